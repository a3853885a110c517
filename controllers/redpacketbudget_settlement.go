package controllers

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// BudgetSettlementTarget is what the settlement of one RedPacketBudget needs to know,
// filled in by the budget reconciler from the resource and the Redis connection it
// resolved (so this file does not depend on the API type):
//
//	BudgetSettlementTarget{
//		UID: b.UID, Name: client.ObjectKeyFromObject(b), Object: b,
//		Shards: int(b.Spec.BudgetShards), Total: b.Spec.Total, Currency: b.Spec.Currency,
//		WebhookURL: b.Spec.Settlement.Webhook.URL, MaxAttempts: int(b.Spec.Settlement.MaxAttempts),
//		MaxPacketCount: b.Spec.Packets.MaxCount, MaxTTL: b.Spec.Packets.MaxTTL.Duration,
//		Conn: s.conn, ClientOptions: r.redisClientOptions(s.conn, false),
//	}
type BudgetSettlementTarget struct {
	// UID is the budget's UID: the activityUID of its deliveries and the prefix of
	// every Idempotency-Key.
	UID types.UID
	// Name is the budget's namespace and name, "activity" in its deliveries.
	Name types.NamespacedName
	// Object, when set, is the budget the Warning events of forged entries are
	// about.
	Object runtime.Object
	// Shards is spec.budgetShards (immutable).
	Shards int
	// Total is spec.total: it is announced to the balance system before anything
	// beyond the last announced total may be credited.
	Total int64
	// Currency is spec.currency (settlement.DefaultCurrency when empty).
	Currency string
	// WebhookURL is spec.settlement.webhook.url; empty: nothing is settled and the
	// entries wait in the streams.
	WebhookURL string
	// MaxAttempts is spec.settlement.maxAttempts (0: the default).
	MaxAttempts int
	// MaxPacketCount is spec.packets.maxCount: a grant's share index is below it.
	MaxPacketCount int64
	// MaxTTL is spec.packets.maxTTL (0: a day): how long after its creation a
	// packet's entries may still be written.
	MaxTTL time.Duration
	// Conn is the budget's Redis as the operator reaches it, with ClientOptions (the
	// address check of a tenant's Redis).
	Conn          redisconn.Conn
	ClientOptions redisconn.ClientOptions
	// LedgerConn, when set (a budget with spec.redis), is the operator's own Redis,
	// where the budget's settlement ledger lives (store.Budget.WithLedger), reached
	// with LedgerClientOptions; unset, the ledger lives beside the budget, on the
	// operator's default Redis already.
	LedgerConn          *redisconn.Conn
	LedgerClientOptions redisconn.ClientOptions
	// EventsURL is spec.events.webhook.url; empty: no events. EventsMaxAttempts is
	// spec.events.maxAttempts (0: the default).
	EventsURL         string
	EventsMaxAttempts int
}

// budget is the store handle of the budget on rdb, its ledger on the operator's
// Redis when t has a LedgerConn; close closes the ledger's client.
func (t BudgetSettlementTarget) budget(rdb redis.UniversalClient) (b *store.Budget, close func()) {
	b = store.NewBudget(rdb, string(t.UID), t.Shards)
	if t.LedgerConn == nil {
		return b, func() {}
	}
	lrdb := t.LedgerConn.NewClient(t.LedgerClientOptions)
	return b.WithLedger(lrdb), func() { _ = lrdb.Close() }
}

