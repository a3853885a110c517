package controllers_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

// recordingSettlement is a BudgetSettlement that settles nothing itself: it records
// the budget's snapshot each time deletion asks whether settlement drained, and
// answers yes, so a test can see what the budget held just before it was purged.
type recordingSettlement struct {
	rdbBudget func(t controllers.BudgetSettlementTarget) *store.Budget
	mu        sync.Mutex
	ensured   int
	atDrain   []store.BudgetSnapshot
	forgotten []types.UID
	// holdDrain, while set, reports every budget not drained yet: a deletion waits
	// for its refunds to settle.
	holdDrain atomic.Bool
}

// recordingSettlement is a recordingSettlement whose budgets are on the test's Redis.
func (e *env) recordingSettlement() *recordingSettlement {
	return &recordingSettlement{rdbBudget: func(t controllers.BudgetSettlementTarget) *store.Budget {
		return store.NewBudget(e.rdb, string(t.UID), t.Shards)
	}}
}

func (s *recordingSettlement) EnsureTarget(context.Context, controllers.BudgetSettlementTarget) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ensured++
	return nil
}

func (s *recordingSettlement) DrainedTarget(ctx context.Context, t controllers.BudgetSettlementTarget) (controllers.BudgetDrain, error) {
	snap, err := s.rdbBudget(t).Snapshot(ctx)
	if err != nil {
		return controllers.BudgetDrain{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.atDrain = append(s.atDrain, snap)
	if s.holdDrain.Load() {
		return controllers.BudgetDrain{Unsettled: 1}, nil
	}
	return controllers.BudgetDrain{Drained: true}, nil
}

func (s *recordingSettlement) Forget(uid types.UID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.forgotten = append(s.forgotten, uid)
}

// startBudgetController runs a manager with the budget reconciler for the test's
// namespace, on the test's Redis as the default, with the options tweak changes; it
// stops at the test's cleanup at the latest, or when the returned function is called
// (which waits for it).
func (e *env) startBudgetController(settlement controllers.BudgetSettlement, tweak ...func(*controllers.Options)) (stop func()) {
	e.t.Helper()
	mgr := e.newManager(e.config())
	expiry := controllers.NewBudgetExpiry()
	expiry.Interval = 50 * time.Millisecond
	if err := mgr.Add(expiry); err != nil {
		e.t.Fatal(err)
	}
	r := &controllers.RedPacketBudgetReconciler{
		Expiry:     expiry,
		Settlement: settlement,
		Options: controllers.Options{
			DefaultRedis:        e.redis.Conn(),
			GrabImage:           "registry.example/redpacket-operator:test",
			RedisTimeout:        3 * time.Second,
			ActiveResyncPeriod:  300 * time.Millisecond,
			CleanupPollInterval: 200 * time.Millisecond,
			MaxBackoff:          time.Second,
			Name:                fmt.Sprintf("rpb-%s-%d", e.ns, managerSeq.Add(1)),
			SkipNameValidation:  true,
		},
	}
	for _, f := range tweak {
		f(&r.Options)
	}
	if err := r.SetupWithManager(mgr); err != nil {
		e.t.Fatalf("setting up the budget controller: %v", err)
	}
	return e.run(mgr).Stop
}

// getBudget reads the budget from the API server.
func (e *env) getBudget(name string) *redpacketv1alpha1.RedPacketBudget {
	e.t.Helper()
	b := &redpacketv1alpha1.RedPacketBudget{}
	if err := e.c.Get(context.Background(), client.ObjectKey{Namespace: e.ns, Name: name}, b); err != nil {
		e.t.Fatalf("getting budget %s: %v", name, err)
	}
	return b
}

// patchBudget changes a budget with a merge patch, which a concurrent status write
// cannot make conflict.
func (e *env) patchBudget(name string, change func(*redpacketv1alpha1.RedPacketBudget)) {
	e.t.Helper()
	b := e.getBudget(name)
	orig := b.DeepCopy()
	change(b)
	if err := e.c.Patch(context.Background(), b, client.MergeFrom(orig)); err != nil {
		e.t.Fatalf("patching budget %s: %v", name, err)
	}
}

// waitRedPacketBudget waits until cond holds for the budget, and returns it.
func (e *env) waitRedPacketBudget(name, what string, timeout time.Duration, cond func(b *redpacketv1alpha1.RedPacketBudget) bool) *redpacketv1alpha1.RedPacketBudget {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		b := e.getBudget(name)
		if cond(b) {
			return b
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("budget %s: %s did not happen within %v; status %+v", name, what, timeout, describeBudget(b))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func describeBudget(b *redpacketv1alpha1.RedPacketBudget) string {
	val := func(p *int64) string {
		if p == nil {
			return "-"
		}
		return fmt.Sprint(*p)
	}
	var conds []string
	for _, c := range b.Status.Conditions {
		conds = append(conds, fmt.Sprintf("%s=%s/%s: %s", c.Type, c.Status, c.Reason, c.Message))
	}
	return fmt.Sprintf("total %s available %s inPackets %s claimed %s refunded %s live %s; %s",
		val(b.Status.Total), val(b.Status.Available), val(b.Status.InPackets), val(b.Status.Claimed),
		val(b.Status.Refunded), val(b.Status.LivePackets), strings.Join(conds, "; "))
}

// is reports whether a status figure is there and equals want.
func is(p *int64, want int64) bool { return p != nil && *p == want }

// A budget on real servers, from creation to deletion: it is configured in Redis
// over its shards, gets its Redis user, sender credential and grab workload, becomes
// Ready once its Deployment has an available replica, is refilled, reports exact
// money after packets are created and grabbed, and its deletion expires and refunds
// every live packet before it purges every key.
func TestBudgetLifecycle(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	settle := e.recordingSettlement()
	e.startBudgetController(settle)

	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "shop"},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{
			Total:        1_000_000,
			BudgetShards: 4,
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 20_000, MaxCount: 10,
				Distributions: []redpacketv1alpha1.DistributionType{redpacketv1alpha1.DistributionRandom, redpacketv1alpha1.DistributionFixed}},
			GrabService: redpacketv1alpha1.BudgetGrabService{Replicas: new(int32(2))},
			Settlement:  &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: "http://balance.default.svc/credit"}},
		},
	}
	if err := e.c.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	b = e.waitRedPacketBudget("shop", "configured", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Total, 1_000_000) && is(b.Status.Available, 1_000_000)
	})
	t.Logf("configured after %v: %s", time.Since(start).Round(time.Millisecond), describeBudget(b))
	uid := string(b.UID)

	// Redis holds the four shards, each with its part of the total.
	h := store.NewBudget(e.rdb, uid, 4)
	var allotted int64
	for i := range 4 {
		sn, err := h.ShardSnapshot(ctx, i)
		if err != nil {
			t.Fatalf("shard %d: %v", i, err)
		}
		if n, _ := e.rdb.Exists(ctx, h.ShardKeys(i).Meta).Result(); n != 1 {
			t.Errorf("shard %d's meta %s is not in Redis", i, h.ShardKeys(i).Meta)
		}
		allotted += sn.Allotted
	}
	if allotted != 1_000_000 {
		t.Errorf("the shards allot %d, want 1000000", allotted)
	}
	if user, err := e.rdb.Do(ctx, "acl", "getuser", "rpb-"+uid).Result(); err != nil || user == nil {
		t.Errorf("the budget's Redis user: %v, %v", user, err)
	}

	// The sender credential, the grab Deployment and Service.
	sender := &corev1.Secret{}
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "shop-sender"}, sender); err != nil {
		t.Fatalf("sender secret: %v", err)
	}
	if tok := string(sender.Data["token"]); len(tok) != 43 || b.Status.SenderSecretName != "shop-sender" {
		t.Errorf("sender token %q, status.senderSecretName %q", tok, b.Status.SenderSecretName)
	}
	d := &appsv1.Deployment{}
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "shop-grab"}, d); err != nil {
		t.Fatalf("grab deployment: %v", err)
	}
	args := d.Spec.Template.Spec.Containers[0].Args
	for _, want := range []string{"--namespace=" + e.ns, "--budget=shop", "--budget-uid=" + uid, "--budget-shards=4",
		"--listen=:8080", "--sender-token-file=/etc/redpacket/sender/token"} {
		if !slices.Contains(args, want) {
			t.Errorf("grab args %q lack %q", args, want)
		}
	}
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 2 {
		t.Errorf("grab replicas %v, want 2", d.Spec.Replicas)
	}
	svc := &corev1.Service{}
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "shop-grab"}, svc); err != nil {
		t.Fatalf("grab service: %v", err)
	}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != 8080 {
		t.Errorf("service ports %+v", svc.Spec.Ports)
	}
	if limit := d.Spec.Template.Spec.Containers[0].Resources.Limits.Memory(); limit.Cmp(resource.MustParse("256Mi")) != 0 {
		t.Errorf("grab container memory limit %v, want 256Mi", limit)
	}

	// The grab workload's guards, as an activity's: a NetworkPolicy, and with 2 replicas a
	// PodDisruptionBudget, both the budget's and selecting its pods.
	policy := &networkingv1.NetworkPolicy{}
	pdb := &policyv1.PodDisruptionBudget{}
	wait.Until(t, 20*time.Second, "the budget's NetworkPolicy and PodDisruptionBudget", func() (bool, string) {
		errP := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "shop-grab"}, policy)
		errB := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "shop-grab"}, pdb)
		return errP == nil && errB == nil, fmt.Sprintf("NetworkPolicy: %v, PodDisruptionBudget: %v", errP, errB)
	})
	selector := map[string]string{"app.kubernetes.io/name": "redpacket-grab", "redpacket.io/budget": "shop"}
	if !metav1.IsControlledBy(policy, b) || !maps.Equal(policy.Spec.PodSelector.MatchLabels, selector) ||
		len(policy.Spec.Ingress) != 1 || len(policy.Spec.Ingress[0].Ports) != 1 || policy.Spec.Ingress[0].Ports[0].Port.IntValue() != 8080 {
		t.Errorf("NetworkPolicy %+v owned by %v", policy.Spec, policy.OwnerReferences)
	}
	if !metav1.IsControlledBy(pdb, b) || pdb.Spec.Selector == nil || !maps.Equal(pdb.Spec.Selector.MatchLabels, selector) ||
		pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 {
		t.Errorf("PodDisruptionBudget %+v owned by %v", pdb.Spec, pdb.OwnerReferences)
	}
	if ready := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReady); ready == nil ||
		ready.Status != metav1.ConditionFalse || ready.Reason != redpacketv1alpha1.ReasonGrabServiceUnavailable {
		t.Errorf("Ready before a replica is available: %+v", ready)
	}

	// No kube-controller-manager runs here: the Deployment's status is written by
	// hand, as the Deployment controller would.
	d.Status.Replicas, d.Status.ReadyReplicas, d.Status.AvailableReplicas, d.Status.UpdatedReplicas = 2, 2, 2, 2
	if err := e.c.Status().Update(ctx, d); err != nil {
		t.Fatalf("marking the grab deployment available: %v", err)
	}
	e.waitRedPacketBudget("shop", "Ready", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return meta.IsStatusConditionTrue(b.Status.Conditions, redpacketv1alpha1.ConditionReady) && b.Status.Replicas == 2
	})

	// One replica: the PodDisruptionBudget goes (it could only block drains), the
	// NetworkPolicy stays.
	e.patchBudget("shop", func(b *redpacketv1alpha1.RedPacketBudget) { b.Spec.GrabService.Replicas = new(int32(1)) })
	wait.Until(t, 20*time.Second, "the PodDisruptionBudget gone at one replica", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "shop-grab"}, &policyv1.PodDisruptionBudget{})
		return isNotFound(err), errString(err)
	})
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "shop-grab"}, &networkingv1.NetworkPolicy{}); err != nil {
		t.Errorf("the NetworkPolicy at one replica: %v", err)
	}

	// A refill raises what is available.
	e.patchBudget("shop", func(b *redpacketv1alpha1.RedPacketBudget) { b.Spec.Total = 1_500_000 })
	e.waitRedPacketBudget("shop", "refilled", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Total, 1_500_000) && is(b.Status.Available, 1_500_000)
	})

	// Packets created and grabbed directly through the store, as the grab fleet does.
	fleet := store.NewBudget(e.rdb, uid, 4)
	var claimed int64
	const packets, each = 40, 1000
	for p := range packets {
		id := fmt.Sprintf("order-%03d", p)
		if _, outcome, err := fleet.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "merchant-" + id, Total: each,
			Count: 5, Distribution: "Random", TTL: time.Hour}); err != nil || outcome != store.CreateCreated {
			t.Fatalf("creating %s: %s, %v", id, outcome, err)
		}
		for u := range p % 6 { // 0..5 grabs, the last ones sold out
			g, err := fleet.GrabPacket(ctx, id, fmt.Sprintf("user-%d", u))
			if err != nil {
				t.Fatal(err)
			}
			if g.Outcome == store.PacketGranted {
				claimed += g.Amount
			}
		}
	}
	b = e.waitRedPacketBudget("shop", "the packets' money in status", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.CreatedPackets, packets) && is(b.Status.Claimed, claimed)
	})
	st := b.Status
	if !is(st.Available, 1_500_000-packets*each) || !is(st.InPackets, packets*each-claimed) || !is(st.Refunded, 0) ||
		!is(st.LivePackets, packets) || *st.Total != *st.Available+*st.InPackets+*st.Claimed+*st.Refunded {
		t.Errorf("status %s, want available %d, in packets %d, claimed %d", describeBudget(b), 1_500_000-packets*each,
			packets*each-claimed, claimed)
	}
	t.Logf("after %d packets: %s", packets, describeBudget(b))

	// Deletion: every live packet expires with its remainder refunded, then the keys
	// and the user go, then the budget.
	if err := e.c.Delete(ctx, b); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(b), &redpacketv1alpha1.RedPacketBudget{})
		if isNotFound(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the budget is still there 30s after its deletion: %s", describeBudget(e.getBudget("shop")))
		}
		time.Sleep(50 * time.Millisecond)
	}
	settle.mu.Lock()
	atDrain := slices.Clone(settle.atDrain)
	forgotten := slices.Clone(settle.forgotten)
	settle.mu.Unlock()
	if len(atDrain) == 0 {
		t.Fatal("deletion never asked whether settlement drained")
	}
	last := atDrain[len(atDrain)-1]
	if last.LivePackets != 0 || last.Live != 0 || last.Refunded != packets*each-claimed || last.Claimed != claimed ||
		!last.Conserved() || last.ExpiredPackets != packets {
		t.Errorf("before the purge Redis held %+v; want every packet expired, %d refunded, %d claimed", last, packets*each-claimed, claimed)
	}
	if !slices.Contains(forgotten, b.UID) {
		t.Errorf("settlement was not told to forget the budget: %v", forgotten)
	}
	if keys, err := e.rdb.Keys(ctx, "rpb:{"+uid+".*").Result(); err != nil || len(keys) != 0 {
		t.Errorf("keys left after the purge: %v (%v)", keys, err)
	}
	if _, err := e.rdb.Do(ctx, "acl", "getuser", "rpb-"+uid).Result(); err == nil {
		t.Error("the budget's Redis user is still there")
	}
}

