package controllers

import (
	"context"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"

	"redpacket.io/operator/store"
)

// DefaultBudgetExpiryInterval is how often the expiry driver looks at every budget's
// due packets.
const DefaultBudgetExpiryInterval = 250 * time.Millisecond

// budgetExpiryBatch is the most packets one ExpireDue call expires: a bounded batch,
// so that no call holds Redis for long (the store's measured default keeps a call
// well under 5 ms), even when 100,000 packets fall due in the same second.
const budgetExpiryBatch = store.DefaultExpireBatch

// budgetExpirer is what the expiry driver needs of a budget: its shards and the
// bounded expiry of one shard (store.Budget implements it).
type budgetExpirer interface {
	// N is the number of budget shards.
	N() int
	// ExpireDue expires at most max due packets of shard i; it reports how many
	// it expired and the money refunded.
	ExpireDue(ctx context.Context, i, max int) (int, int64, error)
}

// BudgetExpiry drives the expiry of every budget's packets: every Interval, for every
// budget it tracks, it calls ExpireDue on each shard, batch after batch, until a batch
// comes back short. Expiry is driven by Redis data, each shard's due index by the Redis
// clock, not by a timer per packet: the driver holds nothing but the handles, so a
// restart of the operator (or a new leader) loses nothing, and the first reconcile of
// each budget tracks it again. It is a leader-election runnable: one driver expires.
type BudgetExpiry struct {
	// Interval is the time between two passes; 0 means DefaultBudgetExpiryInterval.
	Interval time.Duration
	// Timeout bounds one ExpireDue call; 0 means five seconds.
	Timeout time.Duration

	mu       sync.Mutex
	budgets  map[types.UID]budgetExpirer
	expired  int64
	refunded int64
}

// NewBudgetExpiry returns a driver that tracks no budget yet.
func NewBudgetExpiry() *BudgetExpiry {
	return &BudgetExpiry{budgets: map[types.UID]budgetExpirer{}}
}

// Track makes the driver expire the budget uid's packets through h (replacing what it
// tracked for uid before).
func (e *BudgetExpiry) Track(uid types.UID, h budgetExpirer) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.budgets == nil {
		e.budgets = map[types.UID]budgetExpirer{}
	}
	e.budgets[uid] = h
}

// Forget stops expiring the budget uid's packets.
func (e *BudgetExpiry) Forget(uid types.UID) {
	e.mu.Lock()
	defer e.mu.Unlock()
	delete(e.budgets, uid)
}

// Tracked is how many budgets the driver expires.
func (e *BudgetExpiry) Tracked() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.budgets)
}

// Totals are how many packets the driver expired so far and the money it refunded.
func (e *BudgetExpiry) Totals() (expired, refunded int64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.expired, e.refunded
}

// ExpireOnce makes one pass over every tracked budget, its budgets one after another
// and, within each, its shards at the same time: each shard is drained batch after
// batch until a batch comes back short or fails (a failing shard is tried again at
// the next pass; the other shards and budgets go on). It reports how many packets it
// expired and the money refunded.
func (e *BudgetExpiry) ExpireOnce(ctx context.Context) (int, int64) {
	e.mu.Lock()
	budgets := make(map[types.UID]budgetExpirer, len(e.budgets))
	for uid, h := range e.budgets {
		budgets[uid] = h
	}
	e.mu.Unlock()
	timeout := e.Timeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	log := ctrl.LoggerFrom(ctx)
	var (
		mu       sync.Mutex
		expired  int
		refunded int64
	)
	for uid, h := range budgets {
		var wg sync.WaitGroup
		for i := range h.N() {
			wg.Go(func() {
				for ctx.Err() == nil {
					cctx, cancel := context.WithTimeout(ctx, timeout)
					n, money, err := h.ExpireDue(cctx, i, budgetExpiryBatch)
					cancel()
					if err != nil {
						log.V(1).Info("expiring a budget shard failed", "budget", uid, "shard", i, "error", err.Error())
						return
					}
					mu.Lock()
					expired += n
					refunded += money
					mu.Unlock()
					if n < budgetExpiryBatch {
						return
					}
				}
			})
		}
		wg.Wait()
	}
	e.mu.Lock()
	e.expired += int64(expired)
	e.refunded += refunded
	e.mu.Unlock()
	return expired, refunded
}

// Start makes a pass every Interval until ctx ends.
func (e *BudgetExpiry) Start(ctx context.Context) error {
	interval := e.Interval
	if interval <= 0 {
		interval = DefaultBudgetExpiryInterval
	}
	return everyInterval(ctx, interval, func(ctx context.Context) { e.ExpireOnce(ctx) })
}

// NeedLeaderElection is true: only the leader expires packets.
func (e *BudgetExpiry) NeedLeaderElection() bool { return true }
