package history

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/redis/go-redis/v9"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/controlplane"
)

// Fault kinds a schedule draws from.
const (
	faultLatency           = "latency"
	faultReset             = "reset"
	faultStall             = "stall"
	faultClientPause       = "client-pause"
	faultScriptFlush       = "script-flush"
	faultWebhookFail       = "webhook-fail"
	faultWebhookSlow       = "webhook-slow"
	faultRedisRestart      = "redis-restart"
	faultGrabRestart       = "grab-restart"
	faultControllerRestart = "controller-restart"
)

var faultKinds = []string{faultLatency, faultReset, faultStall, faultClientPause, faultScriptFlush,
	faultWebhookFail, faultWebhookSlow, faultRedisRestart, faultGrabRestart, faultControllerRestart}

// fault is one injection: its kind, when, for how long (for a restart, how long the
// service stays down) and, for a grab-restart, which activity's grab service (for a
// controller-restart of a budget run, its restart flags below). An aimed controller-restart
// (hold > 0) is timed at one of the controller's scheduled calls: the controller's
// links hold traffic for hold from then, and the controller is killed halfway
// through, so that call is in flight when it dies and its held command reaches Redis
// after the kill.
type fault struct {
	at     time.Duration
	kind   string
	dur    time.Duration
	target int
	hold   time.Duration
}

// The flags of a budget run's controller-restart (fault.target).
const (
	// restartCutsSettlement cuts the settlement's link at the kill: its commands
	// held on the link never reach Redis.
	restartCutsSettlement = 1 << iota
	// restartAtDelivery aims the restart at a settlement delivery rather than at a
	// scheduled call: the webhook holds the next delivery it gets, the links are held
	// from its arrival, and the kill comes while the delivery is in flight.
	restartAtDelivery
)

func (f fault) String() string {
	switch {
	case f.kind == faultGrabRestart:
		return fmt.Sprintf("%s(%d)@%v/%v", f.kind, f.target, f.at, f.dur)
	case f.kind == faultControllerRestart && (f.hold > 0 || f.target != 0):
		var how []string
		switch {
		case f.target&restartAtDelivery != 0:
			how = append(how, fmt.Sprintf("aimed at a delivery, hold %v", f.hold))
		case f.hold > 0:
			how = append(how, fmt.Sprintf("aimed, hold %v", f.hold))
		}
		if f.target&restartCutsSettlement != 0 {
			how = append(how, "settlement link cut")
		}
		return fmt.Sprintf("%s(%s)@%v/%v", f.kind, strings.Join(how, ", "), f.at, f.dur)
	}
	return fmt.Sprintf("%s@%v/%v", f.kind, f.at, f.dur)
}

type activitySpec struct {
	uid      string
	amounts  []int64
	users    int
	attempts []string // user ids in the order the clients try them; repeats are retries
	ctrl     []ctrlOp
	// startAt and endAt, when endAt is set, are the activity's window from the run's
	// start: grabs before startAt answer not_started and grabs from endAt ended,
	// decided by grab.lua on the Redis clock.
	startAt, endAt time.Duration
}

type ctrlOp struct {
	at time.Duration
	op Op
	// auto marks the reconcile's own close once a window has ended, which the real
	// controller does by itself (it is no spec edit).
	auto bool
}

// scenario is everything a seed decides: the activities, the rain, the controller's
// operations and the fault schedule. The interleaving is the machine's.
type scenario struct {
	seed uint64
	// operator runs the real controller (operatorScenario) instead of the stand-in.
	operator   bool
	clients    int
	deadline   time.Duration
	window     time.Duration
	activities []activitySpec
	faults     []fault
	// tenant is the activity a tenant adversary attacks during the run (tenant_test.go),
	// nil for none.
	tenant *tenantSpec
}

