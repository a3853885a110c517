package controllers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
)

// Condition reasons the controller sets, besides the phase names that Ready uses as
// its reason while the activity is serviceable.
const (
	ReasonPending            = "Pending"
	ReasonSeeding            = "Seeding"
	ReasonCommitted          = "Committed"
	ReasonSeedFailed         = "SeedFailed"
	ReasonInvalidSpec        = "InvalidSpec"
	ReasonSpecMismatch       = "SpecMismatch"
	ReasonRedisConfigInvalid = "RedisConfigInvalid"
	ReasonRedisUnavailable   = "RedisUnavailable"
	ReasonDataLost           = redpacketv1alpha1.ReasonDataLost
	ReasonNotAdopted         = "NotAdopted"
	ReasonWorkloadFailed     = "WorkloadFailed"
	ReasonReporting          = "Reporting"
	ReasonReplicasAvailable  = "ReplicasAvailable"
	ReasonNoReplicas         = "NoReplicaAvailable"
	ReasonNotConfigured      = "NotConfigured"
	ReasonDeadLetters        = "DeadLetters"
	ReasonAllSettled         = "AllSettled"
	ReasonSettlementPending  = "Pending"
	ReasonDeleting           = "Deleting"
	// ReasonGrabServiceUnavailable is Ready's reason while the packets are seeded and
	// the phase is Scheduled, Active or Paused, but no grab replica is available.
	ReasonGrabServiceUnavailable = redpacketv1alpha1.ReasonGrabServiceUnavailable
)

// dataLostRecheckPeriod is how often an activity whose data Redis lost is looked at
// again (the data may be restored from a backup).
const dataLostRecheckPeriod = time.Minute

// activityScope carries one reconcile's facts from one sub-reconciler to the next.
type activityScope struct {
	activity *redpacketv1alpha1.RedPacketActivity
	keys     lua.Keys
	// now is the controller's clock when the reconcile started.
	now time.Time

	// status holds the controller's status fields as they will be applied; it starts
	// as the current ones.
	status redpacketv1alpha1.RedPacketActivityStatus
	// notReady, when set, is why Ready is False whatever the phase says.
	notReady *readyBlocker
	// phaseMessage explains the phase in Ready's message.
	phaseMessage string

	conn     lua.Conn
	redis    redis.UniversalClient
	redisNow time.Time
	snapshot lua.Snapshot
	// snapshotRead is true once snapshot holds what Redis said in this reconcile.
	snapshotRead bool

	amounts []int64
	// seededRecorded is true once the status on the API server says Seeded, which is
	// what allows grabbing to be opened.
	seededRecorded bool

	deployment       *appsv1.Deployment
	deploymentLooked bool
	// workloadChecked is true once the grab workload step ran; notAdopted then names
	// the objects it refused to take over.
	workloadChecked bool
	notAdopted      string

	halted bool
}

type readyBlocker struct {
	reason  string
	message string
}

func newActivityScope(a *redpacketv1alpha1.RedPacketActivity, now time.Time) *activityScope {
	return &activityScope{
		activity: a,
		keys:     lua.KeysFor(string(a.UID)),
		now:      now,
		status:   controllerStatus(a.Status),
	}
}

// halt stops the chain of sub-reconcilers after the current one.
func (s *activityScope) halt() { s.halted = true }

// blockReady makes Ready False with reason and message.
func (s *activityScope) blockReady(reason, format string, args ...any) {
	s.notReady = &readyBlocker{reason: reason, message: fmt.Sprintf(format, args...)}
}

// setCondition sets one of the controller's conditions on the status to apply.
func (s *activityScope) setCondition(condType string, status metav1.ConditionStatus, reason, format string, args ...any) {
	meta.SetStatusCondition(&s.status.Conditions, metav1.Condition{
		Type:               condType,
		Status:             status,
		Reason:             reason,
		Message:            fmt.Sprintf(format, args...),
		ObservedGeneration: s.activity.Generation,
		LastTransitionTime: metav1.NewTime(s.now.Truncate(time.Second)),
	})
}

