package controllers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
)

// dataLostRecheckPeriod is how often an activity whose data Redis lost is looked at
// again (the data may be restored from a backup).
const dataLostRecheckPeriod = time.Minute

// activityScope carries one reconcile's facts from one step to the next: the
// activity, the status the controller will apply (written by the steps, applied once
// on the way out), and what the steps learned from Redis and the API server. What
// every kind's scope has (the clock, conditions, notReady, stalled, the connection,
// halted, final, released) is in the embedded reconcileScope.
type activityScope struct {
	reconcileScope
	activity *redpacketv1alpha1.RedPacketActivity

	// status holds the controller's status fields as they will be applied; it starts
	// as the current ones.
	status redpacketv1alpha1.RedPacketActivityStatus
	// phaseMessage explains the phase in Ready's message.
	phaseMessage string

	// store reaches the activity's data in Redis; set by the Redis connection step.
	store activityStore
	// redisErr is why a deletion could not resolve, read or close the activity in
	// Redis; the later deletion steps act on it (deleteSteps).
	redisErr error
	redisNow time.Time
	snapshot store.Snapshot

	amounts []int64
	// settlementBlocked, when set, is why the operator delivers nothing for the
	// activity (the webhook's host is not allowed): Settled is False with it.
	settlementBlocked string
	// delivery is how the operator's settlement workers of the activity fare, when
	// one runs (reconcileSettlement): SettlementDegraded and status.settlementDelivery.
	delivery *settlement.DeliveryHealthSnapshot
	// reconciliation is the activity's last reconciliation with the balance system,
	// read by the settlement step while a worker runs: Reconciled.
	reconciliation *reconciliationView
	// seededRecorded is true once the status on the API server says Seeded, which is
	// what allows grabbing to be opened.
	seededRecorded bool

	deployment       *appsv1.Deployment
	deploymentLooked bool
	// workloadChecked is true once the grab workload ownership step looked for the
	// workload's objects; notAdopted then names the objects it refused to take over.
	workloadChecked bool
	notAdopted      string
	// grabOwned is true once the grab workload ownership step found the workload the
	// activity's to touch: its image allowed, and every object of its names absent or
	// controlled by the activity. The redis user and grab workload steps act only then.
	grabOwned bool
	// grabRedisSecret is the activity's own <activity>-grab-redis as the ownership
	// step found it; nil when there is none, or another owner's (never touched).
	grabRedisSecret *corev1.Secret
	// grabRedisSettled is true once the redis user step settled how the grab pods
	// reach Redis; the grab workload step applies nothing before.
	grabRedisSettled bool
	// defaultRedisLogin is the activity's own login on the operator's default Redis,
	// which <activity>-grab-redis holds, as the redis user step set it up; nil with
	// spec.redis.
	defaultRedisLogin *specs.RedisLogin
	// capacity is what the operator's HorizontalPodAutoscaler and
	// PodDisruptionBudget of the grab Deployment hold at the reconcile's clock
	// (specs.ActivityCapacity); nil without spec.grabService.autoscaling. Every step
	// and the status read this one value, so they agree on the prewarm window.
	capacity *specs.Capacity
}

// statusPatcher persists the scope's status at once, in the middle of a reconcile,
// with Ready False for progress meanwhile (nil: as the scope says). A step that must
// make its progress durable before it goes on receives one in its signature; every
// other status write happens once, on the way out of Reconcile.
type statusPatcher func(ctx context.Context, s *activityScope, progress *readyBlocker) error

// normalSteps are the steps of an activity that is not being deleted, in order. The
// seed step receives patch: Seeding must show while it writes, and Seeded must be on
// the API server before the gate step opens grabbing. The counters step writes its
// own fields, under its own field manager, through the counters writer. Loading the
// scripts, the four grab workload steps (may the workload be touched, the
// activity's Redis user, the workload's objects, its autoscaler) and the expose
// step keep going when they fail: closing at endTime and refunding the sponsor
// never wait on them.
func (r *RedPacketActivityReconciler) normalSteps(patch statusPatcher) []reconcileStep {
	return []reconcileStep{
		{name: "redis connection", run: r.reconcileRedisConnection},
		{name: "rollback fence", run: r.reconcileFence},
		{name: "validate and split", run: r.reconcileSplit},
		{name: "seed", run: func(ctx context.Context, s *activityScope) (stepResult, error) {
			return r.reconcileSeed(ctx, s, patch)
		}},
		{name: "load scripts", run: r.reconcileScripts, keepGoing: true},
		{name: "durability", run: r.reconcileDurability},
		{name: "open and configure", run: r.reconcileGate},
		{name: "grab workload ownership", run: r.reconcileGrabOwnership, keepGoing: true},
		{name: "redis user", run: r.reconcileRedisUser, keepGoing: true},
		{name: "grab workload", run: r.reconcileGrabWorkload, keepGoing: true},
		{name: "grab autoscaler", run: r.reconcileGrabAutoscaler, keepGoing: true},
		{name: "expose", run: r.reconcileExpose, keepGoing: true},
		{name: "schedule and close", run: r.reconcileSchedule},
		{name: "counters", run: r.reconcileCounters},
		{name: "settlement", run: r.reconcileSettlement, keepGoing: true},
		{name: "conservation", run: r.reconcileConservation},
	}
}

