package specs

import (
	"maps"
	"time"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// PrewarmStage is where an instant falls against an activity's prewarm window.
type PrewarmStage string

// The stages of the prewarm window [startTime − lead, endTime + holdAfter).
const (
	// NoPrewarm: the resource has no prewarm (a budget, or an activity without
	// spec.grabService.autoscaling.prewarm).
	NoPrewarm PrewarmStage = ""
	// PrewarmBefore: the window has not opened yet.
	PrewarmBefore PrewarmStage = "Before"
	// PrewarmInside: the window is open; the HPA's minimum is the prewarm size.
	PrewarmInside PrewarmStage = "Inside"
	// PrewarmAfter: the window has closed; the minimum is released.
	PrewarmAfter PrewarmStage = "After"
)

// Capacity is what the operator's HorizontalPodAutoscaler and PodDisruptionBudget
// of a grab Deployment are at one instant. Invariants: 1 <= MinReplicas <=
// MaxReplicas; MinReplicas is Prewarm exactly while Stage is PrewarmInside, and the
// autoscaling's minReplicas otherwise; inside the window the PodDisruptionBudget's
// minAvailable is MinReplicas, so a voluntary eviction never takes the warmed fleet
// below its size (GrabAutoscaledDisruptionBudgetSpec).
type Capacity struct {
	// MinReplicas is the HPA's minReplicas now.
	MinReplicas int32
	// MaxReplicas is the HPA's maxReplicas.
	MaxReplicas int32
	// TargetCPU is the HPA's target average CPU utilization, in percent of the CPU
	// request.
	TargetCPU int32
	// Prewarm is prewarm.replicas, 0 without prewarm.
	Prewarm int32
	// Stage is where the instant falls against the window.
	Stage PrewarmStage
	// WindowStart and WindowEnd bound the window [WindowStart, WindowEnd); zero
	// without prewarm.
	WindowStart, WindowEnd time.Time
	// Start is the activity's startTime, zero without prewarm.
	Start time.Time
	// Started is true once Start has come (only with prewarm).
	Started bool
	// NextEdge is the next instant after now at which Stage or Started changes:
	// the window's opening, startTime or the window's closing. Zero when none is
	// left.
	NextEdge time.Time
}

// Default durations of a prewarm whose lead or holdAfter the API server did not
// default (an object built in Go); the CRD's defaults say the same.
const (
	DefaultPrewarmLead      = 10 * time.Minute
	DefaultPrewarmHoldAfter = 2 * time.Minute
	// DefaultTargetCPU is the HPA's CPU target when the spec leaves it 0.
	DefaultTargetCPU int32 = 70
)

// ActivityCapacity is the activity's grab Capacity at now; false when the activity
// has no spec.grabService.autoscaling (then the operator owns no HPA and its
// PodDisruptionBudget is the plain one of GrabDisruptionBudgetSpec).
func ActivityCapacity(a *redpacketv1alpha1.RedPacketActivity, now time.Time) (Capacity, bool) {
	as := a.Spec.GrabService.Autoscaling
	if as == nil {
		return Capacity{}, false
	}
	c := bounds(as.MinReplicas, as.MaxReplicas, as.TargetCPUUtilizationPercentage)
	p := as.Prewarm
	if p == nil || a.Spec.StartTime == nil || a.Spec.EndTime == nil {
		return c, true
	}
	lead, hold := DefaultPrewarmLead, DefaultPrewarmHoldAfter
	if p.Lead != nil {
		lead = p.Lead.Duration
	}
	if p.HoldAfter != nil {
		hold = p.HoldAfter.Duration
	}
	c.Prewarm = min(max(p.Replicas, c.MinReplicas), c.MaxReplicas)
	c.Start = a.Spec.StartTime.Time
	c.WindowStart = c.Start.Add(-lead)
	c.WindowEnd = a.Spec.EndTime.Add(hold)
	c.Started = !now.Before(c.Start)
	switch {
	case now.Before(c.WindowStart):
		c.Stage = PrewarmBefore
	case now.Before(c.WindowEnd):
		c.Stage = PrewarmInside
		c.MinReplicas = c.Prewarm
	default:
		c.Stage = PrewarmAfter
	}
	for _, edge := range []time.Time{c.WindowStart, c.Start, c.WindowEnd} {
		if edge.After(now) && (c.NextEdge.IsZero() || edge.Before(c.NextEdge)) {
			c.NextEdge = edge
		}
	}
	return c, true
}

// BudgetCapacity is the budget's grab Capacity; false without
// spec.grabService.autoscaling. A budget has no window, so its minimum never moves.
func BudgetCapacity(b *redpacketv1alpha1.RedPacketBudget) (Capacity, bool) {
	as := b.Spec.GrabService.Autoscaling
	if as == nil {
		return Capacity{}, false
	}
	return bounds(as.MinReplicas, as.MaxReplicas, as.TargetCPUUtilizationPercentage), true
}

// bounds is a Capacity without prewarm, with the CRD's defaults for fields left 0
// and the minimum never above the maximum.
func bounds(minReplicas, maxReplicas, target int32) Capacity {
	maxReplicas = max(maxReplicas, 1)
	minReplicas = min(max(minReplicas, 1), maxReplicas)
	if target <= 0 {
		target = DefaultTargetCPU
	}
	return Capacity{MinReplicas: minReplicas, MaxReplicas: maxReplicas, TargetCPU: target}
}

// GrabAutoscalerSpec is the spec of the operator's HorizontalPodAutoscaler of the
// grab Deployment named deployment: between c.MinReplicas and c.MaxReplicas on the
// pods' average CPU utilization. Every field the API server would default is set,
// so the live spec equals this one and keeping it writes nothing. Behavior is left
// to the HPA's defaults (a scale-down waits 5 minutes of lower load).
func GrabAutoscalerSpec(deployment string, c Capacity) autoscalingv2.HorizontalPodAutoscalerSpec {
	minReplicas, target := c.MinReplicas, c.TargetCPU
	return autoscalingv2.HorizontalPodAutoscalerSpec{
		ScaleTargetRef: autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: "Deployment", Name: deployment},
		MinReplicas:    &minReplicas,
		MaxReplicas:    c.MaxReplicas,
		Metrics: []autoscalingv2.MetricSpec{{
			Type: autoscalingv2.ResourceMetricSourceType,
			Resource: &autoscalingv2.ResourceMetricSource{
				Name:   corev1.ResourceCPU,
				Target: autoscalingv2.MetricTarget{Type: autoscalingv2.UtilizationMetricType, AverageUtilization: &target},
			},
		}},
	}
}

