package controllers

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
	return runSteps(ctx, s, r.deleteSteps(), latestBlocker)
}

// deleteSteps are the steps of a deleted activity, in order. A step that settles
// what this reconcile does (holds the deletion, waits for settlement, lets the
// activity go) ends the chain with done; an error is retried with backoff.
func (r *RedPacketActivityReconciler) deleteSteps() []reconcileStep {
	return []reconcileStep{
		{name: "redis connection", run: r.deleteReadRedis},
		{name: "hold", run: r.deleteHold},
		{name: "close", run: r.deleteClose},
		{name: "redis unreachable", run: r.deleteUnreachable},
		{name: "purge or wait", run: r.deletePurgeOrWait},
		{name: "redis user and finalizer", run: r.deleteLetGo},
	}
}

// deletionGrace is when the deletion purges whether settlement drained or not, and
// how long is left until then.
func (r *RedPacketActivityReconciler) deletionGrace(s *activityScope) (purgeAt time.Time, left time.Duration) {
	purgeAt = s.activity.DeletionTimestamp.Add(r.Options.CleanupGracePeriod)
	return purgeAt, purgeAt.Sub(s.now)
}

// deleteReadRedis resolves the deleted activity's Redis connection, takes its store
// and reads it. A failure does not stop the chain: it is kept in s.redisErr, for the
// hold step (status may hold the deletion all the same) and the unreachable step.
func (r *RedPacketActivityReconciler) deleteReadRedis(ctx context.Context, s *activityScope) (stepResult, error) {
	a := s.activity
	conn, err := r.connection(ctx, a.Namespace, a.Spec.Redis)
	if err == nil {
		s.conn = conn
		s.store = r.storeFor(conn, a)
		err = r.readForDeletion(ctx, s)
	}
	s.redisErr = err
	return stepResult{}, nil
}

// deleteHold holds a deletion that decideDeletionHold holds (or, when Redis cannot
// be read, that status holds: heldByStatus), unless a platform decision releases it:
// an acceptance confirmed by decidedBy lets the usual deletion go on (close, refund,
// drain, purge), a confirmed abandon purges without a refund and lets the activity
// go. A refused decision holds it, and says why.
func (r *RedPacketActivityReconciler) deleteHold(ctx context.Context, s *activityScope) (stepResult, error) {
	a := s.activity
	if s.redisErr != nil {
		if why := heldByStatus(&a.Status); why != "" {
			// Redis cannot be read, and status says the activity is fenced or lost: the
			// grace period does not let it go.
			return r.holdDeletion(ctx, s, why, fmt.Sprintf("Redis cannot be read: %v", s.redisErr))
		}
		return stepResult{}, nil
	}
	hold, why := decideDeletionHold(a, s.snapshot)
	switch hold {
	case holdAccept:
		user, refused, err := r.decidedBy(ctx, a, acceptDecision)
		if err != nil {
			return stepResult{}, fmt.Errorf("checking who accepted the Redis state of the deleted activity: %w", err)
		}
		if refused != "" {
			r.refuseAcceptance(ctx, s, refused)
			return r.holdDeletion(ctx, s, why, "the acceptance was refused: "+refused)
		}
		if _, err := r.acceptRedisState(ctx, s, why, user); err != nil {
			return stepResult{}, fmt.Errorf("accepting the Redis state of the deleted activity: %w", err)
		}
		// Accepted: the usual deletion, which closes, refunds and drains.
	case holdAbandon:
		user, refused, err := r.decidedBy(ctx, a, abandonDecision)
		if err != nil {
			return stepResult{}, fmt.Errorf("checking who abandoned the deleted activity: %w", err)
		}
		if refused != "" {
			r.Recorder.Eventf(a, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAbandonNotAllowed, "Delete",
				"the deleted activity was not abandoned, its Redis keys stay: %s", refused)
			return r.holdDeletion(ctx, s, why, "the abandon was refused: "+refused)
		}
		return r.abandonDeletion(ctx, s, why, user)
	case holdWait:
		return r.holdDeletion(ctx, s, why, "")
	}
	return stepResult{}, nil
}

