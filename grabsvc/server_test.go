package grabsvc

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// serveOn serves hs on a loopback port until the test ends and returns the address.
func serveOn(t *testing.T, hs *http.Server) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close() })
	return ln.Addr().String()
}

// counterValue reads one sample of a counter from the registry.
func counterValue(t testing.TB, g prometheus.Gatherer, name, label, value string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gathering metrics: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if hasLabel(m, label, value) {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func hasLabel(m *dto.Metric, label, value string) bool {
	if label == "" {
		return true
	}
	for _, lp := range m.GetLabel() {
		if lp.GetName() == label && lp.GetValue() == value {
			return true
		}
	}
	return false
}

func TestActivityEndpoint(t *testing.T) {
	h := newHarness(t)
	act := testActivity("view")
	start := time.Now().Add(-time.Minute).Truncate(time.Second)
	end := time.Now().Add(time.Hour).Truncate(time.Second)
	act.Object.Spec.Currency = "USD"
	act.Object.Spec.TotalAmount, act.Object.Spec.Count = 28, 7
	h.useActivity(act, ones(7), start.UnixMilli(), end.UnixMilli(), false)
	for _, u := range []string{"a", "b"} {
		if r := h.grab(u, nil); r.Status != 200 {
			t.Fatalf("grab: %s", r.Raw)
		}
	}
	get := func() ActivityView {
		resp, err := http.Get(h.http.URL + "/v1/activity")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("GET /v1/activity: %d", resp.StatusCode)
		}
		var raw map[string]any
		body, _ := io.ReadAll(resp.Body)
		if err := json.Unmarshal(body, &raw); err != nil {
			t.Fatal(err)
		}
		for _, f := range []string{"namespace", "name", "phase", "totalAmount", "count", "remainingCount",
			"remainingAmount", "claimedCount", "claimedAmount", "startTime", "endTime", "currency"} {
			if _, ok := raw[f]; !ok {
				t.Fatalf("GET /v1/activity lacks %q: %s", f, body)
			}
		}
		var v ActivityView
		if err := json.Unmarshal(body, &v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	v := get()
	want := ActivityView{Namespace: "default", Name: "view", Phase: "Active", TotalAmount: 28, Count: 7,
		RemainingCount: 5, RemainingAmount: 25, ClaimedCount: 2, ClaimedAmount: 3,
		StartTime: rfc3339(start), EndTime: rfc3339(end), Currency: "USD"}
	if v.StartTime == nil || v.EndTime == nil || *v.StartTime != *want.StartTime || *v.EndTime != *want.EndTime {
		t.Fatalf("window %v..%v, want %s..%s", v.StartTime, v.EndTime, *want.StartTime, *want.EndTime)
	}
	v.StartTime, v.EndTime, want.StartTime, want.EndTime = nil, nil, nil, nil
	if v != want {
		t.Fatalf("activity view\n got %+v\nwant %+v", v, want)
	}
	if _, err := handleOf(h.admin, act).Configure(context.Background(), start.UnixMilli(), end.UnixMilli(), true, true); err != nil {
		t.Fatal(err)
	}
	if v := get(); v.Phase != "Paused" || !v.Paused {
		t.Fatalf("paused activity: %+v", v)
	}
	if _, err := handleOf(h.admin, act).Close(context.Background(), store.CloseExpired); err != nil {
		t.Fatal(err)
	}
	v = get()
	if v.Phase != "Expired" || v.RemainingAmount != 0 || v.RefundedAmount != 25 || v.ClaimedAmount+v.RemainingAmount+v.RefundedAmount != v.TotalAmount {
		t.Fatalf("expired activity: %+v", v)
	}
	if r := h.do("POST", "/v1/activity", "", nil); r.Status != http.StatusMethodNotAllowed {
		t.Fatalf("POST /v1/activity: %d", r.Status)
	}
	// No window: the times are null, and the phase is Active.
	h.useActivity(testActivity("open-ended"), ones(2), 0, 0, false)
	r := h.do("GET", "/v1/activity", "", nil)
	if !strings.Contains(r.Raw, `"startTime":null`) || !strings.Contains(r.Raw, `"endTime":null`) ||
		!strings.Contains(r.Raw, `"phase":"Active"`) || !strings.Contains(r.Raw, `"currency":"CNY"`) {
		t.Fatalf("open-ended activity: %s", r.Raw)
	}
}

func TestDerivePhase(t *testing.T) {
	now := time.UnixMilli(1_000_000)
	o := &redpacketv1alpha1.RedPacketActivity{}
	o.Status.Phase = redpacketv1alpha1.PhaseSeeding
	cases := []struct {
		snap store.Snapshot
		want redpacketv1alpha1.Phase
	}{
		{store.Snapshot{}, redpacketv1alpha1.PhaseSeeding},
		{store.Snapshot{State: store.StateReady}, redpacketv1alpha1.PhaseSeeding},
		{store.Snapshot{State: store.StateOpen, RemainingCount: 3}, redpacketv1alpha1.PhaseActive},
		{store.Snapshot{State: store.StateOpen, RemainingCount: 3, StartMs: 2_000_000}, redpacketv1alpha1.PhaseScheduled},
		{store.Snapshot{State: store.StateOpen, RemainingCount: 3, EndMs: 900_000}, redpacketv1alpha1.PhaseExpired},
		{store.Snapshot{State: store.StateOpen, RemainingCount: 3, Paused: true}, redpacketv1alpha1.PhasePaused},
		{store.Snapshot{State: store.StateOpen}, redpacketv1alpha1.PhaseExhausted},
		{store.Snapshot{State: store.StateClosed, CloseReason: store.CloseExhausted}, redpacketv1alpha1.PhaseExhausted},
		{store.Snapshot{State: store.StateClosed, CloseReason: store.CloseExpired}, redpacketv1alpha1.PhaseExpired},
	}
	for _, c := range cases {
		if got := DerivePhase(o, c.snap, now); got != c.want {
			t.Errorf("%+v: phase %s, want %s", c.snap, got, c.want)
		}
	}
	if got := DerivePhase(&redpacketv1alpha1.RedPacketActivity{}, store.Snapshot{}, now); got != redpacketv1alpha1.PhasePending {
		t.Errorf("no snapshot, no status: %s", got)
	}
}

func TestProbesAndMetrics(t *testing.T) {
	h := newHarness(t)
	if r := h.do("GET", "/readyz", "", nil); r.Status != http.StatusServiceUnavailable || !strings.Contains(r.Raw, "not been read") {
		t.Fatalf("readyz before the activity is known: %d %s", r.Status, r.Raw)
	}
	if r := h.do("GET", "/healthz", "", nil); r.Status != http.StatusOK {
		t.Fatalf("healthz: %d", r.Status)
	}
	if r := h.grab("early", nil); r.Status != http.StatusServiceUnavailable || r.Outcome != OutcomeUnavailable {
		t.Fatalf("grab before the activity is known: %d %s", r.Status, r.Raw)
	}
	act := testActivity("probes")
	h.useActivity(act, ones(3), 0, 0, false)
	if r := h.do("GET", "/readyz", "", nil); r.Status != http.StatusOK {
		t.Fatalf("readyz: %d %s", r.Status, r.Raw)
	}
	h.grab("p1", nil)
	h.grab("p1", nil)
	h.do("POST", "/v1/grab", "{", nil)
	resp, err := http.Get(h.http.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	text := string(body)
	for _, want := range []string{
		`redpacket_grab_requests_total{outcome="granted"} 1`,
		`redpacket_grab_requests_total{outcome="already_claimed"} 1`,
		`redpacket_grab_requests_total{outcome="invalid_request"} 1`,
		`redpacket_grab_requests_total{outcome="unavailable"} 1`,
		`redpacket_grab_claim_duration_seconds_count 2`,
		`redpacket_grab_redis_errors_total{op="grab"} 0`,
		`redpacket_grab_report_lag_seconds`,
		`redpacket_grab_report_failures_total{stage="apply"} 0`,
		`go_goroutines`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if r := h.do("GET", "/nope", "", nil); r.Status != http.StatusNotFound {
		t.Fatalf("unknown path: %d", r.Status)
	}
}

// TestScriptFlushDuringBurst flushes the script cache while concurrent grabs run
// through the auto-pipeliner: the grab is an FCALL of the function library, which
// SCRIPT FLUSH does not touch, so every grab answers and the grab path never sends
// EVAL.
func TestScriptFlushDuringBurst(t *testing.T) {
	t.Run("standalone", func(t *testing.T) {
		srv := redistest.Start(t)
		rc, err := srv.Conn().NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
		if err != nil {
			t.Fatal(err)
		}
		defer rc.Close()
		admin := srv.Client(t)
		flushDuringBurst(t, rc, func(ctx context.Context) error { return admin.ScriptFlush(ctx).Err() },
			func() int64 { return evalCalls(t, admin) })
	})
	t.Run("cluster", func(t *testing.T) {
		cl := redistest.StartCluster(t, 3)
		rc, err := cl.Conn().NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
		if err != nil {
			t.Fatal(err)
		}
		defer rc.Close()
		admin := cl.Client(t)
		flushDuringBurst(t, rc, func(ctx context.Context) error {
			return admin.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error {
				return n.ScriptFlush(ctx).Err()
			})
		}, func() int64 {
			var sum atomic.Int64
			_ = admin.ForEachMaster(context.Background(), func(ctx context.Context, n *redis.Client) error {
				sum.Add(evalCalls(t, n))
				return nil
			})
			return sum.Load()
		})
	})
}

// evalCalls is how many plain EVAL calls (the NOSCRIPT fallback) a server has run.
func evalCalls(t testing.TB, c *redis.Client) int64 {
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Errorf("info commandstats: %v", err)
		return 0
	}
	for _, line := range strings.Split(info, "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_eval:"); ok {
			var n int64
			if _, err := fmt.Sscanf(rest, "calls=%d", &n); err == nil {
				return n
			}
		}
	}
	return 0
}

func flushDuringBurst(t *testing.T, rc *redisconn.PipelinedClient, flush func(context.Context) error, evals func() int64) {
	const (
		workers   = 32
		perWorker = 60
		packets   = workers*perWorker - 100 // some grabs find it sold out
	)
	ctx := context.Background()
	act := testActivity("flush")
	amounts := ones(packets)
	var total int64
	for _, a := range amounts {
		total += a
	}
	seed(t, rc.Client, act, amounts, 0, 0, false)
	if err := lua.LoadAll(ctx, rc.Client); err != nil {
		t.Fatal(err)
	}

	var (
		wg       sync.WaitGroup
		started  = make(chan struct{})
		mu       sync.Mutex
		byPacket = map[string]string{}
		errs     []error
		soldOut  atomic.Int64
		sum      atomic.Int64
		done     atomic.Int64
	)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-started
			for i := 0; i < perWorker; i++ {
				user := fmt.Sprintf("w%d-u%d", w, i)
				res, err := handleOf(rc.Pipeliner, act).Shard(0).Grab(ctx, user)
				done.Add(1)
				mu.Lock()
				switch {
				case err != nil:
					errs = append(errs, err)
				case res.Outcome == store.Granted:
					if prev, dup := byPacket[res.PacketID]; dup {
						errs = append(errs, fmt.Errorf("packet %s granted to %s and %s", res.PacketID, prev, user))
					}
					byPacket[res.PacketID] = user
					sum.Add(res.Amount)
				case res.Outcome == store.SoldOut:
					soldOut.Add(1)
				default:
					errs = append(errs, fmt.Errorf("outcome %s for %s", res.Outcome, user))
				}
				mu.Unlock()
			}
		}()
	}
	evalsBefore := evals()
	close(started)
	flushes := 0
	for done.Load() < workers*perWorker*8/10 {
		if done.Load() > int64(flushes)*workers*perWorker/8 {
			if err := flush(ctx); err != nil {
				t.Fatalf("script flush: %v", err)
			}
			flushes++
		}
		time.Sleep(time.Millisecond)
	}
	wg.Wait()
	for _, err := range errs {
		t.Error(err)
	}
	if flushes < 3 {
		t.Fatalf("only %d flushes happened during the burst", flushes)
	}
	evalsSent := evals() - evalsBefore
	t.Logf("%d script flushes, %d EVALs", flushes, evalsSent)
	if evalsSent != 0 {
		t.Fatalf("%d EVALs during the burst: the grab path must only FCALL", evalsSent)
	}
	snap, err := handleOf(rc.Client, act).Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	xlen, err := rc.Client.XLen(ctx, keysOf(act).Stream).Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(byPacket) != packets || snap.ClaimedCount != packets || snap.RemainingCount != 0 || xlen != packets ||
		snap.ClaimedAmount != total || sum.Load() != total || soldOut.Load() != workers*perWorker-packets {
		t.Fatalf("after %d flushes: %d grants (sum %d), %d sold out, snapshot %+v, stream %d; want %d grants summing to %d",
			flushes, len(byPacket), sum.Load(), soldOut.Load(), snap, xlen, packets, total)
	}
}