// BudgetSettlementRunner runs the operator's settlement of RedPacketBudgets: for each
// budget with a webhook, one worker per budget shard (settlement.NewBudgetWorkers),
// signing with the operator's key for the webhook's host from the settlement keys
// Secret (the host allowlist), every entry checked against its packet and decided in
// the budget's ledger before delivery. It is the hook the budget reconciler calls:
// EnsureTarget at every reconcile of a budget with a webhook (also while a deleted
// budget drains), DrainedTarget while a deleted budget waits to be purged, Forget
// once it is gone.
//
// It is a manager Runnable that needs leader election (the workers run only on the
// elected operator); workers asked for before Start runs start with it. Its
// registry of workers is a SettlementRunner of its own, so budgets and activities
// never share a worker slot even if a UID were reused.
type BudgetSettlementRunner struct {
	// Reader reads the settlement keys Secret from the API server.
	Reader client.Reader
	// Recorder raises the Warning events of forged entries; nil raises none.
	Recorder events.EventRecorder
	// KeysSecret is the settlement keys Secret (Options.settlementKeysSecret).
	KeysSecret types.NamespacedName
	// Consumer is the workers' consumer name (defaultSettlementConsumer when empty).
	Consumer string
	// Registerer receives the workers' metrics; nil: controller-runtime's registry.
	Registerer prometheus.Registerer
	// LedgerRetention is how long a budget's ledger keeps a packet after its last
	// credit; 0 means store.DefaultPacketLedgerRetention.
	LedgerRetention time.Duration
	// MinConcurrency and MaxConcurrency bound each worker's adaptive limit on first
	// deliveries in flight (Options.SettlementMinConcurrency and
	// SettlementMaxConcurrency); 0 means the settlement package's defaults.
	MinConcurrency, MaxConcurrency int
	// ReconcileInterval is how often each budget is reconciled with the balance
	// system (Options.ReconcileInterval); 0 means DefaultReconcileInterval.
	ReconcileInterval time.Duration

	registry *SettlementRunner
	mu       sync.Mutex
	// announced is, per budget, the total the balance system acknowledged, so that
	// Ensure announces only when the total grew.
	announced map[types.UID]int64
	// announcing is, per budget, its announcement under way in the background or
	// the last one that failed; gone once the balance system acknowledged the total.
	announcing map[types.UID]*announcement
	// eventsRefused is, per budget, the events webhook last refused for want of a
	// key, so that its Warning is raised once per URL.
	eventsRefused map[types.UID]string
	// eventsGroups records the budgets whose events groups exist (ensureEventsGroups).
	eventsGroups map[types.UID]bool
}

// announcement is one budget's announcement of a total that grew, run in the
// background so that a balance system that does not answer holds no reconcile.
type announcement struct {
	// total is the total being announced, or that the last attempt announced.
	total int64
	// cancel ends the attempt under way; nil when none runs.
	cancel context.CancelFunc
	// lastErr is why the last attempt failed; failures counts the failures in a row.
	lastErr  error
	failures int
	// retryAt is when the next attempt may start after a failure.
	retryAt time.Time
}

// Announcements are retried after a failure with a backoff from
// announceRetryBase, doubling, up to announceRetryMax; an attempt lasts at most
// announceAttemptTimeout (the POSTs' own timeout is settlement.DefaultHTTPTimeout).
const (
	announceRetryBase      = time.Second
	announceRetryMax       = 30 * time.Second
	announceAttemptTimeout = 30 * time.Second
	// announcePollInterval is how soon the reconcile comes back while an attempt
	// runs.
	announcePollInterval = time.Second
)

// AnnouncementPendingError is EnsureTarget's answer while the balance system has not
// acknowledged the budget's total: the announcement runs in the background, and
// the shards must not be allotted beyond Announced until it returns nil. It is not a
// failure of the reconcile: the caller shows it and comes back after RetryIn.
type AnnouncementPendingError struct {
	// Total is the total being announced; Announced is the one acknowledged so far
	// (0: none).
	Total, Announced int64
	// LastErr is why the last attempt failed, if one did.
	LastErr error
	// RetryIn is when to ask again.
	RetryIn time.Duration
}

func (e *AnnouncementPendingError) Error() string {
	msg := fmt.Sprintf("the budget's total of %d is being announced to the balance system (acknowledged so far: %d)", e.Total, e.Announced)
	if e.LastErr != nil {
		msg += fmt.Sprintf("; the last attempt failed, retried in %s: %v", e.RetryIn.Round(time.Millisecond), e.LastErr)
	}
	return msg
}

var _ manager.LeaderElectionRunnable = (*BudgetSettlementRunner)(nil)

