package controllers

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/settlement"
)

// SettlementRunner runs the operator's settlement workers: one per activity (by UID)
// that has a webhook, from the time it is seeded until its deletion has drained.
// Settlement runs here, never in the grab pods: everything in the tenant's namespace
// (pods, Secrets) is readable by the tenant, and the key that signs credits must not
// be (settlementKeys). The reconciler asks for a worker at every reconcile of a
// seeded activity and of a deletion waiting for settlement (ensureSettlement), and
// stops it (waiting until it has stopped) before the finalizer goes: before the keys
// are purged, at the end of the grace period, or when the activity is gone. The
// same registry caches each activity's seeded split (Budget), which every entry is
// checked against before it is delivered.
//
// SettlementRunner is a manager Runnable that needs leader election, so workers run
// only on the elected operator, never twice for one activity from one process, and
// all of them stop when the manager stops or loses the lead. Workers asked for
// before Start runs are started by Start.
type SettlementRunner struct {
	mu      sync.Mutex
	ctx     context.Context // Start's context; nil until Start runs
	stopped bool            // Start's context ended: no new workers
	workers map[types.UID]*activitySettler
	// budgets caches each activity's seeded split while a worker may need it.
	budgets map[types.UID]*settlement.Allowance
	// health is each activity's delivery health (settlement.DeliveryHealth), shared
	// by its workers, read for SettlementDegraded.
	health map[types.UID]*deliveryHealth
	// reconcilers holds each source's last reconciliation with the balance system
	// (settlement_reconciliation.go), run beside its workers.
	reconcilers reconcilerRegistry
}

// deliveryHealth is an activity's delivery health and when a Warning event last
// said that its deliveries fail.
type deliveryHealth struct {
	*settlement.DeliveryHealth
	warnedAt time.Time
}

// activitySettler is one activity's worker.
type activitySettler struct {
	name        types.NamespacedName
	fingerprint string
	run         func(context.Context)
	cancel      context.CancelFunc // nil until started
	done        chan struct{}      // closed when run returned
}

var _ manager.LeaderElectionRunnable = (*SettlementRunner)(nil)

// NewSettlementRunner returns a registry with no workers.
func NewSettlementRunner() *SettlementRunner {
	return &SettlementRunner{workers: map[types.UID]*activitySettler{}, budgets: map[types.UID]*settlement.Allowance{},
		health: map[types.UID]*deliveryHealth{}}
}

// Ensure keeps a worker running for the activity uid (named name) with the given
// configuration fingerprint: a worker with the same fingerprint that still runs is
// left alone; one with another fingerprint (the webhook or the key changed) is
// stopped, and waited for, before run starts in its place, and so is a worker whose
// run returned by itself. run must return when its context ends. Nothing starts once
// the registry has stopped.
func (d *SettlementRunner) Ensure(uid types.UID, name types.NamespacedName, fingerprint string, run func(context.Context)) {
	d.mu.Lock()
	if d.stopped {
		d.mu.Unlock()
		return
	}
	old := d.workers[uid]
	if old != nil && old.fingerprint == fingerprint && !old.ended() {
		d.mu.Unlock()
		return
	}
	delete(d.workers, uid)
	d.mu.Unlock()
	old.stop()

	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stopped || d.workers[uid] != nil {
		return
	}
	w := &activitySettler{name: name, fingerprint: fingerprint, run: run, done: make(chan struct{})}
	d.workers[uid] = w
	if d.ctx != nil {
		w.start(d.ctx)
	}
}

// Stop stops the activity's worker, if any, and returns once it has stopped.
func (d *SettlementRunner) Stop(uid types.UID) {
	d.mu.Lock()
	w := d.workers[uid]
	delete(d.workers, uid)
	delete(d.budgets, uid)
	delete(d.health, uid)
	d.mu.Unlock()
	w.stop()
	d.reconcilers.forget(uid)
}

// StopNamed stops, and waits for, the workers of activities named name, except the
// one with UID keep (none when keep is empty): the activity is gone, or was replaced
// by a new one of the same name.
func (d *SettlementRunner) StopNamed(name types.NamespacedName, keep types.UID) {
	d.mu.Lock()
	stop := map[types.UID]*activitySettler{}
	for uid, w := range d.workers {
		if w.name == name && uid != keep {
			stop[uid] = w
			delete(d.workers, uid)
			delete(d.budgets, uid)
			delete(d.health, uid)
		}
	}
	d.mu.Unlock()
	for uid, w := range stop {
		w.stop()
		d.reconcilers.forget(uid)
	}
}

