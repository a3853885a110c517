// Package controllers holds the RedPacketActivity reconciler: it splits an activity's
// money into packets, seeds them into Redis exactly once, loads the grab script, runs
// the activity's grab workload, opens, pauses and closes grabbing on schedule, and
// cleans the activity's Redis keys up once settlement has drained.
package controllers

import (
	"context"
	"fmt"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	kerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

const (
	// FieldManager is the field manager of everything the controller applies: its
	// status fields and the grab workload.
	FieldManager = "redpacket-controller"

	// Finalizer holds a deleted activity until its Redis keys are cleaned up.
	Finalizer = "redpacket.io/cleanup"

	// ControllerName is the default name of the controller (in logs and metrics).
	ControllerName = "redpacketactivity"

	// EventReporter is the reporting controller of the events the controller emits.
	EventReporter = "redpacket-controller"
)

// Defaults for Options fields left at zero.
const (
	DefaultGrabImage           = "redpacket-operator:latest"
	DefaultGrabReplicas        = 1
	DefaultCleanupGracePeriod  = 10 * time.Minute
	DefaultUnsettledRetention  = 30 * 24 * time.Hour
	DefaultGrabReportTimeout   = 10 * time.Second
	DefaultRedisTimeout        = 5 * time.Second
	DefaultActiveResyncPeriod  = 5 * time.Second
	DefaultCleanupPollInterval = 2 * time.Second
	DefaultMaxBackoff          = time.Minute
	// DefaultGrabTokenMaxLifetime matches the grab service's own default.
	DefaultGrabTokenMaxLifetime = 24 * time.Hour
)

// Options are the operator-wide settings of the controller. DefaultRedis,
// AllowedRedisHosts and RedisTimeout are the Redis policy: NewRedisAccess reads them
// once into the RedisAccess the reconcilers share, which is what the steps consult.
type Options struct {
	// DefaultRedis is the connection of activities without spec.redis.
	DefaultRedis redisconn.Conn
	// GrabImage is the grab service image of activities without spec.grabService.image.
	GrabImage string
	// GrabReplicas is the grab Deployment's replicas of activities without
	// spec.grabService.replicas; 0 is a valid count, a negative one means
	// DefaultGrabReplicas.
	GrabReplicas int32
	// CleanupGracePeriod is how long deletion waits for settlement to drain before it
	// deletes the Redis keys anyway.
	CleanupGracePeriod time.Duration
	// UnsettledRetention is how long the settlement and dead-letter streams of an
	// activity deleted before settlement drained are kept, so the claims and refunds
	// never credited can still be reconciled by hand.
	UnsettledRetention time.Duration
	// GrabTokenMaxLifetime is passed to the grab services of activities with
	// spec.grabService.auth as --token-max-lifetime: a user token whose exp lies
	// further ahead is refused. Zero or less means DefaultGrabTokenMaxLifetime.
	GrabTokenMaxLifetime time.Duration
	// GrabReportTimeout is how recent status.lastReportTime must be for the grab service
	// to count as available.
	GrabReportTimeout time.Duration
	// RedisTimeout bounds every Redis call except seeding, whose deadline grows with
	// the packet count.
	RedisTimeout time.Duration
	// ActiveResyncPeriod is how often an Active activity (and a closed one that has not
	// settled yet) is looked at again, to notice exhaustion, settlement and staleness.
	ActiveResyncPeriod time.Duration
	// CleanupPollInterval is how often a deleted activity checks whether settlement
	// has drained.
	CleanupPollInterval time.Duration
	// MaxBackoff caps the exponential backoff after errors (Redis down, say).
	MaxBackoff time.Duration
	// GatewayAPIRecheckPeriod is how long "the Gateway API is not installed" is
	// believed before discovery is asked again; 0 means DefaultGatewayAPIRecheckPeriod.
	GatewayAPIRecheckPeriod time.Duration
	// MaxConcurrentReconciles is how many activities are reconciled at once; 0 means 1.
	MaxConcurrentReconciles int
	// SettlementConsumer is the consumer name of the settlement workers the operator
	// runs for deleted activities waiting for settlement; empty means "operator-" and
	// the pod's name (POD_NAME, else the host name).
	SettlementConsumer string
	// SettlementKeysSecret is the Secret holding the keys that sign settlement
	// deliveries, one per balance system host (settlement_keys.go); an empty name
	// means DefaultSettlementKeysSecret, an empty namespace the operator's own
	// (POD_NAMESPACE, else DefaultOperatorNamespace).
	SettlementKeysSecret types.NamespacedName
	// SettlementRegisterer receives the settlement workers' metrics; nil means
	// controller-runtime's registry, which the manager serves.
	SettlementRegisterer prometheus.Registerer
	// SettlementMinConcurrency and SettlementMaxConcurrency bound the adaptive limit
	// on each settlement worker's first deliveries in flight (one worker per shard of
	// an activity or a budget; settlement.Config.MinConcurrency and MaxConcurrency):
	// the platform's ceiling on what one shard's worker asks of a balance system at
	// once, and the floor it keeps while the balance system fails. 0 means
	// settlement.DefaultMinConcurrency and settlement.DefaultMaxConcurrency.
	SettlementMinConcurrency, SettlementMaxConcurrency int
	// ReconcileInterval is how often each activity's and budget's ledger is compared
	// with the balance system's book (settlement_reconciliation.go); 0 means
	// DefaultReconcileInterval. A deletion asks for a comparison at once.
	ReconcileInterval time.Duration
	// Name is the controller's name; empty means ControllerName. Several managers in
	// one process need distinct names (or SkipNameValidation).
	Name string
	// SkipNameValidation lets several controllers share a name (tests).
	SkipNameValidation bool
	// AllowGrabImageOverride lets spec.grabService.image replace GrabImage. When
	// false (the default), an activity that names another image gets Ready False
	// with reason GrabImageNotAllowed and its grab workload is left as it is.
	AllowGrabImageOverride bool
	// AllowedRedisHosts are the hosts and networks spec.redis may name besides the
	// default Redis's own addresses; the zero value allows none. Any other address
	// is refused with reason RedisNotAllowed before a connection is attempted.
	AllowedRedisHosts RedisHosts
	// LibraryRetireAfter is how long another release's function library goes
	// uncalled by any grab pod before the function keeper deletes it
	// (FunctionKeeper.RetireOnce); 0 means DefaultLibraryRetireAfter.
	LibraryRetireAfter time.Duration
}

func (o Options) withDefaults() Options {
	if o.GrabImage == "" {
		o.GrabImage = DefaultGrabImage
	}
	if o.GrabReplicas < 0 {
		o.GrabReplicas = DefaultGrabReplicas
	}
	if o.CleanupGracePeriod <= 0 {
		o.CleanupGracePeriod = DefaultCleanupGracePeriod
	}
	if o.UnsettledRetention <= 0 {
		o.UnsettledRetention = DefaultUnsettledRetention
	}
	if o.GrabTokenMaxLifetime <= 0 {
		o.GrabTokenMaxLifetime = DefaultGrabTokenMaxLifetime
	}
	if o.GrabReportTimeout <= 0 {
		o.GrabReportTimeout = DefaultGrabReportTimeout
	}
	if o.RedisTimeout <= 0 {
		o.RedisTimeout = DefaultRedisTimeout
	}
	if o.ActiveResyncPeriod <= 0 {
		o.ActiveResyncPeriod = DefaultActiveResyncPeriod
	}
	if o.CleanupPollInterval <= 0 {
		o.CleanupPollInterval = DefaultCleanupPollInterval
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = DefaultMaxBackoff
	}
	if o.GatewayAPIRecheckPeriod <= 0 {
		o.GatewayAPIRecheckPeriod = DefaultGatewayAPIRecheckPeriod
	}
	if o.ReconcileInterval <= 0 {
		o.ReconcileInterval = DefaultReconcileInterval
	}
	if o.MaxConcurrentReconciles <= 0 {
		o.MaxConcurrentReconciles = 1
	}
	if o.SettlementConsumer == "" {
		o.SettlementConsumer = defaultSettlementConsumer()
	}
	o.SettlementKeysSecret = o.settlementKeysSecret()
	if o.SettlementRegisterer == nil {
		o.SettlementRegisterer = ctrlmetrics.Registry
	}
	if o.Name == "" {
		o.Name = ControllerName
	}
	return o
}

// RedPacketActivityReconciler reconciles a RedPacketActivity into Redis (packets, the
// grab script, the open/paused/closed gate) and into a grab workload, and reports what
// it did in the activity's status under its own field manager.
type RedPacketActivityReconciler struct {
	// Client reads through the manager's cache and writes to the API server.
	Client client.Client
	// APIReader reads from the API server directly: Secrets, objects the cache does not
	// hold, and the activity's status when it matters that it is current.
	APIReader client.Reader
	// Recorder emits events.k8s.io events.
	Recorder events.EventRecorder
	// RedisAccess is how the activities reach Redis: the operator's Redis policy,
	// the cached clients and the function keeper, shared with the budget controller;
	// nil is made from Options by SetupWithManager.
	*RedisAccess
	// Settlers runs the operator's settlement workers, one per seeded activity with a
	// webhook, until its deletion has drained.
	Settlers *SettlementRunner
	// Seeder stages and commits packets; its zero value is what production uses.
	Seeder store.Seeder
	// Options are the operator-wide settings.
	Options Options
	// Now is the controller's clock; nil means time.Now.
	Now func() time.Time

	// newStore, when set, replaces the activity stores on the cached Redis clients
	// (storeFor); the phase tests set it.
	newStore storeFactory
	// exposer keeps spec.expose's route or Ingress; made by SetupWithManager (nil in
	// the phase tests, where the expose step does nothing).
	exposer *exposer
	// statuses, when set, replaces the API server as the status writer
	// (statusWriter); the phase tests set it.
	statuses statusWriter
	// counters, when set, replaces the API server as the money counters' writer
	// (the phase tests).
	counters countersWriter
	// access, when set, replaces the API server's SubjectAccessReviews as the judge
	// of platform decisions (the phase tests).
	access accessReviewer
}

// +kubebuilder:rbac:groups=redpacket.io,resources=redpacketactivities,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=redpacket.io,resources=redpacketactivities/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=redpacket.io,resources=redpacketactivities/finalizers,verbs=update
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;create;patch;delete
// +kubebuilder:rbac:groups="",resources=serviceaccounts;services,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=rbac.authorization.k8s.io,resources=roles;rolebindings,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=networking.k8s.io,resources=networkpolicies,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=autoscaling,resources=horizontalpodautoscalers,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch
// +kubebuilder:rbac:groups="",resources=events,verbs=create;patch

// SetupWithManager registers the reconciler with mgr. Fields left nil are filled
// from the manager, a nil RedisAccess from Options (RedisAccess.SetupWithManager);
// the Redis client cache is closed when the manager stops, and the
// deletion settlement workers (a leader-election runnable) are stopped with it.
func (r *RedPacketActivityReconciler) SetupWithManager(mgr ctrl.Manager) error {
	r.Options = r.Options.withDefaults()
	wiring := reconcilerWiring{client: &r.Client, reader: &r.APIReader, recorder: &r.Recorder, now: &r.Now, access: &r.RedisAccess}
	if err := wiring.fill(mgr, r.Options); err != nil {
		return err
	}
	if r.Settlers == nil {
		r.Settlers = NewSettlementRunner()
		if err := mgr.Add(r.Settlers); err != nil {
			return fmt.Errorf("adding the deletion settlement workers to the manager: %w", err)
		}
	}
	x, watchRoutes := newExposer(mgr, r.Client, r.APIReader, r.Options.GatewayAPIRecheckPeriod)
	r.exposer = x
	err := watchExposure(ctrl.NewControllerManagedBy(mgr), watchRoutes).
		Named(r.Options.Name).
		For(&redpacketv1alpha1.RedPacketActivity{}, builder.WithPredicates(activityChangePredicate())).
		Owns(&appsv1.Deployment{}).
		// Their spec changes and deletions only: a PodDisruptionBudget's status moves
		// with every pod's readiness.
		Owns(&networkingv1.NetworkPolicy{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Owns(&policyv1.PodDisruptionBudget{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		// Spec edits only, so an edit of the minimum inside a prewarm window is put
		// back at once; the HPA's status moves with every metrics sync.
		Owns(&autoscalingv2.HorizontalPodAutoscaler{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		WithOptions(r.Options.controllerOptions()).
		Complete(r)
	if err != nil {
		return fmt.Errorf("building the %s controller: %w", r.Options.Name, err)
	}
	return nil
}

// CacheOptions are the manager's cache settings the controller relies on: the kinds of
// the grab workload are cached only when they carry the operator's managed-by label, so
// the cache holds the operator's own objects rather than every Deployment, Service,
// ServiceAccount, Role, RoleBinding, NetworkPolicy, PodDisruptionBudget and
// HorizontalPodAutoscaler of the cluster. Objects the cache does not hold are looked up on the API server directly
// before anything is applied. namespaces, when given, restrict the whole cache to
// them.
func CacheOptions(namespaces ...string) cache.Options {
	managed := cache.ByObject{Label: labels.SelectorFromSet(labels.Set{specs.LabelManagedBy: specs.ManagedByValue})}
	opts := cache.Options{
		ByObject: map[client.Object]cache.ByObject{
			&appsv1.Deployment{}:                     managed,
			&corev1.Service{}:                        managed,
			&corev1.ServiceAccount{}:                 managed,
			&rbacv1.Role{}:                           managed,
			&rbacv1.RoleBinding{}:                    managed,
			&networkingv1.NetworkPolicy{}:            managed,
			&policyv1.PodDisruptionBudget{}:          managed,
			&autoscalingv2.HorizontalPodAutoscaler{}: managed,
			&networkingv1.Ingress{}:                  managed,
		},
	}
	if len(namespaces) > 0 {
		opts.DefaultNamespaces = map[string]cache.Config{}
		for _, ns := range namespaces {
			opts.DefaultNamespaces[ns] = cache.Config{}
		}
	}
	return opts
}

// activityChangePredicate lets through the activity events the controller must act
// on: spec changes (a new generation), annotation and label changes (also a way to
// force a reconcile), deletion, and the four kinds of status writes of the grab
// service that need a prompt reaction (grabServiceSignalPredicate): the first report
// and any report while GrabServiceAvailable is not True, the last packet claimed,
// every claim of a closed or deleted activity settled, and the first dead letter.
// Every other status write of the grab service is ignored, so its reports do not cause
// a storm of reconciles; the periodic resync of active activities notices the rest.
func activityChangePredicate() predicate.Predicate {
	return predicate.Or(
		predicate.GenerationChangedPredicate{},
		predicate.AnnotationChangedPredicate{},
		predicate.LabelChangedPredicate{},
		deletionPredicate(),
		grabServiceSignalPredicate(),
	)
}

// deletionPredicate fires when an activity is marked for deletion or removed.
func deletionPredicate() predicate.Predicate {
	return predicate.Funcs{
		CreateFunc: func(event.CreateEvent) bool { return false },
		UpdateFunc: func(e event.UpdateEvent) bool {
			return e.ObjectOld.GetDeletionTimestamp().IsZero() != e.ObjectNew.GetDeletionTimestamp().IsZero()
		},
		DeleteFunc:  func(event.DeleteEvent) bool { return true },
		GenericFunc: func(event.GenericEvent) bool { return false },
	}
}

// grabServiceSignalPredicate fires on the grab service's reports that change what the
// controller says: status.remainingCount becoming 0 (the activity can be closed as
// exhausted now), status.lastReportTime set for the first time, or changed while
// the controller's GrabServiceAvailable is not True (a grab replica is up: it and
// Ready may turn True), status.settledCount reaching status.claimedCount on an
// activity that is closed or being deleted (Settled may turn True; deletion may
// purge), and status.deadLetterCount leaving 0 (Settled turns False with
// DeadLetters). Each is a transition, so a steady stream of reports lets through at
// most a few of them: once the controller says GrabServiceAvailable=True, reports
// that only refresh lastReportTime are ignored again.
func grabServiceSignalPredicate() predicate.Predicate {
	return predicate.Funcs{
		CreateFunc: func(event.CreateEvent) bool { return false },
		UpdateFunc: func(e event.UpdateEvent) bool {
			oldA, ok1 := e.ObjectOld.(*redpacketv1alpha1.RedPacketActivity)
			newA, ok2 := e.ObjectNew.(*redpacketv1alpha1.RedPacketActivity)
			if !ok1 || !ok2 {
				return false
			}
			oldSt, newSt := &oldA.Status, &newA.Status
			becameEmpty := isZero(newSt.RemainingCount) && !isZero(oldSt.RemainingCount)
			firstReport := oldSt.LastReportTime == nil && newSt.LastReportTime != nil
			reportWhileUnavailable := newSt.LastReportTime != nil && !newSt.LastReportTime.Equal(oldSt.LastReportTime) &&
				!meta.IsStatusConditionTrue(newSt.Conditions, redpacketv1alpha1.ConditionGrabServiceAvailable)
			closed := newSt.Phase == redpacketv1alpha1.PhaseExhausted || newSt.Phase == redpacketv1alpha1.PhaseExpired ||
				!newA.DeletionTimestamp.IsZero()
			caughtUp := closed && allSettled(newSt) && !allSettled(oldSt)
			firstDeadLetter := isPositive(newSt.DeadLetterCount) && !isPositive(oldSt.DeadLetterCount)
			return becameEmpty || firstReport || reportWhileUnavailable || caughtUp || firstDeadLetter
		},
		DeleteFunc:  func(event.DeleteEvent) bool { return false },
		GenericFunc: func(event.GenericEvent) bool { return false },
	}
}

// isZero reports whether a status counter is reported and 0.
func isZero(v *int64) bool { return v != nil && *v == 0 }

// isPositive reports whether a status counter is reported and above 0.
func isPositive(v *int64) bool { return v != nil && *v > 0 }

// allSettled reports whether the grab service reported every claim settled.
func allSettled(st *redpacketv1alpha1.RedPacketActivityStatus) bool {
	return st.SettledCount != nil && st.ClaimedCount != nil && *st.SettledCount == *st.ClaimedCount
}

// Reconcile moves one activity towards its spec: deletion first, then the finalizer,
// then the ordered steps of reconcileNormal. The controller's status fields are
// applied once, on the way out, whatever happened (finishReconcile), on the deletion
// path too; only an activity the controller has let go, or never held, gets none.
func (r *RedPacketActivityReconciler) Reconcile(ctx context.Context, req ctrl.Request) (result ctrl.Result, retErr error) {
	log := ctrl.LoggerFrom(ctx)

	activity := &redpacketv1alpha1.RedPacketActivity{}
	if err := r.Client.Get(ctx, req.NamespacedName, activity); err != nil {
		if apierrors.IsNotFound(err) {
			// Gone: nothing is left to settle from here.
			r.Settlers.StopNamed(req.NamespacedName, "")
			forgetActivityMetrics(req.NamespacedName)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, fmt.Errorf("getting activity %s: %w", req.NamespacedName, err)
	}
	// A worker of an earlier activity of the same name has no business any more.
	r.Settlers.StopNamed(req.NamespacedName, activity.UID)

	deleting := !activity.DeletionTimestamp.IsZero()
	if deleting && !controllerutil.ContainsFinalizer(activity, Finalizer) {
		// Someone else let it go: nothing waits for settlement any more, and the
		// activity is not the controller's to write.
		r.Settlers.Stop(activity.UID)
		return ctrl.Result{}, nil
	}

	scope := newActivityScope(activity, r.now())
	defer func() {
		result, retErr = r.finishReconcile(ctx, scope, result, retErr)
	}()

	if deleting {
		return r.reconcileDelete(ctx, scope)
	}
	if !controllerutil.ContainsFinalizer(activity, Finalizer) {
		if err := r.addFinalizer(ctx, activity); err != nil {
			return ctrl.Result{}, err
		}
	}
	result, retErr = r.reconcileNormal(ctx, scope)
	if retErr != nil {
		log.V(1).Info("reconcile stopped, retrying with backoff", "error", retErr.Error())
	}
	return result, retErr
}

// finishReconcile is the one status apply of a reconcile, on every path. The
// generation counts as observed only when the reconcile was clean (no error, no step
// halted); otherwise status keeps the generation observed before. It asks to come
// back when the last grab report turns stale, to say so.
func (r *RedPacketActivityReconciler) finishReconcile(ctx context.Context, s *activityScope, result ctrl.Result, retErr error) (ctrl.Result, error) {
	if s.released {
		return result, retErr
	}
	if s.clean(retErr) {
		s.status.ObservedGeneration = s.activity.Generation
	}
	staleIn, err := r.patchStatus(ctx, s)
	observeActivityMetrics(s)
	switch {
	case err != nil && !isNotFoundOrGone(err):
		retErr = kerrors.NewAggregate([]error{retErr, err})
	case err == nil && retErr == nil && staleIn > 0:
		result = lowestNonZeroResult(result, ctrl.Result{RequeueAfter: staleIn})
	}
	return result, retErr
}

// reconcileNormal runs the steps of an activity that is not being deleted
// (normalSteps), the seed step with the status patcher it needs.
func (r *RedPacketActivityReconciler) reconcileNormal(ctx context.Context, s *activityScope) (ctrl.Result, error) {
	return runSteps(ctx, s, r.normalSteps(r.patchStatusNow), latestBlocker)
}

// addFinalizer adds the cleanup finalizer with an optimistic-lock patch.
func (r *RedPacketActivityReconciler) addFinalizer(ctx context.Context, activity *redpacketv1alpha1.RedPacketActivity) error {
	orig := activity.DeepCopy()
	controllerutil.AddFinalizer(activity, Finalizer)
	if err := r.Client.Patch(ctx, activity, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("adding finalizer %s: %w", Finalizer, err)
	}
	return nil
}

func (r *RedPacketActivityReconciler) now() time.Time {
	if r.Now == nil {
		return time.Now()
	}
	return r.Now()
}

func (r *RedPacketActivityReconciler) logger(ctx context.Context) logr.Logger {
	return ctrl.LoggerFrom(ctx)
}

// lowestNonZeroResult returns the result that asks to come back sooner.
func lowestNonZeroResult(a, b ctrl.Result) ctrl.Result {
	return ctrl.Result{RequeueAfter: soonest(a.RequeueAfter, b.RequeueAfter)}
}

// soonest returns the shorter of two requeue delays, 0 meaning none.
func soonest(a, b time.Duration) time.Duration {
	switch {
	case a == 0:
		return b
	case b == 0:
		return a
	default:
		return min(a, b)
	}
}
