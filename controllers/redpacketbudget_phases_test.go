package controllers

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// fakeBudget is an in-memory budget store that keeps the scripts' bookkeeping: an
// allotment, live packets by shard (each with its remainder), and the money moved by
// expiry. Every call goes into log.
type fakeBudget struct {
	mu       sync.Mutex
	log      *callLog
	shards   int
	snap     store.BudgetSnapshot
	limits   store.BudgetLimits
	live     map[int][]int64 // shard → remainders of its live packets, soonest due first
	failures map[string]error
	purged   bool
	purging  bool   // MarkPurge was called
	fenced   string // the first reason Fence was given
}

func newFakeBudget(shards int) *fakeBudget {
	return &fakeBudget{log: &callLog{}, shards: shards, live: map[int][]int64{}, failures: map[string]error{}}
}

func (f *fakeBudget) fail(call string) error {
	f.log.add("%s", call)
	name, _, _ := strings.Cut(call, " ")
	return f.failures[name]
}

// addLive puts a live packet with remainder money on shard i, drawn from available.
func (f *fakeBudget) addLive(i int, money int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.live[i] = append(f.live[i], money)
	f.snap.Available -= money
	f.snap.Live += money
	f.snap.LivePackets++
	f.snap.CreatedPackets++
}

func (f *fakeBudget) N() int { return f.shards }

func (f *fakeBudget) LoadLibrary(context.Context) error { return f.fail("LoadLibrary") }

func (f *fakeBudget) Configure(_ context.Context, total int64, limits store.BudgetLimits) error {
	if err := f.fail(fmt.Sprintf("Configure %d", total)); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if total < f.snap.Total {
		return errors.New("a total is never lowered")
	}
	f.snap.Available += total - f.snap.Total
	f.snap.Total = total
	f.limits = limits
	return nil
}

func (f *fakeBudget) AdvanceEpoch(context.Context) (int64, error) {
	if err := f.fail("AdvanceEpoch"); err != nil {
		return 0, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.snap.Epoch++
	return f.snap.Epoch, nil
}

func (f *fakeBudget) Snapshot(context.Context) (store.BudgetSnapshot, error) {
	if err := f.fail("Snapshot"); err != nil {
		return store.BudgetSnapshot{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.snap, nil
}

func (f *fakeBudget) ExpireDue(_ context.Context, i, max int) (int, int64, error) {
	if err := f.fail(fmt.Sprintf("ExpireDue %d", i)); err != nil {
		return 0, 0, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.snap.Closed {
		return 0, 0, nil // in these tests nothing falls due before the budget closes
	}
	n := min(max, len(f.live[i]))
	var money int64
	for _, m := range f.live[i][:n] {
		money += m
	}
	f.live[i] = f.live[i][n:]
	f.snap.Live -= money
	f.snap.Refunded += money
	f.snap.LivePackets -= int64(n)
	f.snap.ExpiredPackets += int64(n)
	return n, money, nil
}

func (f *fakeBudget) Close(context.Context) error {
	if err := f.fail("Close"); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.snap.Closed = true
	return nil
}

func (f *fakeBudget) Fence(_ context.Context, reason string) error {
	if err := f.fail("Fence"); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fenced == "" {
		f.fenced = reason
	}
	return nil
}

func (f *fakeBudget) Unfence(context.Context) error {
	if err := f.fail("Unfence"); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fenced = ""
	return nil
}

func (f *fakeBudget) LedgerSums(context.Context) (store.BudgetLedgerSums, error) {
	return store.BudgetLedgerSums{}, f.fail("LedgerSums")
}

func (f *fakeBudget) MarkPurge(context.Context) error {
	if err := f.fail("MarkPurge"); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.purging = true
	return nil
}

func (f *fakeBudget) PurgeBegun(context.Context) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.purging, nil
}

func (f *fakeBudget) Purge(context.Context) error {
	if err := f.fail("Purge"); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.purged = true
	f.snap = store.BudgetSnapshot{}
	return nil
}

func (f *fakeBudget) CheckDurability(_ context.Context, d *redpacketv1alpha1.Durability) error {
	if err := f.fail("CheckDurability"); err != nil {
		return err
	}
	if d != nil && d.Mode == redpacketv1alpha1.DurabilityFsync && f.failures["fsync"] != nil {
		return f.failures["fsync"]
	}
	return nil
}

func (f *fakeBudget) UserName() string { return "rpb-fake" }

func (f *fakeBudget) EnsureUser(context.Context, string) (store.UserChange, error) {
	return store.UserChange{Nodes: 1}, f.fail("EnsureUser")
}

func (f *fakeBudget) DeleteUser(context.Context) (int, error) { return 1, f.fail("DeleteUser") }

// fakeSettlement records the hook's calls and answers Drained from drained.
type fakeSettlement struct {
	log     *callLog
	drained bool
}

func (f *fakeSettlement) EnsureTarget(_ context.Context, t BudgetSettlementTarget) error {
	f.log.add("settlement.Ensure %s", t.Name.Name)
	return nil
}

func (f *fakeSettlement) DrainedTarget(_ context.Context, t BudgetSettlementTarget) (BudgetDrain, error) {
	f.log.add("settlement.Drained %s", t.Name.Name)
	if f.drained {
		return BudgetDrain{Drained: true}, nil
	}
	return BudgetDrain{Unsettled: 3}, nil
}

func (f *fakeSettlement) Forget(uid types.UID) { f.log.add("settlement.Forget %s", uid) }

// phaseBudget is a valid budget "shop" in namespace "ns".
func phaseBudget(mutate ...func(*redpacketv1alpha1.RedPacketBudget)) *redpacketv1alpha1.RedPacketBudget {
	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Name: "shop", Namespace: "ns", UID: "buid-1", Generation: 1},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{
			Total: 1_000_000, BudgetShards: 4,
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 20_000, MaxCount: 100, MinShare: 1,
				Distributions: []redpacketv1alpha1.DistributionType{redpacketv1alpha1.DistributionRandom},
				MaxTTL:        &metav1.Duration{Duration: time.Hour}},
		},
	}
	for _, m := range mutate {
		m(b)
	}
	return b
}