// Running reports whether a worker is registered for the activity uid and has not
// ended.
func (d *SettlementRunner) Running(uid types.UID) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	w := d.workers[uid]
	return w != nil && !w.ended()
}

// Len is the number of registered workers.
func (d *SettlementRunner) Len() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.workers)
}

// Start starts the workers asked for so far and every later one under ctx; when ctx
// ends it stops them all and returns once they have stopped. It makes the registry a
// manager.Runnable.
func (d *SettlementRunner) Start(ctx context.Context) error {
	d.mu.Lock()
	if d.ctx != nil || d.stopped {
		d.mu.Unlock()
		return fmt.Errorf("the deletion settlement workers were started before")
	}
	d.ctx = ctx
	for _, w := range d.workers {
		w.start(ctx)
	}
	d.mu.Unlock()

	<-ctx.Done()

	d.mu.Lock()
	d.stopped = true
	workers := d.workers
	d.workers = map[types.UID]*activitySettler{}
	d.mu.Unlock()
	for _, w := range workers {
		w.stop()
	}
	return nil
}

// NeedLeaderElection is true: only the elected operator delivers.
func (d *SettlementRunner) NeedLeaderElection() bool { return true }

func (w *activitySettler) start(ctx context.Context) {
	wctx, cancel := context.WithCancel(ctx)
	w.cancel = cancel
	go func() {
		defer close(w.done)
		w.run(wctx)
	}()
}

// stop cancels the worker and waits for it; a worker never started is dropped.
func (w *activitySettler) stop() {
	if w == nil || w.cancel == nil {
		return
	}
	w.cancel()
	<-w.done
}

