package controllers

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// DefaultFunctionCheckInterval is how often the function keeper checks every Redis
// the activities use.
const DefaultFunctionCheckInterval = 100 * time.Millisecond

// DefaultLibraryRetireAfter is how long another release's function library must go
// uncalled, as far as the grab Deployments tell, before the keeper deletes it: far
// longer than a grab pod's termination grace period, so a pod of an old ReplicaSet
// that is still shutting down has ended; DefaultLibraryRetireInterval is how often
// the keeper looks.
const (
	DefaultLibraryRetireAfter    = 10 * time.Minute
	DefaultLibraryRetireInterval = 30 * time.Second
)

// FunctionKeeper keeps the grab-side function library (store.Library) loaded on
// every Redis that an activity uses: on every master of it, every Interval (FUNCTION
// LIST LIBRARYNAME, one short reply per master), loading it where it is missing. The
// grab pods cannot load it (their Redis user may only FCALL it) and answer 503
// unavailable while it is missing, after a FUNCTION FLUSH, a restart of a Redis
// without persistence or a failover to a node that never had it; the keeper makes
// that window about one Interval long. Replicas get the library from their master by
// replication. The reconciler's "load scripts" step tracks each activity's Redis
// (Track) and its deletion forgets it (Forget). It is a leader-election runnable:
// one keeper per operator.
type FunctionKeeper struct {
	// Interval is the time between two checks; 0 means DefaultFunctionCheckInterval.
	Interval time.Duration
	// Timeout bounds one check of one Redis; 0 means one second.
	Timeout time.Duration
	// Client returns the client of a tracked connection.
	Client func(conn redisconn.Conn) redis.UniversalClient
	// InUse names the function libraries the grab pods may call (grabLibrariesInUse,
	// from the grab Deployments); an error means it cannot tell (a Deployment rolling
	// out, one that names no library), and then no library is retired. nil: the
	// keeper deletes nothing.
	InUse func(ctx context.Context) (map[string]bool, error)
	// RetireAfter is how long another release's library must go without being in
	// use, with no break, before it is deleted from every master (RetireOnce); 0
	// means DefaultLibraryRetireAfter. RetireInterval is the time between two
	// passes; 0 means DefaultLibraryRetireInterval.
	RetireAfter, RetireInterval time.Duration
	// Now is the keeper's clock; nil means time.Now.
	Now func() time.Time

	mu         sync.Mutex
	byActivity map[types.UID]redisconn.Conn
	restored   int
	// neededAt is, per library of another release, when it was last in use or of
	// unknown use (or first seen, by this keeper).
	neededAt map[string]time.Time
}

// NewFunctionKeeper returns a keeper that reaches each Redis with client.
func NewFunctionKeeper(client func(conn redisconn.Conn) redis.UniversalClient) *FunctionKeeper {
	return &FunctionKeeper{Client: client, byActivity: map[types.UID]redisconn.Conn{}, neededAt: map[string]time.Time{}}
}

// Track makes the keeper check the Redis of conn for the activity uid (replacing
// what it tracked for uid before).
func (k *FunctionKeeper) Track(uid types.UID, conn redisconn.Conn) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.byActivity[uid] = conn
}

// Forget stops checking for the activity uid; a Redis no other activity uses is no
// longer checked.
func (k *FunctionKeeper) Forget(uid types.UID) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.byActivity, uid)
}

// Restored is how many times the keeper loaded the library on a server so far.
func (k *FunctionKeeper) Restored() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.restored
}

// tracked is every tracked Redis once, by connection key.
func (k *FunctionKeeper) tracked() map[string]redisconn.Conn {
	k.mu.Lock()
	defer k.mu.Unlock()
	conns := map[string]redisconn.Conn{}
	for _, c := range k.byActivity {
		conns[c.Key()] = c
	}
	return conns
}

