package history

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/klog/v2/textlogger"
	ctrlruntime "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/redistest"
)

// Runs with the operator: the controller of these histories is the real one, the
// controllers package's RedPacketActivityReconciler in a controller-runtime manager on
// a real kube-apiserver and etcd (one control plane for the test binary, a namespace
// per run). It seeds and opens the activities it is given, acts on spec edits, closes
// an activity at its endTime or once nothing is left, and writes status. It reaches
// Redis through the controller's fault proxy: the activities' spec.redis names a
// Secret whose address is the proxy's, so latency, stalls and resets hit it as they
// hit the grab path. A controller-restart stops its manager and starts a new one on
// the same control plane.
//
// Spec edits as operations. The controller turns a spec edit into Redis writes at
// moments of its own choosing after the edit, possibly more than once, and reports
// in status which generation it acted on. So an edit is one operation of the model
// (open when the activity is created, pause and resume for spec.paused, close-expired
// for an endTime moved to the present), whose effect porcupine may place anywhere
// between:
//
//   - its call: the instant just before the API write;
//   - its return: the instant the watch shows status.observedGeneration equal to the
//     edit's generation for the first time. The controller writes that only at the
//     end of a clean reconcile of that spec, after its Redis writes, so Redis held the
//     edit's gate at some instant in between. The output is what that status's phase
//     says of Redis. Active, Paused or Scheduled: the activity was open, so a pause or
//     resume answered open. Exhausted or Expired: it was closed by then, with that
//     reason, which is a close's answer; but a pause or resume may have answered open
//     and been followed by a close in the same reconcile, so it is an unknown outcome
//     bounded by the return (the close that followed is an operation of its own). A
//     phase the edit cannot lead to (Active after a pause, open after a close) is a
//     contradiction: it fails the run, and its output fails the check;
//   - when the status goes past the edit's generation without showing it (a later
//     edit came first), the edit is an unknown outcome bounded by that instant
//     (Output.Bounded): whatever the controller wrote for it, it wrote before the
//     status of the later edit. Placed right before the later edit, it is the same as
//     not having happened;
//   - an edit the status never reports by the end of the run is an unknown outcome
//     returning at the end: it may or may not have taken effect.
//
// This rests on the controller writing the gate of each generation only while that is
// the newest it has seen, so that its gate writes come in generation order. Within one
// manager that holds: reconciles of one activity run one at a time, its cache only
// moves forward, and every Redis call of a reconcile ends before the reconcile does
// (the controller's Redis deadline, controllerRedisTimeout, is far above any delay
// the faults add, so no command of it arrives late). Across a restart, the old
// manager is stopped and the controller's link reset before the new one starts, as a
// killed pod's connections are closed: a command of the old manager reaches Redis
// before the new manager starts or never. A command held in the network past a new
// leader's first write is not exercised here; it would break that order.
//
// The controller's own closes, which no edit asks for: close-exhausted from the
// activity's creation on (it closes once nothing is left), returning, closed as
// exhausted, when the watch first shows phase Exhausted (only that close leads
// there), and close-expired from the end of a window the activity was created with,
// an unknown outcome returning at the end. An exhausted close with packets left
// changes nothing, and an expired one cannot come before the window's end.
//
// Restarts. Half of them are aimed at an edit: the controller's link holds traffic
// from just before the edit, and the manager is stopped halfway through the hold, so
// the reconcile of that edit is cut; the held command then reaches Redis after the
// stop and before the new manager starts. The other half stop the manager wherever it
// is, and the link reset drops what it held.

// Settings of the real controller in these runs.
const (
	// controllerRedisTimeout is the reconciler's Redis deadline: well above the
	// longest stall, pause or restart a fault makes, so that its calls end within
	// their reconcile (see above).
	controllerRedisTimeout = 3 * time.Second
	// operatorResync is the reconciler's ActiveResyncPeriod.
	operatorResync = 300 * time.Millisecond
	// editWait bounds the wait for the controller to act on the edits still pending
	// when the rain is over, and for its closes at the end.
	editWait = 30 * time.Second
)

// sharedControlPlane is the test binary's one control plane, started by the first
// run that needs it and stopped by TestMain.
var sharedControlPlane struct {
	once sync.Once
	cp   *controlplane.ControlPlane
	err  error
}

