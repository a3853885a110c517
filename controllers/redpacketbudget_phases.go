package controllers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
	// The time-zone database, as the grab service embeds it: the operator judges
	// spec.packets.timeZone by the same names whatever its image holds.
	_ "time/tzdata"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/store"
)

// budgetScope carries one reconcile's facts from one step to the next: the budget,
// the status the controller will apply once on the way out, and what the steps
// learned from Redis and the API server. What every kind's scope has is in the
// embedded reconcileScope; a budget's stalled is also a Redis that does not answer.
type budgetScope struct {
	reconcileScope
	budget *redpacketv1alpha1.RedPacketBudget
	// status is the status to apply; it starts as the current one.
	status redpacketv1alpha1.RedPacketBudgetStatus

	store    budgetStore
	snapshot store.BudgetSnapshot
	// configured is true once Redis holds the spec's total and limits.
	configured bool
	// defaultRedisLogin is the budget's own login on the default Redis; nil with
	// spec.redis or before the redis user step.
	defaultRedisLogin *specs.RedisLogin
	// redisLoginSettled is true once the redis user step settled how the grab pods
	// reach Redis; the workload step applies nothing before.
	redisLoginSettled bool
	// deployment is the grab Deployment as last read; nil when there is none.
	deployment *appsv1.Deployment
	// fenced is set when Redis holds less of the budget than its status recorded
	// (reconcileBudgetDataLoss): the status keeps its figures, the high-water marks,
	// and nothing is configured or announced again.
	fenced bool
	// ledger is the budget's settlement ledger as read just before the snapshot,
	// when it settles and no rollback was accepted; nil otherwise.
	ledger *store.BudgetLedgerSums
	// announcing is set while the balance system has not acknowledged spec.total
	// (reconcileBudgetSettlement): the configure step allots nothing beyond what
	// Redis holds.
	announcing *AnnouncementPendingError
	// epoch is the reconcile epoch this reconcile advanced the shards to (0: none).
	epoch int64
	// reconciliation is the budget's last reconciliation with the balance system,
	// read by the settlement step: Reconciled.
	reconciliation *reconciliationView
	// fenceAbandoned is set when the platform team abandoned a fenced budget's
	// deletion (deleteBudgetFenced): closing, expiring and the drain are skipped,
	// and the keys are purged.
	fenceAbandoned bool
	// capacity is what the operator's HorizontalPodAutoscaler and
	// PodDisruptionBudget of the grab Deployment hold (specs.BudgetCapacity); nil
	// without spec.grabService.autoscaling.
	capacity *specs.Capacity
}

func newBudgetScope(b *redpacketv1alpha1.RedPacketBudget, now time.Time) *budgetScope {
	s := &budgetScope{budget: b, status: *b.Status.DeepCopy()}
	s.reconcileScope = newReconcileScope(b, &s.status.Conditions, now)
	if c, ok := specs.BudgetCapacity(b); ok {
		s.capacity = &c
	}
	return s
}

// budgetNormalSteps are the steps of a budget that is not being deleted, in order.
func (r *RedPacketBudgetReconciler) budgetNormalSteps() []budgetStep {
	return []budgetStep{
		{name: "redis connection", run: r.reconcileBudgetRedis},
		{name: "data loss", run: r.reconcileBudgetDataLoss},
		{name: "load functions", run: r.reconcileBudgetFunctions},
		{name: "durability", run: r.reconcileBudgetDurability},
		{name: "settlement", run: r.reconcileBudgetSettlement},
		{name: "configure", run: r.reconcileBudgetConfigure},
		{name: "epoch", run: r.reconcileBudgetEpoch},
		{name: "expiry", run: r.reconcileBudgetExpiry},
		{name: "sender credential", run: r.reconcileSenderSecret, keepGoing: true},
		{name: "redis user", run: r.reconcileBudgetRedisUser, keepGoing: true},
		{name: "grab workload", run: r.reconcileBudgetWorkload, keepGoing: true},
		{name: "grab autoscaler", run: r.reconcileBudgetAutoscaler, keepGoing: true},
		{name: "expose", run: r.reconcileBudgetExpose, keepGoing: true},
		{name: "status", run: r.reconcileBudgetStatus},
	}
}

// reconcileBudgetRedis resolves the budget's Redis connection (spec.redis's Secret
// or the operator's default), takes the budget's store on it and reads a snapshot.
// A missing or unusable Secret is RedisConfigInvalid (or RedisNotAllowed); a Redis
// that does not answer is RedisUnavailable, and Stalled says so too.
func (r *RedPacketBudgetReconciler) reconcileBudgetRedis(ctx context.Context, s *budgetScope) (stepResult, error) {
	conn, err := r.connection(ctx, s.budget.Namespace, s.budget.Spec.Redis)
	if err != nil {
		return blocked(connectionFailureReason(err), "%v", err), err
	}
	s.conn = conn
	s.store = r.storeFor(conn, s.budget)
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	// The ledger is read before the snapshot, so every credit it counts was paid for
	// in the shards the snapshot reads (store.BudgetSnapshot.LedgerFaults). After an
	// accepted rollback the shards may hold less than was credited before it, and
	// the comparison is left out.
	b := s.budget
	if b.Spec.Settlement != nil && b.Spec.Settlement.Webhook != nil && b.Status.LastAcceptance == nil {
		if sums, err := s.store.LedgerSums(rctx); err == nil {
			s.ledger = &sums
		} else {
			ctrl.LoggerFrom(ctx).V(1).Info("reading the budget's settlement ledger failed; its credits are not compared this time", "error", err.Error())
		}
	}
	snap, err := s.store.Snapshot(rctx)
	if err != nil {
		res := blocked(redpacketv1alpha1.ReasonRedisUnavailable, "reading the budget from Redis at %s: %v",
			strings.Join(conn.Addresses, ","), err)
		s.stalled = res.blocker
		return res, fmt.Errorf("reading the budget's snapshot: %w", err)
	}
	s.snapshot, s.snapshotRead = snap, true
	return stepResult{}, nil
}

// reconcileBudgetFunctions loads the grab-side function library, which the grab pods
// FCALL and cannot load, on every master, and has the function keeper watch this
// Redis from now on.
func (r *RedPacketBudgetReconciler) reconcileBudgetFunctions(ctx context.Context, s *budgetScope) (stepResult, error) {
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	if err := s.store.LoadLibrary(rctx); err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "loading the function library: %v", err),
			fmt.Errorf("loading the function library: %w", err)
	}
	if r.Functions != nil {
		r.Functions.Track(s.budget.UID, s.conn)
	}
	return stepResult{}, nil
}

