package controllers

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

const (
	// BudgetFieldManager is the field manager of everything the budget controller
	// applies: the budget's status and its grab workload.
	BudgetFieldManager = "redpacket-budget-controller"
	// BudgetReplicasFieldManager holds a budget's grab Deployment spec.replicas
	// while spec.grabService.autoscaling is set: the operator's HPA owns the count,
	// and BudgetFieldManager's apply leaves spec.replicas out. It applies only the
	// count the Deployment already has (or the HPA's minimum on creation), once, so
	// that the field keeps an owner when BudgetFieldManager lets it go (a field no
	// manager holds any more would be reset to 1); the HPA's scale writes take it
	// over from there.
	BudgetReplicasFieldManager = "redpacket-budget-controller-replicas"
	// BudgetAcceptanceFieldManager applies a budget's status.lastAcceptance alone,
	// so the budget controller's apply, which leaves the field out, never removes it.
	BudgetAcceptanceFieldManager = "redpacket-budget-acceptance"

	// BudgetFinalizer holds a deleted budget until every live packet expired, was
	// refunded and settled, and its Redis keys are gone.
	BudgetFinalizer = "redpacket.io/budget-cleanup"

	// BudgetControllerName is the default name of the budget controller.
	BudgetControllerName = "redpacketbudget"
)

// BudgetSettlement runs the settlement of budgets' streams; BudgetSettlementRunner
// (redpacketbudget_settlement.go) implements it. The reconciler calls EnsureTarget at every
// reconcile of a budget with spec.settlement.webhook, before the configure step, so
// that a raised total is announced to the balance system before the shards may draw
// on it; DrainedTarget while a deleted budget waits to be purged; and Forget once it
// is gone. nil means no settlement: entries wait in the streams.
type BudgetSettlement interface {
	// EnsureTarget announces the budget's total when it grew and makes its shards'
	// streams be settled (idempotent).
	EnsureTarget(ctx context.Context, t BudgetSettlementTarget) error
	// DrainedTarget reports whether every entry of every shard's stream was
	// credited, so the keys may go, and when not, how many are still unsettled and
	// how many were dead-lettered (BudgetDrain).
	DrainedTarget(ctx context.Context, t BudgetSettlementTarget) (BudgetDrain, error)
	// Forget stops settling the budget uid.
	Forget(uid types.UID)
}

// BudgetDrain is what a deleted budget's settlement still owes. Drained holds only
// when nothing does: no entry waits in a stream and no dead letter waits for a replay.
// Dead letters are the record of credits the balance system refused; purging the
// keys with them would forget money owed, so a budget holding some is not drained
// until they are replayed (kubectl rpa replay-dead-letters rpb/NAME) or the platform
// team abandons them.
type BudgetDrain struct {
	Drained bool
	// Unsettled counts the stream entries not yet settled or dead-lettered;
	// DeadLetters the entries in the dead-letter streams.
	Unsettled, DeadLetters int64
}

// Owed is every entry not credited: unsettled and dead-lettered.
func (d BudgetDrain) Owed() int64 { return d.Unsettled + d.DeadLetters }

// budgetStore is what the controller does to a budget in Redis; budgetHandle, on a
// store.Budget, implements it, and the phase tests fake it.
type budgetStore interface {
	budgetExpirer
	// LoadLibrary loads the grab-side function library on every master.
	LoadLibrary(ctx context.Context) error
	Configure(ctx context.Context, total int64, limits store.BudgetLimits) error
	Snapshot(ctx context.Context) (store.BudgetSnapshot, error)
	AdvanceEpoch(ctx context.Context) (int64, error)
	Close(ctx context.Context) error
	Purge(ctx context.Context) error
	// MarkPurge records that the purge begins, PurgeBegun reads it
	// (store.BudgetLedger.MarkPurge): the keys' absence is then no loss of data.
	MarkPurge(ctx context.Context) error
	PurgeBegun(ctx context.Context) (bool, error)
	// Fence makes every shard answer creations and grabs fenced and expire nothing
	// (store.Budget.Fence); Unfence lifts it (store.Budget.Unfence).
	Fence(ctx context.Context, reason string) error
	Unfence(ctx context.Context) error
	// LedgerSums reads the budget's settlement ledger (store.Budget.LedgerSums).
	LedgerSums(ctx context.Context) (store.BudgetLedgerSums, error)
	// CheckDurability checks that the master of every shard gives d (nil: None);
	// it wraps store.ErrDurabilityNotMet when one does not.
	CheckDurability(ctx context.Context, d *redpacketv1alpha1.Durability) error
	redisUsers
}