func newActivityScope(a *redpacketv1alpha1.RedPacketActivity, now time.Time) *activityScope {
	s := &activityScope{activity: a, status: controllerStatus(a.Status)}
	s.reconcileScope = newReconcileScope(a, &s.status.Conditions, now)
	if c, ok := specs.ActivityCapacity(a, now); ok {
		s.capacity = &c
	}
	return s
}

// reconcileRedisConnection resolves the activity's Redis connection (the Secret named
// by spec.redis, else the operator's default), takes the activity's store on it and
// reads the server clock and the activity's snapshot, which every later step decides
// on. A missing or unusable Secret makes Ready False with RedisConfigInvalid, an
// address the operator does not allow with RedisNotAllowed, an unreachable Redis with
// RedisUnavailable; all halt and are retried with backoff.
func (r *RedPacketActivityReconciler) reconcileRedisConnection(ctx context.Context, s *activityScope) (stepResult, error) {
	conn, err := r.connection(ctx, s.activity.Namespace, s.activity.Spec.Redis)
	if err != nil {
		return blocked(connectionFailureReason(err), "%v", err), err
	}
	s.conn = conn
	s.store = r.storeFor(conn, s.activity)
	where := strings.Join(conn.Addresses, ",")

	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	redisNow, err := s.store.Time(rctx)
	if err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "Redis at %s is unavailable: %v", where, err), err
	}
	snap, err := s.store.Snapshot(rctx)
	if err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "reading the activity from Redis at %s: %v", where, err),
			fmt.Errorf("reading the activity's snapshot: %w", err)
	}
	s.redisNow = redisNow
	s.snapshot = snap
	s.snapshotRead = true
	return stepResult{}, nil
}

// reconcileSplit validates the money fields and splits the total into packets, which
// only seeding needs: an activity that Redis already holds, or that status records as
// seeded, is not split again. The split seed (spec.distribution.seed, else one derived
// from the UID) goes into status either way. A spec that cannot be split makes the
// activity Failed with reason InvalidSpec, without retries until the spec changes.
func (r *RedPacketActivityReconciler) reconcileSplit(_ context.Context, s *activityScope) (stepResult, error) {
	params := splitParams(s.activity)
	s.status.SplitSeed = &params.Seed
	if s.snapshot.Exists() || statusShowsSeeded(s.activity.Status) {
		return stepResult{}, nil
	}
	if err := validateSchedule(s.activity); err != nil {
		return invalidSpec(s, err), nil
	}
	amounts, err := split.Split(params)
	if err != nil {
		if errors.Is(err, split.ErrInvalidParams) {
			return invalidSpec(s, err), nil
		}
		return stepResult{}, fmt.Errorf("splitting: %w", err)
	}
	s.amounts = amounts
	return stepResult{}, nil
}

