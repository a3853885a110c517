package controllers_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

// A sharded activity through the real controller: it is seeded over its shards,
// grabs on a dry home shard refill from the others, status shows one set of numbers
// summed over the shards, the Redis imbalance gauge stays 0, the close refunds once
// for the activity, the operator's settlement workers deliver every shard's stream
// (one consumer group per shard stream), and deletion purges every shard.
func TestShardedActivityLifecycle(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()
	bal := newBalance(t, nil)
	bal.setUp(true)

	// Sharding needs durability; this Redis fsyncs every write.
	if err := e.rdb.ConfigSet(ctx, "appendonly", "yes").Err(); err != nil {
		t.Fatal(err)
	}
	if err := e.rdb.ConfigSet(ctx, "appendfsync", "always").Err(); err != nil {
		t.Fatal(err)
	}
	const total, count, shards = 40000, 400, 4
	e.allowWebhook(bal.URL())
	e.create(e.activity("rain", total, count, withWebhook(bal.URL(), ""), func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Shards = shards
		a.Spec.Durability = &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityFsync}
	}))
	a := e.waitPhase("rain", redpacketv1alpha1.PhaseActive, 20*time.Second)
	e.runReporter("rain")
	h := store.NewActivity(e.rdb, string(a.UID), shards)
	view, err := h.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i, sh := range view.Shards {
		if sh.State != store.StateOpen || sh.Count != count/shards {
			t.Fatalf("shard %d: %s with %d packets, want open with %d", i, sh.State, sh.Count, count/shards)
		}
	}

	// 300 users, 150 of them at home on shard 0, which starts with 100 packets.
	var users []string
	onZero := 0
	for k := 0; len(users) < 300; k++ {
		u := "user-" + strconv.Itoa(k)
		if h.Home(u) == 0 {
			if onZero == 150 {
				continue
			}
			onZero++
		} else if len(users)-onZero >= 150 {
			continue
		}
		users = append(users, u)
	}
	var claimed int64
	packets := map[string]bool{}
	for _, u := range users {
		r, _, err := h.Grab(ctx, u, nil)
		if err != nil || r.Outcome != store.Granted {
			t.Fatalf("grab for %s: %+v, %v", u, r, err)
		}
		if packets[r.PacketID] {
			t.Fatalf("packet %s granted twice", r.PacketID)
		}
		packets[r.PacketID] = true
		claimed += r.Amount
	}

	// Status: one set of numbers, the sums over the shards.
	wait.Until(t, 15*time.Second, "the counters of 300 grants in status", func() (bool, string) {
		a = e.get("rain")
		st := a.Status
		return st.ClaimedCount != nil && *st.ClaimedCount == 300 && st.ClaimedAmount != nil && *st.ClaimedAmount == claimed &&
				st.RemainingCount != nil && *st.RemainingCount == count-300 && st.RemainingAmount != nil && *st.RemainingAmount == total-claimed,
			describeCounters(a)
	})
	wait.Until(t, 15*time.Second, "the Redis imbalance gauge", func() (bool, string) {
		v, ok := imbalanceGauge(t, e.ns, "rain")
		return ok && v == 0, fmt.Sprintf("gauge %v (exported %v)", v, ok)
	})

	// The end comes: the controller closes every shard and refunds once.
	e.patch("rain", func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.EndTime = &metav1.Time{Time: time.Now().Add(time.Second)}
	})
	a = e.waitPhase("rain", redpacketv1alpha1.PhaseExpired, 20*time.Second)
	wait.Until(t, 10*time.Second, "the refund in status", func() (bool, string) {
		a = e.get("rain")
		return a.Status.RefundedAmount != nil && *a.Status.RefundedAmount == total-claimed, describeCounters(a)
	})
	view, err = h.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if view.Whole.State != store.StateClosed || view.Whole.Refunded != total-claimed || !view.Conservation().Zero() {
		t.Fatalf("after close: %s, refunded %d (want %d), imbalance %+v", view.Whole.State, view.Whole.Refunded,
			total-claimed, view.Conservation())
	}

	// Deletion: the operator's settlement workers deliver every shard's entries, then
	// every shard's keys go.
	if err := e.c.Delete(ctx, a); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 30*time.Second, "the activity gone", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(a), &redpacketv1alpha1.RedPacketActivity{})
		return isNotFound(err), "get: " + errString(err)
	})
	credited, bad := bal.credits()
	if len(bad) != 0 {
		t.Fatalf("bad deliveries: %v", bad)
	}
	var grants, refund int64
	for key, d := range credited {
		switch d.Kind {
		case store.KindGrant:
			if key != string(a.UID)+"/"+d.PacketID || !packets[d.PacketID] {
				t.Errorf("grant delivery %s for packet %s, not one of the activity's grants", key, d.PacketID)
			}
			grants += d.Amount
		case store.KindRefund:
			if key != string(a.UID)+"/refund" {
				t.Errorf("refund delivered under %s", key)
			}
			refund += d.Amount
		}
	}
	if len(credited) != 301 || grants != claimed || refund != total-claimed {
		t.Fatalf("credited %d deliveries, grants %d (want %d), refund %d (want %d)", len(credited), grants, claimed, refund, total-claimed)
	}
	if n := e.dbsize(); n != 0 {
		keys, _ := e.rdb.Keys(ctx, "*").Result()
		t.Fatalf("%d keys left in Redis after deletion: %v", n, keys)
	}
}

// imbalanceGauge sums redpacket_activity_redis_imbalance of the activity over its
// units, from the manager's registry.
func imbalanceGauge(t *testing.T, ns, name string) (float64, bool) {
	t.Helper()
	fams, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	found := 0
	for _, f := range fams {
		if f.GetName() != "redpacket_activity_redis_imbalance" {
			continue
		}
		for _, m := range f.GetMetric() {
			if labelValue(m, "namespace") == ns && labelValue(m, "name") == name {
				sum += m.GetGauge().GetValue()
				found++
			}
		}
	}
	return sum, found == 2
}

func labelValue(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}
