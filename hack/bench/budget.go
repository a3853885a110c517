package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/util/uuid"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/proc"
	"redpacket.io/operator/test/redistest"
)

// budgetRun is (l): runtime packets of a RedPacketBudget through one grab service in
// budget mode: packets of 5 shares created per second through POST /v1/packets, then
// grabs per second through POST /v1/packets/{id}/grab on the same server, and Redis
// memory per live 5-share packet and per claimed share.
type budgetRun struct {
	shards, clients int
	create, grab    latencies
	// created is how many packets Redis counts after the create load; granted the
	// grants it counts after the grab load.
	created, granted int64
	// memPackets packets were created directly for the memory figures.
	memPackets              int64
	perLivePacket, perShare float64
	conserved               bool
	// fleetRSS is the grab service's resident memory with fleetLive[i] live packets.
	fleetLive, fleetRSS [2]int64
	// activities is the resource path in the same run: activities of 5 packets made
	// Active per second by the operator (zero Activities: not measured).
	activities activityRun
	// check is the settlement check's cost per budget entry against no check
	// (BenchmarkBudgetSettlementCheck); zero when not measured.
	check budgetCheckRun
	// quotas are created/s with quotas on and off and the bytes of quota state
	// (BenchmarkPacketQuotas), with the run's budget shards and with one.
	quotas []quotaRun
	// events are grabs/s with a stuck events receiver, a healthy one and none
	// (BenchmarkGrabsWithAStuckEventsReceiver).
	events eventsRun
}

// budgetCheckRun is what BenchmarkBudgetSettlementCheck reported: ns per entry
// settled with the budget's check and without it, alternately in one run.
type budgetCheckRun struct {
	iterations         int
	checked, unchecked float64
}

func (c budgetCheckRun) ratio() float64 { return ratio(c.checked, c.unchecked) }

// budgetCheckIterations is -benchtime of BenchmarkBudgetSettlementCheck: each
// iteration settles 2,000 grants twice, once checked and once not.
const budgetCheckIterations = 5

// measureBudgetCheck runs BenchmarkBudgetSettlementCheck (settlement) in a child
// go test and reads its metrics.
func measureBudgetCheck(ctx context.Context, root string) (budgetCheckRun, error) {
	r := budgetCheckRun{iterations: budgetCheckIterations}
	fmt.Println("(l) the settlement check per budget entry: go test -bench BenchmarkBudgetSettlementCheck ./settlement ...")
	cmd := exec.CommandContext(ctx, "go", "test", "-run", "^$", "-bench", "^BenchmarkBudgetSettlementCheck$",
		"-benchtime", fmt.Sprintf("%dx", budgetCheckIterations), "-count", "1", "./settlement")
	cmd.Dir = root
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return r, fmt.Errorf("BenchmarkBudgetSettlementCheck: %w\n%s", err, out)
	}
	m := benchMetrics(out, "BenchmarkBudgetSettlementCheck")
	r.checked, r.unchecked = m["ns/entry-checked"], m["ns/entry-unchecked"]
	if r.checked == 0 || r.unchecked == 0 {
		return r, fmt.Errorf("BenchmarkBudgetSettlementCheck printed no ns/entry figures:\n%s", out)
	}
	return r, nil
}

// benchMetrics reads the figures a child go test -bench printed on the lines of the
// benchmark name: each value before its unit ("12.5 ns/entry-checked"), by unit. A
// unit printed on several lines keeps its last value.
func benchMetrics(out []byte, name string) map[string]float64 {
	m := map[string]float64{}
	for _, line := range strings.Split(string(out), "\n") {
		if !strings.HasPrefix(line, name) {
			continue
		}
		f := strings.Fields(line)
		for i := 1; i < len(f); i++ {
			v, err := strconv.ParseFloat(f[i-1], 64)
			if _, unitIsNumber := strconv.ParseFloat(f[i], 64); err == nil && unitIsNumber != nil {
				m[f[i]] = v
			}
		}
	}
	return m
}

func (b budgetRun) createdRate() float64 {
	return float64(b.create.ByStatus["201"]) / b.create.Elapsed.Seconds()
}

func (b budgetRun) ratio() float64 { return ratio(b.createdRate(), b.grab.Rate()) }

