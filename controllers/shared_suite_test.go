package controllers_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2/textlogger"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// cp is the package's one control plane (kube-apiserver + etcd). Under -short it is
// not started, and every test that needs servers skips (needsServers).
var cp *controlplane.ControlPlane

func TestMain(m *testing.M) {
	flag.Parse()
	if os.Getenv("RPA_TEST_LOG") != "" {
		ctrl.SetLogger(textlogger.NewLogger(textlogger.NewConfig(textlogger.Verbosity(1))))
	} else {
		ctrl.SetLogger(logr.Discard())
	}
	if testing.Short() {
		// The phase tables and the pure rules need no server.
		os.Exit(m.Run())
	}
	var err error
	cp, err = controlplane.New()
	if err != nil {
		fmt.Fprintln(os.Stderr, "control plane:", err)
		os.Exit(1)
	}
	code := m.Run()
	if err := cp.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "stopping the control plane:", err)
	}
	os.Exit(code)
}

// grabServiceManager is the field manager the grab service's reporter uses.
const grabServiceManager = "redpacket-grab-service"

// env is one test's world: a namespace, a Redis and a client of each.
type env struct {
	t     *testing.T
	ns    string
	redis *redistest.Server
	rdb   *redis.Client
	c     client.Client
	// cfg reaches the API server the test's controllers run against; nil means the
	// package's shared control plane (cp). A test on a control plane of its own (one
	// with the Gateway API installed) sets it with c.
	cfg *rest.Config
}

// config is the test's API server credentials: cfg, else the shared control plane's.
func (e *env) config() *rest.Config {
	if e.cfg != nil {
		return e.cfg
	}
	return cp.Config
}

var managerSeq atomic.Int64

// needsServers skips the test under -short, where TestMain starts no server. Every
// test that uses the control plane or a Redis calls it first (newEnv does).
func needsServers(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("needs kube-apiserver, etcd and Redis; run without -short")
	}
}

func newEnv(t *testing.T) *env {
	t.Helper()
	needsServers(t)
	srv := redistest.Start(t)
	e := &env{t: t, ns: cp.Namespace(t), redis: srv, rdb: srv.Client(t), c: cp.Client}
	e.createSettlementKeys()
	return e
}

// createSettlementKeys creates the operator's settlement keys Secret in the test's
// namespace, standing for the operator's: a key for the host and port of
// withSettlement's webhook and of the budgets' placeholder webhook. The test
// receivers' 127.0.0.1 and port are added by allowWebhook.
func (e *env) createSettlementKeys() {
	e.t.Helper()
	keys := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: testSettlementKeys, Namespace: e.ns},
		Data: map[string][]byte{"balance.default.svc": []byte(testSigningKey), "balance.default.svc_8080": []byte(testSigningKey)}}
	if err := e.c.Create(context.Background(), keys); err != nil {
		e.t.Fatalf("creating the settlement keys Secret: %v", err)
	}
}

// allowWebhook adds to the test's settlement keys Secret the key for webhookURL's
// host and port ("127.0.0.1_<port>" for a test receiver): the allowlist is keyed by
// host and port, and each receiver listens on a port of its own.
func (e *env) allowWebhook(webhookURL string) {
	e.t.Helper()
	u, err := url.Parse(webhookURL)
	if err != nil || u.Port() == "" {
		e.t.Fatalf("allowing webhook %q: no host and port", webhookURL)
	}
	ctx := context.Background()
	keys := &corev1.Secret{}
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: testSettlementKeys}, keys); err != nil {
		e.t.Fatalf("reading the settlement keys Secret: %v", err)
	}
	if keys.Data == nil {
		keys.Data = map[string][]byte{}
	}
	keys.Data[u.Hostname()+controllers.AllowlistPortSeparator+u.Port()] = []byte(testSigningKey)
	if err := e.c.Update(ctx, keys); err != nil {
		e.t.Fatalf("allowing webhook %q: %v", webhookURL, err)
	}
}

// testSettlementKeys is the operator's settlement keys Secret in every test
// namespace, and testSigningKey the key it holds for every allowed host.
const (
	testSettlementKeys = "settlement-keys"
	testSigningKey     = "webhook-signing-key"
)

