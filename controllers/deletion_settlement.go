package controllers

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"sync"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"redpacket.io/operator/settlement"
)

// DeletionSettlers runs the operator's own settlement workers: one per deleted
// activity (by UID) while its deletion waits for settlement to drain.
//
// A deleted activity's claims are normally credited by the settlement workers in its
// grab pods, but those pods do not outlive every deletion: with foreground
// propagation (kubectl delete --cascade=foreground, Argo CD's prune) the garbage
// collector removes the grab Deployment first, while the finalizer still holds the
// activity until settlement drains. So the reconciler starts a worker here when a
// deletion starts waiting, and stops it (waiting until it has stopped) before the
// finalizer goes: before the keys are purged, at the end of the grace period, or when
// the activity is gone. The workers join the activity's consumer group next to any
// grab pod that is still running: each entry is delivered by one consumer at a time,
// and the balance system deduplicates by Idempotency-Key anyway.
//
// DeletionSettlers is a manager Runnable that needs leader election, so workers run
// only on the elected operator, never twice for one activity from one process, and
// all of them stop when the manager stops or loses the lead. Workers asked for
// before Start runs are started by Start.
type DeletionSettlers struct {
	mu      sync.Mutex
	ctx     context.Context // Start's context; nil until Start runs
	stopped bool            // Start's context ended: no new workers
	workers map[types.UID]*deletionSettler
}

// deletionSettler is one activity's worker.
type deletionSettler struct {
	name        types.NamespacedName
	fingerprint string
	run         func(context.Context)
	cancel      context.CancelFunc // nil until started
	done        chan struct{}      // closed when run returned
}

var _ manager.LeaderElectionRunnable = (*DeletionSettlers)(nil)

// NewDeletionSettlers returns a registry with no workers.
func NewDeletionSettlers() *DeletionSettlers {
	return &DeletionSettlers{workers: map[types.UID]*deletionSettler{}}
}

// Ensure keeps a worker running for the activity uid (named name) with the given
// configuration fingerprint: a worker with the same fingerprint that still runs is
// left alone; one with another fingerprint (the webhook or the key changed) is
// stopped, and waited for, before run starts in its place, and so is a worker whose
// run returned by itself. run must return when its context ends. Nothing starts once
// the registry has stopped.
func (d *DeletionSettlers) Ensure(uid types.UID, name types.NamespacedName, fingerprint string, run func(context.Context)) {
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
	w := &deletionSettler{name: name, fingerprint: fingerprint, run: run, done: make(chan struct{})}
	d.workers[uid] = w
	if d.ctx != nil {
		w.start(d.ctx)
	}
}

// Stop stops the activity's worker, if any, and returns once it has stopped.
func (d *DeletionSettlers) Stop(uid types.UID) {
	d.mu.Lock()
	w := d.workers[uid]
	delete(d.workers, uid)
	d.mu.Unlock()
	w.stop()
}

// StopNamed stops, and waits for, the workers of activities named name, except the
// one with UID keep (none when keep is empty): the activity is gone, or was replaced
// by a new one of the same name.
func (d *DeletionSettlers) StopNamed(name types.NamespacedName, keep types.UID) {
	d.mu.Lock()
	var stop []*deletionSettler
	for uid, w := range d.workers {
		if w.name == name && uid != keep {
			stop = append(stop, w)
			delete(d.workers, uid)
		}
	}
	d.mu.Unlock()
	for _, w := range stop {
		w.stop()
	}
}

// Running reports whether a worker is registered for the activity uid and has not
// ended.
func (d *DeletionSettlers) Running(uid types.UID) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	w := d.workers[uid]
	return w != nil && !w.ended()
}

// Len is the number of registered workers.
func (d *DeletionSettlers) Len() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.workers)
}