// budgetPhaseReconciler is a reconciler on controller-runtime's fake client and the
// fake store.
func budgetPhaseReconciler(t *testing.T, f *fakeBudget, objs ...client.Object) (*RedPacketBudgetReconciler, client.Client) {
	t.Helper()
	c := fake.NewClientBuilder().WithScheme(testScheme(t)).
		WithStatusSubresource(&redpacketv1alpha1.RedPacketBudget{}).WithObjects(objs...).Build()
	opts, access := phaseOptions(c)
	r := &RedPacketBudgetReconciler{
		Client: c, APIReader: c, Recorder: events.NewFakeRecorder(100),
		Expiry:      NewBudgetExpiry(),
		RedisAccess: access,
		Options:     opts,
		Now:         func() time.Time { return time.Unix(1_800_000_000, 0) },
		newStore:    func(redisconn.Conn, *redpacketv1alpha1.RedPacketBudget) budgetStore { return f },
	}
	return r, c
}

// The limits the store writes follow the spec, with the defaults of an unset field,
// and the default TTL never above the max.
func TestBudgetLimits(t *testing.T) {
	l := budgetLimits(phaseBudget())
	want := store.BudgetLimits{Currency: "CNY", MaxTotal: 20_000, MaxCount: 100, MinShare: 1,
		Distributions: []string{"Random"}, DefaultTTL: time.Hour, MaxTTL: time.Hour}
	if fmt.Sprint(l) != fmt.Sprint(want) {
		t.Errorf("limits %+v, want %+v (default TTL capped by max TTL)", l, want)
	}
	l = budgetLimits(phaseBudget(func(b *redpacketv1alpha1.RedPacketBudget) {
		b.Spec.Packets = redpacketv1alpha1.PacketLimits{MaxTotal: 5}
		b.Spec.Currency = "USD"
	}))
	if l.Currency != "USD" || l.MaxCount != 100 || l.MinShare != 1 || len(l.Distributions) != 3 ||
		l.DefaultTTL != 24*time.Hour || l.MaxTTL != 24*time.Hour {
		t.Errorf("defaults %+v", l)
	}
}