// NewBudgetSettlementRunner returns a runner with no workers that reads the keys
// Secret through reader, with the operator's options (the keys Secret, the consumer
// name, the metrics registry and the concurrency bounds, as the activities'
// settlement uses them).
func NewBudgetSettlementRunner(reader client.Reader, recorder events.EventRecorder, o Options) *BudgetSettlementRunner {
	consumer := o.SettlementConsumer
	if consumer == "" {
		consumer = defaultSettlementConsumer()
	}
	return &BudgetSettlementRunner{Reader: reader, Recorder: recorder, KeysSecret: o.settlementKeysSecret(),
		Consumer: consumer, Registerer: o.SettlementRegisterer,
		MinConcurrency: o.SettlementMinConcurrency, MaxConcurrency: o.SettlementMaxConcurrency,
		ReconcileInterval: o.ReconcileInterval,
		registry:          NewSettlementRunner(), announced: map[types.UID]int64{}, announcing: map[types.UID]*announcement{},
		eventsRefused: map[types.UID]string{}, eventsGroups: map[types.UID]bool{}}
}

// Start runs the workers until ctx ends (see SettlementRunner.Start).
func (d *BudgetSettlementRunner) Start(ctx context.Context) error { return d.registry.Start(ctx) }

// NeedLeaderElection is true: only the elected operator delivers.
func (d *BudgetSettlementRunner) NeedLeaderElection() bool { return true }

// Running reports whether the budget's workers run.
func (d *BudgetSettlementRunner) Running(uid types.UID) bool { return d.registry.Running(uid) }

// Reconciliation is the budget's last reconciliation with the balance system's book
// (settlement_reconciliation.go); ok is false before its first round finished.
func (d *BudgetSettlementRunner) Reconciliation(uid types.UID) (last settlement.Reconciliation, err error, ok bool) {
	return d.registry.reconcilers.Reconciliation(uid)
}

// ReconcileSoon asks for a reconciliation of the budget now.
func (d *BudgetSettlementRunner) ReconcileSoon(uid types.UID) {
	d.registry.reconcilers.ReconcileSoon(uid)
}

func (d *BudgetSettlementRunner) reconciliationView(uid types.UID) *reconciliationView {
	return d.registry.reconcilers.viewOf(uid)
}

func (d *BudgetSettlementRunner) reconciledForDeletion(uid types.UID, now time.Time) (ok, differ bool, why string) {
	return d.registry.reconcilers.reconciledForDeletion(uid, now)
}

// Forget stops the budget's workers, waiting for them, and forgets what was
// announced for it.
func (d *BudgetSettlementRunner) Forget(uid types.UID) {
	d.registry.Stop(uid)
	d.mu.Lock()
	delete(d.announced, uid)
	if a := d.announcing[uid]; a != nil && a.cancel != nil {
		a.cancel()
	}
	delete(d.announcing, uid)
	delete(d.eventsRefused, uid)
	delete(d.eventsGroups, uid)
	d.mu.Unlock()
}