func newScenario(seed uint64) scenario {
	r := rand.New(rand.NewPCG(seed, 0x68697374))
	sc := scenario{seed: seed, clients: 3 + r.IntN(4), deadline: time.Duration(80+r.IntN(120)) * time.Millisecond,
		window: time.Duration(800+r.IntN(700)) * time.Millisecond}
	for a := 0; a < 2; a++ {
		spec := activitySpec{uid: fmt.Sprintf("hist-%d-%d", seed, a), users: 100 + r.IntN(301)}
		n := 40 + r.IntN(161)
		for i := 0; i < n; i++ {
			spec.amounts = append(spec.amounts, int64(1+r.IntN(200)))
		}
		for i := 0; i < spec.users; i++ {
			spec.attempts = append(spec.attempts, fmt.Sprintf("a%d-u%d", a, i))
		}
		for i := spec.users / 3; i > 0; i-- { // retries of the same users
			spec.attempts = append(spec.attempts, fmt.Sprintf("a%d-u%d", a, r.IntN(spec.users)))
		}
		r.Shuffle(len(spec.attempts), func(i, j int) { spec.attempts[i], spec.attempts[j] = spec.attempts[j], spec.attempts[i] })
		spec.ctrl = append(spec.ctrl, ctrlOp{at: time.Duration(r.IntN(100)) * time.Millisecond, op: OpOpen})
		for i := 2 + r.IntN(5); i > 0; i-- {
			op := []Op{OpPause, OpResume, OpResume, OpCloseExhausted}[r.IntN(4)]
			spec.ctrl = append(spec.ctrl, ctrlOp{at: time.Duration(r.Int64N(int64(sc.window))), op: op})
		}
		if r.IntN(2) == 0 { // a window: the rain starts before it and outlasts it
			spec.startAt = time.Duration(100+r.IntN(300)) * time.Millisecond
			spec.endAt = max(spec.startAt+200*time.Millisecond, sc.window*time.Duration(65+r.IntN(31))/100)
			// The reconcile closes the activity once the Redis clock passes the end.
			spec.ctrl = append(spec.ctrl, ctrlOp{at: spec.endAt + time.Duration(r.IntN(150))*time.Millisecond, op: OpCloseExpired, auto: true})
		} else if r.IntN(3) == 0 { // an early end racing the rain
			spec.ctrl = append(spec.ctrl, ctrlOp{at: sc.window/2 + time.Duration(r.Int64N(int64(sc.window/2))), op: OpCloseExpired})
		}
		sort.Slice(spec.ctrl, func(i, j int) bool { return spec.ctrl[i].at < spec.ctrl[j].at })
		sc.activities = append(sc.activities, spec)
	}
	for i := 4 + r.IntN(6); i > 0; i-- {
		f := fault{at: time.Duration(r.Int64N(int64(sc.window))), kind: faultKinds[r.IntN(len(faultKinds))]}
		switch f.kind {
		case faultLatency:
			f.dur = time.Duration(100+r.IntN(300)) * time.Millisecond
		case faultStall:
			f.dur = sc.deadline + time.Duration(r.IntN(300))*time.Millisecond
		case faultClientPause:
			f.dur = time.Duration(50+r.IntN(300)) * time.Millisecond
		case faultWebhookFail, faultWebhookSlow:
			f.dur = time.Duration(300+r.IntN(1000)) * time.Millisecond
		case faultGrabRestart:
			f.dur = time.Duration(20+r.IntN(130)) * time.Millisecond
			f.target = r.IntN(len(sc.activities))
		case faultControllerRestart:
			f.dur = time.Duration(20+r.IntN(180)) * time.Millisecond
			if r.IntN(2) == 0 { // aimed at a scheduled call, which it cuts
				ctrl := sc.activities[r.IntN(len(sc.activities))].ctrl
				f.at = max(ctrl[r.IntN(len(ctrl))].at-time.Millisecond, 0)
				f.hold = time.Duration(40+r.IntN(120)) * time.Millisecond
			}
		}
		sc.faults = append(sc.faults, f)
	}
	sort.Slice(sc.faults, func(i, j int) bool { return sc.faults[i].at < sc.faults[j].at })
	sc.tenant = newTenantSpec(seed)
	return sc
}

// recorder collects the operations of one run with monotonic timestamps.
type recorder struct {
	base time.Time
	mu   sync.Mutex
	ops  []porcupine.Operation
}

// add records one operation called at call and returned at ret (times read with
// time.Now, so they carry the monotonic clock).
func (r *recorder) add(client int, in, out any, call, ret time.Time) {
	r.mu.Lock()
	r.ops = append(r.ops, porcupine.Operation{ClientId: client, Input: in, Output: out,
		Call: int64(call.Sub(r.base)), Return: int64(ret.Sub(r.base))})
	r.mu.Unlock()
}

// history returns the operations with every unknown outcome (an output whose atEnd
// says so: for an activity's, unless it is Bounded) returning after the last
// completed one: the checker may place it anywhere after its call.
func (r *recorder) history() []porcupine.Operation {
	r.mu.Lock()
	defer r.mu.Unlock()
	var last int64
	for _, op := range r.ops {
		last = max(last, op.Return)
	}
	ops := append([]porcupine.Operation(nil), r.ops...)
	for i := range ops {
		if o, ok := ops[i].Output.(interface{ atEnd() bool }); ok && o.atEnd() {
			ops[i].Return = last + int64(time.Hour)
		}
	}
	return ops
}

// atEnd says whether the recorder moves the return to the end of the history.
func (o Output) atEnd() bool { return o.Unknown && !o.Bounded || o.Resolved }

// runStats is what one run adds to the soak table.
type runStats struct {
	ops, unknown, dropped, granted, firstAlready, violations, lost int
	// tenant is what the tenant adversary sent and what Redis did with it.
	tenant adversaryStats
	// faults counts the injected faults by kind; outcomes the grabs' answers by
	// outcome, with "503" for the grab service's unavailable answers and
	// "no-answer" for requests that got none.
	faults, outcomes map[string]int
	// ctrlCut and ctrlReissued are controller calls cut by a restart and calls a
	// restarted controller re-issued.
	ctrlCut, ctrlReissued int
	// op is what the real controller did in runs with the operator.
	op    operatorStats
	check time.Duration
}