// pathRatio is packets created per second against activities made Active per second.
func (b budgetRun) pathRatio() float64 { return ratio(b.createdRate(), b.activities.Rate()) }

// budgetPacketAmount is each benchmark packet's money: 5 shares of 100.
const budgetPacketAmount = 500

// measureBudget starts bin/grabsvc in budget mode on the benchmark's Redis and runs
// the create load, then the grab load, with o.httpClients keep-alive clients each;
// then it measures memory with packets created directly on a budget of its own.
func measureBudget(ctx context.Context, o options, root, work string, redisSrv *redistest.Server, rc redis.UniversalClient) (budgetRun, error) {
	r := budgetRun{shards: o.budgetShards, clients: o.httpClients, memPackets: o.budgetMemPackets}
	if _, err := lua.GrabLibrary.Ensure(ctx, rc); err != nil {
		return r, fmt.Errorf("loading the function library: %w", err)
	}
	limits := store.BudgetLimits{Currency: redpacketv1alpha1.DefaultCurrency, MaxTotal: 20_000, MaxCount: 100, MinShare: 1,
		Distributions: []string{split.TypeRandom, split.TypeFixed}, DefaultTTL: 24 * time.Hour, MaxTTL: 24 * time.Hour}
	uid := string(uuid.NewUUID())
	budget := store.NewBudget(rc, uid, o.budgetShards)
	if err := budget.Configure(ctx, 1_000_000_000_000, limits); err != nil {
		return r, err
	}

	// The budget-mode binary is built into the work directory: bin/ may be shared.
	grabBin, err := benchBinary(ctx, o, root, work, "grabsvc")
	if err != nil {
		return r, err
	}
	const senderToken = "bench-sender-credential"
	tokenFile := filepath.Join(work, "sender-token")
	if err := os.WriteFile(tokenFile, []byte(senderToken+"\n"), 0o600); err != nil {
		return r, err
	}
	addr, err := proc.FreeAddr()
	if err != nil {
		return r, err
	}
	logPath := filepath.Join(work, "grabsvc-budget.log")
	gp, err := proc.Start("grabsvc (budget)", logPath, redisSrv.AuthEnv(), grabBin, "--namespace", "default", "--budget", "bench",
		"--budget-uid", uid, "--budget-shards", strconv.Itoa(o.budgetShards), "--sender-token-file", tokenFile,
		"--listen", addr, "--redis-addresses", redisSrv.Addr)
	if err != nil {
		return r, err
	}
	defer gp.Stop(10 * time.Second)
	if err := proc.WaitHTTP(ctx, gp, "http://"+addr+"/readyz", 60*time.Second); err != nil {
		return r, fmt.Errorf("grab service in budget mode: %w (log: %s)", err, proc.Tail(logPath, 2000))
	}

	// The fleet's memory against the live packets: the grab service keeps nothing per
	// packet, so its resident memory with 100,000 live packets is what it is with 1,000.
	r.fleetLive = [2]int64{1_000, 100_000}
	var made int64
	for i, live := range r.fleetLive {
		if err := createPackets(ctx, "http://"+addr, senderToken, "m-", made, live); err != nil {
			return r, fmt.Errorf("creating %d live packets: %w (log: %s)", live, err, proc.Tail(logPath, 2000))
		}
		made = live
		if r.fleetRSS[i], err = residentBytes(gp.Pid()); err != nil {
			return r, err
		}
	}
	fmt.Printf("(l) the grab service's resident memory: %d MiB with %d live packets, %d MiB with %d\n",
		r.fleetRSS[0]>>20, r.fleetLive[0], r.fleetRSS[1]>>20, r.fleetLive[1])

	redisMeter := redisCPUMeter(ctx, rc)
	meters := []cpuMeter{procCPU(serverMeter, gp.Pid()), redisMeter, selfCPU()}
	fmt.Printf("(l) POST /v1/packets, 5 shares each, %d keep-alive clients, %s ... ", o.httpClients, o.httpDuration)
	r.create, err = runHTTPLoad(ctx, loadSpec{
		URL: "http://" + addr + "/v1/packets", Clients: o.httpClients, Duration: o.httpDuration, Warmup: o.httpWarmup,
		Max:    10_000_000,
		Header: map[string]string{"Authorization": "Bearer " + senderToken},
		Body: func(i int64) []byte {
			return []byte(`{"id":"o-` + strconv.FormatInt(i, 10) + `","sender":"merchant-1","totalAmount":` +
				strconv.Itoa(budgetPacketAmount) + `,"count":5,"distribution":"Fixed"}`)
		},
		Meters: meters,
	})
	if err != nil {
		return r, fmt.Errorf("create load: %w", err)
	}
	fmt.Printf("%s  CPU per request %s\n", rateLine(r.create), fmtCPU(r.create.CPU))
	if r.create.Errors > 0 || r.create.ByStatus["201"] == 0 || r.create.ByStatus["201"] != r.create.Requests {
		return r, fmt.Errorf("create answers: %v (log: %s)", r.create.ByStatus, proc.Tail(logPath, 2000))
	}
	snap, err := budget.Snapshot(ctx)
	if err != nil {
		return r, err
	}
	r.created = snap.CreatedPackets
	if r.created < r.create.ByStatus["201"] {
		return r, fmt.Errorf("the grab service answered %d creations but Redis counts %d", r.create.ByStatus["201"], r.created)
	}

	// Grab i takes share (i-1)%5 of packet o-((i-1)/5+1): distinct (packet, user) pairs,
	// all granted while there are packets left.
	fmt.Printf("(l) POST /v1/packets/{id}/grab on the same server, %d keep-alive clients, %s ... ", o.httpClients, o.httpDuration)
	r.grab, err = runHTTPLoad(ctx, loadSpec{
		Clients: o.httpClients, Duration: o.httpDuration, Warmup: o.httpWarmup, Max: 5 * r.created,
		URLOf: func(i int64) string {
			return "http://" + addr + "/v1/packets/o-" + strconv.FormatInt((i-1)/5+1, 10) + "/grab"
		},
		Body:   func(i int64) []byte { return []byte(`{"userId":"u-` + strconv.FormatInt(i, 10) + `"}`) },
		Meters: meters,
	})
	if err != nil {
		return r, fmt.Errorf("grab load: %w", err)
	}
	fmt.Printf("%s  CPU per request %s\n", rateLine(r.grab), fmtCPU(r.grab.CPU))
	if r.grab.Errors > 0 || r.grab.ByStatus["200"] == 0 {
		return r, fmt.Errorf("grab answers: %v (log: %s)", r.grab.ByStatus, proc.Tail(logPath, 2000))
	}
	if snap, err = budget.Snapshot(ctx); err != nil {
		return r, err
	}
	r.granted, r.conserved = snap.GrabbedShares, snap.Conserved()
	if !r.conserved || r.granted < r.grab.ByStatus["200"] {
		return r, fmt.Errorf("after the grab load: %+v, %d grants answered", snap, r.grab.ByStatus["200"])
	}
	fmt.Printf("    created %d packets, granted %d shares; created/s ÷ grabs/s = %.2f\n", r.created, r.granted, r.ratio())

	if err := measureBudgetMemory(ctx, rc, o.budgetShards, limits, &r); err != nil {
		return r, err
	}
	fmt.Printf("(l) Redis memory: %.0f B per live 5-share packet, %.0f B per claimed share (%d packets)\n",
		r.perLivePacket, r.perShare, r.memPackets)

	if o.budgetActivities > 0 {
		if r.activities, err = measureActivitiesActive(ctx, o, root, work, redisSrv, o.budgetActivities); err != nil {
			return r, fmt.Errorf("the resource path: %w", err)
		}
		fmt.Printf("    packets created/s ÷ activities made Active/s = %.0f\n", r.pathRatio())
	}
	if r.check, err = measureBudgetCheck(ctx, root); err != nil {
		return r, err
	}
	fmt.Print(r.checkSummary())
	if r.quotas, err = measureQuotas(ctx, root, o.budgetShards); err != nil {
		return r, err
	}
	if r.events, err = measureEvents(ctx, root); err != nil {
		return r, err
	}
	return r, nil
}

