package controllers_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// Issue 34, case 1: a budget whose Redis lost its data. A budget of 1,000 with a
// webhook; order-1 of 1,000 in 2 shares; alice grabs 500, and 500 stays live. Then
// FLUSHALL, standing in for a restart without persistence or a failover to an empty
// replica. Before, the next reconcile announced and configured the budget again:
// `available 1000 of total 1000`, the 500 left in order-1 never refunded, and no
// condition said so. Now the budget is Stalled DataLost, a Warning names the 500 at
// risk, the status keeps its figures (the high-water marks), nothing is announced or
// configured again however long it runs, and a creation fails (503 at the grab API).
func TestBudgetDataLossIsFencedNeverRefunded(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	settle := e.recordingSettlement()
	e.startBudgetController(settle)
	h := e.budgetWithLivePacket(t, "flushed")

	if err := e.rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	settle.mu.Lock()
	ensuredBefore := settle.ensured
	settle.mu.Unlock()
	got := e.waitBudgetStalled("flushed", redpacketv1alpha1.ReasonDataLost)
	e.waitEvent("flushed", corev1.EventTypeWarning, redpacketv1alpha1.ReasonDataLost)
	c := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionStalled)
	if !strings.Contains(c.Message, "500 CNY was in live packets") {
		t.Errorf("the Stalled message %q does not name the 500 at risk", c.Message)
	}
	// Many reconciles later: never configured or announced again, the marks kept.
	time.Sleep(2 * time.Second)
	got = e.getBudget("flushed")
	if !is(got.Status.Total, 1000) || !is(got.Status.InPackets, 500) || !is(got.Status.Claimed, 500) ||
		meta.IsStatusConditionTrue(got.Status.Conditions, redpacketv1alpha1.ConditionReady) {
		t.Errorf("status after the loss: %s; want the marks kept and not Ready", describeBudget(got))
	}
	snap, err := h.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.Total != 0 || snap.Available != 0 {
		t.Errorf("Redis after the loss: %+v; want the budget never configured again", snap)
	}
	settle.mu.Lock()
	ensuredAfter := settle.ensured
	settle.mu.Unlock()
	if ensuredAfter != ensuredBefore {
		t.Errorf("the settlement runner was asked %d more times after the loss; want none (no announcement)", ensuredAfter-ensuredBefore)
	}
	_, err = h.Create(ctx, store.NewPacket{ID: "order-2", Sender: "merchant-7", Total: 100, Count: 1, Distribution: split.TypeFixed})
	if err == nil || errors.Is(err, context.Canceled) {
		t.Errorf("a creation after the loss: %v; want an error (503 at the grab API)", err)
	}
}

// budgetWithLivePacket creates the budget name (1,000 over 2 shards with a webhook),
// waits until it is configured, creates order-1 of 1,000 in 2 Fixed shares, has
// alice grab 500, and waits until the status counts 500 in packets.
func (e *env) budgetWithLivePacket(t *testing.T, name string) *store.Budget {
	ctx := context.Background()
	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{Total: 1000, BudgetShards: 2,
			Packets:    redpacketv1alpha1.PacketLimits{MaxTotal: 1000, MaxCount: 10},
			Settlement: &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: "http://balance.default.svc/credit"}}},
	}
	if err := e.c.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	b = e.waitRedPacketBudget(name, "configured", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Total, 1000)
	})
	h := store.NewBudget(e.rdb, string(b.UID), 2)
	if _, outcome, err := h.CreatePacket(ctx, store.NewPacket{ID: "order-1", Sender: "merchant-7", Total: 1000, Count: 2,
		Distribution: split.TypeFixed}); err != nil || outcome != store.CreateCreated {
		t.Fatalf("creating order-1: %v, %v", outcome, err)
	}
	if g, err := h.GrabPacket(ctx, "order-1", "alice"); err != nil || g.Amount != 500 {
		t.Fatalf("alice's grab: %+v, %v", g, err)
	}
	e.waitRedPacketBudget(name, "500 in packets", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.InPackets, 500) && is(b.Status.Claimed, 500)
	})
	return h
}

// waitBudgetStalled waits until the budget is Stalled with reason.
func (e *env) waitBudgetStalled(name, reason string) *redpacketv1alpha1.RedPacketBudget {
	return e.waitRedPacketBudget(name, "Stalled "+reason, 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled)
		return c != nil && c.Status == metav1.ConditionTrue && c.Reason == reason
	})
}

