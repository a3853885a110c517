package upgrade

import (
	"context"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// kubectl runs the real kubectl against the node and fails the test when it fails.
func kubectl(t *testing.T, stdin string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	out, err := env.node.Kubectl(ctx, stdin, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// eventually polls f every 250 ms until it returns nil, failing the test after within.
func eventually(t *testing.T, within time.Duration, what string, f func() error) {
	t.Helper()
	eventuallyValue(t, within, what, func() (struct{}, error) { return struct{}{}, f() })
}

// eventuallyValue polls f every 250 ms until it returns no error and returns its
// value, failing the test after within.
func eventuallyValue[V any](t *testing.T, within time.Duration, what string, f func() (V, error)) V {
	t.Helper()
	start := time.Now()
	for {
		v, err := f()
		if err == nil {
			return v
		}
		if time.Since(start) > within {
			t.Fatalf("%s: not within %s: %v", what, within, err)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("%s: %v", what, t.Context().Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// activity reads an activity.
func activity(t *testing.T, ns, name string) *redpacketv1alpha1.RedPacketActivity {
	t.Helper()
	a := &redpacketv1alpha1.RedPacketActivity{}
	if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name}, a); err != nil {
		t.Fatalf("reading activity %s/%s: %v", ns, name, err)
	}
	return a
}

// deployment reads a Deployment.
func deployment(t *testing.T, ns, name string) *appsv1.Deployment {
	t.Helper()
	d := &appsv1.Deployment{}
	if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name}, d); err != nil {
		t.Fatalf("reading deployment %s/%s: %v", ns, name, err)
	}
	return d
}

// val is a status counter, -1 while unset.
func val(p *int64) int64 {
	if p == nil {
		return -1
	}
	return *p
}