// budgetHandle is the production budgetStore: the store's handle and the client it
// runs on.
type budgetHandle struct {
	*store.Budget
	c redis.UniversalClient
}

// LoadLibrary loads the function library (store.Library) wherever it is missing.
func (h budgetHandle) LoadLibrary(ctx context.Context) error {
	_, err := store.NewLibrary(h.c).Ensure(ctx)
	return err
}

// CheckDurability checks the master of each shard's slot (store.Budget.CheckFsync,
// CheckReplicas), as an activity's durability step does.
func (h budgetHandle) CheckDurability(ctx context.Context, d *redpacketv1alpha1.Durability) error {
	if d == nil || d.Mode == "" || d.Mode == redpacketv1alpha1.DurabilityNone {
		return nil
	}
	switch d.Mode {
	case redpacketv1alpha1.DurabilityFsync:
		return h.CheckFsync(ctx)
	case redpacketv1alpha1.DurabilityReplicas:
		return h.CheckReplicas(ctx, int(d.Replicas))
	}
	return fmt.Errorf("unknown durability mode %q", d.Mode)
}

// RedPacketBudgetReconciler reconciles a RedPacketBudget into Redis (its shards'
// allotments and limits, the function library, its own Redis user) and into one
// shared grab workload, mints its sender credential, reports its money in status
// from Redis snapshots, and, at deletion, expires and refunds every live packet and
// purges the budget's keys once settled.
type RedPacketBudgetReconciler struct {
	// Client reads through the manager's cache and writes to the API server.
	Client client.Client
	// APIReader reads from the API server directly.
	APIReader client.Reader
	// Recorder emits events.k8s.io events.
	Recorder events.EventRecorder
	// RedisAccess is how the budgets reach Redis: the operator's Redis policy, the
	// cached clients and the function keeper, shared with the activity controller;
	// nil is made from Options by SetupWithManager.
	*RedisAccess
	// Expiry is the leader-elected expiry driver of every budget.
	Expiry *BudgetExpiry
	// exposer keeps spec.expose's route or Ingress; made by SetupWithManager.
	exposer *exposer
	// Settlement settles the budgets' streams; nil means no settlement.
	Settlement BudgetSettlement
	// Options are the operator-wide settings, the activity controller's.
	Options Options
	// Now is the controller's clock; nil means time.Now.
	Now func() time.Time

	// access answers the platform decisions (the abandon of a deletion that waits on
	// settlement); nil asks the API server (subjectAccessReviewer).
	access accessReviewer

	// newStore, when set, replaces the budget stores on the cached Redis clients
	// (the phase tests).
	newStore func(conn redisconn.Conn, b *redpacketv1alpha1.RedPacketBudget) budgetStore

	// warnedTimeZone is, by budget UID, the unknown time zone this process raised its
	// Warning for, so that it is raised once, not at every reconcile (a status read
	// from the cache can be older than the last one written).
	warnedTimeZone sync.Map
}

// +kubebuilder:rbac:groups=redpacket.io,resources=redpacketbudgets,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=redpacket.io,resources=redpacketbudgets/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=redpacket.io,resources=redpacketbudgets/finalizers,verbs=update
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;create;patch;delete
// +kubebuilder:rbac:groups="",resources=services,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=networking.k8s.io,resources=networkpolicies,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=autoscaling,resources=horizontalpodautoscalers,verbs=get;list;watch;create;update;patch;delete

