package controllers

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
)

// prewarmEdgeMargin is how long after a window edge the reconcile asked for at that
// edge comes: late enough that the controller's clock is past it.
const prewarmEdgeMargin = 100 * time.Millisecond

// reconcileGrabAutoscaler keeps the activity's HorizontalPodAutoscaler
// <activity>-grab as spec.grabService.autoscaling and the controller's clock say
// (keepGrabAutoscaler with s.capacity): its minReplicas is prewarm.replicas inside the
// prewarm window [startTime − lead, endTime + holdAfter) and autoscaling.minReplicas
// outside it, written again at every reconcile, not once. Without autoscaling, the
// operator's HPA is deleted. It asks to come back just after the next edge of the
// window (its opening, startTime, its closing), so the minimum moves on time with
// no watch of its own.
//
// Like the other grab workload steps it acts only once the ownership step found the
// workload the activity's and the redis user step settled its login; its failure
// never holds up closing and refunding (keepGoing).
func (r *RedPacketActivityReconciler) reconcileGrabAutoscaler(ctx context.Context, s *activityScope) (stepResult, error) {
	// The edge matters to Prewarmed even while the workload is not the activity's.
	var res stepResult
	if s.capacity != nil && !s.capacity.NextEdge.IsZero() {
		res.requeueAfter = s.capacity.NextEdge.Sub(s.now) + prewarmEdgeMargin
	}
	if !s.grabOwned || !s.grabRedisSettled {
		return res, nil
	}
	a := s.activity
	if err := keepGrabAutoscaler(ctx, r.Client, r.APIReader, r.Recorder, grabGuarded{
		owner: a, kind: "activity", name: specs.GrabName(a), labels: specs.GrabLabels(a),
		selector: specs.GrabSelector(a), capacity: s.capacity,
	}); err != nil {
		return workloadFailed(err), err
	}
	return res, nil
}

// computePrewarmed sets the Prewarmed condition from s.capacity, the controller's
// clock and the grab Deployment's available replicas, and returns why Ready must be
// False for it (nil: it need not). Without prewarm the condition goes.
//
// Inside the window it is True (Warmed) once prewarm.replicas are available, else
// False: Warming before startTime, NotPrewarmed from startTime on, which also makes
// Ready False with NotPrewarmed while the activity serves (Scheduled, Active,
// Paused: the controller's clock may be past startTime a moment before Redis's).
// Outside the window it is False with PrewarmPending or PrewarmReleased and the
// minimum the HPA holds.
func computePrewarmed(s *activityScope) *readyBlocker {
	const condType = redpacketv1alpha1.ConditionPrewarmed
	c := s.capacity
	if c == nil || c.Stage == specs.NoPrewarm {
		meta.RemoveStatusCondition(&s.status.Conditions, condType)
		return nil
	}
	const layout = time.RFC3339
	switch c.Stage {
	case specs.PrewarmBefore:
		s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonPrewarmPending,
			"the prewarm window opens at %s; until then the HPA's minimum is %d", c.WindowStart.UTC().Format(layout), c.MinReplicas)
		return nil
	case specs.PrewarmAfter:
		s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonPrewarmReleased,
			"the prewarm window closed at %s; the HPA's minimum is back at %d", c.WindowEnd.UTC().Format(layout), c.MinReplicas)
		return nil
	}
	var available int32
	name := specs.GrabName(s.activity)
	if d := s.deployment; d != nil {
		available = d.Status.AvailableReplicas
	}
	switch {
	case available >= c.Prewarm:
		s.setCondition(condType, metav1.ConditionTrue, redpacketv1alpha1.ReasonWarmed,
			"deployment %s has %d available replicas of the %d prewarmed; the HPA's minimum is held at %d until %s",
			name, available, c.Prewarm, c.Prewarm, c.WindowEnd.UTC().Format(layout))
		return nil
	case !c.Started:
		s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonWarming,
			"deployment %s has %d available replicas of the %d prewarmed; startTime is %s",
			name, available, c.Prewarm, c.Start.UTC().Format(layout))
		return nil
	}
	s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonNotPrewarmed,
		"startTime %s has come and deployment %s has %d available replicas of the %d prewarmed (pending pods, too small a node pool, or too short a lead)",
		c.Start.UTC().Format(layout), name, available, c.Prewarm)
	if !servingPhases[s.status.Phase] {
		return nil
	}
	return notReady(redpacketv1alpha1.ReasonNotPrewarmed,
		"grabbing started at %s with %d of the %d prewarmed grab replicas available", c.Start.UTC().Format(layout), available, c.Prewarm)
}