// EnsureTarget keeps the budget's workers running and its total announced:
//
//  1. without a webhook, its workers stop (entries wait in the streams);
//  2. the signing keys are read for the webhook's host; a host with no key stops the
//     workers and returns errWebhookHostNotAllowed (wrapped);
//  3. the workers are (re)started when where or how they deliver changed (the
//     webhook, the keys, the currency, maxAttempts, the connection, the limits); a
//     new total needs no restart, since the ledger reads the announced total;
//  4. when Total exceeds the total announced so far, it is announced in the
//     background (settlement.AnnounceBudgetTotal), never in the caller's time, and
//     EnsureTarget returns an *AnnouncementPendingError until the balance system
//     acknowledged it: a webhook that does not answer holds no reconcile, of this
//     budget or any other. Call it before Budget.Configure raises the shards'
//     allotment, and raise it only once it returns nil, so nothing is drawn that
//     the ledger would refuse.
func (d *BudgetSettlementRunner) EnsureTarget(ctx context.Context, t BudgetSettlementTarget) error {
	if t.WebhookURL == "" {
		d.registry.Stop(t.UID)
		return nil
	}
	keys, err := readSettlementKeys(ctx, d.Reader, d.KeysSecret, t.WebhookURL)
	if err != nil {
		d.registry.Stop(t.UID)
		return err
	}
	cfg := d.config(t, keys)
	events := d.eventsConfig(ctx, t, cfg)
	connKey := t.Conn.Key()
	if t.LedgerConn != nil {
		connKey += "|ledger|" + t.LedgerConn.Key()
	}
	connSum := sha256.Sum256([]byte(connKey))
	fingerprint := cfg.Fingerprint() + "|budget|" + strconv.Itoa(t.Shards) + "|" + strconv.FormatInt(t.MaxPacketCount, 10) +
		"|" + t.MaxTTL.String() + "|" + hex.EncodeToString(connSum[:])
	if events != nil {
		fingerprint += "|events|" + events.Fingerprint()
		if err := d.ensureEventsGroups(ctx, t); err != nil {
			return err
		}
	}
	conn, opts := t.Conn, t.ClientOptions
	d.registry.Ensure(t.UID, t.Name, fingerprint, func(ctx context.Context) {
		rdb := conn.NewClient(opts)
		defer func() { _ = rdb.Close() }()
		cfg.Redis = rdb
		b, closeLedger := t.budget(rdb)
		defer closeLedger()
		ws, err := settlement.NewBudgetWorkers(cfg, b)
		if err != nil {
			// The workers end; the next reconcile starts them again.
			cfg.Logger.Error("creating the budget's settlement workers failed", "budget", cfg.Source.Ref(), "err", err)
			return
		}
		cfg.Logger.Info("settling the budget's packets from the operator", "budget", cfg.Source.Ref(), "webhook", cfg.WebhookURL,
			"consumer", cfg.Consumer, "shards", len(ws))
		if rc, err := settlement.NewBudgetReconciler(cfg, b); err != nil {
			cfg.Logger.Error("creating the budget's reconciliation failed", "budget", cfg.Source.Ref(), "err", err)
		} else {
			every := d.ReconcileInterval
			if every <= 0 {
				every = DefaultReconcileInterval
			}
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				d.registry.reconcilers.run(ctx, t.UID, "rpb/"+cfg.Source.Ref(), rc, every, cfg.Logger)
			}()
			defer wg.Wait()
		}
		if events != nil {
			var wg sync.WaitGroup
			wg.Go(func() { d.runEvents(ctx, t, *events) })
			defer wg.Wait()
		}
		if err := settlement.RunAll(ctx, ws); err != nil && ctx.Err() == nil {
			cfg.Logger.Error("the budget's settlement workers stopped", "budget", cfg.Source.Ref(), "err", err)
		}
	})
	if pending := d.announce(t, cfg); pending != nil {
		return pending
	}
	return nil
}

// eventsConfig is the configuration of t's events workers: the settlement's, with the
// events webhook, the operator's keys for its host, the events' maxAttempts and an
// HTTP client of their own; nil when t has no events webhook, or when no key allows
// its host (a Warning EventsWebhookHostNotAllowed, once per URL): settlement runs on
// without events.
func (d *BudgetSettlementRunner) eventsConfig(ctx context.Context, t BudgetSettlementTarget, cfg settlement.Config) *settlement.Config {
	if t.EventsURL == "" {
		return nil
	}
	keys, err := readSettlementKeys(ctx, d.Reader, d.KeysSecret, t.EventsURL)
	if err != nil {
		d.mu.Lock()
		first := d.eventsRefused[t.UID] != t.EventsURL
		d.eventsRefused[t.UID] = t.EventsURL
		d.mu.Unlock()
		if first {
			cfg.Logger.Error("the budget's events webhook is not allowed; no events are sent", "budget", cfg.Source.Ref(), "err", err)
			if d.Recorder != nil && t.Object != nil {
				d.Recorder.Eventf(t.Object, nil, corev1.EventTypeWarning, "EventsWebhookHostNotAllowed", "Settle",
					"no packet events are sent to %s: %v", t.EventsURL, err)
			}
		}
		return nil
	}
	d.mu.Lock()
	delete(d.eventsRefused, t.UID)
	d.mu.Unlock()
	ecfg := cfg
	ecfg.WebhookURL = t.EventsURL
	ecfg.MaxAttempts = t.EventsMaxAttempts
	ecfg.HTTPClient = nil
	ecfg.OnForged = nil
	keys.apply(&ecfg)
	return &ecfg
}

