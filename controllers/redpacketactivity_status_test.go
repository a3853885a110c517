package controllers_test

import (
	"context"
	"encoding/json"
	"net"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
)

// The grab service's counters, applied under its own field manager, survive the
// controller's reconciles; each manager owns its own status fields. A fresh report
// makes GrabServiceAvailable True, and a stale one False again.
func TestGrabServiceStatusFieldsSurviveReconciles(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Options.GrabReportTimeout = 3 * time.Second
	})

	e.create(e.activity("shared", 1000, 10))
	a := e.waitPhase("shared", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if c := findCondition(a, redpacketv1alpha1.ConditionGrabServiceAvailable); c == nil || c.Status != metav1.ConditionFalse {
		t.Errorf("GrabServiceAvailable %+v with no pod and no report, want False", c)
	}

	// Three real grants, reported as the reporter would: status never records more
	// than Redis holds (that would be a rollback, and fence the activity).
	for _, u := range []string{"u1", "u2", "u3"} {
		if res := e.grab(a, u); res.Outcome != store.Granted {
			t.Fatalf("grab: %+v", res)
		}
	}
	snap := e.snapshot(a)
	reported := metav1.NewTime(time.Now().Truncate(time.Second))
	counters := map[string]any{
		"remainingCount": snap.RemainingCount, "remainingAmount": snap.RemainingAmount(),
		"claimedCount": snap.ClaimedCount, "claimedAmount": snap.ClaimedAmount,
		"settledCount": int64(0), "settledAmount": int64(0),
		"deadLetterCount": int64(0), "lastReportTime": reported.UTC().Format(time.RFC3339),
	}
	e.applyGrabServiceStatus("shared", counters)
	e.waitCondition("shared", redpacketv1alpha1.ConditionGrabServiceAvailable, metav1.ConditionTrue, redpacketv1alpha1.ReasonReporting, 5*time.Second)

	for i := range 5 {
		e.bump("shared", i)
	}
	e.reconcileRoundTrip("shared")
	e.reconcileRoundTrip("shared")

	a = e.get("shared")
	st := a.Status
	for name, got := range map[string]*int64{
		"remainingCount": st.RemainingCount, "remainingAmount": st.RemainingAmount,
		"claimedCount": st.ClaimedCount, "claimedAmount": st.ClaimedAmount,
		"settledCount": st.SettledCount, "settledAmount": st.SettledAmount, "deadLetterCount": st.DeadLetterCount,
	} {
		if got == nil || *got != counters[name].(int64) {
			t.Errorf("status.%s = %v after reconciles, want %d", name, got, counters[name])
		}
	}
	if st.LastReportTime == nil || !st.LastReportTime.Equal(&reported) {
		t.Errorf("status.lastReportTime %v, want %v", st.LastReportTime, reported)
	}
	if st.Phase != redpacketv1alpha1.PhaseActive || st.ScriptSHA != lua.GrabScript.SHA() || st.ObservedGeneration != a.Generation {
		t.Errorf("controller fields after reconciles: %s", describe(a))
	}

	// managedFields: two managers on the status subresource, each with its own fields.
	owned := map[string]string{}
	for _, m := range a.ManagedFields {
		if m.Subresource == "status" && m.Operation == metav1.ManagedFieldsOperationApply {
			owned[m.Manager] = string(m.FieldsV1.GetRawBytes())
		}
	}
	ctrlFields, grabFields := owned[controllers.FieldManager], owned[grabServiceManager]
	if ctrlFields == "" || grabFields == "" {
		t.Fatalf("status managers %v, want %s and %s", keysOf(owned), controllers.FieldManager, grabServiceManager)
	}
	for _, f := range []string{"f:phase", "f:conditions", "f:scriptSHA", "f:observedGeneration", "f:seededTime", "f:splitSeed"} {
		if !hasStatusField(t, ctrlFields, f) {
			t.Errorf("%s does not own status.%s: %s", controllers.FieldManager, f, ctrlFields)
		}
		if hasStatusField(t, grabFields, f) {
			t.Errorf("%s owns status.%s", grabServiceManager, f)
		}
	}
	for _, f := range []string{"f:claimedCount", "f:remainingCount", "f:settledAmount", "f:lastReportTime"} {
		if !hasStatusField(t, grabFields, f) {
			t.Errorf("%s does not own status.%s: %s", grabServiceManager, f, grabFields)
		}
		if hasStatusField(t, ctrlFields, f) {
			t.Errorf("%s owns status.%s", controllers.FieldManager, f)
		}
	}

	// The report turns stale; the controller notices without any event.
	e.waitCondition("shared", redpacketv1alpha1.ConditionGrabServiceAvailable, metav1.ConditionFalse, redpacketv1alpha1.ReasonNoReplicas, 10*time.Second)
}

func hasStatusField(t *testing.T, fieldsV1, field string) bool {
	t.Helper()
	var m map[string]map[string]any
	if err := json.Unmarshal([]byte(fieldsV1), &m); err != nil {
		t.Fatalf("managed fields %s: %v", fieldsV1, err)
	}
	_, ok := m["f:status"][field]
	return ok
}

