package controllers

import (
	"bytes"
	"context"
	"fmt"
	"maps"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
)

// What an activity's and a budget's grab workloads share: the guards kept next to
// the Deployment (keepGrabGuards), the look-up of an object the cache may not hold
// (getGrabChild), and the answer to a failed write (workloadFailed).

// workloadFailed is the result of a grab workload write that failed with err: Ready
// False with WorkloadFailed, halting, except for a conflict (another writer changed
// the object meanwhile), which is only retried.
func workloadFailed(err error) stepResult {
	if apierrors.IsConflict(err) {
		return stepResult{}
	}
	return blocked(redpacketv1alpha1.ReasonWorkloadFailed, "applying the grab workload: %v", err)
}

// getGrabChild reads a workload object: through c, whose cache holds only objects
// with the operator's label, and else from the API server (reader), so that an
// unlabeled object of the same name is seen too. It reports whether the object
// exists.
func getGrabChild(ctx context.Context, c client.Client, reader client.Reader, key client.ObjectKey, obj client.Object) (bool, error) {
	err := c.Get(ctx, key, obj)
	if err == nil {
		return true, nil
	}
	if !apierrors.IsNotFound(err) {
		return false, err
	}
	err = reader.Get(ctx, key, obj)
	if err == nil {
		return true, nil
	}
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	return false, err
}

// secretDataEqual reports whether a Secret's data is exactly want.
func secretDataEqual(got, want map[string][]byte) bool {
	return maps.EqualFunc(got, want, bytes.Equal)
}

// minReplicasForDisruptionBudget is the replica count from which the grab
// Deployment gets a PodDisruptionBudget. With one replica a budget could only
// block voluntary evictions (node drains) or allow them all, so there is none.
const minReplicasForDisruptionBudget = 2

// grabGuarded is a grab workload that keepGrabGuards protects: an activity's or a
// budget's.
type grabGuarded struct {
	// owner controls the guards: the activity or the budget.
	owner client.Object
	// kind is "activity" or "budget", for the events.
	kind string
	// name is the workload's name, <owner>-grab, which the guards take too.
	name string
	// labels are the workload's labels (specs.GrabLabels, specs.BudgetLabels).
	labels map[string]string
	// selector selects the workload's pods (specs.GrabSelector, specs.BudgetSelector).
	selector map[string]string
	// replicas is the grab Deployment's replica count after this reconcile.
	replicas int32
	// capacity, when set, is what the operator's HorizontalPodAutoscaler holds now
	// (spec.grabService.autoscaling): the PodDisruptionBudget is then kept whatever
	// replicas says, with minAvailable the warmed minimum inside a prewarm window.
	// Nil without autoscaling.
	capacity *specs.Capacity
}

// keepGrabGuards keeps a grab workload's NetworkPolicy and, while the Deployment has
// minReplicasForDisruptionBudget replicas or more, its PodDisruptionBudget, and
// deletes that budget when the replicas drop below. With autoscaling (g.capacity)
// the PodDisruptionBudget is always kept, and inside a prewarm window its
// minAvailable is the warmed minimum instead of one eviction at a time
// (specs.GrabAutoscaledDisruptionBudgetSpec): the warmed fleet is never drained
// below its size, while outside the window a drain is never blocked.
// The controller is their only writer: it creates them, and updates them when their
// labels or spec drift. One piece of code serves activities and budgets.
//
// The NetworkPolicy <name>-grab selects the grab pods and admits ingress on the grab
// port only (TCP 8080: the grab API, the probes and /metrics share it); egress is not
// restricted (Redis, the API server and the balance system's webhook are wherever the
// resource says). The PodDisruptionBudget <name>-grab allows one grab pod at a time
// to be evicted, and always allows evicting a pod that is not ready, so a broken
// replica never blocks a node drain.
//
// Both objects carry a controller reference to the owner; one of the same name that
// the owner does not control is left alone, with a Warning event.
func keepGrabGuards(ctx context.Context, c client.Client, reader client.Reader, recorder events.EventRecorder, g grabGuarded) error {
	key := client.ObjectKey{Namespace: g.owner.GetNamespace(), Name: g.name}
	warnForeign := func(kind string) {
		if recorder != nil {
			recorder.Eventf(g.owner, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonNotAdopted, "Reconcile",
				"%s %s already exists and is not controlled by this %s; leaving it alone (delete or rename it)", kind, g.name, g.kind)
		}
	}

	policy := &networkingv1.NetworkPolicy{}
	found, err := getGrabChild(ctx, c, reader, key, policy)
	if err != nil {
		return fmt.Errorf("looking up NetworkPolicy %s: %w", g.name, err)
	}
	if found && !metav1.IsControlledBy(policy, g.owner) {
		warnForeign("NetworkPolicy")
	} else if err := keepGrabChild(ctx, c, g, policy, func() { policy.Spec = specs.GrabNetworkPolicySpec(g.selector) }); err != nil {
		return err
	}

	budget := &policyv1.PodDisruptionBudget{}
	found, err = getGrabChild(ctx, c, reader, key, budget)
	if err != nil {
		return fmt.Errorf("looking up PodDisruptionBudget %s: %w", g.name, err)
	}
	switch {
	case found && !metav1.IsControlledBy(budget, g.owner):
		warnForeign("PodDisruptionBudget")
	case g.capacity != nil:
		capacity := *g.capacity
		return keepGrabChild(ctx, c, g, budget, func() { budget.Spec = specs.GrabAutoscaledDisruptionBudgetSpec(g.selector, capacity) })
	case g.replicas >= minReplicasForDisruptionBudget:
		return keepGrabChild(ctx, c, g, budget, func() { budget.Spec = specs.GrabDisruptionBudgetSpec(g.selector) })
	case found:
		if err := c.Delete(ctx, budget, client.Preconditions{UID: &budget.UID}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("deleting PodDisruptionBudget %s: %w", g.name, err)
		}
	}
	return nil
}

// keepGrabChild makes obj, named after the workload, carry the workload's labels,
// the owner's controller reference and the spec that setSpec writes into it: it
// creates obj when absent and updates it when any of these drifted.
func keepGrabChild(ctx context.Context, c client.Client, g grabGuarded, obj client.Object, setSpec func()) error {
	kind := fmt.Sprintf("%T", obj)
	if gvk, err := c.GroupVersionKindFor(obj); err == nil {
		kind = gvk.Kind
	}
	obj.SetName(g.name)
	obj.SetNamespace(g.owner.GetNamespace())
	_, err := controllerutil.CreateOrUpdate(ctx, c, obj, func() error {
		merged := maps.Clone(obj.GetLabels())
		if merged == nil {
			merged = map[string]string{}
		}
		maps.Copy(merged, g.labels)
		obj.SetLabels(merged)
		setSpec()
		return controllerutil.SetControllerReference(g.owner, obj, c.Scheme())
	})
	if err != nil {
		return fmt.Errorf("creating or updating %s %s: %w", kind, obj.GetName(), err)
	}
	return nil
}

// deploymentReplicas is a Deployment's spec.replicas, 1 when unset (the API server's
// default).
func deploymentReplicas(d *appsv1.Deployment) int32 {
	if d.Spec.Replicas == nil {
		return 1
	}
	return *d.Spec.Replicas
}