// The configure step writes the total when Redis holds another one or the spec
// changed, and never lowers it.
func TestBudgetConfigureStep(t *testing.T) {
	for _, tc := range []struct {
		name          string
		redisTotal    int64
		specTotal     int64
		observed      int64
		wantConfigure bool
		wantStalled   string
	}{
		{name: "first time", redisTotal: 0, specTotal: 1000, wantConfigure: true},
		{name: "a refill", redisTotal: 1000, specTotal: 1500, observed: 1, wantConfigure: true},
		{name: "a spec change with the same total", redisTotal: 1000, specTotal: 1000, observed: 0, wantConfigure: true},
		{name: "nothing changed", redisTotal: 1000, specTotal: 1000, observed: 1},
		{name: "Redis holds more", redisTotal: 2000, specTotal: 1000, observed: 1, wantStalled: redpacketv1alpha1.ReasonConfigureRefused},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeBudget(4)
			f.snap.Total, f.snap.Available = tc.redisTotal, tc.redisTotal
			b := phaseBudget(func(b *redpacketv1alpha1.RedPacketBudget) {
				b.Spec.Total = tc.specTotal
				b.Status.ObservedGeneration = tc.observed
			})
			r, _ := budgetPhaseReconciler(t, f)
			s := newBudgetScope(b, r.now())
			s.store, s.snapshot = f, f.snap
			res, err := r.reconcileBudgetConfigure(t.Context(), s)
			configured := len(f.log.with("Configure")) > 0
			if configured != tc.wantConfigure {
				t.Errorf("Configure called %v, want %v (%v)", configured, tc.wantConfigure, f.log.all())
			}
			if tc.wantStalled != "" {
				if s.stalled == nil || s.stalled.reason != tc.wantStalled || !res.halt || s.configured {
					t.Errorf("stalled %+v halt %v configured %v, want Stalled %s", s.stalled, res.halt, s.configured, tc.wantStalled)
				}
				return
			}
			if err != nil || !s.configured || s.snapshot.Total != tc.specTotal || s.snapshot.Available != tc.specTotal {
				t.Errorf("err %v configured %v snapshot %+v, want the spec's total allotted", err, s.configured, s.snapshot)
			}
		})
	}
}