func TestMain(m *testing.M) {
	// HISTORY_LOG=1 shows the controller's log.
	if os.Getenv("HISTORY_LOG") != "" {
		ctrlruntime.SetLogger(textlogger.NewLogger(textlogger.NewConfig(textlogger.Verbosity(1))))
	} else {
		ctrlruntime.SetLogger(logr.Discard())
	}
	code := m.Run()
	if cp := sharedControlPlane.cp; cp != nil {
		if err := cp.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stopping the control plane:", err)
		}
	}
	os.Exit(code)
}

// controlPlane returns the shared control plane, starting it on first use.
func controlPlane(t *testing.T) *controlplane.ControlPlane {
	t.Helper()
	if testing.Short() {
		t.Skip("needs kube-apiserver, etcd and redis-server; run without -short")
	}
	sharedControlPlane.once.Do(func() {
		cp, err := controlplane.New()
		if err == nil {
			err = warmUp(cp)
		}
		sharedControlPlane.cp, sharedControlPlane.err = cp, err
	})
	if sharedControlPlane.err != nil {
		t.Fatalf("control plane: %v", sharedControlPlane.err)
	}
	return sharedControlPlane.cp
}

// warmUp makes the API server validate an activity once: the first one takes it
// seconds (it compiles the CRD's validation rules), which would otherwise fall in
// the first run's seeding.
func warmUp(cp *controlplane.ControlPlane) error {
	a := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Name: "warm-up", Namespace: "default"},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{TotalAmount: 100, Count: 10, Sponsor: "warm-up",
			Settlement: &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: "http://127.0.0.1:1/credit"}}},
	}
	if err := cp.Client.Create(context.Background(), a, client.DryRunAll); err != nil {
		return fmt.Errorf("warming up the API server: %w", err)
	}
	return nil
}

// TestHistoriesWithOperator runs seeded rains under faults with the real controller
// (see above) and checks every history, and at the end of each run the controller's
// status against Redis and the history. It runs HISTORY_OPERATOR_RUNS runs, else
// HISTORY_RUNS, else 3; HISTORY_SEED replays one seed. Every run restarts the
// controller at least once.
func TestHistoriesWithOperator(t *testing.T) {
	srv := startRedis(t)
	cp := controlPlane(t)
	runs := envInt("HISTORY_OPERATOR_RUNS", envInt("HISTORY_RUNS", 3))
	runSeeds(t, harness{srv: srv, cp: cp}, runs, operatorScenario)
}

// operatorScenario is the seed's scenario for the real controller. The stand-in's
// calls that the real controller makes by itself (the open of a created activity, the
// closes once nothing is left and at a window's end) are no edits and leave the
// schedule; pause, resume and an early close stay, as spec edits. A scenario without
// a controller-restart gets one, aimed at an edit half the time.
func operatorScenario(seed uint64) scenario {
	sc := newScenario(seed)
	sc.operator = true
	sc.tenant = nil // the tenant adversary plays against the stand-in's runs
	r := rand.New(rand.NewPCG(seed, 0x6f70))
	var edits []time.Duration
	for i := range sc.activities {
		a := &sc.activities[i]
		var kept []ctrlOp
		for _, c := range a.ctrl {
			if c.op == OpOpen || c.op == OpCloseExhausted || c.auto {
				continue
			}
			kept = append(kept, c)
			edits = append(edits, c.at)
		}
		a.ctrl = kept
	}
	for _, f := range sc.faults {
		if f.kind == faultControllerRestart {
			return sc
		}
	}
	f := fault{at: time.Duration(r.Int64N(int64(sc.window))), kind: faultControllerRestart,
		dur: time.Duration(20+r.IntN(180)) * time.Millisecond}
	if len(edits) > 0 && r.IntN(2) == 0 {
		f.at = max(edits[r.IntN(len(edits))]-time.Millisecond, 0)
		f.hold = time.Duration(40+r.IntN(120)) * time.Millisecond
	}
	sc.faults = append(sc.faults, f)
	sort.Slice(sc.faults, func(i, j int) bool { return sc.faults[i].at < sc.faults[j].at })
	return sc
}

