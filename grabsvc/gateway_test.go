package grabsvc

import (
	"math/rand/v2"
	"net"
	"net/http"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/grabsvc/grabapi"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/gatewaytest"
)

// The 503 contract at the edge: TestA503MayHoldAPacketAndTheRetryReturnsIt's rain
// (30 % of the script's replies held 2 s, past the Redis and resolving deadlines),
// played through a real Gateway. Traefik (bin/traefik) serves a Gateway on a real
// API server with the Gateway API's standard CRDs; the activity's HTTPRoute is the
// one the operator builds (specs.HTTPRoute: its path prefix rewritten away, its
// timeouts from grabapi's deadlines), to a Service whose EndpointSlice names the
// grab service on the host. Every answer that reaches a user is the grab service's
// own JSON (send fails on anything else, such as a gateway's 502 or 504): the
// gateway never cuts a grab that is still being resolved. A 503 may hold a packet,
// its retry through the gateway returns it, and the money adds up.
func TestA503ThroughTheGateway(t *testing.T) {
	gatewaytest.Require(t)
	amounts := ones(1500)
	admin, fault, act, web := faultedGrabServerAt(t, "gateway-rain", amounts, false, 500*time.Millisecond, 2*time.Second,
		DefaultResolveTimeout, func(f *replyFault) { f.holdEvery, f.rng = 0.3, rand.New(rand.NewPCG(36, 504)) })

	cp := controlplane.Start(t)
	gatewaytest.InstallCRDs(t, cp.Config)
	traefik := gatewaytest.StartTraefik(t, cp)
	ns := cp.Namespace(t)
	traefik.Gateway(t, cp.Client, ns, "public")

	a := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "gateway-rain", UID: "0b0c1d2e-0000-4000-8000-000000000503"},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{Expose: &redpacketv1alpha1.Expose{HTTPRoute: &redpacketv1alpha1.HTTPRouteExpose{
			ParentRefs: []redpacketv1alpha1.ParentReference{{Name: "public"}}, PathPrefix: "/rain"}}},
	}
	e := specs.ActivityExposure(a)
	gatewaytest.Backend(t, cp.Client, ns, e.Service, 8080, gatewaytest.Serve(t, web.Config.Handler))
	if err := cp.Client.Apply(t.Context(), specs.HTTPRoute(e), client.FieldOwner("redpacket-operator-expose")); err != nil {
		t.Fatalf("applying the activity's HTTPRoute: %v", err)
	}
	route := &gatewayv1.HTTPRoute{}
	if err := cp.Client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: e.Name}, route); err != nil {
		t.Fatal(err)
	}
	// The route's timeouts cover the longest grab the service resolves.
	for _, r := range route.Spec.Rules {
		d, err := time.ParseDuration(string(*r.Timeouts.Request))
		if err != nil || d < grabapi.GrabDeadline(0) {
			t.Fatalf("route timeout %v (%v), want at least the grab deadline %v", *r.Timeouts.Request, err, grabapi.GrabDeadline(0))
		}
	}

	base := traefik.URL() + "/rain"
	gatewaytest.WaitRouted(t, traefik, base+"/v1/activity", time.Minute, func(r *http.Response) bool {
		return r.Header.Get("Content-Type") == "application/json"
	})

	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext}}
	t.Cleanup(c.CloseIdleConnections)
	unavailable, holding := heldRain(t, admin, fault, act, amounts, grabAt(t, base, c))
	t.Logf("through Traefik (its route's timeouts %s): %d users answered 503 first, %d of them holding a packet", *route.Spec.Rules[0].Timeouts.Request, unavailable, holding)
	if holding == 0 {
		t.Fatal("no 503 hid a packet: the rain did not reach the case the contract is about")
	}
}
