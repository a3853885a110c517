package history

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrlruntime "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
)

// Budget histories that lose their data. The budget of each run is a real
// RedPacketBudget, reconciled by the real controller with its expiry driver and its
// settlement runner (delivering to a balance system that requires the
// announcement), on a redis-server of its own that keeps an append-only file
// fsynced on every write. Clients create and grab its packets through two real
// packet servers for the whole run. At a seeded instant the budget's data is lost,
// one of:
//
//   - flushall: FLUSHALL, as a restart without persistence or a failover to an
//     empty replica;
//   - older-aof: the server is killed and started again on a copy of its
//     append-only files taken seconds earlier, after the status recorded more
//     packets than the copy holds (a restore of an older backup).
//
// The promise checked, with the faults' worst timing the run can reach (the
// clients keep calling across the loss, the restart and the fence):
//
//   - the budget ends fenced: Stalled DataLost (flushall) or RedisRolledBack
//     (older-aof), and every shard's meta holds the fence;
//   - never re-funded: no announcement reaches the balance system after the loss,
//     and from the moment the status shows the fence, for at least 2s of calls,
//     Redis allots nothing (the shards' total stays what the loss left: 0 after a
//     FLUSHALL, the copy's after a restore), nothing is appended to any shard's
//     stream (no creation, grant or refund of the older data), and every creation
//     and grab answers 503;
//   - the balance system never refuses a credit as beyond the announced total.
//
// What the fleet grants between the loss and the operator's next reading (at most
// one resync period, 300ms here) is the window docs/budgets.md states; the run
// reports the answers it gave.
type budgetLossRun struct {
	kind                string
	shards              int
	calls, window       int
	fenced503           int
	detect              time.Duration
	refusedOver, repeat int64
	conflicts           int64
}

// budgetLossKinds are the two ways a run loses its budget's data.
var budgetLossKinds = []string{"flushall", "older-aof"}