// operatorStats is what the real controller did in a run.
type operatorStats struct {
	// restarts are the manager restarts, aimed those aimed at an edit; edits the
	// spec edits recorded (creations included), of which acked were reported in
	// status with their generation, superseded were passed over by a later edit's
	// status, and unresolved never reported; cut were pending when a restart came.
	restarts, aimed, edits, acked, superseded, unresolved, cut int
	// contradictions are statuses that contradict the edit they report.
	contradictions int
	// statusChecked counts the activities whose final status was checked.
	statusChecked int
	// seeding is how long the controller took from the creation of the activities
	// to their packets in Redis (the slowest run's, in a sum).
	seeding time.Duration
}

func (s *operatorStats) add(o operatorStats) {
	s.restarts += o.restarts
	s.aimed += o.aimed
	s.edits += o.edits
	s.acked += o.acked
	s.superseded += o.superseded
	s.unresolved += o.unresolved
	s.cut += o.cut
	s.contradictions += o.contradictions
	s.statusChecked += o.statusChecked
	s.seeding = max(s.seeding, o.seeding)
}

func (s operatorStats) String() string {
	return fmt.Sprintf("%d restarts (%d aimed); %d spec edits (%d acknowledged in status, %d superseded, %d never reported; %d pending at a restart); %d contradicting statuses; %d final statuses checked; seeding took %v",
		s.restarts, s.aimed, s.edits, s.acked, s.superseded, s.unresolved, s.cut, s.contradictions, s.statusChecked, s.seeding.Round(time.Millisecond))
}

// operator is the real controller of one run.
type operator struct {
	t     *testing.T
	cp    *controlplane.ControlPlane
	ns    string
	link  *Proxy // the controller's link to Redis
	opts  controllers.Options
	watch context.CancelFunc
	wdone chan struct{}

	// mgrMu serializes restarts and the stop; mgr is the running manager, nil
	// while the controller is down.
	mgrMu sync.Mutex
	mgr   *runningManager

	rec *recorder

	mu      sync.Mutex
	acts    []*opActivity
	byName  map[string]*opActivity
	flushed bool
	stats   operatorStats
}

// runningManager is one started manager.
type runningManager struct {
	cancel context.CancelFunc
	done   chan error
}

// opActivity is one activity of the run as the operator side knows it.
type opActivity struct {
	name   string
	uid    string
	client int // the history's client id of its edits
	// editMu makes one edit of the activity at a time; obj is the activity as the
	// last edit's answer had it.
	editMu sync.Mutex
	obj    *redpacketv1alpha1.RedPacketActivity
	// The rest is guarded by operator.mu.
	pending []*edit
	status  redpacketv1alpha1.RedPacketActivityStatus // the newest status watched
	seen    bool
	// firstPhase is the phase of the first status watched with each observed
	// generation: the one written at the end of the reconcile that acted on it.
	// unsure marks generations first watched after a gap in the watch.
	firstPhase map[int64]redpacketv1alpha1.Phase
	unsure     map[int64]bool
	gap        bool
	// exhausted is the controller's own close-exhausted until the status shows it.
	exhausted *edit
}

// edit is a spec edit waiting for the controller's status.
type edit struct {
	in   Input
	gen  int64
	call time.Time
}

var managerSeq atomic.Int64

// startOperator makes the run's namespace and starts the controller for it, with the
// operator-wide settings of main.go where they matter and shorter periods.
func startOperator(t *testing.T, cp *controlplane.ControlPlane, defaultRedis string, link *Proxy) *operator {
	t.Helper()
	o := &operator{t: t, cp: cp, ns: cp.Namespace(t), link: link, byName: map[string]*opActivity{}}
	o.opts = controllers.Options{
		DefaultRedis:       adminConn(defaultRedis),
		AllowedRedisHosts:  controllers.MustParseRedisHosts("127.0.0.1"),
		GrabImage:          "registry.example/redpacket-operator:history",
		GrabReplicas:       0, // no node runs pods; the grab services are the run's own
		RedisTimeout:       controllerRedisTimeout,
		ActiveResyncPeriod: operatorResync,
		MaxBackoff:         500 * time.Millisecond,
		// As main.go's --max-concurrent-reconciles default.
		MaxConcurrentReconciles: 2,
		SkipNameValidation:      true,
	}
	wctx, cancel := context.WithCancel(context.Background())
	o.watch, o.wdone = cancel, make(chan struct{})
	go o.watchActivities(wctx)
	if err := o.start(); err != nil {
		cancel()
		<-o.wdone
		t.Fatalf("starting the controller: %v", err)
	}
	return o
}

