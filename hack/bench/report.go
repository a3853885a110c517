package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// machineInfo describes where the figures were measured.
type machineInfo struct {
	CPUs         int
	CPUModel     string
	MemTotal     string
	Kernel       string
	GoVersion    string
	RedisVersion string
}

func readMachine(ctx context.Context, rc redis.Cmdable) machineInfo {
	m := machineInfo{CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), RedisVersion: "unknown",
		CPUModel: "unknown", MemTotal: "unknown", Kernel: "unknown"}
	if v, err := serverVersion(ctx, rc); err == nil {
		m.RedisVersion = v
	}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
		_ = f.Close()
	}
	if f, err := os.Open("/proc/meminfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
				kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
				if err == nil {
					m.MemTotal = fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
				}
				break
			}
		}
		_ = f.Close()
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	return m
}

// memoryFigures are used_memory readings around seeding and claiming N packets.
type memoryFigures struct {
	N                        int64
	before, seeded, claimed  int64
	packetsKey               int64
	claimsKey, streamKey     int64
	claimsBytes, streamBytes float64
}

func (m memoryFigures) perSeeded() float64     { return float64(m.seeded-m.before) / float64(m.N) }
func (m memoryFigures) perClaimed() float64    { return float64(m.claimed-m.before) / float64(m.N) }
func (m memoryFigures) perClaimDelta() float64 { return float64(m.claimed-m.seeded) / float64(m.N) }

// measureMemory seeds N packets, claims them all through pc's auto-pipeliner and
// reads used_memory before, between and after, plus MEMORY USAGE of the activity's
// keys (measure.go).
func measureMemory(ctx context.Context, pc *redisconn.PipelinedClient, n int64) (memoryFigures, error) {
	m := memoryFigures{N: n}
	const uid = "bench-mem"
	rc := pc.Client
	var err error
	if m.before, err = usedMemory(ctx, rc); err != nil {
		return m, err
	}
	if _, err := seedActivity(ctx, rc, uid, n); err != nil {
		return m, err
	}
	if m.seeded, err = usedMemory(ctx, rc); err != nil {
		return m, err
	}
	act := store.NewActivity(rc, uid, 1)
	seeded, err := measureKeys(ctx, rc, act.Shard(0))
	if err != nil {
		return m, err
	}
	m.packetsKey = seeded.Packets
	l, err := goClaims(ctx, store.NewActivity(pc.Pipeliner, uid, 1).Shard(0), "m:", 64, 5*time.Minute, n)
	if err != nil {
		return m, err
	}
	if got := l.ByStatus[string(store.Granted)]; got != n {
		return m, fmt.Errorf("memory run granted %d of %d packets: %v", got, n, l.ByStatus)
	}
	if m.claimed, err = usedMemory(ctx, rc); err != nil {
		return m, err
	}
	claimed, err := measureKeys(ctx, rc, act.Shard(0))
	if err != nil {
		return m, err
	}
	m.claimsKey, m.streamKey = claimed.Claims, claimed.Stream
	m.claimsBytes = float64(m.claimsKey) / float64(n)
	m.streamBytes = float64(m.streamKey) / float64(n)
	return m, act.Purge(ctx)
}

