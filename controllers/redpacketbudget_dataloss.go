package controllers

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// reconcileBudgetDataLoss fences a budget whose Redis holds less of it than its
// status recorded. The status's figures only grow while Redis keeps the budget: the
// total allotted, the money claimed and refunded, the packets created and the shares
// grabbed. They are the high-water marks, kept outside the budget's Redis. A Redis
// that comes back with a configured budget's shards missing lost its data (DataLost:
// a restart without persistence, a failover to an empty replica, a FLUSHALL); one
// that holds the shards below a mark went back in time (RedisRolledBack: an older
// RDB or AOF). Either way configuring the budget again would fund it anew while the
// money of its live packets, which the status last counted, is gone or counted
// twice, and the ledger's credited sums may restart below what was paid.
//
// A fenced budget is Stalled with the reason, a Warning names the live money at
// risk, and it halts here, before the function library, the settlement runner and
// configure: nothing is announced or allotted again. The status keeps its figures
// (computeBudgetStatus does not overwrite them), so the fence holds across restarts:
// the Stalled condition with either reason is read back at the next reconcile, and
// the budget stays fenced until it is deleted.
//
// The grab fleet is fenced in Redis too, at every reconcile of the fenced budget
// (store.Budget.Fence): every shard's meta holds the reason, so creations and grabs
// answer 503 and the expiry driver refunds nothing from the data that came back.
// Between the loss and the operator's next reading the fleet serves what Redis holds
// (at most one ActiveResyncPeriod, dataLostRecheckPeriod once fenced).
// TestBudgetDataLossIsFencedNeverRefunded replays a FLUSHALL,
// TestBudgetRolledBackToAnOlderRDBIsFenced a restore of an older RDB.
func (r *RedPacketBudgetReconciler) reconcileBudgetDataLoss(ctx context.Context, s *budgetScope) (stepResult, error) {
	b := s.budget
	if c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled); c != nil &&
		c.Status == metav1.ConditionTrue &&
		(c.Reason == redpacketv1alpha1.ReasonDataLost || c.Reason == redpacketv1alpha1.ReasonRedisRolledBack) {
		if c.Reason == redpacketv1alpha1.ReasonRedisRolledBack &&
			b.Annotations[redpacketv1alpha1.AnnotationAcceptRedisState] == budgetFenceToken(c.LastTransitionTime) {
			user, refused, err := platformDecidedBy(ctx, reviewerOr(r.access, r.Client), b, "redpacketbudgets", acceptDecision)
			if err != nil {
				return s.fence(c.Reason, c.Message), fmt.Errorf("checking who accepted the Redis state: %w", err)
			}
			if refused == "" && (s.snapshot.Total == 0 || len(s.snapshot.MissingShards) > 0) {
				// The state to accept lost its data since the fence began: accepted, the
				// marks would fall to what is left and the next reconcile would fund the
				// missing shards again. A loss has no acceptance.
				refused = fmt.Sprintf("Redis now holds none of the budget's shards %v: their data is lost, which no acceptance restores",
					s.snapshot.MissingShards)
			}
			if refused == "" {
				return r.acceptBudgetState(ctx, s, c, user)
			}
			if !strings.Contains(c.Message, refused) {
				r.eventf(b, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAcceptNotAllowed,
					"the Redis state was not accepted, the budget stays fenced: %s", refused)
			}
			r.fenceFleet(ctx, s, c.Reason)
			msg, _, _ := strings.Cut(c.Message, "; the acceptance was refused: ")
			return s.fence(c.Reason, msg+"; the acceptance was refused: "+refused), nil
		}
		r.fenceFleet(ctx, s, c.Reason)
		return s.fence(c.Reason, c.Message), nil
	}
	reason, why := budgetBelowMarks(b.Status, s.snapshot)
	if reason == "" {
		return stepResult{}, nil
	}
	var live int64
	if b.Status.InPackets != nil {
		live = *b.Status.InPackets
	}
	msg := fmt.Sprintf("Redis at %s %s; the budget is never configured or announced again (that could fund it twice); "+
		"%d %s was in live packets at the last reading and is at risk", strings.Join(s.conn.Addresses, ","), why, live,
		b.Spec.Currency)
	if reason == redpacketv1alpha1.ReasonRedisRolledBack {
		// The fence begins now, unless the budget is Stalled already (the condition
		// keeps its transition time): the token names this fence and no later one.
		since := metav1.NewTime(s.now.Truncate(time.Second))
		if c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled); c != nil && c.Status == metav1.ConditionTrue {
			since = c.LastTransitionTime
		}
		msg += fmt.Sprintf(". Once the balances are reconciled with the settlement streams, the platform team may accept "+
			"Redis's state as it is with %s=%s and %s=<their user name>", redpacketv1alpha1.AnnotationAcceptRedisState,
			budgetFenceToken(since), redpacketv1alpha1.AnnotationAcceptedBy)
	}
	if r.Recorder != nil {
		r.Recorder.Eventf(b, nil, corev1.EventTypeWarning, reason, "Reconcile", "%s", msg)
	}
	r.fenceFleet(ctx, s, reason)
	return s.fence(reason, msg), nil
}