// deleteClose closes the activity as expired (closeForDeletion), so grabbing stops
// for good and the remainder goes to settlement as the sponsor's refund; a failure
// is kept in s.redisErr.
func (r *RedPacketActivityReconciler) deleteClose(ctx context.Context, s *activityScope) (stepResult, error) {
	if s.redisErr == nil {
		s.redisErr = r.closeForDeletion(ctx, s)
	}
	return stepResult{}, nil
}

// deleteUnreachable handles a Redis that could not be resolved, read or closed:
// retried with backoff, Ready False with Deleting, until the grace period is over;
// then the activity is let go with a Warning event, and its keys, if any are left,
// have to be removed by hand.
func (r *RedPacketActivityReconciler) deleteUnreachable(ctx context.Context, s *activityScope) (stepResult, error) {
	err := s.redisErr
	if err == nil {
		return stepResult{}, nil
	}
	a := s.activity
	purgeAt, graceLeft := r.deletionGrace(s)
	if graceLeft > 0 {
		s.notReady = notReady(redpacketv1alpha1.ReasonDeleting,
			"the deleted activity's Redis keys cannot be cleaned up yet, retrying until %s: %v",
			purgeAt.UTC().Format(time.RFC3339), err)
		return stepResult{}, fmt.Errorf("cleaning up the deleted activity: %w", err)
	}
	r.Settlers.Stop(a.UID)
	r.Recorder.Eventf(a, nil, corev1.EventTypeWarning, "CleanupAbandoned", "Delete",
		"Redis could not be cleaned up within the cleanup grace period of %s; the activity's keys (rpa:{%s}:*) may be left behind: %v",
		r.Options.CleanupGracePeriod, a.UID, err)
	return stepResult{done: true}, r.letGo(ctx, s)
}

// deletePurgeOrWait does what decideDeletion says of the closed activity: wait for
// settlement to drain, with the operator's settlement worker running, or stop the
// worker and purge (every key, or all but the unsettled streams once the grace period
// is over), or nothing when Redis holds nothing of it.
func (r *RedPacketActivityReconciler) deletePurgeOrWait(ctx context.Context, s *activityScope) (stepResult, error) {
	a := s.activity
	snap := s.snapshot
	purgeAt, graceLeft := r.deletionGrace(s)
	action := decideDeletion(snap, graceLeft)
	if action == deletionPurge {
		if res, hold, err := r.holdUntilReconciled(ctx, s); hold || err != nil {
			return res, err
		}
	}
	if action != deletionWait {
		// Whatever comes next deletes keys or lets the activity go: the worker must
		// not outlive this point.
		r.Settlers.Stop(a.UID)
	}
	switch action {
	case deletionLetGo:
		r.logger(ctx).Info("the deleted activity is not in Redis; letting it go")
	case deletionPurge:
		if err := r.purge(ctx, s); err != nil {
			return stepResult{}, err
		}
		r.Recorder.Eventf(a, nil, corev1.EventTypeNormal, "Purged", "Delete",
			"settlement drained (%d claims, refund %d); the activity's Redis keys were deleted", snap.ClaimedCount, snap.Refunded)
	case deletionPurgeKeepingUnsettled:
		kept, err := r.purgeKeepingUnsettled(ctx, s)
		if err != nil {
			return stepResult{}, err
		}
		r.Recorder.Eventf(a, nil, corev1.EventTypeWarning, "CleanupGracePeriodExpired", "Delete",
			"settlement did not drain within %s (%s); the activity's Redis keys were deleted except %v, kept for %s to reconcile what was never credited",
			r.Options.CleanupGracePeriod, snapshotDescribe(snap), kept, r.Options.UnsettledRetention)
	case deletionWait:
		return r.waitForSettlement(ctx, s, purgeAt, graceLeft), nil
	}
	return stepResult{}, nil
}

