package controllers_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/gatewaytest"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// gatewayEnv is a test's world on a control plane of its own with the Gateway API
// installed: the package's shared control plane has none, which the
// GatewayAPIMissing test relies on. A second API server costs about 10 s.
func gatewayEnv(t *testing.T) *env {
	t.Helper()
	needsServers(t)
	gcp := controlplane.Start(t)
	gatewaytest.InstallCRDs(t, gcp.Config)
	srv := redistest.Start(t)
	e := &env{t: t, ns: gcp.Namespace(t), redis: srv, rdb: srv.Client(t), c: gcp.Client, cfg: gcp.Config}
	e.createSettlementKeys()
	return e
}

// gateway creates the platform's Gateway name in ns with one listener of protocol
// (HTTPS with a certificate Secret reference, or HTTP).
func (e *env) gateway(ns, name string, protocol gatewayv1.ProtocolType) {
	e.t.Helper()
	ctx := context.Background()
	if err := e.c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil && !apierrors.IsAlreadyExists(err) {
		e.t.Fatalf("creating namespace %s: %v", ns, err)
	}
	l := gatewayv1.Listener{Name: "web", Protocol: protocol, Port: 443}
	if protocol == gatewayv1.HTTPSProtocolType {
		mode := gatewayv1.TLSModeTerminate
		l.TLS = &gatewayv1.ListenerTLSConfig{Mode: &mode, CertificateRefs: []gatewayv1.SecretObjectReference{{Name: "edge-cert"}}}
	} else {
		l.Port = 80
	}
	gw := &gatewayv1.Gateway{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: gatewayv1.GatewaySpec{GatewayClassName: "platform", Listeners: []gatewayv1.Listener{l}}}
	if err := e.c.Create(ctx, gw); err != nil {
		e.t.Fatalf("creating Gateway %s/%s: %v", ns, name, err)
	}
}

// routeExpose is an httpRoute expose to the Gateway gateways/<gw>.
func routeExpose(gw string, hostnames ...string) *redpacketv1alpha1.Expose {
	return &redpacketv1alpha1.Expose{HTTPRoute: &redpacketv1alpha1.HTTPRouteExpose{
		ParentRefs: []redpacketv1alpha1.ParentReference{{Name: gw, Namespace: "gateways"}}, Hostnames: hostnames}}
}

// waitRoute waits until the HTTPRoute name exists, and returns it.
func (e *env) waitRoute(name string) *gatewayv1.HTTPRoute {
	e.t.Helper()
	r := &gatewayv1.HTTPRoute{}
	wait.Until(e.t, 30*time.Second, "HTTPRoute "+name, func() (bool, string) {
		err := e.c.Get(context.Background(), client.ObjectKey{Namespace: e.ns, Name: name}, r)
		return err == nil, fmt.Sprint(err)
	})
	return r
}

// waitGone waits until obj of name is deleted.
func (e *env) waitGone(name string, obj client.Object) {
	e.t.Helper()
	wait.Until(e.t, 30*time.Second, fmt.Sprintf("%T %s deleted", obj, name), func() (bool, string) {
		err := e.c.Get(context.Background(), client.ObjectKey{Namespace: e.ns, Name: name}, obj)
		return apierrors.IsNotFound(err), fmt.Sprint(err)
	})
}

// reportRoute writes the route's status as a gateway controller does: one parent,
// gateways/<gw>, with Accepted and ResolvedRefs for the route's generation.
func (e *env) reportRoute(name, gw string, accepted metav1.ConditionStatus, reason, message string) {
	e.t.Helper()
	r := e.waitRoute(name)
	ns := gatewayv1.Namespace("gateways")
	now := metav1.Now()
	r.Status.Parents = []gatewayv1.RouteParentStatus{{
		ParentRef:      gatewayv1.ParentReference{Name: gatewayv1.ObjectName(gw), Namespace: &ns},
		ControllerName: "example.com/gateway-controller",
		Conditions: []metav1.Condition{
			{Type: "Accepted", Status: accepted, Reason: reason, Message: message, ObservedGeneration: r.Generation, LastTransitionTime: now},
			{Type: "ResolvedRefs", Status: metav1.ConditionTrue, Reason: "ResolvedRefs", Message: "backend resolved", ObservedGeneration: r.Generation, LastTransitionTime: now},
		},
	}}
	if err := e.c.Status().Update(context.Background(), r); err != nil {
		e.t.Fatalf("writing HTTPRoute %s's status: %v", name, err)
	}
}

