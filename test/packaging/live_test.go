package packaging

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/proc"
	"redpacket.io/operator/test/redistest"
)

// stopGrace is how long a stopped process may take after SIGTERM; tailBytes is how
// much of a log a failure shows.
const (
	stopGrace = 20 * time.Second
	tailBytes = 6000
)

// binaries are the manager and the grab service built from this tree.
type binaries struct {
	dir, manager, grabsvc string
}

var (
	buildOnce sync.Once
	built     binaries
	buildErr  error
)

// buildBinaries builds the manager and the grab service once for the package.
func buildBinaries(t *testing.T) binaries {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "redpacket-packaging-bin-")
		if err != nil {
			buildErr = err
			return
		}
		built = binaries{dir: dir, manager: filepath.Join(dir, "manager"), grabsvc: filepath.Join(dir, "grabsvc")}
		for _, b := range [][2]string{{built.manager, "./cmd/manager"}, {built.grabsvc, "./cmd/grabsvc"}} {
			cmd := exec.Command("go", "build", "-o", b[0], b[1])
			cmd.Dir = root
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("go build %s: %w\n%s", b[1], err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return built
}

// liveEnv is a control plane, a redis-server, the manager (its metrics on
// metricsURL) and a balance system receiving settlement deliveries; the tests start
// grab services for their activities.
type liveEnv struct {
	work       string
	cp         *controlplane.ControlPlane
	client     client.WithWatch
	kubeconfig string
	redisAddr  string
	redis      *redis.Client
	redisProc  *redistest.Server
	manager    *proc.Proc
	managerLog string
	metricsURL string
	balanceURL string
	stopBal    func()
	grabs      []*proc.Proc
	grabLogs   []string
}

var (
	liveOnce sync.Once
	live     *liveEnv
	liveErr  error
	liveMu   sync.Mutex
)

// startLive starts the environment once for the package; stopLive (TestMain) stops
// it. Under -short the calling test skips.
func startLive(t *testing.T) *liveEnv {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a control plane, Redis, the manager and grab services; not under -short")
	}
	bins := buildBinaries(t)
	liveOnce.Do(func() {
		liveMu.Lock()
		defer liveMu.Unlock()
		live, liveErr = newLiveEnv(bins)
	})
	if liveErr != nil {
		t.Fatal(liveErr)
	}
	return live
}

func newLiveEnv(bins binaries) (*liveEnv, error) {
	e := &liveEnv{}
	var err error
	if e.work, err = os.MkdirTemp("", "redpacket-packaging-"); err != nil {
		return nil, err
	}
	fail := func(err error) (*liveEnv, error) {
		e.stop()
		return nil, err
	}
	if e.cp, err = controlplane.New(); err != nil {
		return fail(err)
	}
	if e.client, err = client.NewWithWatch(e.cp.Config, client.Options{Scheme: e.cp.Scheme}); err != nil {
		return fail(fmt.Errorf("creating a watching client: %w", err))
	}
	e.kubeconfig = filepath.Join(e.work, "kubeconfig")
	if err := e.cp.Kubeconfig(e.kubeconfig); err != nil {
		return fail(err)
	}
	if e.redisProc, err = redistest.StartProcess(e.work); err != nil {
		return fail(err)
	}
	e.redisAddr = e.redisProc.Addr
	e.redis = redis.NewClient(e.redisProc.Options())

	// The operator settles, signing with the key its own namespace holds for the
	// balance system's host (the receiver below listens on 127.0.0.1).
	const operatorNamespace = "redpacket-system"
	ctx := context.Background()
	if err := e.client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: operatorNamespace}}); err != nil {
		return fail(err)
	}
	if err := e.client.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "redpacket-settlement-keys", Namespace: operatorNamespace},
		Data: map[string][]byte{}}); err != nil {
		return fail(err)
	}

	metrics, err := proc.FreeAddr()
	if err != nil {
		return fail(err)
	}
	probe, err := proc.FreeAddr()
	if err != nil {
		return fail(err)
	}
	e.metricsURL = "http://" + metrics + "/metrics"
	e.managerLog = filepath.Join(e.work, "manager.log")
	if e.manager, err = proc.Start("operator", e.managerLog, append([]string{"POD_NAMESPACE=" + operatorNamespace}, e.redisProc.AuthEnv()...), bins.manager, "--kubeconfig", e.kubeconfig,
		"--redis-addresses", e.redisAddr, "--metrics-bind-address", metrics, "--health-probe-bind-address", probe,
		"--active-resync-period", "1s", "--cleanup-grace-period", "1m"); err != nil {
		return fail(err)
	}
	if err := proc.WaitHTTP(context.Background(), e.manager, "http://"+probe+"/readyz", 60*time.Second); err != nil {
		return fail(fmt.Errorf("operator: %w\n%s", err, proc.Tail(e.managerLog, tailBytes)))
	}
	balance := rain.NewReceiver(nil)
	url, stopBal, err := balance.Serve(context.Background(), "127.0.0.1")
	if err != nil {
		return fail(err)
	}
	// The allowlist is keyed by host and port: the receiver's.
	keys := &corev1.Secret{}
	if err := e.client.Get(ctx, client.ObjectKey{Namespace: operatorNamespace, Name: "redpacket-settlement-keys"}, keys); err != nil {
		stopBal()
		return fail(err)
	}
	keys.Data = map[string][]byte{strings.Replace(strings.TrimPrefix(url, "http://"), ":", "_", 1): []byte("packaging-operator-signing-key")}
	if err := e.client.Update(ctx, keys); err != nil {
		stopBal()
		return fail(err)
	}
	e.balanceURL, e.stopBal = url+"/credit", stopBal
	return e, nil
}