// invalidSpec makes the activity Failed: the spec cannot be split.
func invalidSpec(s *activityScope, err error) stepResult {
	s.status.Phase = redpacketv1alpha1.PhaseFailed
	s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionFalse, redpacketv1alpha1.ReasonInvalidSpec, "%v", err)
	return blocked(redpacketv1alpha1.ReasonInvalidSpec, "%v", err)
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
		if c.Status == metav1.ConditionTrue || c.Reason == redpacketv1alpha1.ReasonDataLost {
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
// that in status before anything can be grabbed. It is where an activity is seeded:
// the one caller of the store's Seed (store.Activity.Seed).
//
// If Redis holds the committed activity, it is adopted as it is. If it does not, but
// the status (in the cache, or read fresh from the API server) says the activity was
// seeded, Redis lost the data: seeding again could pay a claimed packet twice, so the
// activity is marked Failed with reason DataLost, a Warning event is emitted, and
// grabbing stays closed (the grab script answers "missing"). Otherwise the packets are
// staged in chunks and committed; the commit leaves the activity "ready" (closed to
// grabs), and Seeded=True with the seeded time is written to status through patch
// before the next step may open it. So if Redis loses the data before the status says
// Seeded, nobody can have grabbed, and seeding again is safe.
func (r *RedPacketActivityReconciler) reconcileSeed(ctx context.Context, s *activityScope, patch statusPatcher) (stepResult, error) {
	if !s.snapshot.Exists() {
		lost, err := r.statusSaysSeeded(ctx, s)
		if err != nil {
			return stepResult{}, err
		}
		if lost {
			return markDataLost(s), nil
		}
		if res, err := r.seed(ctx, s, patch); err != nil {
			return res, err
		}
	}

	if s.snapshot.Count != s.activity.Spec.Count || s.snapshot.Total != s.activity.Spec.TotalAmount {
		return blocked(redpacketv1alpha1.ReasonSpecMismatch,
			"Redis holds %d packets summing to %d for this activity, the spec says %d summing to %d",
			s.snapshot.Count, s.snapshot.Total, s.activity.Spec.Count, s.activity.Spec.TotalAmount), nil
	}

	seededAt := metav1.NewTime(time.UnixMilli(s.snapshot.SeededMs).Truncate(time.Second))
	if s.status.SeededTime == nil {
		s.status.SeededTime = &seededAt
	}
	s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionTrue, redpacketv1alpha1.ReasonCommitted,
		"%d packets summing to %d are committed to Redis", s.snapshot.Count, s.snapshot.Total)

	if !statusRecordsSeeded(s.activity.Status) {
		// Record first, open afterwards: see the doc comment.
		if err := patch(ctx, s, nil); err != nil {
			return stepResult{}, fmt.Errorf("recording Seeded before opening: %w", err)
		}
	}
	s.seededRecorded = true
	return stepResult{}, nil
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

// markDataLost makes the activity Failed: Redis lost what status says was seeded.
func markDataLost(s *activityScope) stepResult {
	where := strings.Join(s.conn.Addresses, ",")
	s.status.Phase = redpacketv1alpha1.PhaseFailed
	s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionFalse, redpacketv1alpha1.ReasonDataLost,
		"Redis at %s no longer holds the activity's packets", where)
	res := blocked(redpacketv1alpha1.ReasonDataLost,
		"the activity was seeded but Redis at %s holds no data for it; it is never seeded again (that could pay twice) and grabbing stays closed", where)
	res.requeueAfter = dataLostRecheckPeriod
	res.final = true
	s.stalled = res.blocker
	return res
}

// seed stages and commits the packets through the store, showing phase Seeding
// (written through patch) meanwhile.
func (r *RedPacketActivityReconciler) seed(ctx context.Context, s *activityScope, patch statusPatcher) (stepResult, error) {
	a := s.activity
	if s.amounts == nil {
		return stepResult{}, fmt.Errorf("no packets to seed")
	}
	s.status.Phase = redpacketv1alpha1.PhaseSeeding
	seeding := notReady(redpacketv1alpha1.ReasonSeeding, "seeding %d packets into Redis", a.Spec.Count)
	s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionFalse, redpacketv1alpha1.ReasonSeeding,
		"seeding %d packets into Redis (%d staged)", a.Spec.Count, s.snapshot.StagedCount)
	if err := patch(ctx, s, seeding); err != nil {
		return stepResult{blocker: seeding}, fmt.Errorf("showing phase Seeding: %w", err)
	}

	sctx, cancel := context.WithTimeout(ctx, r.seedTimeout(a.Spec.Count))
	defer cancel()
	startMs, endMs := scheduleMs(a)
	res, err := s.store.Seed(sctx, s.amounts, store.SeedParams{
		Count:    a.Spec.Count,
		Total:    a.Spec.TotalAmount,
		StartMs:  startMs,
		EndMs:    endMs,
		Paused:   a.Spec.Paused,
		Sponsor:  a.Spec.Sponsor,
		Currency: currencyOf(a),
	})
	if err != nil {
		s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionFalse, redpacketv1alpha1.ReasonSeedFailed, "seeding stopped: %v", err)
		return stepResult{blocker: notReady(redpacketv1alpha1.ReasonSeedFailed, "seeding stopped, it resumes where it stood: %v", err)},
			fmt.Errorf("seeding %d packets: %w", a.Spec.Count, err)
	}
	rctx, rcancel := r.redisContext(ctx)
	defer rcancel()
	snap, err := s.store.Snapshot(rctx)
	if err != nil {
		return stepResult{blocker: seeding}, fmt.Errorf("reading the activity after seeding: %w", err)
	}
	if !snap.Exists() {
		return stepResult{blocker: seeding}, fmt.Errorf("the activity is not in Redis right after seeding")
	}
	s.snapshot = snap
	r.logger(ctx).Info("seeded", "count", a.Spec.Count, "total", a.Spec.TotalAmount, "committedNow", res.Committed)
	return stepResult{}, nil
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

