package controllers

import (
	"context"
	"errors"
	"fmt"
	"k8s.io/apimachinery/pkg/runtime"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// fenceReasonRolledBack is what the controller writes into Redis's fence.
const fenceReasonRolledBack = "rolled_back"

// reconcileFence keeps an activity whose Redis came back older than it was from ever
// granting, reopening or refunding from that state. It runs right after Redis is read
// and before anything is written there.
//
// Redis is older than the resource when the snapshot is fenced already (a grab
// replica saw it first), when its epoch is below status.redisEpoch, when in the same
// epoch a cumulative counter is below what status records, or when it holds open an
// activity that status records as closed (store.Snapshot.RolledBack). The status is
// kept where Redis cannot roll it back: on the API server. The cached status can only
// be behind the live one, and a status that is behind finds fewer rollbacks, never
// one that did not happen.
//
// A rolled-back activity is fenced in Redis (fence.lua: the grab script then grants
// nothing, configure does not reopen it, close does not refund from it), its phase is
// Failed, Ready is False and Stalled True with reason RedisRolledBack, and a Warning
// event says what Redis and status hold. The chain stops there, with the generation
// observed: nothing more will happen until a person acts. The way back is the
// AnnotationAcceptRedisState annotation with the current epoch as its value, after
// the balances are reconciled: Redis's state is then taken as it is, in a new epoch.
func (r *RedPacketActivityReconciler) reconcileFence(ctx context.Context, s *activityScope) (stepResult, error) {
	why := s.snapshot.RolledBack(&s.activity.Status)
	if why == "" {
		return stepResult{}, nil
	}
	refused := ""
	if acceptsEpoch(s.activity, s.snapshot.Epoch) {
		user, no, err := r.decidedBy(ctx, s.activity, acceptDecision)
		if err != nil {
			return blocked(redpacketv1alpha1.ReasonRedisRolledBack, "checking who accepted the Redis state: %v", err),
				fmt.Errorf("checking the acceptance: %w", err)
		}
		if no == "" {
			return r.acceptRedisState(ctx, s, why, user)
		}
		refused = no
		r.refuseAcceptance(ctx, s, no)
	}
	if !s.snapshot.FullyFenced() {
		// Fencing is idempotent: a shard fenced already keeps its reason, and every
		// other shard of a sharded activity is fenced too.
		rctx, cancel := r.redisContext(ctx)
		defer cancel()
		if _, err := s.store.Fence(rctx, fenceReasonRolledBack); err != nil {
			return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "fencing the rolled-back activity: %v", err),
				fmt.Errorf("fencing the activity: %w", err)
		}
		if s.snapshot.Fenced == "" {
			s.snapshot.Fenced = fenceReasonRolledBack
		}
		r.logger(ctx).Info("Redis rolled back; the activity is fenced", "why", why)
	}
	res := markRolledBack(s, why)
	if refused != "" {
		res.blocker.message += "; the acceptance was refused: " + refused
		s.stalled = res.blocker
	}
	return res, nil
}

// acceptsEpoch reports whether the activity's accept annotation names epoch.
func acceptsEpoch(a *redpacketv1alpha1.RedPacketActivity, epoch int64) bool {
	accept, ok := a.Annotations[redpacketv1alpha1.AnnotationAcceptRedisState]
	return ok && accept == strconv.FormatInt(epoch, 10)
}

// refuseAcceptance says with a Warning event that an acceptance does not stand;
// nothing else changes.
func (r *RedPacketActivityReconciler) refuseAcceptance(ctx context.Context, s *activityScope, why string) {
	if r.Recorder != nil {
		r.Recorder.Eventf(s.activity, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAcceptNotAllowed, "Accept",
			"the Redis state was not accepted, the activity stays fenced: %s", why)
	}
	r.logger(ctx).Info("an acceptance of the Redis state was refused", "why", why)
}

// markRolledBack makes the activity Failed, Ready False and Stalled True with reason
// RedisRolledBack.
func markRolledBack(s *activityScope, why string) stepResult {
	where := strings.Join(s.conn.Addresses, ",")
	s.status.Phase = redpacketv1alpha1.PhaseFailed
	msg := fmt.Sprintf("Redis at %s rolled back: %s. The activity is fenced and grants nothing; reconcile the balances "+
		"against the settlement stream, then accept the Redis state with the annotation %s=%d",
		where, why, redpacketv1alpha1.AnnotationAcceptRedisState, s.snapshot.Epoch)
	s.stalled = notReady(redpacketv1alpha1.ReasonRedisRolledBack, "%s", msg)
	res := blocked(redpacketv1alpha1.ReasonRedisRolledBack, "%s", msg)
	res.final = true
	res.requeueAfter = dataLostRecheckPeriod
	return res
}