// The status: the money from one snapshot, rates from the last status's snapshot,
// Ready only with an available grab replica, Stalled when the money does not add up.
func TestComputeBudgetStatus(t *testing.T) {
	now := time.Unix(1_800_000_010, 0)
	available := &appsv1.Deployment{Status: appsv1.DeploymentStatus{Replicas: 2, AvailableReplicas: 2}}
	for _, tc := range []struct {
		name        string
		snap        store.BudgetSnapshot
		prev        *redpacketv1alpha1.RedPacketBudgetStatus
		deployment  *appsv1.Deployment
		wantReady   metav1.ConditionStatus
		wantReason  string
		wantStalled string
		wantRates   [2]int64
	}{
		{
			name:       "configured, first snapshot, a replica available",
			snap:       store.BudgetSnapshot{Total: 1000, Available: 1000},
			deployment: available, wantReady: metav1.ConditionTrue, wantReason: redpacketv1alpha1.ReasonBudgetReady,
		},
		{
			name: "rates from the last snapshot ten seconds ago",
			snap: store.BudgetSnapshot{Total: 1000, Available: 400, Live: 300, Claimed: 200, Refunded: 100,
				CreatedPackets: 1000, GrabbedShares: 4005},
			prev: &redpacketv1alpha1.RedPacketBudgetStatus{CreatedPackets: new(int64(0)), GrabbedShares: new(int64(5)),
				SnapshotTime: &metav1.Time{Time: now.Add(-10 * time.Second)}},
			deployment: available, wantReady: metav1.ConditionTrue, wantReason: redpacketv1alpha1.ReasonBudgetReady,
			wantRates: [2]int64{100, 400},
		},
		{
			name:       "no available replica",
			snap:       store.BudgetSnapshot{Total: 1000, Available: 1000},
			deployment: &appsv1.Deployment{}, wantReady: metav1.ConditionFalse, wantReason: redpacketv1alpha1.ReasonGrabServiceUnavailable,
		},
		{
			name:       "the money does not add up",
			snap:       store.BudgetSnapshot{Total: 1000, Available: 900, Claimed: 200},
			deployment: available, wantReady: metav1.ConditionFalse, wantReason: redpacketv1alpha1.ReasonConservationBroken,
			wantStalled: redpacketv1alpha1.ReasonConservationBroken,
		},
		{
			name:       "the sums agree, a shard borrowed money no sibling lent",
			snap:       store.BudgetSnapshot{Total: 1000, Available: 1000, Borrowed: 500, LentAfter: 200},
			deployment: available, wantReady: metav1.ConditionFalse, wantReason: redpacketv1alpha1.ReasonConservationBroken,
			wantStalled: redpacketv1alpha1.ReasonConservationBroken,
		},
		{
			name:       "the sums agree, two shards' own do not",
			snap:       store.BudgetSnapshot{Total: 1000, Available: 1000, UnconservedShards: []int{2, 3}},
			deployment: available, wantReady: metav1.ConditionFalse, wantReason: redpacketv1alpha1.ReasonConservationBroken,
			wantStalled: redpacketv1alpha1.ReasonConservationBroken,
		},
		{
			name:       "a move under way: borrowed and lent agree",
			snap:       store.BudgetSnapshot{Total: 1000, Available: 1000, Borrowed: 500, LentAfter: 700},
			deployment: available, wantReady: metav1.ConditionTrue, wantReason: redpacketv1alpha1.ReasonBudgetReady,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := phaseBudget()
			if tc.prev != nil {
				b.Status = *tc.prev
			}
			s := newBudgetScope(b, now)
			s.snapshot, s.snapshotRead, s.configured, s.deployment = tc.snap, true, true, tc.deployment
			computeBudgetStatus(s, true)
			st := s.status
			if *st.Total != tc.snap.Total || *st.Available != tc.snap.Available || *st.InPackets != tc.snap.Live ||
				*st.Claimed != tc.snap.Claimed || *st.Refunded != tc.snap.Refunded {
				t.Errorf("money %d %d %d %d %d, want the snapshot's %+v", *st.Total, *st.Available, *st.InPackets, *st.Claimed, *st.Refunded, tc.snap)
			}
			if *st.CreatedPerSecond != tc.wantRates[0] || *st.GrabbedPerSecond != tc.wantRates[1] {
				t.Errorf("rates %d/s %d/s, want %v", *st.CreatedPerSecond, *st.GrabbedPerSecond, tc.wantRates)
			}
			ready := meta.FindStatusCondition(st.Conditions, redpacketv1alpha1.ConditionReady)
			if ready == nil || ready.Status != tc.wantReady || ready.Reason != tc.wantReason {
				t.Errorf("Ready %+v, want %s %s", ready, tc.wantReady, tc.wantReason)
			}
			stalled := meta.FindStatusCondition(st.Conditions, redpacketv1alpha1.ConditionStalled)
			switch {
			case tc.wantStalled == "" && stalled != nil:
				t.Errorf("Stalled %+v, want none", stalled)
			case tc.wantStalled != "" && (stalled == nil || stalled.Status != metav1.ConditionTrue || stalled.Reason != tc.wantStalled):
				t.Errorf("Stalled %+v, want True %s", stalled, tc.wantStalled)
			}
			if st.Selector != "app.kubernetes.io/name=redpacket-grab,redpacket.io/budget=shop" || st.ObservedGeneration != 1 {
				t.Errorf("selector %q observed %d", st.Selector, st.ObservedGeneration)
			}
		})
	}
}