// A budget fenced for lost data is deleted: the deletion waits, Stalled DataLost,
// with a message and a Warning that name the 500 the status last counted in live
// packets and the way out, and the keys stay; no refund is made from what Redis
// holds now. The platform team's abandon (checked for the verb abandon) lets it go,
// with a Warning Abandoned naming the money and the user. Before, the deletion
// closed, found nothing to expire, and purged at once, the 500 gone unsaid.
func TestDeletingAFencedBudgetWaitsForTheAbandon(t *testing.T) {
	e := newEnv(t)
	installPolicies(t)
	ctx := context.Background()
	settle := e.recordingSettlement()
	e.startBudgetController(settle)
	e.budgetWithLivePacket(t, "lost")
	if err := e.rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	b := e.waitBudgetStalled("lost", redpacketv1alpha1.ReasonDataLost)
	uid := string(b.UID)
	if err := e.c.Delete(ctx, b); err != nil {
		t.Fatal(err)
	}
	held := e.waitRedPacketBudget("lost", "the deletion held", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled)
		return c != nil && c.Reason == redpacketv1alpha1.ReasonDataLost && strings.HasPrefix(c.Message, "the budget was deleted while fenced")
	})
	c := meta.FindStatusCondition(held.Status.Conditions, redpacketv1alpha1.ConditionStalled)
	if !strings.Contains(c.Message, "500 CNY was in live packets") || !strings.Contains(c.Message, redpacketv1alpha1.AnnotationAbandon+"="+uid) {
		t.Errorf("the held deletion's message %q does not name the 500 and the abandon", c.Message)
	}
	wait.Until(t, 20*time.Second, "a Warning about the held deletion", func() (bool, string) {
		notes := e.eventNotes("lost")
		for _, n := range notes {
			if strings.HasPrefix(n, redpacketv1alpha1.ReasonDataLost+": the budget was deleted while fenced") {
				return true, ""
			}
		}
		return false, strings.Join(notes, " | ")
	})
	// Reconciles later it is still there, its marks kept.
	time.Sleep(2 * time.Second)
	if got := e.getBudget("lost"); !is(got.Status.InPackets, 500) || !is(got.Status.Total, 1000) {
		t.Errorf("the held budget's status: %s; want its marks", describeBudget(got))
	}

	p := e.people()
	if err := e.annotateBudget(p.asPlatform, "lost", map[string]string{
		redpacketv1alpha1.AnnotationAbandon: uid, redpacketv1alpha1.AnnotationAbandonedBy: p.platform}); err != nil {
		t.Fatalf("the platform user abandoning: %v", err)
	}
	wait.Until(t, 30*time.Second, "the abandoned budget gone", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "lost"}, &redpacketv1alpha1.RedPacketBudget{})
		return isNotFound(err), errString(err)
	})
	note := e.eventNote("lost", "Warning", redpacketv1alpha1.ReasonAbandoned)
	if !strings.Contains(note, p.platform) || !strings.Contains(note, "500 CNY in live packets") {
		t.Errorf("the Abandoned warning %q does not name %s and the 500", note, p.platform)
	}
	if keys, err := e.rdb.Keys(ctx, "rpb:{"+uid+".*").Result(); err != nil || len(keys) != 0 {
		t.Errorf("keys left after the abandon: %v (%v)", keys, err)
	}
}

// rollBackBudget makes the budget name with order-1 live (budgetWithLivePacket: alice
// has 500), saves the RDB, has bob grab the other 500 and waits until the status
// records it, then kills the server and starts it again on the saved RDB: Redis
// comes back from before bob's grab.
func (e *env) rollBackBudget(t *testing.T, name string) *store.Budget {
	ctx := context.Background()
	h := e.budgetWithLivePacket(t, name)
	if err := e.rdb.Save(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	dump := filepath.Join(e.redis.Dir(), "dump.rdb")
	older, err := os.ReadFile(dump)
	if err != nil {
		t.Fatal(err)
	}
	if g, err := h.GrabPacket(ctx, "order-1", "bob"); err != nil || g.Outcome != store.PacketGranted {
		t.Fatalf("bob's grab: %+v, %v", g, err)
	}
	e.waitRedPacketBudget(name, "bob's share recorded", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Claimed, 1000)
	})
	if err := e.redis.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dump, older, 0o600); err != nil {
		t.Fatal(err)
	}
	restored, err := redistest.RestartProcess(e.redis)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restored.Stop)
	return h
}

