package controllers

import (
	"context"
	"fmt"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
)

// keepGrabAutoscaler keeps the operator's HorizontalPodAutoscaler <name>-grab of a
// grab workload (an activity's or a budget's) as g.capacity says: with a capacity it
// is created, and its labels, controller reference and spec
// (specs.GrabAutoscalerSpec: minReplicas is the capacity's minimum now) are put
// back whenever they drifted, at every call, so an edit by hand inside a prewarm
// window lasts only until the next reconcile. Without a capacity (autoscaling
// removed or never set) an HPA of that name the owner controls is deleted; the
// Deployment keeps the replica count it had.
//
// An HPA of that name that the owner does not control is never touched: with a
// capacity that is a Warning event (NotAdopted) and nothing is created, without
// one it is the user's own autoscaler and is left alone silently.
func keepGrabAutoscaler(ctx context.Context, c client.Client, reader client.Reader, recorder events.EventRecorder, g grabGuarded) error {
	key := client.ObjectKey{Namespace: g.owner.GetNamespace(), Name: g.name}
	hpa := &autoscalingv2.HorizontalPodAutoscaler{}
	found, err := getGrabChild(ctx, c, reader, key, hpa)
	if err != nil {
		return fmt.Errorf("looking up HorizontalPodAutoscaler %s: %w", g.name, err)
	}
	ours := found && metav1.IsControlledBy(hpa, g.owner)
	switch {
	case g.capacity == nil && ours:
		if err := c.Delete(ctx, hpa, client.Preconditions{UID: &hpa.UID}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("deleting HorizontalPodAutoscaler %s: %w", g.name, err)
		}
		return nil
	case g.capacity == nil:
		return nil
	case found && !ours:
		if recorder != nil {
			recorder.Eventf(g.owner, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonNotAdopted, "Reconcile",
				"HorizontalPodAutoscaler %s already exists and is not controlled by this %s; leaving it alone, spec.grabService.autoscaling has no effect (delete or rename it)",
				g.name, g.kind)
		}
		return nil
	}
	capacity := *g.capacity
	return keepGrabChild(ctx, c, g, hpa, func() { hpa.Spec = specs.GrabAutoscalerSpec(g.name, capacity) })
}