// A whole reconcile of a new budget on the fake client: the finalizer, the library,
// the allotment, the sender Secret minted once, the expiry driver tracking it, and a
// status whose money adds up; a second reconcile keeps the token.
func TestReconcileNewBudget(t *testing.T) {
	f := newFakeBudget(4)
	b := phaseBudget(func(b *redpacketv1alpha1.RedPacketBudget) { b.Spec.Redis = nil })
	r, c := budgetPhaseReconciler(t, f, b)
	req := ctrl.Request{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "shop"}}
	res, err := r.Reconcile(t.Context(), req)
	if err != nil {
		t.Fatalf("reconcile: %v (calls %v)", err, f.log.all())
	}
	if res.RequeueAfter != 5*time.Second {
		t.Errorf("requeue after %v, want the resync period", res.RequeueAfter)
	}
	for _, want := range []string{"LoadLibrary", "Configure 1000000", "EnsureUser"} {
		if !slices.Contains(f.log.all(), want) {
			t.Errorf("calls %v lack %s", f.log.all(), want)
		}
	}
	if r.Expiry.Tracked() != 1 {
		t.Errorf("the expiry driver tracks %d budgets", r.Expiry.Tracked())
	}
	got := &redpacketv1alpha1.RedPacketBudget{}
	if err := c.Get(t.Context(), req.NamespacedName, got); err != nil {
		t.Fatal(err)
	}
	if !controllerutil.ContainsFinalizer(got, BudgetFinalizer) {
		t.Error("no finalizer")
	}
	if got.Status.Total == nil || *got.Status.Total != 1_000_000 || *got.Status.Available != 1_000_000 ||
		got.Status.SenderSecretName != "shop-sender" {
		t.Errorf("status %+v", got.Status)
	}
	sender := &corev1.Secret{}
	if err := c.Get(t.Context(), client.ObjectKey{Namespace: "ns", Name: "shop-sender"}, sender); err != nil {
		t.Fatalf("sender secret: %v", err)
	}
	token := string(sender.Data["token"])
	if len(token) != 43 || !metav1.IsControlledBy(sender, got) {
		t.Errorf("sender token %q owners %+v", token, sender.OwnerReferences)
	}
	d := &appsv1.Deployment{}
	if err := c.Get(t.Context(), client.ObjectKey{Namespace: "ns", Name: "shop-grab"}, d); err != nil {
		t.Fatalf("grab deployment: %v", err)
	}
	if args := d.Spec.Template.Spec.Containers[0].Args; !slices.Contains(args, "--budget-uid=buid-1") || !slices.Contains(args, "--budget-shards=4") {
		t.Errorf("grab args %q", args)
	}
	if d.Spec.Template.Annotations[specs.AnnotationRedisCredentials] == "" {
		t.Error("the pods do not carry the digest of the budget's Redis login")
	}
	if _, err := r.Reconcile(t.Context(), req); err != nil {
		t.Fatalf("second reconcile: %v", err)
	}
	again := &corev1.Secret{}
	if err := c.Get(t.Context(), client.ObjectKey{Namespace: "ns", Name: "shop-sender"}, again); err != nil || string(again.Data["token"]) != token {
		t.Errorf("the sender token changed: %q → %q (%v)", token, again.Data["token"], err)
	}
	if n := len(f.log.with("Configure")); n != 1 {
		t.Errorf("Configure ran %d times; an unchanged spec needs it once", n)
	}
}