// reconcileRedisConnection resolves the activity's Redis connection (the Secret named
// by spec.redis, else the operator's default), takes a cached client for it and reads
// the server clock and the activity's snapshot, which every later step decides on. A
// missing or unusable Secret makes Ready False with RedisConfigInvalid, an unreachable
// Redis with RedisUnavailable; both halt and are retried with backoff.
func (r *RedPacketActivityReconciler) reconcileRedisConnection(ctx context.Context, s *activityScope) (ctrl.Result, error) {
	conn, err := r.connectionFor(ctx, s.activity)
	if err != nil {
		s.blockReady(ReasonRedisConfigInvalid, "%v", err)
		s.halt()
		return ctrl.Result{}, err
	}
	s.conn = conn
	s.redis = r.Redis.Get(conn)

	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	redisNow, err := s.redis.Time(rctx).Result()
	if err != nil {
		s.blockReady(ReasonRedisUnavailable, "Redis at %s does not answer: %v", strings.Join(conn.Addresses, ","), err)
		s.halt()
		return ctrl.Result{}, fmt.Errorf("reading the Redis clock: %w", err)
	}
	snap, err := lua.ReadSnapshot(rctx, s.redis, s.keys)
	if err != nil {
		s.blockReady(ReasonRedisUnavailable, "reading the activity from Redis at %s: %v", strings.Join(conn.Addresses, ","), err)
		s.halt()
		return ctrl.Result{}, fmt.Errorf("reading the activity's snapshot: %w", err)
	}
	s.redisNow = redisNow
	s.snapshot = snap
	s.snapshotRead = true
	return ctrl.Result{}, nil
}

// connectionFor returns the Redis connection of the activity.
func (r *RedPacketActivityReconciler) connectionFor(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity) (lua.Conn, error) {
	if a.Spec.Redis == nil {
		conn := r.Options.DefaultRedis
		if conn.Mode == "" {
			conn.Mode = lua.ModeStandalone
		}
		if err := conn.Validate(); err != nil {
			return lua.Conn{}, fmt.Errorf("the operator's default Redis connection: %w", err)
		}
		return conn, nil
	}
	secret := &corev1.Secret{}
	key := client.ObjectKey{Namespace: a.Namespace, Name: a.Spec.Redis.SecretRef.Name}
	if err := r.APIReader.Get(ctx, key, secret); err != nil {
		if apierrors.IsNotFound(err) {
			return lua.Conn{}, fmt.Errorf("secret %s named by spec.redis.secretRef does not exist", key.Name)
		}
		return lua.Conn{}, fmt.Errorf("reading secret %s: %w", key.Name, err)
	}
	conn, err := lua.ConnFromSecret(secret.Data)
	if err != nil {
		return lua.Conn{}, fmt.Errorf("secret %s: %w", key.Name, err)
	}
	return conn, nil
}

// reconcileSplit validates the money fields and splits the total into packets, which
// only seeding needs: an activity that Redis already holds, or that status records as
// seeded, is not split again. The split seed (spec.distribution.seed, else one derived
// from the UID) goes into status either way. A spec that cannot be split makes the
// activity Failed with reason InvalidSpec, without retries until the spec changes.
func (r *RedPacketActivityReconciler) reconcileSplit(_ context.Context, s *activityScope) (ctrl.Result, error) {
	params := splitParams(s.activity)
	s.status.SplitSeed = &params.Seed
	if s.snapshot.Exists() || statusShowsSeeded(s.activity.Status) {
		return ctrl.Result{}, nil
	}
	if err := validateSchedule(s.activity); err != nil {
		return r.invalidSpec(s, err)
	}
	amounts, err := split.Split(params)
	if err != nil {
		if errors.Is(err, split.ErrInvalidParams) {
			return r.invalidSpec(s, err)
		}
		return ctrl.Result{}, fmt.Errorf("splitting: %w", err)
	}
	s.amounts = amounts
	return ctrl.Result{}, nil
}

