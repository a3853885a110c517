package controllers

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
)

// reconcileDelete cleans a deleted activity's Redis keys up and then lets the
// resource go. Reconcile calls it only while the finalizer holds the activity.
//
// It first closes the activity as expired, so grabbing stops for good and the
// unclaimed remainder is handed to settlement as the sponsor's refund. It then waits
// (asking to come back every CleanupPollInterval) until settlement has drained, every
// grant and the refund credited, because the settlement stream lives in the keys it
// is about to delete. Then it purges the keys, removes the activity's own Redis user
// from the default Redis (deleteActivityRedisUser), and removes the finalizer. When
// CleanupGracePeriod has passed since the deletion was requested, it purges anyway,
// except the settlement and dead-letter streams, which are kept for
// UnsettledRetention as the record of what was never credited, and says so with a
// Warning event. If Redis does not hold the activity, there is nothing
// to wait for. If Redis cannot be reached, it retries with backoff until the grace
// period is over and then lets the resource go with a Warning event: the keys, if any
// are left, have to be removed by hand. decideDeletion makes that choice.
//
// While it waits, the operator's settlement worker of the activity keeps running
// (ensureSettlement, in r.Settlers), whatever became of the grab pods (foreground
// propagation has the garbage collector delete the grab Deployment before the
// activity). The worker is stopped, and has stopped, before the keys are purged and
// before the finalizer is removed, so nothing it does can recreate a key of a purged
// activity.
//
// Its status (Ready False with reason Deleting while it waits or retries) is applied
// by Reconcile on the way out, like every other path's.
func (r *RedPacketActivityReconciler) reconcileDelete(ctx context.Context, s *activityScope) (ctrl.Result, error) {
	a := s.activity
	log := r.logger(ctx)
	purgeAt := a.DeletionTimestamp.Add(r.Options.CleanupGracePeriod)
	graceLeft := purgeAt.Sub(s.now)

	conn, err := r.connectionFor(ctx, a)
	if err == nil {
		s.conn = conn
		s.store = r.storeFor(conn, a)
		err = r.closeForDeletion(ctx, s)
	}
	if err != nil {
		if graceLeft > 0 {
			s.notReady = notReady(redpacketv1alpha1.ReasonDeleting,
				"the deleted activity's Redis keys cannot be cleaned up yet, retrying until %s: %v",
				purgeAt.UTC().Format(time.RFC3339), err)
			return ctrl.Result{}, fmt.Errorf("cleaning up the deleted activity: %w", err)
		}
		r.Settlers.Stop(a.UID)
		r.Recorder.Eventf(a, nil, corev1.EventTypeWarning, "CleanupAbandoned", "Delete",
			"Redis could not be cleaned up within the cleanup grace period of %s; the activity's keys (rpa:{%s}:*) may be left behind: %v",
			r.Options.CleanupGracePeriod, a.UID, err)
		return ctrl.Result{}, r.letGo(ctx, s)
	}

	snap := s.snapshot
	action := decideDeletion(snap, graceLeft)
	if action != deletionWait {
		// Whatever comes next deletes keys or lets the activity go: the worker must
		// not outlive this point.
		r.Settlers.Stop(a.UID)
	}
	switch action {
	case deletionLetGo:
		log.Info("the deleted activity is not in Redis; letting it go")
	case deletionPurge:
		if err := r.purge(ctx, s); err != nil {
			return ctrl.Result{}, err
		}
		r.Recorder.Eventf(a, nil, corev1.EventTypeNormal, "Purged", "Delete",
			"settlement drained (%d claims, refund %d); the activity's Redis keys were deleted", snap.ClaimedCount, snap.Refunded)
	case deletionPurgeKeepingUnsettled:
		kept, err := r.purgeKeepingUnsettled(ctx, s)
		if err != nil {
			return ctrl.Result{}, err
		}
		r.Recorder.Eventf(a, nil, corev1.EventTypeWarning, "CleanupGracePeriodExpired", "Delete",
			"settlement did not drain within %s (%s); the activity's Redis keys were deleted except %v, kept for %s to reconcile what was never credited",
			r.Options.CleanupGracePeriod, snapshotDescribe(snap), kept, r.Options.UnsettledRetention)
	case deletionWait:
		log.V(1).Info("waiting for settlement to drain before purging", "snapshot", snapshotDescribe(snap))
		if snap.State == store.StateClosed {
			s.recordClosed()
			if recorded, _ := redpacketv1alpha1.RecordedCounters(&s.activity.Status); recorded != snap.Counters() && snap.Fenced == "" {
				// The refund and the final figures, whoever reports.
				r.writeSnapshotCounters(ctx, s)
			}
		}
		worker := "the operator is settling them"
		switch err := r.ensureSettlement(ctx, s); {
		case err != nil:
			r.settlementNotStarted(s, err)
			// Status says so; the next poll tries again.
			log.V(1).Info("the operator's settlement worker of the deleted activity cannot start", "error", err.Error())
			worker = fmt.Sprintf("the operator cannot settle them: %v", err)
		case !settlement.HasWebhook(a):
			worker = "spec.settlement has no webhook to settle them with"
		}
		s.notReady = notReady(redpacketv1alpha1.ReasonDeleting, "%s (%s); purge at %s", waitingFor(snap), worker,
			purgeAt.UTC().Format(time.RFC3339))
		return ctrl.Result{RequeueAfter: min(r.Options.CleanupPollInterval, graceLeft+10*time.Millisecond)}, nil
	}
	if a.Spec.Redis == nil {
		// Its keys are gone: so goes its Redis user (redis_acl.go).
		if err := r.deleteActivityRedisUser(ctx, a); err != nil {
			return ctrl.Result{}, err
		}
	}
	return ctrl.Result{}, r.letGo(ctx, s)
}