// ensureEventsGroups creates t's events consumer groups once (per process) before
// EnsureTarget returns, so before a new budget's shards are configured and its first
// packet is made: a group made after the stream has entries starts at its end.
func (d *BudgetSettlementRunner) ensureEventsGroups(ctx context.Context, t BudgetSettlementTarget) error {
	d.mu.Lock()
	done := d.eventsGroups[t.UID]
	d.mu.Unlock()
	if done {
		return nil
	}
	rdb := t.Conn.NewClient(t.ClientOptions)
	defer func() { _ = rdb.Close() }()
	if err := settlement.EnsureEventsGroups(ctx, store.NewBudget(rdb, string(t.UID), t.Shards)); err != nil {
		return fmt.Errorf("creating the budget's events groups: %w", err)
	}
	d.mu.Lock()
	d.eventsGroups[t.UID] = true
	d.mu.Unlock()
	return nil
}

// runEvents runs t's events workers (settlement.NewBudgetEventsWorkers) on a Redis
// client of their own until ctx ends.
func (d *BudgetSettlementRunner) runEvents(ctx context.Context, t BudgetSettlementTarget, cfg settlement.Config) {
	// Each shard's worker holds a connection while it blocks reading its stream: room
	// for all of them and their other calls, whatever the number of shards.
	opts := t.ClientOptions
	opts.PoolSize = 2*t.Shards + 8
	rdb := t.Conn.NewClient(opts)
	defer func() { _ = rdb.Close() }()
	cfg.Redis = rdb
	b, closeLedger := t.budget(rdb)
	defer closeLedger()
	ws, err := settlement.NewBudgetEventsWorkers(cfg, b)
	if err != nil {
		cfg.Logger.Error("creating the budget's events workers failed", "budget", cfg.Source.Ref(), "err", err)
		return
	}
	cfg.Logger.Info("sending the budget's packet events", "budget", cfg.Source.Ref(), "webhook", cfg.WebhookURL, "shards", len(ws))
	settlement.RunEvents(ctx, ws)
}

// config is the workers' configuration for t, signing with keys.
func (d *BudgetSettlementRunner) config(t BudgetSettlementTarget, keys settlementKeys) settlement.Config {
	cfg := settlement.BudgetConfigFor(t.Name.Namespace, t.Name.Name, string(t.UID), t.Currency, t.WebhookURL, t.MaxAttempts, keys.hmac,
		settlement.Packets{MaxCount: t.MaxPacketCount, MaxTTL: t.MaxTTL, LedgerRetention: d.LedgerRetention})
	keys.apply(&cfg)
	cfg.Consumer = d.Consumer
	cfg.Registerer = d.Registerer
	cfg.MinConcurrency, cfg.MaxConcurrency = d.MinConcurrency, d.MaxConcurrency
	cfg.Logger = slog.New(logr.ToSlogHandler(ctrl.Log.WithName("settlement")))
	if d.Recorder != nil && t.Object != nil {
		recorder, ref := d.Recorder, t.Object.DeepCopyObject()
		cfg.OnForged = func(f settlement.ForgedEntry) {
			recorder.Eventf(ref, nil, corev1.EventTypeWarning, "ForgedSettlementEntry", "Settle",
				"settlement entry %s (budget shard %d) dead-lettered, not delivered: %s of %s to user %q for %d: %s (%s)",
				f.EntryID, f.Shard, f.Kind, f.PacketID, f.UserID, f.Amount, f.Reason, f.Detail)
		}
	}
	return cfg
}