// deleteBudgetDataLoss is the data-loss check of a deleted budget: a Redis that lost
// the budget's data, or went back in time, after the deletion began is fenced as it
// is before (reconcileBudgetDataLoss), so the deletion neither refunds from what came
// back nor purges the money trail; deleteBudgetFenced then holds it for the platform
// team. A budget fenced already is deleteBudgetFenced's alone, and once its purge
// began (BudgetLedger.MarkPurge) the keys' absence is the purge's, so a purge cut
// short is finished, never taken for a loss.
// TestLossAfterTheDeletionBeganHoldsTheDeletion replays a FLUSHALL while a deleted
// budget waits for its refund to settle.
func (r *RedPacketBudgetReconciler) deleteBudgetDataLoss(ctx context.Context, s *budgetScope) (stepResult, error) {
	if c := meta.FindStatusCondition(s.budget.Status.Conditions, redpacketv1alpha1.ConditionStalled); c != nil &&
		c.Status == metav1.ConditionTrue &&
		(c.Reason == redpacketv1alpha1.ReasonDataLost || c.Reason == redpacketv1alpha1.ReasonRedisRolledBack) {
		return stepResult{}, nil
	}
	if reason, _ := budgetBelowMarks(s.budget.Status, s.snapshot); reason == "" {
		return stepResult{}, nil
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	begun, err := s.store.PurgeBegun(rctx)
	if err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "%v", err), err
	}
	if begun {
		return stepResult{}, nil
	}
	res, err := r.reconcileBudgetDataLoss(ctx, s)
	// The status records the fence now; the next reconcile, soon, holds the
	// deletion with its message and Warning (deleteBudgetFenced).
	res.requeueAfter = time.Second
	return res, err
}

// budgetFenceToken is the value of AnnotationAcceptRedisState that accepts the
// budget's fence that began at since: its Unix seconds. A later fence has another.
func budgetFenceToken(since metav1.Time) string { return strconv.FormatInt(since.Unix(), 10) }