// Start starts the workers asked for so far and every later one under ctx; when ctx
// ends it stops them all and returns once they have stopped. It makes the registry a
// manager.Runnable.
func (d *DeletionSettlers) Start(ctx context.Context) error {
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
	d.workers = map[types.UID]*deletionSettler{}
	d.mu.Unlock()
	for _, w := range workers {
		w.stop()
	}
	return nil
}

// NeedLeaderElection is true: only the elected operator delivers.
func (d *DeletionSettlers) NeedLeaderElection() bool { return true }

func (w *deletionSettler) start(ctx context.Context) {
	wctx, cancel := context.WithCancel(ctx)
	w.cancel = cancel
	go func() {
		defer close(w.done)
		w.run(wctx)
	}()
}

// stop cancels the worker and waits for it; a worker never started is dropped.
func (w *deletionSettler) stop() {
	if w == nil || w.cancel == nil {
		return
	}
	w.cancel()
	<-w.done
}

// ended reports whether a started worker's run returned.
func (w *deletionSettler) ended() bool {
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

// ensureDeletionSettlement keeps the operator's settlement worker running for a
// deleted activity that waits for settlement to drain, configured exactly as a grab
// pod's worker (settlement.ActivityConfig): the same consumer group, the activity's
// webhook URL, currency and maxAttempts, and the signing key read from the Secret
// spec.settlement.webhook.secretRef (key "key") on the API server. It has its own
// Redis client, closed when it stops. Without a webhook no worker runs (claims wait
// in the stream until the grace period ends). It returns why no worker could start,
// such as a missing Secret; the next poll tries again.
func (r *RedPacketActivityReconciler) ensureDeletionSettlement(ctx context.Context, s *activityScope) error {
	a := s.activity
	if !settlement.HasWebhook(a) {
		r.Settlers.Stop(a.UID)
		return nil
	}
	var signing []byte
	if ref := a.Spec.Settlement.Webhook.SecretRef; ref != nil {
		secret := &corev1.Secret{}
		key := client.ObjectKey{Namespace: a.Namespace, Name: ref.Name}
		if err := r.APIReader.Get(ctx, key, secret); err != nil {
			if apierrors.IsNotFound(err) {
				return fmt.Errorf("secret %s named by spec.settlement.webhook.secretRef does not exist", ref.Name)
			}
			return fmt.Errorf("reading secret %s: %w", ref.Name, err)
		}
		k, err := settlement.SigningKeyFromSecret(secret.Data)
		if err != nil {
			return fmt.Errorf("secret %s: %w", ref.Name, err)
		}
		signing = k
	}
	cfg := settlement.ActivityConfig(a, signing)
	cfg.Consumer = r.Options.SettlementConsumer
	cfg.Logger = slog.New(logr.ToSlogHandler(ctrl.Log.WithName("deletion-settlement")))
	// The worker's fingerprint covers where it delivers and how it signs; the Redis
	// connection (which may carry a password) is part of it as a hash.
	connSum := sha256.Sum256([]byte(s.conn.Key()))
	fingerprint := cfg.Fingerprint() + "|" + hex.EncodeToString(connSum[:])
	conn := s.conn
	r.Settlers.Ensure(a.UID, client.ObjectKeyFromObject(a), fingerprint, func(ctx context.Context) {
		rdb := conn.NewClient(r.redisClientOptions(conn, false))
		defer func() { _ = rdb.Close() }()
		cfg.Redis = rdb
		ws, err := settlement.NewShardWorkers(cfg, a.Spec.ShardCount())
		if err != nil {
			// The worker ends; the next poll of the deletion starts it again.
			cfg.Logger.Error("creating the settlement worker of the deleted activity failed", "activity", cfg.Activity, "err", err)
			return
		}
		cfg.Logger.Info("settling the deleted activity's claims from the operator", "webhook", cfg.WebhookURL, "consumer", cfg.Consumer,
			"shards", len(ws))
		if err := settlement.RunAll(ctx, ws); err != nil && ctx.Err() == nil {
			cfg.Logger.Error("the settlement worker of the deleted activity stopped", "err", err)
		}
	})
	return nil
}