// waitBudgetExposed waits until the budget's Exposed condition has status and
// reason for its generation.
func (e *env) waitBudgetExposed(name string, status metav1.ConditionStatus, reason string) *redpacketv1alpha1.RedPacketBudget {
	e.t.Helper()
	return e.waitRedPacketBudget(name, fmt.Sprintf("Exposed=%s/%s", status, reason), 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionExposed)
		return c != nil && c.Status == status && c.Reason == reason && c.ObservedGeneration == b.Generation
	})
}

// An activity and a budget with spec.expose.httpRoute, on an API server with the
// Gateway API: each gets an HTTPRoute attached to the named Gateway, to its grab
// Service's port, with the timeouts derived from the grab service's deadline.
// Exposed follows what the parent reports (Unknown before, True once accepted with
// its refs resolved, False with the parent's reason when refused), status.url is
// https for an HTTPS listener and http for a plain one, and removing spec.expose
// deletes the route and the condition.
func TestExposeThroughAGatewayRoute(t *testing.T) {
	e := gatewayEnv(t)
	e.gateway("gateways", "edge", gatewayv1.HTTPSProtocolType)
	e.gateway("gateways", "plain", gatewayv1.HTTPProtocolType)
	e.startController(nil)
	e.startBudgetController(e.recordingSettlement())

	a := e.create(e.activity("rain", 10_000, 100, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Expose = routeExpose("edge", "rain.example.com")
	}))
	route := e.waitRoute("rain-grab")
	if !metav1.IsControlledBy(route, a) {
		t.Errorf("route owners %+v, want the activity", route.OwnerReferences)
	}
	if p := route.Spec.ParentRefs; len(p) != 1 || p[0].Name != "edge" || p[0].Namespace == nil || *p[0].Namespace != "gateways" {
		t.Errorf("parentRefs %+v, want gateways/edge", p)
	}
	if h := route.Spec.Hostnames; len(h) != 1 || h[0] != "rain.example.com" {
		t.Errorf("hostnames %v", h)
	}
	var paths []string
	for _, rule := range route.Spec.Rules {
		paths = append(paths, *rule.Matches[0].Path.Value)
		if b := rule.BackendRefs; len(b) != 1 || b[0].Name != "rain-grab" || b[0].Port == nil || *b[0].Port != 8080 {
			t.Errorf("backendRefs %+v, want rain-grab:8080", b)
		}
		// 0.5 s Redis + 1 s resolve + 1 s margin, in whole seconds (the durability's
		// wait for replicas adds to it: TestRouteTimeoutCoversTheGrabDeadline).
		if rule.Timeouts == nil || *rule.Timeouts.Request != "3s" || *rule.Timeouts.BackendRequest != "3s" {
			t.Errorf("timeouts %+v, want 3s and 3s", rule.Timeouts)
		}
	}
	if want := "/ /v1/ /p/ /assets/"; strings.Join(paths, " ") != want {
		t.Errorf("paths %v, want %s", paths, want)
	}
	e.waitCondition("rain", redpacketv1alpha1.ConditionExposed, metav1.ConditionUnknown, redpacketv1alpha1.ReasonRoutePending, 30*time.Second)

	e.reportRoute("rain-grab", "edge", metav1.ConditionTrue, "Accepted", "accepted")
	a = e.waitCondition("rain", redpacketv1alpha1.ConditionExposed, metav1.ConditionTrue, redpacketv1alpha1.ReasonRouteAccepted, 30*time.Second)
	if a.Status.URL != "https://rain.example.com/" {
		t.Errorf("status.url %q, want https://rain.example.com/", a.Status.URL)
	}
	if !strings.HasSuffix(a.Status.Endpoint, ".svc:8080") {
		t.Errorf("status.endpoint %q: the in-cluster endpoint stays", a.Status.Endpoint)
	}

	e.reportRoute("rain-grab", "edge", metav1.ConditionFalse, "NotAllowedByListeners", "no listener allows routes from this namespace")
	a = e.waitCondition("rain", redpacketv1alpha1.ConditionExposed, metav1.ConditionFalse, "NotAllowedByListeners", 30*time.Second)
	if c := meta.FindStatusCondition(a.Status.Conditions, redpacketv1alpha1.ConditionExposed); !strings.Contains(c.Message, "no listener allows routes") ||
		!strings.Contains(c.Message, "gateways/edge") {
		t.Errorf("Exposed message %q lacks the parent and its message", c.Message)
	}

	// The budget, on a Gateway whose only listener is plain HTTP.
	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "orders"},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{Total: 100_000, BudgetShards: 2,
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 1000, MaxCount: 10},
			Expose:  routeExpose("plain", "orders.example.com")},
	}
	if err := e.c.Create(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	broute := e.waitRoute("orders-grab")
	if !metav1.IsControlledBy(broute, b) || broute.Spec.Rules[0].BackendRefs[0].Name != "orders-grab" {
		t.Errorf("budget route owners %+v, backend %+v", broute.OwnerReferences, broute.Spec.Rules[0].BackendRefs)
	}
	if got := *broute.Spec.Rules[0].Timeouts.Request; got != "3s" {
		t.Errorf("budget route timeout %s, want 3s", got)
	}
	e.reportRoute("orders-grab", "plain", metav1.ConditionTrue, "Accepted", "accepted")
	b = e.waitBudgetExposed("orders", metav1.ConditionTrue, redpacketv1alpha1.ReasonRouteAccepted)
	if b.Status.URL != "http://orders.example.com/" {
		t.Errorf("budget status.url %q, want http://orders.example.com/ (the Gateway's listener is HTTP)", b.Status.URL)
	}

	// Removing spec.expose deletes the routes, the condition and the URL.
	e.patch("rain", func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Expose = nil })
	e.waitGone("rain-grab", &gatewayv1.HTTPRoute{})
	wait.Until(t, 30*time.Second, "rain without Exposed and url", func() (bool, string) {
		a := e.get("rain")
		return meta.FindStatusCondition(a.Status.Conditions, redpacketv1alpha1.ConditionExposed) == nil && a.Status.URL == "", describe(a)
	})
	e.patchBudget("orders", func(b *redpacketv1alpha1.RedPacketBudget) { b.Spec.Expose = nil })
	e.waitGone("orders-grab", &gatewayv1.HTTPRoute{})
	e.waitRedPacketBudget("orders", "no Exposed, no url", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionExposed) == nil && b.Status.URL == ""
	})
}