// ended reports whether a started worker's run returned.
func (w *activitySettler) ended() bool {
	if w.cancel == nil {
		return false
	}
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

// deliveryHealth returns the activity's delivery health, made when first asked for.
func (d *SettlementRunner) deliveryHealth(uid types.UID) *deliveryHealth {
	d.mu.Lock()
	defer d.mu.Unlock()
	h := d.health[uid]
	if h == nil {
		h = &deliveryHealth{DeliveryHealth: settlement.NewDeliveryHealth()}
		d.health[uid] = h
	}
	return h
}

// settlementWarningInterval is how often, at most, a Warning event repeats that an
// activity's deliveries keep failing.
const settlementWarningInterval = 5 * time.Minute

// dueForWarning reports whether a Warning event about the activity's failing
// deliveries is due at now (none in the last settlementWarningInterval), and if so
// records it as sent.
func (d *SettlementRunner) dueForWarning(uid types.UID, now time.Time) bool {
	h := d.deliveryHealth(uid)
	d.mu.Lock()
	defer d.mu.Unlock()
	if !h.warnedAt.IsZero() && now.Sub(h.warnedAt) < settlementWarningInterval {
		return false
	}
	h.warnedAt = now
	return true
}

// defaultSettlementConsumer is the consumer name of the operator's settlement
// workers: "operator-" and the pod's name (POD_NAME, else the host name, which is
// the pod's name in Kubernetes), stable while the process runs, so a worker
// restarted for the same activity picks up its own pending entries.
func defaultSettlementConsumer() string {
	name := os.Getenv("POD_NAME")
	if name == "" {
		host, err := os.Hostname()
		if err != nil || host == "" {
			host = "unknown"
		}
		name = host
	}
	return "operator-" + name
}

// budget returns the activity's seeded split, computed once per UID by compute and
// kept while its worker may need it (until Stop or StopNamed).
func (d *SettlementRunner) budget(uid types.UID, compute func() (*settlement.Allowance, error)) (*settlement.Allowance, error) {
	d.mu.Lock()
	b := d.budgets[uid]
	d.mu.Unlock()
	if b != nil {
		return b, nil
	}
	b, err := compute()
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if old := d.budgets[uid]; old != nil {
		return old, nil
	}
	d.budgets[uid] = b
	return b, nil
}

// seededAllowance recomputes what was seeded for the activity: the split of its spec
// with status.splitSeed (the seed it was split with), at the time Seeded turned
// True (else the creation time).
func seededAllowance(a *redpacketv1alpha1.RedPacketActivity) (*settlement.Allowance, error) {
	params := splitParams(a)
	if a.Status.SplitSeed != nil {
		params.Seed = *a.Status.SplitSeed
	}
	amounts, err := split.Split(params)
	if err != nil {
		return nil, fmt.Errorf("recomputing the seeded split: %w", err)
	}
	at := a.CreationTimestamp.Time
	if c := meta.FindStatusCondition(a.Status.Conditions, redpacketv1alpha1.ConditionSeeded); c != nil && c.Status == metav1.ConditionTrue {
		at = c.LastTransitionTime.Time
	}
	return &settlement.Allowance{Total: a.Spec.TotalAmount, Count: a.Spec.Count, Amounts: amounts, At: at}, nil
}

// ensureSettlement keeps the operator's settlement worker of the activity running:
// the activity's consumer group, webhook URL, currency and maxAttempts
// (settlement.ActivityConfig), deliveries signed with the keys the operator's keys
// Secret holds for the webhook's host (signingKeys; never
// spec.settlement.webhook.secretRef), every entry checked against the seeded split
// and the ledger (seededAllowance), forged entries raised as Warning events. Before the
// first grant the worker announces the budget (settlement.AnnounceAllowance). It has
// its own Redis client, closed when it stops. Without a webhook no worker runs
// (claims wait in the stream). It returns errWebhookHostNotAllowed (wrapped) when
// the webhook's host has no key, and why else no worker could start, such as a
// missing keys Secret; the next reconcile tries again.
func (r *RedPacketActivityReconciler) ensureSettlement(ctx context.Context, s *activityScope) error {
	a := s.activity
	if !settlement.HasWebhook(a) {
		r.Settlers.Stop(a.UID)
		return nil
	}
	keys, err := r.signingKeys(ctx, a.Spec.Settlement.Webhook.URL)
	if err != nil {
		r.Settlers.Stop(a.UID)
		return err
	}
	budget, err := r.Settlers.budget(a.UID, func() (*settlement.Allowance, error) { return seededAllowance(a) })
	if err != nil {
		return err
	}
	cfg := settlement.ActivityConfig(a, keys.hmac)
	keys.apply(&cfg)
	cfg.Consumer = r.Options.SettlementConsumer
	cfg.MinConcurrency, cfg.MaxConcurrency = r.Options.SettlementMinConcurrency, r.Options.SettlementMaxConcurrency
	cfg.Logger = slog.New(logr.ToSlogHandler(ctrl.Log.WithName("settlement")))
	cfg.Allowance = budget
	cfg.Health = r.Settlers.deliveryHealth(a.UID).DeliveryHealth
	cfg.Registerer = r.Options.SettlementRegisterer
	recorder, ref := r.Recorder, a.DeepCopy()
	cfg.OnForged = func(f settlement.ForgedEntry) {
		recorder.Eventf(ref, nil, corev1.EventTypeWarning, "ForgedSettlementEntry", "Settle",
			"settlement entry %s (shard %d) dead-lettered, not delivered: %s of packet %s to user %q for %d: %s (%s)",
			f.EntryID, f.Shard, f.Kind, f.PacketID, f.UserID, f.Amount, f.Reason, f.Detail)
	}
	// The worker's fingerprint covers where it delivers and how it signs; the Redis
	// connection (which may carry a password) is part of it as a hash.
	connSum := sha256.Sum256([]byte(s.conn.Key()))
	fingerprint := cfg.Fingerprint() + "|" + hex.EncodeToString(connSum[:])
	conn := s.conn
	shards := a.Spec.ShardCount()
	uid := a.UID
	r.Settlers.Ensure(a.UID, client.ObjectKeyFromObject(a), fingerprint, func(ctx context.Context) {
		rdb := conn.NewClient(r.redisClientOptions(conn, false))
		defer func() { _ = rdb.Close() }()
		cfg.Redis = rdb
		for failures := 0; ; failures++ {
			err := settlement.AnnounceAllowance(ctx, cfg, shards)
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return
			}
			cfg.Logger.Warn("announcing the activity's budget to the balance system failed; grants wait", "activity", cfg.Source.Ref(), "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(min(time.Duration(failures+1)*time.Second, 30*time.Second)):
			}
		}
		ws, err := settlement.NewShardWorkers(cfg, shards)
		if err != nil {
			// The worker ends; the next reconcile starts it again.
			cfg.Logger.Error("creating the settlement worker failed", "activity", cfg.Source.Ref(), "err", err)
			return
		}
		cfg.Logger.Info("settling the activity's claims from the operator", "activity", cfg.Source.Ref(), "webhook", cfg.WebhookURL,
			"consumer", cfg.Consumer, "shards", len(ws))
		if rc, err := settlement.NewActivityReconciler(cfg, shards); err != nil {
			cfg.Logger.Error("creating the activity's reconciliation failed", "activity", cfg.Source.Ref(), "err", err)
		} else {
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.Settlers.reconcilers.run(ctx, uid, "rpa/"+cfg.Source.Ref(), rc, r.Options.ReconcileInterval, cfg.Logger)
			}()
			defer wg.Wait()
		}
		if err := settlement.RunAll(ctx, ws); err != nil && ctx.Err() == nil {
			cfg.Logger.Error("the settlement worker stopped", "activity", cfg.Source.Ref(), "err", err)
		}
	})
	return nil
}