// reconcileBudgetDurability checks that the budget's Redis gives spec.durability
// on the master of every shard before the budget is configured (and on every
// resync): otherwise Ready is False with DurabilityNotMet and the chain halts, so a
// new budget takes no money until it holds. A configured budget's packets keep being
// served meanwhile; the grab fleet does not ask the operator.
func (r *RedPacketBudgetReconciler) reconcileBudgetDurability(ctx context.Context, s *budgetScope) (stepResult, error) {
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	switch err := s.store.CheckDurability(rctx, s.budget.Spec.Durability); {
	case err == nil:
		return stepResult{}, nil
	case errors.Is(err, store.ErrDurabilityNotMet):
		res := blocked(redpacketv1alpha1.ReasonDurabilityNotMet, "durability %s: %v", s.budget.Spec.Durability.Mode, err)
		res.requeueAfter = r.Options.ActiveResyncPeriod
		// A budget that holds money goes on, Ready False: its live packets must
		// still expire and be refunded.
		res.halt = s.snapshot.Total == 0
		return res, nil
	default:
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "checking durability: %v", err),
			fmt.Errorf("checking durability: %w", err)
	}
}

// budgetLimits are the spec's per-packet limits as the store writes them.
func budgetLimits(b *redpacketv1alpha1.RedPacketBudget) store.BudgetLimits {
	p := b.Spec.Packets
	l := store.BudgetLimits{
		Currency:   b.Spec.Currency,
		MaxTotal:   p.MaxTotal,
		MaxCount:   int64(p.MaxCount),
		MinShare:   max(p.MinShare, 1),
		DefaultTTL: 24 * time.Hour,
		MaxTTL:     24 * time.Hour,
	}
	if l.Currency == "" {
		l.Currency = redpacketv1alpha1.DefaultCurrency
	}
	if l.MaxCount < 1 {
		l.MaxCount = 100
	}
	for _, d := range p.Distributions {
		l.Distributions = append(l.Distributions, string(d))
	}
	if len(l.Distributions) == 0 {
		l.Distributions = []string{string(redpacketv1alpha1.DistributionRandom), string(redpacketv1alpha1.DistributionLineCut),
			string(redpacketv1alpha1.DistributionFixed)}
	}
	if p.MaxTTL != nil && p.MaxTTL.Duration > 0 {
		l.MaxTTL = p.MaxTTL.Duration
	}
	if p.DefaultTTL != nil && p.DefaultTTL.Duration > 0 {
		l.DefaultTTL = p.DefaultTTL.Duration
	}
	l.DefaultTTL = min(l.DefaultTTL, l.MaxTTL)
	return l
}

// reconcileBudgetConfigure writes the spec's total and limits to every shard when
// the spec changed since it was last observed or Redis holds another total (a first
// configuration, a refill, or a Redis that lost the budget), then reads the snapshot
// again. A total below what Redis already allotted is never written: the budget is
// Stalled with ConfigureRefused (the API server refuses lowering it, so this is a
// Redis that holds a newer budget than the spec, or a restore).
func (r *RedPacketBudgetReconciler) reconcileBudgetConfigure(ctx context.Context, s *budgetScope) (stepResult, error) {
	b := s.budget
	if s.snapshot.Total > b.Spec.Total {
		res := blocked(redpacketv1alpha1.ReasonConfigureRefused,
			"Redis allots %d to the budget, more than spec.total %d; a total is never lowered", s.snapshot.Total, b.Spec.Total)
		s.stalled = res.blocker
		return res, nil
	}
	if s.snapshot.Total == b.Spec.Total && b.Status.ObservedGeneration == b.Generation {
		s.configured = true
		return stepResult{}, nil
	}
	if s.announcing != nil {
		// The total is not acknowledged yet (the settlement step's blocker says so):
		// what Redis allots stays, and a budget never configured has nothing yet.
		s.configured = s.snapshot.Total > 0
		return stepResult{}, nil
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	switch err := s.store.Configure(rctx, b.Spec.Total, budgetLimits(b)); {
	case errors.Is(err, store.ErrBudgetLowered), errors.Is(err, store.ErrInvalidLimits):
		// Nothing was written, and nothing changes until the spec does.
		res := blocked(redpacketv1alpha1.ReasonConfigureRefused, "Redis refused the budget's configuration: %v", err)
		s.stalled = res.blocker
		return res, nil
	case err != nil:
		res := blocked(redpacketv1alpha1.ReasonRedisUnavailable, "configuring the budget's shards: %v", err)
		return res, fmt.Errorf("configuring the budget's %d shards: %w", b.Spec.ShardCount(), err)
	}
	snap, err := s.store.Snapshot(rctx)
	if err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "reading the budget after configuring it: %v", err),
			fmt.Errorf("reading the budget after configuring it: %w", err)
	}
	if snap.Total != b.Spec.Total {
		return blocked(redpacketv1alpha1.ReasonConfiguring, "Redis allots %d after configuring %d", snap.Total, b.Spec.Total),
			fmt.Errorf("configuring the budget: Redis allots %d, the spec says %d", snap.Total, b.Spec.Total)
	}
	if s.snapshot.Total != snap.Total {
		ctrl.LoggerFrom(ctx).Info("configured the budget", "total", snap.Total, "was", s.snapshot.Total, "shards", b.Spec.ShardCount())
	}
	s.snapshot, s.configured = snap, true
	return stepResult{}, nil
}

// reconcileBudgetEpoch advances the reconcile epoch of a configured budget's shards
// (store.Budget.AdvanceEpoch) once the data-loss step found them at or above every
// mark, and the status records it: the mark a busy fleet cannot outrun. The
// counters' marks tell an older Redis only while it holds less than the status
// last recorded; packets created after a restore soon take them past it, where the
// epoch, which only the operator writes, stays behind (reconcileBudgetDataLoss).
// A Redis that does not take it is logged and tried at the next reconcile: the
// status keeps the epoch it recorded.
func (r *RedPacketBudgetReconciler) reconcileBudgetEpoch(ctx context.Context, s *budgetScope) (stepResult, error) {
	if !s.configured || len(s.snapshot.MissingShards) > 0 {
		return stepResult{}, nil
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	e, err := s.store.AdvanceEpoch(rctx)
	if err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "advancing the budget's epoch; tried again at the next reconcile")
		return stepResult{}, nil
	}
	s.epoch = e
	return stepResult{}, nil
}

