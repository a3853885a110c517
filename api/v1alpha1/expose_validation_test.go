package v1alpha1_test

import (
	"fmt"
	"strings"
	"testing"

	v1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// spec.expose is checked by the real API server: exactly one of httpRoute and
// ingress, a route with at least one parent, and bounded lists, strings and maps.
// A valid expose of each kind is admitted, on an activity and on a budget alike.
func TestExposeSpecsAreValidated(t *testing.T) {
	needsControlPlane(t)
	ns := cp.Namespace(t)
	route := func() *v1alpha1.HTTPRouteExpose {
		return &v1alpha1.HTTPRouteExpose{ParentRefs: []v1alpha1.ParentReference{{Name: "edge", Namespace: "gateways"}},
			Hostnames: []string{"rain.example.com"}}
	}
	ingress := func() *v1alpha1.IngressExpose {
		return &v1alpha1.IngressExpose{Host: "rain.example.com", TLSSecretName: "rain-tls",
			Annotations: map[string]string{"cert-manager.io/cluster-issuer": "letsencrypt"}}
	}
	manyParents := make([]v1alpha1.ParentReference, 9)
	for i := range manyParents {
		manyParents[i] = v1alpha1.ParentReference{Name: fmt.Sprintf("gw-%d", i)}
	}
	manyAnnotations := map[string]string{}
	for i := range 33 {
		manyAnnotations[fmt.Sprintf("example.com/a%d", i)] = "x"
	}
	for i, tc := range []struct {
		name   string
		expose *v1alpha1.Expose
		msg    string // "" means admitted
	}{
		{"an httpRoute", &v1alpha1.Expose{HTTPRoute: route()}, ""},
		{"an ingress", &v1alpha1.Expose{Ingress: ingress()}, ""},
		{"both", &v1alpha1.Expose{HTTPRoute: route(), Ingress: ingress()}, "expose needs exactly one of httpRoute and ingress"},
		{"neither", &v1alpha1.Expose{}, "expose needs exactly one of httpRoute and ingress"},
		{"a route without parents", &v1alpha1.Expose{HTTPRoute: &v1alpha1.HTTPRouteExpose{}}, "parentRefs"},
		{"nine parents", &v1alpha1.Expose{HTTPRoute: &v1alpha1.HTTPRouteExpose{ParentRefs: manyParents}}, "must have at most 8 items"},
		{"a parent without a name", &v1alpha1.Expose{HTTPRoute: &v1alpha1.HTTPRouteExpose{ParentRefs: []v1alpha1.ParentReference{{Namespace: "gateways"}}}}, "parentRefs[0].name"},
		{"an upper-case hostname", &v1alpha1.Expose{HTTPRoute: func() *v1alpha1.HTTPRouteExpose {
			r := route()
			r.Hostnames = []string{"Rain.Example.com"}
			return r
		}()}, "hostnames[0]"},
		{"a relative path prefix", &v1alpha1.Expose{HTTPRoute: func() *v1alpha1.HTTPRouteExpose {
			r := route()
			r.PathPrefix = "rain"
			return r
		}()}, "pathPrefix"},
		{"an ingress without a host", &v1alpha1.Expose{Ingress: &v1alpha1.IngressExpose{}}, "host"},
		{"33 annotations", &v1alpha1.Expose{Ingress: func() *v1alpha1.IngressExpose {
			in := ingress()
			in.Annotations = manyAnnotations
			return in
		}()}, "must have at most 32 items"},
		{"a huge annotation value", &v1alpha1.Expose{Ingress: func() *v1alpha1.IngressExpose {
			in := ingress()
			in.Annotations = map[string]string{"example.com/a": strings.Repeat("x", 4097)}
			return in
		}()}, "an annotation key is at most 317 characters and its value at most 4096"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := activity(ns, fmt.Sprintf("expose-%d", i))
			a.Spec.Expose = tc.expose
			err := cp.Client.Create(testCtx(t), a)
			if tc.msg == "" {
				if err != nil {
					t.Fatalf("activity refused: %v", err)
				}
			} else {
				expectRejected(t, err, tc.msg)
			}
			b := budget(ns, fmt.Sprintf("expose-%d", i))
			b.Spec.Expose = tc.expose
			err = cp.Client.Create(testCtx(t), b)
			if tc.msg == "" {
				if err != nil {
					t.Fatalf("budget refused: %v", err)
				}
			} else {
				expectRejected(t, err, tc.msg)
			}
		})
	}
}