// Expiry is driven by Redis data: packets that fall due while no operator runs are
// expired, each remainder refunded exactly once, by the next operator's driver.
func TestBudgetExpirySurvivesARestart(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	stop := e.startBudgetController(nil)
	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "restart"},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{
			Total: 100_000, BudgetShards: 3,
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 1000, MaxCount: 5},
		},
	}
	if err := e.c.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	b = e.waitRedPacketBudget("restart", "configured", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Total, 100_000)
	})
	stop()

	fleet := store.NewBudget(e.rdb, string(b.UID), 3)
	const packets = 30
	var remainder int64
	for p := range packets {
		id := fmt.Sprintf("short-%02d", p)
		if _, outcome, err := fleet.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "s-" + id, Total: 500, Count: 5,
			Distribution: "Fixed", TTL: 500 * time.Millisecond}); err != nil || outcome != store.CreateCreated {
			t.Fatalf("creating %s: %s, %v", id, outcome, err)
		}
		remainder += 500
		for u := range p % 3 {
			g, err := fleet.GrabPacket(ctx, id, fmt.Sprintf("u%d", u))
			if err != nil || g.Outcome != store.PacketGranted {
				t.Fatalf("grab: %+v, %v", g, err)
			}
			remainder -= g.Amount
		}
	}
	time.Sleep(700 * time.Millisecond)
	if snap, err := fleet.Snapshot(ctx); err != nil || snap.LivePackets != packets || snap.Refunded != 0 {
		t.Fatalf("with no operator running nothing expires: %+v, %v", snap, err)
	}

	e.startBudgetController(nil)
	got := e.waitRedPacketBudget("restart", "every packet expired", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.ExpiredPackets, packets) && is(b.Status.LivePackets, 0)
	})
	if !is(got.Status.Refunded, remainder) || !is(got.Status.InPackets, 0) ||
		*got.Status.Total != *got.Status.Available+*got.Status.Claimed+*got.Status.Refunded {
		t.Errorf("after expiry %s; want %d refunded", describeBudget(got), remainder)
	}
	refunds := 0
	for i := range 3 {
		entries, err := e.rdb.XRange(ctx, fleet.ShardKeys(i).Stream, "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range entries {
			for _, v := range m.Values {
				if s, ok := v.(string); ok && strings.Contains(s, "/refund") {
					refunds++
				}
			}
		}
	}
	if refunds != packets {
		t.Errorf("%d refund entries in the streams, want one per packet (%d)", refunds, packets)
	}
	t.Logf("after the restart: %s", describeBudget(got))
}