// start starts a manager with the reconciler, restricted to the run's namespace, and
// waits for its cache.
func (o *operator) start() error {
	grace := 20 * time.Second
	mgr, err := ctrlruntime.NewManager(o.cp.Config, ctrlruntime.Options{
		Scheme:                  o.cp.Scheme,
		Metrics:                 metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress:  "0",
		Cache:                   controllers.CacheOptions(o.ns),
		GracefulShutdownTimeout: &grace,
	})
	if err != nil {
		return fmt.Errorf("creating the manager: %w", err)
	}
	opts := o.opts
	opts.Name = fmt.Sprintf("history-%s-%d", o.ns, managerSeq.Add(1))
	r := &controllers.RedPacketActivityReconciler{Options: opts}
	if err := r.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("setting up the controller: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &runningManager{cancel: cancel, done: make(chan error, 1)}
	go func() { m.done <- mgr.Start(ctx) }()
	sctx, scancel := context.WithTimeout(ctx, 30*time.Second)
	defer scancel()
	// The grab workload's kinds that the controller does not watch get their
	// informers on first use, each waiting for its sync in the middle of a reconcile;
	// started here, they are ready when the first reconcile looks, as in an operator
	// that has been running.
	var warm sync.WaitGroup
	errs := make(chan error, len(grabWorkloadKinds))
	for _, obj := range grabWorkloadKinds {
		warm.Go(func() {
			if _, err := mgr.GetCache().GetInformer(sctx, obj); err != nil {
				errs <- fmt.Errorf("informer of %T: %w", obj, err)
			}
		})
	}
	warm.Wait()
	close(errs)
	var all []error
	for e := range errs {
		all = append(all, e)
	}
	err = errors.Join(all...)
	if err == nil && !mgr.GetCache().WaitForCacheSync(sctx) {
		err = errors.New("the manager's cache did not sync")
	}
	if err != nil {
		cancel()
		<-m.done
		return err
	}
	o.mgr = m
	return nil
}

// grabWorkloadKinds are the kinds of the grab workload the controller reads through
// its cache.
var grabWorkloadKinds = []client.Object{&appsv1.Deployment{}, &corev1.Service{}, &corev1.ServiceAccount{},
	&rbacv1.Role{}, &rbacv1.RoleBinding{}, &networkingv1.NetworkPolicy{}, &policyv1.PodDisruptionBudget{},
	&autoscalingv2.HorizontalPodAutoscaler{}}

// stop stops a manager and waits until it has stopped.
func (o *operator) stopManager(m *runningManager) {
	m.cancel()
	select {
	case err := <-m.done:
		if err != nil {
			o.t.Errorf("the manager stopped with an error: %v", err)
		}
	case <-time.After(60 * time.Second):
		o.t.Errorf("the manager did not stop within 60s")
	}
}

// Restart stops the running manager, as a killed operator pod, and after down starts
// a new one. heldUntil, when set, is the end of a hold of the controller's link aimed
// at a call in flight: the held command reaches Redis after the stop, before the link
// is reset. Then the link is reset, so that nothing of the old manager arrives once
// the new one runs.
func (o *operator) Restart(down time.Duration, heldUntil time.Time) {
	o.mgrMu.Lock()
	defer o.mgrMu.Unlock()
	old := o.mgr
	o.mgr = nil
	o.mu.Lock()
	o.stats.restarts++
	if !heldUntil.IsZero() {
		o.stats.aimed++
	}
	for _, a := range o.acts {
		o.stats.cut += len(a.pending)
	}
	o.mu.Unlock()
	if old != nil {
		old.cancel()
	}
	if wait := time.Until(heldUntil); wait > 0 {
		time.Sleep(wait + 30*time.Millisecond)
	}
	o.link.Reset()
	if old != nil {
		o.stopManager(old)
	}
	o.link.Reset()
	time.Sleep(down)
	if err := o.start(); err != nil {
		o.t.Errorf("restarting the controller: %v", err)
	}
}

// Stop stops the controller and the watch.
func (o *operator) Stop() {
	o.mgrMu.Lock()
	if o.mgr != nil {
		o.stopManager(o.mgr)
		o.mgr = nil
	}
	o.mgrMu.Unlock()
	o.watch()
	<-o.wdone
}

// windowSecond rounds t up to a whole second: the API server keeps startTime and
// endTime to the second.
func windowSecond(t time.Time) time.Time {
	if r := t.Truncate(time.Second); !r.Equal(t) {
		return r.Add(time.Second)
	}
	return t
}

// Create makes the Secret naming the controller's link and the run's activities,
// each recorded as its open (and as the controller's own closes), waits until the
// controller has committed their packets to Redis, and returns them and that instant,
// from which the run's schedule counts: the rain then races the open, not the
// seeding. A window is moved to whole seconds (as the API server keeps it), from a
// little after the creation, and the rain stretched to outlast it; sc's activities
// are updated to say so.
func (o *operator) Create(rec *recorder, sc *scenario, webhook string, direct redis.UniversalClient) ([]runActivity, time.Time) {
	t := o.t
	t.Helper()
	o.rec = rec
	ctx := context.Background()
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "redis-conn", Namespace: o.ns},
		StringData: map[string]string{"addresses": o.link.Addr(), "mode": redisconn.ModeStandalone,
			"username": redistest.AdminUser, "password": adminPassword},
	}
	if err := o.cp.Client.Create(ctx, secret); err != nil {
		t.Fatalf("creating the Redis Secret: %v", err)
	}
	out := make([]runActivity, len(sc.activities))
	created := time.Now()
	// Seeding takes the controller a little while; the window counts from after it.
	lead := time.Now().Add(500 * time.Millisecond)
	var windows []*metav1.Time
	for i := range sc.activities {
		a := &sc.activities[i]
		var total int64
		for _, v := range a.amounts {
			total += v
		}
		seed := int64(sc.seed) + int64(i)
		obj := &redpacketv1alpha1.RedPacketActivity{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("a%d", i), Namespace: o.ns},
			Spec: redpacketv1alpha1.RedPacketActivitySpec{
				TotalAmount:  total,
				Count:        int64(len(a.amounts)),
				Currency:     "CNY",
				Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionRandom, MinAmount: 1, Seed: &seed},
				Sponsor:      fmt.Sprintf("sponsor-%d", i),
				Durability:   &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityFsync},
				Redis:        &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: secret.Name}},
				Settlement: &redpacketv1alpha1.Settlement{
					Webhook: &redpacketv1alpha1.Webhook{URL: webhook}, MaxAttempts: 1000,
				},
			},
		}
		if a.endAt > 0 {
			start := windowSecond(lead.Add(a.startAt))
			end := windowSecond(lead.Add(a.endAt))
			if !end.After(start) {
				end = start.Add(time.Second)
			}
			obj.Spec.StartTime, obj.Spec.EndTime = &metav1.Time{Time: start}, &metav1.Time{Time: end}
		}
		act := &opActivity{name: obj.Name, client: sc.clients + i,
			firstPhase: map[int64]redpacketv1alpha1.Phase{}, unsure: map[int64]bool{}}
		o.mu.Lock()
		o.acts = append(o.acts, act)
		o.byName[act.name] = act
		o.mu.Unlock()
		act.editMu.Lock()
		call := time.Now()
		if err := o.cp.Client.Create(ctx, obj); err != nil {
			t.Fatalf("creating activity %s: %v", obj.Name, err)
		}
		act.obj = obj
		act.uid = string(obj.UID)
		startMs, endMs := windowMs(obj)
		o.register(act, &edit{in: Input{Activity: act.uid, Op: OpOpen, StartMs: startMs, EndMs: endMs}, gen: obj.Generation, call: call})
		act.editMu.Unlock()
		// The controller's own closes.
		o.mu.Lock()
		act.exhausted = &edit{in: Input{Activity: act.uid, Op: OpCloseExhausted}, call: call}
		o.mu.Unlock()
		if endMs > 0 {
			at := time.UnixMilli(endMs).Add(-5 * time.Millisecond)
			rec.add(act.client, Input{Activity: act.uid, Op: OpCloseExpired}, Output{Unknown: true}, at, at)
		}
		a.uid = act.uid
		out[i] = runActivity{uid: act.uid, obj: obj.DeepCopy(), count: len(a.amounts), total: total}
		windows = append(windows, obj.Spec.StartTime, obj.Spec.EndTime)
	}
	deadline := time.Now().Add(editWait)
	for _, a := range out {
		for {
			snap, err := store.NewActivity(direct, a.uid, 1).Snapshot(ctx)
			if err == nil && snap.State != "" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the controller did not seed %s within %v: %+v, %v", a.obj.Name, editWait, snap, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	start := time.Now()
	o.mu.Lock()
	o.stats.seeding = start.Sub(created)
	o.mu.Unlock()
	for i := range sc.activities {
		if a := &sc.activities[i]; a.endAt > 0 {
			a.startAt, a.endAt = windows[2*i].Sub(start), windows[2*i+1].Sub(start)
			sc.window = max(sc.window, a.endAt+300*time.Millisecond)
		}
	}
	return out, start
}

// windowMs is the window the controller writes for the activity's spec (its
// scheduleMs): unix milliseconds, 0 for an open side.
func windowMs(a *redpacketv1alpha1.RedPacketActivity) (startMs, endMs int64) {
	if a.Spec.StartTime != nil {
		startMs = a.Spec.StartTime.UnixMilli()
	}
	if a.Spec.EndTime != nil {
		endMs = a.Spec.EndTime.UnixMilli()
	}
	return startMs, endMs
}

// Apply makes the spec edit of a scheduled controller operation on activity i:
// spec.paused for pause and resume, endTime moved to the present for close-expired
// (and startTime before it when the window had not started). An edit that changes
// nothing (a resume of a running activity, a close of one whose endTime has passed)
// is not made. Operations the controller makes by itself are not edits.
func (o *operator) Apply(i int, op Op) {
	act := o.acts[i]
	act.editMu.Lock()
	defer act.editMu.Unlock()
	switch op {
	case OpPause, OpResume:
		paused := op == OpPause
		if act.obj.Spec.Paused == paused {
			return
		}
		o.edit(act, op, func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Paused = paused })
	case OpCloseExpired:
		o.editClose(act)
	}
}