// Deletion closes, expires every live packet (in batches of 500), waits for the
// settlement to drain, and only then removes the user and the keys and lets go.
func TestBudgetDeletion(t *testing.T) {
	f := newFakeBudget(2)
	f.snap.Total, f.snap.Available = 1_000_000, 1_000_000
	for i := range 1203 {
		f.addLive(i%2, 7)
	}
	settle := &fakeSettlement{log: f.log}
	now := metav1.Now()
	b := phaseBudget(func(b *redpacketv1alpha1.RedPacketBudget) {
		b.Spec.BudgetShards = 2
		b.Spec.Settlement = &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: "http://balance/credit"}}
		b.Finalizers = []string{BudgetFinalizer}
		b.DeletionTimestamp = &now
	})
	r, c := budgetPhaseReconciler(t, f, b)
	r.Settlement = settle
	r.Expiry.Track(b.UID, f)
	req := ctrl.Request{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "shop"}}

	res, err := r.Reconcile(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	if f.snap.LivePackets != 0 || f.snap.Refunded != 1203*7 || !f.snap.Conserved() {
		t.Errorf("after the first pass %+v, want every packet refunded and the money conserved", f.snap)
	}
	if f.purged || len(f.log.with("DeleteUser")) > 0 || res.RequeueAfter != r.Options.CleanupPollInterval {
		t.Errorf("purged %v calls %v requeue %v: nothing may go before settlement drained", f.purged, f.log.with("DeleteUser"), res.RequeueAfter)
	}
	// 602 and 601 live packets: full batches on each shard, then a short one.
	if n, want := len(f.log.with("ExpireDue")), 602/budgetExpiryBatch+1+601/budgetExpiryBatch+1; n != want {
		t.Errorf("%d ExpireDue calls, want %d", n, want)
	}
	got := &redpacketv1alpha1.RedPacketBudget{}
	if err := c.Get(t.Context(), req.NamespacedName, got); err != nil {
		t.Fatal(err)
	}
	if ready := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionReady); ready == nil ||
		ready.Reason != redpacketv1alpha1.ReasonSettlementPending || !strings.Contains(ready.Message, "3 entries") ||
		!strings.Contains(ready.Message, "redpacket.io/abandon=buid-1") || *got.Status.Refunded != 1203*7 {
		t.Errorf("status while deleting %+v", got.Status)
	}

	settle.drained = true
	if _, err := r.Reconcile(t.Context(), req); err != nil {
		t.Fatal(err)
	}
	calls := f.log.all()
	order := []string{"Close", "settlement.Drained shop", "DeleteUser", "Purge", "settlement.Forget buid-1"}
	last := -1
	for _, want := range order {
		i := slices.Index(calls, want)
		if i < 0 || i < last {
			t.Fatalf("calls %v: want %v in that order", calls, order)
		}
		last = i
	}
	if !f.purged || r.Expiry.Tracked() != 0 {
		t.Errorf("purged %v, expiry still tracks %d", f.purged, r.Expiry.Tracked())
	}
	if err := c.Get(t.Context(), req.NamespacedName, got); err == nil && controllerutil.ContainsFinalizer(got, BudgetFinalizer) {
		t.Error("the finalizer is still there")
	}
}

// A deleted budget whose Redis comes back without it (the snapshot below the
// status's marks) before its purge began is fenced, DataLost, and neither expired
// nor purged; once its purge began (MarkPurge), the keys' absence is the purge's, and
// a purge cut short is finished.
func TestBudgetDeletionAfterALoss(t *testing.T) {
	for _, tc := range []struct {
		name         string
		purgeBegun   bool
		wantPurged   bool
		wantStalled  string
		wantNoExpiry bool
	}{
		{name: "lost after the deletion began", wantStalled: redpacketv1alpha1.ReasonDataLost, wantNoExpiry: true},
		{name: "the purge was cut short", purgeBegun: true, wantPurged: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeBudget(2)
			f.purging = tc.purgeBegun // the snapshot is empty: the keys are gone
			now := metav1.Now()
			b := phaseBudget(func(b *redpacketv1alpha1.RedPacketBudget) {
				b.Spec.BudgetShards = 2
				b.Finalizers = []string{BudgetFinalizer}
				b.DeletionTimestamp = &now
				b.Status.Total, b.Status.InPackets, b.Status.Claimed = new(int64(1000)), new(int64(500)), new(int64(500))
			})
			r, c := budgetPhaseReconciler(t, f, b)
			req := ctrl.Request{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "shop"}}
			if _, err := r.Reconcile(t.Context(), req); err != nil {
				t.Fatal(err)
			}
			if f.purged != tc.wantPurged {
				t.Errorf("purged %v, want %v (calls %v)", f.purged, tc.wantPurged, f.log.all())
			}
			if tc.wantNoExpiry && (len(f.log.with("ExpireDue")) > 0 || len(f.log.with("Close")) > 0) {
				t.Errorf("calls %v: nothing may be closed or expired from what came back", f.log.all())
			}
			if tc.wantStalled == "" {
				return
			}
			got := &redpacketv1alpha1.RedPacketBudget{}
			if err := c.Get(t.Context(), req.NamespacedName, got); err != nil {
				t.Fatal(err)
			}
			if st := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionStalled); st == nil ||
				st.Reason != tc.wantStalled || !strings.Contains(st.Message, "500") || f.fenced != tc.wantStalled {
				t.Errorf("Stalled %+v, fence %q; want %s naming the 500 at risk", st, f.fenced, tc.wantStalled)
			}
		})
	}
}