// reconcileBudgetExpiry has the expiry driver expire the budget's due packets from
// now on. The driver holds nothing but the handle: the due indexes in Redis are the
// state, so after a restart the first reconcile of each budget resumes it.
func (r *RedPacketBudgetReconciler) reconcileBudgetExpiry(_ context.Context, s *budgetScope) (stepResult, error) {
	if r.Expiry != nil {
		r.Expiry.TrackNamed(s.budget.UID, client.ObjectKeyFromObject(s.budget), s.store)
	}
	return stepResult{}, nil
}

// reconcileSenderSecret mints the sender credential: the Secret <budget>-sender with
// a random token, created once and never overwritten (a Create, which fails on an
// existing Secret, never an apply). Deleting the Secret rotates the token (the grab
// pods read the mounted file again). A Secret of that name that is not the budget's
// is left alone and the budget is not Ready (NotAdopted).
func (r *RedPacketBudgetReconciler) reconcileSenderSecret(ctx context.Context, s *budgetScope) (stepResult, error) {
	b := s.budget
	name := specs.BudgetSenderSecretName(b)
	existing := &corev1.Secret{}
	err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: b.Namespace, Name: name}, existing)
	switch {
	case err == nil:
		if !metav1.IsControlledBy(existing, b) {
			return stepResult{halt: true, blocker: notReady(redpacketv1alpha1.ReasonNotAdopted,
				"secret %s exists and is not the budget's; the sender credential is not minted", name)}, nil
		}
	case apierrors.IsNotFound(err):
		token, err := specs.NewSenderToken()
		if err != nil {
			return stepResult{}, err
		}
		if err := r.Client.Create(ctx, specs.BudgetSenderSecret(b, token), client.FieldOwner(BudgetFieldManager)); err != nil &&
			!apierrors.IsAlreadyExists(err) {
			return stepResult{}, fmt.Errorf("creating secret %s: %w", name, err)
		}
		ctrl.LoggerFrom(ctx).Info("minted the sender credential", "secret", name)
	default:
		return stepResult{}, fmt.Errorf("reading secret %s: %w", name, err)
	}
	s.status.SenderSecretName = name
	return stepResult{}, nil
}

// reconcileBudgetRedisUser gives a budget on the operator's default Redis its own ACL
// user (store.Budget.EnsureUser: keys rpb:{<uid>.*, FCALL of the library) and the
// Secret <budget>-grab-redis with its login, as an activity's redis user step does;
// the password is the one the Secret holds, a new one when there is none. A budget
// with spec.redis brings its own credentials.
func (r *RedPacketBudgetReconciler) reconcileBudgetRedisUser(ctx context.Context, s *budgetScope) (stepResult, error) {
	b := s.budget
	if b.Spec.Redis != nil {
		s.redisLoginSettled = true
		return stepResult{}, nil
	}
	conn, err := r.defaultRedisConn()
	if err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisConfigInvalid, "%v", err), err
	}
	name := specs.BudgetRedisSecretName(b)
	existing := &corev1.Secret{}
	switch err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: b.Namespace, Name: name}, existing); {
	case apierrors.IsNotFound(err):
		existing = nil
	case err != nil:
		return stepResult{}, fmt.Errorf("reading secret %s: %w", name, err)
	case !metav1.IsControlledBy(existing, b):
		return blocked(redpacketv1alpha1.ReasonNotAdopted, "secret %s exists and is not the budget's", name), nil
	}
	user := s.store.UserName()
	password, err := loginPassword(existing, user)
	if err != nil {
		return stepResult{}, err
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	if _, err := s.store.EnsureUser(rctx, password); err != nil {
		if errors.Is(err, store.ErrACLUnavailable) {
			return blocked(redpacketv1alpha1.ReasonRedisACLUnavailable,
				"the operator's default Redis cannot give the budget a Redis user of its own: %v; the grab service is not deployed", err), nil
		}
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "setting up the budget's Redis user: %v", err),
			fmt.Errorf("setting up the budget's Redis user: %w", err)
	}
	login := defaultRedisLogin(conn, user, password)
	if existing == nil || !secretDataEqual(existing.Data, login.SecretData()) {
		if err := r.Client.Apply(ctx, specs.BudgetRedisSecret(b, *login), client.FieldOwner(BudgetFieldManager), client.ForceOwnership); err != nil {
			return workloadFailed(err), fmt.Errorf("applying secret %s: %w", name, err)
		}
	}
	s.defaultRedisLogin = login
	s.redisLoginSettled = true
	return stepResult{}, nil
}

