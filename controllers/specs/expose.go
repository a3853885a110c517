package specs

import (
	"fmt"
	"strings"
	"time"

	networkingv1 "k8s.io/api/networking/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	networkingv1ac "k8s.io/client-go/applyconfigurations/networking/v1"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"
	gatewayv1ac "sigs.k8s.io/gateway-api/applyconfiguration/apis/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc/grabapi"
)

// Exposure is what the public route or Ingress of one grab Service is made of: the
// object it belongs to (an activity or a budget) and its spec.expose.
type Exposure struct {
	// Name is the route's or Ingress's name, the grab Service's own (<name>-grab).
	Name, Namespace string
	// Service is the grab Service the traffic goes to, on its port 8080.
	Service string
	Labels  map[string]string
	Owner   *metav1ac.OwnerReferenceApplyConfiguration
	// Durability is the object's spec.durability; the wait for replicas it asks
	// for lengthens a grab, and so the route's timeouts.
	Durability *redpacketv1alpha1.Durability
	Expose     *redpacketv1alpha1.Expose
}

// ActivityExposure is the activity's exposure.
func ActivityExposure(a *redpacketv1alpha1.RedPacketActivity) Exposure {
	return Exposure{Name: GrabName(a), Namespace: a.Namespace, Service: GrabName(a), Labels: GrabLabels(a),
		Owner: grabOwner(a), Durability: a.Spec.Durability, Expose: a.Spec.Expose}
}

// BudgetExposure is the budget's exposure.
func BudgetExposure(b *redpacketv1alpha1.RedPacketBudget) Exposure {
	return Exposure{Name: BudgetGrabName(b), Namespace: b.Namespace, Service: BudgetGrabName(b), Labels: BudgetLabels(b),
		Owner: budgetOwner(b), Durability: b.Spec.Durability, Expose: b.Spec.Expose}
}

// ReplicaWait is how long a grant waits for replicas under d: the timeout of mode
// Replicas (grabapi.DefaultReplicaWait unless timeoutMilliseconds says), 0 otherwise.
func ReplicaWait(d *redpacketv1alpha1.Durability) time.Duration {
	if d == nil || d.Mode != redpacketv1alpha1.DurabilityReplicas {
		return 0
	}
	if d.TimeoutMilliseconds > 0 {
		return time.Duration(d.TimeoutMilliseconds) * time.Millisecond
	}
	return grabapi.DefaultReplicaWait
}

// RouteTimeoutMargin is what the route's timeouts add to the grab service's own
// deadline (grabapi.GrabDeadline): the time to send the answer back and the
// scheduling noise of a busy pod.
const RouteTimeoutMargin = time.Second

// RouteTimeout is the HTTPRoute's timeouts.request and timeouts.backendRequest for a
// grab service whose durability is d: grabapi.GrabDeadline of its wait for replicas
// plus RouteTimeoutMargin, rounded up to whole seconds. Invariant: it is longer than
// anything the grab service spends on a grab, so the gateway never answers 504 for a
// grab Redis may still grant; the grab service answers first, with the packet or
// with a 503 to retry. The route sets no retries, so request and backendRequest are
// equal. With the largest wait the API admits it is 13 s.
func RouteTimeout(d *redpacketv1alpha1.Durability) time.Duration {
	t := grabapi.GrabDeadline(ReplicaWait(d)) + RouteTimeoutMargin
	return (t + time.Second - 1) / time.Second * time.Second
}

// exposedPaths are what a public host reaches, relative to the path prefix: the rain
// page (exactly "/"), the grab API (/v1/), the packet pages (/p/) and the pages'
// content-hashed assets (/assets/). The grab service's /metrics, /healthz and
// /readyz are not among them: they stay inside the cluster.
var exposedPaths = []struct {
	path  string
	exact bool
}{
	{"/", true},
	{"/v1/", false},
	{"/p/", false},
	{"/assets/", false},
}

// RoutePrefix is the HTTPRoute's path prefix without a trailing slash ("" for "/").
func RoutePrefix(r *redpacketv1alpha1.HTTPRouteExpose) string {
	return strings.TrimRight(r.PathPrefix, "/")
}

