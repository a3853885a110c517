package specs

import (
	"maps"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// The NetworkPolicy admits ingress to the activity's grab pods on the grab port
// only, and leaves egress alone; a budget's selects the budget's pods the same way.
func TestGrabNetworkPolicySpec(t *testing.T) {
	b := testBudget()
	if spec := GrabNetworkPolicySpec(BudgetSelector(b)); !maps.Equal(spec.PodSelector.MatchLabels, BudgetSelector(b)) {
		t.Errorf("a budget's pod selector %+v, want %v", spec.PodSelector, BudgetSelector(b))
	}
	a := testActivity()
	spec := GrabNetworkPolicySpec(GrabSelector(a))
	if !maps.Equal(spec.PodSelector.MatchLabels, GrabSelector(a)) || len(spec.PodSelector.MatchExpressions) != 0 {
		t.Errorf("pod selector %+v, want %v", spec.PodSelector, GrabSelector(a))
	}
	if len(spec.PolicyTypes) != 1 || spec.PolicyTypes[0] != networkingv1.PolicyTypeIngress || len(spec.Egress) != 0 {
		t.Errorf("policy types %q egress %+v, want ingress only", spec.PolicyTypes, spec.Egress)
	}
	if len(spec.Ingress) != 1 || len(spec.Ingress[0].From) != 0 || len(spec.Ingress[0].Ports) != 1 {
		t.Fatalf("ingress %+v, want one rule from anywhere on one port", spec.Ingress)
	}
	port := spec.Ingress[0].Ports[0]
	if port.Protocol == nil || *port.Protocol != corev1.ProtocolTCP || port.Port == nil || *port.Port != intstr.FromInt32(8080) || port.EndPort != nil {
		t.Errorf("port %+v, want TCP 8080", port)
	}
}

// The PodDisruptionBudget lets one grab pod go at a time, and an unready one always.
func TestGrabDisruptionBudgetSpec(t *testing.T) {
	a := testActivity()
	spec := GrabDisruptionBudgetSpec(GrabSelector(a))
	if spec.Selector == nil || !maps.Equal(spec.Selector.MatchLabels, GrabSelector(a)) {
		t.Errorf("selector %+v, want %v", spec.Selector, GrabSelector(a))
	}
	if spec.MaxUnavailable == nil || *spec.MaxUnavailable != intstr.FromInt32(1) || spec.MinAvailable != nil {
		t.Errorf("maxUnavailable %v minAvailable %v, want maxUnavailable 1 only", spec.MaxUnavailable, spec.MinAvailable)
	}
	if spec.UnhealthyPodEvictionPolicy == nil || *spec.UnhealthyPodEvictionPolicy != policyv1.AlwaysAllow {
		t.Errorf("unhealthy pod eviction policy %v, want AlwaysAllow", spec.UnhealthyPodEvictionPolicy)
	}
}