// editClose moves the activity's endTime to the present (to the second, so at or
// before now), unless it has passed already; act.editMu is held.
func (o *operator) editClose(act *opActivity) bool {
	end := time.Now().Truncate(time.Second)
	if e := act.obj.Spec.EndTime; e != nil && !e.After(end) {
		return false
	}
	o.edit(act, OpCloseExpired, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.EndTime = &metav1.Time{Time: end}
		if s := a.Spec.StartTime; s != nil && !end.After(s.Time) {
			a.Spec.StartTime = &metav1.Time{Time: end.Add(-time.Second)}
		}
	})
	return true
}

// edit patches the activity's spec and records the edit; act.editMu is held.
func (o *operator) edit(act *opActivity, op Op, change func(*redpacketv1alpha1.RedPacketActivity)) {
	orig := act.obj.DeepCopy()
	mod := orig.DeepCopy()
	change(mod)
	call := time.Now()
	if err := o.cp.Client.Patch(context.Background(), mod, client.MergeFrom(orig)); err != nil {
		o.t.Errorf("%s of %s: %v", op, act.name, err)
		return
	}
	act.obj = mod
	if mod.Generation == orig.Generation {
		return // the spec did not change: nothing for the controller to act on
	}
	startMs, endMs := windowMs(mod)
	o.register(act, &edit{in: Input{Activity: act.uid, Op: op, StartMs: startMs, EndMs: endMs}, gen: mod.Generation, call: call})
}