// Where the Gateway API is not installed (the shared control plane), the manager
// starts, an activity with spec.expose.httpRoute gets Exposed=False
// GatewayAPIMissing while everything else goes on (it is seeded), and it stays so:
// no error, no ExposeFailed (discovery is asked at most once per recheck period:
// TestGatewayAPIDiscoveryIsRecheckedNotHammered).
func TestExposeWithoutTheGatewayAPI(t *testing.T) {
	e := newEnv(t)
	e.startController(nil)
	e.create(e.activity("nogw", 10_000, 100, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Expose = routeExpose("edge", "rain.example.com")
	}))
	a := e.waitCondition("nogw", redpacketv1alpha1.ConditionExposed, metav1.ConditionFalse, redpacketv1alpha1.ReasonGatewayAPIMissing, 30*time.Second)
	c := meta.FindStatusCondition(a.Status.Conditions, redpacketv1alpha1.ConditionExposed)
	if !strings.Contains(c.Message, "gateway.networking.k8s.io/v1") || !strings.Contains(c.Message, "spec.expose.ingress") {
		t.Errorf("message %q does not say what is missing and what to do", c.Message)
	}
	e.waitCondition("nogw", redpacketv1alpha1.ConditionSeeded, metav1.ConditionTrue, redpacketv1alpha1.ReasonCommitted, 30*time.Second)
	if a.Status.URL != "" {
		t.Errorf("status.url %q without a route, want none", a.Status.URL)
	}
	consistently(t, 2*time.Second, "Exposed stays GatewayAPIMissing", func() (bool, string) {
		c := meta.FindStatusCondition(e.get("nogw").Status.Conditions, redpacketv1alpha1.ConditionExposed)
		return c != nil && c.Status == metav1.ConditionFalse && c.Reason == redpacketv1alpha1.ReasonGatewayAPIMissing, fmt.Sprintf("%+v", c)
	})
}

