package controllers_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

// A full life: create → Seeding → Seeded → Active → every packet grabbed → Exhausted
// → settled.
func TestLifecycleCreateSeedGrabExhaust(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(settledByHand)

	const total, count = 2000, 20
	e.create(e.activity("quiz", total, count, withSettlement))

	// Open, but with no grab replica up nobody can grab: not Ready yet.
	a := e.waitPhase("quiz", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if c := findCondition(a, redpacketv1alpha1.ConditionReady); c == nil || c.Status != metav1.ConditionFalse ||
		c.Reason != redpacketv1alpha1.ReasonGrabServiceUnavailable || !strings.Contains(c.Message, "grabbing is open with 20 of 20 packets left") {
		t.Errorf("Ready %+v with no grab replica, want False/%s saying grabbing is open", c, redpacketv1alpha1.ReasonGrabServiceUnavailable)
	}
	// Before any report, the controller put the counters from Redis into status, under
	// a field manager of its own (not the one of its other status fields).
	wait.Until(t, 10*time.Second, "the initial counters", func() (bool, string) {
		a = e.get("quiz")
		st := a.Status
		return st.RemainingCount != nil && *st.RemainingCount == count && st.RemainingAmount != nil && *st.RemainingAmount == total &&
			st.ClaimedCount != nil && *st.ClaimedCount == 0 && st.ClaimedAmount != nil && *st.ClaimedAmount == 0, describeCounters(a)
	})
	for _, m := range a.ManagedFields {
		if m.Manager == controllers.FieldManager && m.Subresource == "status" &&
			(hasStatusField(t, string(m.FieldsV1.GetRawBytes()), "f:remainingCount") || hasStatusField(t, string(m.FieldsV1.GetRawBytes()), "f:claimedCount")) {
			t.Errorf("%s owns the grab service's counters: %s", controllers.FieldManager, string(m.FieldsV1.GetRawBytes()))
		}
	}

	// A grab replica comes up (its status reporter): Ready.
	e.runReporter("quiz")
	a = e.waitCondition("quiz", redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, string(redpacketv1alpha1.PhaseActive), 10*time.Second)
	if a.Status.Phase != redpacketv1alpha1.PhaseActive {
		t.Fatalf("phase %s, want Active", a.Status.Phase)
	}
	if c := findCondition(a, redpacketv1alpha1.ConditionGrabServiceAvailable); c == nil || c.Status != metav1.ConditionTrue {
		t.Errorf("GrabServiceAvailable %+v while Ready, want True", c)
	}
	if !controllerutil.ContainsFinalizer(a, controllers.Finalizer) {
		t.Errorf("finalizer %s missing: %v", controllers.Finalizer, a.Finalizers)
	}
	seeded := findCondition(a, redpacketv1alpha1.ConditionSeeded)
	if seeded == nil || seeded.Status != metav1.ConditionTrue || seeded.Reason != redpacketv1alpha1.ReasonCommitted {
		t.Errorf("Seeded condition %+v, want True/Committed", seeded)
	}
	if a.Status.SeededTime == nil {
		t.Errorf("status.seededTime not set")
	}
	if a.Status.SplitSeed == nil || *a.Status.SplitSeed != split.SeedFromUID(string(a.UID)) {
		t.Errorf("status.splitSeed %v, want the UID's seed %d", a.Status.SplitSeed, split.SeedFromUID(string(a.UID)))
	}
	if a.Status.ScriptSHA != lua.GrabScript.SHA() {
		t.Errorf("status.scriptSHA %q, want %q", a.Status.ScriptSHA, lua.GrabScript.SHA())
	}
	if want := fmt.Sprintf("http://quiz-grab.%s.svc:8080", e.ns); a.Status.Endpoint != want {
		t.Errorf("status.endpoint %q, want %q", a.Status.Endpoint, want)
	}
	if a.Status.ObservedGeneration != a.Generation {
		t.Errorf("observedGeneration %d, generation %d", a.Status.ObservedGeneration, a.Generation)
	}
	if loaded, err := lua.GrabLibrary.LoadedOn(context.Background(), e.rdb); err != nil || !loaded {
		t.Errorf("grab function library not loaded in Redis: %v %v", loaded, err)
	}
	snap := e.snapshot(a)
	if snap.State != store.StateOpen || snap.Count != count || snap.Total != total || snap.RemainingCount != count {
		t.Fatalf("Redis snapshot %+v, want open with %d packets summing to %d", snap, count, total)
	}
	// The split is the one the seed reproduces.
	want, err := split.Split(split.Params{Type: split.TypeRandom, Total: total, Count: count, Min: 1, Seed: *a.Status.SplitSeed})
	if err != nil {
		t.Fatal(err)
	}

	var sum int64
	granted := map[string]int64{}
	for i := range count {
		res := e.grab(a, fmt.Sprintf("user-%d", i))
		if res.Outcome != store.Granted {
			t.Fatalf("grab %d: %+v, want granted", i, res)
		}
		if want[i] != res.Amount {
			t.Errorf("packet %s amount %d, the split says %d", res.PacketID, res.Amount, want[i])
		}
		granted[res.PacketID] = res.Amount
		sum += res.Amount
	}
	if sum != total || len(granted) != count {
		t.Fatalf("granted %d distinct packets summing to %d, want %d summing to %d", len(granted), sum, count, total)
	}
	if res := e.grab(a, "late-user"); res.Outcome != store.SoldOut {
		t.Errorf("grab after the last packet: %+v, want sold_out", res)
	}
	if again := e.grab(a, "user-3"); again.Outcome != store.AlreadyClaimed {
		t.Errorf("second grab of user-3: %+v, want already_claimed", again)
	}

	// The grab service's reporter reports the last packet gone; the controller closes
	// the activity as exhausted.
	a = e.waitCondition("quiz", redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, string(redpacketv1alpha1.PhaseExhausted), 10*time.Second)
	if a.Status.RefundedAmount == nil || *a.Status.RefundedAmount != 0 {
		t.Errorf("refundedAmount %v after exhaustion, want 0", a.Status.RefundedAmount)
	}
	if snap := e.snapshot(a); snap.State != store.StateClosed || snap.CloseReason != store.CloseExhausted {
		t.Errorf("Redis state %q reason %q, want closed/exhausted", snap.State, snap.CloseReason)
	}
	if c := findCondition(a, redpacketv1alpha1.ConditionSettled); c == nil || c.Status != metav1.ConditionFalse || c.Reason != redpacketv1alpha1.ReasonSettlementPending {
		t.Errorf("Settled %+v before any delivery, want False/SettlementPending", c)
	}

	if n := e.settleAll(a); n != count {
		t.Fatalf("settled %d entries, want %d grants", n, count)
	}
	e.waitCondition("quiz", redpacketv1alpha1.ConditionSettled, metav1.ConditionTrue, redpacketv1alpha1.ReasonAllSettled, 10*time.Second)
	e.waitEvent("quiz", "Normal", redpacketv1alpha1.ReasonCommitted)
	e.waitEvent("quiz", "Normal", string(redpacketv1alpha1.PhaseExhausted))
	e.waitEvent("quiz", "Normal", redpacketv1alpha1.ReasonAllSettled)
}

// At endTime grabbing closes and status.refundedAmount is exactly total − granted,
// handed to settlement as the sponsor's refund. Dead letters turn Settled False.
func TestExpiredActivityRefundsTheRemainder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(settledByHand)

	const total, count = 10000, 50
	end := metav1.NewTime(time.Now().Add(6 * time.Second).Truncate(time.Second))
	e.create(e.activity("flash", total, count, withSettlement, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.EndTime = &end
	}))
	a := e.waitPhase("flash", redpacketv1alpha1.PhaseActive, 20*time.Second)

	var granted int64
	for i := range 7 {
		res := e.grab(a, fmt.Sprintf("early-%d", i))
		if res.Outcome != store.Granted {
			t.Fatalf("grab %d before endTime: %+v", i, res)
		}
		granted += res.Amount
	}

	a = e.waitPhase("flash", redpacketv1alpha1.PhaseExpired, 15*time.Second)
	if a.Status.RefundedAmount == nil || *a.Status.RefundedAmount != total-granted {
		t.Fatalf("refundedAmount %v, want %d − %d = %d", a.Status.RefundedAmount, total, granted, total-granted)
	}
	if c := findCondition(a, redpacketv1alpha1.ConditionReady); c == nil || c.Status != metav1.ConditionTrue || c.Reason != "Expired" {
		t.Errorf("Ready %+v, want True/Expired", c)
	}
	snap := e.snapshot(a)
	if snap.State != store.StateClosed || snap.CloseReason != store.CloseExpired || snap.Refunded != total-granted ||
		snap.ClaimedAmount+snap.Refunded != total {
		t.Errorf("Redis snapshot %+v, want closed/expired with refund %d", snap, total-granted)
	}
	if res := e.grab(a, "late"); res.Outcome != store.Ended {
		t.Errorf("grab after endTime: %+v, want ended", res)
	}

	// The refund is in the stream, for the sponsor, next to the grants.
	msgs := e.readPending(a)
	var refunds, grants int
	for _, m := range msgs {
		switch d := m; d.Kind {
		case store.KindRefund:
			refunds++
			if d.UserID != "merchant-001" || d.Amount != total-granted {
				t.Errorf("refund entry %v, want %d for merchant-001", m.Fields, total-granted)
			}
		case store.KindGrant:
			grants++
		}
	}
	if refunds != 1 || grants != 7 {
		t.Fatalf("stream holds %d refunds and %d grants, want 1 and 7", refunds, grants)
	}

	// Settle all but one grant, which is parked as a dead letter.
	parked := false
	for _, m := range msgs {
		if !parked && m.Kind == store.KindGrant {
			parked = true
			ok, err := e.handle(a).Shard(0).DeadLetter(context.Background(), settlementGroup, m.ID, "HTTP 422: unknown account", m.FieldValues())
			if err != nil || !ok {
				t.Fatalf("dead-lettering %s: %v %v", m.ID, ok, err)
			}
			continue
		}
		e.ack(a, m)
	}
	a = e.waitCondition("flash", redpacketv1alpha1.ConditionSettled, metav1.ConditionFalse, redpacketv1alpha1.ReasonDeadLetters, 10*time.Second)
	e.waitEvent("flash", "Warning", redpacketv1alpha1.ReasonDeadLetters)
	if *a.Status.RefundedAmount != total-granted {
		t.Errorf("refundedAmount changed to %d", *a.Status.RefundedAmount)
	}
}