// deletionAction is what a deletion does next.
type deletionAction int

const (
	// deletionLetGo: Redis holds nothing of the activity; remove the finalizer.
	deletionLetGo deletionAction = iota
	// deletionPurge: settlement drained (or nothing was committed, only staged);
	// delete every key, then remove the finalizer.
	deletionPurge
	// deletionPurgeKeepingUnsettled: the grace period is over before settlement
	// drained; delete the keys except the settlement and dead-letter streams, then
	// remove the finalizer.
	deletionPurgeKeepingUnsettled
	// deletionWait: wait for settlement to drain.
	deletionWait
)

func (d deletionAction) String() string {
	switch d {
	case deletionLetGo:
		return "let go"
	case deletionPurge:
		return "purge"
	case deletionPurgeKeepingUnsettled:
		return "purge keeping unsettled"
	case deletionWait:
		return "wait"
	}
	return fmt.Sprintf("deletionAction(%d)", int(d))
}

// decideDeletion decides what a deletion does next from the activity's snapshot
// (read after closing it) and the time left of the grace period.
func decideDeletion(snap store.Snapshot, graceLeft time.Duration) deletionAction {
	switch {
	case !snap.Exists() && snap.StagedCount == 0:
		return deletionLetGo
	case !snap.Exists() || settled(snap):
		return deletionPurge
	case graceLeft <= 0:
		return deletionPurgeKeepingUnsettled
	default:
		return deletionWait
	}
}

// waitingFor says which settlements a deletion waits for.
func waitingFor(snap store.Snapshot) string {
	msg := fmt.Sprintf("waiting for %d of %d claims to settle", snap.ClaimedCount-snap.SettledCount, snap.ClaimedCount)
	if snap.RefundSettled != snap.Refunded {
		msg += fmt.Sprintf(" and the refund of %d", snap.Refunded)
	}
	return msg + " before removing the activity's Redis keys"
}

// closeForDeletion reads the activity from Redis and closes it as expired when it is
// not closed yet.
func (r *RedPacketActivityReconciler) closeForDeletion(ctx context.Context, s *activityScope) error {
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	snap, err := s.store.Snapshot(rctx)
	if err != nil {
		return fmt.Errorf("reading the activity from Redis: %w", err)
	}
	if snap.Exists() && snap.State != store.StateClosed {
		res, err := s.store.Close(rctx, store.CloseExpired)
		if err != nil {
			return fmt.Errorf("closing the deleted activity: %w", err)
		}
		if res.Outcome == store.Closed {
			r.Recorder.Eventf(s.activity, nil, corev1.EventTypeNormal, "Closed", "Delete",
				"grabbing closed for deletion; %d refunded to the sponsor, waiting for settlement to drain", res.Refunded)
		}
		if snap, err = s.store.Snapshot(rctx); err != nil {
			return fmt.Errorf("reading the activity from Redis after closing it: %w", err)
		}
	}
	s.snapshot = snap
	s.snapshotRead = true
	return nil
}

// purge deletes every Redis key of the activity.
func (r *RedPacketActivityReconciler) purge(ctx context.Context, s *activityScope) error {
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	if err := s.store.Purge(rctx); err != nil {
		return fmt.Errorf("purging the activity's keys: %w", err)
	}
	return nil
}

// purgeKeepingUnsettled deletes the activity's keys but keeps the settlement and
// dead-letter streams, with an expiry, as the record of what was never credited.
func (r *RedPacketActivityReconciler) purgeKeepingUnsettled(ctx context.Context, s *activityScope) ([]string, error) {
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	kept, err := s.store.PurgeKeepingUnsettled(rctx, r.Options.UnsettledRetention)
	if err != nil {
		return nil, fmt.Errorf("purging the activity's keys: %w", err)
	}
	return kept, nil
}

// letGo removes the finalizer. From here on the activity is not the controller's: no
// status is applied on the way out.
func (r *RedPacketActivityReconciler) letGo(ctx context.Context, s *activityScope) error {
	s.released = true
	return r.removeFinalizer(ctx, s.activity)
}

// removeFinalizer lets the activity go.
func (r *RedPacketActivityReconciler) removeFinalizer(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity) error {
	orig := a.DeepCopy()
	controllerutil.RemoveFinalizer(a, Finalizer)
	if err := r.Client.Patch(ctx, a, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		if isNotFoundOrGone(err) {
			return nil
		}
		return fmt.Errorf("removing finalizer %s: %w", Finalizer, err)
	}
	return nil
}