// Money that does not add up in Redis makes the budget Stalled with
// ConservationBroken and a Warning event; once it adds up again, Stalled goes.
func TestBudgetConservationBrokenIsStalled(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.startBudgetController(nil)
	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "leaky"},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{Total: 10_000, BudgetShards: 2,
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 1000}},
	}
	if err := e.c.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	b = e.waitRedPacketBudget("leaky", "configured", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Total, 10_000)
	})
	meta0 := store.NewBudget(e.rdb, string(b.UID), 2).ShardKeys(0).Meta
	// Someone writes money into a shard by hand.
	if err := e.rdb.HIncrBy(ctx, meta0, "available", 7).Err(); err != nil {
		t.Fatal(err)
	}
	got := e.waitRedPacketBudget("leaky", "Stalled", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled)
		return c != nil && c.Status == metav1.ConditionTrue && c.Reason == redpacketv1alpha1.ReasonConservationBroken
	})
	if !is(got.Status.Available, 10_007) || meta.IsStatusConditionTrue(got.Status.Conditions, redpacketv1alpha1.ConditionReady) {
		t.Errorf("status %s", describeBudget(got))
	}
	e.waitEvent("leaky", corev1.EventTypeWarning, redpacketv1alpha1.ReasonConservationBroken)
	if err := e.rdb.HIncrBy(ctx, meta0, "available", -7).Err(); err != nil {
		t.Fatal(err)
	}
	e.waitRedPacketBudget("leaky", "no longer Stalled", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled) == nil && is(b.Status.Available, 10_000)
	})

	// A borrow that no sibling lent (FCALL budget_borrow, which the budget's Redis
	// user may send): the budget's sums still agree, so only the moves' check sees it.
	if err := lua.BudgetBorrowScript.Call(ctx, e.rdb, []string{meta0}, 1, 1, 500).Err(); err != nil {
		t.Fatal(err)
	}
	got = e.waitRedPacketBudget("leaky", "Stalled by the forged borrow", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled)
		return c != nil && c.Reason == redpacketv1alpha1.ReasonConservationBroken && strings.Contains(c.Message, "borrowed 500, more than the 0")
	})
	if !is(got.Status.Available, 10_000) || !is(got.Status.Total, 10_000) {
		t.Errorf("after the forged borrow: %s; want the sums as they were", describeBudget(got))
	}
	wait.Until(t, 20*time.Second, "a Warning naming the forged borrow", func() (bool, string) {
		notes := e.eventNotes("leaky")
		for _, n := range notes {
			if strings.HasPrefix(n, redpacketv1alpha1.ReasonConservationBroken+": ") && strings.Contains(n, "borrowed 500") {
				return true, ""
			}
		}
		return false, strings.Join(notes, " | ")
	})
}
