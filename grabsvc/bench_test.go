package grabsvc

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"os/exec"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// Load shapes shared by the benchmarks, so their figures compare in one run:
//
//	go test ./grabsvc -run '^$' -bench 'ClaimPath|HTTPClaim|NoopHTTP|RedisBenchmarkP16'
//
// ClaimPath / RedisBenchmarkP16 is the Redis claim path against redis-benchmark -P 16
// of the same script; HTTPClaim / NoopHTTP is the HTTP claim path against a no-op Go
// handler under the same load generator.
const (
	// claimGoroutines are the concurrent callers of the Redis claim path: as many
	// calls in flight as redis-benchmark keeps (connections × pipeline depth), as
	// both are closed loops.
	claimGoroutines = rbClients * rbPipeline
	// httpClients are the concurrent keep-alive HTTP clients.
	httpClients = 64
	// rbClients and rbPipeline are redis-benchmark's -c and -P.
	rbClients  = 50
	rbPipeline = 16
)

// benchRedis starts a redis-server with an open activity of n packets and the
// scripts loaded.
func benchRedis(b *testing.B, n int) (*redisconn.PipelinedClient, *Resource, *redistest.Server) {
	b.Helper()
	srv := redistest.Start(b)
	rc, err := srv.Conn().NewPipelinedClient(redisconn.GrabClientOptions(5 * time.Second))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = rc.Close() })
	act := testActivity("bench")
	seed(b, rc.Client, act, ones(n), 0, 0, false)
	if err := lua.LoadAll(context.Background(), rc.Client); err != nil {
		b.Fatal(err)
	}
	return rc, act, srv
}

// parallelism makes RunParallel use about want goroutines.
func parallelism(want int) int {
	return max(1, want/runtime.GOMAXPROCS(0))
}

func reportRate(b *testing.B, unit string) {
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), unit)
}

// checkGranted verifies that the run granted n packets.
func checkGranted(b *testing.B, rc *redisconn.PipelinedClient, act *Resource, n int64) {
	b.Helper()
	snap, err := handleOf(rc.Client, act).Snapshot(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	if snap.ClaimedCount != n {
		b.Fatalf("%d packets claimed, want %d", snap.ClaimedCount, n)
	}
}

// BenchmarkClaimPath runs the shard's Grab through the auto-pipeliner from many goroutines,
// every call a grant to a new user.
func BenchmarkClaimPath(b *testing.B) {
	rc, act, _ := benchRedis(b, b.N+100)
	var next atomic.Int64
	ctx := context.Background()
	b.SetParallelism(parallelism(claimGoroutines))
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			user := "u" + strconv.FormatInt(next.Add(1), 10)
			res, err := handleOf(rc.Pipeliner, act).Shard(0).Grab(ctx, user)
			if err != nil || res.Outcome != store.Granted {
				b.Errorf("grab for %s: %+v %v", user, res, err)
				return
			}
		}
	})
	b.StopTimer()
	reportRate(b, "grabs/s")
	checkGranted(b, rc, act, int64(b.N))
}

// BenchmarkRedisBenchmarkP16 runs redis-benchmark -P 16 of the same grab script
// (EVALSHA with the activity's four keys and random user ids) for b.N requests, as
// the ceiling of what one redis-server does with the script.
func BenchmarkRedisBenchmarkP16(b *testing.B) {
	bin, err := exec.LookPath("redis-benchmark")
	if err != nil {
		b.Fatalf("redis-benchmark is not installed: %v", err)
	}
	rc, act, srv := benchRedis(b, b.N+100)
	host, port, _ := net.SplitHostPort(srv.Addr)
	k := keysOf(act)
	args := []string{"-h", host, "-p", port, "--user", srv.Username, "-a", srv.Password,
		"-n", strconv.Itoa(b.N), "-c", strconv.Itoa(rbClients),
		"-P", strconv.Itoa(rbPipeline), "-r", "100000000", "-q",
		"FCALL", lua.GrabScript.Function(), "4", k.Meta, k.Packets, k.Claims, k.Stream, "u:__rand_int__"}
	b.ResetTimer()
	out, err := exec.Command(bin, args...).CombinedOutput()
	b.StopTimer()
	if err != nil {
		b.Fatalf("redis-benchmark: %v: %s", err, out)
	}
	reportRate(b, "grabs/s")
	// Random user ids can repeat (already_claimed); nearly every call must grant.
	snap, err := handleOf(rc.Client, act).Snapshot(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	if snap.ClaimedCount < int64(b.N)*99/100 {
		b.Fatalf("redis-benchmark claimed %d packets for %d requests: %s", snap.ClaimedCount, b.N, out)
	}
}

// benchHTTP serves h on loopback with the grab service's server settings and runs
// b.N POSTs of a fresh user id from httpClients keep-alive clients.
func benchHTTP(b *testing.B, h http.Handler) {
	hs := NewHTTPServer("127.0.0.1:0", h)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go func() { _ = hs.Serve(ln) }()
	b.Cleanup(func() { _ = hs.Close() })
	url := "http://" + ln.Addr().String() + "/v1/grab"
	tr := &http.Transport{MaxIdleConns: httpClients * 2, MaxIdleConnsPerHost: httpClients * 2, DisableCompression: true}
	b.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr}
	var next atomic.Int64
	b.SetParallelism(parallelism(httpClients))
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		body := make([]byte, 0, 64)
		for pb.Next() {
			body = append(body[:0], `{"userId":"h`...)
			body = strconv.AppendInt(body, next.Add(1), 10)
			body = append(body, `"}`...)
			resp, err := c.Post(url, "application/json", bytes.NewReader(body))
			if err != nil {
				b.Errorf("POST: %v", err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b.Errorf("POST: %s", resp.Status)
				return
			}
		}
	})
	b.StopTimer()
	reportRate(b, "req/s")
}

// BenchmarkHTTPClaim is the real grab handler over loopback HTTP: each request a
// grant to a new user.
func BenchmarkHTTPClaim(b *testing.B) {
	rc, act, _ := benchRedis(b, b.N+100)
	srv, err := NewServer(Config{
		Redis:    rc.Pipeliner,
		Resource: func() *Resource { return act },
		Metrics:  NewMetrics(prometheus.NewRegistry()),
	})
	if err != nil {
		b.Fatal(err)
	}
	benchHTTP(b, srv.Handler())
	checkGranted(b, rc, act, int64(b.N))
}

// BenchmarkNoopHTTP is a Go handler that reads the request and answers a grant of
// the same size without deciding anything, under the same load as HTTPClaim.
func BenchmarkNoopHTTP(b *testing.B) {
	var n atomic.Int64
	answer := []byte(`{"outcome":"granted","packetId":"1","amount":7}` + "\n")
	benchHTTP(b, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, MaxBodyBytes))
		n.Add(1)
		h := w.Header()
		h.Set("Content-Type", "application/json")
		h.Set("Content-Length", strconv.Itoa(len(answer)))
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(answer)
	}))
	if n.Load() < int64(b.N) {
		b.Fatalf("%d requests served, want %d", n.Load(), b.N)
	}
}