// reconcileScripts loads the operator's scripts into the script cache and the
// grab-side function library (store.Library) into Redis, on every master in cluster
// mode, puts the grab script's SHA into status, and has the function keeper watch
// this Redis from now on. The operator's scripts fall back to EVAL on NOSCRIPT; the
// grab side's FCALLs work only while the library is loaded, which the keeper sees to
// between reconciles.
func (r *RedPacketActivityReconciler) reconcileScripts(ctx context.Context, s *activityScope) (stepResult, error) {
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	if err := s.store.LoadScripts(rctx); err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "loading the scripts: %v", err), fmt.Errorf("loading the scripts: %w", err)
	}
	s.status.ScriptSHA = store.GrabScriptSHA
	if r.Functions != nil {
		r.Functions.Track(s.activity.UID, s.conn)
	}
	return stepResult{}, nil
}

// reconcileGate writes the schedule, the pause flag and the payee (spec.sponsor, who
// gets the refund at close, and spec.currency, recorded in later grants' settlement
// entries) into Redis and opens a ready activity to grabs, which is allowed only once
// status records Seeded. A closed activity stays closed; spec.paused toggles the gate
// both ways; a fenced one is never written. Afterwards the
// snapshot holds the spec's window and pause flag, as Redis does.
func (r *RedPacketActivityReconciler) reconcileGate(ctx context.Context, s *activityScope) (stepResult, error) {
	if !s.seededRecorded {
		return stepResult{}, fmt.Errorf("refusing to open an activity whose status does not record Seeded")
	}
	if s.snapshot.State == store.StateClosed {
		return stepResult{}, nil
	}
	startMs, endMs := scheduleMs(s.activity)
	paused := s.activity.Spec.Paused
	sponsor, currency := s.activity.Spec.Sponsor, currencyOf(s.activity)
	if s.snapshot.State == store.StateOpen && s.snapshot.Paused == paused &&
		s.snapshot.StartMs == startMs && s.snapshot.EndMs == endMs &&
		(sponsor == "" || s.snapshot.Sponsor == sponsor && s.snapshot.Currency == currency) {
		return stepResult{}, nil
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	res, err := s.store.ConfigureWith(rctx, store.Settings{StartMs: startMs, EndMs: endMs, Paused: paused, Open: true,
		Sponsor: sponsor, Currency: currency})
	if err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "configuring the activity: %v", err), fmt.Errorf("configuring the activity: %w", err)
	}
	if !res.Found {
		return stepResult{}, fmt.Errorf("configuring the activity: %w", store.ErrMissing)
	}
	if res.Fenced {
		// A grab replica fenced it since the snapshot: the next reconcile says so.
		return stepResult{halt: true, requeueAfter: r.Options.ActiveResyncPeriod}, fmt.Errorf("configuring the activity: it is fenced in Redis")
	}
	if sponsor != "" {
		s.snapshot.Sponsor, s.snapshot.Currency = sponsor, currency
	}
	if res.State != store.StateClosed {
		s.snapshot.StartMs, s.snapshot.EndMs, s.snapshot.Paused = startMs, endMs, paused
	}
	s.snapshot.State = res.State
	return stepResult{}, nil
}