func (r *RedPacketActivityReconciler) invalidSpec(s *activityScope, err error) (ctrl.Result, error) {
	s.status.Phase = redpacketv1alpha1.PhaseFailed
	s.blockReady(ReasonInvalidSpec, "%v", err)
	s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionFalse, ReasonInvalidSpec, "%v", err)
	s.halt()
	return ctrl.Result{}, nil
}

// splitParams are the split parameters of the activity.
func splitParams(a *redpacketv1alpha1.RedPacketActivity) split.Params {
	d := a.Spec.Distribution
	p := split.Params{
		Type:  string(d.Type),
		Total: a.Spec.TotalAmount,
		Count: a.Spec.Count,
		Min:   d.MinAmount,
		Max:   d.MaxAmount,
	}
	if p.Type == "" {
		p.Type = split.TypeRandom
	}
	if p.Min == 0 {
		p.Min = 1
	}
	if d.Seed != nil {
		p.Seed = *d.Seed
	} else {
		p.Seed = split.SeedFromUID(string(a.UID))
	}
	return p
}

func validateSchedule(a *redpacketv1alpha1.RedPacketActivity) error {
	if a.Spec.StartTime != nil && a.Spec.EndTime != nil && !a.Spec.EndTime.After(a.Spec.StartTime.Time) {
		return fmt.Errorf("endTime %s is not after startTime %s",
			a.Spec.EndTime.UTC().Format(time.RFC3339), a.Spec.StartTime.UTC().Format(time.RFC3339))
	}
	return nil
}

// statusShowsSeeded reports whether the status says the activity was seeded at some
// point: a seeded time, a Seeded condition that is True or says the data was lost,
// or claims reported by the grab service.
func statusShowsSeeded(st redpacketv1alpha1.RedPacketActivityStatus) bool {
	if st.SeededTime != nil {
		return true
	}
	if c := meta.FindStatusCondition(st.Conditions, redpacketv1alpha1.ConditionSeeded); c != nil {
		if c.Status == metav1.ConditionTrue || c.Reason == ReasonDataLost {
			return true
		}
	}
	return st.ClaimedCount != nil && *st.ClaimedCount > 0
}

// statusRecordsSeeded reports whether the status says Seeded=True with a seeded time,
// which is what must be on the API server before grabbing opens.
func statusRecordsSeeded(st redpacketv1alpha1.RedPacketActivityStatus) bool {
	return st.SeededTime != nil && meta.IsStatusConditionTrue(st.Conditions, redpacketv1alpha1.ConditionSeeded)
}

// reconcileSeed puts the packets into Redis exactly once per activity UID and records
// that in status before anything can be grabbed.
//
// If Redis holds the committed activity, it is adopted as it is. If it does not, but
// the status (in the cache, or read fresh from the API server) says the activity was
// seeded, Redis lost the data: seeding again could pay a claimed packet twice, so the
// activity is marked Failed with reason DataLost, a Warning event is emitted, and
// grabbing stays closed (the grab script answers "missing"). Otherwise the packets are
// staged in chunks and committed; the commit leaves the activity "ready" (closed to
// grabs), and Seeded=True with the seeded time is applied to status before the next
// step may open it. So if Redis loses the data before the status says Seeded, nobody
// can have grabbed, and seeding again is safe.
func (r *RedPacketActivityReconciler) reconcileSeed(ctx context.Context, s *activityScope) (ctrl.Result, error) {
	if !s.snapshot.Exists() {
		lost, err := r.statusSaysSeeded(ctx, s)
		if err != nil {
			return ctrl.Result{}, err
		}
		if lost {
			r.markDataLost(s)
			return ctrl.Result{RequeueAfter: dataLostRecheckPeriod}, nil
		}
		if err := r.seed(ctx, s); err != nil {
			return ctrl.Result{}, err
		}
	}

	if s.snapshot.Count != s.activity.Spec.Count || s.snapshot.Total != s.activity.Spec.TotalAmount {
		s.blockReady(ReasonSpecMismatch, "Redis holds %d packets summing to %d for this activity, the spec says %d summing to %d",
			s.snapshot.Count, s.snapshot.Total, s.activity.Spec.Count, s.activity.Spec.TotalAmount)
		s.halt()
		return ctrl.Result{}, nil
	}

	seededAt := metav1.NewTime(time.UnixMilli(s.snapshot.SeededMs).Truncate(time.Second))
	if s.status.SeededTime == nil {
		s.status.SeededTime = &seededAt
	}
	s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionTrue, ReasonCommitted,
		"%d packets summing to %d are committed to Redis", s.snapshot.Count, s.snapshot.Total)

	if !statusRecordsSeeded(s.activity.Status) {
		// Record first, open afterwards: see the doc comment.
		if err := r.applyStatus(ctx, s); err != nil {
			return ctrl.Result{}, fmt.Errorf("recording Seeded before opening: %w", err)
		}
	}
	s.seededRecorded = true
	return ctrl.Result{}, nil
}