// holdUntilReconciled keeps a deleted activity whose settlement drained until its
// reconciliation with the balance system, asked for at once, finds the books
// agreeing (or finds no read endpoint): the keys are the record the books are
// compared against. Books that differ hold the deletion, visibly (Ready False with
// NotReconciled, and the BooksDiffer event of the settlement step), until they
// agree or the platform team abandons it (AnnotationAbandon with the activity's UID,
// checked as for a fenced activity). Without a webhook, or a worker that can run,
// there is nothing to compare and nothing is held.
func (r *RedPacketActivityReconciler) holdUntilReconciled(ctx context.Context, s *activityScope) (stepResult, bool, error) {
	a := s.activity
	if !settlement.HasWebhook(a) {
		return stepResult{}, false, nil
	}
	if err := r.ensureSettlement(ctx, s); err != nil || !r.Settlers.Running(a.UID) {
		return stepResult{}, false, nil
	}
	r.readReconciliation(s)
	ok, differ, why := r.Settlers.reconcilers.reconciledForDeletion(a.UID, r.Now())
	if ok {
		return stepResult{}, false, nil
	}
	if differ && a.Annotations[redpacketv1alpha1.AnnotationAbandon] == string(a.UID) {
		user, refused, err := r.decidedBy(ctx, a, abandonDecision)
		if err != nil {
			return stepResult{}, true, fmt.Errorf("checking who abandoned the deleted activity's reconciliation: %w", err)
		}
		if user != "" {
			r.Recorder.Eventf(a, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAbandoned, "Delete",
				"%s abandoned the deleted activity's reconciliation; its keys are purged while the books differ: %s", user, why)
			return stepResult{}, false, nil
		}
		why += "; the abandon was refused: " + refused
	}
	if differ {
		why += fmt.Sprintf(". The keys stay until the books agree, or the platform team abandons them with %s=%s and %s=<their user name>",
			redpacketv1alpha1.AnnotationAbandon, a.UID, redpacketv1alpha1.AnnotationAbandonedBy)
	}
	s.notReady = notReady(redpacketv1alpha1.ReasonNotReconciled, "the activity was deleted and settlement drained; %s", why)
	return stepResult{done: true, requeueAfter: min(r.Options.CleanupPollInterval, time.Second)}, true, nil
}

// waitForSettlement keeps the deleted activity while settlement drains: it records a
// closed activity's phase and final figures, keeps the operator's settlement worker
// running (ensureSettlement) and says in Ready what it waits for, coming back every
// CleanupPollInterval (and once the grace period is over).
func (r *RedPacketActivityReconciler) waitForSettlement(ctx context.Context, s *activityScope, purgeAt time.Time, graceLeft time.Duration) stepResult {
	log := r.logger(ctx)
	snap := s.snapshot
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
	case !settlement.HasWebhook(s.activity):
		worker = "spec.settlement has no webhook to settle them with"
	}
	s.notReady = notReady(redpacketv1alpha1.ReasonDeleting, "%s (%s); purge at %s", waitingFor(snap), worker,
		purgeAt.UTC().Format(time.RFC3339))
	return stepResult{done: true, requeueAfter: min(r.Options.CleanupPollInterval, graceLeft+10*time.Millisecond)}
}