// reconcileBudgetWorkload applies the shared grab Service and Deployment
// (specs.BudgetGrabService, specs.BudgetGrabDeployment) under BudgetFieldManager,
// once the redis user step settled the login, then keeps the workload's guards as an
// activity's (keepGrabGuards: the NetworkPolicy <budget>-grab, and the
// PodDisruptionBudget <budget>-grab while the Deployment has two replicas or more,
// whoever set them: the spec, kubectl scale or an autoscaler through the budget's
// scale subresource). An object of those names that is not the budget's is left
// alone (NotAdopted); an image other than the operator's needs
// --allow-grab-image-override (GrabImageNotAllowed).
func (r *RedPacketBudgetReconciler) reconcileBudgetWorkload(ctx context.Context, s *budgetScope) (stepResult, error) {
	b := s.budget
	if img := b.Spec.GrabService.Image; img != "" && img != r.Options.GrabImage && !r.Options.AllowGrabImageOverride {
		return blocked(redpacketv1alpha1.ReasonGrabImageNotAllowed,
			"spec.grabService.image %q is not the operator's grab image and the operator does not allow another", img), nil
	}
	if !s.redisLoginSettled {
		return stepResult{halt: true}, nil
	}
	key := client.ObjectKey{Namespace: b.Namespace, Name: specs.BudgetGrabName(b)}
	live := &appsv1.Deployment{}
	liveFound := false
	for _, obj := range []client.Object{&corev1.Service{}, live} {
		err := r.APIReader.Get(ctx, key, obj)
		if err == nil && !metav1.IsControlledBy(obj, b) {
			return blocked(redpacketv1alpha1.ReasonNotAdopted, "%T %s exists and is not the budget's; it is left alone", obj, key.Name), nil
		}
		if err != nil && !apierrors.IsNotFound(err) {
			return stepResult{}, fmt.Errorf("reading %s: %w", key.Name, err)
		}
		liveFound = liveFound || (err == nil && obj == client.Object(live))
	}
	// With autoscaling, spec.replicas passes to BudgetReplicasFieldManager before
	// the workload's apply lets it go, so it is never left without an owner.
	if s.capacity != nil && liveFound && managerHoldsReplicas(live, BudgetFieldManager) {
		if err := r.Client.Apply(ctx, specs.BudgetGrabScale(b, deploymentReplicas(live)),
			client.FieldOwner(BudgetReplicasFieldManager), client.ForceOwnership); err != nil {
			return workloadFailed(err), fmt.Errorf("handing the grab Deployment's replicas to its autoscaler: %w", err)
		}
	}
	in := specs.BudgetGrab{Budget: b, OperatorImage: r.Options.GrabImage, OperatorLibrary: store.LibraryName,
		TokenMaxLifetime: r.Options.GrabTokenMaxLifetime, DefaultRedis: s.defaultRedisLogin}
	for _, obj := range []runtime.ApplyConfiguration{specs.BudgetGrabService(b), specs.BudgetGrabDeployment(in)} {
		if err := r.Client.Apply(ctx, obj, client.FieldOwner(BudgetFieldManager), client.ForceOwnership); err != nil {
			return workloadFailed(err), fmt.Errorf("applying the grab workload: %w", err)
		}
	}
	if s.capacity != nil && !liveFound {
		// A new Deployment starts at the HPA's minimum.
		if err := r.Client.Apply(ctx, specs.BudgetGrabScale(b, s.capacity.MinReplicas),
			client.FieldOwner(BudgetReplicasFieldManager), client.ForceOwnership); err != nil {
			return workloadFailed(err), fmt.Errorf("starting the grab Deployment at the autoscaler's minimum: %w", err)
		}
	}
	d := &appsv1.Deployment{}
	if err := r.APIReader.Get(ctx, key, d); err != nil {
		return stepResult{}, fmt.Errorf("reading Deployment %s: %w", key.Name, err)
	}
	s.deployment = d
	if err := keepGrabGuards(ctx, r.Client, r.APIReader, r.Recorder, grabGuarded{
		owner: b, kind: "budget", name: key.Name, labels: specs.BudgetLabels(b),
		selector: specs.BudgetSelector(b), replicas: deploymentReplicas(d), capacity: s.capacity,
	}); err != nil {
		return workloadFailed(err), err
	}
	s.status.Endpoint = specs.BudgetEndpoint(b)
	if tz := b.Spec.Packets.TimeZone; tz != "" {
		// The API server checks the name's shape only; the grab pods load it from the
		// same database (embedded in both binaries) and refuse creations without it.
		if _, err := time.LoadLocation(tz); err != nil {
			msg := fmt.Sprintf("spec.packets.timeZone %q is not a zone of the time-zone database: creations are refused (503) until it is corrected; grabs go on", tz)
			// The Warning once per zone, not at every reconcile.
			if prev, _ := r.warnedTimeZone.Swap(b.UID, tz); prev != tz {
				r.eventf(b, corev1.EventTypeWarning, redpacketv1alpha1.ReasonInvalidTimeZone, "%s", msg)
			}
			return stepResult{blocker: notReady(redpacketv1alpha1.ReasonInvalidTimeZone, "%s", msg)}, nil
		}
	}
	r.warnedTimeZone.Delete(b.UID)
	return stepResult{}, nil
}

// reconcileBudgetAutoscaler keeps the budget's HorizontalPodAutoscaler <budget>-grab
// as spec.grabService.autoscaling says (keepGrabAutoscaler: between minReplicas and
// maxReplicas on CPU, written again whenever it drifted), or deletes the operator's
// HPA when autoscaling is unset. A budget has no window: its minimum never moves.
// It acts once the workload step applied the Deployment.
func (r *RedPacketBudgetReconciler) reconcileBudgetAutoscaler(ctx context.Context, s *budgetScope) (stepResult, error) {
	if s.deployment == nil {
		return stepResult{}, nil
	}
	b := s.budget
	if err := keepGrabAutoscaler(ctx, r.Client, r.APIReader, r.Recorder, grabGuarded{
		owner: b, kind: "budget", name: specs.BudgetGrabName(b), labels: specs.BudgetLabels(b),
		selector: specs.BudgetSelector(b), capacity: s.capacity,
	}); err != nil {
		return workloadFailed(err), err
	}
	return stepResult{}, nil
}

// managerHoldsReplicas reports whether field manager holds d's spec.replicas by
// apply, as d's managed fields record.
func managerHoldsReplicas(d *appsv1.Deployment, manager string) bool {
	for _, m := range d.ManagedFields {
		if m.Manager != manager || m.Operation != metav1.ManagedFieldsOperationApply || m.FieldsV1 == nil {
			continue
		}
		var fields struct {
			Spec map[string]json.RawMessage `json:"f:spec"`
		}
		if err := json.Unmarshal(m.FieldsV1.GetRawBytes(), &fields); err != nil {
			continue
		}
		if _, ok := fields.Spec["f:replicas"]; ok {
			return true
		}
	}
	return false
}

// reconcileBudgetSettlement hands a budget with a webhook to the settlement runner.
// It comes before configure: a total that grew is announced first, and a total the
// balance system has not acknowledged is not allotted to the shards (the ledger
// would refuse credits drawn from it). The announcement runs in the runner's time,
// not the reconcile's: while it is pending, Ready is False with TotalNotAnnounced,
// the configure step keeps what Redis allots, the later steps (expiry, the grab
// workload) go on, and the reconcile comes back soon.
func (r *RedPacketBudgetReconciler) reconcileBudgetSettlement(ctx context.Context, s *budgetScope) (stepResult, error) {
	if r.Settlement == nil || s.budget.Spec.Settlement == nil || s.budget.Spec.Settlement.Webhook == nil {
		return stepResult{}, nil
	}
	err := r.Settlement.EnsureTarget(ctx, r.settlementTarget(s))
	var pending *AnnouncementPendingError
	switch {
	case errors.As(err, &pending):
		s.announcing = pending
		return stepResult{requeueAfter: pending.RetryIn,
			blocker: notReady(redpacketv1alpha1.ReasonTotalNotAnnounced, "%v; Redis allots %d until then", pending, s.snapshot.Total)}, nil
	case err != nil:
		return stepResult{}, fmt.Errorf("starting the budget's settlement: %w", err)
	}
	r.readBudgetReconciliation(s)
	return stepResult{}, nil
}

// budgetReconciliations is what the budget reconciler reads of a settlement runner
// that reconciles (BudgetSettlementRunner); a BudgetSettlement without it gets no
// Reconciled condition and no wait for it.
type budgetReconciliations interface {
	Running(uid types.UID) bool
	reconciliationView(uid types.UID) *reconciliationView
	reconciledForDeletion(uid types.UID, now time.Time) (ok, differ bool, why string)
}