// stop ends everything the environment started.
func (e *liveEnv) stop() {
	for _, g := range e.grabs {
		g.Stop(stopGrace)
	}
	if e.manager != nil {
		e.manager.Stop(stopGrace)
	}
	if e.stopBal != nil {
		e.stopBal()
	}
	if e.redis != nil {
		_ = e.redis.Close()
	}
	if e.redisProc != nil {
		e.redisProc.Stop()
	}
	if e.cp != nil {
		_ = e.cp.Stop()
	}
	if e.work != "" {
		_ = os.RemoveAll(e.work)
	}
}

// stopLive stops the environment and removes the binaries, if they were made.
func stopLive() {
	liveMu.Lock()
	defer liveMu.Unlock()
	if live != nil {
		live.stop()
	}
	if built.dir != "" {
		_ = os.RemoveAll(built.dir)
	}
}

// dumpLogs shows the manager's log (and the grab services') when a test failed.
func (e *liveEnv) dumpLogs(t *testing.T) {
	t.Helper()
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		t.Logf("--- operator log (tail)\n%s", proc.Tail(e.managerLog, tailBytes))
		for _, l := range e.grabLogs {
			t.Logf("--- %s (tail)\n%s", filepath.Base(l), proc.Tail(l, tailBytes/2))
		}
	})
}

// namespace creates a namespace for a test.
func (e *liveEnv) namespace(t *testing.T) string {
	t.Helper()
	return e.cp.Namespace(t)
}

// startGrab runs a grab service process for the activity and returns its base URL.
// It runs until the environment stops (its metrics are scraped after the test that
// started it).
func (e *liveEnv) startGrab(t *testing.T, ns, name string) string {
	t.Helper()
	addr, err := proc.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	return e.runGrab(t, fmt.Sprintf("grabsvc-%s-%s.log", ns, name), "/readyz", "--namespace", ns, "--activity", name,
		"--listen", addr, "--kubeconfig", e.kubeconfig, "--redis-addresses", e.redisAddr,
		"--report-interval", "200ms", "--shutdown-delay", "0s")
}

// runGrab starts a grab service process with args (which name its --listen
// address), logging to logName in the environment's directory, keeps it until the
// environment stops, and waits until path answers; it returns the base URL.
func (e *liveEnv) runGrab(t *testing.T, logName, path string, args ...string) string {
	t.Helper()
	addr := ""
	for i, a := range args {
		if a == "--listen" && i+1 < len(args) {
			addr = args[i+1]
		}
	}
	logPath := filepath.Join(e.work, logName)
	p, err := proc.Start("grab service", logPath, e.redisProc.AuthEnv(), built.grabsvc, args...)
	if err != nil {
		t.Fatal(err)
	}
	liveMu.Lock()
	e.grabs = append(e.grabs, p)
	e.grabLogs = append(e.grabLogs, logPath)
	liveMu.Unlock()
	if err := proc.WaitHTTP(t.Context(), p, "http://"+addr+path, 60*time.Second); err != nil {
		t.Fatalf("grab service %s: %v\n%s", logName, err, proc.Tail(logPath, tailBytes))
	}
	return "http://" + addr
}

