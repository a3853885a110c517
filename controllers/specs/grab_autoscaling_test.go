package specs

import (
	"maps"
	"testing"
	"time"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// prewarmed is an activity from 20:00 to 20:10 with autoscaling 1→8, prewarm 4, a
// 60 s lead and a 2 m hold.
func prewarmed() (*redpacketv1alpha1.RedPacketActivity, time.Time, time.Time) {
	a := testActivity()
	start := time.Date(2026, 12, 31, 20, 0, 0, 0, time.UTC)
	end := start.Add(10 * time.Minute)
	a.Spec.StartTime, a.Spec.EndTime = &metav1.Time{Time: start}, &metav1.Time{Time: end}
	a.Spec.GrabService.Autoscaling = &redpacketv1alpha1.ActivityGrabAutoscaling{
		MinReplicas: 1, MaxReplicas: 8, TargetCPUUtilizationPercentage: 60,
		Prewarm: &redpacketv1alpha1.GrabPrewarm{Replicas: 4,
			Lead: &metav1.Duration{Duration: time.Minute}, HoldAfter: &metav1.Duration{Duration: 2 * time.Minute}},
	}
	return a, start, end
}

// The window [startTime − lead, endTime + holdAfter) holds the minimum at the
// prewarm size, and only it; each instant knows the next edge to come back at.
func TestActivityCapacityWindow(t *testing.T) {
	a, start, end := prewarmed()
	for _, tc := range []struct {
		name     string
		now      time.Time
		stage    PrewarmStage
		min      int32
		started  bool
		nextEdge time.Time
	}{
		{"long before the lead", start.Add(-time.Hour), PrewarmBefore, 1, false, start.Add(-time.Minute)},
		{"a moment before the lead", start.Add(-time.Minute - time.Millisecond), PrewarmBefore, 1, false, start.Add(-time.Minute)},
		{"at the window's opening", start.Add(-time.Minute), PrewarmInside, 4, false, start},
		{"inside, before startTime", start.Add(-time.Second), PrewarmInside, 4, false, start},
		{"at startTime", start, PrewarmInside, 4, true, end.Add(2 * time.Minute)},
		{"during the rain", start.Add(5 * time.Minute), PrewarmInside, 4, true, end.Add(2 * time.Minute)},
		{"after endTime, before holdAfter", end.Add(time.Minute), PrewarmInside, 4, true, end.Add(2 * time.Minute)},
		{"at the window's closing", end.Add(2 * time.Minute), PrewarmAfter, 1, true, time.Time{}},
		{"long after", end.Add(time.Hour), PrewarmAfter, 1, true, time.Time{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, ok := ActivityCapacity(a, tc.now)
			if !ok {
				t.Fatal("no capacity for an autoscaled activity")
			}
			if c.Stage != tc.stage || c.MinReplicas != tc.min || c.Started != tc.started || !c.NextEdge.Equal(tc.nextEdge) {
				t.Errorf("stage %q min %d started %v next edge %v, want %q %d %v %v",
					c.Stage, c.MinReplicas, c.Started, c.NextEdge, tc.stage, tc.min, tc.started, tc.nextEdge)
			}
			if c.MaxReplicas != 8 || c.TargetCPU != 60 || c.Prewarm != 4 {
				t.Errorf("max %d target %d prewarm %d, want 8, 60 and 4", c.MaxReplicas, c.TargetCPU, c.Prewarm)
			}
			pdb := GrabAutoscaledDisruptionBudgetSpec(GrabSelector(a), c)
			switch {
			case tc.stage == PrewarmInside && (pdb.MinAvailable == nil || pdb.MinAvailable.IntValue() != int(tc.min) || pdb.MaxUnavailable != nil):
				t.Errorf("the disruption budget's minAvailable %v maxUnavailable %v, want minAvailable %d only inside the window",
					pdb.MinAvailable, pdb.MaxUnavailable, tc.min)
			case tc.stage != PrewarmInside && (pdb.MinAvailable != nil || pdb.MaxUnavailable == nil || pdb.MaxUnavailable.IntValue() != 1):
				t.Errorf("the disruption budget's minAvailable %v maxUnavailable %v, want maxUnavailable 1 only outside the window",
					pdb.MinAvailable, pdb.MaxUnavailable)
			}
		})
	}
}

// Without autoscaling there is no capacity; without prewarm the minimum is
// autoscaling's at every instant; defaults fill what an object built in Go left
// out, and the minimum never exceeds the maximum.
func TestCapacityWithoutPrewarm(t *testing.T) {
	a, start, _ := prewarmed()
	plain := testActivity()
	if _, ok := ActivityCapacity(plain, start); ok {
		t.Error("an activity without autoscaling has a capacity")
	}
	a.Spec.GrabService.Autoscaling.Prewarm = nil
	for _, now := range []time.Time{start.Add(-time.Hour), start, start.Add(time.Hour)} {
		c, _ := ActivityCapacity(a, now)
		if c.Stage != NoPrewarm || c.MinReplicas != 1 || !c.NextEdge.IsZero() {
			t.Errorf("at %v: stage %q min %d next edge %v, want no prewarm, 1, none", now, c.Stage, c.MinReplicas, c.NextEdge)
		}
	}

	a, start, end := prewarmed()
	a.Spec.GrabService.Autoscaling.Prewarm.Lead, a.Spec.GrabService.Autoscaling.Prewarm.HoldAfter = nil, nil
	c, _ := ActivityCapacity(a, start)
	if !c.WindowStart.Equal(start.Add(-DefaultPrewarmLead)) || !c.WindowEnd.Equal(end.Add(DefaultPrewarmHoldAfter)) {
		t.Errorf("window [%v, %v), want the default lead and hold", c.WindowStart, c.WindowEnd)
	}

	b := testBudget()
	if _, ok := BudgetCapacity(b); ok {
		t.Error("a budget without autoscaling has a capacity")
	}
	b.Spec.GrabService.Autoscaling = &redpacketv1alpha1.GrabAutoscaling{MinReplicas: 9, MaxReplicas: 3}
	c, _ = BudgetCapacity(b)
	if c.MinReplicas != 3 || c.MaxReplicas != 3 || c.TargetCPU != DefaultTargetCPU || c.Stage != NoPrewarm {
		t.Errorf("budget capacity %+v, want min clamped to max 3 and the default target", c)
	}
	if pdb := GrabAutoscaledDisruptionBudgetSpec(BudgetSelector(b), c); pdb.MinAvailable != nil || pdb.MaxUnavailable == nil || pdb.MaxUnavailable.IntValue() != 1 {
		t.Errorf("budget disruption budget minAvailable %v maxUnavailable %v, want maxUnavailable 1 only: a budget has no window to hold",
			pdb.MinAvailable, pdb.MaxUnavailable)
	}
}

// The HPA targets the grab Deployment by name, with the capacity's bounds and CPU
// target, and sets what the API server would default, so keeping it writes nothing.
func TestGrabAutoscalerSpec(t *testing.T) {
	a, start, _ := prewarmed()
	c, _ := ActivityCapacity(a, start)
	spec := GrabAutoscalerSpec(GrabName(a), c)
	if spec.ScaleTargetRef != (autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: "Deployment", Name: GrabName(a)}) {
		t.Errorf("scale target %+v", spec.ScaleTargetRef)
	}
	if spec.MinReplicas == nil || *spec.MinReplicas != 4 || spec.MaxReplicas != 8 {
		t.Errorf("bounds %v..%d, want 4..8", spec.MinReplicas, spec.MaxReplicas)
	}
	if len(spec.Metrics) != 1 || spec.Metrics[0].Resource == nil || spec.Metrics[0].Resource.Name != corev1.ResourceCPU ||
		spec.Metrics[0].Resource.Target.Type != autoscalingv2.UtilizationMetricType ||
		spec.Metrics[0].Resource.Target.AverageUtilization == nil || *spec.Metrics[0].Resource.Target.AverageUtilization != 60 {
		t.Errorf("metrics %+v, want CPU utilization 60", spec.Metrics)
	}
	pdb := GrabAutoscaledDisruptionBudgetSpec(GrabSelector(a), c)
	if !maps.Equal(pdb.Selector.MatchLabels, GrabSelector(a)) || pdb.UnhealthyPodEvictionPolicy == nil ||
		*pdb.UnhealthyPodEvictionPolicy != policyv1.AlwaysAllow {
		t.Errorf("disruption budget %+v, want the grab selector and unready pods always evictable", pdb)
	}
}
