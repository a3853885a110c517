package controllers

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
)

// +kubebuilder:rbac:groups=gateway.networking.k8s.io,resources=httproutes,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=gateway.networking.k8s.io,resources=gateways,verbs=get;list;watch
// +kubebuilder:rbac:groups=networking.k8s.io,resources=ingresses,verbs=get;list;watch;create;update;patch;delete

// ExposeFieldManager is the field manager of the routes and Ingresses of spec.expose.
const ExposeFieldManager = "redpacket-controller-expose"

// DefaultGatewayAPIRecheckPeriod is how long the answer "the Gateway API is not
// installed" is trusted by default (Options.GatewayAPIRecheckPeriod): a reconcile
// after it asks discovery again, and an object whose route waits for the API is
// looked at again this often, so installing the CRDs later is noticed without a
// restart and without an error backoff.
const DefaultGatewayAPIRecheckPeriod = 30 * time.Second

// exposeRecheckPeriod is how often an object whose route or Ingress is not accepted
// yet is looked at again, where no watch on routes brings their status changes.
const exposeRecheckPeriod = 10 * time.Second

// gatewayAPIGroupVersion is what discovery must serve, with its httproutes, for the
// operator to make HTTPRoutes.
var gatewayAPIGroupVersion = gatewayv1.GroupVersion.String()

// gatewayAPI tells whether the cluster serves gateway.networking.k8s.io/v1
// HTTPRoutes, asking discovery at most once per recheck period while the answer is
// no, and again after forget (an apply that found the kind gone). It is safe for
// concurrent reconciles.
type gatewayAPI struct {
	discovery discovery.DiscoveryInterface
	recheck   time.Duration

	mu        sync.Mutex
	known     bool
	present   bool
	checkedAt time.Time
}

// newGatewayAPI asks d, believing an absent Gateway API for recheck.
func newGatewayAPI(d discovery.DiscoveryInterface, recheck time.Duration) *gatewayAPI {
	return &gatewayAPI{discovery: d, recheck: recheck}
}

// installed reports whether HTTPRoutes are served, as of now or of a recent look. An
// error is discovery's own failure (not "absent"); nothing is cached then.
func (g *gatewayAPI) installed(now time.Time) (bool, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.known && (g.present || now.Sub(g.checkedAt) < g.recheck) {
		return g.present, nil
	}
	if g.discovery == nil {
		return false, nil
	}
	present, err := servesHTTPRoutes(g.discovery)
	if err != nil {
		return false, err
	}
	g.known, g.present, g.checkedAt = true, present, now
	return present, nil
}

// forget drops what is known, so the next question asks discovery.
func (g *gatewayAPI) forget() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.known = false
}

// servesHTTPRoutes asks discovery whether gateway.networking.k8s.io/v1 has
// httproutes.
func servesHTTPRoutes(d discovery.DiscoveryInterface) (bool, error) {
	list, err := d.ServerResourcesForGroupVersion(gatewayAPIGroupVersion)
	if err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("asking discovery for %s: %w", gatewayAPIGroupVersion, err)
	}
	for _, r := range list.APIResources {
		if r.Name == "httproutes" {
			return true, nil
		}
	}
	return false, nil
}

// exposer keeps the route or Ingress of one object's spec.expose, for either kind.
type exposer struct {
	client client.Client
	// reader reads routes and Gateways from the API server: the cache holds no
	// Gateway, and no route where the Gateway API was missing at start.
	reader  client.Reader
	gateway *gatewayAPI
}

// exposeResult is what keeping an exposure found: the Exposed condition (nil: none,
// spec.expose is absent), status.url, and when to look again.
type exposeResult struct {
	condition    *metav1.Condition
	url          string
	requeueAfter time.Duration
}