// reconcileSettlement keeps the operator's settlement worker running once Redis
// holds the seeded activity: see ensureSettlement. An activity not seeded yet (or
// whose data is lost) has nothing to settle and no budget to announce.
func (r *RedPacketActivityReconciler) reconcileSettlement(ctx context.Context, s *activityScope) (stepResult, error) {
	if !s.snapshot.Exists() {
		return stepResult{}, nil
	}
	if err := r.ensureSettlement(ctx, s); err != nil {
		r.settlementNotStarted(s, err)
		if errors.Is(err, errWebhookHostNotAllowed) {
			return stepResult{}, nil // said in Settled and an event; a keys change or the resync retries
		}
		return stepResult{}, fmt.Errorf("starting the settlement worker: %w", err)
	}
	if r.Settlers.Running(s.activity.UID) {
		health := r.Settlers.deliveryHealth(s.activity.UID).Snapshot()
		s.delivery = &health
		r.warnFailingDeliveries(s)
		r.readReconciliation(s)
	}
	return stepResult{}, nil
}

// readReconciliation reads the activity's last reconciliation for Reconciled, and
// raises a Warning event BooksDiffer when it found a difference the condition does
// not say yet.
func (r *RedPacketActivityReconciler) readReconciliation(s *activityScope) {
	s.reconciliation = r.Settlers.reconcilers.viewOf(s.activity.UID)
	if s.reconciliation.newDifference(s.activity.Status.Conditions) && r.Recorder != nil {
		r.Recorder.Eventf(s.activity, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonBooksDiffer, "Reconcile",
			"the balance system's book differs from what the operator paid: %s", boundedMessage(s.reconciliation.last.String()))
	}
}

// warnFailingDeliveries raises a Warning event while the activity's deliveries fail:
// when they start failing and again every settlementWarningInterval while they do.
// The event names the error class, never what the balance system answered.
func (r *RedPacketActivityReconciler) warnFailingDeliveries(s *activityScope) {
	if s.delivery == nil || !s.delivery.Degraded() || r.Recorder == nil {
		return
	}
	if !r.Settlers.dueForWarning(s.activity.UID, r.Now()) {
		return
	}
	r.Recorder.Eventf(s.activity, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonDeliveriesFailing, "Settle",
		"settlement deliveries to the webhook are failing: %s", s.delivery)
}

// settlementNotStarted records why the settlement worker could not start: a webhook
// host that is not allowed makes Settled False with reason WebhookHostNotAllowed and
// a Warning event (once per change of the condition).
func (r *RedPacketActivityReconciler) settlementNotStarted(s *activityScope, err error) {
	if !errors.Is(err, errWebhookHostNotAllowed) {
		return
	}
	s.settlementBlocked = fmt.Sprintf("nothing is delivered: %v", err)
	c := meta.FindStatusCondition(s.activity.Status.Conditions, redpacketv1alpha1.ConditionSettled)
	if c == nil || c.Reason != redpacketv1alpha1.ReasonWebhookHostNotAllowed || c.Message != s.settlementBlocked {
		r.Recorder.Eventf(s.activity, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonWebhookHostNotAllowed, "Settle",
			"%s", s.settlementBlocked)
	}
}
