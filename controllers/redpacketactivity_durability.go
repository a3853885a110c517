package controllers

import (
	"context"
	"errors"
	"fmt"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// reconcileDurability checks, before grabbing may open and on every resync, that the
// activity's Redis gives the durability its spec asks for: with Fsync, the master
// holding the activity runs appendonly yes with appendfsync always; with Replicas,
// it has at least that many replicas connected. When it does not, Ready is False
// with reason DurabilityNotMet and the chain halts, so a ready activity is not
// opened (one already open keeps serving: its grabs still wait for replicas, and
// answer 503 while too few hold them).
func (r *RedPacketActivityReconciler) reconcileDurability(ctx context.Context, s *activityScope) (stepResult, error) {
	d := s.activity.Spec.Durability
	if d == nil || d.Mode == "" || d.Mode == redpacketv1alpha1.DurabilityNone {
		return stepResult{}, nil
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	var err error
	switch d.Mode {
	case redpacketv1alpha1.DurabilityFsync:
		err = s.store.CheckFsync(rctx)
	case redpacketv1alpha1.DurabilityReplicas:
		err = s.store.CheckReplicas(rctx, int(d.Replicas))
	default:
		return blocked(redpacketv1alpha1.ReasonInvalidSpec, "unknown durability mode %q", d.Mode), nil
	}
	switch {
	case err == nil:
		return stepResult{}, nil
	case errors.Is(err, store.ErrDurabilityNotMet):
		res := blocked(redpacketv1alpha1.ReasonDurabilityNotMet, "durability %s: %v", d.Mode, err)
		res.requeueAfter = r.Options.ActiveResyncPeriod
		return res, nil
	default:
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "checking durability %s: %v", d.Mode, err),
			fmt.Errorf("checking durability %s: %w", d.Mode, err)
	}
}