// ratio is a/b, or 0 when b is 0.
func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// summary is the console's closing block.
func (r results) summary() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-52s %12s %10s %10s\n", "path", "per second", "p50", "p99")
	row := func(name string, l latencies) {
		fmt.Fprintf(&b, "%-52s %12.0f %10s %10s\n", name, l.Rate(), fmtDur(l.P50), fmtDur(l.P99))
	}
	row("(a) redis-benchmark FCALL grab -P 1", r.rbP1)
	row("(a) redis-benchmark FCALL grab -P 16", r.rbP16)
	row("(b) Go store.Grab, plain pooled client", r.goPlain)
	row("(b) Go store.Grab, auto-pipelining", r.goAuto)
	row("(b) Go store.Grab, go-redis default auto-pipelining", r.goHalf)
	row(fmt.Sprintf("(c) HTTP POST /v1/grab (grab service), %d clients", r.opts.httpClients), r.httpGrab)
	row(fmt.Sprintf("(d) HTTP no-op Go handler, %d clients", r.opts.httpClients), r.httpNoop)
	if h := r.httpHigh; h.clients > 0 {
		row(fmt.Sprintf("(c) HTTP POST /v1/grab (grab service), %d clients", h.clients), h.grab)
		row(fmt.Sprintf("(d) HTTP no-op Go handler, %d clients", h.clients), h.noop)
	}
	fmt.Fprintf(&b, "\nratio b/a(-P16) = %.2f   (auto-pipelined Go claim path / redis-benchmark -P 16)\n",
		ratio(r.goAuto.Rate(), r.rbP16.Rate()))
	fmt.Fprintf(&b, "ratio c/d       = %.2f   (grab service / no-op handler, same load generator, %d clients)\n",
		ratio(r.httpGrab.Rate(), r.httpNoop.Rate()), r.opts.httpClients)
	if h := r.httpHigh; h.clients > 0 {
		fmt.Fprintf(&b, "ratio c/d       = %.2f   (the same, %d clients)\n", ratio(h.grab.Rate(), h.noop.Rate()), h.clients)
	}
	fmt.Fprintf(&b, "(e) seeding %d packets: %s (%.0f packets/s)\n", r.seedCount, r.seedTook.Round(time.Millisecond),
		float64(r.seedCount)/r.seedTook.Seconds())
	fmt.Fprintf(&b, "(f) Redis memory: %.0f bytes per claimed packet (%.0f as a seeded packet, +%.0f when claimed)\n",
		r.mem.perClaimed(), r.mem.perSeeded(), r.mem.perClaimDelta())
	b.WriteString(r.durable.summary())
	b.WriteString(r.seedScript.summary())
	b.WriteString(r.scale.summary())
	if r.seedMax.count > 0 {
		b.WriteString(r.seedMax.summary())
	}
	b.WriteString(settlementSummary(r.settle))
	b.WriteString(verificationLine(r.settleCheck) + "\n")
	if r.balance.res.Grants > 0 {
		b.WriteString(r.balance.summary())
	}
	if r.reconcile.res.Credits > 0 {
		b.WriteString(r.reconcile.summary())
	}
	return b.String()
}

