// Command bench measures the grab path in one run, on loopback, against a
// redis-server it starts itself:
//
//	(a) the grab script through redis-benchmark at -P 1 and -P 16;
//	(b) the project's claim path from Go (store.Grab) through go-redis auto-pipelining;
//	(c) the HTTP claim path (the grab service binary) under a Go load generator,
//	(d) against a no-op Go HTTP handler under the same load;
//	(e) seeding 1,000,000 packets;
//	(f) Redis memory per claimed packet;
//	(g) settlement: 100,000 grants to a healthy balance system, 10,000 under a failing one,
//	    each against a plain HTTP client's reference, and 100,000 refunds of a budget's
//	    packets expiring in the same second;
//	(h) the grab path under each durability mode (None, Fsync, Replicas 1);
//	(i) our grab script against seed article 000's, through redis-benchmark -P 16;
//	(j) one activity over one master and over two (spec.shards), and a model of more;
//	(k) splitting and seeding 10,000,000 packets, the CRD's limit;
//	(l) runtime packets of a budget: created/s and grabs/s through one grab service in
//	    budget mode, Redis memory per live 5-share packet, and the resource path in the
//	    same run: activities of 5 packets made Active per second by the operator; and
//	    created/s with the budget's quotas on ÷ off, with the bytes of quota state per
//	    sender and per recipient; and grabs/s with a stuck events receiver ÷ without
//	    events;
//	(m) the reference balance system: 100,000 grants booked over HTTP into a PostgreSQL
//	    cluster of its own (fsync on) against plain inserts on the same server;
//	(n) reconciliation: one round for a source of 1,000,000 credits differing from the
//	    reference balance system's book in 10 keys, its time and the operator's heap.
//
// It prints the figures and the ratios b/a(-P16) and c/d, and writes them with the
// machine's details to docs/benchmarks.md. Every loop is bounded by a request count
// and a duration; everything it starts is stopped when it ends.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/redis/go-redis/v9"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/redistest"
)

// options are the benchmark's knobs.
type options struct {
	out          string
	benchClients int
	requestsP1   int
	requestsP16  int
	// seedScriptRequests and seedScriptRounds size the comparison with the seed's
	// script (i).
	seedScriptRequests, seedScriptRounds int
	seedScriptOnly                       bool
	scaleRounds                          int
	claimRounds                          int
	goWorkers                            int
	goDuration                           time.Duration
	goPackets                            int64
	httpClients                          int
	httpClientsHigh                      int
	httpDuration                         time.Duration
	httpWarmup                           time.Duration
	httpPackets                          int64
	seedPackets                          int64
	seedMaxPackets                       int64
	memPackets                           int64
	serveNoop                            string
	skipBuild                            bool

	settleGrants        int
	settleFailingGrants int
	settleCheckGrants   int
	settleProfile       string
	refundPackets       int
	refundLead          time.Duration
	settleTimeout       time.Duration
	settleLimit         time.Duration
	settlementOnly      bool
	failureOnly         bool
	failureRounds       int
	verifyOnly          bool
	scaleOnly           bool
	claimOnly           bool
	httpOnly            bool
	httpRounds          int
	grabProfile         string

	budgetOnly       bool
	quotasOnly       bool
	eventsOnly       bool
	budgetShards     int
	budgetMemPackets int64
	budgetActivities int

	balanceGrants int
	balanceOnly   bool
	// reconcileCredits is the size of the source (n) reconciles; 0 skips it.
	reconcileCredits int
}