// deleteLetGo removes the activity's own Redis user from the default Redis, its keys
// being gone (deleteActivityRedisUser, redpacketactivity_redis_user.go), and lets the activity go.
func (r *RedPacketActivityReconciler) deleteLetGo(ctx context.Context, s *activityScope) (stepResult, error) {
	a := s.activity
	if a.Spec.Redis == nil {
		if err := r.deleteActivityRedisUser(ctx, a); err != nil {
			return stepResult{}, err
		}
	}
	return stepResult{done: true}, r.letGo(ctx, s)
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

// deletionHold is whether a deletion is held, and what may release it.
type deletionHold int

const (
	// holdNone: the activity is neither fenced nor DataLost; the usual deletion.
	holdNone deletionHold = iota
	// holdWait: the activity is fenced (RedisRolledBack) or DataLost; keep the
	// finalizer and every key, refund nothing, purge nothing.
	holdWait
	// holdAccept: fenced, and the accept annotation names Redis's epoch: accept the
	// state if the platform permission confirms it, then the usual deletion (close,
	// refund, drain, purge).
	holdAccept
	// holdAbandon: fenced or DataLost, and the abandon annotation carries the
	// activity's UID: purge without a refund if the platform permission confirms it.
	holdAbandon
)

func (h deletionHold) String() string {
	switch h {
	case holdNone:
		return "none"
	case holdWait:
		return "wait"
	case holdAccept:
		return "accept"
	case holdAbandon:
		return "abandon"
	}
	return fmt.Sprintf("deletionHold(%d)", int(h))
}

// decideDeletionHold decides whether the deletion of a, whose Redis holds snap (read
// before anything was closed), is held, and says why. A deletion is held when Redis
// rolled back behind the status (snap.RolledBack, a fence included) or when status
// records that Redis lost the activity's data (DataLost) and Redis still does not hold
// it: closing would refund nothing (a fenced close refunds nothing) and purging would
// erase the claims and streams that the balances must be reconciled against. An
// acceptance of the current epoch releases a fenced activity to the usual deletion;
// an abandon that carries the activity's UID releases either to a purge without
// refund. When both are set, the acceptance wins: it refunds.
func decideDeletionHold(a *redpacketv1alpha1.RedPacketActivity, snap store.Snapshot) (deletionHold, string) {
	why := snap.RolledBack(&a.Status)
	rolledBack := why != ""
	if !rolledBack {
		if snap.Exists() || !statusRecordsDataLost(&a.Status) {
			return holdNone, ""
		}
		why = "Redis lost the activity's data (DataLost)"
	}
	if rolledBack && acceptsEpoch(a, snap.Epoch) {
		return holdAccept, why
	}
	if v, ok := a.Annotations[redpacketv1alpha1.AnnotationAbandon]; ok {
		if v == string(a.UID) {
			return holdAbandon, why
		}
		return holdWait, fmt.Sprintf("%s; the annotation %s=%q does not carry this activity's UID %s, so it does nothing",
			why, redpacketv1alpha1.AnnotationAbandon, v, a.UID)
	}
	return holdWait, why
}

// statusRecordsDataLost reports whether status says Redis lost the activity's data.
func statusRecordsDataLost(st *redpacketv1alpha1.RedPacketActivityStatus) bool {
	for _, t := range []string{redpacketv1alpha1.ConditionSeeded, redpacketv1alpha1.ConditionStalled} {
		if c := meta.FindStatusCondition(st.Conditions, t); c != nil && c.Reason == redpacketv1alpha1.ReasonDataLost {
			return true
		}
	}
	return false
}

// heldByStatus says why status alone holds a deletion when Redis cannot be read: the
// activity is Stalled because Redis rolled back or lost its data. "" otherwise.
func heldByStatus(st *redpacketv1alpha1.RedPacketActivityStatus) string {
	c := meta.FindStatusCondition(st.Conditions, redpacketv1alpha1.ConditionStalled)
	if c == nil || c.Status != metav1.ConditionTrue {
		return ""
	}
	switch c.Reason {
	case redpacketv1alpha1.ReasonRedisRolledBack:
		return "status records that Redis rolled back (RedisRolledBack)"
	case redpacketv1alpha1.ReasonDataLost:
		return "status records that Redis lost the activity's data (DataLost)"
	}
	return ""
}

// notRefunded is the money of the activity that was neither claimed nor refunded:
// from Redis when it holds the activity, else from status.
func notRefunded(s *activityScope) (amount int64, source string) {
	if s.snapshotRead && s.snapshot.Exists() {
		return s.snapshot.RemainingAmount(), "Redis"
	}
	st := &s.activity.Status
	amount = s.activity.Spec.TotalAmount
	if st.ClaimedAmount != nil {
		amount -= *st.ClaimedAmount
	}
	if st.RefundedAmount != nil {
		amount -= *st.RefundedAmount
	}
	return amount, "status"
}

// holdDeletion keeps a deleted activity that is fenced or DataLost: the finalizer and
// every Redis key stay, nothing is closed, refunded or purged, and the operator's
// settlement worker does not run. A rolled-back Redis that is not fenced yet is
// fenced, so it grants nothing meanwhile. Ready is False with reason DeletionHeld and
// a message that names the amount not refunded and the two ways on; its arrival is
// reported once as a Warning event (emitTransitionEvents), not at every reconcile.
// Stalled stays True.
func (r *RedPacketActivityReconciler) holdDeletion(ctx context.Context, s *activityScope, why, note string) (stepResult, error) {
	a := s.activity
	r.Settlers.Stop(a.UID)
	stalledReason := redpacketv1alpha1.ReasonRedisRolledBack
	if s.snapshotRead && !s.snapshot.Exists() || !s.snapshotRead && statusRecordsDataLost(&a.Status) {
		stalledReason = redpacketv1alpha1.ReasonDataLost
	}
	if s.snapshotRead && stalledReason == redpacketv1alpha1.ReasonRedisRolledBack && !s.snapshot.FullyFenced() {
		rctx, cancel := r.redisContext(ctx)
		defer cancel()
		if _, err := s.store.Fence(rctx, fenceReasonRolledBack); err != nil {
			s.notReady = notReady(redpacketv1alpha1.ReasonDeletionHeld, "the deletion is held because %s, and fencing Redis failed: %v", why, err)
			return stepResult{}, fmt.Errorf("fencing the rolled-back deleted activity: %w", err)
		}
	}
	amount, source := notRefunded(s)
	s.status.Phase = redpacketv1alpha1.PhaseFailed
	s.stalled = notReady(stalledReason, "the deletion is held because %s", why)
	msg := fmt.Sprintf("the deletion is held because %s: %d of the total %d was not refunded to the sponsor (from %s). "+
		"The finalizer and every Redis key (claims, streams, meta) are kept until the platform team accepts the Redis state "+
		"(%s=<status.redisEpoch>, after reconciling the balances; then the rest is refunded and the keys purged) "+
		"or abandons it (%s=%s: the keys are purged and nothing is refunded)",
		why, amount, a.Spec.TotalAmount, source, redpacketv1alpha1.AnnotationAcceptRedisState, redpacketv1alpha1.AnnotationAbandon, a.UID)
	if note != "" {
		msg += "; " + note
	}
	s.notReady = notReady(redpacketv1alpha1.ReasonDeletionHeld, "%s", msg)
	r.logger(ctx).Info("the deletion of a fenced or lost activity is held", "why", why, "notRefunded", amount)
	return stepResult{done: true, requeueAfter: dataLostRecheckPeriod}, nil
}

// abandonDeletion lets a held deletion go on user's word, which decidedBy confirmed:
// every key is purged, nothing is refunded, and a Warning event names the amount
// abandoned and who abandoned it.
func (r *RedPacketActivityReconciler) abandonDeletion(ctx context.Context, s *activityScope, why, user string) (stepResult, error) {
	a := s.activity
	r.Settlers.Stop(a.UID)
	amount, source := notRefunded(s)
	if err := r.purge(ctx, s); err != nil {
		return stepResult{}, err
	}
	r.Recorder.Eventf(a, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAbandoned, "Delete",
		"%s abandoned the activity (%s): %d of the total %d was never refunded to the sponsor (from %s); its Redis keys were purged",
		user, why, amount, a.Spec.TotalAmount, source)
	r.logger(ctx).Info("the deleted activity was abandoned", "by", user, "notRefunded", amount)
	if a.Spec.Redis == nil {
		if err := r.deleteActivityRedisUser(ctx, a); err != nil {
			return stepResult{}, err
		}
	}
	return stepResult{done: true}, r.letGo(ctx, s)
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

// readForDeletion reads the deleted activity from Redis.
func (r *RedPacketActivityReconciler) readForDeletion(ctx context.Context, s *activityScope) error {
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	snap, err := s.store.Snapshot(rctx)
	if err != nil {
		return fmt.Errorf("reading the activity from Redis: %w", err)
	}
	s.snapshot = snap
	s.snapshotRead = true
	return nil
}

// closeForDeletion closes the activity (as readForDeletion or an acceptance read it)
// as expired when it is not closed yet, and reads it again.
func (r *RedPacketActivityReconciler) closeForDeletion(ctx context.Context, s *activityScope) error {
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	snap := s.snapshot
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
	if r.Functions != nil {
		r.Functions.Forget(a.UID)
	}
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