// register adds a pending edit and resolves it at once if the status already
// reports it.
func (o *operator) register(act *opActivity, e *edit) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.flushed {
		o.t.Errorf("an edit of %s after the history was taken", act.name)
		return
	}
	o.stats.edits++
	act.pending = append(act.pending, e)
	o.resolveLocked(act, time.Now())
}

// watchActivities follows the run's activities on the API server and resolves the
// edits their status reports, until ctx ends.
func (o *operator) watchActivities(ctx context.Context) {
	defer close(o.wdone)
	wc, err := client.NewWithWatch(o.cp.Config, client.Options{Scheme: o.cp.Scheme})
	if err != nil {
		o.t.Errorf("watch client: %v", err)
		return
	}
	rv := ""
	for ctx.Err() == nil {
		w, err := wc.Watch(ctx, &redpacketv1alpha1.RedPacketActivityList{}, client.InNamespace(o.ns),
			&client.ListOptions{Raw: &metav1.ListOptions{ResourceVersion: rv}})
		if err != nil {
			if ctx.Err() == nil {
				time.Sleep(50 * time.Millisecond)
			}
			continue
		}
		for ev := range w.ResultChan() {
			if ev.Type == watch.Error {
				// Too old a resourceVersion: start over from the present. Statuses
				// written meanwhile were not seen.
				rv = ""
				o.markGap()
				break
			}
			a, ok := ev.Object.(*redpacketv1alpha1.RedPacketActivity)
			if !ok {
				continue
			}
			rv = a.ResourceVersion
			o.observe(a, time.Now())
		}
		w.Stop()
	}
}