// statusSaysSeeded checks the cached status and then, to rule out a stale cache, the
// status on the API server.
func (r *RedPacketActivityReconciler) statusSaysSeeded(ctx context.Context, s *activityScope) (bool, error) {
	if statusShowsSeeded(s.activity.Status) {
		return true, nil
	}
	fresh := &redpacketv1alpha1.RedPacketActivity{}
	if err := r.APIReader.Get(ctx, client.ObjectKeyFromObject(s.activity), fresh); err != nil {
		return false, fmt.Errorf("reading the activity's current status: %w", err)
	}
	if fresh.UID != s.activity.UID {
		return false, fmt.Errorf("activity %s was replaced (uid %s, now %s)", s.activity.Name, s.activity.UID, fresh.UID)
	}
	return statusShowsSeeded(fresh.Status), nil
}

func (r *RedPacketActivityReconciler) markDataLost(s *activityScope) {
	where := strings.Join(s.conn.Addresses, ",")
	s.status.Phase = redpacketv1alpha1.PhaseFailed
	s.blockReady(ReasonDataLost,
		"the activity was seeded but Redis at %s holds no data for it; it is never seeded again (that could pay twice) and grabbing stays closed", where)
	s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionFalse, ReasonDataLost,
		"Redis at %s no longer holds the activity's packets", where)
	s.halt()
}

// seed stages and commits the packets, showing phase Seeding meanwhile.
func (r *RedPacketActivityReconciler) seed(ctx context.Context, s *activityScope) error {
	a := s.activity
	if s.amounts == nil {
		return fmt.Errorf("no packets to seed")
	}
	s.status.Phase = redpacketv1alpha1.PhaseSeeding
	s.blockReady(ReasonSeeding, "seeding %d packets into Redis", a.Spec.Count)
	s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionFalse, ReasonSeeding,
		"seeding %d packets into Redis (%d staged)", a.Spec.Count, s.snapshot.StagedCount)
	if err := r.applyStatus(ctx, s); err != nil {
		return fmt.Errorf("showing phase Seeding: %w", err)
	}

	sctx, cancel := context.WithTimeout(ctx, r.seedTimeout(a.Spec.Count))
	defer cancel()
	startMs, endMs := scheduleMs(a)
	res, err := r.Seeder.Seed(sctx, s.redis, s.keys, s.amounts, lua.SeedParams{
		Count:   a.Spec.Count,
		Total:   a.Spec.TotalAmount,
		StartMs: startMs,
		EndMs:   endMs,
		Paused:  a.Spec.Paused,
		Sponsor: a.Spec.Sponsor,
	})
	if err != nil {
		s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionFalse, ReasonSeedFailed, "seeding stopped: %v", err)
		s.blockReady(ReasonSeedFailed, "seeding stopped, it resumes where it stood: %v", err)
		return fmt.Errorf("seeding %d packets: %w", a.Spec.Count, err)
	}
	rctx, rcancel := r.redisContext(ctx)
	defer rcancel()
	snap, err := lua.ReadSnapshot(rctx, s.redis, s.keys)
	if err != nil {
		return fmt.Errorf("reading the activity after seeding: %w", err)
	}
	if !snap.Exists() {
		return fmt.Errorf("the activity is not in Redis right after seeding")
	}
	s.snapshot = snap
	s.notReady = nil
	r.logger(ctx).Info("seeded", "count", a.Spec.Count, "total", a.Spec.TotalAmount, "committedNow", res.Committed)
	return nil
}

