package controllers

import (
	"context"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"

	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// DefaultFunctionCheckInterval is how often the function keeper checks every Redis
// the activities use.
const DefaultFunctionCheckInterval = 100 * time.Millisecond

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

	mu         sync.Mutex
	byActivity map[types.UID]redisconn.Conn
	restored   int
}

// NewFunctionKeeper returns a keeper that reaches each Redis with client.
func NewFunctionKeeper(client func(conn redisconn.Conn) redis.UniversalClient) *FunctionKeeper {
	return &FunctionKeeper{Client: client, byActivity: map[types.UID]redisconn.Conn{}}
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

// CheckOnce checks every tracked Redis once, at the same time, and loads the library
// wherever it is missing. It returns on how many servers it loaded it.
func (k *FunctionKeeper) CheckOnce(ctx context.Context) int {
	k.mu.Lock()
	conns := map[string]redisconn.Conn{}
	for _, c := range k.byActivity {
		conns[c.Key()] = c
	}
	k.mu.Unlock()
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

// Start checks every Interval until ctx ends.
func (k *FunctionKeeper) Start(ctx context.Context) error {
	interval := k.Interval
	if interval <= 0 {
		interval = DefaultFunctionCheckInterval
	}
	return everyInterval(ctx, interval, func(ctx context.Context) { k.CheckOnce(ctx) })
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