// exposedCondition is an Exposed condition with a formatted message; the scope adds
// the generation and the time when it sets it.
func exposedCondition(status metav1.ConditionStatus, reason, format string, args ...any) *metav1.Condition {
	return &metav1.Condition{Type: redpacketv1alpha1.ConditionExposed, Status: status, Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// keep makes the cluster hold what e's spec.expose asks: it deletes the owner's
// route or Ingress that spec.expose no longer asks for (expose removed, or switched
// kind), then applies the one it asks for and reads its status. An error is
// returned with the result that describes it (Exposed False, ExposeFailed); a
// missing Gateway API is no error (GatewayAPIMissing, looked at again later).
//
// wasExposed says that the owner's status on the API server has an Exposed
// condition, which the operator sets whenever it keeps an exposure and removes only
// once it deleted it: only then is an HTTPRoute looked up for deletion, so an object
// that never asked for an exposure costs no API call. The Ingress is looked up in
// the cache, which holds the operator's own.
func (x *exposer) keep(ctx context.Context, e specs.Exposure, owner metav1.Object, wasExposed bool, now time.Time) (exposeResult, error) {
	wantRoute := e.Expose != nil && e.Expose.HTTPRoute != nil
	wantIngress := e.Expose != nil && e.Expose.Ingress != nil
	key := client.ObjectKey{Namespace: e.Namespace, Name: e.Name}
	if !wantIngress {
		if err := x.deleteOwned(ctx, x.client, key, &networkingv1.Ingress{}, owner); err != nil {
			return failedExposure(err)
		}
	}
	if !wantRoute && wasExposed {
		installed, err := x.gateway.installed(now)
		if err != nil {
			return failedExposure(err)
		}
		if installed {
			if err := x.deleteOwned(ctx, x.reader, key, &gatewayv1.HTTPRoute{}, owner); err != nil {
				return failedExposure(err)
			}
		}
	}
	switch {
	case wantRoute:
		return x.keepRoute(ctx, e, owner, now)
	case wantIngress:
		return x.keepIngress(ctx, e, owner)
	}
	return exposeResult{}, nil
}

// failedExposure is the result and error of an exposure that could not be kept:
// Exposed False, ExposeFailed, with err's text.
func failedExposure(err error) (exposeResult, error) {
	return exposeResult{condition: exposedCondition(metav1.ConditionFalse, redpacketv1alpha1.ReasonExposeFailed, "%v", err)}, err
}

// deleteOwned deletes the object of key, as read through reader, when the owner
// controls it; another's is left alone.
func (x *exposer) deleteOwned(ctx context.Context, reader client.Reader, key client.ObjectKey, obj client.Object, owner metav1.Object) error {
	if err := reader.Get(ctx, key, obj); err != nil {
		if apierrors.IsNotFound(err) || meta.IsNoMatchError(err) {
			return nil
		}
		return fmt.Errorf("looking up %T %s: %w", obj, key.Name, err)
	}
	if !metav1.IsControlledBy(obj, owner) {
		return nil
	}
	if err := x.client.Delete(ctx, obj, client.Preconditions{UID: ptr.To(obj.GetUID())}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting %T %s that spec.expose no longer asks for: %w", obj, key.Name, err)
	}
	return nil
}

// notOwned returns an Exposed False NotAdopted result when an object of key exists
// and the owner does not control it; nil otherwise.
func (x *exposer) notOwned(ctx context.Context, key client.ObjectKey, obj client.Object, kind string, owner metav1.Object) (*exposeResult, error) {
	if err := x.reader.Get(ctx, key, obj); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		return nil, fmt.Errorf("looking up %s %s: %w", kind, key.Name, err)
	}
	if metav1.IsControlledBy(obj, owner) {
		return nil, nil
	}
	return &exposeResult{condition: exposedCondition(metav1.ConditionFalse, redpacketv1alpha1.ReasonNotAdopted,
		"%s %s already exists and is not controlled by this object; not adopting it (delete or rename it)", kind, key.Name)}, nil
}

// keepRoute applies the HTTPRoute and reads what its parents say of it.
func (x *exposer) keepRoute(ctx context.Context, e specs.Exposure, owner metav1.Object, now time.Time) (exposeResult, error) {
	installed, err := x.gateway.installed(now)
	if err != nil {
		return failedExposure(err)
	}
	if !installed {
		return exposeResult{
			condition: exposedCondition(metav1.ConditionFalse, redpacketv1alpha1.ReasonGatewayAPIMissing,
				"spec.expose.httpRoute needs the Gateway API, and this cluster serves no %s HTTPRoute: install the Gateway API's standard CRDs (and a Gateway), or use spec.expose.ingress; the operator looks again every %v",
				gatewayAPIGroupVersion, x.gateway.recheck),
			requeueAfter: x.gateway.recheck,
		}, nil
	}
	key := client.ObjectKey{Namespace: e.Namespace, Name: e.Name}
	if res, err := x.notOwned(ctx, key, &gatewayv1.HTTPRoute{}, "HTTPRoute", owner); res != nil || err != nil {
		if err != nil {
			return x.routeFailed(err)
		}
		return *res, nil
	}
	if err := x.client.Apply(ctx, specs.HTTPRoute(e), client.FieldOwner(ExposeFieldManager), client.ForceOwnership); err != nil {
		return x.routeFailed(fmt.Errorf("applying HTTPRoute %s: %w", e.Name, err))
	}
	route := &gatewayv1.HTTPRoute{}
	if err := x.reader.Get(ctx, key, route); err != nil {
		return x.routeFailed(fmt.Errorf("reading HTTPRoute %s: %w", e.Name, err))
	}
	https, listenerHost := x.gatewayListener(ctx, route)
	host := specs.RouteHost(e.Expose.HTTPRoute)
	if host == "" {
		host = listenerHost
	}
	res := exposeResult{condition: routeCondition(route), url: specs.RouteURL(e.Expose.HTTPRoute, host, https)}
	if res.condition.Status != metav1.ConditionTrue {
		res.requeueAfter = exposeRecheckPeriod
	}
	return res, nil
}

// routeFailed is failedExposure, and forgets whether the Gateway API is installed
// when err says the kind is gone: the next reconcile asks discovery again.
func (x *exposer) routeFailed(err error) (exposeResult, error) {
	if meta.IsNoMatchError(err) || apierrors.IsNotFound(err) {
		x.gateway.forget()
	}
	return failedExposure(err)
}

// routeCondition is Exposed as the route's parents report it, for the route's
// current generation: False with the first refusing parent's reason and message
// (Accepted or ResolvedRefs False), True once every parentRef has Accepted and
// ResolvedRefs True, Unknown while a parent has not reported.
func routeCondition(route *gatewayv1.HTTPRoute) *metav1.Condition {
	var pending []string
	for _, ref := range route.Spec.ParentRefs {
		name := parentName(ref, route.Namespace)
		st := parentStatus(route, ref)
		if st == nil {
			pending = append(pending, name)
			continue
		}
		reported := 0
		for _, t := range []string{string(gatewayv1.RouteConditionAccepted), string(gatewayv1.RouteConditionResolvedRefs)} {
			c := meta.FindStatusCondition(st.Conditions, t)
			if c == nil || c.ObservedGeneration < route.Generation {
				continue
			}
			if c.Status == metav1.ConditionFalse {
				return exposedCondition(metav1.ConditionFalse, c.Reason, "Gateway %s: %s %s: %s", name, t, c.Reason, c.Message)
			}
			if c.Status == metav1.ConditionTrue {
				reported++
			}
		}
		if reported < 2 {
			pending = append(pending, name)
		}
	}
	if len(pending) > 0 {
		return exposedCondition(metav1.ConditionUnknown, redpacketv1alpha1.ReasonRoutePending,
			"HTTPRoute %s is applied; waiting for Gateway %s to accept it and resolve its backend", route.Name, strings.Join(pending, ", "))
	}
	return exposedCondition(metav1.ConditionTrue, redpacketv1alpha1.ReasonRouteAccepted,
		"HTTPRoute %s is accepted by every parent Gateway and its backend resolves", route.Name)
}

// parentName is ref as namespace/name[/section].
func parentName(ref gatewayv1.ParentReference, routeNamespace string) string {
	ns := routeNamespace
	if ref.Namespace != nil {
		ns = string(*ref.Namespace)
	}
	name := ns + "/" + string(ref.Name)
	if ref.SectionName != nil {
		name += "/" + string(*ref.SectionName)
	}
	return name
}

// parentStatus is the route's status entry for ref, matched by name, namespace and
// section (a namespace left out is the route's); nil when none reported.
func parentStatus(route *gatewayv1.HTTPRoute, ref gatewayv1.ParentReference) *gatewayv1.RouteParentStatus {
	want := parentName(ref, route.Namespace)
	for i := range route.Status.Parents {
		p := &route.Status.Parents[i]
		if parentName(p.ParentRef, route.Namespace) == want {
			return p
		}
	}
	return nil
}

// gatewayListener reads the route's first parent Gateway and tells whether its
// listeners the route attaches to serve HTTPS, and a hostname one of them names
// (no wildcard). A Gateway that cannot be read counts as HTTPS (the public default),
// with no hostname.
func (x *exposer) gatewayListener(ctx context.Context, route *gatewayv1.HTTPRoute) (https bool, host string) {
	if len(route.Spec.ParentRefs) == 0 {
		return true, ""
	}
	ref := route.Spec.ParentRefs[0]
	ns := route.Namespace
	if ref.Namespace != nil {
		ns = string(*ref.Namespace)
	}
	gw := &gatewayv1.Gateway{}
	if err := x.reader.Get(ctx, client.ObjectKey{Namespace: ns, Name: string(ref.Name)}, gw); err != nil {
		return true, ""
	}
	sawHTTP := false
	for _, l := range gw.Spec.Listeners {
		if ref.SectionName != nil && l.Name != *ref.SectionName {
			continue
		}
		switch l.Protocol {
		case gatewayv1.HTTPSProtocolType:
			https = true
		case gatewayv1.HTTPProtocolType:
			sawHTTP = true
		}
		if host == "" && l.Hostname != nil && !strings.HasPrefix(string(*l.Hostname), "*") {
			host = string(*l.Hostname)
		}
	}
	return https || !sawHTTP, host
}

// keepIngress applies the Ingress and reads its load balancer's address.
func (x *exposer) keepIngress(ctx context.Context, e specs.Exposure, owner metav1.Object) (exposeResult, error) {
	key := client.ObjectKey{Namespace: e.Namespace, Name: e.Name}
	if res, err := x.notOwned(ctx, key, &networkingv1.Ingress{}, "Ingress", owner); res != nil || err != nil {
		if err != nil {
			return failedExposure(err)
		}
		return *res, nil
	}
	if err := x.client.Apply(ctx, specs.Ingress(e), client.FieldOwner(ExposeFieldManager), client.ForceOwnership); err != nil {
		return failedExposure(fmt.Errorf("applying Ingress %s: %w", e.Name, err))
	}
	in := &networkingv1.Ingress{}
	if err := x.reader.Get(ctx, key, in); err != nil {
		return failedExposure(fmt.Errorf("reading Ingress %s: %w", e.Name, err))
	}
	res := exposeResult{url: specs.IngressURL(e.Expose.Ingress)}
	var addresses []string
	for _, lb := range in.Status.LoadBalancer.Ingress {
		if lb.IP != "" {
			addresses = append(addresses, lb.IP)
		} else if lb.Hostname != "" {
			addresses = append(addresses, lb.Hostname)
		}
	}
	if len(addresses) == 0 {
		res.condition = exposedCondition(metav1.ConditionUnknown, redpacketv1alpha1.ReasonAddressPending,
			"Ingress %s is applied; its load balancer has no address yet", e.Name)
		res.requeueAfter = exposeRecheckPeriod
		return res, nil
	}
	res.condition = exposedCondition(metav1.ConditionTrue, redpacketv1alpha1.ReasonAddressAssigned,
		"Ingress %s has the load balancer address %s", e.Name, strings.Join(addresses, ", "))
	return res, nil
}

// setExposed records r's Exposed condition on the scope, or removes the condition
// when r has none (no spec.expose).
func (s *reconcileScope) setExposed(r exposeResult) {
	if r.condition == nil {
		meta.RemoveStatusCondition(s.conditions, redpacketv1alpha1.ConditionExposed)
		return
	}
	s.setCondition(r.condition.Type, r.condition.Status, r.condition.Reason, "%s", r.condition.Message)
}

// newExposer is the exposer of a reconciler on mgr, and whether the Gateway API is
// installed now, which decides whether the controller watches HTTPRoutes. A watch on
// a kind the API server does not serve would fail the manager's start, so where the
// Gateway API comes later, its routes' status is read on the periodic requeue
// instead (exposeRecheckPeriod). A discovery that fails at start counts as absent.
func newExposer(mgr ctrl.Manager, c client.Client, reader client.Reader, recheck time.Duration) (*exposer, bool) {
	log := mgr.GetLogger().WithName("expose")
	var g *gatewayAPI
	if dc, err := discovery.NewDiscoveryClientForConfig(mgr.GetConfig()); err != nil {
		log.Error(err, "making a discovery client; the Gateway API counts as absent")
		g = newGatewayAPI(nil, recheck)
	} else {
		g = newGatewayAPI(dc, recheck)
	}
	installed, err := g.installed(time.Now())
	if err != nil {
		log.Error(err, "asking discovery for the Gateway API at start; HTTPRoutes are not watched")
	}
	return &exposer{client: c, reader: reader, gateway: g}, installed
}

// watchExposure adds the exposure's owned kinds to a controller's builder: the
// Ingress always (networking.k8s.io/v1 is built in), the HTTPRoute only when routes
// is set (the Gateway API was installed at start).
func watchExposure(b *builder.Builder, routes bool) *builder.Builder {
	b = b.Owns(&networkingv1.Ingress{})
	if routes {
		b = b.Owns(&gatewayv1.HTTPRoute{})
	}
	return b
}
