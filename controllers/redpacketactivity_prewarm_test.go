package controllers_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/test/wait"
)

// An autoscaled activity with prewarm: the operator's HPA holds its minimum at the
// prewarm size over [startTime − lead, endTime + holdAfter) by the controller's
// clock, and at autoscaling.minReplicas outside it; a hand edit inside the window
// is put back without any other prompt; the PodDisruptionBudget follows the
// minimum; Prewarmed says whether the fleet is there, and startTime without it is a
// Warning and Ready=False NotPrewarmed. Removing autoscaling deletes the HPA and
// the PodDisruptionBudget. Redis's clock keeps the activity Scheduled throughout
// (its startTime is an hour ahead): only the controller's clock moves.
func TestPrewarmHoldsTheAutoscalerMinimumOverTheWindow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	start := time.Now().Add(time.Hour).Truncate(time.Second)
	end := start.Add(10 * time.Minute)
	var clock atomic.Int64
	setClock := func(tm time.Time) { clock.Store(tm.UnixNano()) }
	setClock(start.Add(-2 * time.Minute))
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Now = func() time.Time { return time.Unix(0, clock.Load()) }
	})

	const name = "warm"
	e.create(e.activity(name, 1000, 10, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.StartTime, a.Spec.EndTime = &metav1.Time{Time: start}, &metav1.Time{Time: end}
		a.Spec.GrabService.Autoscaling = &redpacketv1alpha1.ActivityGrabAutoscaling{
			MinReplicas: 1, MaxReplicas: 8,
			Prewarm: &redpacketv1alpha1.GrabPrewarm{Replicas: 4, Lead: &metav1.Duration{Duration: 60 * time.Second}},
		}
	}))
	a := e.waitPhase(name, redpacketv1alpha1.PhaseScheduled, 20*time.Second)
	key := client.ObjectKey{Namespace: e.ns, Name: name + "-grab"}

	hpa := func() (*autoscalingv2.HorizontalPodAutoscaler, error) {
		h := &autoscalingv2.HorizontalPodAutoscaler{}
		return h, e.c.Get(ctx, key, h)
	}
	waitMinimum := func(want int32) *autoscalingv2.HorizontalPodAutoscaler {
		t.Helper()
		var h *autoscalingv2.HorizontalPodAutoscaler
		// The PDB: minAvailable at the warmed size inside the window (want 4), one
		// eviction at a time outside it (want 1, autoscaling's minimum).
		inside := want > 1
		wait.Until(t, 10*time.Second, fmt.Sprintf("HPA minReplicas %d and the PDB of the window's stage", want), func() (bool, string) {
			var err error
			if h, err = hpa(); err != nil {
				return false, err.Error()
			}
			pdb := &policyv1.PodDisruptionBudget{}
			if err := e.c.Get(ctx, key, pdb); err != nil {
				return false, "PDB: " + err.Error()
			}
			got := fmt.Sprintf("HPA min %v, PDB minAvailable %v maxUnavailable %v", h.Spec.MinReplicas, pdb.Spec.MinAvailable, pdb.Spec.MaxUnavailable)
			pdbOK := pdb.Spec.MinAvailable != nil && pdb.Spec.MinAvailable.IntValue() == int(want) && pdb.Spec.MaxUnavailable == nil
			if !inside {
				pdbOK = pdb.Spec.MinAvailable == nil && pdb.Spec.MaxUnavailable != nil && pdb.Spec.MaxUnavailable.IntValue() == 1
			}
			return h.Spec.MinReplicas != nil && *h.Spec.MinReplicas == want && pdbOK, got
		})
		return h
	}
	setAvailable := func(n int32) {
		t.Helper()
		d := &appsv1.Deployment{}
		if err := e.c.Get(ctx, key, d); err != nil {
			t.Fatal(err)
		}
		d.Status = appsv1.DeploymentStatus{ObservedGeneration: d.Generation, Replicas: n, UpdatedReplicas: n,
			ReadyReplicas: n, AvailableReplicas: n}
		if err := e.c.Status().Update(ctx, d); err != nil {
			t.Fatalf("updating the Deployment's status: %v", err)
		}
	}
	bumps := 0
	moveClock := func(tm time.Time) {
		setClock(tm)
		bumps++
		e.bump(name, bumps)
	}

	// Before the window: the minimum is autoscaling's, and the Deployment started at it.
	h := waitMinimum(1)
	if !metav1.IsControlledBy(h, a) || h.Labels["app.kubernetes.io/managed-by"] != "redpacket-operator" {
		t.Errorf("HPA owners %+v labels %v, want the activity's controller reference and the workload's labels", h.OwnerReferences, h.Labels)
	}
	if h.Spec.MaxReplicas != 8 || h.Spec.ScaleTargetRef.Name != name+"-grab" || h.Spec.ScaleTargetRef.Kind != "Deployment" {
		t.Errorf("HPA spec %+v, want max 8 targeting Deployment %s-grab", h.Spec, name)
	}
	d := &appsv1.Deployment{}
	if err := e.c.Get(ctx, key, d); err != nil {
		t.Fatal(err)
	}
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 1 {
		t.Errorf("Deployment replicas %v, want the HPA's minimum 1 at creation", d.Spec.Replicas)
	}
	e.waitCondition(name, redpacketv1alpha1.ConditionPrewarmed, metav1.ConditionFalse, redpacketv1alpha1.ReasonPrewarmPending, 5*time.Second)

	// A reconcile that changes nothing writes nothing to the HPA.
	before := h.ResourceVersion
	moveClock(start.Add(-90 * time.Second))
	e.waitCondition(name, redpacketv1alpha1.ConditionPrewarmed, metav1.ConditionFalse, redpacketv1alpha1.ReasonPrewarmPending, 5*time.Second)
	time.Sleep(time.Second)
	if h, _ := hpa(); h.ResourceVersion != before {
		t.Errorf("the HPA was written by a reconcile that changed nothing (resourceVersion %s, then %s)", before, h.ResourceVersion)
	}

	// Inside the lead: the minimum is the prewarm size; the fleet is warming.
	moveClock(start.Add(-30 * time.Second))
	waitMinimum(4)
	setAvailable(1)
	e.waitCondition(name, redpacketv1alpha1.ConditionPrewarmed, metav1.ConditionFalse, redpacketv1alpha1.ReasonWarming, 5*time.Second)

	// A user lowers the minimum by hand: put back, prompted by the edit alone.
	h, _ = hpa()
	h.Spec.MinReplicas = ptr(int32(2))
	if err := e.c.Update(ctx, h); err != nil {
		t.Fatalf("editing the HPA: %v", err)
	}
	waitMinimum(4)

	// Four replicas available: Prewarmed, and Ready.
	setAvailable(4)
	e.waitCondition(name, redpacketv1alpha1.ConditionPrewarmed, metav1.ConditionTrue, redpacketv1alpha1.ReasonWarmed, 5*time.Second)
	e.waitCondition(name, redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, string(redpacketv1alpha1.PhaseScheduled), 5*time.Second)

	// Past startTime with two available: a Warning, and Ready False with the reason.
	setAvailable(2)
	moveClock(start.Add(10 * time.Second))
	e.waitCondition(name, redpacketv1alpha1.ConditionPrewarmed, metav1.ConditionFalse, redpacketv1alpha1.ReasonNotPrewarmed, 5*time.Second)
	e.waitCondition(name, redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonNotPrewarmed, 5*time.Second)
	e.waitEvent(name, "Warning", redpacketv1alpha1.ReasonNotPrewarmed)
	waitMinimum(4)

	// After endTime but within holdAfter (2m by default): still held.
	moveClock(end.Add(time.Minute))
	e.waitCondition(name, redpacketv1alpha1.ConditionPrewarmed, metav1.ConditionFalse, redpacketv1alpha1.ReasonNotPrewarmed, 5*time.Second)
	waitMinimum(4)

	// Past the window: released to autoscaling's minimum.
	moveClock(end.Add(3 * time.Minute))
	waitMinimum(1)
	e.waitCondition(name, redpacketv1alpha1.ConditionPrewarmed, metav1.ConditionFalse, redpacketv1alpha1.ReasonPrewarmReleased, 5*time.Second)
	e.waitCondition(name, redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, string(redpacketv1alpha1.PhaseScheduled), 5*time.Second)

	// Autoscaling removed: the HPA and the PodDisruptionBudget go (one replica: no
	// disruption budget without autoscaling), and so does the condition.
	e.patch(name, func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.GrabService.Autoscaling = nil })
	wait.Until(t, 10*time.Second, "the HPA and the PDB deleted", func() (bool, string) {
		_, herr := hpa()
		perr := e.c.Get(ctx, key, &policyv1.PodDisruptionBudget{})
		return isNotFound(herr) && isNotFound(perr), fmt.Sprintf("HPA: %v, PDB: %v", herr, perr)
	})
	wait.Until(t, 5*time.Second, "Prewarmed gone", func() (bool, string) {
		a := e.get(name)
		return findCondition(a, redpacketv1alpha1.ConditionPrewarmed) == nil, describe(a)
	})
}