func TestGracefulShutdownFinishesInFlightClaims(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.RedisTimeout = 5 * time.Second })
	act := testActivity("shutdown")
	h.useActivity(act, ones(5), 0, 0, false)
	hs := NewHTTPServer("127.0.0.1:0", h.srv.Handler())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	base := "http://" + ln.Addr().String()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, hs, ln, h.srv, 400*time.Millisecond, 10*time.Second) }()
	wait.Until(t, 5*time.Second, "readiness", func() (bool, string) {
		resp, err := http.Get(base + "/readyz")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		return resp.StatusCode == 200, resp.Status
	})

	// Hold Redis for a while so the claim is in flight during the shutdown.
	if err := h.admin.Do(context.Background(), "CLIENT", "PAUSE", "1500", "ALL").Err(); err != nil {
		t.Fatal(err)
	}
	type result struct {
		r   reply
		at  time.Time
		err error
	}
	inflight := make(chan result, 1)
	go func() {
		resp, err := http.Post(base+"/v1/grab", "application/json", strings.NewReader(`{"userId":"slow"}`))
		if err != nil {
			inflight <- result{err: err}
			return
		}
		defer resp.Body.Close()
		var r reply
		r.Status = resp.StatusCode
		err = json.NewDecoder(resp.Body).Decode(&r)
		inflight <- result{r: r, at: time.Now(), err: err}
	}()
	time.Sleep(150 * time.Millisecond) // let the request reach Redis
	stop()

	// Readiness fails first, while the claim is still in flight.
	var notReadyAt time.Time
	wait.Until(t, 2*time.Second, "readiness to fail", func() (bool, string) {
		resp, err := http.Get(base + "/readyz")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		notReadyAt = time.Now()
		return resp.StatusCode == http.StatusServiceUnavailable, resp.Status
	})
	res := <-inflight
	if res.err != nil {
		t.Fatalf("in-flight claim: %v", res.err)
	}
	if res.r.Status != 200 || res.r.Outcome != OutcomeGranted || res.r.PacketID == "" {
		t.Fatalf("in-flight claim answered %d %+v, want 200 granted", res.r.Status, res.r)
	}
	if !notReadyAt.Before(res.at) {
		t.Fatalf("readiness failed at %s, after the claim finished at %s", notReadyAt, res.at)
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if _, err := http.Get(base + "/healthz"); err == nil {
		t.Fatal("the server still accepts connections after shutdown")
	}
	if got := h.state(act).Claims; got != 1 {
		t.Fatalf("claims after shutdown: %d, want 1", got)
	}
}

