package controllers_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/test/printed"
	"redpacket.io/operator/test/wait"
)

// Ready means grabs can be served: in Scheduled, Active and Paused it needs a grab
// replica (an available Deployment replica or a fresh report), else it is False with
// GrabServiceUnavailable. The controller notices promptly, without any resync, when
// the Deployment becomes available or unavailable, when the first report arrives,
// and when reports come back after they went stale.
func TestReadyNeedsAGrabReplica(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		// No resync could explain a prompt change.
		r.Options.ActiveResyncPeriod = time.Hour
		r.Options.GrabReportTimeout = 2 * time.Second
	})
	ctx := context.Background()

	start := metav1.NewTime(time.Now().Add(time.Hour).Truncate(time.Second))
	e.create(e.activity("soon", 500, 5, func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.StartTime = &start }))
	e.waitPhase("soon", redpacketv1alpha1.PhaseScheduled, 20*time.Second)
	a := e.waitCondition("soon", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonGrabServiceUnavailable, 5*time.Second)
	msg := findCondition(a, redpacketv1alpha1.ConditionReady).Message
	if !strings.Contains(msg, "5 packets are seeded") || !strings.Contains(msg, "no grab replica is available") {
		t.Errorf("Ready message %q, want it to say the packets are seeded but no grab replica is available", msg)
	}
	if c := findCondition(a, redpacketv1alpha1.ConditionSeeded); c == nil || c.Status != metav1.ConditionTrue {
		t.Errorf("Seeded %+v, want True", c)
	}

	// The Deployment's pods become available (as the Deployment controller reports).
	setAvailable := func(n int32) {
		t.Helper()
		d := &appsv1.Deployment{}
		if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "soon-grab"}, d); err != nil {
			t.Fatal(err)
		}
		d.Status = appsv1.DeploymentStatus{ObservedGeneration: d.Generation, Replicas: 1, UpdatedReplicas: 1,
			ReadyReplicas: n, AvailableReplicas: n, UnavailableReplicas: 1 - n}
		if err := e.c.Status().Update(ctx, d); err != nil {
			t.Fatalf("updating the Deployment's status: %v", err)
		}
	}
	setAvailable(1)
	e.waitCondition("soon", redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, string(redpacketv1alpha1.PhaseScheduled), 5*time.Second)
	e.waitCondition("soon", redpacketv1alpha1.ConditionGrabServiceAvailable, metav1.ConditionTrue, redpacketv1alpha1.ReasonReplicasAvailable, time.Second)
	setAvailable(0)
	e.waitCondition("soon", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonGrabServiceUnavailable, 5*time.Second)

	// An open activity turns Ready with the grab service's first report.
	e.create(e.activity("open", 500, 5))
	e.waitPhase("open", redpacketv1alpha1.PhaseActive, 20*time.Second)
	a = e.waitCondition("open", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonGrabServiceUnavailable, 5*time.Second)
	if msg := findCondition(a, redpacketv1alpha1.ConditionReady).Message; !strings.Contains(msg, "grabbing is open with 5 of 5 packets left") {
		t.Errorf("Ready message %q, want it to say grabbing is open", msg)
	}
	report := func() {
		e.applyGrabServiceStatus("open", map[string]any{
			"remainingCount": int64(5), "remainingAmount": int64(500), "claimedCount": int64(0), "claimedAmount": int64(0),
			"settledCount": int64(0), "settledAmount": int64(0), "deadLetterCount": int64(0),
			"lastReportTime": time.Now().UTC().Format(time.RFC3339),
		})
	}
	report()
	e.waitCondition("open", redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, string(redpacketv1alpha1.PhaseActive), 5*time.Second)
	// The reports stop: stale after the report timeout, Ready turns False by itself.
	e.waitCondition("open", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonGrabServiceUnavailable, 10*time.Second)
	// They resume (a new lastReportTime: the last one is over 2s old): the next report
	// is let through at once.
	report()
	e.waitCondition("open", redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, string(redpacketv1alpha1.PhaseActive), 5*time.Second)
}

