package controllers_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

// startBudgetSettlementRunner runs the operator's budget settlement runner with the
// test's settlement keys until the test ends.
func (e *env) startBudgetSettlementRunner() *controllers.BudgetSettlementRunner {
	runner := controllers.NewBudgetSettlementRunner(cp.Client, nil, controllers.Options{
		SettlementKeysSecret: types.NamespacedName{Namespace: e.ns, Name: testSettlementKeys},
		SettlementConsumer:   "operator-test", SettlementRegisterer: prometheus.NewRegistry()})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runner.Start(ctx) }()
	e.t.Cleanup(func() { stop(); <-done })
	return runner
}

// budgetReceiver is a real balance system that requires the budget's announcement
// (rain.Receiver) behind an HTTP server the test's settlement keys allow; it returns
// the receiver and the server's URL.
func (e *env) budgetReceiver() (*rain.Receiver, string) {
	receiver := rain.NewReceiver([]byte(testSigningKey))
	receiver.RequireBudget = true
	hs := httptest.NewServer(receiver)
	e.t.Cleanup(hs.Close)
	e.allowWebhook(hs.URL)
	return receiver, hs.URL
}

// createConfiguredBudget creates the budget name with spec and waits until Redis
// allots its total.
func (e *env) createConfiguredBudget(name string, spec redpacketv1alpha1.RedPacketBudgetSpec) *redpacketv1alpha1.RedPacketBudget {
	e.t.Helper()
	b := &redpacketv1alpha1.RedPacketBudget{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}, Spec: spec}
	if err := e.c.Create(context.Background(), b); err != nil {
		e.t.Fatal(err)
	}
	return e.waitRedPacketBudget(name, "configured", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Total, spec.Total)
	})
}

// A budget with a webhook, settled by the operator's own runner through the
// reconciler: the total is announced before the shards may draw on it and again at
// a refill, every grant and every refund of its runtime packets is credited once,
// signed with the operator's key, under "<uid>/<packet>/<share>" and
// "<uid>/<packet>/refund", the credits add up to the packets' totals, and deletion
// waits for settlement before the keys go.
func TestBudgetSettledByTheOperatorsRunner(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	receiver, url := e.budgetReceiver()
	e.startBudgetController(e.startBudgetSettlementRunner())

	b := e.createConfiguredBudget("settled", redpacketv1alpha1.RedPacketBudgetSpec{
		Total: 100_000, BudgetShards: 4,
		Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 10_000, MaxCount: 10,
			Distributions: []redpacketv1alpha1.DistributionType{redpacketv1alpha1.DistributionRandom}},
		Settlement: &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: url + "/credit"}},
	})
	uid := string(b.UID)
	if amount, _, ok := receiver.Budget(uid); !ok || amount != 100_000 {
		t.Fatalf("announced before the shards were configured: %d, %v; want 100000", amount, ok)
	}

	// Packets of 1,000 in 5 shares, 3 shares grabbed each, due in a second.
	const packets, each, grabbed = 20, int64(1000), 3
	h := store.NewBudget(e.rdb, uid, 4)
	for p := range packets {
		id := fmt.Sprintf("order-%d", p)
		if _, outcome, err := h.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "merchant-1", Total: each, Count: 5,
			Distribution: split.TypeRandom, TTL: time.Second}); err != nil || outcome != store.CreateCreated {
			t.Fatalf("creating %s: %s, %v", id, outcome, err)
		}
		for u := range grabbed {
			if g, err := h.GrabPacket(ctx, id, fmt.Sprintf("user-%d", u)); err != nil || g.Outcome != store.PacketGranted {
				t.Fatalf("grab of %s: %+v, %v", id, g, err)
			}
		}
	}
	// A refill: announced again, as the whole new total.
	e.patchBudget("settled", func(b *redpacketv1alpha1.RedPacketBudget) { b.Spec.Total = 150_000 })
	e.waitRedPacketBudget("settled", "refilled", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Total, 150_000)
	})
	if amount, _, _ := receiver.Budget(uid); amount != 150_000 {
		t.Fatalf("the refill announced %d, want 150000", amount)
	}

	// The expiry driver refunds each remainder; settlement credits every share and
	// every refund once.
	deadline := time.Now().Add(60 * time.Second)
	for {
		tot := receiver.Totals()
		if tot.Grants == packets*grabbed && tot.Refunds == packets {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("credits after 60s: %+v; want %d grants and %d refunds", tot, packets*grabbed, packets)
		}
		time.Sleep(100 * time.Millisecond)
	}
	tot := receiver.Totals()
	if tot.GrantSum+tot.RefundSum != packets*each || tot.Conflicts != 0 || tot.BadRequests != 0 || tot.OverBudget != 0 {
		t.Fatalf("credits %+v: grants and refunds must add up to %d, each key once, every signature valid", tot, packets*each)
	}
	grants, refunded := receiver.Credited(uid)
	for p := range packets {
		for s := range grabbed {
			if d, ok := receiver.Delivered(fmt.Sprintf("%s/order-%d/%d", uid, p, s)); !ok || d.UserID != fmt.Sprintf("user-%d", s) {
				t.Fatalf("share %d of order-%d under its key: %+v, %v", s, p, d, ok)
			}
		}
		if d, ok := receiver.Delivered(fmt.Sprintf("%s/order-%d/refund", uid, p)); !ok || d.UserID != "merchant-1" {
			t.Fatalf("the refund of order-%d: %+v, %v", p, d, ok)
		}
	}
	b = e.waitRedPacketBudget("settled", "every packet expired", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.LivePackets, 0) && is(b.Status.Refunded, packets*each-tot.GrantSum)
	})
	t.Logf("%d shares and %d refunded credited; %s", len(grants), refunded, describeBudget(b))

	if err := e.c.Delete(ctx, b); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(30 * time.Second)
	for {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(b), &redpacketv1alpha1.RedPacketBudget{})
		if isNotFound(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the budget is still there 30s after its deletion: %s", describeBudget(e.getBudget("settled")))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if keys, err := e.rdb.Keys(ctx, "rpb:{"+uid+".*").Result(); err != nil || len(keys) != 0 {
		t.Errorf("keys left after the purge: %v (%v)", keys, err)
	}
	if after := receiver.Totals(); after.Grants != tot.Grants || after.Refunds != tot.Refunds {
		t.Errorf("credits changed after the deletion: %+v, then %+v", tot, after)
	}
}