// readBudgetReconciliation reads the budget's last reconciliation for Reconciled, and
// raises a Warning event BooksDiffer when it found a difference the condition does
// not say yet.
func (r *RedPacketBudgetReconciler) readBudgetReconciliation(s *budgetScope) {
	rs, ok := r.Settlement.(budgetReconciliations)
	if !ok || !rs.Running(s.budget.UID) {
		return
	}
	s.reconciliation = rs.reconciliationView(s.budget.UID)
	if s.reconciliation.newDifference(s.budget.Status.Conditions) {
		r.eventf(s.budget, corev1.EventTypeWarning, redpacketv1alpha1.ReasonBooksDiffer,
			"the balance system's book differs from what the operator paid: %s", boundedMessage(s.reconciliation.last.String()))
	}
}

// deleteBudgetReconciled keeps a deleted budget whose settlement drained until its
// reconciliation with the balance system, asked for at once, finds the books
// agreeing (or finds no read endpoint): its ledger and streams are what the book is
// compared against. Books that differ hold the deletion, visibly (Ready False with
// NotReconciled, and a BooksDiffer event), until they agree or the platform team
// abandons it, as a deletion that waits on settlement.
func (r *RedPacketBudgetReconciler) deleteBudgetReconciled(ctx context.Context, s *budgetScope) (stepResult, error) {
	b := s.budget
	if s.fenceAbandoned || r.Settlement == nil || b.Spec.Settlement == nil || b.Spec.Settlement.Webhook == nil {
		return stepResult{}, nil
	}
	rs, ok := r.Settlement.(budgetReconciliations)
	if !ok || !rs.Running(b.UID) {
		return stepResult{}, nil
	}
	r.readBudgetReconciliation(s)
	done, differ, why := rs.reconciledForDeletion(b.UID, s.now)
	if done {
		return stepResult{}, nil
	}
	if differ {
		user, note, err := r.abandonedBy(ctx, b)
		if err != nil {
			return stepResult{}, fmt.Errorf("checking who abandoned the deleted budget's reconciliation: %w", err)
		}
		if user != "" {
			r.eventf(b, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAbandoned,
				"%s abandoned the deleted budget's reconciliation; its keys are purged while the books differ: %s", user, why)
			return stepResult{}, nil
		}
		if note != "" {
			why += "; " + note
		}
		why += fmt.Sprintf(". The keys stay until the books agree, or the platform team abandons them with %s=%s and %s=<their user name>",
			redpacketv1alpha1.AnnotationAbandon, b.UID, redpacketv1alpha1.AnnotationAbandonedBy)
	}
	s.notReady = notReady(redpacketv1alpha1.ReasonNotReconciled, "the budget was deleted and settlement drained; %s", why)
	return stepResult{halt: true, requeueAfter: min(r.Options.CleanupPollInterval, time.Second)}, nil
}

// settlementTarget is what the settlement runner needs to know of the budget.
func (r *RedPacketBudgetReconciler) settlementTarget(s *budgetScope) BudgetSettlementTarget {
	b := s.budget
	t := BudgetSettlementTarget{
		UID: b.UID, Name: client.ObjectKeyFromObject(b), Object: b,
		Shards: b.Spec.ShardCount(), Total: b.Spec.Total, Currency: b.Spec.Currency,
		Conn: s.conn, ClientOptions: r.redisClientOptions(s.conn, false),
	}
	if st := b.Spec.Settlement; st != nil {
		if st.Webhook != nil {
			t.WebhookURL = st.Webhook.URL
		}
		t.MaxAttempts = int(st.MaxAttempts)
	}
	if ev := b.Spec.Events; ev != nil {
		t.EventsURL, t.EventsMaxAttempts = ev.Webhook.URL, int(ev.MaxAttempts)
	}
	t.MaxPacketCount = int64(b.Spec.Packets.MaxCount)
	if b.Spec.Packets.MaxTTL != nil {
		t.MaxTTL = b.Spec.Packets.MaxTTL.Duration
	}
	if l := r.ledgerConn(s.conn); l != nil {
		t.LedgerConn, t.LedgerClientOptions = l, r.redisClientOptions(*l, false)
	}
	return t
}

// reconcileBudgetStatus asks to come back every ActiveResyncPeriod, so the status's
// figures and rates follow Redis; the figures are written by finishBudgetReconcile.
func (r *RedPacketBudgetReconciler) reconcileBudgetStatus(_ context.Context, _ *budgetScope) (stepResult, error) {
	return stepResult{requeueAfter: r.Options.ActiveResyncPeriod}, nil
}

// finishBudgetReconcile is the one status apply of a reconcile, on every path: the
// money figures from this reconcile's snapshot, the rates against the last status,
// Ready and Stalled. A money fault of the snapshot (its sums, a shard's sums or its
// moves do not add up: store.BudgetSnapshot.MoneyFaults) is Stalled with
// ConservationBroken and a Warning event.
func (r *RedPacketBudgetReconciler) finishBudgetReconcile(ctx context.Context, s *budgetScope, result ctrl.Result, retErr error) (ctrl.Result, error) {
	if s.released {
		return result, retErr
	}
	before := s.budget.Status
	computeBudgetStatus(s, s.clean(retErr))
	if s.snapshotRead {
		budgetMetrics.Observe(client.ObjectKeyFromObject(s.budget), s.snapshot, s.ledger)
	}
	if c := meta.FindStatusCondition(s.status.Conditions, redpacketv1alpha1.ConditionStalled); c != nil &&
		c.Reason == redpacketv1alpha1.ReasonConservationBroken && c.Status == metav1.ConditionTrue &&
		!meta.IsStatusConditionTrue(before.Conditions, redpacketv1alpha1.ConditionStalled) && r.Recorder != nil {
		r.Recorder.Eventf(s.budget, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonConservationBroken, "Reconcile", "%s", c.Message)
	}
	if equality.Semantic.DeepEqual(before, s.status) {
		return result, retErr
	}
	if err := r.applyBudgetStatus(ctx, s.budget, s.status); err != nil && !isNotFoundOrGone(err) {
		return result, errors.Join(retErr, err)
	}
	s.budget.Status = s.status
	return result, retErr
}

// applyBudgetStatus writes status with a server-side apply under BudgetFieldManager.
func (r *RedPacketBudgetReconciler) applyBudgetStatus(ctx context.Context, b *redpacketv1alpha1.RedPacketBudget, st redpacketv1alpha1.RedPacketBudgetStatus) error {
	fields, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&st)
	if err != nil {
		return fmt.Errorf("converting the budget's status: %w", err)
	}
	obj := statusApplyObjectOf("RedPacketBudget", b, fields)
	if err := r.Client.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(obj), client.FieldOwner(BudgetFieldManager), client.ForceOwnership); err != nil {
		return fmt.Errorf("applying the budget's status: %w", err)
	}
	return nil
}