// runBudgetLoss plays one run (see budgetLossRun).
func runBudgetLoss(t *testing.T, seed uint64) budgetLossRun {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, seed^0x5eed1055))
	run := budgetLossRun{kind: budgetLossKinds[seed%2], shards: 1 + r.IntN(4)}
	defer func() {
		if t.Failed() {
			t.Logf("the loss run of seed %d (%s, %d shards) failed; replay with HISTORY_LOSS_SEED=%d HISTORY_BUDGET_RUNS=0 go test -run '^TestBudgetHistories$' ./test/history/",
				seed, run.kind, run.shards, seed)
		}
	}()
	cp := controlPlane(t)
	srv := startRedis(t)
	ns := cp.Namespace(t)
	ctx := context.Background()
	admin := redis.NewClient(srv.Options())
	defer func() { _ = admin.Close() }()

	// The balance system, and the lossAt after which no announcement may reach it.
	receiver := rain.NewReceiver([]byte(lossSigningKey))
	receiver.RequireBudget = true
	var lossAt atomic.Int64
	var lateAnnouncements atomic.Int32
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if at := lossAt.Load(); at != 0 && time.Now().UnixNano() > at && strings.Contains(req.Header.Get("Idempotency-Key"), "/budget:") {
			lateAnnouncements.Add(1)
		}
		receiver.ServeHTTP(w, req)
	}))
	defer hook.Close()
	hu, _ := url.Parse(hook.URL)
	keys := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "settlement-keys"},
		Data: map[string][]byte{hu.Hostname() + controllers.AllowlistPortSeparator + hu.Port(): []byte(lossSigningKey)}}
	if err := cp.Client.Create(ctx, keys); err != nil {
		t.Fatalf("creating the settlement keys: %v", err)
	}
	stopOperator := startBudgetController(t, ns, srv.Addr, keys)
	defer stopOperator()

	const total = 10_000_000
	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "lossy"},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{Total: total, BudgetShards: int32(run.shards),
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 2000, MaxCount: 8,
				Distributions: []redpacketv1alpha1.DistributionType{redpacketv1alpha1.DistributionRandom, redpacketv1alpha1.DistributionFixed},
				DefaultTTL:    &metav1.Duration{Duration: 2 * time.Second}, MaxTTL: &metav1.Duration{Duration: 5 * time.Second}},
			Settlement: &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: hook.URL + "/credit"}}},
	}
	if err := cp.Client.Create(ctx, b); err != nil {
		t.Fatalf("creating the budget: %v", err)
	}
	b = waitBudget(t, cp.Client, ns, "lossy", 30*time.Second, "configured", func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return b.Status.Total != nil && *b.Status.Total == total
	})
	uid := string(b.UID)
	h := store.NewBudget(admin, uid, run.shards)
	gb := grabsvc.Budget{Namespace: ns, Name: "lossy", UID: b.UID, Shards: run.shards}
	var svcs [2]*grabService
	for i := range svcs {
		var err error
		if svcs[i], err = newPacketService(gb, []byte(budgetSender), srv.Addr, 500*time.Millisecond, store.Quotas{}, false); err != nil {
			t.Fatalf("packet server: %v", err)
		}
		defer svcs[i].Close()
	}

	// The clients: creations and grabs until stop, each answer kept with its call's
	// start.
	type answer struct {
		call   time.Time
		status int
		op     string
	}
	var (
		mu      sync.Mutex
		answers []answer
		created []string
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := range 6 {
		cr := rand.New(rand.NewPCG(seed, uint64(c)))
		wg.Go(func() {
			hc := &http.Client{Timeout: 2 * time.Second}
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				base := *svcs[cr.IntN(2)].url.Load()
				mu.Lock()
				var id string
				if len(created) > 0 && cr.IntN(3) > 0 {
					id = created[cr.IntN(len(created))]
				}
				mu.Unlock()
				call := time.Now()
				var status int
				op := "grab"
				if id == "" {
					op, id = "create", fmt.Sprintf("order-%d-%d", c, n)
					q := packetRequest{Sender: "merchant-1", TotalAmount: 100 + cr.Int64N(1901), Count: 1 + cr.Int64N(8),
						Distribution: []string{split.TypeRandom, split.TypeFixed}[cr.IntN(2)], TTLSeconds: 1 + cr.Int64N(3)}
					status = postJSON(hc, base+"/v1/packets", budgetSender, struct {
						ID string `json:"id"`
						packetRequest
					}{id, q})
				} else {
					status = postJSON(hc, base+"/v1/packets/"+id+"/grab", "", map[string]string{"userId": fmt.Sprintf("user-%d", cr.IntN(40))})
				}
				mu.Lock()
				answers = append(answers, answer{call: call, status: status, op: op})
				if op == "create" && status == http.StatusCreated {
					created = append(created, id)
				}
				mu.Unlock()
				time.Sleep(time.Duration(2+cr.IntN(10)) * time.Millisecond)
			}
		})
	}
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}()

	// The loss.
	time.Sleep(time.Duration(500+r.IntN(1000)) * time.Millisecond)
	var older map[string][]byte
	if run.kind == "older-aof" {
		var err error
		if older, err = copyAOF(srv.dir); err != nil {
			t.Fatalf("copying the append-only files: %v", err)
		}
		// The copy holds at most the packets created by now (a creation in flight
		// may land in the copy too, but none of a later reading): the operator can
		// only tell an older state from marks its status recorded above it.
		after, err := h.Snapshot(ctx)
		if err != nil {
			t.Fatalf("snapshot after the copy: %v", err)
		}
		waitBudget(t, cp.Client, ns, "lossy", 20*time.Second, "a status above the copy", func(b *redpacketv1alpha1.RedPacketBudget) bool {
			return b.Status.CreatedPackets != nil && *b.Status.CreatedPackets > after.CreatedPackets
		})
		time.Sleep(time.Duration(r.IntN(300)) * time.Millisecond)
	} else {
		time.Sleep(time.Duration(500+r.IntN(1000)) * time.Millisecond)
	}
	lost := time.Now()
	lossAt.Store(lost.UnixNano())
	switch run.kind {
	case "flushall":
		if err := admin.FlushAll(ctx).Err(); err != nil {
			t.Fatalf("FLUSHALL: %v", err)
		}
	default:
		srv.kill()
		if err := restoreAOF(srv.dir, older); err != nil {
			t.Fatalf("restoring the older append-only files: %v", err)
		}
		if err := srv.start(); err != nil {
			t.Fatalf("restarting redis-server on the older files: %v", err)
		}
	}
	after, err := h.Snapshot(ctx)
	if err != nil {
		t.Fatalf("snapshot after the loss: %v", err)
	}
	wantReason := map[string]string{"flushall": redpacketv1alpha1.ReasonDataLost, "older-aof": redpacketv1alpha1.ReasonRedisRolledBack}[run.kind]
	waitBudget(t, cp.Client, ns, "lossy", 15*time.Second, "Stalled "+wantReason, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled)
		return c != nil && c.Status == metav1.ConditionTrue && c.Reason == wantReason
	})
	seen := time.Now()
	run.detect = seen.Sub(lost)

	// From here on: nothing allotted, appended or answered but 503.
	lastIDs := func() []string {
		out := make([]string, run.shards)
		for i := range out {
			info, err := admin.XInfoStream(ctx, h.ShardKeys(i).Stream).Result()
			switch {
			case err == nil:
				out[i] = info.LastGeneratedID
			case errors.Is(err, redis.Nil) || strings.Contains(err.Error(), "no such key"):
				out[i] = "none"
			default:
				t.Errorf("seed %d: reading shard %d's stream: %v", seed, i, err)
			}
		}
		return out
	}
	atFence := lastIDs()
	for i := range run.shards {
		if v, err := admin.HGet(ctx, h.ShardKeys(i).Meta, "fenced").Result(); v != wantReason {
			t.Errorf("seed %d: shard %d's fence once the status shows it: %q, %v; want %s", seed, i, v, err, wantReason)
		}
	}
	time.Sleep(2500 * time.Millisecond)
	close(stop)
	wg.Wait()
	end, err := h.Snapshot(ctx)
	if err != nil {
		t.Fatalf("snapshot at the end: %v", err)
	}
	if end.Total != after.Total || end.Available > after.Available {
		t.Errorf("seed %d: the shards after the fence: total %d, available %d; just after the loss %d, %d: the budget was funded again",
			seed, end.Total, end.Available, after.Total, after.Available)
	}
	if run.kind == "flushall" && end.Total != 0 {
		t.Errorf("seed %d: a flushed budget holds a total of %d again", seed, end.Total)
	}
	if got := lastIDs(); fmt.Sprint(got) != fmt.Sprint(atFence) {
		t.Errorf("seed %d: the shards' streams moved after the fence (%v, then %v): something was created, granted or refunded", seed, atFence, got)
	}
	if n := lateAnnouncements.Load(); n != 0 {
		t.Errorf("seed %d: %d announcements reached the balance system after the loss", seed, n)
	}
	now := getBudget(t, cp.Client, ns, "lossy")
	if c := meta.FindStatusCondition(now.Status.Conditions, redpacketv1alpha1.ConditionStalled); c == nil || c.Reason != wantReason ||
		now.Status.Total == nil || *now.Status.Total != total {
		t.Errorf("seed %d: the status at the end: %+v; want still Stalled %s with its total mark %d", seed, now.Status, wantReason, total)
	}
	mu.Lock()
	for _, a := range answers {
		run.calls++
		switch {
		case a.call.After(seen) && a.status != http.StatusServiceUnavailable:
			t.Errorf("seed %d: a %s called %v after the status showed the fence answered %d; want 503", seed, a.op,
				a.call.Sub(seen).Round(time.Millisecond), a.status)
		case a.call.After(seen):
			run.fenced503++
		case a.call.After(lost) && a.status/100 == 2:
			run.window++
		}
	}
	mu.Unlock()
	if run.fenced503 == 0 {
		t.Errorf("seed %d: no call was made after the fence showed", seed)
	}
	tot := receiver.Totals()
	run.refusedOver, run.repeat, run.conflicts = tot.OverBudget, tot.Repeats, tot.Conflicts
	if tot.OverBudget != 0 {
		t.Errorf("seed %d: the balance system refused %d credits beyond the announced total", seed, tot.OverBudget)
	}
	return run
}

