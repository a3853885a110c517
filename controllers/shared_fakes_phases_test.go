package controllers

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// The fakes of the phase tests: an in-memory activity store that behaves like the
// Lua scripts, a status writer that records what would be written, and a reconciler
// wired to them and to controller-runtime's fake client. Every call to the store and
// the writer goes into one call log, so a test can check the order of Redis writes
// and status writes.

// callLog is the ordered record of the calls made to the fakes.
type callLog struct {
	mu    sync.Mutex
	calls []string
}

func (l *callLog) add(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls = append(l.calls, fmt.Sprintf(format, args...))
}

func (l *callLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.calls...)
}

// with returns the calls that start with prefix.
func (l *callLog) with(prefix string) []string {
	var out []string
	for _, c := range l.all() {
		if strings.HasPrefix(c, prefix) {
			out = append(out, c)
		}
	}
	return out
}

func (l *callLog) String() string { return strings.Join(l.all(), "\n") }

// fakeStore is an activity's data in memory. It does what the scripts do: Seed
// commits once, Configure opens a ready activity, Close refunds the remainder once,
// the purges forget everything.
type fakeStore struct {
	log *callLog
	// clock is the Redis server's clock.
	clock time.Time
	// snap is what Redis holds.
	snap store.Snapshot
	// fail makes the named method return the error.
	fail map[string]error

	seeded     []int64
	seedParams store.SeedParams
	retention  time.Duration
	// uid is the activity's, as the reconciler last asked for its store.
	uid types.UID
}

var _ activityStore = (*fakeStore)(nil)

func (f *fakeStore) err(method string) error { return f.fail[method] }

// Resolve finishes no transfer: the plain fake has none (shardedFakeStore, which
// the conservation step's tests use, has).
func (f *fakeStore) Resolve(context.Context) (int, error) { return 0, nil }

// ReadShards reads no steady view, so the conservation step reports nothing of the
// plain fake (shardedFakeStore's views are what it checks).
func (f *fakeStore) ReadShards(context.Context) (store.View, error) { return store.View{}, nil }

func (f *fakeStore) Time(context.Context) (time.Time, error) {
	f.log.add("store.Time")
	if err := f.err("Time"); err != nil {
		return time.Time{}, err
	}
	return f.clock, nil
}

func (f *fakeStore) Snapshot(context.Context) (store.Snapshot, error) {
	f.log.add("store.Snapshot")
	if err := f.err("Snapshot"); err != nil {
		return store.Snapshot{}, err
	}
	return f.snap, nil
}

func (f *fakeStore) Seed(_ context.Context, amounts []int64, p store.SeedParams) (store.SeedResult, error) {
	f.log.add("store.Seed")
	if err := f.err("Seed"); err != nil {
		return store.SeedResult{}, err
	}
	if f.snap.Exists() {
		return store.SeedResult{}, nil
	}
	f.seeded, f.seedParams = amounts, p
	f.snap = store.Snapshot{
		State: store.StateReady, Count: p.Count, Total: p.Total, RemainingCount: p.Count,
		StartMs: p.StartMs, EndMs: p.EndMs, Paused: p.Paused, Sponsor: p.Sponsor,
		SeededMs: f.clock.UnixMilli(),
	}
	return store.SeedResult{Committed: true}, nil
}

func (f *fakeStore) LoadScripts(context.Context) error {
	f.log.add("store.LoadScripts")
	return f.err("LoadScripts")
}

func (f *fakeStore) Configure(ctx context.Context, startMs, endMs int64, paused, open bool) (store.ConfigureResult, error) {
	return f.ConfigureWith(ctx, store.Settings{StartMs: startMs, EndMs: endMs, Paused: paused, Open: open})
}

func (f *fakeStore) ConfigureWith(_ context.Context, st store.Settings) (store.ConfigureResult, error) {
	f.log.add("store.Configure start=%d end=%d paused=%t open=%t", st.StartMs, st.EndMs, st.Paused, st.Open)
	if err := f.err("Configure"); err != nil {
		return store.ConfigureResult{}, err
	}
	if !f.snap.Exists() {
		return store.ConfigureResult{}, nil
	}
	if f.snap.Fenced != "" {
		return store.ConfigureResult{Found: true, Fenced: true}, nil
	}
	if f.snap.State != store.StateClosed {
		f.snap.StartMs, f.snap.EndMs, f.snap.Paused = st.StartMs, st.EndMs, st.Paused
		if st.Open {
			f.snap.State = store.StateOpen
		}
		if st.Sponsor != "" {
			f.snap.Sponsor, f.snap.Currency = st.Sponsor, st.Currency
		}
	}
	return store.ConfigureResult{State: f.snap.State, Found: true}, nil
}