// computeBudgetStatus fills the scope's status: the snapshot's figures (all of them
// from one snapshot, so they add up), the per-second rates since the last status's
// snapshot, the grab Deployment's replicas and selector, and the conditions. clean
// says the reconcile went through, so the generation counts as observed.
func computeBudgetStatus(s *budgetScope, clean bool) {
	b := s.budget
	st := &s.status
	if clean {
		st.ObservedGeneration = b.Generation
	}
	st.Selector = specs.BudgetSelectorString(b)
	if s.deployment != nil {
		st.Replicas = s.deployment.Status.Replicas
	}
	if s.snapshotRead && !s.fenced {
		snap := s.snapshot
		prevCreated, prevGrabbed, prevAt := st.CreatedPackets, st.GrabbedShares, st.SnapshotTime
		st.Total, st.Available, st.InPackets = new(snap.Total), new(snap.Available), new(snap.Live)
		st.Claimed, st.Refunded = new(snap.Claimed), new(snap.Refunded)
		st.LivePackets, st.CreatedPackets, st.ExpiredPackets = new(snap.LivePackets), new(snap.CreatedPackets), new(snap.ExpiredPackets)
		st.GrabbedShares, st.SettledCount, st.DeadLetters = new(snap.GrabbedShares), new(snap.SettledCount), new(snap.DeadLetters)
		at := metav1.NewTime(s.now.Truncate(time.Millisecond))
		// The counters and the time they were read move together, so each rate is
		// over exactly the time since the last snapshot; when no time passed (or the
		// clock went back) the rates stay as they were.
		if prevAt == nil || prevCreated == nil || prevGrabbed == nil {
			st.CreatedPerSecond, st.GrabbedPerSecond = new(int64(0)), new(int64(0))
		} else if elapsed := at.Sub(prevAt.Time).Seconds(); elapsed > 0 {
			st.CreatedPerSecond = new(perSecond(snap.CreatedPackets-*prevCreated, elapsed))
			st.GrabbedPerSecond = new(perSecond(snap.GrabbedShares-*prevGrabbed, elapsed))
		}
		st.SnapshotTime = &at
		if s.epoch > 0 {
			st.Epoch = new(s.epoch)
		}
		faults := snap.MoneyFaults()
		if s.ledger != nil {
			faults = append(faults, snap.LedgerFaults(*s.ledger)...)
		}
		if faults != nil {
			s.stalled = notReady(redpacketv1alpha1.ReasonConservationBroken,
				"the budget's money does not add up in Redis: %s", strings.Join(faults, "; "))
		}
	}

	switch {
	case b.Spec.Settlement == nil || b.Spec.Settlement.Webhook == nil:
		meta.RemoveStatusCondition(&st.Conditions, redpacketv1alpha1.ConditionReconciled)
	case s.reconciliation != nil:
		v := s.reconciliation
		reconciledCondition(&st.Conditions, b.Generation, true, v.last, v.err, v.ok)
	}
	switch {
	case s.stalled != nil:
		s.setCondition(redpacketv1alpha1.ConditionStalled, metav1.ConditionTrue, s.stalled.reason, "%s", s.stalled.message)
	default:
		meta.RemoveStatusCondition(&st.Conditions, redpacketv1alpha1.ConditionStalled)
	}
	switch {
	case s.stalled != nil:
		s.setCondition(redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, s.stalled.reason, "%s", s.stalled.message)
	case s.notReady != nil:
		s.setCondition(redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, s.notReady.reason, "%s", s.notReady.message)
	case !s.configured:
		s.setCondition(redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonConfiguring,
			"the budget's shards are not configured yet")
	case s.deployment == nil || s.deployment.Status.AvailableReplicas < 1:
		s.setCondition(redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonGrabServiceUnavailable,
			"the budget is configured but its grab Deployment has no available replica")
	default:
		s.setCondition(redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, redpacketv1alpha1.ReasonBudgetReady,
			"%d of %d available over %d shards; %d live packets; %d grab replicas available",
			s.snapshot.Available, s.snapshot.Total, b.Spec.ShardCount(), s.snapshot.LivePackets, s.deployment.Status.AvailableReplicas)
	}
}

// perSecond is n per elapsed seconds, rounded; never negative (a counter below its
// last figure is a Redis that rolled back, not a negative rate).
func perSecond(n int64, elapsed float64) int64 {
	if n <= 0 || elapsed <= 0 {
		return 0
	}
	return int64(math.Round(float64(n) / elapsed))
}

// budgetDeleteSteps are the steps of a deleted budget, in order: hold a fenced
// budget until the platform team abandons it, close creation, expire every live
// packet (each refunded through settlement), wait for settlement to drain, then
// remove the Redis user and every key, and let the budget go.
func (r *RedPacketBudgetReconciler) budgetDeleteSteps() []budgetStep {
	return []budgetStep{
		{name: "redis connection", run: r.reconcileBudgetRedis},
		{name: "data loss", run: r.deleteBudgetDataLoss},
		{name: "fence", run: r.deleteBudgetFenced},
		{name: "close", run: r.deleteBudgetClose},
		{name: "expire everything", run: r.deleteBudgetExpireAll},
		{name: "settlement drained", run: r.deleteBudgetDrained},
		{name: "reconciled", run: r.deleteBudgetReconciled},
		{name: "purge", run: r.deleteBudgetPurge},
	}
}

// deleteBudgetClose stops creation on every shard; ExpireDue then expires every live
// packet whatever its time.
func (r *RedPacketBudgetReconciler) deleteBudgetClose(ctx context.Context, s *budgetScope) (stepResult, error) {
	s.notReady = notReady(redpacketv1alpha1.ReasonDeleting, "the budget is being deleted: its live packets expire and are refunded")
	if s.snapshot.Closed || s.fenceAbandoned {
		return stepResult{}, nil
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	if err := s.store.Close(rctx); err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "closing the budget: %v", err), fmt.Errorf("closing the budget: %w", err)
	}
	return stepResult{}, nil
}

// budgetDeleteBatchTime bounds how long one reconcile of a deleted budget expires
// packets before it lets others go and comes back.
const budgetDeleteBatchTime = 2 * time.Second