// settledByHand keeps the operator's settlement workers from ever starting (a
// runner the manager never starts), for the tests that play the settlement worker
// themselves (settleAll, readPending and ack).
func settledByHand(r *controllers.RedPacketActivityReconciler) {
	r.Settlers = controllers.NewSettlementRunner()
}

// runningController is a started manager with the reconciler.
type runningController struct {
	// Cancel asks the manager to stop and returns at once.
	Cancel func()
	// Stop asks the manager to stop and waits until it has.
	Stop func()
}

// startController runs a manager with the reconciler for the test's namespace; it is
// stopped at the test's cleanup at the latest.
func (e *env) startController(configure func(r *controllers.RedPacketActivityReconciler)) runningController {
	e.t.Helper()
	return e.startControllerWith(e.config(), configure)
}

// startControllerWith is startController with the given API server credentials.
func (e *env) startControllerWith(cfg *rest.Config, configure func(r *controllers.RedPacketActivityReconciler)) runningController {
	e.t.Helper()
	mgr := e.newManager(cfg)
	r := &controllers.RedPacketActivityReconciler{
		Options: controllers.Options{
			DefaultRedis:         e.redis.Conn(),
			GrabImage:            "registry.example/redpacket-operator:test",
			GrabReplicas:         1,
			CleanupGracePeriod:   10 * time.Minute,
			GrabReportTimeout:    10 * time.Second,
			RedisTimeout:         3 * time.Second,
			ActiveResyncPeriod:   500 * time.Millisecond,
			CleanupPollInterval:  200 * time.Millisecond,
			MaxBackoff:           time.Second,
			Name:                 fmt.Sprintf("rpa-%s-%d", e.ns, managerSeq.Add(1)),
			SkipNameValidation:   true,
			SettlementKeysSecret: types.NamespacedName{Namespace: e.ns, Name: testSettlementKeys},
		},
	}
	if configure != nil {
		configure(r)
	}
	if err := r.SetupWithManager(mgr); err != nil {
		e.t.Fatalf("setting up the controller: %v", err)
	}
	return e.run(mgr)
}

// newManager is a manager for the test's namespace on the API server cfg names,
// serving no metrics or probes.
func (e *env) newManager(cfg *rest.Config) ctrl.Manager {
	e.t.Helper()
	grace := 10 * time.Second
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                  cp.Scheme,
		Metrics:                 metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress:  "0",
		Cache:                   controllers.CacheOptions(e.ns),
		GracefulShutdownTimeout: &grace,
	})
	if err != nil {
		e.t.Fatalf("creating manager: %v", err)
	}
	return mgr
}

// run starts mgr; it is stopped at the test's cleanup at the latest.
func (e *env) run(mgr ctrl.Manager) runningController {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					e.t.Errorf("manager stopped with an error: %v", err)
				}
			case <-time.After(30 * time.Second):
				e.t.Errorf("manager did not stop within 30s")
			}
		})
	}
	e.t.Cleanup(stop)
	return runningController{Cancel: cancel, Stop: stop}
}

// activity returns an activity in the test's namespace with the given figures.
func (e *env) activity(name string, total, count int64, mutate ...func(*redpacketv1alpha1.RedPacketActivity)) *redpacketv1alpha1.RedPacketActivity {
	a := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			TotalAmount:  total,
			Count:        count,
			Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionRandom, MinAmount: 1},
			Sponsor:      "merchant-001",
		},
	}
	for _, m := range mutate {
		m(a)
	}
	return a
}

func withSettlement(a *redpacketv1alpha1.RedPacketActivity) {
	a.Spec.Settlement = &redpacketv1alpha1.Settlement{
		Webhook:     &redpacketv1alpha1.Webhook{URL: "http://balance.default.svc:8080/credit"},
		MaxAttempts: 10,
	}
}

func (e *env) create(a *redpacketv1alpha1.RedPacketActivity) *redpacketv1alpha1.RedPacketActivity {
	e.t.Helper()
	if err := e.c.Create(context.Background(), a); err != nil {
		e.t.Fatalf("creating activity %s: %v", a.Name, err)
	}
	return a
}

func (e *env) get(name string) *redpacketv1alpha1.RedPacketActivity {
	e.t.Helper()
	a := &redpacketv1alpha1.RedPacketActivity{}
	if err := e.c.Get(context.Background(), client.ObjectKey{Namespace: e.ns, Name: name}, a); err != nil {
		e.t.Fatalf("getting activity %s: %v", name, err)
	}
	return a
}