func (f *fakeStore) CheckFsync(context.Context) error {
	f.log.add("store.CheckFsync")
	return f.err("CheckFsync")
}

func (f *fakeStore) CheckReplicas(_ context.Context, n int) error {
	f.log.add("store.CheckReplicas %d", n)
	return f.err("CheckReplicas")
}

func (f *fakeStore) Fence(_ context.Context, why string) (string, error) {
	f.log.add("store.Fence %s", why)
	if err := f.err("Fence"); err != nil {
		return "", err
	}
	if !f.snap.Exists() {
		return "", nil
	}
	if f.snap.Fenced == "" {
		f.snap.Fenced = why
	}
	return f.snap.Fenced, nil
}

func (f *fakeStore) Accept(_ context.Context, seen int64) (int64, error) {
	f.log.add("store.Accept %d", seen)
	if err := f.err("Accept"); err != nil {
		return 0, err
	}
	if !f.snap.Exists() {
		return 0, store.ErrMissing
	}
	if f.snap.Epoch != seen {
		return 0, store.ErrEpochMoved
	}
	f.snap.Fenced = ""
	f.snap.Epoch++
	return f.snap.Epoch, nil
}

func (f *fakeStore) Close(_ context.Context, reason store.CloseReason) (store.CloseResult, error) {
	f.log.add("store.Close %s", reason)
	if err := f.err("Close"); err != nil {
		return store.CloseResult{}, err
	}
	switch {
	case !f.snap.Exists():
		return store.CloseResult{Outcome: store.CloseMissing}, nil
	case f.snap.Fenced != "":
		return store.CloseResult{Outcome: store.CloseFenced}, nil
	case f.snap.State == store.StateClosed:
		return store.CloseResult{Outcome: store.Closed, Reason: f.snap.CloseReason, Refunded: f.snap.Refunded}, nil
	case reason == store.CloseExhausted && f.snap.RemainingCount > 0:
		return store.CloseResult{Outcome: store.CloseStillOpen}, nil
	}
	f.snap.State = store.StateClosed
	f.snap.CloseReason = reason
	f.snap.Refunded = f.snap.Total - f.snap.ClaimedAmount
	f.snap.RemainingCount = 0
	return store.CloseResult{Outcome: store.Closed, Reason: reason, Refunded: f.snap.Refunded}, nil
}

func (f *fakeStore) Purge(context.Context) error {
	f.log.add("store.Purge")
	if err := f.err("Purge"); err != nil {
		return err
	}
	f.snap = store.Snapshot{}
	return nil
}

func (f *fakeStore) PurgeKeepingUnsettled(_ context.Context, retention time.Duration) ([]string, error) {
	f.log.add("store.PurgeKeepingUnsettled")
	if err := f.err("PurgeKeepingUnsettled"); err != nil {
		return nil, err
	}
	f.snap = store.Snapshot{}
	f.retention = retention
	return []string{"rpa:{uid}:stream"}, nil
}

// fakeStatusWriter records the status writes instead of sending them.
type fakeStatusWriter struct {
	log *callLog
	// applied are the controller's statuses, in the order written.
	applied []redpacketv1alpha1.RedPacketActivityStatus
	// counters are the money counters written.
	counters []redpacketv1alpha1.Counters
	// err and countersErr are returned by the writes.
	err, countersErr error
}

var (
	_ statusWriter   = (*fakeStatusWriter)(nil)
	_ countersWriter = (*fakeStatusWriter)(nil)
)

func (w *fakeStatusWriter) applyStatus(_ context.Context, _ *redpacketv1alpha1.RedPacketActivity, st redpacketv1alpha1.RedPacketActivityStatus) error {
	w.log.add("status.apply %s", describeStatus(st))
	if w.err != nil {
		return w.err
	}
	w.applied = append(w.applied, *st.DeepCopy())
	return nil
}

