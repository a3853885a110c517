package specs

import (
	"maps"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// GrabNetworkPolicySpec selects the grab pods of an activity or a budget (selector:
// GrabSelector or BudgetSelector) and admits ingress on the grab port only (TCP
// 8080: the grab API, the probes and /metrics share it). Egress is not restricted:
// Redis, the API server and the balance system's webhook are wherever the resource
// says.
func GrabNetworkPolicySpec(selector map[string]string) networkingv1.NetworkPolicySpec {
	tcp := corev1.ProtocolTCP
	port := intstr.FromInt32(grabPort)
	return networkingv1.NetworkPolicySpec{
		PodSelector: metav1.LabelSelector{MatchLabels: maps.Clone(selector)},
		PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
		Ingress: []networkingv1.NetworkPolicyIngressRule{{
			Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &port}},
		}},
	}
}

// GrabDisruptionBudgetSpec allows one voluntary eviction of the selected grab pods (of
// an activity or a budget) at a time, and the eviction of unready ones always, so a
// broken replica never blocks a node drain.
func GrabDisruptionBudgetSpec(selector map[string]string) policyv1.PodDisruptionBudgetSpec {
	one := intstr.FromInt32(1)
	alwaysAllow := policyv1.AlwaysAllow
	return policyv1.PodDisruptionBudgetSpec{
		Selector:                   &metav1.LabelSelector{MatchLabels: maps.Clone(selector)},
		MaxUnavailable:             &one,
		UnhealthyPodEvictionPolicy: &alwaysAllow,
	}
}