// acceptRedisState lifts the fence on the word of user, whose permission decidedBy
// confirmed: accept.lua starts a new epoch in Redis (provided Redis is still at the
// epoch the annotation names), and the money counters are written from Redis as they
// are, lower ones included, with the new epoch. status.lastAcceptance and an event
// record who and when. The chain then goes on as for any activity.
func (r *RedPacketActivityReconciler) acceptRedisState(ctx context.Context, s *activityScope, why, user string) (stepResult, error) {
	accepted := s.snapshot.Epoch
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	epoch, err := s.store.Accept(rctx, s.snapshot.Epoch)
	if err != nil {
		if errors.Is(err, store.ErrEpochMoved) {
			return stepResult{requeueAfter: dataLostRecheckPeriod}, fmt.Errorf("accepting the Redis state: %w", err)
		}
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "accepting the Redis state: %v", err),
			fmt.Errorf("accepting the Redis state: %w", err)
	}
	snap, err := s.store.Snapshot(rctx)
	if err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "reading the activity after the accept: %v", err),
			fmt.Errorf("reading the activity after the accept: %w", err)
	}
	s.snapshot = snap
	s.status.RedisEpoch = &epoch
	if err := r.counterWriter().applyCounters(ctx, s.activity, snap.Counters(), epoch, true); err != nil {
		return stepResult{}, fmt.Errorf("writing the accepted counters: %w", err)
	}
	s.activity.Status.RedisEpoch = &epoch
	la := redpacketv1alpha1.RedisStateAcceptance{Epoch: accepted, By: user, At: metav1.NewTime(s.now.UTC().Truncate(time.Second))}
	if err := r.counterWriter().applyAcceptance(ctx, s.activity, la); err != nil {
		return stepResult{}, fmt.Errorf("recording the acceptance: %w", err)
	}
	s.status.LastAcceptance, s.activity.Status.LastAcceptance = la.DeepCopy(), la.DeepCopy()
	if r.Recorder != nil {
		r.Recorder.Eventf(s.activity, nil, corev1.EventTypeNormal, redpacketv1alpha1.ReasonRedisStateAccepted, "Accept",
			"%s accepted the Redis state of epoch %d as it is at %s (%s; it was fenced because %s); epoch %d begins",
			user, accepted, s.status.LastAcceptance.At.Format(time.RFC3339), snapshotDescribe(snap), why, epoch)
	}
	r.logger(ctx).Info("Redis state accepted", "epoch", epoch, "was", why, "by", user)
	return stepResult{}, nil
}

// counterWriter writes the money counters; see countersWriter.
func (r *RedPacketActivityReconciler) counterWriter() countersWriter {
	if r.counters != nil {
		return r.counters
	}
	return apiCountersWriter{c: r.Client, reader: r.APIReader}
}

// countersWriter writes an activity's money counters, all of them from one snapshot,
// under CountersFieldManager.
type countersWriter interface {
	// applyCounters applies c (and the epoch) to the live activity, provided c is not
	// behind what the live status records (lower is allowed only when accepting a
	// rolled-back state) and the live object did not change between the read and
	// the apply (its resourceVersion is the apply's precondition). It returns
	// errCountersStale when the live status is ahead of c; nothing is written then.
	applyCounters(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity, c redpacketv1alpha1.Counters, epoch int64, allowLower bool) error
	// applyAcceptance applies status.lastAcceptance alone, under
	// AcceptanceFieldManager.
	applyAcceptance(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity, la redpacketv1alpha1.RedisStateAcceptance) error
}

// AcceptanceFieldManager is the field manager of status.lastAcceptance, which the
// controller applies alone when a person's acceptance of a rolled-back state lifts
// the fence. No other apply names the field, so none removes it: the controller's
// status apply under FieldManager is computed from its cache, which may not hold the
// record yet in the reconcile that follows, and under server-side apply a field the
// manager owns and leaves out is removed.
const AcceptanceFieldManager = "redpacket-controller-acceptance"

// errCountersStale says that the status already records more than a snapshot.
var errCountersStale = errors.New("the status already records counters ahead of this snapshot")

// CountersFieldManager is the field manager under which the controller writes the
// money counters: when the activity becomes Ready, when it closes, while no grab
// replica reports, and when a rolled-back state is accepted. The grab service's
// reporter writes the same fields under its own manager; both write all of them
// together, with force and the resourceVersion as a precondition, so the last writer
// owns them and no write is based on a status that changed meanwhile.
const CountersFieldManager = "redpacket-controller-counters"

// apiCountersWriter writes the counters to the API server.
type apiCountersWriter struct {
	c      client.Client
	reader client.Reader
}

func (w apiCountersWriter) applyCounters(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity, c redpacketv1alpha1.Counters, epoch int64, allowLower bool) error {
	live := &redpacketv1alpha1.RedPacketActivity{}
	if err := w.reader.Get(ctx, client.ObjectKeyFromObject(a), live); err != nil {
		return fmt.Errorf("reading the live status: %w", err)
	}
	if live.UID != a.UID {
		return fmt.Errorf("activity %s was replaced", a.Name)
	}
	if !allowLower {
		if recorded, ok := redpacketv1alpha1.RecordedCounters(&live.Status); ok && c.Behind(recorded) != "" {
			return errCountersStale
		}
	}
	fields := c.StatusFields()
	fields["redisEpoch"] = epoch
	obj := statusApplyObject(a, fields)
	obj.SetResourceVersion(live.ResourceVersion)
	if err := w.c.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(obj),
		client.FieldOwner(CountersFieldManager), client.ForceOwnership); err != nil {
		return fmt.Errorf("applying the counters: %w", err)
	}
	return nil
}

func (w apiCountersWriter) applyAcceptance(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity, la redpacketv1alpha1.RedisStateAcceptance) error {
	v, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&la)
	if err != nil {
		return fmt.Errorf("converting the acceptance: %w", err)
	}
	if err := w.c.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(statusApplyObject(a, map[string]any{"lastAcceptance": v})),
		client.FieldOwner(AcceptanceFieldManager), client.ForceOwnership); err != nil {
		return fmt.Errorf("applying the acceptance: %w", err)
	}
	return nil
}

// stalledCondition sets or removes the Stalled condition from the scope's stalled
// blocker.
func (s *activityScope) stalledCondition() {
	if s.stalled == nil {
		meta.RemoveStatusCondition(&s.status.Conditions, redpacketv1alpha1.ConditionStalled)
		return
	}
	s.setCondition(redpacketv1alpha1.ConditionStalled, metav1.ConditionTrue, s.stalled.reason, "%s", s.stalled.message)
}