func (w *fakeStatusWriter) applyAcceptance(_ context.Context, _ *redpacketv1alpha1.RedPacketActivity, la redpacketv1alpha1.RedisStateAcceptance) error {
	w.log.add("status.acceptance epoch=%d by=%s", la.Epoch, la.By)
	return nil
}

func (w *fakeStatusWriter) applyCounters(_ context.Context, _ *redpacketv1alpha1.RedPacketActivity, c redpacketv1alpha1.Counters, epoch int64, allowLower bool) error {
	w.log.add("status.counters %+v epoch=%d lower=%t", c, epoch, allowLower)
	if w.countersErr != nil {
		return w.countersErr
	}
	w.counters = append(w.counters, c)
	return nil
}

// last is the last status written.
func (w *fakeStatusWriter) last(t *testing.T) redpacketv1alpha1.RedPacketActivityStatus {
	t.Helper()
	if len(w.applied) == 0 {
		t.Fatal("no status was written")
	}
	return w.applied[len(w.applied)-1]
}

// describeStatus is a one-line summary: the phase, the observed generation and each
// condition as Type=Status/Reason.
func describeStatus(st redpacketv1alpha1.RedPacketActivityStatus) string {
	var b strings.Builder
	fmt.Fprintf(&b, "phase=%s observed=%d", st.Phase, st.ObservedGeneration)
	for _, t := range controllerConditionTypes {
		if c := meta.FindStatusCondition(st.Conditions, t); c != nil {
			fmt.Fprintf(&b, " %s=%s/%s", t, c.Status, c.Reason)
		}
	}
	return b.String()
}

// condition returns "Status/Reason" of the condition, "" when absent.
func condition(st redpacketv1alpha1.RedPacketActivityStatus, condType string) string {
	c := meta.FindStatusCondition(st.Conditions, condType)
	if c == nil {
		return ""
	}
	return string(c.Status) + "/" + c.Reason
}

// conditionMessage returns the condition's message, "" when absent.
func conditionMessage(st redpacketv1alpha1.RedPacketActivityStatus, condType string) string {
	if c := meta.FindStatusCondition(st.Conditions, condType); c != nil {
		return c.Message
	}
	return ""
}

// testNow is the controller's clock (and, unless a test says otherwise, Redis's) in
// the phase tests.
var testNow = time.Date(2026, 12, 31, 20, 0, 0, 0, time.UTC)

// testActivity is an activity of 10 packets summing to 1000, at generation 2, with the
// controller's finalizer.
func testActivity(mutate ...func(*redpacketv1alpha1.RedPacketActivity)) *redpacketv1alpha1.RedPacketActivity {
	a := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{
			Name: "quiz", Namespace: "default", UID: types.UID("uid-1"), Generation: 2,
			Finalizers: []string{Finalizer},
		},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			TotalAmount:  1000,
			Count:        10,
			Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionRandom, MinAmount: 1},
			Sponsor:      "merchant-001",
		},
	}
	for _, m := range mutate {
		m(a)
	}
	return a
}

func withWebhook(a *redpacketv1alpha1.RedPacketActivity) {
	a.Spec.Settlement = &redpacketv1alpha1.Settlement{
		Webhook: &redpacketv1alpha1.Webhook{URL: "http://balance:8080/credit"}, MaxAttempts: 10,
	}
}

// seededStatus makes the status record Seeded, as the API server holds it once the
// seed step ran.
func seededStatus(a *redpacketv1alpha1.RedPacketActivity) {
	at := metav1.NewTime(testNow.Add(-time.Hour))
	a.Status.SeededTime = &at
	meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{
		Type: redpacketv1alpha1.ConditionSeeded, Status: metav1.ConditionTrue,
		Reason: redpacketv1alpha1.ReasonCommitted, ObservedGeneration: a.Generation, LastTransitionTime: at,
	})
}

// openSnapshot is Redis holding the test activity open, in its window, untouched.
func openSnapshot() store.Snapshot {
	return store.Snapshot{State: store.StateOpen, Count: 10, Total: 1000, RemainingCount: 10,
		SeededMs: testNow.Add(-time.Hour).UnixMilli(), Sponsor: "merchant-001", Currency: "CNY"}
}

func testScheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := redpacketv1alpha1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	return s
}

// phaseTest is a reconciler wired to fakes, and the fakes.
type phaseTest struct {
	r      *RedPacketActivityReconciler
	log    *callLog
	store  *fakeStore
	status *fakeStatusWriter
	events *events.FakeRecorder
	client client.Client
}

// newPhaseTest wires a reconciler to a fake store holding snap, a recording status
// writer, and a fake API server holding objs.
func newPhaseTest(t *testing.T, snap store.Snapshot, objs ...client.Object) *phaseTest {
	t.Helper()
	log := &callLog{}
	store := &fakeStore{log: log, clock: testNow, snap: snap}
	writer := &fakeStatusWriter{log: log}
	// The operator's settlement keys, allowing withWebhook's host and port.
	keys := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: DefaultSettlementKeysSecret, Namespace: operatorNamespace()},
		Data: map[string][]byte{"balance_8080": []byte("phase-test-key")}}
	c := fake.NewClientBuilder().WithScheme(testScheme(t)).
		WithStatusSubresource(&redpacketv1alpha1.RedPacketActivity{}).
		WithObjects(append(objs, keys)...).Build()
	rec := events.NewFakeRecorder(100)
	opts, access := phaseOptions(c)
	r := &RedPacketActivityReconciler{
		Client:      c,
		APIReader:   c,
		Recorder:    rec,
		Settlers:    NewSettlementRunner(),
		RedisAccess: access,
		Options:     opts,
		Now:         func() time.Time { return testNow },
		newStore: func(_ redisconn.Conn, uid types.UID) activityStore {
			store.uid = uid
			return store
		},
		statuses: writer,
		counters: writer,
		access:   &fakeReviewer{log: log, grants: map[string][]string{platformUser: {redpacketv1alpha1.VerbAcceptRedisState, redpacketv1alpha1.VerbAbandon}}},
	}
	return &phaseTest{r: r, log: log, store: store, status: writer, events: rec, client: c}
}

// scope is a scope of a, with the store and Redis's clock and snapshot as the Redis
// connection step leaves them.
func (p *phaseTest) scope(a *redpacketv1alpha1.RedPacketActivity) *activityScope {
	s := newActivityScope(a, testNow)
	s.conn = p.r.Options.DefaultRedis
	s.store = p.store
	s.redisNow = p.store.clock
	s.snapshot = p.store.snap
	s.snapshotRead = true
	return s
}

// eventReasons drains the recorded events: "Type Reason" each.
func (p *phaseTest) eventReasons() []string {
	var out []string
	for {
		select {
		case e := <-p.events.Events:
			typ, rest, _ := strings.Cut(e, " ")
			reason, _, _ := strings.Cut(rest, " ")
			out = append(out, typ+" "+reason)
		default:
			return out
		}
	}
}

// blockerReason is the reason of a result's blocker, "" when none.
func blockerReason(res stepResult) string {
	if res.blocker == nil {
		return ""
	}
	return res.blocker.reason
}

func ptrTo[T any](v T) *T { return &v }

// platformUser holds the platform verbs in the phase tests' fakeReviewer.
const platformUser = "platform-alice"

// fakeReviewer answers access reviews from a table of users and the verbs they hold.
type fakeReviewer struct {
	log    *callLog
	grants map[string][]string
}

func (f *fakeReviewer) allowed(_ context.Context, _ client.Object, _, verb, user string, _ []string) (bool, string, error) {
	f.log.add("review %s %s", user, verb)
	for _, v := range f.grants[user] {
		if v == verb {
			return true, "", nil
		}
	}
	return false, "no binding grants it", nil
}

// phaseOptions are the operator-wide settings of both kinds' phase tests (the
// default Redis at redis.test:6379), and the Redis access made of them, which reads
// Secrets through c.
func phaseOptions(c client.Reader) (Options, *RedisAccess) {
	opts := Options{
		DefaultRedis:       redisconn.Conn{Addresses: []string{"redis.test:6379"}},
		ActiveResyncPeriod: 5 * time.Second,
	}.withDefaults()
	access := NewRedisAccess(opts)
	access.APIReader = c
	return opts, access
}