// announce returns nil when the balance system acknowledged t.Total (or more), as
// far as this process knows (the ledger knows across restarts, and an attempt
// finds out at once). Otherwise it starts an attempt in the background, unless one
// runs or the last one failed less than its backoff ago, and says what is pending.
func (d *BudgetSettlementRunner) announce(t BudgetSettlementTarget, cfg settlement.Config) *AnnouncementPendingError {
	d.mu.Lock()
	defer d.mu.Unlock()
	announced := d.announced[t.UID]
	if announced >= t.Total {
		return nil
	}
	a := d.announcing[t.UID]
	if a == nil {
		a = &announcement{}
		d.announcing[t.UID] = a
	}
	now := time.Now()
	if a.cancel == nil && !now.Before(a.retryAt) {
		actx, cancel := context.WithTimeout(context.Background(), announceAttemptTimeout)
		a.total, a.cancel = t.Total, cancel
		go d.attemptAnnouncement(actx, cancel, t, cfg, a)
	}
	pending := &AnnouncementPendingError{Total: t.Total, Announced: announced, LastErr: a.lastErr, RetryIn: announcePollInterval}
	if a.cancel == nil {
		pending.RetryIn = max(a.retryAt.Sub(now), 10*time.Millisecond)
	}
	return pending
}

// attemptAnnouncement announces t.Total once and records the outcome in a: the
// acknowledged total, or the error and when to try again.
func (d *BudgetSettlementRunner) attemptAnnouncement(ctx context.Context, cancel context.CancelFunc, t BudgetSettlementTarget,
	cfg settlement.Config, a *announcement) {
	defer cancel()
	rdb := t.Conn.NewClient(t.ClientOptions)
	defer func() { _ = rdb.Close() }()
	cfg.Redis = rdb
	b, closeLedger := t.budget(rdb)
	defer closeLedger()
	got, err := settlement.AnnounceBudgetTotal(ctx, cfg, b, t.Total)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.announcing[t.UID] != a {
		return // forgotten meanwhile
	}
	a.cancel = nil
	d.announced[t.UID] = max(d.announced[t.UID], got)
	if err == nil {
		a.lastErr, a.failures = nil, 0
		if d.announced[t.UID] >= a.total {
			delete(d.announcing, t.UID)
		}
		return
	}
	a.lastErr = fmt.Errorf("announcing budget %s's total of %d to the balance system: %w", t.Name, t.Total, err)
	a.failures++
	a.retryAt = time.Now().Add(min(announceRetryBase<<min(a.failures-1, 10), announceRetryMax))
	cfg.Logger.Error("announcing the budget's total failed", "budget", cfg.Source.Ref(), "total", t.Total,
		"failures", a.failures, "retryAt", a.retryAt, "err", err)
}

// DrainedTarget reports whether the budget owes nothing: every entry of every
// shard's stream settled or dead-lettered by the operator's consumer group, and no
// dead letter left (BudgetDrain). When something is owed it counts the entries still
// unsettled (settlement.BudgetUnsettled) and the dead letters.
func (d *BudgetSettlementRunner) DrainedTarget(ctx context.Context, t BudgetSettlementTarget) (BudgetDrain, error) {
	rdb := t.Conn.NewClient(t.ClientOptions)
	defer func() { _ = rdb.Close() }()
	b := store.NewBudget(rdb, string(t.UID), t.Shards)
	var out BudgetDrain
	dead, err := b.DeadLetterCount(ctx)
	if err != nil {
		return out, fmt.Errorf("counting budget %s's dead letters: %w", t.Name, err)
	}
	out.DeadLetters = dead
	ok, err := settlement.BudgetDrained(ctx, b, settlement.DefaultGroup)
	if err != nil {
		return out, fmt.Errorf("checking budget %s's settlement: %w", t.Name, err)
	}
	if !ok {
		if out.Unsettled, err = settlement.BudgetUnsettled(ctx, b, settlement.DefaultGroup); err != nil {
			return out, fmt.Errorf("counting budget %s's unsettled entries: %w", t.Name, err)
		}
	}
	out.Drained = ok && dead == 0
	return out, nil
}
