package specs

import (
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// GrabNetworkPolicySpec selects the activity's grab pods and admits ingress on the
// grab port only (TCP 8080: the grab API, the probes and /metrics share it). Egress
// is not restricted: Redis, the API server and the balance system's webhook are
// wherever the activity says.
func GrabNetworkPolicySpec(a *redpacketv1alpha1.RedPacketActivity) networkingv1.NetworkPolicySpec {
	tcp := corev1.ProtocolTCP
	port := intstr.FromInt32(grabPort)
	return networkingv1.NetworkPolicySpec{
		PodSelector: metav1.LabelSelector{MatchLabels: GrabSelector(a)},
		PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
		Ingress: []networkingv1.NetworkPolicyIngressRule{{
			Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &port}},
		}},
	}
}

// GrabDisruptionBudgetSpec allows one voluntary eviction of the activity's grab pods
// at a time, and the eviction of unready ones always, so a broken replica never
// blocks a node drain.
func GrabDisruptionBudgetSpec(a *redpacketv1alpha1.RedPacketActivity) policyv1.PodDisruptionBudgetSpec {
	one := intstr.FromInt32(1)
	alwaysAllow := policyv1.AlwaysAllow
	return policyv1.PodDisruptionBudgetSpec{
		Selector:                   &metav1.LabelSelector{MatchLabels: GrabSelector(a)},
		MaxUnavailable:             &one,
		UnhealthyPodEvictionPolicy: &alwaysAllow,
	}
}
