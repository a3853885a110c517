package specs_test

import (
	"reflect"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/grabsvc/grabapi"
)

func exposedActivity(expose *redpacketv1alpha1.Expose, durability *redpacketv1alpha1.Durability) *redpacketv1alpha1.RedPacketActivity {
	return &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Name: "rain", Namespace: "shop", UID: types.UID("u-1")},
		Spec:       redpacketv1alpha1.RedPacketActivitySpec{Expose: expose, Durability: durability},
	}
}

// The route's timeouts come from the grab service's own deadline for the durability:
// longer than it by the margin, in whole seconds, never shorter.
func TestRouteTimeoutCoversTheGrabDeadline(t *testing.T) {
	for _, tc := range []struct {
		name       string
		durability *redpacketv1alpha1.Durability
		want       time.Duration
	}{
		{"no durability", nil, 3 * time.Second},
		{"fsync", &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityFsync}, 3 * time.Second},
		{"replicas, default wait", &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityReplicas, Replicas: 1}, 3 * time.Second},
		{"replicas, 2.5 s", &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityReplicas, Replicas: 1, TimeoutMilliseconds: 2500}, 5 * time.Second},
		{"replicas, the largest wait", &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityReplicas, Replicas: 1, TimeoutMilliseconds: 10000}, 13 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := specs.RouteTimeout(tc.durability)
			if got != tc.want {
				t.Errorf("RouteTimeout = %v, want %v", got, tc.want)
			}
			if deadline := grabapi.GrabDeadline(specs.ReplicaWait(tc.durability)); got < deadline+specs.RouteTimeoutMargin {
				t.Errorf("RouteTimeout %v is shorter than the grab deadline %v plus the margin", got, deadline)
			}
			// The grab service's HTTP write timeout must not cut it first.
			if got > 15*time.Second {
				t.Errorf("RouteTimeout %v exceeds the grab service's 15 s write timeout", got)
			}
		})
	}
}

type routeRule struct {
	match, matchType, rewrite string
}

func rulesOf(t *testing.T, e specs.Exposure) ([]routeRule, string) {
	t.Helper()
	route := specs.HTTPRoute(e)
	var out []routeRule
	timeout := ""
	for _, r := range route.Spec.Rules {
		if len(r.Matches) != 1 || len(r.BackendRefs) != 1 {
			t.Fatalf("rule %+v: want one match and one backend", r)
		}
		b := r.BackendRefs[0]
		if *b.Name != gatewayv1.ObjectName(e.Service) || *b.Port != 8080 {
			t.Errorf("backend %s:%d, want %s:8080", *b.Name, *b.Port, e.Service)
		}
		if *r.Timeouts.Request != *r.Timeouts.BackendRequest {
			t.Errorf("request timeout %s, backend %s: want them equal (no retries)", *r.Timeouts.Request, *r.Timeouts.BackendRequest)
		}
		timeout = string(*r.Timeouts.Request)
		rr := routeRule{match: *r.Matches[0].Path.Value, matchType: string(*r.Matches[0].Path.Type)}
		for _, f := range r.Filters {
			p := f.URLRewrite.Path
			if p.ReplaceFullPath != nil {
				rr.rewrite = "full:" + *p.ReplaceFullPath
			} else {
				rr.rewrite = "prefix:" + *p.ReplacePrefixMatch
			}
		}
		out = append(out, rr)
	}
	return out, timeout
}

// The route sends the page, the API, the packet pages and the assets (and nothing
// else) to the grab Service, rewriting a prefix away.
func TestHTTPRouteRules(t *testing.T) {
	parents := []redpacketv1alpha1.ParentReference{{Name: "edge", Namespace: "gateways", SectionName: "https"}}
	for _, tc := range []struct {
		name   string
		prefix string
		want   []routeRule
	}{
		{"at the root", "/", []routeRule{
			{"/", "Exact", ""}, {"/v1/", "PathPrefix", ""}, {"/p/", "PathPrefix", ""}, {"/assets/", "PathPrefix", ""}}},
		{"under a prefix", "/rain/", []routeRule{
			{"/rain/", "Exact", "full:/"}, {"/rain/v1/", "PathPrefix", "prefix:/v1/"},
			{"/rain/p/", "PathPrefix", "prefix:/p/"}, {"/rain/assets/", "PathPrefix", "prefix:/assets/"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := exposedActivity(&redpacketv1alpha1.Expose{HTTPRoute: &redpacketv1alpha1.HTTPRouteExpose{
				ParentRefs: parents, Hostnames: []string{"rain.example.com"}, PathPrefix: tc.prefix}},
				&redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityReplicas, Replicas: 1, TimeoutMilliseconds: 10000})
			e := specs.ActivityExposure(a)
			got, timeout := rulesOf(t, e)
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("rules\n got %+v\nwant %+v", got, tc.want)
			}
			if timeout != "13s" {
				t.Errorf("timeout %q, want 13s", timeout)
			}
			route := specs.HTTPRoute(e)
			if *route.Name != "rain-grab" || *route.Namespace != "shop" || len(route.OwnerReferences) != 1 || *route.OwnerReferences[0].UID != "u-1" {
				t.Errorf("route %s/%s owners %+v", *route.Namespace, *route.Name, route.OwnerReferences)
			}
			if route.Labels[specs.LabelManagedBy] != specs.ManagedByValue {
				t.Errorf("labels %v lack the managed-by label", route.Labels)
			}
			p := route.Spec.ParentRefs[0]
			if *p.Name != "edge" || *p.Namespace != "gateways" || *p.SectionName != "https" {
				t.Errorf("parentRef %+v", p)
			}
			if len(route.Spec.Hostnames) != 1 || route.Spec.Hostnames[0] != "rain.example.com" {
				t.Errorf("hostnames %v", route.Spec.Hostnames)
			}
		})
	}
}