// GrabAutoscaledDisruptionBudgetSpec is the PodDisruptionBudget of an autoscaled
// grab Deployment at capacity c. Inside a prewarm window (c.Stage is PrewarmInside)
// minAvailable is the warmed minimum, so a voluntary eviction (a node drain) never
// takes the fleet below the size the rain was warmed for: pods above it may go as
// the budget allows, and at the minimum a drain waits for the window to close.
// Outside the window, and for a budget, which has none, it is the plain
// one-eviction-at-a-time budget (GrabDisruptionBudgetSpec): a fleet at its everyday
// minimum, one replica included, never blocks a node's maintenance. Either way an
// unready pod may always be evicted, so a broken replica never blocks a drain.
func GrabAutoscaledDisruptionBudgetSpec(selector map[string]string, c Capacity) policyv1.PodDisruptionBudgetSpec {
	if c.Stage != PrewarmInside {
		return GrabDisruptionBudgetSpec(selector)
	}
	minAvailable := intstr.FromInt32(c.MinReplicas)
	alwaysAllow := policyv1.AlwaysAllow
	return policyv1.PodDisruptionBudgetSpec{
		Selector:                   &metav1.LabelSelector{MatchLabels: maps.Clone(selector)},
		MinAvailable:               &minAvailable,
		UnhealthyPodEvictionPolicy: &alwaysAllow,
	}
}