// lossSigningKey signs the loss runs' deliveries.
const lossSigningKey = "history-loss-signing-key"

// startBudgetController runs the budget controller of main.go (the reconciler, its
// expiry driver and its settlement runner) for namespace ns on a manager of its
// own, with the default Redis at redisAddr and short periods. It returns its stop.
func startBudgetController(t *testing.T, ns, redisAddr string, keys *corev1.Secret) func() {
	t.Helper()
	cp := controlPlane(t)
	grace := 20 * time.Second
	mgr, err := ctrlruntime.NewManager(cp.Config, ctrlruntime.Options{
		Scheme:                  cp.Scheme,
		Metrics:                 metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress:  "0",
		Cache:                   controllers.CacheOptions(ns),
		GracefulShutdownTimeout: &grace,
	})
	if err != nil {
		t.Fatalf("creating the manager: %v", err)
	}
	opts := controllers.Options{
		DefaultRedis:         adminConn(redisAddr),
		AllowedRedisHosts:    controllers.MustParseRedisHosts("127.0.0.1"),
		GrabImage:            "registry.example/redpacket-operator:history",
		RedisTimeout:         controllerRedisTimeout,
		ActiveResyncPeriod:   300 * time.Millisecond,
		CleanupPollInterval:  200 * time.Millisecond,
		MaxBackoff:           500 * time.Millisecond,
		SettlementKeysSecret: types.NamespacedName{Namespace: keys.Namespace, Name: keys.Name},
		SettlementConsumer:   "history-operator",
		SettlementRegisterer: prometheus.NewRegistry(),
		Name:                 fmt.Sprintf("history-rpb-%s-%d", ns, managerSeq.Add(1)),
		SkipNameValidation:   true,
	}
	expiry := controllers.NewBudgetExpiry()
	expiry.Interval = 50 * time.Millisecond
	if err := mgr.Add(expiry); err != nil {
		t.Fatal(err)
	}
	runner := controllers.NewBudgetSettlementRunner(mgr.GetAPIReader(), nil, opts)
	if err := mgr.Add(runner); err != nil {
		t.Fatal(err)
	}
	r := &controllers.RedPacketBudgetReconciler{Expiry: expiry, Settlement: runner, Options: opts}
	if err := r.SetupWithManager(mgr); err != nil {
		t.Fatalf("setting up the budget controller: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	sctx, scancel := context.WithTimeout(ctx, 30*time.Second)
	defer scancel()
	for _, obj := range grabWorkloadKinds {
		if _, err := mgr.GetCache().GetInformer(sctx, obj); err != nil {
			cancel()
			t.Fatalf("informer of %T: %v", obj, err)
		}
	}
	if !mgr.GetCache().WaitForCacheSync(sctx) {
		cancel()
		t.Fatal("the manager's cache did not sync")
	}
	return func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("the budget controller stopped with an error: %v", err)
			}
		case <-time.After(60 * time.Second):
			t.Errorf("the budget controller did not stop within 60s")
		}
	}
}