// RetireOnce deletes, from every tracked Redis, the libraries of other releases that
// no grab pod has called for RetireAfter: a library is needed while InUse names it,
// and while InUse cannot tell (a grab Deployment rolling out, or one whose pods run
// an image that names no library); the clock of each starts when the keeper first
// sees it, so a new leader waits RetireAfter again. This release's library is never
// deleted. An upgrade thus leaves the old library callable until the last old grab
// pod is long gone, and a rollback's operator loads its own again (CheckOnce). It
// returns how many libraries it deleted.
func (k *FunctionKeeper) RetireOnce(ctx context.Context) int {
	if k.InUse == nil {
		return 0
	}
	log := ctrl.LoggerFrom(ctx)
	inUse, useErr := k.InUse(ctx)
	if useErr != nil {
		log.V(1).Info("no function library is retired while the grab pods' libraries are unknown", "reason", useErr.Error())
	}
	retireAfter := k.RetireAfter
	if retireAfter <= 0 {
		retireAfter = DefaultLibraryRetireAfter
	}
	now := time.Now()
	if k.Now != nil {
		now = k.Now()
	}
	timeout := k.Timeout
	if timeout <= 0 {
		timeout = time.Second
	}
	deleted := 0
	for _, conn := range k.tracked() {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		lib := store.NewLibrary(k.Client(conn))
		others, err := lib.Others(cctx)
		if err != nil {
			log.V(1).Info("listing the function libraries failed", "redis", conn.Addresses, "error", err.Error())
		}
		for _, name := range others {
			k.mu.Lock()
			if _, seen := k.neededAt[name]; !seen || useErr != nil || inUse[name] {
				k.neededAt[name] = now
			}
			unused := now.Sub(k.neededAt[name])
			k.mu.Unlock()
			if unused < retireAfter {
				continue
			}
			if err := lib.Delete(cctx, name); err != nil {
				log.Error(err, "deleting a function library no grab pod calls", "library", name, "redis", conn.Addresses)
				continue
			}
			log.Info("deleted the function library of another release, which no grab pod has called", "library", name,
				"for", unused.Round(time.Second).String(), "redis", conn.Addresses)
			deleted++
		}
		cancel()
	}
	return deleted
}

// CheckOnce checks every tracked Redis once, at the same time, and loads the library
// wherever it is missing. It returns on how many servers it loaded it.
func (k *FunctionKeeper) CheckOnce(ctx context.Context) int {
	conns := k.tracked()
	timeout := k.Timeout
	if timeout <= 0 {
		timeout = time.Second
	}
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		loaded int
	)
	for _, conn := range conns {
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			lib := store.NewLibrary(k.Client(conn))
			n, err := lib.Ensure(cctx)
			log := ctrl.LoggerFrom(ctx)
			if err != nil {
				log.V(1).Info("checking the function library failed", "library", lib.Name(),
					"redis", conn.Addresses, "error", err.Error())
			}
			if n > 0 {
				log.Info("loaded the missing function library", "library", lib.Name(),
					"redis", conn.Addresses, "servers", n)
				mu.Lock()
				loaded += n
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	k.mu.Lock()
	k.restored += loaded
	k.mu.Unlock()
	return loaded
}

// Start checks every Interval, and retires other releases' libraries every
// RetireInterval, until ctx ends.
func (k *FunctionKeeper) Start(ctx context.Context) error {
	interval := k.Interval
	if interval <= 0 {
		interval = DefaultFunctionCheckInterval
	}
	retireInterval := k.RetireInterval
	if retireInterval <= 0 {
		retireInterval = DefaultLibraryRetireInterval
	}
	var wg sync.WaitGroup
	wg.Go(func() { _ = everyInterval(ctx, retireInterval, func(ctx context.Context) { k.RetireOnce(ctx) }) })
	err := everyInterval(ctx, interval, func(ctx context.Context) { k.CheckOnce(ctx) })
	wg.Wait()
	return err
}

// grabLibrariesInUse names the function libraries the grab pods of every grab
// Deployment (both kinds, every namespace) may call, from the pod templates'
// AnnotationFunctionLibrary. It cannot tell, and says why, while a Deployment names
// no library (a custom image, or a template of a release before the annotation) or
// is rolling out (pods of an older template may still run).
func grabLibrariesInUse(ctx context.Context, c client.Reader) (map[string]bool, error) {
	var list appsv1.DeploymentList
	if err := c.List(ctx, &list, client.MatchingLabels(specs.GrabWorkloadLabels())); err != nil {
		return nil, fmt.Errorf("listing the grab Deployments: %w", err)
	}
	inUse := map[string]bool{}
	for _, d := range list.Items {
		lib := d.Spec.Template.Annotations[specs.AnnotationFunctionLibrary]
		if lib == "" {
			return nil, fmt.Errorf("grab Deployment %s/%s names no function library (a custom image, or an older release's template)", d.Namespace, d.Name)
		}
		if d.Status.ObservedGeneration < d.Generation || d.Status.UpdatedReplicas != d.Status.Replicas {
			return nil, fmt.Errorf("grab Deployment %s/%s is rolling out (%d of %d pods updated)", d.Namespace, d.Name,
				d.Status.UpdatedReplicas, d.Status.Replicas)
		}
		inUse[lib] = true
	}
	return inUse, nil
}

// everyInterval runs fn every interval until ctx ends, then returns nil: the loop of
// the operator's periodic runnables (the function keeper, the budget expiry driver).
func everyInterval(ctx context.Context, interval time.Duration, fn func(context.Context)) error {
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
			fn(ctx)
		}
	}
}

// NeedLeaderElection is true: one keeper, the leader's, loads libraries.
func (k *FunctionKeeper) NeedLeaderElection() bool { return true }
