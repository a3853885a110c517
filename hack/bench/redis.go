package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// packetAmount is every benchmark packet's amount, in minor units.
const packetAmount = 100

// seedActivity seeds count packets of packetAmount into the activity uid on c and
// opens it. It returns how long the seeding (staging and commit) took.
func seedActivity(ctx context.Context, c redis.Cmdable, uid string, count int64) (time.Duration, error) {
	amounts := make([]int64, count)
	for i := range amounts {
		amounts[i] = packetAmount
	}
	a := store.NewActivity(c, uid, 1)
	start := time.Now()
	res, err := a.Seed(ctx, amounts, store.SeedParams{Count: count, Total: count * packetAmount, Sponsor: "bench"})
	if err != nil {
		return 0, fmt.Errorf("seeding %s: %w", uid, err)
	}
	took := time.Since(start)
	if !res.Committed {
		return 0, fmt.Errorf("seeding %s: already committed", uid)
	}
	state, err := a.Configure(ctx, 0, 0, false, true)
	if err != nil {
		return 0, fmt.Errorf("opening %s: %w", uid, err)
	}
	if state.State != store.StateOpen {
		return 0, fmt.Errorf("opening %s: state %q", uid, state.State)
	}
	return took, nil
}

// redisBenchmark runs redis-benchmark against the grab function, called as the grab
// service calls it: FCALL with the activity's four keys and a random user id after
// the prefix users per call.
func redisBenchmark(ctx context.Context, srv *redistest.Server, k store.Keys, users string, pipeline, clients, requests int) (latencies, error) {
	return benchmarkScript(ctx, srv, grabCall(), []string{k.Meta, k.Packets, k.Claims, k.Stream}, users, pipeline, clients, requests)
}

// grabCall is the command and function name of the grab as the grab service sends
// it: FCALL of the grab function of the library the benchmark loaded (lua.LoadAll).
func grabCall() [2]string { return [2]string{"FCALL", lua.GrabScript.Function()} }

// evalsha is the command and digest of a cached script's call.
func evalsha(sha string) [2]string { return [2]string{"EVALSHA", sha} }

// benchmarkScript runs redis-benchmark -P pipeline of call (FCALL function or
// EVALSHA sha) with keys, a random
// user id after the prefix users and then extra arguments. redis-benchmark seeds
// random() with the time in seconds XOR its pid, so two runs a few seconds apart can
// draw the same user ids (one such run granted nothing, every call a repeat): every
// run that must grant needs a prefix of its own.
func benchmarkScript(ctx context.Context, srv *redistest.Server, call [2]string, keys []string, users string, pipeline, clients, requests int, extra ...string) (latencies, error) {
	host, port, err := net.SplitHostPort(srv.Addr)
	if err != nil {
		return latencies{}, fmt.Errorf("splitting %s: %w", srv.Addr, err)
	}
	// The server refuses the default user: redis-benchmark logs in as the admin user.
	args := []string{"-h", host, "-p", port, "--user", srv.Username, "-a", srv.Password, "-c", strconv.Itoa(clients), "-n", strconv.Itoa(requests),
		"-P", strconv.Itoa(pipeline), "-r", "1000000000", "--csv", call[0], call[1], strconv.Itoa(len(keys))}
	args = append(args, keys...)
	args = append(args, users+"__rand_int__")
	args = append(args, extra...)
	cmd := exec.CommandContext(ctx, "redis-benchmark", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	start := time.Now()
	out, err := cmd.Output()
	elapsed := time.Since(start)
	if err != nil {
		return latencies{}, fmt.Errorf("redis-benchmark: %w: %s", err, stderr.String())
	}
	return parseBenchmarkCSV(out, int64(requests), elapsed)
}

// parseBenchmarkCSV reads redis-benchmark's --csv output: a header line and one line
// per test with rps and latency columns in milliseconds.
func parseBenchmarkCSV(out []byte, requests int64, elapsed time.Duration) (latencies, error) {
	rows, err := csv.NewReader(bytes.NewReader(out)).ReadAll()
	if err != nil {
		return latencies{}, fmt.Errorf("reading redis-benchmark output %q: %w", out, err)
	}
	if len(rows) < 2 {
		return latencies{}, fmt.Errorf("redis-benchmark printed no result: %q", out)
	}
	col := map[string]int{}
	for i, h := range rows[0] {
		col[h] = i
	}
	row := rows[len(rows)-1]
	get := func(name string) (float64, error) {
		i, ok := col[name]
		if !ok || i >= len(row) {
			return 0, fmt.Errorf("redis-benchmark output lacks %s: %q", name, out)
		}
		v, err := strconv.ParseFloat(row[i], 64)
		if err != nil {
			return 0, fmt.Errorf("redis-benchmark %s %q: %w", name, row[i], err)
		}
		return v, nil
	}
	rps, err := get("rps")
	if err != nil {
		return latencies{}, err
	}
	ms := func(name string) (time.Duration, error) {
		v, err := get(name)
		return time.Duration(v * float64(time.Millisecond)), err
	}
	p50, err := ms("p50_latency_ms")
	if err != nil {
		return latencies{}, err
	}
	p99, err := ms("p99_latency_ms")
	if err != nil {
		return latencies{}, err
	}
	maxl, err := ms("max_latency_ms")
	if err != nil {
		return latencies{}, err
	}
	// redis-benchmark's own rate excludes its start-up; keep its figure.
	return latencies{Requests: requests, Elapsed: time.Duration(float64(requests) / rps * float64(time.Second)),
		P50: p50, P99: p99, Max: maxl}, nil
}

// goClaims is the project's claim path from Go: workers goroutines grab through the
// activity's handle a (on a plain or auto-pipelining client), each with a fresh user
// id, for dur or until max calls.
func goClaims(ctx context.Context, a *store.Shard, prefix string, workers int, dur time.Duration, max int64) (latencies, error) {
	l, firstErr, err := closedLoop(ctx, workers, dur, max, func(_ context.Context, i int64) (string, error) {
		user := prefix + strconv.FormatInt(i, 10)
		// The call runs on ctx, not the run's context, so the end of the run never
		// cuts a claim in half on the client side; the client's socket timeouts
		// bound it. No deadline of its own either: a timer per call is load
		// generator work redis-benchmark does not do.
		res, err := a.Grab(ctx, user)
		if err != nil {
			return "", err
		}
		return string(res.Outcome), nil
	})
	if err != nil {
		return latencies{}, err
	}
	if l.Errors > 0 {
		return l, fmt.Errorf("%d of %d claims failed, first: %w", l.Errors, l.Requests+l.Errors, firstErr)
	}
	return l, nil
}