func (st *runStats) add(o runStats) {
	st.ops += o.ops
	st.unknown += o.unknown
	st.dropped += o.dropped
	st.granted += o.granted
	st.firstAlready += o.firstAlready
	st.violations += o.violations
	st.lost += o.lost
	st.ctrlCut += o.ctrlCut
	st.ctrlReissued += o.ctrlReissued
	st.tenant.sent += o.tenant.sent
	st.tenant.succeeded += o.tenant.succeeded
	st.tenant.refused += o.tenant.refused
	st.tenant.failed += o.tenant.failed
	st.tenant.foreign += o.tenant.foreign
	st.op.add(o.op)
	st.check = max(st.check, o.check)
	for _, m := range []struct{ to, from *map[string]int }{{&st.faults, &o.faults}, {&st.outcomes, &o.outcomes}} {
		if *m.to == nil {
			*m.to = map[string]int{}
		}
		for k, v := range *m.from {
			(*m.to)[k] += v
		}
	}
}

// formatCounts formats a count map in the order of keys, then any other key sorted.
func formatCounts(m map[string]int, keys []string) string {
	var parts []string
	seen := map[string]bool{}
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
		seen[k] = true
	}
	var rest []string
	for k := range m {
		if !seen[k] {
			rest = append(rest, k)
		}
	}
	sort.Strings(rest)
	for _, k := range rest {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return strings.Join(parts, " ")
}

var grabOutcomeKeys = []string{string(store.Granted), string(store.AlreadyClaimed), string(store.SoldOut),
	string(store.NotStarted), string(store.Ended), string(store.Paused), "503", "no-answer"}

// checkTimeout bounds one history's check; a check that times out fails the run. A
// check slower than slowCheck leaves its history as a failed one does.
const (
	checkTimeout = 30 * time.Second
	slowCheck    = 10 * time.Second
)

// outputDir is where failed runs leave their visualization and seed.
func outputDir() string {
	if d := os.Getenv("HISTORY_OUT"); d != "" {
		return d
	}
	return filepath.Join(os.TempDir(), "redpacket-history")
}