func main() {
	var o options
	flag.StringVar(&o.out, "out", "docs/benchmarks.md", "write the results here (relative to the repository root); empty: do not write")
	flag.IntVar(&o.benchClients, "benchmark-clients", 50, "redis-benchmark connections (-c)")
	flag.IntVar(&o.requestsP1, "requests-p1", 200000, "redis-benchmark requests at -P 1")
	flag.IntVar(&o.requestsP16, "requests-p16", 250000, "redis-benchmark requests at -P 16")
	flag.IntVar(&o.seedScriptRequests, "seed-script-requests", 400000, "redis-benchmark requests in each run of the comparison with the seed's script")
	flag.IntVar(&o.seedScriptRounds, "seed-script-rounds", 5, "rounds of the comparison with the seed's script (ours, the seed's, ours with a watermark)")
	flag.IntVar(&o.scaleRounds, "scale-rounds", 5, "rounds of N = 1 and N = 2 over two masters, alternating; the scale ratio is the median round's")
	flag.IntVar(&o.claimRounds, "claim-rounds", 7, "rounds of redis-benchmark -P 16 and the Go claim path, alternating; b/a is the median round's")
	flag.IntVar(&o.goWorkers, "goroutines", 0, "concurrent callers on the Go claim path (0: the calls redis-benchmark keeps in flight at -P 16, -benchmark-clients × 16)")
	flag.DurationVar(&o.goDuration, "go-duration", 2*time.Second, "duration of each Go claim-path run")
	flag.Int64Var(&o.goPackets, "go-packets", 400000, "cap on the grabs of each Go claim-path run (as many packets are seeded per run)")
	flag.IntVar(&o.httpClients, "http-clients", 64, "concurrent keep-alive HTTP clients")
	flag.IntVar(&o.httpClientsHigh, "http-clients-high", 256, "concurrent keep-alive HTTP clients of the second HTTP load (0: none)")
	flag.DurationVar(&o.httpDuration, "http-duration", 3*time.Second, "measured duration of each HTTP run")
	flag.DurationVar(&o.httpWarmup, "http-warmup", time.Second, "unmeasured warm-up before each HTTP run")
	flag.Int64Var(&o.httpPackets, "http-packets", 2000000, "packets seeded for the HTTP claim path (also its request cap)")
	flag.Int64Var(&o.seedPackets, "seed-packets", 1000000, "packets in the seeding measurement")
	flag.Int64Var(&o.seedMaxPackets, "seed-max-packets", 10000000, "packets in the split-and-seed measurement at the CRD's limit (0 skips it)")
	flag.Int64Var(&o.memPackets, "memory-packets", 200000, "packets claimed in the memory measurement")
	flag.StringVar(&o.serveNoop, "serve-noop", "", "internal: serve the no-op handler on this address and nothing else")
	flag.BoolVar(&o.skipBuild, "skip-build", false, "use bin/grabsvc as it is instead of building it")
	flag.IntVar(&o.settleGrants, "settlement-grants", 100000, "grants credited by the healthy settlement run")
	flag.IntVar(&o.settleFailingGrants, "settlement-failing-grants", 10000, "grants credited by the settlement run under the failure mix")
	flag.IntVar(&o.settleCheckGrants, "settlement-check-grants", 2000, "grants credited by each run of the settlement check's cost")
	flag.StringVar(&o.settleProfile, "settlement-cpu-profile", "", "write this process's CPU profile during the healthy settlement run to this file, and during the refunds' to FILE.refunds (go tool pprof FILE)")
	flag.IntVar(&o.refundPackets, "settlement-refund-packets", 100000, "packets of a budget expiring in the same second whose refunds are settled (0 skips it)")
	flag.DurationVar(&o.refundLead, "settlement-refund-lead", 45*time.Second, "how far ahead the refund run's packets are due: creating them must end within it")
	flag.DurationVar(&o.settleTimeout, "settlement-sender-timeout", settlement.DefaultHTTPTimeout, "the settlement worker's HTTP timeout in the failure-mix run (held deliveries are held 1s longer)")
	flag.DurationVar(&o.settleLimit, "settlement-limit", 10*time.Minute, "give a settlement run up this long")
	flag.BoolVar(&o.settlementOnly, "settlement-only", false, "run only the settlement measurements (g): healthy grants, grants under the failure mix, a second's refunds, each with its reference; print them and their section of docs/benchmarks.md, write nothing")
	flag.BoolVar(&o.failureOnly, "settlement-failure-only", false, "run only the settlement measurement under the failure mix (g), -settlement-failure-rounds times, each with its reference; print them, write nothing")
	flag.IntVar(&o.failureRounds, "settlement-failure-rounds", 1, "runs of the failure mix with -settlement-failure-only")
	flag.BoolVar(&o.verifyOnly, "settlement-check-only", false, "run only the cost of the settlement check per entry (g); print it, write nothing")
	flag.BoolVar(&o.seedScriptOnly, "seed-script-only", false, "run only the comparison with the seed's script (i); print it, write nothing")
	flag.BoolVar(&o.scaleOnly, "scale-only", false, "run only the measurement over one and two masters (j); print it, write nothing")
	flag.StringVar(&o.grabProfile, "grab-cpu-profile", "", "write the grab service's CPU profile during (c) at -http-clients to this file (go tool pprof bin/grabsvc FILE)")
	flag.IntVar(&o.httpRounds, "http-rounds", 5, "rounds of (d) and (c), alternating, at each HTTP load; c/d is the median round's")
	flag.BoolVar(&o.httpOnly, "http-only", false, "run only the HTTP measurements, (c) and (d); print them, write nothing")
	flag.BoolVar(&o.claimOnly, "claim-only", false, "run only the claim path, redis-benchmark (a) and Go (b); print them, write nothing")
	flag.BoolVar(&o.budgetOnly, "budget-only", false, "run only the runtime packets of a budget (l); print them, write nothing")
	flag.BoolVar(&o.quotasOnly, "quotas-only", false, "run only the budget quotas' part of (l), created/s with quotas on and off and bytes per sender and recipient; print it and its part of docs/benchmarks.md, write nothing")
	flag.BoolVar(&o.eventsOnly, "events-only", false, "run only the packet events' part of (l), grabs/s of a budget whose events receiver is stuck, of one whose receiver answers and of one without events; print it and its part of docs/benchmarks.md, write nothing")
	flag.IntVar(&o.budgetShards, "budget-shards", 16, "budget shards of the budget in (l)")
	flag.Int64Var(&o.budgetMemPackets, "budget-memory-packets", 20000, "packets of 5 shares created for the memory figures of (l)")
	flag.IntVar(&o.budgetActivities, "budget-activities", 100, "activities of 5 packets made Active by the operator in (l), the resource path its created/s is compared with (0 skips it)")
	flag.IntVar(&o.balanceGrants, "balance-grants", 100000, "grants booked by the reference balance system into PostgreSQL in (m), and plain inserts of its reference (0 skips it)")
	flag.BoolVar(&o.balanceOnly, "balance-only", false, "run only the reference balance system on PostgreSQL (m); print it and its section of docs/benchmarks.md, write nothing")
	flag.IntVar(&o.reconcileCredits, "reconcile-credits", 1_000_000, "credits of the source reconciled in (n) against the reference balance system's book (0 skips it); -balance-only runs it too")
	flag.Parse()
	if o.goWorkers <= 0 {
		// The ratio b/a compares two closed loops, so each gets the same number of
		// calls in flight: redis-benchmark's connections times its pipeline depth.
		o.goWorkers = o.benchClients * 16
	}

	// The local control plane's library logs through controller-runtime; the
	// benchmark prints its own lines only.
	ctrllog.SetLogger(logr.Discard())

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	if o.serveNoop != "" {
		if err := serveNoop(ctx, o.serveNoop); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		return
	}
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// results are every figure of one run.
type results struct {
	machine   machineInfo
	started   time.Time
	took      time.Duration
	rbP1      latencies
	rbP16     latencies
	rbGranted int64
	goPlain   latencies
	goAuto    latencies
	goHalf    latencies
	// claimRounds are the rounds of b/a; rbP16 and goAuto are the median round's.
	claimRounds []claimRound
	httpGrab    latencies
	httpNoop    latencies
	httpHigh    httpPair
	httpLow     httpPair
	seedTook    time.Duration
	seedCount   int64
	mem         memoryFigures
	settle      settlementFigures
	settleCheck verificationRun
	durable     durabilityRun
	seedScript  seedScriptRun
	scale       scaleRun
	seedMax     seedMaxRun
	opts        options
	loadBefore  string
	loadAfter   string
	// budget is (l).
	budget budgetRun
	// balance is (m); zero Grants when skipped.
	balance balanceRun
	// reconcile is (n); zero Credits when skipped.
	reconcile reconcileRun
}

func run(ctx context.Context, o options) error {
	root, err := controlplane.Root()
	if err != nil {
		return fmt.Errorf("finding the repository: %w", err)
	}
	if err := os.Chdir(root); err != nil {
		return fmt.Errorf("entering %s: %w", root, err)
	}
	if o.quotasOnly {
		runs, err := measureQuotas(ctx, root, o.budgetShards)
		if err != nil {
			return err
		}
		fmt.Print("\n", quotasMarkdown(runs))
		return nil
	}
	if o.eventsOnly {
		r, err := measureEvents(ctx, root)
		if err != nil {
			return err
		}
		fmt.Print("\n", eventsMarkdown(r))
		return nil
	}
	if o.balanceOnly {
		b, err := measureBalance(ctx, o.balanceGrants)
		if err != nil {
			return err
		}
		fmt.Print("\n", b.summary(), "\n", b.markdown())
		if o.reconcileCredits > 0 {
			rr, err := measureReconcile(ctx, o.reconcileCredits)
			if err != nil {
				return err
			}
			fmt.Print("\n", rr.summary(), "\n", rr.markdown())
		}
		return nil
	}
	for _, tool := range []string{"redis-server", "redis-benchmark"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s is not installed: run hack/ensure-redis.sh (make redis) first", tool)
		}
	}
	r := results{opts: o, started: time.Now(), loadBefore: loadAverage()}
	start := time.Now()

	work, err := os.MkdirTemp("", "redpacket-bench-")
	if err != nil {
		return fmt.Errorf("creating a work directory: %w", err)
	}
	defer os.RemoveAll(work)

	srv, err := redistest.StartProcess(work)
	if err != nil {
		return err
	}
	defer srv.Stop()
	conn := srv.Conn()
	// A plain client with a pool of 64 connections, and its auto-pipeliner for the
	// memory run.
	pc, err := conn.NewPipelinedClient(redisconn.ClientOptions{PoolSize: 64})
	if err != nil {
		return err
	}
	defer func() { _ = pc.Close() }()
	rc := pc.Client
	if err := lua.LoadAll(ctx, rc); err != nil {
		return fmt.Errorf("loading scripts: %w", err)
	}
	r.machine = readMachine(ctx, rc)
	fmt.Printf("redis-server %s on %s; %d CPUs (%s); load average %s\n\n",
		r.machine.RedisVersion, srv.Addr, r.machine.CPUs, r.machine.CPUModel, r.loadBefore)

	if o.seedScriptOnly {
		s, err := measureSeedScript(ctx, rc, srv, o.benchClients, o.seedScriptRequests, o.seedScriptRounds)
		if err != nil {
			return err
		}
		fmt.Print(s.summary(), "\n", s.sharesMarkdown())
		return nil
	}
	if o.scaleOnly {
		s, err := measureScale(ctx, work, o.benchClients, o.requestsP16, o.scaleRounds)
		if err != nil {
			return err
		}
		fmt.Print(s.summary())
		return nil
	}

	if o.budgetOnly {
		b, err := measureBudget(ctx, o, root, work, srv, rc)
		if err != nil {
			return err
		}
		fmt.Print("\n", b.summary())
		return nil
	}

	if o.httpOnly {
		if _, _, err := measureHTTP(ctx, o, root, work, srv, rc); err != nil {
			return err
		}
		return nil
	}
	if o.claimOnly {
		if err := measureClaimPath(ctx, o, conn, srv, rc, &r); err != nil {
			return err
		}
		fmt.Printf("\nratio b/a(-P16) = %.2f   (auto-pipelined Go claim path / redis-benchmark -P 16)\n",
			ratio(r.goAuto.Rate(), r.rbP16.Rate()))
		return nil
	}

	// (g) Settlement, healthy and under the failure mix, and the check's cost.
	if o.verifyOnly {
		_, err := measureVerification(ctx, o, srv)
		return err
	}
	if o.failureOnly {
		return measureFailureMixOnly(ctx, o, srv)
	}
	if r.settle, err = measureSettlements(ctx, o, srv); err != nil {
		return err
	}
	if o.settlementOnly {
		fmt.Print("\n", settlementSummary(r.settle), "load average before / after: ", r.loadBefore, " / ", loadAverage(), "\n\n",
			settlementMarkdown(r.settle))
		return nil
	}
	if r.settleCheck, err = measureVerification(ctx, o, srv); err != nil {
		return err
	}

	// (e) Seeding.
	fmt.Printf("(e) seeding %d packets ... ", o.seedPackets)
	if r.seedTook, err = seedActivity(ctx, rc, "bench-seed", o.seedPackets); err != nil {
		return err
	}
	r.seedCount = o.seedPackets
	fmt.Printf("%s (%.0f packets/s)\n", r.seedTook.Round(time.Millisecond), float64(o.seedPackets)/r.seedTook.Seconds())
	if err := store.NewActivity(rc, "bench-seed", 1).Purge(ctx); err != nil {
		return err
	}

	// (f) Memory per packet.
	fmt.Printf("(f) memory: seeding and claiming %d packets ... ", o.memPackets)
	if r.mem, err = measureMemory(ctx, pc, o.memPackets); err != nil {
		return err
	}
	fmt.Printf("%.0f bytes per claimed packet (%.0f seeded, %.0f more when claimed)\n",
		r.mem.perClaimed(), r.mem.perSeeded(), r.mem.perClaimDelta())

	// (a) and (b): the claim path.
	if err := measureClaimPath(ctx, o, conn, srv, rc, &r); err != nil {
		return err
	}

	// (i) Our grab script against the seed's.
	if r.seedScript, err = measureSeedScript(ctx, rc, srv, o.benchClients, o.seedScriptRequests, o.seedScriptRounds); err != nil {
		return fmt.Errorf("seed script: %w", err)
	}

	// (j) One activity over one master and over two.
	if r.scale, err = measureScale(ctx, work, o.benchClients, o.requestsP16, o.scaleRounds); err != nil {
		return fmt.Errorf("scale: %w", err)
	}

	// (k) An activity at the CRD's limit.
	if o.seedMaxPackets > 0 {
		fmt.Printf("(k) splitting and seeding %d packets ... ", o.seedMaxPackets)
		if r.seedMax, err = measureSeedMax(ctx, rc, o.seedMaxPackets); err != nil {
			return fmt.Errorf("seeding at the limit: %w", err)
		}
		fmt.Printf("%s (split %s, seed %s)\n", r.seedMax.took().Round(time.Millisecond),
			r.seedMax.split.Round(time.Millisecond), r.seedMax.seed.Round(time.Millisecond))
	}

	// (h) Durability modes, each on its own servers.
	if r.durable, err = measureDurability(ctx, work, o.goWorkers, o.goDuration, o.goPackets); err != nil {
		return fmt.Errorf("durability: %w", err)
	}

	// (c) and (d) HTTP.
	low, high, err := measureHTTP(ctx, o, root, work, srv, rc)
	if err != nil {
		return err
	}
	r.httpGrab, r.httpNoop, r.httpLow, r.httpHigh = low.grab, low.noop, low, high

	// (l) Runtime packets of a budget.
	if r.budget, err = measureBudget(ctx, o, root, work, srv, rc); err != nil {
		return fmt.Errorf("budget: %w", err)
	}

	// (m) The reference balance system on PostgreSQL.
	if o.balanceGrants > 0 {
		if r.balance, err = measureBalance(ctx, o.balanceGrants); err != nil {
			return err
		}
	}

	// (n) Reconciliation of a large source with the balance system's book.
	if o.reconcileCredits > 0 {
		if r.reconcile, err = measureReconcile(ctx, o.reconcileCredits); err != nil {
			return err
		}
	}

	r.took = time.Since(start)
	r.loadAfter = loadAverage()
	report := r.markdown()
	fmt.Println()
	fmt.Println(r.summary())
	if o.out != "" {
		path := filepath.Join(root, o.out)
		if err := os.WriteFile(path, []byte(report), 0o644); err != nil {
			return fmt.Errorf("writing %s: %w", path, err)
		}
		fmt.Printf("wrote %s\n", o.out)
	}
	return nil
}