// HTTPRoute is the route of e (which must have spec.expose.httpRoute): attached to
// the parentRefs, for the hostnames, one rule per exposed path under the prefix,
// each to the grab Service's port with RouteTimeout. Under a prefix other than "/",
// each rule rewrites the prefix away, so the grab service sees the paths it serves.
func HTTPRoute(e Exposure) *gatewayv1ac.HTTPRouteApplyConfiguration {
	r := e.Expose.HTTPRoute
	spec := gatewayv1ac.HTTPRouteSpec()
	for _, p := range r.ParentRefs {
		ref := gatewayv1ac.ParentReference().WithName(gatewayv1.ObjectName(p.Name))
		if p.Namespace != "" {
			ref.WithNamespace(gatewayv1.Namespace(p.Namespace))
		}
		if p.SectionName != "" {
			ref.WithSectionName(gatewayv1.SectionName(p.SectionName))
		}
		spec.WithParentRefs(ref)
	}
	for _, h := range r.Hostnames {
		spec.WithHostnames(gatewayv1.Hostname(h))
	}
	timeout := gatewayv1.Duration(formatRouteDuration(RouteTimeout(e.Durability)))
	prefix := RoutePrefix(r)
	for _, p := range exposedPaths {
		match := gatewayv1ac.HTTPPathMatch().WithValue(prefix + p.path)
		modifier := gatewayv1ac.HTTPPathModifier()
		if p.exact {
			match.WithType(gatewayv1.PathMatchExact)
			modifier.WithType(gatewayv1.FullPathHTTPPathModifier).WithReplaceFullPath(p.path)
		} else {
			match.WithType(gatewayv1.PathMatchPathPrefix)
			modifier.WithType(gatewayv1.PrefixMatchHTTPPathModifier).WithReplacePrefixMatch(p.path)
		}
		rule := gatewayv1ac.HTTPRouteRule().
			WithMatches(gatewayv1ac.HTTPRouteMatch().WithPath(match)).
			WithBackendRefs(gatewayv1ac.HTTPBackendRef().WithName(gatewayv1.ObjectName(e.Service)).WithPort(grabPort)).
			WithTimeouts(gatewayv1ac.HTTPRouteTimeouts().WithRequest(timeout).WithBackendRequest(timeout))
		if prefix != "" {
			rule.WithFilters(gatewayv1ac.HTTPRouteFilter().WithType(gatewayv1.HTTPRouteFilterURLRewrite).
				WithURLRewrite(gatewayv1ac.HTTPURLRewriteFilter().WithPath(modifier)))
		}
		spec.WithRules(rule)
	}
	return gatewayv1ac.HTTPRoute(e.Name, e.Namespace).WithLabels(e.Labels).WithOwnerReferences(e.Owner).WithSpec(spec)
}

// formatRouteDuration writes d in the Gateway API's duration format (GEP-2257): whole
// seconds, or milliseconds when d is not a whole number of seconds.
func formatRouteDuration(d time.Duration) string {
	if d%time.Second == 0 {
		return fmt.Sprintf("%ds", d/time.Second)
	}
	return fmt.Sprintf("%dms", (d+time.Millisecond-1)/time.Millisecond)
}

// Ingress is the Ingress of e (which must have spec.expose.ingress): the class, the
// host with its TLS Secret when one is named, the annotations as they are, and one
// path per exposed path (the page exactly, the rest by prefix) to the grab Service's
// port. An Ingress has no portable timeout; the controller's own, set through
// annotations, must be at least RouteTimeout (docs/operations.md).
func Ingress(e Exposure) *networkingv1ac.IngressApplyConfiguration {
	in := e.Expose.Ingress
	rule := networkingv1ac.HTTPIngressRuleValue()
	for _, p := range exposedPaths {
		pathType := networkingv1.PathTypePrefix
		path := strings.TrimSuffix(p.path, "/")
		if p.exact {
			pathType, path = networkingv1.PathTypeExact, p.path
		}
		rule.WithPaths(networkingv1ac.HTTPIngressPath().WithPath(path).WithPathType(pathType).
			WithBackend(networkingv1ac.IngressBackend().WithService(networkingv1ac.IngressServiceBackend().
				WithName(e.Service).WithPort(networkingv1ac.ServiceBackendPort().WithNumber(grabPort)))))
	}
	spec := networkingv1ac.IngressSpec().WithRules(networkingv1ac.IngressRule().WithHost(in.Host).WithHTTP(rule))
	if in.ClassName != "" {
		spec.WithIngressClassName(in.ClassName)
	}
	if in.TLSSecretName != "" {
		spec.WithTLS(networkingv1ac.IngressTLS().WithHosts(in.Host).WithSecretName(in.TLSSecretName))
	}
	obj := networkingv1ac.Ingress(e.Name, e.Namespace).WithLabels(e.Labels).WithOwnerReferences(e.Owner).WithSpec(spec)
	if len(in.Annotations) > 0 {
		obj.WithAnnotations(in.Annotations)
	}
	return obj
}

// IngressURL is the public URL of an Ingress exposure: https with a TLS Secret, http
// without.
func IngressURL(in *redpacketv1alpha1.IngressExpose) string {
	scheme := "http"
	if in.TLSSecretName != "" {
		scheme = "https"
	}
	return scheme + "://" + in.Host + "/"
}

// RouteURL is the public URL of an HTTPRoute exposure served over https or not, at
// host (the route's first hostname without a wildcard, else one the caller found on
// the Gateway's listener); "" when there is no such host.
func RouteURL(r *redpacketv1alpha1.HTTPRouteExpose, host string, https bool) string {
	if host == "" {
		return ""
	}
	scheme := "http"
	if https {
		scheme = "https"
	}
	return scheme + "://" + host + RoutePrefix(r) + "/"
}

// RouteHost is the route's first hostname that names one host (no wildcard), or "".
func RouteHost(r *redpacketv1alpha1.HTTPRouteExpose) string {
	for _, h := range r.Hostnames {
		if !strings.HasPrefix(h, "*.") {
			return h
		}
	}
	return ""
}
