package controllers_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
)

// A sharded close that stopped half-way (shard 0 closed, then the controller died or
// shard 1's close timed out) is finished by the next reconcile: every shard closed and
// the one refund written, even when spec.paused changed meanwhile and the gate step
// configures first (ConfigureWith reports a half-closed activity as open, so the
// schedule step's Close runs and finishes it).
func TestShardedCloseStoppedHalfWayIsFinished(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	first := e.startController(nil)
	ctx := context.Background()
	for _, kv := range [][2]string{{"appendonly", "yes"}, {"appendfsync", "always"}} {
		if err := e.rdb.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
			t.Fatal(err)
		}
	}
	const total, count, shards = 10000, 100, 2
	e.create(e.activity("half", total, count, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Shards = shards
		a.Spec.Durability = &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityFsync}
		a.Spec.EndTime = &metav1.Time{Time: time.Now().Add(4 * time.Second)}
	}))
	a := e.waitPhase("half", redpacketv1alpha1.PhaseActive, 20*time.Second)
	h := store.NewActivity(e.rdb, string(a.UID), shards)
	var claimed int64
	for i := range 10 {
		r, _, err := h.Grab(ctx, fmt.Sprintf("user-%d", i), nil)
		if err != nil || r.Outcome != store.Granted {
			t.Fatalf("grab: %+v %v", r, err)
		}
		claimed += r.Amount
	}
	first.Stop()
	// The end comes; the close reached shard 0 only.
	time.Sleep(time.Until(a.Spec.EndTime.Time) + 200*time.Millisecond)
	k0 := h.Shard(0).Keys()
	if err := lua.CloseScript.Run(ctx, e.rdb, []string{k0.Meta, k0.Packets, k0.Stream}, "expired", "0").Err(); err != nil {
		t.Fatal(err)
	}
	// Meanwhile someone pauses the activity.
	e.patch("half", func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Paused = true })
	e.startController(nil)

	var last string
	ok := false
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		v, err := h.ReadShards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		a = e.get("half")
		last = fmt.Sprintf("redis: %s, shard states %s/%s, refunded %d, fenced %q; status: %s",
			v.Whole.State, v.Shards[0].State, v.Shards[1].State, v.Whole.Refunded, v.Whole.Fenced, describe(a))
		if v.Whole.State == store.StateClosed && v.Whole.Refunded == total-claimed {
			ok = true
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if !ok {
		t.Fatalf("the half-done close was never finished and the refund of %d never written: %s", total-claimed, last)
	}
	a = e.waitPhase("half", redpacketv1alpha1.PhaseExpired, 10*time.Second)
	if a.Status.RefundedAmount == nil || *a.Status.RefundedAmount != total-claimed {
		t.Fatalf("status after the close: %s, want Expired with the refund of %d", describe(a), total-claimed)
	}
}
