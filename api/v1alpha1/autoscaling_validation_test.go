package v1alpha1_test

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// autoscaled gives an activity a window and autoscaling 1→8 with prewarm 4.
func autoscaled(s *v1alpha1.RedPacketActivitySpec) {
	s.StartTime, s.EndTime = at("2026-12-31T20:00:00Z"), at("2026-12-31T20:10:00Z")
	s.GrabService.Autoscaling = &v1alpha1.ActivityGrabAutoscaling{
		MinReplicas: 1, MaxReplicas: 8,
		Prewarm: &v1alpha1.GrabPrewarm{Replicas: 4, Lead: ttl("60s")},
	}
}

// The API server refuses autoscaling that the HPA could not hold: bounds out of
// order, a prewarm size outside them, a prewarm without a window, durations out of
// range.
func TestImpossibleAutoscalingIsRejected(t *testing.T) {
	needsControlPlane(t)
	ns := cp.Namespace(t)
	for _, tc := range []struct {
		name   string
		mutate func(*v1alpha1.RedPacketActivitySpec)
		msg    string
	}{
		{"min above max", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.Autoscaling.MinReplicas, s.GrabService.Autoscaling.Prewarm = 9, nil
		}, "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"},
		{"max zero", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.Autoscaling.MaxReplicas = 0
		}, "spec.grabService.autoscaling.maxReplicas in body should be greater than or equal to 1"},
		{"max above 1000", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.Autoscaling.MaxReplicas = 1001
		}, "spec.grabService.autoscaling.maxReplicas in body should be less than or equal to 1000"},
		{"cpu target above 400", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.Autoscaling.TargetCPUUtilizationPercentage = 401
		}, "targetCPUUtilizationPercentage in body should be less than or equal to 400"},
		{"prewarm above max", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.Autoscaling.Prewarm.Replicas = 9
		}, "autoscaling.prewarm.replicas must not exceed autoscaling.maxReplicas"},
		{"prewarm below min", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.Autoscaling.MinReplicas = 5
		}, "autoscaling.prewarm.replicas must be at least autoscaling.minReplicas"},
		{"prewarm without a start", func(s *v1alpha1.RedPacketActivitySpec) { s.StartTime = nil },
			"grabService.autoscaling.prewarm needs startTime and endTime"},
		{"prewarm without an end", func(s *v1alpha1.RedPacketActivitySpec) { s.EndTime = nil },
			"grabService.autoscaling.prewarm needs startTime and endTime"},
		{"negative lead", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.Autoscaling.Prewarm.Lead = ttl("-1s")
		}, "prewarm.lead must be between 0s and 24h"},
		{"hold over a day", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.Autoscaling.Prewarm.HoldAfter = ttl("25h")
		}, "prewarm.holdAfter must be between 0s and 24h"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := activity(ns, "as-"+strings.ReplaceAll(tc.name, " ", "-"))
			autoscaled(&a.Spec)
			tc.mutate(&a.Spec)
			expectRejected(t, cp.Client.Create(testCtx(t), a), tc.msg)
		})
	}
}

// Autoscaling at its edges is accepted, and its defaults are filled in.
func TestAutoscalingBoundariesAndDefaults(t *testing.T) {
	needsControlPlane(t)
	ns := cp.Namespace(t)
	for _, tc := range []struct {
		name   string
		mutate func(*v1alpha1.RedPacketActivitySpec)
	}{
		{"prewarm equals max", func(s *v1alpha1.RedPacketActivitySpec) { s.GrabService.Autoscaling.Prewarm.Replicas = 8 }},
		{"prewarm equals min", func(s *v1alpha1.RedPacketActivitySpec) { s.GrabService.Autoscaling.MinReplicas = 4 }},
		{"min equals max", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.Autoscaling.MinReplicas, s.GrabService.Autoscaling.MaxReplicas = 4, 4
		}},
		{"no prewarm and no window", func(s *v1alpha1.RedPacketActivitySpec) {
			s.StartTime, s.EndTime, s.GrabService.Autoscaling.Prewarm = nil, nil, nil
		}},
		{"zero lead", func(s *v1alpha1.RedPacketActivitySpec) { s.GrabService.Autoscaling.Prewarm.Lead = ttl("0s") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := activity(ns, "ok-"+strings.ReplaceAll(tc.name, " ", "-"))
			autoscaled(&a.Spec)
			tc.mutate(&a.Spec)
			if err := cp.Client.Create(testCtx(t), a); err != nil {
				t.Fatalf("rejected: %v", err)
			}
		})
	}

	a := activity(ns, "defaults")
	autoscaled(&a.Spec)
	a.Spec.GrabService.Autoscaling.MinReplicas = 0
	a.Spec.GrabService.Autoscaling.Prewarm.Lead = nil
	if err := cp.Client.Create(testCtx(t), a); err != nil {
		t.Fatalf("creating: %v", err)
	}
	got := a.Spec.GrabService.Autoscaling
	if got.MinReplicas != 1 || got.TargetCPUUtilizationPercentage != 70 ||
		got.Prewarm.Lead == nil || got.Prewarm.Lead.Duration.String() != "10m0s" ||
		got.Prewarm.HoldAfter == nil || got.Prewarm.HoldAfter.Duration.String() != "2m0s" {
		t.Errorf("defaults %+v prewarm %+v, want minReplicas 1, target 70, lead 10m, holdAfter 2m", got, got.Prewarm)
	}
}

// A budget's autoscaling has no prewarm at all (a budget has no window), keeps its
// bounds in order, and needs a CPU request to scale on.
func TestBudgetAutoscalingValidation(t *testing.T) {
	needsControlPlane(t)
	ns := cp.Namespace(t)

	b := budget(ns, "min-above-max")
	b.Spec.GrabService.Autoscaling = &v1alpha1.GrabAutoscaling{MinReplicas: 3, MaxReplicas: 2}
	expectRejected(t, cp.Client.Create(testCtx(t), b), "autoscaling.minReplicas must not exceed autoscaling.maxReplicas")

	b = budget(ns, "no-cpu-request")
	b.Spec.GrabService.Autoscaling = &v1alpha1.GrabAutoscaling{MaxReplicas: 4}
	b.Spec.GrabService.Resources = &corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")}}
	expectRejected(t, cp.Client.Create(testCtx(t), b), "resources must then request cpu")

	b = budget(ns, "fine")
	b.Spec.GrabService.Autoscaling = &v1alpha1.GrabAutoscaling{MaxReplicas: 4}
	if err := cp.Client.Create(testCtx(t), b); err != nil {
		t.Fatalf("rejected: %v", err)
	}
	if got := b.Spec.GrabService.Autoscaling; got.MinReplicas != 1 || got.TargetCPUUtilizationPercentage != 70 {
		t.Errorf("defaults %+v, want minReplicas 1 and target 70", got)
	}

	// prewarm is no field of a budget: strict field validation refuses it.
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": v1alpha1.GroupVersion.String(), "kind": "RedPacketBudget",
		"metadata": map[string]any{"name": "prewarmed", "namespace": ns},
		"spec": map[string]any{
			"total": int64(1000), "packets": map[string]any{"maxTotal": int64(100)},
			"grabService": map[string]any{"autoscaling": map[string]any{"maxReplicas": int64(4),
				"prewarm": map[string]any{"replicas": int64(2)}}},
		},
	}}
	err := cp.Client.Create(testCtx(t), u, client.FieldValidation("Strict"))
	if err == nil || !strings.Contains(err.Error(), `unknown field "spec.grabService.autoscaling.prewarm"`) {
		t.Errorf("a budget with prewarm: %v, want the unknown field refused", err)
	}
}
