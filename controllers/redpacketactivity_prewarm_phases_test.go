package controllers

import (
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// Prewarmed and Ready across the window, by the controller's clock and the grab
// Deployment's available replicas: pending before the lead, warming until enough
// are available, NotPrewarmed from startTime on (Ready False only while the
// activity serves), released after holdAfter; absent without prewarm.
func TestComputePrewarmed(t *testing.T) {
	start := time.Date(2026, 12, 31, 20, 0, 0, 0, time.UTC)
	end := start.Add(10 * time.Minute)
	prewarmed := func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.StartTime, a.Spec.EndTime = &metav1.Time{Time: start}, &metav1.Time{Time: end}
		a.Spec.GrabService.Autoscaling = &redpacketv1alpha1.ActivityGrabAutoscaling{MinReplicas: 1, MaxReplicas: 8,
			Prewarm: &redpacketv1alpha1.GrabPrewarm{Replicas: 4, Lead: &metav1.Duration{Duration: time.Minute},
				HoldAfter: &metav1.Duration{Duration: 2 * time.Minute}}}
	}
	for _, tc := range []struct {
		name       string
		mutate     func(*redpacketv1alpha1.RedPacketActivity)
		now        time.Time
		available  int32
		phase      redpacketv1alpha1.Phase
		wantReason string // "" : no condition
		wantStatus metav1.ConditionStatus
		wantReady  bool // Ready must be False with NotPrewarmed
	}{
		{"no autoscaling", nil, start, 0, redpacketv1alpha1.PhaseActive, "", "", false},
		{"autoscaling without prewarm", func(a *redpacketv1alpha1.RedPacketActivity) {
			prewarmed(a)
			a.Spec.GrabService.Autoscaling.Prewarm = nil
		}, start, 0, redpacketv1alpha1.PhaseActive, "", "", false},
		{"before the lead", prewarmed, start.Add(-2 * time.Minute), 1, redpacketv1alpha1.PhaseScheduled,
			redpacketv1alpha1.ReasonPrewarmPending, metav1.ConditionFalse, false},
		{"in the lead, warming", prewarmed, start.Add(-30 * time.Second), 3, redpacketv1alpha1.PhaseScheduled,
			redpacketv1alpha1.ReasonWarming, metav1.ConditionFalse, false},
		{"in the lead, warmed", prewarmed, start.Add(-30 * time.Second), 4, redpacketv1alpha1.PhaseScheduled,
			redpacketv1alpha1.ReasonWarmed, metav1.ConditionTrue, false},
		{"started, warmed above the size", prewarmed, start.Add(time.Minute), 6, redpacketv1alpha1.PhaseActive,
			redpacketv1alpha1.ReasonWarmed, metav1.ConditionTrue, false},
		{"started short", prewarmed, start, 2, redpacketv1alpha1.PhaseActive,
			redpacketv1alpha1.ReasonNotPrewarmed, metav1.ConditionFalse, true},
		{"started short, by Redis's clock still Scheduled", prewarmed, start.Add(time.Second), 2, redpacketv1alpha1.PhaseScheduled,
			redpacketv1alpha1.ReasonNotPrewarmed, metav1.ConditionFalse, true},
		{"short after endTime, closed: Ready is not held", prewarmed, end.Add(time.Minute), 2, redpacketv1alpha1.PhaseExpired,
			redpacketv1alpha1.ReasonNotPrewarmed, metav1.ConditionFalse, false},
		{"after holdAfter", prewarmed, end.Add(2 * time.Minute), 1, redpacketv1alpha1.PhaseExpired,
			redpacketv1alpha1.ReasonPrewarmReleased, metav1.ConditionFalse, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mutate []func(*redpacketv1alpha1.RedPacketActivity)
			if tc.mutate != nil {
				mutate = append(mutate, tc.mutate)
			}
			s := newActivityScope(testActivity(mutate...), tc.now)
			s.status.Phase = tc.phase
			s.deployment = &appsv1.Deployment{Status: appsv1.DeploymentStatus{AvailableReplicas: tc.available}}
			// A condition left from before goes when prewarm does.
			s.setCondition(redpacketv1alpha1.ConditionPrewarmed, metav1.ConditionTrue, redpacketv1alpha1.ReasonWarmed, "before")
			blocker := computePrewarmed(s)
			c := meta.FindStatusCondition(s.status.Conditions, redpacketv1alpha1.ConditionPrewarmed)
			switch {
			case tc.wantReason == "" && c != nil:
				t.Errorf("Prewarmed %+v, want none", c)
			case tc.wantReason != "" && (c == nil || c.Reason != tc.wantReason || c.Status != tc.wantStatus):
				t.Errorf("Prewarmed %+v, want %s/%s", c, tc.wantStatus, tc.wantReason)
			}
			if got := blocker != nil && blocker.reason == redpacketv1alpha1.ReasonNotPrewarmed; got != tc.wantReady {
				t.Errorf("Ready held by NotPrewarmed: %v (%+v), want %v", got, blocker, tc.wantReady)
			}
		})
	}
}

// The grab autoscaler step asks to come back just after the window's next edge:
// its opening, startTime, its closing; after the window, and without prewarm,
// nothing.
func TestGrabAutoscalerRequeuesAtTheWindowsEdges(t *testing.T) {
	start := time.Date(2026, 12, 31, 20, 0, 0, 0, time.UTC)
	end := start.Add(10 * time.Minute)
	a := testActivity(func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.StartTime, a.Spec.EndTime = &metav1.Time{Time: start}, &metav1.Time{Time: end}
		a.Spec.GrabService.Autoscaling = &redpacketv1alpha1.ActivityGrabAutoscaling{MinReplicas: 1, MaxReplicas: 8,
			Prewarm: &redpacketv1alpha1.GrabPrewarm{Replicas: 4, Lead: &metav1.Duration{Duration: time.Minute},
				HoldAfter: &metav1.Duration{Duration: 2 * time.Minute}}}
	})
	r := &RedPacketActivityReconciler{}
	for _, tc := range []struct {
		now  time.Time
		want time.Duration
	}{
		{start.Add(-time.Hour), 59*time.Minute + prewarmEdgeMargin},
		{start.Add(-30 * time.Second), 30*time.Second + prewarmEdgeMargin},
		{start.Add(time.Minute), 11*time.Minute + prewarmEdgeMargin},
		{end.Add(2 * time.Minute), 0},
	} {
		// The workload is not the activity's here: the step touches nothing, and
		// still asks to come back for Prewarmed.
		res, err := r.reconcileGrabAutoscaler(t.Context(), newActivityScope(a, tc.now))
		if err != nil || res.requeueAfter != tc.want {
			t.Errorf("at %v: requeue after %v (%v), want %v", tc.now, res.requeueAfter, err, tc.want)
		}
	}
	res, _ := r.reconcileGrabAutoscaler(t.Context(), newActivityScope(testActivity(), start))
	if res.requeueAfter != 0 {
		t.Errorf("requeue after %v without autoscaling, want none", res.requeueAfter)
	}
}