// SetupWithManager registers the reconciler with mgr. A nil RedisAccess is made from
// Options; what it and Expiry leave nil is made and added to the manager (the
// function keeper and Expiry are leader-election runnables).
func (r *RedPacketBudgetReconciler) SetupWithManager(mgr ctrl.Manager) error {
	r.Options = r.Options.withDefaults()
	if r.Options.Name == ControllerName {
		r.Options.Name = BudgetControllerName
	}
	wiring := reconcilerWiring{client: &r.Client, reader: &r.APIReader, recorder: &r.Recorder, now: &r.Now, access: &r.RedisAccess}
	if err := wiring.fill(mgr, r.Options); err != nil {
		return err
	}
	if r.Expiry == nil {
		r.Expiry = NewBudgetExpiry()
		if err := mgr.Add(r.Expiry); err != nil {
			return fmt.Errorf("adding the budget expiry driver to the manager: %w", err)
		}
	}
	x, watchRoutes := newExposer(mgr, r.Client, r.APIReader, r.Options.GatewayAPIRecheckPeriod)
	r.exposer = x
	err := watchExposure(ctrl.NewControllerManagedBy(mgr), watchRoutes).
		Named(r.Options.Name).
		For(&redpacketv1alpha1.RedPacketBudget{}, builder.WithPredicates(predicate.Or(
			predicate.GenerationChangedPredicate{}, predicate.AnnotationChangedPredicate{},
			predicate.LabelChangedPredicate{}, deletionPredicate()))).
		Owns(&appsv1.Deployment{}).
		Owns(&networkingv1.NetworkPolicy{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		// Spec edits only: an edit of the operator's HPA is put back at once; its
		// status moves with every metrics sync.
		Owns(&autoscalingv2.HorizontalPodAutoscaler{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		WithOptions(r.Options.controllerOptions()).
		Complete(r)
	if err != nil {
		return fmt.Errorf("building the %s controller: %w", r.Options.Name, err)
	}
	return nil
}

// Reconcile moves one budget towards its spec: deletion first, then the finalizer,
// then the ordered steps of budgetNormalSteps. The status is applied once, on the way
// out, whatever happened, unless the budget was let go.
func (r *RedPacketBudgetReconciler) Reconcile(ctx context.Context, req ctrl.Request) (result ctrl.Result, retErr error) {
	budget := &redpacketv1alpha1.RedPacketBudget{}
	if err := r.Client.Get(ctx, req.NamespacedName, budget); err != nil {
		if apierrors.IsNotFound(err) {
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, fmt.Errorf("getting budget %s: %w", req.NamespacedName, err)
	}
	deleting := !budget.DeletionTimestamp.IsZero()
	if deleting && !controllerutil.ContainsFinalizer(budget, BudgetFinalizer) {
		r.forget(budget.UID)
		budgetMetrics.Forget(req.NamespacedName)
		return ctrl.Result{}, nil
	}

	s := newBudgetScope(budget, r.now())
	defer func() {
		result, retErr = r.finishBudgetReconcile(ctx, s, result, retErr)
	}()

	if deleting {
		return runSteps(ctx, s, r.budgetDeleteSteps(), earliestBlocker)
	}
	if !controllerutil.ContainsFinalizer(budget, BudgetFinalizer) {
		orig := budget.DeepCopy()
		controllerutil.AddFinalizer(budget, BudgetFinalizer)
		if err := r.Client.Patch(ctx, budget, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
			return ctrl.Result{}, fmt.Errorf("adding finalizer %s: %w", BudgetFinalizer, err)
		}
	}
	result, retErr = runSteps(ctx, s, r.budgetNormalSteps(), earliestBlocker)
	if retErr != nil {
		ctrl.LoggerFrom(ctx).V(1).Info("reconcile stopped, retrying with backoff", "error", retErr.Error())
	}
	return result, retErr
}

// forget stops everything the operator runs for the budget uid.
func (r *RedPacketBudgetReconciler) forget(uid types.UID) {
	if r.Expiry != nil {
		r.Expiry.Forget(uid)
	}
	if r.Functions != nil {
		r.Functions.Forget(uid)
	}
	if r.Settlement != nil {
		r.Settlement.Forget(uid)
	}
}

// storeFor is the budget's store on conn.
func (r *RedPacketBudgetReconciler) storeFor(conn redisconn.Conn, b *redpacketv1alpha1.RedPacketBudget) budgetStore {
	if r.newStore != nil {
		return r.newStore(conn, b)
	}
	c := r.redisClient(conn)
	h := budgetHandle{Budget: store.NewBudget(c, string(b.UID), b.Spec.ShardCount()), c: c}
	if l := r.ledgerConn(conn); l != nil {
		h.Budget = h.Budget.WithLedger(r.redisClient(*l))
	}
	return h
}

// ledgerConn is where the settlement ledger of a budget on conn lives when it is
// not beside the budget: the operator's default Redis, for a budget on a Redis of
// its own (spec.redis), whose credentials the tenant holds. It is nil for a budget
// on the default Redis, and for an operator without one (the ledger then stays
// beside the budget). The store handle (storeFor) and the settlement
// (settlementTarget) both follow it.
func (r *RedPacketBudgetReconciler) ledgerConn(conn redisconn.Conn) *redisconn.Conn {
	if r.isDefaultRedis(conn) {
		return nil
	}
	def, err := r.defaultRedisConn()
	if err != nil {
		return nil
	}
	return &def
}

func (r *RedPacketBudgetReconciler) now() time.Time {
	if r.Now == nil {
		return time.Now()
	}
	return r.Now()
}