// deleteBudgetExpireAll expires every live packet of the closed budget, a bounded
// batch at a time on each shard, and reads the snapshot again; while packets are
// live it comes back at once.
func (r *RedPacketBudgetReconciler) deleteBudgetExpireAll(ctx context.Context, s *budgetScope) (stepResult, error) {
	if s.fenceAbandoned {
		return stepResult{}, nil
	}
	deadline := time.Now().Add(budgetDeleteBatchTime)
	for i := range s.budget.Spec.ShardCount() {
		for time.Now().Before(deadline) {
			rctx, cancel := r.redisContext(ctx)
			n, _, err := s.store.ExpireDue(rctx, i, budgetExpiryBatch)
			cancel()
			if err != nil {
				return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "expiring shard %d: %v", i, err),
					fmt.Errorf("expiring shard %d of the deleted budget: %w", i, err)
			}
			if n < budgetExpiryBatch {
				break
			}
		}
	}
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	snap, err := s.store.Snapshot(rctx)
	if err != nil {
		return blocked(redpacketv1alpha1.ReasonRedisUnavailable, "reading the budget: %v", err), fmt.Errorf("reading the budget: %w", err)
	}
	s.snapshot = snap
	if snap.LivePackets > 0 || snap.Live > 0 {
		return stepResult{halt: true, requeueAfter: 10 * time.Millisecond}, nil
	}
	return stepResult{}, nil
}

// deleteBudgetDrained waits until settlement delivered every entry of the budget's
// streams, when it has a webhook and the operator runs its settlement.
//
// While it waits the wait is visible: Ready is False with SettlementPending and a
// message that counts the entries the balance system has not taken yet and names the
// way out, and a Warning event says so when the wait begins. Once CleanupGracePeriod
// has passed since the deletion, Stalled is True as well (kstatus and Argo CD show
// the budget degraded), with another Warning event: the balance system has not
// answered for that long and a person must look. The budget is never let go on a
// timer, since its streams are the record of what is owed. Dead letters are owed
// too: a budget holding some waits until they are replayed (BudgetDrain).
//
// The way out, when the balance system will not take the credits, is the platform
// team's abandon, guarded as an activity's: AnnotationAbandon set to the budget's UID
// and AnnotationAbandonedBy to the user who decided, whom the admission policy and a
// SubjectAccessReview check for the verb abandon on redpacketbudgets. The budget's
// settlement workers then stop, the purge step deletes its keys with the unsettled
// entries, and a Warning Abandoned names the count and the user. A refused or
// misdirected abandon changes nothing and says why (an AbandonNotAllowed event).
func (r *RedPacketBudgetReconciler) deleteBudgetDrained(ctx context.Context, s *budgetScope) (stepResult, error) {
	b := s.budget
	if s.fenceAbandoned || r.Settlement == nil || b.Spec.Settlement == nil || b.Spec.Settlement.Webhook == nil {
		return stepResult{}, nil
	}
	t := r.settlementTarget(s)
	// A settlement that cannot start (its signing key is gone, say) is one more
	// reason to wait, said in the message; the drain is checked all the same.
	ensureErr := r.Settlement.EnsureTarget(ctx, t)
	if pending := (*AnnouncementPendingError)(nil); errors.As(ensureErr, &pending) {
		ensureErr = nil // the workers run; only a raise of the total waits
	}
	drain, err := r.Settlement.DrainedTarget(ctx, t)
	if err != nil {
		return stepResult{}, errors.Join(ensureErr, fmt.Errorf("checking the budget's settlement: %w", err))
	}
	if drain.Drained {
		return stepResult{}, nil
	}
	unsettled := drain.Owed()

	var notes []string
	if ensureErr != nil {
		notes = append(notes, fmt.Sprintf("settlement cannot run: %v", ensureErr))
	}
	user, note, err := r.abandonedBy(ctx, b)
	if err != nil {
		return stepResult{}, fmt.Errorf("checking who abandoned the deleted budget's settlement: %w", err)
	}
	if user != "" {
		r.eventf(b, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAbandoned,
			"%s abandoned the deleted budget's settlement: %d entries (grants to users, refunds to senders) were never credited by the balance system at %s; the budget's Redis keys are purged with them",
			user, unsettled, t.WebhookURL)
		ctrl.LoggerFrom(ctx).Info("the deleted budget's settlement was abandoned", "by", user, "unsettled", unsettled)
		return stepResult{}, nil
	}
	if note != "" {
		notes = append(notes, note)
	}

	owed := fmt.Sprintf("%d entries are not yet settled (grants and refunds the balance system at %s has not credited, "+
		"and creation records not yet booked)", unsettled, t.WebhookURL)
	if drain.DeadLetters > 0 {
		owed += fmt.Sprintf(", %d of them dead letters that wait for kubectl rpa replay-dead-letters rpb/%s", drain.DeadLetters, b.Name)
	}
	msg := fmt.Sprintf("the budget was deleted at %s and waits for settlement to drain: %s. "+
		"If it cannot take them, the platform team may abandon them with %s=%s and %s=<their user name>: the keys are purged and those credits are never made",
		b.DeletionTimestamp.UTC().Format(time.RFC3339), owed,
		redpacketv1alpha1.AnnotationAbandon, b.UID, redpacketv1alpha1.AnnotationAbandonedBy)
	if len(notes) > 0 {
		msg += "; " + strings.Join(notes, "; ")
	}
	s.notReady = notReady(redpacketv1alpha1.ReasonSettlementPending, "%s", msg)
	before := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReady)
	if before == nil || before.Reason != redpacketv1alpha1.ReasonSettlementPending {
		r.eventf(b, corev1.EventTypeWarning, redpacketv1alpha1.ReasonSettlementPending,
			"deletion waits for settlement: %s", owed)
	}
	for _, note := range notes {
		if strings.HasPrefix(note, "the abandon was refused") || strings.HasPrefix(note, "the annotation") {
			if before == nil || !strings.Contains(before.Message, note) {
				r.eventf(b, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAbandonNotAllowed,
					"the deleted budget's settlement was not abandoned, its keys stay: %s", note)
			}
		}
	}
	requeue := r.Options.CleanupPollInterval
	if deadline := b.DeletionTimestamp.Add(r.Options.CleanupGracePeriod); !s.now.Before(deadline) {
		s.stalled = notReady(redpacketv1alpha1.ReasonSettlementPending, "%s (longer than the cleanup grace period of %s)", msg, r.Options.CleanupGracePeriod)
		if !meta.IsStatusConditionTrue(b.Status.Conditions, redpacketv1alpha1.ConditionStalled) {
			r.eventf(b, corev1.EventTypeWarning, redpacketv1alpha1.ReasonSettlementPending,
				"deletion has waited for settlement longer than the cleanup grace period of %s: %d entries not credited; the balance system at %s needs a look, or the platform team's abandon",
				r.Options.CleanupGracePeriod, unsettled, t.WebhookURL)
		}
	} else {
		requeue = min(requeue, deadline.Sub(s.now))
	}
	return stepResult{halt: true, requeueAfter: requeue}, nil
}