// checkGranted fails when a run granted nothing: a broken setup, not a result.
func checkGranted(what string, l latencies) error {
	if l.ByStatus[string(store.Granted)] == 0 {
		return fmt.Errorf("%s granted nothing: %v", what, l.ByStatus)
	}
	return nil
}

// rateLine is one line of figures.
func rateLine(l latencies) string {
	return fmt.Sprintf("%.0f/s  p50 %s  p99 %s", l.Rate(), fmtDur(l.P50), fmtDur(l.P99))
}

// fmtMicros prints a duration in microseconds with two decimals.
func fmtMicros(d time.Duration) string {
	return fmt.Sprintf("%.2f µs", float64(d)/float64(time.Microsecond))
}

// fmtDur prints a latency in milliseconds with three decimals.
func fmtDur(d time.Duration) string {
	return fmt.Sprintf("%.3f ms", float64(d)/float64(time.Millisecond))
}

// loadAverage is the first three fields of /proc/loadavg.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// claimRound is one round of the claim path's ratio: redis-benchmark -P 16 against
// the grab script, then the grab service's Go claim path, one after the other on the
// same server.
type claimRound struct {
	// rb and goAuto carry redis-server's CPU time per call (CPU[redisServer]).
	rb, goAuto latencies
	// rbGranted is how many packets redis-benchmark's calls granted.
	rbGranted int64
}