func TestRestarter(t *testing.T) {
	var r Restarter
	var runs, running atomic.Int32
	task := func(ctx context.Context) {
		runs.Add(1)
		running.Add(1)
		<-ctx.Done()
		running.Add(-1)
	}
	ctx := context.Background()
	r.Set(ctx, "a", task)
	r.Set(ctx, "a", task)
	wait.Until(t, time.Second, "one run", func() (bool, string) { return runs.Load() == 1 && running.Load() == 1, "" })
	r.Set(ctx, "b", task)
	wait.Until(t, time.Second, "the restart", func() (bool, string) { return runs.Load() == 2, "" })
	if running.Load() != 1 || r.Key() != "b" {
		t.Fatalf("after a new key: %d running, key %q", running.Load(), r.Key())
	}
	// A task that ends by itself is started again on the next Set.
	r.Set(ctx, "c", func(context.Context) { runs.Add(1) })
	wait.Until(t, time.Second, "the short task", func() (bool, string) { return runs.Load() == 3 && r.Key() == "", "" })
	r.Set(ctx, "c", func(context.Context) { runs.Add(1) })
	wait.Until(t, time.Second, "the rerun", func() (bool, string) { return runs.Load() == 4, "" })
	r.Set(ctx, "", nil)
	if running.Load() != 0 || r.Key() != "" {
		t.Fatalf("after stop: %d running, key %q", running.Load(), r.Key())
	}
	r.Set(ctx, "d", task)
	r.Stop()
	if running.Load() != 0 {
		t.Fatal("Stop left the task running")
	}
}