// A Redis that does not answer makes the budget Stalled, and nothing is configured.
func TestBudgetRedisDownIsStalled(t *testing.T) {
	f := newFakeBudget(4)
	f.failures["Snapshot"] = errors.New("connection refused")
	b := phaseBudget(func(b *redpacketv1alpha1.RedPacketBudget) { b.Finalizers = []string{BudgetFinalizer} })
	r, c := budgetPhaseReconciler(t, f, b)
	req := ctrl.Request{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "shop"}}
	if _, err := r.Reconcile(t.Context(), req); err == nil {
		t.Fatal("reconcile succeeded with Redis down")
	}
	got := &redpacketv1alpha1.RedPacketBudget{}
	if err := c.Get(t.Context(), req.NamespacedName, got); err != nil {
		t.Fatal(err)
	}
	stalled := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionStalled)
	if stalled == nil || stalled.Status != metav1.ConditionTrue || stalled.Reason != redpacketv1alpha1.ReasonRedisUnavailable {
		t.Errorf("Stalled %+v, want True RedisUnavailable", stalled)
	}
	if len(f.log.with("Configure")) > 0 || got.Status.ObservedGeneration != 0 {
		t.Errorf("calls %v observed %d", f.log.all(), got.Status.ObservedGeneration)
	}
}

// fakeExpirer has a number of due packets per shard, each worth one unit, and may
// fail on some shards.
type fakeExpirer struct {
	mu    sync.Mutex
	due   []int
	fails map[int]bool
	calls []int
}

func (e *fakeExpirer) N() int { return len(e.due) }

func (e *fakeExpirer) ExpireDue(_ context.Context, i, max int) (int, int64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.calls = append(e.calls, i)
	if e.fails[i] {
		return 0, 0, errors.New("shard down")
	}
	n := min(max, e.due[i])
	e.due[i] -= n
	return n, int64(n), nil
}

// One pass of the expiry driver drains every shard batch after batch until a batch
// comes back short; a failing shard holds up neither the others nor other budgets,
// and is drained at a later pass.
func TestBudgetExpiryPass(t *testing.T) {
	one := &fakeExpirer{due: []int{1234, 10, 700}, fails: map[int]bool{2: true}}
	two := &fakeExpirer{due: []int{500}}
	e := NewBudgetExpiry()
	e.Track("one", one)
	e.Track("two", two)
	n, money := e.ExpireOnce(t.Context())
	if n != 1234+10+500 || money != int64(n) {
		t.Errorf("first pass expired %d (%d), want %d", n, money, 1234+10+500)
	}
	if one.due[0] != 0 || one.due[1] != 0 || one.due[2] != 700 || two.due[0] != 0 {
		t.Errorf("left due %v %v", one.due, two.due)
	}
	// Full batches until a short one: 500 due take 500/batch full calls and an
	// empty one when the batch divides 500.
	if c, want := len(two.calls), 500/budgetExpiryBatch+1; c != want {
		t.Errorf("budget two: %d calls, want %d (full batches, then a short one)", c, want)
	}
	one.fails[2] = false
	if n, _ := e.ExpireOnce(t.Context()); n != 700 || one.due[2] != 0 {
		t.Errorf("second pass expired %d, left %d", n, one.due[2])
	}
	e.Forget("one")
	e.Forget("two")
	if e.Tracked() != 0 {
		t.Errorf("tracks %d after Forget", e.Tracked())
	}
	if total, _ := e.Totals(); total != 1234+10+500+700 {
		t.Errorf("totals %d", total)
	}
}