// writeFailure leaves porcupine's visualization of a failed (or slow) history, the history
// itself as JSON (history.json: one object per operation, times in nanoseconds from
// the run's start) and its seed in outputDir()/<seed>/, and returns the
// visualization's path.
func writeFailure(model porcupine.Model, info porcupine.LinearizationInfo, history []porcupine.Operation, seed uint64, faults string) (string, error) {
	dir := filepath.Join(outputDir(), strconv.FormatUint(seed, 10))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	path := filepath.Join(dir, "history.html")
	if err := porcupine.VisualizePath(model, info, path); err != nil {
		return path, err
	}
	raw, err := json.Marshal(history)
	if err != nil {
		return path, fmt.Errorf("encoding the history: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "history.json"), raw, 0o644); err != nil {
		return path, err
	}
	return path, os.WriteFile(filepath.Join(dir, "seed"), []byte(fmt.Sprintf("HISTORY_SEED=%d\nfaults %s\n", seed, faults)), 0o644)
}

// faultTargets are what a fault acts on: the links to Redis (the fault proxies), a
// direct admin client, the Redis process, the flaky webhook, the controller's own
// links (held by an aimed controller-restart), and how to restart the i-th grab
// service and the controller (or the operator's part a run has). excuse, when set,
// is told how long a fault may keep Redis from answering.
type faultTargets struct {
	links             []*Proxy
	admin             *redis.Client
	srv               *redisProc
	flaky             *FlakyWebhook
	ctrlLinks         []*Proxy
	restartGrab       func(i int, down time.Duration) error
	restartController func(f fault, heldUntil time.Time)
	excuse            func(d time.Duration)
}

// inject plays one fault on the real processes; it returns when the fault is under
// way (a restart: when the restarted service is back).
func (ft faultTargets) inject(ctx context.Context, f fault) error {
	switch f.kind {
	case faultLatency:
		for _, p := range ft.links {
			p.SetLatency(2*time.Millisecond + f.dur/20)
			time.AfterFunc(f.dur, func() { p.SetLatency(0) })
		}
	case faultReset:
		for _, p := range ft.links {
			p.Reset()
		}
	case faultStall:
		for _, p := range ft.links {
			p.Stall(f.dur)
		}
	case faultClientPause:
		if ft.excuse != nil {
			ft.excuse(f.dur + 200*time.Millisecond)
		}
		if err := ft.admin.Do(ctx, "CLIENT", "PAUSE", strconv.FormatInt(f.dur.Milliseconds(), 10), "ALL").Err(); err != nil {
			return fmt.Errorf("CLIENT PAUSE: %w", err)
		}
	case faultScriptFlush:
		if err := ft.admin.ScriptFlush(ctx).Err(); err != nil {
			return fmt.Errorf("SCRIPT FLUSH: %w", err)
		}
		// The grab side's functions go too: grabs answer 503 until the
		// operator's function keeper loads them again.
		if err := ft.admin.FunctionFlush(ctx).Err(); err != nil {
			return fmt.Errorf("FUNCTION FLUSH: %w", err)
		}
	case faultWebhookFail:
		ft.flaky.FailFor(f.dur)
	case faultWebhookSlow:
		ft.flaky.SlowFor(f.dur)
	case faultRedisRestart:
		if ft.excuse != nil {
			ft.excuse(5 * time.Second)
		}
		if err := ft.srv.restart(); err != nil {
			return fmt.Errorf("restarting redis-server: %w", err)
		}
	case faultGrabRestart:
		if err := ft.restartGrab(f.target, f.dur); err != nil {
			return fmt.Errorf("restarting the grab service: %w", err)
		}
	case faultControllerRestart:
		var heldUntil time.Time
		if f.target&restartAtDelivery != 0 {
			// Wait for the next delivery to reach the webhook, which holds it
			// beyond the kill; without one soon, the restart comes anyway.
			select {
			case <-ft.flaky.HoldNext(2 * f.hold):
			case <-time.After(2 * time.Second):
				ft.flaky.HoldNext(0)
			}
		}
		if f.hold > 0 {
			for _, l := range ft.ctrlLinks {
				l.Stall(f.hold)
			}
			heldUntil = time.Now().Add(f.hold)
			time.Sleep(f.hold / 2)
		}
		ft.restartController(f, heldUntil)
	}
	return nil
}

// checkHistory checks a run's history with porcupine, within checkTimeout, and
// reports whether it is linearizable and how long the check took. A history that is
// not (or whose check timed out) fails the test and leaves its visualization, the
// history and the seed (writeFailure); so does, without failing, one whose check
// took over slowCheck. Checked per partition first, the failing partitions are
// logged operation by operation.
func checkHistory(t *testing.T, model porcupine.Model, history []porcupine.Operation, seed uint64, faults []fault) (bool, time.Duration) {
	t.Helper()
	start := time.Now()
	res, info := porcupine.CheckOperationsVerbose(model, history, checkTimeout)
	took := time.Since(start)
	if res == porcupine.Ok && took <= slowCheck {
		return true, took
	}
	path, err := writeFailure(model, info, history, seed, fmt.Sprint(faults))
	if err != nil {
		t.Errorf("writing the visualization: %v", err)
	}
	if res == porcupine.Ok {
		// Not a failure, but close to one: leave the history for a look at what
		// made the search long.
		t.Logf("seed %d: the check took %v (the limit is %v); visualization %s", seed, took.Round(time.Millisecond), checkTimeout, path)
		return true, took
	}
	t.Errorf("seed %d: history of %d operations is %s (not linearizable, or the check timed out); visualization %s; replay with HISTORY_SEED=%d",
		seed, len(history), res, path, seed)
	if res == porcupine.Illegal {
		logIllegalPartitions(t, model, history)
	}
	return false, took
}

// logIllegalPartitions logs the operations of every partition that alone is not
// linearizable, in call order, with the times from the run's start.
func logIllegalPartitions(t *testing.T, model porcupine.Model, history []porcupine.Operation) {
	t.Helper()
	for _, part := range model.Partition(history) {
		if porcupine.CheckOperations(model, part) {
			continue
		}
		sort.Slice(part, func(i, j int) bool { return part[i].Call < part[j].Call })
		t.Logf("a partition of %d operations is not linearizable:", len(part))
		for _, op := range part {
			t.Logf("  client %2d  %9.1fms .. %9.1fms  %s", op.ClientId, float64(op.Call)/1e6, float64(op.Return)/1e6,
				model.DescribeOperation(op.Input, op.Output))
		}
	}
}

// controllerTimeout is the deadline of each of the controller's Redis calls.
const controllerTimeout = 300 * time.Millisecond

// harness is what runs share: the Redis server and, for runs with the real
// controller, the control plane (nil for the stand-in's runs).
type harness struct {
	srv *redisProc
	cp  *controlplane.ControlPlane
}

// runActivity is one activity as a run knows it once it exists: its UID (the key of
// its Redis data and of its history's partition), the object its grab service serves,
// and its packet count and total.
type runActivity struct {
	uid   string
	obj   *redpacketv1alpha1.RedPacketActivity
	count int
	total int64
}

// fakeActivity is the object of an activity the stand-in seeds itself: the grab
// service needs only its UID, name and currency.
func fakeActivity(uid string) *redpacketv1alpha1.RedPacketActivity {
	return &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Name: uid, Namespace: "default", UID: types.UID(uid), ResourceVersion: "1"},
		Spec:       redpacketv1alpha1.RedPacketActivitySpec{Currency: "CNY"},
	}
}