// markGap notes that the watch may have missed statuses.
func (o *operator) markGap() {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, a := range o.acts {
		a.gap = true
	}
}

// observe takes in one watched state of an activity at the instant it was seen.
func (o *operator) observe(obj *redpacketv1alpha1.RedPacketActivity, at time.Time) {
	o.mu.Lock()
	defer o.mu.Unlock()
	act := o.byName[obj.Name]
	if act == nil {
		return
	}
	gen := obj.Status.ObservedGeneration
	if _, ok := act.firstPhase[gen]; !ok {
		act.firstPhase[gen] = obj.Status.Phase
		if act.gap {
			act.unsure[gen] = true
		}
	}
	act.gap = false
	act.status = *obj.Status.DeepCopy()
	act.seen = true
	if obj.Status.Phase == redpacketv1alpha1.PhaseExhausted && act.exhausted != nil && !o.flushed {
		o.rec.add(act.client, act.exhausted.in, Output{State: string(store.Closed), Reason: store.CloseExhausted}, act.exhausted.call, at)
		act.exhausted = nil
	}
	o.resolveLocked(act, at)
}

// resolveLocked records the pending edits of act that its status reports, acting on
// them or having passed them over, as returning at at.
func (o *operator) resolveLocked(act *opActivity, at time.Time) {
	if !act.seen || o.flushed {
		return
	}
	observed := act.status.ObservedGeneration
	keep := act.pending[:0]
	for _, e := range act.pending {
		switch {
		case observed == e.gen && !act.unsure[e.gen]:
			o.stats.acked++
			out, ok := editOutput(e.in.Op, act.firstPhase[e.gen])
			if !ok {
				o.stats.contradictions++
				o.t.Errorf("%s generation %d (%s): the controller reports phase %q", act.name, e.gen, e.in.Op, act.firstPhase[e.gen])
			}
			o.rec.add(act.client, e.in, out, e.call, at)
		case observed >= e.gen:
			o.stats.superseded++
			o.rec.add(act.client, e.in, Output{Unknown: true, Bounded: true}, e.call, at)
		default:
			keep = append(keep, e)
		}
	}
	act.pending = keep
}

// editOutput is the model's output of an edit of operation op that the controller
// reported acting on with phase, and whether that phase can follow from the edit.
func editOutput(op Op, phase redpacketv1alpha1.Phase) (Output, bool) {
	switch phase {
	case redpacketv1alpha1.PhaseActive, redpacketv1alpha1.PhaseScheduled, redpacketv1alpha1.PhasePaused:
		if op == OpCloseExpired {
			return Output{State: string(store.CloseStillOpen)}, false
		}
		return Output{State: string(store.StateOpen)}, (phase == redpacketv1alpha1.PhasePaused) == (op == OpPause)
	case redpacketv1alpha1.PhaseExhausted, redpacketv1alpha1.PhaseExpired:
		if op != OpCloseExpired {
			// Configured, then closed in the same reconcile, or closed before.
			return Output{Unknown: true, Bounded: true}, true
		}
		if phase == redpacketv1alpha1.PhaseExhausted {
			return Output{State: string(store.Closed), Reason: store.CloseExhausted}, true
		}
		return Output{State: string(store.Closed), Reason: store.CloseExpired}, true
	}
	// Failed, or a phase before the packets are committed: no model state accepts it.
	return Output{State: "phase " + string(phase)}, false
}

// pending counts the edits not resolved yet.
func (o *operator) pending() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, a := range o.acts {
		n += len(a.pending)
	}
	return n
}

// Wait waits up to within for the controller to report every pending edit.
func (o *operator) Wait(within time.Duration) {
	deadline := time.Now().Add(within)
	for o.pending() > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
}