// A budget whose Redis does not give its durability is not configured: Ready False
// with DurabilityNotMet, and no money is allotted.
func TestBudgetDurabilityNotMet(t *testing.T) {
	f := newFakeBudget(4)
	f.failures["fsync"] = fmt.Errorf("%w: appendfsync everysec", store.ErrDurabilityNotMet)
	b := phaseBudget(func(b *redpacketv1alpha1.RedPacketBudget) {
		b.Finalizers = []string{BudgetFinalizer}
		b.Spec.Durability = &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityFsync}
	})
	r, c := budgetPhaseReconciler(t, f, b)
	req := ctrl.Request{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "shop"}}
	if _, err := r.Reconcile(t.Context(), req); err != nil {
		t.Fatal(err)
	}
	got := &redpacketv1alpha1.RedPacketBudget{}
	if err := c.Get(t.Context(), req.NamespacedName, got); err != nil {
		t.Fatal(err)
	}
	ready := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionReady)
	if ready == nil || ready.Reason != redpacketv1alpha1.ReasonDurabilityNotMet || len(f.log.with("Configure")) > 0 {
		t.Errorf("Ready %+v, calls %v: want DurabilityNotMet and nothing configured", ready, f.log.all())
	}
}

// The settlement of a budget on a Redis of its own (spec.redis) keeps its ledger on
// the operator's default Redis (BudgetSettlementTarget.LedgerConn); a budget on the
// default Redis keeps it beside itself, which is the operator's Redis already.
func TestBudgetSettlementTargetPutsTheLedgerOnTheOperatorsRedis(t *testing.T) {
	def := redisconn.Conn{Addresses: []string{"redis.operator:6379"}, Username: "ops", Password: "operator-pw"}
	own := redisconn.Conn{Mode: redisconn.ModeStandalone, Addresses: []string{"redis.tenant:6379"}, Password: "tenant-pw"}
	r := &RedPacketBudgetReconciler{RedisAccess: &RedisAccess{DefaultRedis: def}}
	for _, tc := range []struct {
		name       string
		conn       redisconn.Conn
		wantLedger bool
	}{
		{"spec.redis", own, true},
		{"the default Redis", redisconn.Conn{Mode: redisconn.ModeStandalone, Addresses: def.Addresses, Username: "ops", Password: "operator-pw"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &redpacketv1alpha1.RedPacketBudget{ObjectMeta: metav1.ObjectMeta{Name: "shop", Namespace: "ns", UID: "buid"},
				Spec: redpacketv1alpha1.RedPacketBudgetSpec{Total: 1000}}
			s := newBudgetScope(b, time.Now())
			s.conn = tc.conn
			got := r.settlementTarget(s)
			if !tc.wantLedger {
				if got.LedgerConn != nil {
					t.Fatalf("the ledger goes to %v; want beside the budget", got.LedgerConn.Addresses)
				}
				return
			}
			if got.LedgerConn == nil || got.LedgerConn.Key() != (redisconn.Conn{Mode: redisconn.ModeStandalone, Addresses: def.Addresses,
				Username: "ops", Password: "operator-pw"}).Key() {
				t.Fatalf("the ledger of a budget on its own Redis goes to %+v; want the operator's default Redis", got.LedgerConn)
			}
			if got.LedgerClientOptions.DialCheck != nil {
				t.Errorf("the operator's own Redis is dialled with the tenant address check")
			}
		})
	}
}