// reconcileSchedule decides the phase from Redis and the Redis server clock (the one
// the grab script gates on) with store.Snapshot.Phase, where the grab service decides
// it too, and closes the activity when that phase says it is over: at endTime as
// Expired, refunding the unclaimed remainder to the sponsor through the settlement
// stream (status.refundedAmount is the close's exact figure), or as Exhausted once no
// packet remains. It asks to come back at startTime and endTime, and every
// ActiveResyncPeriod while Active or while a closed activity has not settled yet.
func (r *RedPacketActivityReconciler) reconcileSchedule(ctx context.Context, s *activityScope) (stepResult, error) {
	nowMs := s.redisNow.UnixMilli()
	resync := r.Options.ActiveResyncPeriod
	until := func(ms int64) time.Duration {
		return max(time.Duration(ms-nowMs)*time.Millisecond, 50*time.Millisecond)
	}

	phase, ok := s.snapshot.Phase(s.redisNow)
	if !ok {
		return stepResult{}, fmt.Errorf("the activity is in state %q in Redis, from which no phase follows", s.snapshot.State)
	}
	if s.snapshot.State == store.StateOpen && (phase == redpacketv1alpha1.PhaseExpired || phase == redpacketv1alpha1.PhaseExhausted) {
		reason := store.CloseExpired
		if phase == redpacketv1alpha1.PhaseExhausted {
			reason = store.CloseExhausted
		}
		rctx, cancel := r.redisContext(ctx)
		defer cancel()
		res, err := s.store.Close(rctx, reason)
		if err != nil {
			return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "closing the activity: %v", err),
				fmt.Errorf("closing the activity as %s: %w", reason, err)
		}
		switch res.Outcome {
		case store.Closed:
			s.snapshot.State = store.StateClosed
			s.snapshot.CloseReason = res.Reason
			s.snapshot.Refunded = res.Refunded
			s.snapshot.RemainingCount = 0
			r.logger(ctx).Info("closed", "reason", res.Reason, "refunded", res.Refunded)
		case store.CloseMissing:
			return stepResult{}, fmt.Errorf("closing the activity: %w", store.ErrMissing)
		case store.CloseFenced:
			return stepResult{halt: true, requeueAfter: r.Options.ActiveResyncPeriod}, fmt.Errorf("closing the activity: it is fenced in Redis")
		default:
			return stepResult{}, fmt.Errorf("closing the activity as %s: Redis says %q (the snapshot was stale)", reason, res.Outcome)
		}
	}

	if s.snapshot.State == store.StateClosed {
		s.recordClosed()
		switch {
		case settled(s.snapshot), s.activity.Spec.Settlement == nil:
			// Nothing to wait for, or nothing that can move without a spec change.
			return stepResult{}, nil
		case s.snapshot.DeadCount > 0:
			return stepResult{requeueAfter: 6 * resync}, nil
		default:
			return stepResult{requeueAfter: resync}, nil
		}
	}

	var res stepResult
	if s.snapshot.EndMs > 0 {
		res.requeueAfter = until(s.snapshot.EndMs)
	}
	s.status.Phase = phase
	s.phaseMessage = phaseMessage(phase, s.snapshot)
	switch phase {
	case redpacketv1alpha1.PhaseScheduled:
		res.requeueAfter = soonest(res.requeueAfter, until(s.snapshot.StartMs))
	case redpacketv1alpha1.PhaseActive:
		res.requeueAfter = soonest(res.requeueAfter, resync)
	}
	return res, nil
}

// recordClosed puts a closed activity's phase (store.Snapshot.Phase: Exhausted when
// every packet was claimed, else Expired) into the status to apply. The exact refund
// goes into status with the other money counters (reconcileCounters).
func (s *activityScope) recordClosed() {
	phase, _ := s.snapshot.Phase(s.redisNow)
	s.status.Phase = phase
	s.phaseMessage = phaseMessage(phase, s.snapshot)
}

// phaseMessage explains the phase that Redis says, for Ready's message.
func phaseMessage(phase redpacketv1alpha1.Phase, snap store.Snapshot) string {
	switch phase {
	case redpacketv1alpha1.PhaseExhausted:
		return fmt.Sprintf("all %d packets were claimed", snap.Count)
	case redpacketv1alpha1.PhaseExpired:
		return fmt.Sprintf("grabbing closed at endTime; %d of %d packets were claimed and %d was refunded to the sponsor",
			snap.ClaimedCount, snap.Count, snap.Refunded)
	case redpacketv1alpha1.PhasePaused:
		return fmt.Sprintf("grabbing is paused with %d of %d packets left", snap.RemainingCount, snap.Count)
	case redpacketv1alpha1.PhaseScheduled:
		return fmt.Sprintf("%d packets are seeded; grabbing opens at %s", snap.Count,
			time.UnixMilli(snap.StartMs).UTC().Format(time.RFC3339))
	default:
		return fmt.Sprintf("grabbing is open with %d of %d packets left", snap.RemainingCount, snap.Count)
	}
}

// settled reports whether every claim and the refund have been credited.
func settled(snap store.Snapshot) bool {
	return snap.SettledCount == snap.ClaimedCount && snap.RefundSettled == snap.Refunded
}

// currencyOf is the activity's currency, redpacketv1alpha1.DefaultCurrency when the
// spec leaves it out.
func currencyOf(a *redpacketv1alpha1.RedPacketActivity) string {
	if a.Spec.Currency == "" {
		return redpacketv1alpha1.DefaultCurrency
	}
	return a.Spec.Currency
}