// startBudgetGrab runs a grab service of the budget's fleet (--budget), as the
// budget's grab pods run it, with a sender credential of its own, and returns its
// base URL. It runs until the environment stops.
func (e *liveEnv) startBudgetGrab(t *testing.T, b *redpacketv1alpha1.RedPacketBudget) string {
	t.Helper()
	addr, err := proc.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	tokenFile := filepath.Join(e.work, fmt.Sprintf("sender-%s-%s", b.Namespace, b.Name))
	if err := os.WriteFile(tokenFile, []byte("packaging-sender-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return e.runGrab(t, fmt.Sprintf("grabsvc-budget-%s-%s.log", b.Namespace, b.Name), "/healthz",
		"--namespace", b.Namespace, "--budget", b.Name, "--budget-uid", string(b.UID),
		"--budget-shards", fmt.Sprint(b.Spec.ShardCount()), "--sender-token-file", tokenFile,
		"--listen", addr, "--redis-addresses", e.redisAddr, "--shutdown-delay", "0s")
}

// newActivity is an activity of count packets and total minor units.
func newActivity(ns, name string, total, count int64) *redpacketv1alpha1.RedPacketActivity {
	return &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			TotalAmount:  total,
			Count:        count,
			Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionRandom, MinAmount: 1},
			Sponsor:      "merchant-001",
		},
	}
}

// activityWatch records every version of the activities of one namespace that the
// API server sends, from before the first is created, so a short-lived status (phase
// Seeding) is not missed.
type activityWatch struct {
	mu       sync.Mutex
	versions []*redpacketv1alpha1.RedPacketActivity
	changed  chan struct{}
}

// watchActivities starts recording the namespace's activities until the test ends.
func (e *liveEnv) watchActivities(t *testing.T, ns string) *activityWatch {
	t.Helper()
	w, err := e.client.Watch(t.Context(), &redpacketv1alpha1.RedPacketActivityList{}, client.InNamespace(ns))
	if err != nil {
		t.Fatalf("watching activities: %v", err)
	}
	aw := &activityWatch{changed: make(chan struct{}, 1)}
	go func() {
		for ev := range w.ResultChan() {
			a, ok := ev.Object.(*redpacketv1alpha1.RedPacketActivity)
			if !ok || (ev.Type != watch.Added && ev.Type != watch.Modified) {
				continue
			}
			aw.mu.Lock()
			aw.versions = append(aw.versions, a.DeepCopy())
			aw.mu.Unlock()
			select {
			case aw.changed <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(w.Stop)
	return aw
}

// await returns the first recorded version of the named activity that satisfies
// cond, waiting up to within for it.
func (aw *activityWatch) await(t *testing.T, name, what string, within time.Duration,
	cond func(*redpacketv1alpha1.RedPacketActivity) bool) *redpacketv1alpha1.RedPacketActivity {
	t.Helper()
	deadline := time.After(within)
	seen := 0
	for {
		aw.mu.Lock()
		var last *redpacketv1alpha1.RedPacketActivity
		for _, a := range aw.versions[seen:] {
			if a.Name != name {
				continue
			}
			last = a
			if cond(a) {
				aw.mu.Unlock()
				return a
			}
		}
		seen = len(aw.versions)
		aw.mu.Unlock()
		select {
		case <-aw.changed:
		case <-deadline:
			t.Fatalf("activity %s: %s did not happen within %s; last version seen: %+v", name, what, within, statusOf(last))
		case <-time.After(time.Second):
		}
	}
}

func statusOf(a *redpacketv1alpha1.RedPacketActivity) any {
	if a == nil {
		return "none"
	}
	return a.Status
}