// redisServer names redis-server in a run's CPU figures.
const redisServer = "redis-server"

// redisCPUMeter meters redis-server through rc.
func redisCPUMeter(ctx context.Context, rc redis.Cmdable) cpuMeter {
	return cpuMeter{name: redisServer, read: func() (time.Duration, error) { return redisCPU(ctx, rc) }}
}

// redisCPU is redis-server's CPU time so far, user and system (INFO cpu).
func redisCPU(ctx context.Context, rc redis.Cmdable) (time.Duration, error) {
	info, err := rc.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, fmt.Errorf("INFO cpu: %w", err)
	}
	var total float64
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return 0, fmt.Errorf("INFO cpu %s=%q: %w", k, v, err)
			}
			total += f
		}
	}
	return time.Duration(total * float64(time.Second)), nil
}

func (c claimRound) ratio() float64 { return ratio(c.goAuto.Rate(), c.rb.Rate()) }

// measureClaimPath runs (a), redis-benchmark against the grab script at -P 1, then
// o.claimRounds rounds of redis-benchmark -P 16 and the Go claim path on the grab
// service's auto-pipelining client, alternating, and then (b) on a plain client and
// on go-redis's default auto-pipeliner. The machine's speed drifts by tens of per
// cent within minutes, so b/a is the median round's, each round's two runs a few
// seconds apart. redis-benchmark and the Go runs grab from activities of their own
// on the server srv; every run must really grant.
func measureClaimPath(ctx context.Context, o options, conn redisconn.Conn, srv *redistest.Server, rc redis.UniversalClient, r *results) error {
	rb := store.NewActivity(rc, "bench-rb", 1)
	rbPackets := int64(o.requestsP1+o.claimRounds*o.requestsP16) * 11 / 10
	fmt.Printf("    seeding %d packets for redis-benchmark ... ", rbPackets)
	took, err := seedActivity(ctx, rc, "bench-rb", rbPackets)
	if err != nil {
		return err
	}
	fmt.Println(took.Round(time.Millisecond))
	claimed := func() (int64, error) {
		snap, err := rb.Snapshot(ctx)
		return snap.ClaimedCount, err
	}
	// benchmark runs redis-benchmark and checks that its calls granted: a NOSCRIPT or
	// error reply counts as a request too. Random user ids repeat now and then
	// (already_claimed), so 95 % must grant; each run draws them after a prefix of
	// its own.
	runs := 0
	benchmark := func(pipeline, requests int) (latencies, int64, error) {
		before, err := claimed()
		if err != nil {
			return latencies{}, 0, err
		}
		runs++
		l, err := redisBenchmark(ctx, srv, rb.Shard(0).Keys(), fmt.Sprintf("u%d:", runs), pipeline, o.benchClients, requests)
		if err != nil {
			return latencies{}, 0, err
		}
		after, err := claimed()
		if err != nil {
			return latencies{}, 0, err
		}
		if granted := after - before; granted < int64(requests)*95/100 {
			return latencies{}, 0, fmt.Errorf("redis-benchmark -P %d: only %d of %d calls granted a packet (claimed %d before, %d after)",
				pipeline, granted, requests, before, after)
		}
		return l, after - before, nil
	}
	fmt.Printf("(a) redis-benchmark FCALL grab -P 1, %d requests ... ", o.requestsP1)
	var granted int64
	if r.rbP1, granted, err = benchmark(1, o.requestsP1); err != nil {
		return err
	}
	r.rbGranted += granted
	fmt.Println(rateLine(r.rbP1))

	goAct := store.NewActivity(rc, "bench-go", 1)
	goPackets := o.goPackets * int64(o.claimRounds+2)
	fmt.Printf("    seeding %d packets for the Go claim path ... ", goPackets)
	if took, err = seedActivity(ctx, rc, "bench-go", goPackets); err != nil {
		return err
	}
	fmt.Println(took.Round(time.Millisecond))
	// The grab service's own clients: the same options and auto-pipeliner it serves with.
	gc, err := conn.NewPipelinedClient(redisconn.GrabClientOptions(grabsvc.DefaultRedisTimeout))
	if err != nil {
		return fmt.Errorf("grab service redis clients: %w", err)
	}
	defer func() { _ = gc.Close() }()
	auto := store.NewActivity(gc.Pipeliner, "bench-go", 1).Shard(0)
	r.claimRounds = nil
	for i := range o.claimRounds {
		var round claimRound
		fmt.Printf("(a) round %d: redis-benchmark FCALL grab -P 16, %d requests ... ", i+1, o.requestsP16)
		redis := []cpuMeter{redisCPUMeter(ctx, rc)}
		if round.rb, err = metered(redis, func() (l latencies, err error) {
			l, round.rbGranted, err = benchmark(16, o.requestsP16)
			return l, err
		}); err != nil {
			return err
		}
		fmt.Printf("%s  Redis CPU %s per call\n", rateLine(round.rb), fmtMicros(round.rb.CPU[redisServer]))
		fmt.Printf("(b) round %d: Go store.Grab, auto-pipelining, %d goroutines, %s ... ", i+1, o.goWorkers, o.goDuration)
		if round.goAuto, err = metered(redis, func() (latencies, error) {
			return goClaims(ctx, auto, fmt.Sprintf("auto%d:", i), o.goWorkers, o.goDuration, o.goPackets)
		}); err != nil {
			return err
		}
		if err := checkGranted("Go claim path", round.goAuto); err != nil {
			return err
		}
		fmt.Printf("%s  Redis CPU %s per call  b/a %.2f\n", rateLine(round.goAuto), fmtMicros(round.goAuto.CPU[redisServer]), round.ratio())
		r.rbGranted += round.rbGranted
		r.claimRounds = append(r.claimRounds, round)
	}
	median := medianRound(r.claimRounds, claimRound.ratio)
	r.rbP16, r.goAuto = median.rb, median.goAuto

	fmt.Printf("(b) Go store.Grab, plain client (pool of 64), %d goroutines, %s ... ", o.goWorkers, o.goDuration)
	if r.goPlain, err = goClaims(ctx, goAct.Shard(0), "plain:", o.goWorkers, o.goDuration, o.goPackets); err != nil {
		return err
	}
	fmt.Println(rateLine(r.goPlain))
	// A client with the same options through go-redis's default (half-duplex)
	// auto-pipeliner, to show what redisconn.GrabPipelineOptions are worth. A client
	// keeps the first auto-pipeliner it makes, so this is a client of its own.
	hc, ok := conn.NewClient(redisconn.GrabClientOptions(grabsvc.DefaultRedisTimeout)).(*redis.Client)
	if !ok {
		return fmt.Errorf("the benchmark's redis client is not a standalone client")
	}
	half, err := hc.AutoPipeline()
	if err != nil {
		_ = hc.Close()
		return fmt.Errorf("go-redis default auto-pipeliner: %w", err)
	}
	fmt.Printf("(b) Go store.Grab, go-redis default auto-pipelining, %d goroutines, %s ... ", o.goWorkers, o.goDuration)
	r.goHalf, err = goClaims(ctx, store.NewActivity(half, "bench-go", 1).Shard(0), "half:", o.goWorkers, o.goDuration, o.goPackets)
	_ = half.Close()
	_ = hc.Close()
	if err != nil {
		return err
	}
	fmt.Println(rateLine(r.goHalf))
	if err := checkGranted("Go claim path (default auto-pipelining)", r.goHalf); err != nil {
		return err
	}
	if err := rb.Purge(ctx); err != nil {
		return err
	}
	return goAct.Purge(ctx)
}