// Issue 34, case 1: a budget's Redis restored from an older RDB under a live budget.
// order-1 (1,000 in 2 shares): alice grabs 500, the RDB is saved, then bob grabs the
// other 500 and the status records it (claimed 1,000). The server is killed and
// started again on the older RDB, which holds bob's share as still to grab. The next
// reading finds claimed 500 below the mark 1,000: Stalled RedisRolledBack, and the
// fence is written into both shards, so carol's grab of the share bob was already
// paid, and any creation, are refused (503 at the grab API) and change nothing.
// Before, nothing fenced the fleet: carol was granted bob's share a second time.
func TestBudgetRolledBackToAnOlderRDBIsFenced(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	settle := e.recordingSettlement()
	e.startBudgetController(settle)
	h := e.rollBackBudget(t, "rolled")

	got := e.waitBudgetStalled("rolled", redpacketv1alpha1.ReasonRedisRolledBack)
	c := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionStalled)
	if !strings.Contains(c.Message, "claimed money at 500, below the 1000") {
		t.Errorf("the Stalled message %q does not name the claimed money below its mark", c.Message)
	}
	// The fence is written in the reconcile that records Stalled, before its status:
	// once Stalled shows, the fleet is fenced.
	if g, err := h.GrabPacket(ctx, "order-1", "carol"); !errors.Is(err, store.ErrBudgetFenced) {
		t.Fatalf("carol's grab of the share bob was paid: %+v, %v; want the fence", g, err)
	}
	for i := range h.N() {
		if v, err := e.rdb.HGet(ctx, h.ShardKeys(i).Meta, "fenced").Result(); v != redpacketv1alpha1.ReasonRedisRolledBack {
			t.Errorf("shard %d's fence: %q, %v", i, v, err)
		}
	}
	if _, _, err := h.CreatePacket(ctx, store.NewPacket{ID: "order-2", Sender: "merchant-7", Total: 100, Count: 1,
		Distribution: split.TypeFixed}); !errors.Is(err, store.ErrBudgetFenced) {
		t.Fatalf("a creation on the rolled-back budget: %v; want the fence", err)
	}
	if snap, err := h.Snapshot(ctx); err != nil || snap.Claimed != 500 || snap.Live != 500 {
		t.Fatalf("the rolled-back shards after the refused calls: %+v, %v; want them as the older RDB holds them", snap, err)
	}
}

// Issue 34, case 1: the platform team accepts a budget's rolled-back Redis state,
// as for activities. The budget is fenced RedisRolledBack (rollBackBudget), and its
// Stalled message names the annotation that accepts this fence: its start in Unix
// seconds. An acceptance naming another fence changes nothing. The platform user's
// acceptance of this one lifts the fence in Redis, the marks become what Redis holds
// (claimed 500 again), status.lastAcceptance records the fence, the user and the
// time, an event says so, and the budget serves again: carol is granted the share the
// older state holds. Before, a rolled-back budget could only be deleted and abandoned.
func TestAcceptingABudgetsRolledBackState(t *testing.T) {
	e := newEnv(t)
	installPolicies(t)
	ctx := context.Background()
	e.startBudgetController(e.recordingSettlement())
	h := e.rollBackBudget(t, "accepted")
	got := e.waitBudgetStalled("accepted", redpacketv1alpha1.ReasonRedisRolledBack)
	c := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionStalled)
	token := strconv.FormatInt(c.LastTransitionTime.Unix(), 10)
	if want := redpacketv1alpha1.AnnotationAcceptRedisState + "=" + token; !strings.Contains(c.Message, want) {
		t.Fatalf("the Stalled message %q does not name %s", c.Message, want)
	}

	p := e.people()
	stale := strconv.FormatInt(c.LastTransitionTime.Unix()-60, 10)
	if err := e.annotateBudget(p.asPlatform, "accepted", map[string]string{
		redpacketv1alpha1.AnnotationAcceptRedisState: stale, redpacketv1alpha1.AnnotationAcceptedBy: p.platform}); err != nil {
		t.Fatalf("the platform user accepting another fence: %v", err)
	}
	time.Sleep(2 * time.Second)
	if b := e.getBudget("accepted"); !meta.IsStatusConditionTrue(b.Status.Conditions, redpacketv1alpha1.ConditionStalled) ||
		b.Status.LastAcceptance != nil {
		t.Fatalf("an acceptance of another fence lifted this one: %s", describeBudget(b))
	}
	if _, err := h.GrabPacket(ctx, "order-1", "carol"); !errors.Is(err, store.ErrBudgetFenced) {
		t.Fatalf("carol's grab under the fence: %v; want the fence", err)
	}

	if err := e.annotateBudget(p.asPlatform, "accepted", map[string]string{
		redpacketv1alpha1.AnnotationAcceptRedisState: token, redpacketv1alpha1.AnnotationAcceptedBy: p.platform}); err != nil {
		t.Fatalf("the platform user accepting: %v", err)
	}
	b := e.waitRedPacketBudget("accepted", "the acceptance", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return !meta.IsStatusConditionTrue(b.Status.Conditions, redpacketv1alpha1.ConditionStalled) && b.Status.LastAcceptance != nil &&
			is(b.Status.Claimed, 500)
	})
	if la := b.Status.LastAcceptance; la.By != p.platform || !la.FencedAt.Equal(&c.LastTransitionTime) {
		t.Errorf("lastAcceptance %+v; want by %s of the fence of %s", la, p.platform, c.LastTransitionTime)
	}
	if note := e.eventNote("accepted", "Normal", redpacketv1alpha1.ReasonRedisStateAccepted); !strings.Contains(note, p.platform) ||
		!strings.Contains(note, "claimed 500") {
		t.Errorf("the RedisStateAccepted event %q does not name %s and the marks", note, p.platform)
	}
	for i := range h.N() {
		if v, err := e.rdb.HExists(ctx, h.ShardKeys(i).Meta, "fenced").Result(); err != nil || v {
			t.Errorf("shard %d still fenced after the acceptance (%v)", i, err)
		}
	}
	if g, err := h.GrabPacket(ctx, "order-1", "carol"); err != nil || g.Outcome != store.PacketGranted || g.Amount != 500 {
		t.Fatalf("carol's grab after the acceptance: %+v, %v; want the 500 the accepted state holds", g, err)
	}
	e.waitRedPacketBudget("accepted", "Ready again, carol's grab counted", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Claimed, 1000) && !meta.IsStatusConditionTrue(b.Status.Conditions, redpacketv1alpha1.ConditionStalled)
	})
}