func runScenario(t *testing.T, h harness, sc scenario) runStats {
	t.Helper()
	srv := h.srv
	st := runStats{faults: map[string]int{}, outcomes: map[string]int{}}
	ctx := context.Background()
	proxy, err := NewProxy(srv.Addr)
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	defer proxy.Close()
	direct := redis.NewClient(srv.Options())
	defer func() { _ = direct.Close() }()
	admin := redis.NewClient(srv.Options())
	defer func() { _ = admin.Close() }()

	receiver := rain.NewReceiver(nil)
	flaky := NewFlakyWebhook(receiver, 300*time.Millisecond, sc.seed)
	mux := http.NewServeMux()
	mux.Handle("/credit", flaky)
	hook := httptest.NewServer(mux)
	defer hook.Close()

	// The controller reaches Redis over a link of its own, faulted as the grab
	// path's is, and held by an aimed controller-restart.
	ctrlProxy, err := NewProxy(srv.Addr)
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	defer ctrlProxy.Close()
	links := []*Proxy{proxy, ctrlProxy}

	// The controller: the stand-in, which seeds the activities here and calls
	// Configure and Close itself, or the real one, which seeds and opens the
	// activities it is given and acts on spec edits.
	// start is the instant the schedule's times (faults, controller operations, the
	// rain's pace) count from.
	var (
		rec   *recorder
		ctrl  *controller
		opr   *operator
		start time.Time
		acts  = make([]runActivity, len(sc.activities))
	)
	if h.cp == nil {
		rec = &recorder{base: time.Now()}
		start = rec.base
		ctrl = newController(ctrlProxy.Addr(), controllerTimeout, rec)
		defer ctrl.Close()
		for i, a := range sc.activities {
			var total int64
			for _, v := range a.amounts {
				total += v
			}
			if _, err := store.NewActivity(direct, a.uid, 1).Seed(ctx, a.amounts, store.SeedParams{
				Count: int64(len(a.amounts)), Total: total, Sponsor: "sponsor-" + a.uid}); err != nil {
				t.Fatalf("seeding %s: %v", a.uid, err)
			}
			var startMs, endMs int64
			if a.endAt > 0 {
				startMs, endMs = rec.base.Add(a.startAt).UnixMilli(), rec.base.Add(a.endAt).UnixMilli()
			}
			ctrl.track(a.uid, sc.clients+i, startMs, endMs)
			acts[i] = runActivity{uid: a.uid, obj: fakeActivity(a.uid), count: len(a.amounts), total: total}
		}
		// The controller's "load scripts" step, and its function keeper, which
		// restores the grab-side library after a FUNCTION FLUSH within 100 ms.
		if err := store.NewActivity(direct, sc.activities[0].uid, 1).LoadScripts(ctx); err != nil {
			t.Fatalf("loading the scripts: %v", err)
		}
		keeper := controllers.NewFunctionKeeper(func(redisconn.Conn) redis.UniversalClient { return direct })
		for _, a := range sc.activities {
			keeper.Track(types.UID(a.uid), adminConn(srv.Addr))
		}
		kctx, stopKeeper := context.WithCancel(ctx)
		defer stopKeeper()
		go func() { _ = keeper.Start(kctx) }()
	} else {
		opr = startOperator(t, h.cp, srv.Addr, ctrlProxy)
		defer opr.Stop()
		rec = &recorder{base: time.Now()}
		acts, start = opr.Create(rec, &sc, hook.URL+"/credit", direct)
	}

	counts := map[string]int{}
	var totals = map[string]int64{}
	svcs := map[string]*grabService{}
	var svcList []*grabService
	wctx, stopWorkers := context.WithCancel(ctx)
	var workers sync.WaitGroup
	defer func() { stopWorkers(); workers.Wait() }()
	// settle starts the settlement worker of an activity, delivering to the balance
	// system behind the flaky webhook.
	// With the seeded amounts known (the stand-in seeds them itself), the worker checks
	// every entry against them and the activity's ledger, as the operator's do, after
	// announcing the budget.
	settle := func(uid, activity string, amounts []int64) {
		wc := redis.NewClient(srv.Options())
		t.Cleanup(func() { _ = wc.Close() })
		cfg := settlement.Config{
			Redis: wc, Source: sourceOf(activity, uid),
			WebhookURL: hook.URL + "/credit", MaxAttempts: 100000, Consumer: "history", ClaimIdle: time.Second,
			HTTPClient: &http.Client{Timeout: 200 * time.Millisecond}, BackoffBase: 10 * time.Millisecond,
			BackoffMax: 100 * time.Millisecond, Block: 100 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		}
		if amounts != nil {
			var total int64
			for _, v := range amounts {
				total += v
			}
			cfg.Allowance = &settlement.Allowance{Total: total, Count: int64(len(amounts)), Amounts: amounts, At: time.Now()}
			for try := 0; ; try++ {
				err := settlement.AnnounceAllowance(ctx, cfg, 1)
				if err == nil {
					break
				}
				if try == 50 {
					t.Fatalf("announcing the budget of %s: %v", uid, err)
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
		w, err := settlement.NewWorker(cfg)
		if err != nil {
			t.Fatalf("settlement worker: %v", err)
		}
		workers.Add(1)
		go func() {
			defer workers.Done()
			if err := w.Run(wctx); err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("settlement worker %s: %v", uid, err)
			}
		}()
	}
	for i, a := range acts {
		counts[a.uid], totals[a.uid] = a.count, a.total
		svc, err := newGrabService(a.obj, proxy.Addr(), sc.deadline)
		if err != nil {
			t.Fatalf("grab service of %s: %v", a.uid, err)
		}
		defer svc.Close()
		svcs[a.uid] = svc
		svcList = append(svcList, svc)
		var amounts []int64
		if opr == nil {
			amounts = sc.activities[i].amounts
		}
		settle(a.uid, a.obj.Namespace+"/"+a.obj.Name, amounts)
	}
	// The tenant's activity and its adversary (stand-in runs only).
	var tenant *tenantRun
	if sc.tenant != nil && opr == nil {
		var foreign []string
		for _, a := range acts {
			foreign = append(foreign, a.uid)
		}
		tenant = startTenant(t, ctx, srv, direct, proxy.Addr(), sc.tenant, foreign, sc.deadline, sc.window, sc.seed)
		settle(sc.tenant.uid, "default/"+sc.tenant.uid, sc.tenant.amounts)
	}

	var wg sync.WaitGroup
	// The faults.
	faultsDone := make(chan struct{})
	var faultEnd time.Duration
	for _, f := range sc.faults {
		faultEnd = max(faultEnd, f.at+f.dur, f.at+f.hold)
		st.faults[f.kind]++
	}
	targets := faultTargets{links: links, admin: admin, srv: srv, flaky: flaky, ctrlLinks: []*Proxy{ctrlProxy},
		restartGrab: func(i int, down time.Duration) error { return svcList[i].Restart(down) },
		restartController: func(f fault, heldUntil time.Time) {
			if opr != nil {
				opr.Restart(f.dur, heldUntil)
			} else {
				ctrl.Restart(f.dur)
			}
		}}
	if tenant != nil {
		targets.excuse = tenant.ping.excuse
	}
	go func() {
		defer close(faultsDone)
		for _, f := range sc.faults {
			time.Sleep(time.Until(start.Add(f.at)))
			if err := targets.inject(ctx, f); err != nil {
				t.Errorf("seed %d: %v", sc.seed, err)
			}
		}
	}()
	// The controller's schedule, one goroutine per activity: the stand-in's calls,
	// or the spec edits the real controller is to act on.
	for i, a := range sc.activities {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, c := range a.ctrl {
				time.Sleep(time.Until(start.Add(c.at)))
				if opr != nil {
					opr.Apply(i, c.op)
				} else {
					ctrl.Apply(a.uid, c.op)
				}
			}
		}()
	}
	// The rain: clients take attempts from both activities in turn, each over HTTP
	// through the activity's grab service.
	type attempt struct{ uid, user string }
	var all []attempt
	for k := 0; ; k++ {
		more := false
		for i, a := range sc.activities {
			if k < len(a.attempts) {
				all = append(all, attempt{acts[i].uid, a.attempts[k]})
				more = true
			}
		}
		if !more {
			break
		}
	}
	pace := sc.window * time.Duration(sc.clients) / time.Duration(len(all))
	var outMu sync.Mutex
	for c := 0; c < sc.clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(sc.seed, uint64(c)))
			tr := &http.Transport{MaxIdleConnsPerHost: 4}
			defer tr.CloseIdleConnections()
			// A grab the server gives up on answers 503 after its Redis deadline;
			// the client waits a little longer for that answer.
			hc := &http.Client{Transport: tr, Timeout: sc.deadline + 300*time.Millisecond}
			for k := c; k < len(all); k += sc.clients {
				at := all[k]
				call := time.Now()
				out, status, err := svcs[at.uid].Grab(hc, at.user)
				ret := time.Now()
				if err != nil {
					t.Errorf("seed %d: grab of %s by %s: %v", sc.seed, at.uid, at.user, err)
				}
				in := Input{Activity: at.uid, Op: OpGrab, User: at.user, NotBeforeMs: call.UnixMilli()}
				key := string(out.Outcome)
				switch {
				case !out.Unknown:
					in.NotAfterMs = ret.UnixMilli()
				case status == http.StatusServiceUnavailable:
					key = "503"
				default:
					key = "no-answer"
				}
				outMu.Lock()
				st.outcomes[key]++
				outMu.Unlock()
				rec.add(c, in, out, call, ret)
				time.Sleep(time.Duration(r.Int64N(int64(2*pace) + 1)))
			}
		}()
	}
	wg.Wait()
	<-faultsDone
	time.Sleep(time.Until(start.Add(faultEnd)))
	if opr == nil {
		ctrl.Wait()
		ctrl.Close()
		// The end: every activity is closed, which refunds the remainder.
		for i, a := range acts {
			act := store.NewActivity(direct, a.uid, 1)
			for try := 0; ; try++ {
				if closeDirect(rec, sc.clients+i, act, a.uid) {
					break
				}
				if try == 20 {
					t.Fatalf("seed %d: closing %s failed 20 times", sc.seed, a.uid)
				}
			}
		}
		st.ctrlCut, st.ctrlReissued = ctrl.cut, ctrl.reissued
	} else {
		// The end: the controller acts on the edits still pending, then closes every
		// activity on an edit of its endTime, which refunds the remainder.
		opr.Wait(editWait)
		opr.CloseAll(direct)
		opr.Flush()
	}
	history := rec.history()
	// firstAlready counts grabs answered already_claimed with no earlier call of the
	// same user that could have claimed: the grab path's client retried after a lost
	// reply (see stepGrab).
	byCall := append([]porcupine.Operation(nil), history...)
	sort.Slice(byCall, func(i, j int) bool { return byCall[i].Call < byCall[j].Call })
	type userKey struct{ activity, user string }
	mayHold := map[userKey]bool{}
	for _, op := range byCall {
		in, o := op.Input.(Input), op.Output.(Output)
		if in.Op != OpGrab {
			continue
		}
		k := userKey{in.Activity, in.User}
		switch {
		case o.Unknown:
			st.unknown++
		case o.Outcome == store.Granted:
			st.granted++
		case o.Outcome == store.AlreadyClaimed && !mayHold[k]:
			st.firstAlready++
		}
		if o.Unknown || o.Outcome == store.Granted || o.Outcome == store.AlreadyClaimed {
			mayHold[k] = true
		}
	}

	if tenant != nil {
		tenant.end(ctx, direct)
	}

	// Settlement drains: every claim and the refund reach the balance system.
	deadline := time.Now().Add(60 * time.Second)
	for _, a := range acts {
		act := store.NewActivity(direct, a.uid, 1)
		for {
			snap, err := act.Snapshot(ctx)
			if err == nil && snap.SettledCount == snap.ClaimedCount && snap.RefundSettled == snap.Refunded {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("seed %d: settlement of %s did not drain: %+v, %v", sc.seed, a.uid, snap, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if tenant != nil {
		// The tenant's activity may never drain (the adversary may have broken its
		// consumer group): what matters is what was credited by then.
		time.Sleep(500 * time.Millisecond)
	}
	stopWorkers()
	workers.Wait()
	if tenant != nil {
		st.violations += tenant.check(t, sc.seed, receiver)
		st.tenant = tenant.adv.snapshot()
	}

	// The final read of the claims, which also resolves the unknown grabs.
	final := map[string]map[string]string{}
	for _, a := range acts {
		claims, err := store.NewActivity(direct, a.uid, 1).Shard(0).Claims(ctx)
		if err != nil {
			t.Fatalf("claims: %v", err)
		}
		final[a.uid] = map[string]string{}
		for user, c := range claims {
			final[a.uid][user] = c.PacketID
		}
	}
	var phantoms []string
	history, st.dropped, phantoms = Resolve(history, final)
	if len(phantoms) > 0 {
		st.violations++
		t.Errorf("seed %d: users hold packets no grab of theirs can have given: %v", sc.seed, phantoms)
	}
	st.ops = len(history)

	// Linearizability.
	var ok bool
	if ok, st.check = checkHistory(t, Model(counts), history, sc.seed, sc.faults); !ok {
		st.violations++
	}

	// Conservation and acknowledged grants.
	acked := map[string]map[string]string{} // activity -> user -> packet acknowledged
	for _, op := range history {
		in, out := op.Input.(Input), op.Output.(Output)
		if in.Op == OpGrab && (out.Outcome == store.Granted || out.Outcome == store.AlreadyClaimed) {
			if acked[in.Activity] == nil {
				acked[in.Activity] = map[string]string{}
			}
			acked[in.Activity][in.User] = out.Packet
		}
	}
	tot := receiver.Totals()
	if tot.Conflicts != 0 || tot.UsersCreditedTwice != 0 || tot.BadRequests != 0 {
		t.Errorf("seed %d: balance system: %+v", sc.seed, tot)
	}
	for i, a := range acts {
		act := store.NewActivity(direct, a.uid, 1)
		claims, err := act.Shard(0).Claims(ctx)
		if err != nil {
			t.Fatalf("claims: %v", err)
		}
		snap, err := act.Snapshot(ctx)
		if err != nil {
			t.Fatalf("snapshot: %v", err)
		}
		// With the AOF fsynced on every write, Redis never comes back below a
		// watermark a grab service saw, so no grab may have fenced the activity.
		if snap.Fenced != "" {
			st.violations++
			t.Errorf("seed %d: %s is fenced (%s): Redis came back older than a grant a grab service saw", sc.seed, a.uid, snap.Fenced)
		}
		credited, refund := receiver.Credited(a.uid)
		byPacket := map[string]string{}
		var claimed int64
		for user, c := range claims {
			if prev, dup := byPacket[c.PacketID]; dup {
				t.Errorf("seed %d: %s: packet %s held by %s and %s", sc.seed, a.uid, c.PacketID, prev, user)
			}
			byPacket[c.PacketID] = user
			claimed += c.Amount
			d, ok := credited[c.PacketID]
			if !ok || d.UserID != user || d.Amount != c.Amount {
				t.Errorf("seed %d: %s: claim %s=%s:%d credited as %+v (%t)", sc.seed, a.uid, user, c.PacketID, c.Amount, d, ok)
			}
		}
		if len(credited) != len(claims) || int64(len(claims)) != snap.ClaimedCount {
			t.Errorf("seed %d: %s: %d claims, %d credited, claimed_count %d", sc.seed, a.uid, len(claims), len(credited), snap.ClaimedCount)
		}
		if claimed+snap.Refunded != totals[a.uid] || claimed != snap.ClaimedAmount || refund != snap.Refunded {
			t.Errorf("seed %d: %s: claimed %d + refunded %d (credited refund %d) != total %d", sc.seed, a.uid, claimed, snap.Refunded, refund, totals[a.uid])
		}
		for user, p := range acked[a.uid] {
			if c, ok := claims[user]; !ok || c.PacketID != p {
				st.lost++
				t.Errorf("seed %d: %s: %s was acknowledged packet %s, Redis holds %+v", sc.seed, a.uid, user, p, c)
			} else if d, ok := credited[p]; !ok || d.UserID != user {
				st.lost++
				t.Errorf("seed %d: %s: %s was acknowledged packet %s, never credited", sc.seed, a.uid, user, p)
			}
		}
		if opr != nil {
			// The controller's account of the end: its status counters are Redis's,
			// the claims are the history's grants, and the refund is the rest.
			opr.CheckStatus(i, act, sc.seed, a.total, claimed, len(claims), len(acked[a.uid]))
		}
	}
	if opr != nil {
		st.op = opr.Stats()
		st.violations += st.op.contradictions
	}
	return st
}

// closeDirect closes an activity as expired at the end of a run, on a direct client,
// and records the call; it reports whether the outcome is known.
func closeDirect(rec *recorder, client int, act *store.Activity, uid string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	call := time.Now()
	res, err := act.Close(ctx, store.CloseExpired)
	out := closeOutput(res, err)
	rec.add(client, Input{Activity: uid, Op: OpCloseExpired}, out, call, time.Now())
	return !out.Unknown
}

func envInt(name string, def int) int {
	if v := os.Getenv(name); v != "" {
		if n, err := strconv.Atoi(v); err == nil {
			return n
		}
	}
	return def
}

// TestRandomizedHistories runs seeded rains under faults with the stand-in controller
// and checks every history (HISTORY_RUNS runs, default 6; HISTORY_SEED replays one
// seed). It ends with the table of all runs: operations checked, faults injected by
// kind, violations and acknowledged grants lost (both must be 0), and the grabs'
// answers.
func TestRandomizedHistories(t *testing.T) {
	srv := startRedis(t)
	runSeeds(t, harness{srv: srv}, envInt("HISTORY_RUNS", 6), newScenario)
}

// seeds returns the seeds of a test's runs: HISTORY_SEED alone, or runs seeds from
// the clock.
func seeds(t *testing.T, runs int) []uint64 { return seedsOf(t, "HISTORY_SEED", runs) }

// seedsOf is the seed in the variable env alone when it is set (a replay), else runs
// seeds from the clock.
func seedsOf(t *testing.T, env string, runs int) []uint64 {
	t.Helper()
	if s := os.Getenv(env); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("%s=%q: %v", env, s, err)
		}
		return []uint64{n}
	}
	base := uint64(time.Now().UnixNano())
	out := make([]uint64, runs)
	for i := range out {
		out[i] = base + uint64(i)
	}
	return out
}

// runSeeds runs and checks the scenarios of the seeds, logs one line per run, stops
// at the first failed run, and ends with the table of all runs.
func runSeeds(t *testing.T, h harness, runs int, scenarioOf func(uint64) scenario) {
	t.Helper()
	var sum runStats
	windowed, done := 0, 0
	start := time.Now()
	for _, seed := range seeds(t, runs) {
		sc := scenarioOf(seed)
		begin := time.Now()
		st := runScenario(t, h, sc)
		done++
		var windows []string
		for _, a := range sc.activities {
			if a.endAt > 0 {
				windowed++
				windows = append(windows, fmt.Sprintf("%s %v..%v", a.uid, a.startAt, a.endAt))
			}
		}
		ctrlLine := fmt.Sprintf("controller calls cut %d, re-issued %d; tenant adversary %s", st.ctrlCut, st.ctrlReissued, st.tenant)
		if sc.operator {
			ctrlLine = "operator: " + st.op.String()
		}
		t.Logf("seed %d: %d clients, %d+%d packets, windows %v, %d ops (%d granted, %d unknown of which %d changed nothing, %d first-call already_claimed; answers %s; %s), faults %v: %d violations, %d lost (%v, check %v)",
			sc.seed, sc.clients, len(sc.activities[0].amounts), len(sc.activities[1].amounts), windows, st.ops, st.granted, st.unknown, st.dropped, st.firstAlready,
			formatCounts(st.outcomes, grabOutcomeKeys), ctrlLine,
			sc.faults, st.violations, st.lost, time.Since(begin).Round(time.Millisecond), st.check.Round(time.Millisecond))
		sum.add(st)
		if t.Failed() {
			t.Logf("stopping after seed %d; replay with HISTORY_SEED=%d go test -run '^%s$' ./test/history/", sc.seed, sc.seed, t.Name())
			break
		}
	}
	nFaults := 0
	for _, n := range sum.faults {
		nFaults += n
	}
	ctrlLine := fmt.Sprintf("stand-in controller calls cut %d, re-issued %d\ntenant adversary: %s", sum.ctrlCut, sum.ctrlReissued, sum.tenant)
	if h.cp != nil {
		ctrlLine = "real controller: " + sum.op.String()
	}
	t.Logf("\n%-5s %-11s %-7s %-11s %-26s %-14s\n%-5d %-11d %-7d %-11d %-26d %-14d\n"+
		"faults by kind:   %s\n"+
		"grab answers:     %s\n"+
		"unknown outcomes: %d (%d changed nothing); first-call already_claimed %d; windowed activities %d\n"+
		"%s\n"+
		"(%v; slowest check %v)",
		"runs", "operations", "faults", "violations", "acknowledged-grants-lost", "real-restarts",
		done, sum.ops, nFaults, sum.violations, sum.lost, sum.op.restarts,
		formatCounts(sum.faults, faultKinds), formatCounts(sum.outcomes, grabOutcomeKeys),
		sum.unknown, sum.dropped, sum.firstAlready, windowed, ctrlLine,
		time.Since(start).Round(time.Millisecond), sum.check.Round(time.Millisecond))
}

// sourceOf is the settlement source of the activity "<namespace>/<name>" with uid.
func sourceOf(activity, uid string) settlement.Source {
	ns, name, _ := strings.Cut(activity, "/")
	return settlement.Source{Namespace: ns, Name: name, UID: uid, Currency: "CNY"}
}