// deleteBudgetFenced holds the deletion of a budget fenced for a Redis that lost or
// rolled back its data (reconcileBudgetDataLoss). Its Redis no longer holds what its
// status recorded, so the usual deletion would close, expire and refund from what
// is left and purge the rest: the money its status last counted in live packets
// would go without a refund and without a decision. The deletion waits instead,
// Stalled with the fence's reason and a message that names that money and the way
// out, and a Warning says so once. The status keeps its figures.
//
// The way out is the platform team's abandon, as for a deletion that waits on
// settlement: AnnotationAbandon set to the budget's UID and AnnotationAbandonedBy to
// the user who decided, checked for the verb abandon on redpacketbudgets. The
// budget's settlement then stops, closing, expiring and the drain are skipped, the
// purge deletes its keys, and a Warning Abandoned names the live money never
// refunded by the operator and the user. TestDeletingAFencedBudgetWaitsForTheAbandon.
func (r *RedPacketBudgetReconciler) deleteBudgetFenced(ctx context.Context, s *budgetScope) (stepResult, error) {
	b := s.budget
	c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled)
	if c == nil || c.Status != metav1.ConditionTrue ||
		(c.Reason != redpacketv1alpha1.ReasonDataLost && c.Reason != redpacketv1alpha1.ReasonRedisRolledBack) {
		return stepResult{}, nil
	}
	s.fenced = true
	var live int64
	if b.Status.InPackets != nil {
		live = *b.Status.InPackets
	}
	user, note, err := r.abandonedBy(ctx, b)
	if err != nil {
		return stepResult{}, fmt.Errorf("checking who abandoned the fenced budget: %w", err)
	}
	if user != "" {
		r.eventf(b, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAbandoned,
			"%s abandoned the fenced budget (%s): %d %s in live packets at the last reading is never refunded by the operator; the budget's Redis keys are purged",
			user, c.Reason, live, b.Spec.Currency)
		ctrl.LoggerFrom(ctx).Info("the fenced budget was abandoned", "by", user, "reason", c.Reason, "live", live)
		s.fenceAbandoned = true
		return stepResult{}, nil
	}
	const held = "the budget was deleted while fenced"
	msg := fmt.Sprintf("%s (%s): its Redis no longer holds what its status recorded, so nothing is refunded from it; "+
		"%d %s was in live packets at the last reading. Settle them with their senders, then the platform team may abandon the budget with %s=%s and %s=<their user name>: its keys are purged",
		held, c.Reason, live, b.Spec.Currency, redpacketv1alpha1.AnnotationAbandon, b.UID, redpacketv1alpha1.AnnotationAbandonedBy)
	if note != "" {
		msg += "; " + note
	}
	if !strings.HasPrefix(c.Message, held) {
		r.eventf(b, corev1.EventTypeWarning, c.Reason, "%s", msg)
	}
	if note != "" && !strings.Contains(c.Message, note) {
		r.eventf(b, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAbandonNotAllowed,
			"the fenced budget was not abandoned, its keys stay: %s", note)
	}
	s.stalled = notReady(c.Reason, "%s", msg)
	return stepResult{halt: true, requeueAfter: dataLostRecheckPeriod}, nil
}

// abandonedBy reads the platform team's abandon of a deleted budget: the user who
// abandoned it, once AnnotationAbandon carries the budget's UID and a
// SubjectAccessReview confirms AnnotationAbandonedBy may abandon redpacketbudgets
// (the budget's settlement is then stopped); otherwise a note that says why an
// abandon present does nothing, or "" when there is none.
func (r *RedPacketBudgetReconciler) abandonedBy(ctx context.Context, b *redpacketv1alpha1.RedPacketBudget) (user, note string, err error) {
	v, ok := b.Annotations[redpacketv1alpha1.AnnotationAbandon]
	if !ok {
		return "", "", nil
	}
	if v != string(b.UID) {
		return "", fmt.Sprintf("the annotation %s=%q does not carry this budget's UID %s, so it does nothing",
			redpacketv1alpha1.AnnotationAbandon, v, b.UID), nil
	}
	user, refused, err := platformDecidedBy(ctx, reviewerOr(r.access, r.Client), b, "redpacketbudgets", abandonDecision)
	if err != nil {
		return "", "", err
	}
	if refused != "" {
		return "", "the abandon was refused: " + refused, nil
	}
	if r.Settlement != nil {
		r.Settlement.Forget(b.UID)
	}
	return user, "", nil
}

// eventf emits an event about the budget, when the reconciler has a recorder.
func (r *RedPacketBudgetReconciler) eventf(b *redpacketv1alpha1.RedPacketBudget, eventType, reason, note string, args ...any) {
	if r.Recorder != nil {
		r.Recorder.Eventf(b, nil, eventType, reason, "Delete", note, args...)
	}
}

// deleteBudgetPurge removes the budget's Redis user (on the default Redis) and every
// key, stops what the operator runs for it, and removes the finalizer.
func (r *RedPacketBudgetReconciler) deleteBudgetPurge(ctx context.Context, s *budgetScope) (stepResult, error) {
	b := s.budget
	rctx, cancel := r.redisContext(ctx)
	defer cancel()
	if b.Spec.Redis == nil {
		if _, err := s.store.DeleteUser(rctx); err != nil && !errors.Is(err, store.ErrACLUnavailable) {
			return stepResult{}, fmt.Errorf("removing the budget's Redis user: %w", err)
		}
	}
	r.warnedTimeZone.Delete(b.UID)
	if r.Expiry != nil {
		// Nothing may expire into the keys while they go.
		r.Expiry.Forget(b.UID)
	}
	// From here the keys' absence is the purge's: a purge cut short and finished by
	// a later reconcile is no loss of data (deleteBudgetDataLoss).
	if err := s.store.MarkPurge(rctx); err != nil {
		return stepResult{}, err
	}
	if err := s.store.Purge(rctx); err != nil {
		return stepResult{}, fmt.Errorf("purging the budget's keys: %w", err)
	}
	r.forget(b.UID)
	budgetMetrics.Forget(client.ObjectKeyFromObject(b))
	orig := b.DeepCopy()
	controllerutil.RemoveFinalizer(b, BudgetFinalizer)
	if err := r.Client.Patch(ctx, b, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil && !apierrors.IsNotFound(err) {
		return stepResult{}, fmt.Errorf("removing finalizer %s: %w", BudgetFinalizer, err)
	}
	s.released = true
	ctrl.LoggerFrom(ctx).Info("purged the deleted budget", "refunded", s.snapshot.Refunded, "claimed", s.snapshot.Claimed)
	return stepResult{}, nil
}