// An activity with spec.expose.ingress gets an Ingress of its own (class, host, TLS
// Secret, annotations as given); Exposed turns True with the load balancer's
// address once the Ingress controller writes it, status.url is https. Switching to
// httpRoute deletes the Ingress (here without the Gateway API: GatewayAPIMissing),
// and an Ingress of the name that is not the activity's is never taken over.
func TestExposeThroughAnIngress(t *testing.T) {
	e := newEnv(t)
	e.startController(nil)
	e.create(e.activity("door", 10_000, 100, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Expose = &redpacketv1alpha1.Expose{Ingress: &redpacketv1alpha1.IngressExpose{
			ClassName: "traefik", Host: "door.example.com", TLSSecretName: "door-tls",
			Annotations: map[string]string{"cert-manager.io/cluster-issuer": "letsencrypt"}}}
	}))
	a := e.waitCondition("door", redpacketv1alpha1.ConditionExposed, metav1.ConditionUnknown, redpacketv1alpha1.ReasonAddressPending, 30*time.Second)
	if a.Status.URL != "https://door.example.com/" {
		t.Errorf("status.url %q, want https://door.example.com/", a.Status.URL)
	}
	ctx := context.Background()
	in := &networkingv1.Ingress{}
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "door-grab"}, in); err != nil {
		t.Fatal(err)
	}
	if !metav1.IsControlledBy(in, a) || in.Spec.IngressClassName == nil || *in.Spec.IngressClassName != "traefik" ||
		in.Annotations["cert-manager.io/cluster-issuer"] != "letsencrypt" ||
		len(in.Spec.TLS) != 1 || in.Spec.TLS[0].SecretName != "door-tls" || in.Spec.TLS[0].Hosts[0] != "door.example.com" ||
		in.Spec.Rules[0].Host != "door.example.com" || in.Spec.Rules[0].HTTP.Paths[0].Backend.Service.Name != "door-grab" {
		t.Errorf("Ingress %+v", in)
	}
	in.Status.LoadBalancer.Ingress = []networkingv1.IngressLoadBalancerIngress{{IP: "203.0.113.7"}}
	if err := e.c.Status().Update(ctx, in); err != nil {
		t.Fatalf("writing the Ingress's load balancer address: %v", err)
	}
	a = e.waitCondition("door", redpacketv1alpha1.ConditionExposed, metav1.ConditionTrue, redpacketv1alpha1.ReasonAddressAssigned, 30*time.Second)
	if c := meta.FindStatusCondition(a.Status.Conditions, redpacketv1alpha1.ConditionExposed); !strings.Contains(c.Message, "203.0.113.7") {
		t.Errorf("Exposed message %q lacks the address", c.Message)
	}

	e.patch("door", func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Expose = routeExpose("edge") })
	e.waitGone("door-grab", &networkingv1.Ingress{})
	e.waitCondition("door", redpacketv1alpha1.ConditionExposed, metav1.ConditionFalse, redpacketv1alpha1.ReasonGatewayAPIMissing, 30*time.Second)

	// Another's Ingress of the name is left alone.
	foreign := &networkingv1.Ingress{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "taken-grab"},
		Spec: networkingv1.IngressSpec{DefaultBackend: &networkingv1.IngressBackend{Service: &networkingv1.IngressServiceBackend{
			Name: "other", Port: networkingv1.ServiceBackendPort{Number: 80}}}}}
	if err := e.c.Create(ctx, foreign); err != nil {
		t.Fatal(err)
	}
	e.create(e.activity("taken", 10_000, 100, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Expose = &redpacketv1alpha1.Expose{Ingress: &redpacketv1alpha1.IngressExpose{Host: "taken.example.com"}}
	}))
	e.waitCondition("taken", redpacketv1alpha1.ConditionExposed, metav1.ConditionFalse, redpacketv1alpha1.ReasonNotAdopted, 30*time.Second)
	if err := e.c.Get(ctx, client.ObjectKeyFromObject(foreign), foreign); err != nil || foreign.Spec.DefaultBackend.Service.Name != "other" || len(foreign.OwnerReferences) != 0 {
		t.Errorf("the foreign Ingress was touched: %+v, %v", foreign, err)
	}
}

// The Gateway API installed while the operator runs: an activity waiting with
// GatewayAPIMissing gets its route once discovery is asked again (every
// GatewayAPIRecheckPeriod, here 500 ms), through the same manager, whose REST
// mapping learns the new kind; without a watch on routes (there was none at start)
// the route's acceptance is read on the requeue.
func TestExposeOnceTheGatewayAPIIsInstalledLater(t *testing.T) {
	needsServers(t)
	gcp := controlplane.Start(t)
	srv := redistest.Start(t)
	e := &env{t: t, ns: gcp.Namespace(t), redis: srv, rdb: srv.Client(t), c: gcp.Client, cfg: gcp.Config}
	e.createSettlementKeys()
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Options.GatewayAPIRecheckPeriod = 500 * time.Millisecond
	})
	e.create(e.activity("later", 10_000, 100, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Expose = routeExpose("edge", "later.example.com")
	}))
	e.waitCondition("later", redpacketv1alpha1.ConditionExposed, metav1.ConditionFalse, redpacketv1alpha1.ReasonGatewayAPIMissing, 30*time.Second)

	gatewaytest.InstallCRDs(t, gcp.Config)
	e.gateway("gateways", "edge", gatewayv1.HTTPSProtocolType)
	e.waitRoute("later-grab")
	e.waitCondition("later", redpacketv1alpha1.ConditionExposed, metav1.ConditionUnknown, redpacketv1alpha1.ReasonRoutePending, 30*time.Second)
	e.reportRoute("later-grab", "edge", metav1.ConditionTrue, "Accepted", "accepted")
	a := e.waitCondition("later", redpacketv1alpha1.ConditionExposed, metav1.ConditionTrue, redpacketv1alpha1.ReasonRouteAccepted, 30*time.Second)
	if a.Status.URL != "https://later.example.com/" {
		t.Errorf("status.url %q", a.Status.URL)
	}
}
