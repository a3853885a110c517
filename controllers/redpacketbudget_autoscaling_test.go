package controllers_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/test/wait"
)

// A budget's autoscaling on the real API server: turned on over a Deployment that
// spec.grabService.replicas sized, it hands the count to an HPA the budget owns
// without resetting it, and the PodDisruptionBudget stays one eviction at a time (a
// budget has no prewarm window to hold); the HPA's scale writes stick across reconciles; turned off, the
// HPA goes, the spec's count applies again and the PodDisruptionBudget is the
// plain one-at-a-time one.
func TestBudgetAutoscalingOwnsTheCount(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	e.startBudgetController(e.recordingSettlement())

	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "scaled"},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{
			Total: 100_000, BudgetShards: 2,
			Packets:     redpacketv1alpha1.PacketLimits{MaxTotal: 1000},
			GrabService: redpacketv1alpha1.BudgetGrabService{Replicas: new(int32(3))},
		},
	}
	if err := e.c.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: e.ns, Name: "scaled-grab"}
	deployment := func() *appsv1.Deployment {
		d := &appsv1.Deployment{}
		if err := e.c.Get(ctx, key, d); err != nil {
			return nil
		}
		return d
	}
	waitReplicas := func(want int32) {
		t.Helper()
		wait.Until(t, 20*time.Second, fmt.Sprintf("grab replicas %d", want), func() (bool, string) {
			d := deployment()
			if d == nil {
				return false, "no Deployment"
			}
			return d.Spec.Replicas != nil && *d.Spec.Replicas == want, fmt.Sprintf("replicas %v", d.Spec.Replicas)
		})
	}
	waitReplicas(3)

	e.patchBudget("scaled", func(b *redpacketv1alpha1.RedPacketBudget) {
		b.Spec.GrabService.Autoscaling = &redpacketv1alpha1.GrabAutoscaling{MinReplicas: 2, MaxReplicas: 6}
	})
	hpa := &autoscalingv2.HorizontalPodAutoscaler{}
	wait.Until(t, 20*time.Second, "the budget's HPA 2..6 and its PDB maxUnavailable 1", func() (bool, string) {
		pdb := &policyv1.PodDisruptionBudget{}
		herr, perr := e.c.Get(ctx, key, hpa), e.c.Get(ctx, key, pdb)
		if herr != nil || perr != nil {
			return false, fmt.Sprintf("HPA: %v, PDB: %v", herr, perr)
		}
		return hpa.Spec.MinReplicas != nil && *hpa.Spec.MinReplicas == 2 && hpa.Spec.MaxReplicas == 6 &&
				pdb.Spec.MinAvailable == nil && pdb.Spec.MaxUnavailable != nil && pdb.Spec.MaxUnavailable.IntValue() == 1,
			fmt.Sprintf("HPA %v..%d, PDB minAvailable %v maxUnavailable %v", hpa.Spec.MinReplicas, hpa.Spec.MaxReplicas, pdb.Spec.MinAvailable, pdb.Spec.MaxUnavailable)
	})
	if !metav1.IsControlledBy(hpa, e.getBudget("scaled")) || hpa.Spec.ScaleTargetRef.Name != "scaled-grab" {
		t.Errorf("HPA owners %+v target %+v, want the budget's, targeting scaled-grab", hpa.OwnerReferences, hpa.Spec.ScaleTargetRef)
	}
	// The count was handed over, not reset: still 3, and no longer the workload apply's.
	d := deployment()
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 3 {
		t.Errorf("replicas %v after autoscaling was turned on, want 3 kept", d.Spec.Replicas)
	}
	for _, m := range d.ManagedFields {
		if m.Manager == controllers.BudgetFieldManager && m.FieldsV1 != nil && containsField(m.FieldsV1.GetRawBytes(), "f:replicas") {
			t.Errorf("%s still holds spec.replicas: %s", controllers.BudgetFieldManager, m.FieldsV1.GetRawString())
		}
	}

	// The HPA scales through the Deployment's scale subresource (as the
	// kube-controller-manager would); reconciles leave its count alone.
	scale := &autoscalingv1.Scale{ObjectMeta: metav1.ObjectMeta{Name: "scaled-grab", Namespace: e.ns}, Spec: autoscalingv1.ScaleSpec{Replicas: 5}}
	if err := e.c.SubResource("scale").Update(ctx, d, client.WithSubResourceBody(scale)); err != nil {
		t.Fatalf("scaling as the HPA: %v", err)
	}
	e.patchBudget("scaled", func(b *redpacketv1alpha1.RedPacketBudget) { b.Spec.Packets.MaxTotal = 2000 })
	consistently(t, 2*time.Second, "the HPA's count of 5", func() (bool, string) {
		d := deployment()
		return d != nil && d.Spec.Replicas != nil && *d.Spec.Replicas == 5, fmt.Sprintf("%v", d.Spec.Replicas)
	})

	// Autoscaling off: the HPA goes, spec.grabService.replicas applies again, and the
	// PodDisruptionBudget is the plain one.
	e.patchBudget("scaled", func(b *redpacketv1alpha1.RedPacketBudget) { b.Spec.GrabService.Autoscaling = nil })
	wait.Until(t, 20*time.Second, "the HPA deleted and the plain PDB back", func() (bool, string) {
		herr := e.c.Get(ctx, key, &autoscalingv2.HorizontalPodAutoscaler{})
		pdb := &policyv1.PodDisruptionBudget{}
		if err := e.c.Get(ctx, key, pdb); err != nil {
			return false, err.Error()
		}
		return isNotFound(herr) && pdb.Spec.MaxUnavailable != nil && pdb.Spec.MinAvailable == nil,
			fmt.Sprintf("HPA: %v, PDB %+v", herr, pdb.Spec)
	})
	waitReplicas(3)
}

// containsField reports whether a managed fields entry's JSON names field.
func containsField(raw []byte, field string) bool {
	return strings.Contains(string(raw), `"`+field+`"`)
}