func keysOf(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// A missing Secret and an unreachable Redis show as conditions; the controller backs
// off and recovers once the Secret points at a live Redis.
func TestRedisConnectionProblemsAreReported(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		// The dead port below is on loopback, and spec.redis may name it.
		r.Options.AllowedRedisHosts = controllers.MustParseRedisHosts("127.0.0.1")
	})
	ctx := context.Background()

	e.create(e.activity("remote", 1000, 10, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Redis = &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: "redis-conn"}}
	}))
	a := e.waitCondition("remote", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonRedisConfigInvalid, 10*time.Second)
	if c := findCondition(a, redpacketv1alpha1.ConditionReady); !strings.Contains(c.Message, "redis-conn") {
		t.Errorf("message %q does not name the Secret", c.Message)
	}
	if a.Status.Phase != redpacketv1alpha1.PhasePending {
		t.Errorf("phase %s, want Pending", a.Status.Phase)
	}
	e.waitEvent("remote", "Warning", redpacketv1alpha1.ReasonRedisConfigInvalid)

	// A Secret that points at a port nobody listens on.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := l.Addr().String()
	_ = l.Close()
	secret := &corev1.Secret{}
	secret.Name, secret.Namespace = "redis-conn", e.ns
	secret.StringData = map[string]string{"addresses": dead, "mode": "standalone"}
	if err := e.c.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}
	e.waitCondition("remote", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonRedisUnavailable, 15*time.Second)

	// Point it at the test's Redis: the controller recovers on its own.
	secret.StringData = map[string]string{"addresses": e.redis.Addr, "mode": "standalone",
		"username": e.redis.Username, "password": e.redis.Password}
	if err := e.c.Update(ctx, secret); err != nil {
		t.Fatal(err)
	}
	a = e.waitPhase("remote", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if snap := e.snapshot(a); snap.Count != 10 || snap.State != store.StateOpen {
		t.Errorf("snapshot %+v in the Secret's Redis", snap)
	}
}

// Settled follows the grab service's report at once, not at the next resync: when a
// closed activity's settledCount reaches its claimedCount, and when the first dead
// letter is reported.
func TestSettledFollowsTheGrabServiceReportPromptly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		// No resync could explain a prompt change.
		r.Options.ActiveResyncPeriod = time.Hour
		settledByHand(r)
	})
	ctx := context.Background()

	e.create(e.activity("drained", 100, 2, withSettlement))
	a := e.waitPhase("drained", redpacketv1alpha1.PhaseActive, 20*time.Second)
	var claimed int64
	for _, u := range []string{"u1", "u2"} {
		res := e.grab(a, u)
		if res.Outcome != store.Granted {
			t.Fatalf("grab: %+v", res)
		}
		claimed += res.Amount
	}
	report := func(settledCount, settledAmount int64) {
		e.applyGrabServiceStatus("drained", map[string]any{
			"remainingCount": int64(0), "remainingAmount": int64(0),
			"claimedCount": int64(2), "claimedAmount": claimed,
			"settledCount": settledCount, "settledAmount": settledAmount, "deadLetterCount": int64(0),
		})
	}
	report(0, 0)
	e.waitPhase("drained", redpacketv1alpha1.PhaseExhausted, 5*time.Second)
	pending := e.waitCondition("drained", redpacketv1alpha1.ConditionSettled, metav1.ConditionFalse, redpacketv1alpha1.ReasonSettlementPending, 5*time.Second)
	if msg := findCondition(pending, redpacketv1alpha1.ConditionSettled).Message; msg != "0 of 2 claims settled" {
		t.Errorf("Settled message %q of an exhausted activity, want %q (no refund to speak of)", msg, "0 of 2 claims settled")
	}

	if n := e.settleAll(a); n != 2 {
		t.Fatalf("settled %d entries, want 2 grants", n)
	}
	report(2, claimed)
	e.waitCondition("drained", redpacketv1alpha1.ConditionSettled, metav1.ConditionTrue, redpacketv1alpha1.ReasonAllSettled, 5*time.Second)

	e.create(e.activity("poisoned", 100, 3, withSettlement))
	b := e.waitPhase("poisoned", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if res := e.grab(b, "u1"); res.Outcome != store.Granted {
		t.Fatalf("grab: %+v", res)
	}
	msgs := e.readPending(b)
	if len(msgs) != 1 {
		t.Fatalf("%d stream entries, want 1", len(msgs))
	}
	if ok, err := e.handle(b).Shard(0).DeadLetter(ctx, settlementGroup, msgs[0].ID, "webhook answered 500", msgs[0].FieldValues()); err != nil || !ok {
		t.Fatalf("dead-lettering: ok=%v err=%v", ok, err)
	}
	e.applyGrabServiceStatus("poisoned", map[string]any{"claimedCount": int64(1), "deadLetterCount": int64(1)})
	e.waitCondition("poisoned", redpacketv1alpha1.ConditionSettled, metav1.ConditionFalse, redpacketv1alpha1.ReasonDeadLetters, 5*time.Second)
}
