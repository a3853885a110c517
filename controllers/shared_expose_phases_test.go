package controllers

import (
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"
)

// countingDiscovery answers ServerResourcesForGroupVersion as a cluster with or
// without the Gateway API, and counts the questions.
type countingDiscovery struct {
	discovery.DiscoveryInterface
	installed bool
	asked     int
}

func (d *countingDiscovery) ServerResourcesForGroupVersion(gv string) (*metav1.APIResourceList, error) {
	d.asked++
	if !d.installed {
		return nil, apierrors.NewNotFound(schema.GroupResource{Group: gatewayv1.GroupName}, gv)
	}
	return &metav1.APIResourceList{GroupVersion: gv, APIResources: []metav1.APIResource{{Name: "gateways"}, {Name: "httproutes"}}}, nil
}

// An absent Gateway API is believed for the recheck period, so a fleet of
// activities waiting for it asks discovery once per period, not once per reconcile;
// installing it is then seen at the next look. A present one is believed until an
// apply finds the kind gone (forget).
func TestGatewayAPIDiscoveryIsRecheckedNotHammered(t *testing.T) {
	d := &countingDiscovery{}
	g := newGatewayAPI(d, DefaultGatewayAPIRecheckPeriod)
	t0 := time.Unix(1_800_000_000, 0)
	for i := range 100 {
		if ok, err := g.installed(t0.Add(time.Duration(i) * 100 * time.Millisecond)); ok || err != nil {
			t.Fatalf("installed %v, %v: want absent", ok, err)
		}
	}
	if d.asked != 1 {
		t.Errorf("discovery asked %d times in 10 s, want once", d.asked)
	}
	d.installed = true
	if ok, _ := g.installed(t0.Add(DefaultGatewayAPIRecheckPeriod + time.Second)); !ok || d.asked != 2 {
		t.Errorf("after the recheck period: installed %v after %d questions, want true after 2", ok, d.asked)
	}
	for i := range 100 {
		_, _ = g.installed(t0.Add(time.Hour + time.Duration(i)*time.Second))
	}
	if d.asked != 2 {
		t.Errorf("a present Gateway API was asked about again: %d questions", d.asked)
	}
	d.installed = false
	g.forget()
	if ok, _ := g.installed(t0.Add(2 * time.Hour)); ok || d.asked != 3 {
		t.Errorf("after forget: installed %v after %d questions, want false after 3", ok, d.asked)
	}
}