// acceptBudgetState lifts a RedisRolledBack fence on the word of user, whose
// permission platformDecidedBy confirmed: the fence leaves every shard's meta
// (store.Budget.Unfence), the high-water marks become what Redis holds (the status's
// figures are written from this reconcile's snapshot, lower ones included, since the
// budget is no longer fenced), status.lastAcceptance records the fence, who and when
// (applied alone, under BudgetAcceptanceFieldManager), and an event says so. The
// chain then goes on as for any budget. A DataLost budget has no acceptance: the
// money of its packets is gone from Redis, and only the abandon of its deletion ends
// it. TestAcceptingABudgetsRolledBackState.
func (r *RedPacketBudgetReconciler) acceptBudgetState(ctx context.Context, s *budgetScope, c *metav1.Condition, user string) (stepResult, error) {
	b := s.budget
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	if err := s.store.Unfence(rctx); err != nil {
		return s.fence(c.Reason, c.Message), fmt.Errorf("lifting the budget's fence in Redis: %w", err)
	}
	la := redpacketv1alpha1.BudgetStateAcceptance{FencedAt: c.LastTransitionTime, By: user, At: metav1.NewTime(s.now.UTC().Truncate(time.Second))}
	v, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&la)
	if err != nil {
		return s.fence(c.Reason, c.Message), fmt.Errorf("converting the acceptance: %w", err)
	}
	obj := statusApplyObjectOf("RedPacketBudget", b, map[string]any{"lastAcceptance": v})
	if err := r.Client.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(obj),
		client.FieldOwner(BudgetAcceptanceFieldManager), client.ForceOwnership); err != nil {
		return s.fence(c.Reason, c.Message), fmt.Errorf("recording the acceptance: %w", err)
	}
	s.status.LastAcceptance = la.DeepCopy()
	snap := s.snapshot
	// The accepted state's epoch is the mark from now on (the epoch step advances it
	// in this reconcile when Redis takes it).
	s.status.Epoch = new(snap.Epoch)
	r.eventf(b, corev1.EventTypeNormal, redpacketv1alpha1.ReasonRedisStateAccepted,
		"%s accepted the budget's Redis state as it is (fenced since %s: %s); the marks are now total %d, claimed %d, refunded %d, %d packets created, %d shares grabbed",
		user, c.LastTransitionTime.UTC().Format(time.RFC3339), c.Message, snap.Total, snap.Claimed, snap.Refunded, snap.CreatedPackets, snap.GrabbedShares)
	ctrl.LoggerFrom(ctx).Info("the budget's Redis state was accepted", "by", user, "fencedAt", c.LastTransitionTime)
	return stepResult{}, nil
}

// fenceFleet writes the fence into the budget's shards (store.Budget.Fence). A
// Redis that does not take it is logged and tried again at the next reconcile: the
// status's fence holds meanwhile, and the next reading of that Redis fails too.
func (r *RedPacketBudgetReconciler) fenceFleet(ctx context.Context, s *budgetScope, reason string) {
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	if err := s.store.Fence(rctx, reason); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "writing the fence into the budget's shards; retried at the next reconcile")
	}
}

// fence marks the scope fenced and halts the steps, Stalled with reason.
func (s *budgetScope) fence(reason, msg string) stepResult {
	s.fenced = true
	res := blocked(reason, "%s", msg)
	res.requeueAfter = dataLostRecheckPeriod
	s.stalled = res.blocker
	return res
}

// budgetBelowMarks compares a snapshot with the marks a status recorded and says
// why Redis holds less than them: DataLost when the budget was configured (a total
// recorded) and Redis holds none of it or is missing a shard, RedisRolledBack when a
// figure went down; "" when nothing did. A missing shard is a loss, never a
// rollback: every shard was configured in the reconcile that first recorded a
// total, and a snapshot read across a FLUSHALL sees the shards read before it whole
// and the rest missing, with a total below the mark that is not an older state the
// platform team could accept (TestBudgetBelowMarks, the loss runs of
// TestBudgetHistories).
func budgetBelowMarks(st redpacketv1alpha1.RedPacketBudgetStatus, snap store.BudgetSnapshot) (reason, why string) {
	mark := func(p *int64) int64 {
		if p == nil {
			return 0
		}
		return *p
	}
	total := mark(st.Total)
	if total == 0 {
		return "", ""
	}
	if snap.Total == 0 {
		return redpacketv1alpha1.ReasonDataLost, fmt.Sprintf("holds none of the budget whose status recorded a total of %d", total)
	}
	if len(snap.MissingShards) > 0 {
		return redpacketv1alpha1.ReasonDataLost, fmt.Sprintf("holds none of the budget's shards %v, of the budget whose status recorded a total of %d",
			snap.MissingShards, total)
	}
	for _, f := range []struct {
		name       string
		mark, have int64
	}{
		{"total", total, snap.Total},
		{"claimed money", mark(st.Claimed), snap.Claimed},
		{"refunded money", mark(st.Refunded), snap.Refunded},
		{"created packets", mark(st.CreatedPackets), snap.CreatedPackets},
		{"grabbed shares", mark(st.GrabbedShares), snap.GrabbedShares},
		{"reconcile epoch", mark(st.Epoch), snap.Epoch},
	} {
		if f.have < f.mark {
			return redpacketv1alpha1.ReasonRedisRolledBack, fmt.Sprintf("holds the budget's %s at %d, below the %d its status recorded",
				f.name, f.have, f.mark)
		}
	}
	return "", ""
}