// A budget fenced RedisRolledBack whose Redis then loses its data is never accepted:
// the platform user's acceptance of the fence is refused, with a message naming the
// missing shards, the fence stays in Redis and the budget is never configured again.
// Accepted, the marks would have fallen to zero and the next reconcile would have
// funded the flushed shards anew.
func TestAcceptingALostBudgetIsRefused(t *testing.T) {
	e := newEnv(t)
	installPolicies(t)
	ctx := context.Background()
	e.startBudgetController(e.recordingSettlement())
	h := e.rollBackBudget(t, "lost-later")
	got := e.waitBudgetStalled("lost-later", redpacketv1alpha1.ReasonRedisRolledBack)
	c := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionStalled)
	if err := e.rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	p := e.people()
	if err := e.annotateBudget(p.asPlatform, "lost-later", map[string]string{
		redpacketv1alpha1.AnnotationAcceptRedisState: strconv.FormatInt(c.LastTransitionTime.Unix(), 10),
		redpacketv1alpha1.AnnotationAcceptedBy:       p.platform}); err != nil {
		t.Fatalf("the platform user accepting: %v", err)
	}
	e.waitRedPacketBudget("lost-later", "the acceptance refused", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled)
		return c != nil && c.Status == metav1.ConditionTrue && strings.Contains(c.Message, "the acceptance was refused: Redis now holds none")
	})
	time.Sleep(time.Second)
	b := e.getBudget("lost-later")
	if b.Status.LastAcceptance != nil || !is(b.Status.Total, 1000) {
		t.Errorf("after the refused acceptance: %s; want no acceptance and the marks kept", describeBudget(b))
	}
	snap, err := h.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.Total != 0 {
		t.Errorf("Redis after the refused acceptance allots %d; want nothing configured again", snap.Total)
	}
	for i := range h.N() {
		if v, err := e.rdb.HGet(ctx, h.ShardKeys(i).Meta, "fenced").Result(); v != redpacketv1alpha1.ReasonRedisRolledBack {
			t.Errorf("shard %d's fence: %q, %v", i, v, err)
		}
	}
}

// Issue 34, case 1: a budget's Redis loses its data after the budget's deletion
// began. The deletion expired order-1 (500 refunded to merchant-7) and waits for the
// refund to settle when the FLUSHALL comes. The deletion must not take the empty
// Redis for a budget with nothing owed: it is fenced, Stalled DataLost, and held for
// the platform team's abandon, even once settlement says drained. Before, the
// deletion went on to the purge and the budget was gone with its trail.
func TestLossAfterTheDeletionBeganHoldsTheDeletion(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	settle := e.recordingSettlement()
	settle.holdDrain.Store(true)
	e.startBudgetController(settle)
	e.budgetWithLivePacket(t, "late-loss")
	b := e.getBudget("late-loss")
	if err := e.c.Delete(ctx, b); err != nil {
		t.Fatal(err)
	}
	e.waitRedPacketBudget("late-loss", "the refund waiting to settle", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Refunded, 500)
	})
	if err := e.rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	e.waitRedPacketBudget("late-loss", "the deletion held, DataLost", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled)
		return c != nil && c.Reason == redpacketv1alpha1.ReasonDataLost && strings.HasPrefix(c.Message, "the budget was deleted while fenced")
	})
	settle.holdDrain.Store(false)
	time.Sleep(3 * time.Second)
	got := e.getBudget("late-loss")
	if c := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionStalled); c == nil || c.Reason != redpacketv1alpha1.ReasonDataLost ||
		!is(got.Status.Refunded, 500) || !is(got.Status.Claimed, 500) {
		t.Fatalf("the budget after settlement drained: %s; want it held, DataLost, with its marks", describeBudget(got))
	}
}
