package controllers

import (
	"context"
	"fmt"
	"time"

	"redpacket.io/operator/store"
)

// shardsReader is the part of an activity's store that sees the activity shard by
// shard (store.Activity; the conservation step's fake in the phase tests).
type shardsReader interface {
	// Resolve finishes every transfer between shards left half-done by a process
	// that died between its halves; it returns how many its destination refused.
	Resolve(ctx context.Context) (int, error)
	// ReadShards reads every shard, and the transfers between them, while no packet
	// moved between shards.
	ReadShards(ctx context.Context) (store.View, error)
}

var _ shardsReader = (*store.Activity)(nil)

// reconcileConservation checks, at every resync of a seeded activity, that every
// packet and every minor unit is in exactly one place in Redis: listed on a shard,
// claimed, in a transfer between shards or refunded (store.View.Conservation).
// The imbalance is exported as redpacket_activity_redis_imbalance, which must stay 0;
// anything else is a bug or a Redis that lost writes, and the alert pages. Before it
// reads, it finishes the transfers a grab pod left half-done (an open activity only:
// a closed one refunds them). When a steady reading shows a shard behind its figure
// in status.shardWatermarks, claims lost from a shard whose list kept its place, or
// more packets than were seeded, it fences every shard (a rollback the summed
// counters can hide). It never halts the chain.
func (r *RedPacketActivityReconciler) reconcileConservation(ctx context.Context, s *activityScope) (stepResult, error) {
	if !s.seededRecorded || !s.snapshotRead || !s.snapshot.Exists() || s.snapshot.Fenced != "" {
		return stepResult{}, nil
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	log := r.logger(ctx)
	if s.snapshot.State == store.StateOpen {
		if left, err := s.store.Resolve(rctx); err != nil {
			log.Error(err, "finishing transfers between shards failed; retrying at the next reconcile")
		} else if left > 0 {
			log.Info("transfers between shards refused by their destination; the refund at close counts them", "transfers", left)
		}
	}
	view, err := s.store.ReadShards(rctx)
	if err != nil {
		log.Error(err, "reading the shards for the conservation check failed; retrying at the next reconcile")
		return stepResult{}, nil
	}
	if !view.Steady {
		return stepResult{}, nil
	}
	im := view.Conservation()
	activityMetrics.ObserveImbalance(s.activity.Namespace, s.activity.Name, im)
	// The activity as one was compared with the status by the fence step; here each
	// shard is, against its own watermark.
	why := view.ShardBehind(&s.activity.Status)
	if why == "" {
		why = view.ClaimsLost()
	}
	if why == "" && view.Duplicated() {
		why = "the shards hold more packets than were seeded"
	}
	if why != "" && !view.Whole.FullyFenced() {
		// A shard behind its watermark in status, or more packets than were seeded:
		// some could be granted twice. Fence every shard now; the next reconcile's
		// fence step reports it.
		if _, err := s.store.Fence(rctx, fenceReasonRolledBack); err != nil {
			return stepResult{}, fmt.Errorf("fencing the activity (%s): %w", why, err)
		}
		log.Info("Redis rolled back under a shard; the activity is fenced", "why", why, "packets", im.Count, "amount", im.Amount)
		return stepResult{requeueAfter: time.Second}, nil
	}
	if !im.Zero() {
		log.Info("packets or money out of place in Redis", "packets", im.Count, "amount", im.Amount,
			"inTransferPackets", view.InTransferCount)
	}
	return stepResult{}, nil
}
