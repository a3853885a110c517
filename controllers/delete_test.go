package controllers_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/test/wait"
)

// Deleting an activity closes it (refunding the rest), waits for settlement to drain,
// then removes its Redis keys and the finalizer.
func TestDeletionWaitsForSettlementThenPurges(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()

	a := e.create(e.activity("gone", 1000, 5, withSettlement))
	a = e.waitPhase("gone", redpacketv1alpha1.PhaseActive, 20*time.Second)
	var granted int64
	for _, u := range []string{"u1", "u2"} {
		res := e.grab(a, u)
		if res.Outcome != lua.Granted {
			t.Fatalf("grab: %+v", res)
		}
		granted += res.Amount
	}

	if err := e.c.Delete(ctx, a); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "the deleted activity closed in Redis", func() (bool, string) {
		snap := e.snapshot(a)
		return snap.State == lua.StateClosed, snap.State
	})
	if snap := e.snapshot(a); snap.Refunded != 1000-granted {
		t.Errorf("refund on deletion %d, want %d", snap.Refunded, 1000-granted)
	}
	// The status says what the deletion waits for, and the closed activity's refund.
	held := e.waitCondition("gone", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, controllers.ReasonDeleting, 10*time.Second)
	ready := findCondition(held, redpacketv1alpha1.ConditionReady)
	wantMsg := fmt.Sprintf("waiting for 2 of 2 claims to settle and the refund of %d before removing", 1000-granted)
	if !strings.Contains(ready.Message, wantMsg) || !strings.Contains(ready.Message, "purge at ") {
		t.Errorf("Ready message %q, want it to contain %q and the purge time", ready.Message, wantMsg)
	}
	if held.Status.Phase != redpacketv1alpha1.PhaseExpired || held.Status.RefundedAmount == nil || *held.Status.RefundedAmount != 1000-granted {
		t.Errorf("status while deleting: %s, refunded %v; want Expired with refund %d", describe(held), held.Status.RefundedAmount, 1000-granted)
	}
	// Settlement has not drained: the keys and the finalizer stay.
	consistently(t, time.Second, "the finalizer holding the activity", func() (bool, string) {
		held := e.get("gone")
		return controllerutil.ContainsFinalizer(held, controllers.Finalizer) && e.dbsize() > 0, describe(held)
	})

	if n := e.settleAll(a); n != 3 {
		t.Fatalf("settled %d entries, want 2 grants and 1 refund", n)
	}
	wait.Until(t, 10*time.Second, "the activity gone", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(a), &redpacketv1alpha1.RedPacketActivity{})
		return isNotFound(err), "get: " + errString(err)
	})
	if n := e.dbsize(); n != 0 {
		keys, _ := e.rdb.Keys(ctx, "*").Result()
		t.Fatalf("%d keys left in Redis after deletion: %v", n, keys)
	}
	e.waitEvent("gone", "Normal", "Purged")
}

// When settlement does not drain within the grace period, the keys are purged anyway
// with a Warning event.
func TestDeletionPurgesAfterGracePeriod(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Options.CleanupGracePeriod = 2 * time.Second
	})
	ctx := context.Background()

	a := e.create(e.activity("stuck", 1000, 5, withSettlement))
	a = e.waitPhase("stuck", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if res := e.grab(a, "u1"); res.Outcome != lua.Granted {
		t.Fatalf("grab: %+v", res)
	}
	if err := e.c.Delete(ctx, a); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 15*time.Second, "the activity gone", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(a), &redpacketv1alpha1.RedPacketActivity{})
		return isNotFound(err), "get: " + errString(err)
	})
	// Only the settlement stream is left, with an expiry: it records the grant and the
	// refund that were never credited.
	keys := lua.KeysFor(string(a.UID))
	if n := e.dbsize(); n != 1 {
		t.Fatalf("%d keys left in Redis after the grace period, want only the settlement stream", n)
	}
	if n, err := e.rdb.XLen(ctx, keys.Stream).Result(); err != nil || n != 2 {
		t.Fatalf("settlement stream has %d entries (%v), want the grant and the refund", n, err)
	}
	if ttl, err := e.rdb.TTL(ctx, keys.Stream).Result(); err != nil || ttl <= 0 || ttl > controllers.DefaultUnsettledRetention {
		t.Fatalf("settlement stream TTL %s (%v), want the retention", ttl, err)
	}
	e.waitEvent("stuck", "Warning", "CleanupGracePeriodExpired")
}

func errString(err error) string {
	if err == nil {
		return "found"
	}
	return err.Error()
}