// waitBudget polls the budget ns/name until ok holds, failing the test after within.
func waitBudget(t *testing.T, c client.Client, ns, name string, within time.Duration, what string,
	ok func(*redpacketv1alpha1.RedPacketBudget) bool) *redpacketv1alpha1.RedPacketBudget {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		b := getBudget(t, c, ns, name)
		if ok(b) {
			return b
		}
		if time.Now().After(deadline) {
			t.Fatalf("budget %s/%s: %s did not happen within %v; status %+v", ns, name, what, within, b.Status)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// getBudget reads the budget ns/name from the API server.
func getBudget(t *testing.T, c client.Client, ns, name string) *redpacketv1alpha1.RedPacketBudget {
	t.Helper()
	b := &redpacketv1alpha1.RedPacketBudget{}
	if err := c.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, b); err != nil {
		t.Fatalf("reading budget %s/%s: %v", ns, name, err)
	}
	return b
}

// postJSON posts body as JSON (with a bearer token when one is given) and returns
// the answer's status, 0 when none came.
func postJSON(c *http.Client, u, bearer string, body any) int {
	raw, err := json.Marshal(body)
	if err != nil {
		return 0
	}
	req, err := http.NewRequest(http.MethodPost, u, strings.NewReader(string(raw)))
	if err != nil {
		return 0
	}
	req.Header.Set("Content-Type", "application/json")
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

// aofDir is where redisProc's server keeps its append-only files.
const aofDir = "appendonlydir"

// copyAOF copies the append-only files of the server in dir, as a backup taken
// while it runs: the manifest first, then the files it names. Every write is
// fsynced before its reply (redisProc), so the copy holds every acknowledged write
// up to some instant, and at most a truncated last command, which the server
// drops when it loads (aof-load-truncated). A file rewritten away during the copy
// makes it start again.
func copyAOF(dir string) (map[string][]byte, error) {
	for range 5 {
		out := map[string][]byte{}
		entries, err := os.ReadDir(filepath.Join(dir, aofDir))
		if err != nil {
			return nil, err
		}
		var manifest string
		for _, e := range entries {
			if strings.HasSuffix(e.Name(), ".manifest") {
				manifest = e.Name()
			}
		}
		if manifest == "" {
			return nil, errors.New("no append-only manifest")
		}
		m, err := os.ReadFile(filepath.Join(dir, aofDir, manifest))
		if err != nil {
			return nil, err
		}
		out[manifest] = m
		complete := true
		for _, line := range strings.Split(string(m), "\n") {
			f := strings.Fields(line)
			if len(f) < 2 || f[0] != "file" {
				continue
			}
			data, err := os.ReadFile(filepath.Join(dir, aofDir, f[1]))
			if errors.Is(err, os.ErrNotExist) {
				complete = false
				break
			}
			if err != nil {
				return nil, err
			}
			out[f[1]] = data
		}
		if complete {
			return out, nil
		}
	}
	return nil, errors.New("the append-only files kept changing under the copy")
}

// restoreAOF replaces the append-only files in dir (of a stopped server) with files.
func restoreAOF(dir string, files map[string][]byte) error {
	d := filepath.Join(dir, aofDir)
	if err := os.RemoveAll(d); err != nil {
		return err
	}
	if err := os.MkdirAll(d, 0o700); err != nil {
		return err
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(d, name), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}

// describeLosses sums the loss runs for the table.
func describeLosses(runs []budgetLossRun) string {
	if len(runs) == 0 {
		return "no run"
	}
	kinds := map[string]int{}
	var slowest time.Duration
	window, after := 0, 0
	for _, r := range runs {
		kinds[r.kind]++
		slowest = max(slowest, r.detect)
		window += r.window
		after += r.fenced503
	}
	return fmt.Sprintf("%d runs (%d flushall, %d older-aof), each fenced and never funded again; fenced at most %v after the loss; %d answers 2xx between a loss and its fence, %d answers 503 after it",
		len(runs), kinds["flushall"], kinds["older-aof"], slowest.Round(time.Millisecond), window, after)
}

// lossSeeds are the seeds of the loss runs: HISTORY_LOSS_SEED alone when it is set
// (a replay), else runs seeds from the clock, alternating flushall and older-aof.
func lossSeeds(t *testing.T, runs int) []uint64 { return seedsOf(t, "HISTORY_LOSS_SEED", runs) }