func (b budgetRun) checkSummary() string {
	if b.check.checked == 0 {
		return ""
	}
	return fmt.Sprintf("(l) settlement of a budget's grants: %.1f µs per entry with the check, %.1f µs without; ratio with/without = %.2f\n",
		b.check.checked/1000, b.check.unchecked/1000, b.check.ratio())
}

// createPackets creates the packets <prefix><from> .. <prefix><to-1> through POST
// /v1/packets with 32 concurrent clients; every one must answer 201.
func createPackets(ctx context.Context, base, token, prefix string, from, to int64) error {
	var (
		next   atomic.Int64
		failed atomic.Value
		wg     sync.WaitGroup
	)
	next.Store(from)
	hc := &http.Client{Timeout: 10 * time.Second}
	for range 32 {
		wg.Go(func() {
			for i := next.Add(1) - 1; i < to && failed.Load() == nil; i = next.Add(1) - 1 {
				body := `{"id":"` + prefix + strconv.FormatInt(i, 10) + `","sender":"merchant-1","totalAmount":` +
					strconv.Itoa(budgetPacketAmount) + `,"count":5,"distribution":"Fixed"}`
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/packets", strings.NewReader(body))
				if err != nil {
					failed.Store(err)
					return
				}
				req.Header.Set("Authorization", "Bearer "+token)
				resp, err := hc.Do(req)
				if err != nil {
					failed.Store(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusCreated {
					failed.Store(fmt.Errorf("packet %s%d: HTTP %d", prefix, i, resp.StatusCode))
					return
				}
			}
		})
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		return err
	}
	return nil
}

// residentBytes is a process's resident memory (VmRSS).
func residentBytes(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("reading the grab service's memory: %w", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("VmRSS %q: %w", rest, err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

// measureBudgetMemory creates r.memPackets packets of 5 shares on a budget of its own
// and reads used_memory before and after, then grabs every share and reads it again.
func measureBudgetMemory(ctx context.Context, rc redis.UniversalClient, shards int, limits store.BudgetLimits, r *budgetRun) error {
	b := store.NewBudget(rc, string(uuid.NewUUID()), shards)
	// Twice the money the packets need: each shard is allotted an equal part, and the
	// ids do not spread exactly evenly over the shards.
	if err := b.Configure(ctx, 2*r.memPackets*budgetPacketAmount, limits); err != nil {
		return err
	}
	n := r.memPackets
	each := func(f func(i int64) error) error {
		var next atomic.Int64
		var wg sync.WaitGroup
		var first atomic.Value
		for range 128 {
			wg.Go(func() {
				for i := next.Add(1); i <= n; i = next.Add(1) {
					if err := f(i); err != nil {
						first.CompareAndSwap(nil, err)
						return
					}
				}
			})
		}
		wg.Wait()
		if err, _ := first.Load().(error); err != nil {
			return err
		}
		return nil
	}
	id := func(i int64) string { return "mem-" + strconv.FormatInt(i, 10) }
	before, err := usedMemory(ctx, rc)
	if err != nil {
		return err
	}
	if err := each(func(i int64) error {
		_, o, err := b.CreatePacket(ctx, store.NewPacket{ID: id(i), Sender: "merchant-1", Total: budgetPacketAmount, Count: 5,
			Distribution: split.TypeRandom})
		if err == nil && o != store.CreateCreated {
			err = fmt.Errorf("creating %s: %s", id(i), o)
		}
		return err
	}); err != nil {
		return err
	}
	live, err := usedMemory(ctx, rc)
	if err != nil {
		return err
	}
	if err := each(func(i int64) error {
		for u := range 5 {
			g, err := b.GrabPacket(ctx, id(i), "user-"+strconv.Itoa(u))
			if err != nil {
				return err
			}
			if g.Outcome != store.PacketGranted {
				return fmt.Errorf("grabbing %s: %s", id(i), g.Outcome)
			}
		}
		return nil
	}); err != nil {
		return err
	}
	claimed, err := usedMemory(ctx, rc)
	if err != nil {
		return err
	}
	r.perLivePacket = float64(live-before) / float64(n)
	r.perShare = float64(claimed-live) / float64(5*n)
	return nil
}

func (b budgetRun) summary() string {
	return fmt.Sprintf("(l) budget: %.0f packets created/s through HTTP (5 shares), %.0f grabs/s, created/s ÷ grabs/s %.2f; "+
		"%.0f B per live 5-share packet, %.0f B per claimed share; grab service %d MiB with %d live packets, %d MiB with %d\n",
		b.createdRate(), b.grab.Rate(), b.ratio(), b.perLivePacket, b.perShare,
		b.fleetRSS[0]>>20, b.fleetLive[0], b.fleetRSS[1]>>20, b.fleetLive[1]) + b.pathSummary() + b.checkSummary()
}

func (b budgetRun) pathSummary() string {
	if b.activities.Activities == 0 {
		return ""
	}
	return fmt.Sprintf("(l) resource path: %d activities of 5 packets Active in %s (%.1f/s); packets created/s ÷ activities Active/s = %.0f\n",
		b.activities.Activities, fmtDur(b.activities.Elapsed), b.activities.Rate(), b.pathRatio())
}

func (b budgetRun) markdown() string {
	var s strings.Builder
	s.WriteString("\n## (l) Runtime packets of a budget\n\n")
	fmt.Fprintf(&s, "One grab service in budget mode (`--budget`, %d budget shards) on the same redis-server, "+
		"under the same Go load generator with %d keep-alive clients: first `POST /v1/packets` "+
		"(each packet 5 shares, a new order id per request, with the sender credential), then "+
		"`POST /v1/packets/{id}/grab` of those packets by distinct users (five per packet).\n\n", b.shards, b.clients)
	s.WriteString("| run | rate | p50 | p99 | CPU per request |\n|---|---|---|---|---|\n")
	fmt.Fprintf(&s, "| create, 5 shares | %.0f created/s | %s | %s | %s |\n", b.createdRate(), fmtMicros(b.create.P50),
		fmtMicros(b.create.P99), fmtCPU(b.create.CPU))
	fmt.Fprintf(&s, "| grab | %.0f grabs/s | %s | %s | %s |\n\n", b.grab.Rate(), fmtMicros(b.grab.P50),
		fmtMicros(b.grab.P99), fmtCPU(b.grab.CPU))
	fmt.Fprintf(&s, "created/s ÷ grabs/s = **%.2f** (goal ≥ 0.5); Redis counted %d packets created and %d shares "+
		"granted, and the budget's money added up after the run.\n\n", b.ratio(), b.created, b.granted)
	fmt.Fprintf(&s, "Redis memory (used_memory, %d packets created directly through the create function): "+
		"**%.0f bytes per live 5-share packet** (its hash with shares, fingerprint and detail fields, and its "+
		"due-index entry; goal ≤ 1 KiB), and %.0f bytes per claimed share (the claim in the packet's hash and "+
		"the settlement entry).\n\n", b.memPackets, b.perLivePacket, b.perShare)
	fmt.Fprintf(&s, "The grab service's resident memory (VmRSS) with %d live packets: %d MiB; with %d: %d MiB "+
		"(it keeps nothing per packet).\n", b.fleetLive[0], b.fleetRSS[0]>>20, b.fleetLive[1], b.fleetRSS[1]>>20)
	if b.activities.Activities > 0 {
		fmt.Fprintf(&s, "\nThe resource path in the same run: %d activities of 5 packets created at once on a local API "+
			"server, with the operator (bin/manager) on the same redis-server, were all Active after %s, "+
			"%.1f activities/s. Packets created per second ÷ activities made Active per second = **%.0f** "+
			"(goal ≥ 1,000).\n", b.activities.Activities, fmtDur(b.activities.Elapsed), b.activities.Rate(), b.pathRatio())
	}
	if b.check.checked > 0 {
		fmt.Fprintf(&s, "\nThe settlement check of a budget's entries (each entry's key, its packet's hash or tombstone, "+
			"and the ledger's verdicts in one script per batch), against the same settlement without it: "+
			"`BenchmarkBudgetSettlementCheck` settles the 2,000 grants of 400 packets of 5 shares on a fresh "+
			"budget of 4 shards, checked and unchecked alternately, %d times each, to a balance system that "+
			"answers 200 at once: **%.1f µs per entry checked, %.1f µs unchecked, ratio %.2f**.\n",
			b.check.iterations, b.check.checked/1000, b.check.unchecked/1000, b.check.ratio())
	}
	s.WriteString(quotasMarkdown(b.quotas))
	s.WriteString(eventsMarkdown(b.events))
	return s.String()
}
