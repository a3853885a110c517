package controllers

import (
	"context"
	"testing"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"redpacket.io/operator/controllers/specs"
)

// keepGrabAutoscaler with a capacity creates the HPA and puts its minimum back
// after an edit; without one it deletes the operator's HPA; an HPA of the name that
// the owner does not control is never created over, changed or deleted.
func TestKeepGrabAutoscaler(t *testing.T) {
	ctx := context.Background()
	a := testActivity()
	a.UID = "activity-uid"
	g := grabGuarded{owner: a, kind: "activity", name: specs.GrabName(a), labels: specs.GrabLabels(a),
		selector: specs.GrabSelector(a), capacity: &specs.Capacity{MinReplicas: 4, MaxReplicas: 8, TargetCPU: 70}}
	key := client.ObjectKey{Namespace: a.Namespace, Name: g.name}
	minimum := func(c client.Client) int32 {
		t.Helper()
		h := &autoscalingv2.HorizontalPodAutoscaler{}
		if err := c.Get(ctx, key, h); err != nil {
			t.Fatalf("the HPA: %v", err)
		}
		if !metav1.IsControlledBy(h, a) {
			t.Fatalf("the HPA is not controlled by the activity: %+v", h.OwnerReferences)
		}
		return *h.Spec.MinReplicas
	}

	c := fake.NewClientBuilder().WithScheme(testScheme(t)).Build()
	if err := keepGrabAutoscaler(ctx, c, c, nil, g); err != nil {
		t.Fatal(err)
	}
	if got := minimum(c); got != 4 {
		t.Errorf("minReplicas %d, want 4", got)
	}
	h := &autoscalingv2.HorizontalPodAutoscaler{}
	_ = c.Get(ctx, key, h)
	h.Spec.MinReplicas = new(int32(2))
	if err := c.Update(ctx, h); err != nil {
		t.Fatal(err)
	}
	if err := keepGrabAutoscaler(ctx, c, c, nil, g); err != nil {
		t.Fatal(err)
	}
	if got := minimum(c); got != 4 {
		t.Errorf("minReplicas %d after an edit to 2 and a reconcile, want 4 again", got)
	}
	g.capacity = nil
	if err := keepGrabAutoscaler(ctx, c, c, nil, g); err != nil {
		t.Fatal(err)
	}
	if err := c.Get(ctx, key, &autoscalingv2.HorizontalPodAutoscaler{}); err == nil {
		t.Error("the operator's HPA is still there without autoscaling")
	}

	foreign := &autoscalingv2.HorizontalPodAutoscaler{ObjectMeta: metav1.ObjectMeta{Name: g.name, Namespace: a.Namespace},
		Spec: autoscalingv2.HorizontalPodAutoscalerSpec{MinReplicas: new(int32(3)), MaxReplicas: 9}}
	for _, capacity := range []*specs.Capacity{nil, {MinReplicas: 4, MaxReplicas: 8, TargetCPU: 70}} {
		c := fake.NewClientBuilder().WithScheme(testScheme(t)).WithObjects(foreign.DeepCopy()).Build()
		g.capacity = capacity
		if err := keepGrabAutoscaler(ctx, c, c, nil, g); err != nil {
			t.Fatal(err)
		}
		got := &autoscalingv2.HorizontalPodAutoscaler{}
		if err := c.Get(ctx, key, got); err != nil {
			t.Fatalf("a user's HPA was deleted (capacity %v): %v", capacity, err)
		}
		if *got.Spec.MinReplicas != 3 || got.Spec.MaxReplicas != 9 || len(got.OwnerReferences) != 0 {
			t.Errorf("a user's HPA was changed (capacity %v): %+v", capacity, got)
		}
	}
}