// seedTimeout is the deadline of one seeding run; it grows with the packet count.
func (r *RedPacketActivityReconciler) seedTimeout(count int64) time.Duration {
	return min(4*r.Options.RedisTimeout+time.Duration(count)*20*time.Microsecond, 15*time.Minute)
}

// scheduleMs is the activity's window in unix milliseconds, 0 for an open side.
func scheduleMs(a *redpacketv1alpha1.RedPacketActivity) (startMs, endMs int64) {
	if a.Spec.StartTime != nil {
		startMs = a.Spec.StartTime.UnixMilli()
	}
	if a.Spec.EndTime != nil {
		endMs = a.Spec.EndTime.UnixMilli()
	}
	return startMs, endMs
}

// reconcileScripts loads every script of the activity into Redis (on every master in
// cluster mode) and puts the grab script's SHA into status. The grab path falls back
// to EVAL on NOSCRIPT anyway; loading ahead saves that round trip after a restart,
// failover or SCRIPT FLUSH.
func (r *RedPacketActivityReconciler) reconcileScripts(ctx context.Context, s *activityScope) (ctrl.Result, error) {
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	if err := lua.LoadAll(rctx, s.redis); err != nil {
		s.blockReady(ReasonRedisUnavailable, "loading the scripts: %v", err)
		s.halt()
		return ctrl.Result{}, fmt.Errorf("loading the scripts: %w", err)
	}
	s.status.ScriptSHA = lua.GrabScript.SHA()
	return ctrl.Result{}, nil
}