// patch changes an activity with a merge patch, which a concurrent status write
// cannot make conflict.
func (e *env) patch(name string, change func(*redpacketv1alpha1.RedPacketActivity)) *redpacketv1alpha1.RedPacketActivity {
	e.t.Helper()
	a := e.get(name)
	orig := a.DeepCopy()
	change(a)
	if err := e.c.Patch(context.Background(), a, client.MergeFrom(orig)); err != nil {
		e.t.Fatalf("patching activity %s: %v", name, err)
	}
	return a
}

// bump changes an annotation, which makes the controller reconcile the activity.
func (e *env) bump(name string, i int) {
	e.t.Helper()
	e.patch(name, func(a *redpacketv1alpha1.RedPacketActivity) {
		if a.Annotations == nil {
			a.Annotations = map[string]string{}
		}
		a.Annotations["test.redpacket.io/bump"] = strconv.Itoa(i)
	})
}

// consistently checks cond repeatedly for the whole duration.
func consistently(t *testing.T, d time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if ok, seen := cond(); !ok {
			t.Fatalf("%s stopped holding: %s", what, seen)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func describe(a *redpacketv1alpha1.RedPacketActivity) string {
	var b strings.Builder
	fmt.Fprintf(&b, "phase=%s gen=%d observed=%d", a.Status.Phase, a.Generation, a.Status.ObservedGeneration)
	for _, c := range a.Status.Conditions {
		fmt.Fprintf(&b, " %s=%s/%s(%q)", c.Type, c.Status, c.Reason, c.Message)
	}
	return b.String()
}

// waitCondition waits until the activity's condition has the status and reason.
func (e *env) waitCondition(name, condType string, status metav1.ConditionStatus, reason string, timeout time.Duration) *redpacketv1alpha1.RedPacketActivity {
	e.t.Helper()
	var a *redpacketv1alpha1.RedPacketActivity
	wait.Until(e.t, timeout, fmt.Sprintf("%s %s=%s/%s", name, condType, status, reason), func() (bool, string) {
		a = e.get(name)
		c := meta.FindStatusCondition(a.Status.Conditions, condType)
		return c != nil && c.Status == status && c.Reason == reason && c.ObservedGeneration == a.Generation, describe(a)
	})
	return a
}

// waitPhase waits until the activity shows the phase for its current generation.
func (e *env) waitPhase(name string, phase redpacketv1alpha1.Phase, timeout time.Duration) *redpacketv1alpha1.RedPacketActivity {
	e.t.Helper()
	var a *redpacketv1alpha1.RedPacketActivity
	wait.Until(e.t, timeout, fmt.Sprintf("%s phase %s", name, phase), func() (bool, string) {
		a = e.get(name)
		return a.Status.Phase == phase && a.Status.ObservedGeneration == a.Generation, describe(a)
	})
	return a
}

// hasEvent reports whether an events.k8s.io event about the named object has the
// type and reason.
func (e *env) hasEvent(name, eventType, reason string) (bool, string) {
	list := &eventsv1.EventList{}
	if err := e.c.List(context.Background(), list, client.InNamespace(e.ns)); err != nil {
		return false, err.Error()
	}
	var seen []string
	for _, ev := range list.Items {
		if ev.Regarding.Name != name {
			continue
		}
		seen = append(seen, ev.Type+"/"+ev.Reason)
		if ev.Type == eventType && ev.Reason == reason {
			return true, ""
		}
	}
	return false, strings.Join(seen, ", ")
}

func (e *env) waitEvent(name, eventType, reason string) {
	e.t.Helper()
	wait.Until(e.t, 10*time.Second, fmt.Sprintf("%s event %s for %s", eventType, reason, name), func() (bool, string) {
		return e.hasEvent(name, eventType, reason)
	})
}

// handle is the activity's handle on the test's Redis client.
func (e *env) handle(a *redpacketv1alpha1.RedPacketActivity) *store.Activity {
	return store.NewActivity(e.rdb, string(a.UID), a.Spec.ShardCount())
}

// keys are the keys of the activity's first shard (its only one, unless sharded).
func (e *env) keys(a *redpacketv1alpha1.RedPacketActivity) store.Keys {
	return e.handle(a).Shard(0).Keys()
}

func (e *env) snapshot(a *redpacketv1alpha1.RedPacketActivity) store.Snapshot {
	e.t.Helper()
	s, err := e.handle(a).Snapshot(context.Background())
	if err != nil {
		e.t.Fatalf("reading snapshot: %v", err)
	}
	return s
}

func (e *env) grab(a *redpacketv1alpha1.RedPacketActivity, user string) store.GrabResult {
	e.t.Helper()
	res, err := e.handle(a).Shard(0).Grab(context.Background(), user)
	if err != nil {
		e.t.Fatalf("grab for %s: %v", user, err)
	}
	return res
}

// applyGrabServiceStatus applies status fields as the grab service's reporter does:
// server-side apply on the status subresource under its own field manager.
func (e *env) applyGrabServiceStatus(name string, fields map[string]any) {
	e.t.Helper()
	obj := &unstructured.Unstructured{Object: map[string]any{"status": fields}}
	obj.SetAPIVersion(redpacketv1alpha1.GroupVersion.String())
	obj.SetKind("RedPacketActivity")
	obj.SetNamespace(e.ns)
	obj.SetName(name)
	err := e.c.Status().Apply(context.Background(), client.ApplyConfigurationFromUnstructured(obj),
		client.FieldOwner(grabServiceManager), client.ForceOwnership)
	if err != nil {
		e.t.Fatalf("applying the grab service's status: %v", err)
	}
}

// runReporter runs the grab service's own status reporter for the activity, as every
// grab replica does (reading the activity from the API server and the counters from
// Redis, applying them under the grab service's field manager), until the test ends.
// It stands in for a grab replica being up.
func (e *env) runReporter(name string) {
	e.t.Helper()
	src := &grabsvc.ActivitySource{
		Client:  e.c,
		Key:     types.NamespacedName{Namespace: e.ns, Name: name},
		Refresh: 500 * time.Millisecond,
		Retry:   100 * time.Millisecond,
	}
	rep := &grabsvc.Reporter{
		Client:    e.c,
		Redis:     e.rdb,
		Resource:  src.Current,
		Interval:  200 * time.Millisecond,
		Heartbeat: time.Second,
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { src.Run(ctx) })
	wg.Go(func() { rep.Run(ctx) })
	e.t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
}

// settlementGroup is the consumer group the tests settle through.
const settlementGroup = "settlement"

// readPending reads every stream entry not yet delivered to the test's consumer group.
func (e *env) readPending(a *redpacketv1alpha1.RedPacketActivity) []store.StreamEntry {
	e.t.Helper()
	ctx := context.Background()
	sh := e.handle(a).Shard(0)
	if err := sh.EnsureGroup(ctx, settlementGroup); errors.Is(err, store.ErrMissing) {
		return nil
	} else if err != nil {
		e.t.Fatalf("creating consumer group: %v", err)
	}
	out, err := sh.ReadNew(ctx, settlementGroup, "test", 100000, 0)
	if err != nil {
		e.t.Fatalf("reading the stream: %v", err)
	}
	return out
}

// ack settles one delivered entry.
func (e *env) ack(a *redpacketv1alpha1.RedPacketActivity, m store.StreamEntry) {
	e.t.Helper()
	if m.Malformed != nil {
		e.t.Fatalf("entry %s: %v", m.ID, m.Malformed)
	}
	ok, err := e.handle(a).Shard(0).Ack(context.Background(), settlementGroup, m.ID, m.Kind, m.Amount)
	if err != nil || !ok {
		e.t.Fatalf("acking %s: ok=%v err=%v", m.ID, ok, err)
	}
}

// settleAll delivers and acknowledges every entry in the activity's stream.
func (e *env) settleAll(a *redpacketv1alpha1.RedPacketActivity) int {
	e.t.Helper()
	msgs := e.readPending(a)
	for _, m := range msgs {
		e.ack(a, m)
	}
	return len(msgs)
}

func (e *env) dbsize() int64 {
	e.t.Helper()
	n, err := e.rdb.DBSize(context.Background()).Result()
	if err != nil {
		e.t.Fatalf("DBSIZE: %v", err)
	}
	return n
}

func isNotFound(err error) bool { return apierrors.IsNotFound(err) }

func ptr[T any](v T) *T { return &v }