func TestTokens(t *testing.T) {
	key := []byte("k")
	v, err := NewTokenVerifier(key)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1_700_000_000, 0)
	v.Now = func() time.Time { return now }
	aud := TokenAudience{Activity: "ns/a", UID: "uid-a"}
	tok, err := SignToken(key, TokenClaims{UserID: "u", Activity: "ns/a", ActivityUID: "uid-a", Exp: now.Unix() + 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := v.Verify("Bearer "+tok, aud, "u"); err != nil {
		t.Fatalf("valid token: %v", err)
	}
	// Padded base64url is accepted too.
	p, s, _ := strings.Cut(tok, ".")
	pad := func(x string) string { return x + strings.Repeat("=", (4-len(x)%4)%4) }
	if err := v.Verify("Bearer "+pad(p)+"."+pad(s), aud, "u"); err != nil {
		t.Fatalf("padded token: %v", err)
	}
	// Exactly at exp the token is expired.
	now = now.Add(time.Second)
	if err := v.Verify("Bearer "+tok, aud, "u"); err != ErrTokenExpired {
		t.Fatalf("token at exp: %v", err)
	}
	// A rotated key refuses old tokens.
	now = now.Add(-time.Second)
	if err := v.SetKey([]byte("k2")); err != nil {
		t.Fatal(err)
	}
	if err := v.Verify("Bearer "+tok, aud, "u"); err != ErrTokenSignature {
		t.Fatalf("token after key rotation: %v", err)
	}
	if _, err := NewTokenVerifier(nil); err == nil {
		t.Fatal("empty key accepted")
	}
}

// activityForStatus is a RedPacketActivity as the API server accepts it.
func activityForStatus(ns, name string, count, total int64) *redpacketv1alpha1.RedPacketActivity {
	return &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			TotalAmount:  total,
			Count:        count,
			Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionFixed, MinAmount: 1},
			Sponsor:      "sponsor-1",
		},
	}
}