// The Ingress carries the class, the host, its TLS Secret and the annotations as
// they are, and the same paths as a route at the root.
func TestIngress(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      redpacketv1alpha1.IngressExpose
		wantTLS bool
		wantURL string
	}{
		{"with TLS and cert-manager", redpacketv1alpha1.IngressExpose{ClassName: "traefik", Host: "rain.example.com", TLSSecretName: "rain-tls",
			Annotations: map[string]string{"cert-manager.io/cluster-issuer": "letsencrypt"}}, true, "https://rain.example.com/"},
		{"plain", redpacketv1alpha1.IngressExpose{Host: "rain.example.com"}, false, "http://rain.example.com/"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &redpacketv1alpha1.RedPacketBudget{ObjectMeta: metav1.ObjectMeta{Name: "orders", Namespace: "shop", UID: "u-2"},
				Spec: redpacketv1alpha1.RedPacketBudgetSpec{Expose: &redpacketv1alpha1.Expose{Ingress: &tc.in}}}
			in := specs.Ingress(specs.BudgetExposure(b))
			if *in.Name != "orders-grab" || *in.OwnerReferences[0].Kind != "RedPacketBudget" {
				t.Errorf("ingress %s owned by %+v", *in.Name, in.OwnerReferences)
			}
			if tc.in.ClassName == "" && in.Spec.IngressClassName != nil {
				t.Errorf("class %q, want none", *in.Spec.IngressClassName)
			}
			if tc.in.ClassName != "" && *in.Spec.IngressClassName != tc.in.ClassName {
				t.Errorf("class %v", in.Spec.IngressClassName)
			}
			if got := len(in.Spec.TLS) == 1; got != tc.wantTLS {
				t.Errorf("TLS %+v, want %v", in.Spec.TLS, tc.wantTLS)
			} else if got && (*in.Spec.TLS[0].SecretName != "rain-tls" || in.Spec.TLS[0].Hosts[0] != "rain.example.com") {
				t.Errorf("TLS %+v", in.Spec.TLS[0])
			}
			if !reflect.DeepEqual(in.Annotations, tc.in.Annotations) && len(tc.in.Annotations) > 0 {
				t.Errorf("annotations %v, want %v", in.Annotations, tc.in.Annotations)
			}
			rule := in.Spec.Rules[0]
			if *rule.Host != "rain.example.com" {
				t.Errorf("host %s", *rule.Host)
			}
			var paths []string
			for _, p := range rule.HTTP.Paths {
				paths = append(paths, string(*p.PathType)+" "+*p.Path)
				if *p.Backend.Service.Name != "orders-grab" || *p.Backend.Service.Port.Number != 8080 {
					t.Errorf("backend %+v", p.Backend.Service)
				}
			}
			if want := []string{"Exact /", "Prefix /v1", "Prefix /p", "Prefix /assets"}; !reflect.DeepEqual(paths, want) {
				t.Errorf("paths %v, want %v", paths, want)
			}
			if got := specs.IngressURL(&tc.in); got != tc.wantURL {
				t.Errorf("url %q, want %q", got, tc.wantURL)
			}
		})
	}
}

func TestRouteURL(t *testing.T) {
	r := &redpacketv1alpha1.HTTPRouteExpose{Hostnames: []string{"*.example.com", "rain.example.com"}, PathPrefix: "/spring/"}
	if got := specs.RouteURL(r, specs.RouteHost(r), true); got != "https://rain.example.com/spring/" {
		t.Errorf("url %q", got)
	}
	if got := specs.RouteURL(r, specs.RouteHost(r), false); got != "http://rain.example.com/spring/" {
		t.Errorf("url %q", got)
	}
	if got := specs.RouteURL(&redpacketv1alpha1.HTTPRouteExpose{PathPrefix: "/"}, "", true); got != "" {
		t.Errorf("url %q without a host, want none", got)
	}
}
