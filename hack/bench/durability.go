package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// durabilityRun is the grab path's rate under each durability mode, each on its own
// redis-server(s) started for it, in the same run.
type durabilityRun struct {
	none, fsync, replicas latencies
	workers               int
	dur                   time.Duration
}

// measureDurability grabs for dur with workers goroutines through the grab
// service's auto-pipeliner in each mode: None (no AOF), Fsync (appendonly yes,
// appendfsync always, on this machine's disk) and Replicas with 1 replica (each
// grant waits for a batched WAIT 1 before it counts).
func measureDurability(ctx context.Context, work string, workers int, dur time.Duration, packets int64) (durabilityRun, error) {
	r := durabilityRun{workers: workers, dur: dur}
	var err error
	fmt.Printf("(h) durability None, %d goroutines, %s ... ", workers, dur)
	if r.none, err = durabilityMode(ctx, filepath.Join(work, "none"), nil, false, workers, dur, packets); err != nil {
		return r, err
	}
	fmt.Println(rateLine(r.none))
	fmt.Printf("(h) durability Fsync (appendfsync always), %d goroutines, %s ... ", workers, dur)
	if r.fsync, err = durabilityMode(ctx, filepath.Join(work, "fsync"), []string{"--appendonly", "yes", "--appendfsync", "always"}, false, workers, dur, packets); err != nil {
		return r, err
	}
	fmt.Println(rateLine(r.fsync))
	fmt.Printf("(h) durability Replicas 1 (WAIT 1, batched), %d goroutines, %s ... ", workers, dur)
	if r.replicas, err = durabilityMode(ctx, filepath.Join(work, "replicas"), nil, true, workers, dur, packets); err != nil {
		return r, err
	}
	fmt.Println(rateLine(r.replicas))
	return r, nil
}

// durabilityMode starts a redis-server with args (and a replica of it when
// withReplica), seeds packets and runs the grab loop, waiting for the replica after
// each grant when there is one.
func durabilityMode(ctx context.Context, dir string, args []string, withReplica bool, workers int, dur time.Duration, packets int64) (latencies, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return latencies{}, err
	}
	srv, err := redistest.StartProcess(dir, args...)
	if err != nil {
		return latencies{}, err
	}
	defer srv.Stop()
	conn := srv.Conn()
	gc, err := conn.NewPipelinedClient(redisconn.GrabClientOptions(grabsvc.DefaultRedisTimeout))
	if err != nil {
		return latencies{}, err
	}
	defer func() { _ = gc.Close() }()
	if err := lua.LoadAll(ctx, gc.Client); err != nil {
		return latencies{}, fmt.Errorf("loading the scripts: %w", err)
	}
	var waiter *store.ReplicaWaiter
	if withReplica {
		rdir := dir + "-replica"
		if err := os.MkdirAll(rdir, 0o755); err != nil {
			return latencies{}, err
		}
		replica, err := redistest.StartReplicaProcess(rdir, srv, "")
		if err != nil {
			return latencies{}, err
		}
		defer replica.Stop()
		h := store.NewActivity(gc.Client, "bench-durable", 1).Shard(0)
		deadline := time.Now().Add(10 * time.Second)
		for h.CheckReplicas(ctx, 1) != nil {
			if time.Now().After(deadline) {
				return latencies{}, fmt.Errorf("the replica did not connect")
			}
			time.Sleep(20 * time.Millisecond)
		}
		waiter = h.ReplicaWaiter(1, time.Second)
		defer waiter.Close()
	}
	// Seeding gets a client of its own with a long deadline, as the controller's
	// seeding does: with appendfsync always a chunk of 10,000 packets can take longer
	// than the grab path's 500 ms.
	sc := conn.NewClient(redisconn.ClientOptions{Timeout: 30 * time.Second})
	_, err = seedActivity(ctx, sc, "bench-durable", packets)
	_ = sc.Close()
	if err != nil {
		return latencies{}, err
	}
	if waiter != nil {
		// Let the replica catch up with the seeding before the clock starts.
		catchUp := store.NewActivity(gc.Client, "bench-durable", 1).Shard(0).ReplicaWaiter(1, time.Minute)
		err := catchUp.Wait(ctx)
		_ = catchUp.Close()
		if err != nil {
			return latencies{}, fmt.Errorf("the replica did not catch up with the seeding: %w", err)
		}
	}
	a := store.NewActivity(gc.Pipeliner, "bench-durable", 1).Shard(0)
	l, firstErr, err := closedLoop(ctx, workers, dur, packets, func(_ context.Context, i int64) (string, error) {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		res, err := a.Grab(cctx, "d:"+strconv.FormatInt(i, 10))
		if err != nil {
			return "", err
		}
		if waiter != nil && res.Outcome == store.Granted {
			if err := waiter.Wait(cctx); err != nil {
				return "", err
			}
		}
		return string(res.Outcome), nil
	})
	if err != nil {
		return latencies{}, err
	}
	if l.Errors > 0 {
		return l, fmt.Errorf("%d grabs failed, first: %w", l.Errors, firstErr)
	}
	return l, checkGranted("durability run", l)
}

// summary is the durability lines of the closing block.
func (d durabilityRun) summary() string {
	return fmt.Sprintf("(h) durability: None %.0f grants/s; Fsync %.0f (ratio %.2f); Replicas 1 %.0f (ratio %.2f)\n",
		d.none.Rate(), d.fsync.Rate(), ratio(d.fsync.Rate(), d.none.Rate()), d.replicas.Rate(), ratio(d.replicas.Rate(), d.none.Rate()))
}

// markdown is the durability section of docs/benchmarks.md.
func (d durabilityRun) markdown() string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	p("## Durability modes\n\n")
	p("The grab path (store.Grab through the grab service's auto-pipeliner, %d goroutines, %s each) on a\n", d.workers, d.dur)
	p("redis-server of its own per mode, in the same run. Fsync runs with `appendonly yes` and\n")
	p("`appendfsync always` on this machine's disk; Replicas 1 waits after each grant for a batched\n")
	p("`WAIT 1` (store.ReplicaWaiter) on a primary with one replica on the same machine.\n\n")
	p("| mode | grants/s | p50 | p99 | ratio to None |\n|---|---:|---:|---:|---:|\n")
	row := func(name string, l latencies) {
		p("| %s | %.0f | %s | %s | %.2f |\n", name, l.Rate(), fmtDur(l.P50), fmtDur(l.P99), ratio(l.Rate(), d.none.Rate()))
	}
	row("None", d.none)
	row("Fsync", d.fsync)
	row("Replicas 1", d.replicas)
	p("\n")
	return b.String()
}