// reconcileGate writes the schedule and the pause flag into Redis and opens a ready
// activity to grabs, which is allowed only once status records Seeded. A closed
// activity stays closed; spec.paused toggles the gate both ways.
func (r *RedPacketActivityReconciler) reconcileGate(ctx context.Context, s *activityScope) (ctrl.Result, error) {
	if !s.seededRecorded {
		return ctrl.Result{}, fmt.Errorf("refusing to open an activity whose status does not record Seeded")
	}
	if s.snapshot.State == lua.StateClosed {
		return ctrl.Result{}, nil
	}
	startMs, endMs := scheduleMs(s.activity)
	paused := s.activity.Spec.Paused
	if s.snapshot.State == lua.StateOpen && s.snapshot.Paused == paused &&
		s.snapshot.StartMs == startMs && s.snapshot.EndMs == endMs {
		return ctrl.Result{}, nil
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	res, err := lua.Configure(rctx, s.redis, s.keys, startMs, endMs, paused, true)
	if err != nil {
		s.blockReady(ReasonRedisUnavailable, "configuring the activity: %v", err)
		return ctrl.Result{}, fmt.Errorf("configuring the activity: %w", err)
	}
	if !res.Found {
		return ctrl.Result{}, fmt.Errorf("configuring the activity: %w", lua.ErrMissing)
	}
	if res.State != lua.StateClosed {
		s.snapshot.StartMs, s.snapshot.EndMs, s.snapshot.Paused = startMs, endMs, paused
	}
	s.snapshot.State = res.State
	return ctrl.Result{}, nil
}

// reconcileSchedule decides the phase from Redis and the Redis server clock (the one
// the grab script gates on), and closes the activity when it is due: at endTime as
// Expired, refunding the unclaimed remainder to the sponsor through the settlement
// stream (status.refundedAmount is the close's exact figure), or as Exhausted once no
// packet remains. It asks to come back at startTime and endTime, and every
// ActiveResyncPeriod while Active or while a closed activity has not settled yet.
func (r *RedPacketActivityReconciler) reconcileSchedule(ctx context.Context, s *activityScope) (ctrl.Result, error) {
	startMs, endMs := scheduleMs(s.activity)
	nowMs := s.redisNow.UnixMilli()
	resync := r.Options.ActiveResyncPeriod
	until := func(ms int64) time.Duration {
		return max(time.Duration(ms-nowMs)*time.Millisecond, 50*time.Millisecond)
	}

	if s.snapshot.State != lua.StateClosed {
		var reason lua.CloseReason
		switch {
		case endMs > 0 && nowMs >= endMs:
			reason = lua.CloseExpired
		case s.snapshot.RemainingCount == 0:
			reason = lua.CloseExhausted
		}
		if reason != "" {
			rctx, cancel := r.redisContext(ctx)
			defer cancel()
			res, err := lua.Close(rctx, s.redis, s.keys, reason)
			if err != nil {
				s.blockReady(ReasonRedisUnavailable, "closing the activity: %v", err)
				return ctrl.Result{}, fmt.Errorf("closing the activity as %s: %w", reason, err)
			}
			switch res.Outcome {
			case lua.Closed:
				s.snapshot.State = lua.StateClosed
				s.snapshot.CloseReason = res.Reason
				s.snapshot.Refunded = res.Refunded
				s.snapshot.RemainingCount = 0
				r.logger(ctx).Info("closed", "reason", res.Reason, "refunded", res.Refunded)
			case lua.CloseMissing:
				return ctrl.Result{}, fmt.Errorf("closing the activity: %w", lua.ErrMissing)
			}
		}
	}

	if s.snapshot.State == lua.StateClosed {
		s.recordClosed()
		switch {
		case settled(s.snapshot), s.activity.Spec.Settlement == nil:
			// Nothing to wait for, or nothing that can move without a spec change.
			return ctrl.Result{}, nil
		case s.snapshot.DeadCount > 0:
			return ctrl.Result{RequeueAfter: 6 * resync}, nil
		default:
			return ctrl.Result{RequeueAfter: resync}, nil
		}
	}

	var result ctrl.Result
	if endMs > 0 {
		result.RequeueAfter = until(endMs)
	}
	switch {
	case s.activity.Spec.Paused:
		s.status.Phase = redpacketv1alpha1.PhasePaused
		s.phaseMessage = fmt.Sprintf("grabbing is paused with %d of %d packets left", s.snapshot.RemainingCount, s.snapshot.Count)
	case startMs > 0 && nowMs < startMs:
		s.status.Phase = redpacketv1alpha1.PhaseScheduled
		s.phaseMessage = fmt.Sprintf("%d packets are seeded; grabbing opens at %s", s.snapshot.Count, s.activity.Spec.StartTime.UTC().Format(time.RFC3339))
		result = lowestNonZeroResult(result, ctrl.Result{RequeueAfter: until(startMs)})
	default:
		s.status.Phase = redpacketv1alpha1.PhaseActive
		s.phaseMessage = fmt.Sprintf("grabbing is open with %d of %d packets left", s.snapshot.RemainingCount, s.snapshot.Count)
		result = lowestNonZeroResult(result, ctrl.Result{RequeueAfter: resync})
	}
	return result, nil
}

// recordClosed puts a closed activity's phase and exact refund into the status to
// apply: Exhausted when every packet was claimed, else Expired.
func (s *activityScope) recordClosed() {
	refunded := s.snapshot.Refunded
	s.status.RefundedAmount = &refunded
	if s.snapshot.CloseReason == lua.CloseExhausted {
		s.status.Phase = redpacketv1alpha1.PhaseExhausted
		s.phaseMessage = fmt.Sprintf("all %d packets were claimed", s.snapshot.Count)
		return
	}
	s.status.Phase = redpacketv1alpha1.PhaseExpired
	s.phaseMessage = fmt.Sprintf("grabbing closed at endTime; %d of %d packets were claimed and %d was refunded to the sponsor",
		s.snapshot.ClaimedCount, s.snapshot.Count, refunded)
}

// settled reports whether every claim and the refund have been credited.
func settled(snap lua.Snapshot) bool {
	return snap.SettledCount == snap.ClaimedCount && snap.RefundSettled == snap.Refunded
}
