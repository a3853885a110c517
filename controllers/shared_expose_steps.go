package controllers

import (
	"context"

	"k8s.io/apimachinery/pkg/api/meta"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
)

// reconcileExpose keeps the activity's spec.expose: its HTTPRoute or Ingress applied
// (the other deleted), the Exposed condition and status.url. It never makes Ready
// False: an activity serves in the cluster whether or not a gateway accepts its
// route. A missing Gateway API is Exposed False (GatewayAPIMissing), looked at again
// every Options.GatewayAPIRecheckPeriod, never an error; a failed apply is an error, retried
// with backoff, and the later steps run all the same (keepGoing).
func (r *RedPacketActivityReconciler) reconcileExpose(ctx context.Context, s *activityScope) (stepResult, error) {
	if r.exposer == nil {
		return stepResult{}, nil
	}
	wasExposed := meta.FindStatusCondition(s.activity.Status.Conditions, redpacketv1alpha1.ConditionExposed) != nil
	res, err := r.exposer.keep(ctx, specs.ActivityExposure(s.activity), s.activity, wasExposed, s.now)
	s.setExposed(res)
	s.status.URL = res.url
	return stepResult{requeueAfter: res.requeueAfter}, err
}

// reconcileBudgetExpose is reconcileExpose for a budget.
func (r *RedPacketBudgetReconciler) reconcileBudgetExpose(ctx context.Context, s *budgetScope) (stepResult, error) {
	if r.exposer == nil {
		return stepResult{}, nil
	}
	wasExposed := meta.FindStatusCondition(s.budget.Status.Conditions, redpacketv1alpha1.ConditionExposed) != nil
	res, err := r.exposer.keep(ctx, specs.BudgetExposure(s.budget), s.budget, wasExposed, s.now)
	s.setExposed(res)
	s.status.URL = res.url
	return stepResult{requeueAfter: res.requeueAfter}, err
}