// kubectl get -o wide prints START and END as RFC 3339 times, also in the future, and
// REMAINING and CLAIMED from the moment the activity is seeded, before any report.
// The controller sets those counters once under a field manager of its own; the grab
// service's reports take them over and the controller's later reconciles leave them
// alone.
func TestPrinterColumnsBeforeAndAfterReports(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)

	start := metav1.NewTime(time.Now().Add(time.Hour).Truncate(time.Second))
	end := metav1.NewTime(start.Add(10 * time.Minute))
	e.create(e.activity("columns", 1000, 10, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.StartTime, a.Spec.EndTime = &start, &end
	}))
	e.waitPhase("columns", redpacketv1alpha1.PhaseScheduled, 20*time.Second)

	cols := e.waitColumns("columns", "REMAINING", "10")
	want := map[string]string{
		"TOTAL": "1000", "COUNT": "10", "REMAINING": "10", "CLAIMED": "0", "PHASE": "Scheduled", "CLAIMED-AMOUNT": "0",
		"SETTLED": "0", "REFUNDED": "0",
		"START": start.UTC().Format(time.RFC3339), "END": end.UTC().Format(time.RFC3339),
	}
	for k, v := range want {
		if cols[k] != v {
			t.Errorf("column %s = %q before any report, want %q (all: %v)", k, cols[k], v, cols)
		}
	}
	counters := []string{"f:remainingCount", "f:remainingAmount", "f:claimedCount", "f:claimedAmount"}
	owned := statusFieldsByManager(t, e.get("columns"))
	for _, f := range counters {
		if !hasStatusField(t, owned[controllers.CountersFieldManager], f) {
			t.Errorf("%s does not own status.%s before any report: %v", controllers.CountersFieldManager, f, owned)
		}
		if hasStatusField(t, owned[controllers.FieldManager], f) {
			t.Errorf("%s owns status.%s", controllers.FieldManager, f)
		}
	}

	// The grab service reports: its values win and stay through the controller's
	// reconciles.
	e.applyGrabServiceStatus("columns", map[string]any{
		"remainingCount": int64(7), "remainingAmount": int64(640), "claimedCount": int64(3), "claimedAmount": int64(360),
		"settledCount": int64(0), "settledAmount": int64(0), "deadLetterCount": int64(0),
		"lastReportTime": time.Now().UTC().Format(time.RFC3339),
	})
	e.waitColumns("columns", "REMAINING", "7")
	for i := range 3 {
		e.bump("columns", i)
	}
	e.reconcileRoundTrip("columns")
	e.reconcileRoundTrip("columns")

	a := e.get("columns")
	st := a.Status
	for name, got := range map[string]*int64{"remainingCount": st.RemainingCount, "remainingAmount": st.RemainingAmount,
		"claimedCount": st.ClaimedCount, "claimedAmount": st.ClaimedAmount} {
		want := map[string]int64{"remainingCount": 7, "remainingAmount": 640, "claimedCount": 3, "claimedAmount": 360}[name]
		if got == nil || *got != want {
			t.Errorf("status.%s = %v after the report and reconciles, want %d", name, got, want)
		}
	}
	owned = statusFieldsByManager(t, a)
	for _, f := range counters {
		if !hasStatusField(t, owned[grabServiceManager], f) {
			t.Errorf("%s does not own status.%s after its report: %v", grabServiceManager, f, owned)
		}
		if hasStatusField(t, owned[controllers.CountersFieldManager], f) {
			t.Errorf("%s still owns status.%s after the grab service's report", controllers.CountersFieldManager, f)
		}
	}
	cols = e.columns("columns")
	if cols["REMAINING"] != "7" || cols["CLAIMED"] != "3" || cols["CLAIMED-AMOUNT"] != "360" {
		t.Errorf("columns after the report and reconciles: %v", cols)
	}
}

// statusFieldsByManager maps each field manager that applied to the status
// subresource to its fields (FieldsV1 JSON).
func statusFieldsByManager(t *testing.T, a *redpacketv1alpha1.RedPacketActivity) map[string]string {
	t.Helper()
	owned := map[string]string{}
	for _, m := range a.ManagedFields {
		if m.Subresource == "status" && m.Operation == metav1.ManagedFieldsOperationApply {
			owned[m.Manager] = string(m.FieldsV1.GetRawBytes())
		}
	}
	for _, m := range []string{controllers.FieldManager, controllers.CountersFieldManager, grabServiceManager} {
		if owned[m] == "" {
			owned[m] = "{}"
		}
	}
	return owned
}

// columns runs kubectl get rpa NAME -o wide and returns the row's cells by header.
func (e *env) columns(name string) map[string]string {
	e.t.Helper()
	kubeconfig := filepath.Join(e.t.TempDir(), "kubeconfig")
	if err := cp.Kubeconfig(kubeconfig); err != nil {
		e.t.Fatal(err)
	}
	out, err := exec.Command(filepath.Join(cp.BinDir, "kubectl"), "--kubeconfig", kubeconfig,
		"get", "rpa", name, "-n", e.ns, "-o", "wide").CombinedOutput()
	if err != nil {
		e.t.Fatalf("kubectl get rpa %s -o wide: %v\n%s", name, err, out)
	}
	cells, err := printed.FirstRow(string(out))
	if err != nil {
		e.t.Fatalf("kubectl get rpa %s -o wide: %v", name, err)
	}
	return cells
}

// waitColumns waits until kubectl get shows value in the column.
func (e *env) waitColumns(name, column, value string) map[string]string {
	e.t.Helper()
	var cols map[string]string
	wait.Until(e.t, 10*time.Second, "kubectl get rpa "+name+" "+column+"="+value, func() (bool, string) {
		cols = e.columns(name)
		return cols[column] == value, strings.Join(mapString(cols), " ")
	})
	return cols
}

func mapString(m map[string]string) []string {
	var out []string
	for k, v := range m {
		out = append(out, k+"="+v)
	}
	return out
}