// markdown is docs/benchmarks.md.
func (r results) markdown() string {
	var b strings.Builder
	m := r.machine
	o := r.opts
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	p("# Benchmarks\n\n")
	p("Generated by `make bench` (`go run ./hack/bench`) on %s; the run took %s.\n",
		r.started.UTC().Format("2006-01-02 15:04 MST"), r.took.Round(time.Second))
	p("Re-run it to refresh this page. Everything runs on loopback against a `redis-server` the\n")
	p("benchmark starts itself (no persistence, the defaults of `test/redistest`), one process\n")
	p("per server.\n\n")
	p("## Machine\n\n")
	p("| | |\n|---|---|\n")
	p("| CPUs (nproc) | %d |\n| CPU | %s |\n| memory | %s |\n| kernel | %s |\n", m.CPUs, m.CPUModel, m.MemTotal, m.Kernel)
	p("| redis-server | %s |\n| Go | %s |\n", m.RedisVersion, m.GoVersion)
	p("| load average before / after | %s / %s |\n\n", r.loadBefore, r.loadAfter)
	p("The load generators, the servers and Redis share these %d CPUs, so every figure is a\n", m.CPUs)
	p("lower bound of what the code does on a machine of its own; the ratios compare runs that\n")
	p("share the machine the same way.\n\n")

	p("## Claim path\n\n")
	p("| path | load | per second | p50 | p99 | max |\n|---|---|---:|---:|---:|---:|\n")
	row := func(name, load string, l latencies) {
		p("| %s | %s | %.0f | %s | %s | %s |\n", name, load, l.Rate(), fmtDur(l.P50), fmtDur(l.P99), fmtDur(l.Max))
	}
	row("(a) `redis-benchmark` FCALL grab, -P 1", fmt.Sprintf("%d connections, %d requests", o.benchClients, o.requestsP1), r.rbP1)
	row("(a) `redis-benchmark` FCALL grab, -P 16 (median round)", fmt.Sprintf("%d connections, %d requests", o.benchClients, o.requestsP16), r.rbP16)
	row("(b) Go `store.Grab`, plain pooled client", fmt.Sprintf("%d goroutines, %s", o.goWorkers, o.goDuration), r.goPlain)
	row("(b) Go `store.Grab`, go-redis auto-pipelining, the grab service's options (median round)", fmt.Sprintf("%d goroutines, %s", o.goWorkers, o.goDuration), r.goAuto)
	row("(b) Go `store.Grab`, go-redis auto-pipelining, its defaults", fmt.Sprintf("%d goroutines, %s", o.goWorkers, o.goDuration), r.goHalf)
	row("(c) HTTP `POST /v1/grab`, grab service (median round)", fmt.Sprintf("%d keep-alive clients, %s", o.httpClients, o.httpDuration), r.httpGrab)
	row("(d) HTTP no-op Go handler (median round)", fmt.Sprintf("%d keep-alive clients, %s", o.httpClients, o.httpDuration), r.httpNoop)
	if h := r.httpHigh; h.clients > 0 {
		row("(c) HTTP `POST /v1/grab`, grab service (median round)", fmt.Sprintf("%d keep-alive clients, %s", h.clients, o.httpDuration), h.grab)
		row("(d) HTTP no-op Go handler (median round)", fmt.Sprintf("%d keep-alive clients, %s", h.clients, o.httpDuration), h.noop)
	}
	p("\nb/a is measured in %d rounds, each redis-benchmark -P 16 and then the Go claim path on the\n", len(r.claimRounds))
	p("grab service's client, a few seconds apart; the table above shows the median round:\n\n")
	p("| round | (a) -P 16 per second | Redis CPU per call | (b) auto-pipelined per second | Redis CPU per call | b/a |\n|---:|---:|---:|---:|---:|---:|\n")
	for i, c := range r.claimRounds {
		p("| %d | %.0f | %s | %.0f | %s | %.2f |\n", i+1, c.rb.Rate(), fmtMicros(c.rb.CPU[redisServer]), c.goAuto.Rate(), fmtMicros(c.goAuto.CPU[redisServer]), c.ratio())
	}
	p("\nc/d likewise, in %d rounds at each load, each the no-op handler and then the grab service.\n", len(r.httpLow.rounds))
	p("CPU is per request, user and system, of the server's process, redis-server and the load\n")
	p("generator, read around each measured run:\n\n")
	p("| clients | round | (d) per second | CPU: server, load generator | (c) per second | CPU: server, redis-server, load generator | c/d |\n|---:|---:|---:|---|---:|---|---:|\n")
	for _, pair := range []httpPair{r.httpLow, r.httpHigh} {
		for i, h := range pair.rounds {
			p("| %d | %d | %.0f | %s, %s | %.0f | %s, %s, %s | %.2f |\n", pair.clients, i+1,
				h.noop.Rate(), fmtMicros(h.noop.CPU[serverMeter]), fmtMicros(h.noop.CPU[loadGenerator]),
				h.grab.Rate(), fmtMicros(h.grab.CPU[serverMeter]), fmtMicros(h.grab.CPU[redisServer]), fmtMicros(h.grab.CPU[loadGenerator]),
				h.ratio())
		}
	}
	p("\n| ratio | value | goal |\n|---|---:|---:|\n")
	p("| b/a(-P16): auto-pipelined Go claim path / `redis-benchmark -P 16`, median of %d rounds | **%.2f** | ≥ 0.9 |\n", len(r.claimRounds), ratio(r.goAuto.Rate(), r.rbP16.Rate()))
	p("| c/d: grab service / no-op handler under the same load, %d clients, median of %d rounds | **%.2f** | ≥ 0.7 |\n", o.httpClients, len(r.httpLow.rounds), ratio(r.httpGrab.Rate(), r.httpNoop.Rate()))
	if h := r.httpHigh; h.clients > 0 {
		p("| c/d: the same, %d clients | **%.2f** | ≥ 0.7 |\n", h.clients, ratio(h.grab.Rate(), h.noop.Rate()))
	}
	p("\n")
	p("Outcomes: redis-benchmark granted %d packets in %d calls (random user ids repeat now and\n", r.rbGranted, o.requestsP1+o.claimRounds*o.requestsP16)
	p("then); Go auto-pipelining in the median round %s; grab service HTTP statuses %s.\n\n", fmtCounts(r.goAuto.ByStatus), fmtCounts(r.httpGrab.ByStatus))
	p("What is measured:\n\n")
	p("* **(a)** `redis-benchmark -c %d -P {1,16} -r 1000000000 FCALL <grab function> 4 <meta> <packets> <claims> <stream> u<run>:__rand_int__`\n", o.benchClients)
	p("  against an activity seeded with %d packets, so it never sells out: every call is a real grant\n", int64(o.requestsP1+o.claimRounds*o.requestsP16)*11/10)
	p("  (`HGET` of the user's claim, `HGET` of the gate that says the activity is open and has no\n")
	p("  window, so no `TIME`; `LPOP` of a packet that carries the claimed count and amount before\n")
	p("  it; `XADD` of one packed field; `HSET` of the claim; the grant answered as one string).\n")
	p("* **(b)** `store.Grab` (FCALL of the grab function) from %d goroutines in a closed loop, each call a\n", o.goWorkers)
	p("  fresh user: as many calls in flight as redis-benchmark's %d connections at -P 16 keep, since a\n", o.benchClients)
	p("  closed loop's rate is its calls in flight over its latency. Each run is one of these:\n")
	p("  a plain client with a pool of 64 connections; the grab service's own\n")
	p("  clients (`redisconn.Conn.NewPipelinedClient` with `redisconn.GrabClientOptions` and its 500 ms socket\n")
	p("  timeouts: go-redis's auto-pipeliner, which batches concurrent callers' commands into\n")
	p("  pipelines, with `redisconn.GrabPipelineOptions`: full duplex, so one batch is written while the\n")
	p("  replies of the one before are read, and a wait of up to 100 µs for a larger batch once more\n")
	p("  than 64 commands are in flight); and a client with the same options through go-redis's\n")
	p("  default auto-pipeliner (half duplex: one batch per round trip), for comparison.\n")
	p("* **(c)** the grab service binary (`bin/grabsvc`, its own process, status reporter on, settlement\n")
	p("  off) serving `POST /v1/grab` with a fresh user per request, and **(d)** a Go `net/http` handler\n")
	p("  that reads the body and writes a fixed JSON answer, also its own process. Both are driven by the\n")
	p("  benchmark's Go load generator: %d keep-alive HTTP/1.1 clients in a closed loop, %s warm-up,\n", o.httpClients, o.httpWarmup)
	p("  then %s measured; latency is per request, as the client sees it.", o.httpDuration)
	if r.httpHigh.clients > 0 {
		p(" Then both again with %d\n", r.httpHigh.clients)
		p("  clients, to tell a cost of waiting for Redis (which more requests in flight would hide: a\n")
		p("  closed loop's rate is its requests in flight over its latency) from a cost in CPU (which\n")
		p("  they would not).")
	}
	p("\n\n")
	p("Reading the figures: at -P 16 redis-benchmark times each request from its pipeline's\n")
	p("write to its reply, so its latencies are those of a batch of 16. During (c) three busy\n")
	p("processes share the %d CPUs (the load generator, the grab service and redis-server), during\n", m.CPUs)
	p("(d) two; the grab service also parses and validates each body, checks the rate limiters,\n")
	p("counts metrics and waits for Redis. On a machine where Redis has CPUs of its own, (c) does\n")
	p("not compete with it, and c/d should be higher.\n\n")

	p("## Seeding\n\n")
	p("Staging %d packets in chunks of %d (`seed_stage.lua`) and committing them (`seed_commit.lua`):\n", r.seedCount, store.DefaultChunkSize)
	p("**%s**, %.0f packets/s.\n\n", r.seedTook.Round(time.Millisecond), float64(r.seedCount)/r.seedTook.Seconds())

	p("## Redis memory\n\n")
	mem := r.mem
	p("`used_memory` (INFO memory) around seeding %d packets and claiming every one of them:\n\n", mem.N)
	p("| | bytes |\n|---|---:|\n")
	p("| per seeded, unclaimed packet (`packets` list) | %.0f |\n", mem.perSeeded())
	p("| per claimed packet, in total | **%.0f** |\n", mem.perClaimed())
	p("| of which the `claims` hash entry (MEMORY USAGE) | %.0f |\n", mem.claimsBytes)
	p("| of which the `stream` entry (MEMORY USAGE) | %.0f |\n\n", mem.streamBytes)
	p("A claimed packet costs its `claims` entry (user → packet) and its settlement stream entry;\n")
	p("the `packets` list entry it came from is freed. Both stay until the activity is deleted, so\n")
	p("plan about %.0f MB of Redis per million claims (user ids here are about 8 bytes;\n", mem.perClaimed()*1e6/1e6)
	p("longer ids cost their length again in both structures).\n\n")

	b.WriteString(r.durable.markdown())
	b.WriteString(r.seedScript.markdown())
	b.WriteString(r.scale.markdown())
	b.WriteString(`## Profiling the claim and HTTP paths

` + "`go test ./grabsvc -run '^$' -bench 'HTTPClaim|ClaimPath' -benchtime 3s -cpuprofile cpu.prof`" + ` then
` + "`go tool pprof -top -cum cpu.prof`" + `; for the grab service binary under (c),
` + "`go run ./hack/bench -http-only -grab-cpu-profile grab.prof`" + ` (it serves its profiles on
` + "`--pprof-listen`" + `) then ` + "`go tool pprof -top -cum bin/grabsvc grab.prof`" + `.

On the claim path the profile showed two costs of our own, both removed: splitting each grant
reply with ` + "`strings.SplitN`" + ` (a tenth of the client's CPU; the fields are now cut one by one
and reading a grant allocates nothing) and boxing the command, the digest and the four keys
of every EVALSHA anew (another tenth; ` + "`store.Shard`" + ` now keeps them boxed). What is left is
go-redis's auto-pipeliner and the socket system calls, and during (b) redis-server runs at
about one core (its CPU per call above times the rate), so b/a is bounded by Redis, as (a) is.

In the grab service under (c) the socket system calls are 25 to 40 % of its CPU (two
profiles, on two machines): the HTTP response writes 17 to 30 %, the writes of the Redis
pipeline 9 to 14 %. The handler
(` + "`handleGrab`" + ` with the Redis call: validation, the rate limiters, the watermark, metrics) is
9 to 13 % (two profiles): the body parser and the answer writer about 4 % each, the watermark, the metrics
and the clock 1 % or less each, the rate limiters too little to show. What the grab service adds to the
no-op server is the Redis round trip: go-redis's writer goroutine (16 % of the samples in one
5 s profile, most of it its write system calls), the wake-ups of the callers its reader
completes, and the goroutine that bounds each call by the Redis deadline.

c/d is a ratio of CPU per request. On two shared cores both runs keep every core busy, so
each rate is the cores over the CPU that one request costs in all of its processes (the
table of rounds above). At 64 clients the no-op path costs about 50 µs per request (server
about 21, load generator about 29), the grab path about 85 µs (grab service 38 to 40,
redis-server about 13, load generator about 33): 50 / 85 = 0.59, as measured. redis-server's
own share alone would hold c/d to 50 / 63 = 0.79 if the grab service cost no more than the
no-op server. redis-server spends about 13 µs per grab here against 7 to 8 µs under
redis-benchmark -P 16, because at 64 clients only about ten grabs are in flight to Redis at
once (INFO stats, reads against calls, polled each second during (c): 8.7 to 11.5 grabs per
read), and each read and write that wakes the other process is costly on this machine.

Larger batches did not help. A half-duplex pipeliner waiting up to 300 µs did not lower
redis-server's CPU per grab (12.4 µs, against 11.0 to 13.2 µs with the grab path's options).
go-redis's full-duplex writer waits for a larger batch only above 64 commands in flight,
which 64 clients never reach; a copy of go-redis with that floor lowered to 8 raised the
batches only to about 10 grabs and gave c/d 0.60, 0.56 and 0.52 in three rounds. Running
every process with GOMAXPROCS=1 helped the no-op server more than the grab service (c/d 0.49
to 0.59 in five rounds).

`)
	if r.seedMax.count > 0 {
		b.WriteString(r.seedMax.markdown())
	}
	b.WriteString(settlementMarkdown(r.settle))
	if r.budget.created > 0 {
		b.WriteString(r.budget.markdown())
	}
	b.WriteString(verificationMarkdown(r.settleCheck))
	if r.balance.res.Grants > 0 {
		b.WriteString(r.balance.markdown())
	}
	if r.reconcile.res.Credits > 0 {
		b.WriteString(r.reconcile.markdown())
	}

	p("## Command\n\n")
	p("```\nmake bench            # = go run ./hack/bench\ngo run ./hack/bench -h  # the knobs: requests, goroutines, clients, durations\n```\n\n")
	p("Reference points from the field: WeChat peaked at 409,000 grabs/s (2016) and 760,000/s (2017)\n")
	p("over a whole fleet; seed 003 measured 9,500 Lua grabs/s on one Redis 6.2 node with a plain client.\n")
	return b.String()
}

// fmtCounts prints a count map in a stable order.
func fmtCounts(m map[string]int64) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}