// Before startTime the activity is Scheduled and grabs are not_started; it turns
// Active at startTime by itself.
func TestScheduledActivityOpensAtStartTime(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)

	start := metav1.NewTime(time.Now().Add(8 * time.Second).Truncate(time.Second))
	e.create(e.activity("later", 500, 5, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.StartTime = &start
	}))
	// Scheduled and Ready once a grab replica (its reporter) is up.
	e.runReporter("later")
	a := e.waitCondition("later", redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, string(redpacketv1alpha1.PhaseScheduled), 20*time.Second)
	if time.Now().Before(start.Time) {
		if res := e.grab(a, "eager"); res.Outcome != store.NotStarted {
			t.Errorf("grab before startTime: %+v, want not_started", res)
		}
	}
	e.waitPhase("later", redpacketv1alpha1.PhaseActive, 10*time.Second)
	if res := e.grab(a, "eager"); res.Outcome != store.Granted {
		t.Errorf("grab after startTime: %+v, want granted", res)
	}
}

// spec.paused closes the gate in Redis and opens it again.
func TestPauseAndResume(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)

	a := e.create(e.activity("pausable", 1000, 10))
	// A grab replica's reporter runs throughout, so Paused can be Ready.
	e.runReporter("pausable")
	e.waitPhase("pausable", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if res := e.grab(a, "u1"); res.Outcome != store.Granted {
		t.Fatalf("grab while active: %+v", res)
	}

	e.patch("pausable", func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Paused = true })
	a = e.waitCondition("pausable", redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, string(redpacketv1alpha1.PhasePaused), 10*time.Second)
	if !e.snapshot(a).Paused {
		t.Errorf("Redis paused flag not set")
	}
	if res := e.grab(a, "u2"); res.Outcome != store.Paused {
		t.Errorf("grab while paused: %+v, want paused", res)
	}
	if res := e.grab(a, "u1"); res.Outcome != store.AlreadyClaimed {
		t.Errorf("retry of a granted user while paused: %+v, want already_claimed", res)
	}

	e.patch("pausable", func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Paused = false })
	a = e.waitPhase("pausable", redpacketv1alpha1.PhaseActive, 10*time.Second)
	if e.snapshot(a).Paused {
		t.Errorf("Redis paused flag still set after resuming")
	}
	if res := e.grab(a, "u2"); res.Outcome != store.Granted {
		t.Errorf("grab after resuming: %+v, want granted", res)
	}
	if snap := e.snapshot(a); snap.ClaimedCount != 2 || snap.RemainingCount != 8 {
		t.Errorf("after pause and resume: claimed %d remaining %d, want 2 and 8", snap.ClaimedCount, snap.RemainingCount)
	}
}

func findCondition(a *redpacketv1alpha1.RedPacketActivity, t string) *metav1.Condition {
	for i := range a.Status.Conditions {
		if a.Status.Conditions[i].Type == t {
			return &a.Status.Conditions[i]
		}
	}
	return nil
}

// describeCounters shows the grab service's counters of the activity's status.
func describeCounters(a *redpacketv1alpha1.RedPacketActivity) string {
	show := func(v *int64) string {
		if v == nil {
			return "absent"
		}
		return fmt.Sprint(*v)
	}
	st := a.Status
	return fmt.Sprintf("remaining %s/%s claimed %s/%s settled %s/%s lastReport %v",
		show(st.RemainingCount), show(st.RemainingAmount), show(st.ClaimedCount), show(st.ClaimedAmount),
		show(st.SettledCount), show(st.SettledAmount), st.LastReportTime)
}