// Issue 34, case 3: the budget's own Redis user writes a tombstone of a packet that
// never existed (HSET on its packet key) and the grant of 2,000 to mallory that
// matches it (XADD on its stream). No creation record announced that packet, so the
// ledger has no account for it: the grant is dead-lettered packet_unknown and never
// paid. Before packets had accounts, it was credited. The user then forges the
// creation record too (XADD of a "create" entry, which its functions' data commands
// allow): the ledger books that packet within the announced total and pays the
// grant, so that much of the budget's own money is re-routed. It is detected: the
// ledger, read before the snapshot, credited 2,000 more in grants than the shards
// ever granted and booked a packet no creation made, so the budget is Stalled
// ConservationBroken with a Warning that says so, and money_faults counts it.
func TestForgedPacketWithItsGrantIsDetected(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	receiver, url := e.budgetReceiver()
	e.startBudgetController(e.startBudgetSettlementRunner())

	b := e.createConfiguredBudget("forged", redpacketv1alpha1.RedPacketBudgetSpec{
		Total: 10_000, BudgetShards: 1,
		Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 5_000, MaxCount: 10,
			Distributions: []redpacketv1alpha1.DistributionType{redpacketv1alpha1.DistributionFixed}},
		Settlement: &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: url + "/credit"}},
	})
	uid := string(b.UID)
	h := store.NewBudget(e.rdb, uid, 1)
	if _, outcome, err := h.CreatePacket(ctx, store.NewPacket{ID: "order-1", Sender: "merchant-1", Total: 1000, Count: 2,
		Distribution: split.TypeFixed}); err != nil || outcome != store.CreateCreated {
		t.Fatalf("creating order-1: %s, %v", outcome, err)
	}
	if g, err := h.GrabPacket(ctx, "order-1", "alice"); err != nil || g.Outcome != store.PacketGranted {
		t.Fatalf("alice's grab: %+v, %v", g, err)
	}

	secret := &corev1.Secret{}
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "forged-grab-redis"}, secret); err != nil {
		t.Fatal(err)
	}
	tenant := redis.NewClient(&redis.Options{Addr: e.redis.Addr, Username: string(secret.Data["username"]),
		Password: string(secret.Data["password"])})
	t.Cleanup(func() { _ = tenant.Close() })
	xadd := func(field, value string) string {
		t.Helper()
		id, err := tenant.XAdd(ctx, &redis.XAddArgs{Stream: h.ShardKeys(0).Stream, Values: []string{field, value}}).Result()
		if err != nil {
			t.Fatalf("the budget's Redis user appending %s %s: %v", field, value, err)
		}
		return id
	}
	for _, ghost := range []string{"ghost-0", "ghost-1"} {
		if err := tenant.HSet(ctx, h.ShardKeys(0).Packet(ghost), "fp", "f", "snd", "mallory", "tot", 2000, "cnt", 1,
			"g", 1, "r", 0, "x", 1, "f", 1).Err(); err != nil {
			t.Fatalf("the budget's Redis user writing a tombstone: %v", err)
		}
	}
	unknown := xadd("grant", "ghost-0/0:2000:0:CNY:mallory")
	wait.Until(t, 20*time.Second, "the grant of a packet without a creation record dead-lettered", func() (bool, string) {
		dead, err := h.Stream(0).DeadLetters(ctx)
		for _, d := range dead {
			if d.Fields["entry"] == unknown {
				return strings.HasPrefix(d.Fields["error"], "forged settlement entry (packet_unknown)"), d.Fields["error"]
			}
		}
		return false, fmt.Sprintf("%d dead letters, %v", len(dead), err)
	})
	if _, ok := receiver.Delivered(uid + "/ghost-0/0"); ok {
		t.Fatal("the grant of a packet without a creation record was paid")
	}
	xadd("create", fmt.Sprintf("ghost-1:2000:%d:2000:mallory", time.Now().Add(time.Hour).UnixMilli()))
	xadd("grant", "ghost-1/0:2000:0:CNY:mallory")
	wait.Until(t, 20*time.Second, "the forged grant credited", func() (bool, string) {
		d, ok := receiver.Delivered(uid + "/ghost-1/0")
		return ok && d.UserID == "mallory", fmt.Sprintf("%+v", receiver.Totals())
	})
	got := e.waitBudgetStalled("forged", redpacketv1alpha1.ReasonConservationBroken)
	c := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionStalled)
	if !strings.Contains(c.Message, "credited 2500 in grants, more than the 500 the shards ever granted") ||
		!strings.Contains(c.Message, "booked 2 packets drawing 3000, more than the 1 packets and 1000 the shards ever created") {
		t.Fatalf("the Stalled message %q does not name the credits beyond the grants and the packet booked beyond the creations", c.Message)
	}
	e.waitEvent("forged", corev1.EventTypeWarning, redpacketv1alpha1.ReasonConservationBroken)
}