// CloseAll closes every activity on an edit of its endTime (unless it has passed
// already) and waits for the controller to report it closed. An activity the
// controller does not close within editWait fails the run and is closed directly,
// so that the rest of the run can still be checked.
func (o *operator) CloseAll(direct redis.UniversalClient) {
	for _, act := range o.acts {
		act.editMu.Lock()
		o.editClose(act)
		act.editMu.Unlock()
	}
	deadline := time.Now().Add(editWait)
	for _, act := range o.acts {
		for {
			o.mu.Lock()
			st, gen := act.status, act.obj.Generation
			o.mu.Unlock()
			if st.ObservedGeneration == gen && (st.Phase == redpacketv1alpha1.PhaseExpired || st.Phase == redpacketv1alpha1.PhaseExhausted) {
				break
			}
			if time.Now().After(deadline) {
				o.t.Errorf("%s: the controller did not close it within %v: phase %q, observed generation %d of %d",
					act.name, editWait, st.Phase, st.ObservedGeneration, gen)
				closeDirect(o.rec, act.client, store.NewActivity(direct, act.uid, 1), act.uid)
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// Flush records the edits never reported as unknown outcomes returning at the end;
// the history is taken next.
func (o *operator) Flush() {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := time.Now()
	for _, a := range o.acts {
		for _, e := range a.pending {
			o.stats.unresolved++
			o.rec.add(a.client, e.in, Output{Unknown: true}, e.call, now)
		}
		a.pending = nil
		if a.exhausted != nil {
			o.rec.add(a.client, a.exhausted.in, Output{Unknown: true}, a.exhausted.call, now)
			a.exhausted = nil
		}
	}
	o.flushed = true
}

// Stats returns what the controller did.
func (o *operator) Stats() operatorStats {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.stats
}

// CheckStatus checks the final status of activity i once settlement has drained:
// the controller's money counters equal Redis's snapshot (it writes them from one
// snapshot), the activity is closed with the snapshot's reason, claimed is what the
// claims hash holds (claims users, at least the acked users the history acknowledged),
// nothing remains, and the refund is the total less what was claimed.
func (o *operator) CheckStatus(i int, act *store.Activity, seed uint64, total, claimed int64, claims, acked int) {
	t := o.t
	a := o.acts[i]
	var snap store.Snapshot
	var got redpacketv1alpha1.RedPacketActivity
	deadline := time.Now().Add(editWait)
	for {
		var err error
		if snap, err = act.Snapshot(context.Background()); err != nil {
			t.Errorf("seed %d: %s: snapshot: %v", seed, a.name, err)
			return
		}
		if err := o.cp.Client.Get(context.Background(), client.ObjectKey{Namespace: o.ns, Name: a.name}, &got); err != nil {
			t.Errorf("seed %d: %s: %v", seed, a.name, err)
			return
		}
		rc, ok := redpacketv1alpha1.RecordedCounters(&got.Status)
		if ok && rc == snap.Counters() {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("seed %d: %s: status counters %+v (recorded %t) never matched Redis's %+v within %v", seed, a.name, rc, ok, snap.Counters(), editWait)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	c := snap.Counters()
	phase, _ := snap.Phase(time.Now())
	switch {
	case snap.State != store.StateClosed || got.Status.Phase != phase:
		t.Errorf("seed %d: %s: status phase %q, Redis %s (%s) says %q", seed, a.name, got.Status.Phase, snap.State, snap.CloseReason, phase)
	case c.ClaimedCount != int64(claims) || c.ClaimedAmount != claimed || int64(acked) > c.ClaimedCount:
		t.Errorf("seed %d: %s: status claims %d (%d) for %d claims of %d in Redis, %d acknowledged", seed, a.name, c.ClaimedCount, c.ClaimedAmount, claims, claimed, acked)
	case c.RemainingCount != 0 || c.RemainingAmount != 0 || c.RefundedAmount != total-c.ClaimedAmount:
		t.Errorf("seed %d: %s: status remaining %d (%d), refunded %d, want 0, 0 and %d", seed, a.name, c.RemainingCount, c.RemainingAmount, c.RefundedAmount, total-c.ClaimedAmount)
	case c.SettledCount != c.ClaimedCount || c.SettledAmount != c.ClaimedAmount || c.DeadLetterCount != 0:
		t.Errorf("seed %d: %s: status settled %d (%d) of %d (%d), %d dead letters", seed, a.name, c.SettledCount, c.SettledAmount, c.ClaimedCount, c.ClaimedAmount, c.DeadLetterCount)
	}
	o.mu.Lock()
	o.stats.statusChecked++
	o.mu.Unlock()
}
