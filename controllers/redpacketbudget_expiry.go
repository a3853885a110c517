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

// DefaultBudgetExpiryPassLimit bounds one budget's pass: a budget whose due index
// is fed as fast as it is expired (a tenant writing its own index) ends its pass
// after this long and starts another at a later tick.
const DefaultBudgetExpiryPassLimit = time.Second

// budgetOverdue is what the driver reads a budget's overdue age through
// (store.Budget implements it); a handle without it has no age exported.
type budgetOverdue interface {
	// OverdueAge is how long the oldest due entry of the budget has been due.
	OverdueAge(ctx context.Context) (time.Duration, error)
}

// budgetMoves is what the driver finishes a budget's interrupted moves of money
// between shards through (store.Budget implements it): a borrower that crashed
// between the steps left money in transit, which each pass lands.
type budgetMoves interface {
	// FinishMoves finishes every move under way and reports how many.
	FinishMoves(ctx context.Context) (int, error)
}

// trackedBudget is one budget the driver expires.
type trackedBudget struct {
	h budgetExpirer
	// key names the budget in the metrics; an empty name exports none.
	key types.NamespacedName
	// busy is set while Start's pass of the budget is under way: a budget has at
	// most one pass of Start's at a time.
	busy bool
}

// BudgetExpiry drives the expiry of every budget's packets. Each budget is expired
// on its own: every Interval, each budget whose previous pass is over starts a pass,
// which drains its shards at the same time, each batch after batch until a batch
// comes back short or the pass has run for PassLimit. No budget waits for another:
// a budget whose due index never runs short (a tenant feeding its own index through
// its own Redis user) holds only its own pass, and every other budget's due packet
// is expired within Interval and its own pass of falling due. The budgets on one
// Redis share its client's connection pool, whose waiters are served in turn, so a
// busy budget's calls and another's interleave.
//
// Expiry is driven by Redis data, each shard's due index by the Redis clock, not by
// a timer per packet: the driver holds nothing but the handles, so a restart of the
// operator (or a new leader) loses nothing, and the first reconcile of each budget
// tracks it again. At the start of each pass it reads the budget's overdue age (how
// long its oldest due packet has waited) into the metric
// redpacket_budget_expiry_overdue_seconds. It is a leader-election runnable: one
// driver expires.
type BudgetExpiry struct {
	// Interval is the time between two passes; 0 means DefaultBudgetExpiryInterval.
	Interval time.Duration
	// Timeout bounds one ExpireDue call; 0 means five seconds.
	Timeout time.Duration
	// PassLimit bounds one budget's pass; 0 means DefaultBudgetExpiryPassLimit.
	PassLimit time.Duration
	// Metrics receives each named budget's overdue age; nil means the controller's
	// budget gauges.
	Metrics *BudgetMetrics

	mu       sync.Mutex
	budgets  map[types.UID]*trackedBudget
	expired  int64
	refunded int64
}

// NewBudgetExpiry returns a driver that tracks no budget yet.
func NewBudgetExpiry() *BudgetExpiry {
	return &BudgetExpiry{budgets: map[types.UID]*trackedBudget{}}
}

// Track makes the driver expire the budget uid's packets through h (replacing what it
// tracked for uid before), with no metric exported.
func (e *BudgetExpiry) Track(uid types.UID, h budgetExpirer) {
	e.TrackNamed(uid, types.NamespacedName{}, h)
}

// TrackNamed is Track for the budget key, whose overdue age is exported under its
// namespace and name.
func (e *BudgetExpiry) TrackNamed(uid types.UID, key types.NamespacedName, h budgetExpirer) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.budgets == nil {
		e.budgets = map[types.UID]*trackedBudget{}
	}
	if t, ok := e.budgets[uid]; ok {
		// In place: a pass under way keeps the budget busy.
		t.h, t.key = h, key
		return
	}
	e.budgets[uid] = &trackedBudget{h: h, key: key}
}

// Forget stops expiring the budget uid's packets; once it returns, no pass exports
// the budget's overdue age again.
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

// ExpireOnce makes one pass over every tracked budget, the budgets at the same time
// and each as Start's pass does (passBudget), and waits for them all. It reports how
// many packets it expired and the money refunded.
func (e *BudgetExpiry) ExpireOnce(ctx context.Context) (int, int64) {
	e.mu.Lock()
	budgets := make(map[types.UID]*trackedBudget, len(e.budgets))
	for uid, t := range e.budgets {
		budgets[uid] = t
	}
	e.mu.Unlock()
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		expired  int
		refunded int64
	)
	for uid, t := range budgets {
		wg.Go(func() {
			n, money := e.passBudget(ctx, uid, t)
			mu.Lock()
			expired += n
			refunded += money
			mu.Unlock()
		})
	}
	wg.Wait()
	return expired, refunded
}

// passBudget is one pass of the budget uid: it exports the budget's overdue age,
// then drains its shards at the same time, each batch after batch until a batch
// comes back short, fails (a failing shard is tried again at the next pass; the
// other shards and budgets go on) or the pass has run for PassLimit. It adds what it
// expired to the totals and reports it.
func (e *BudgetExpiry) passBudget(ctx context.Context, uid types.UID, t *trackedBudget) (int, int64) {
	e.mu.Lock()
	h, key := t.h, t.key
	e.mu.Unlock()
	timeout := e.Timeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	limit := e.PassLimit
	if limit <= 0 {
		limit = DefaultBudgetExpiryPassLimit
	}
	log := ctrl.LoggerFrom(ctx)
	deadline := time.Now().Add(limit)
	e.observeOverdue(ctx, uid, t, h, key, timeout)
	if m, ok := h.(budgetMoves); ok {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		if n, err := m.FinishMoves(cctx); err != nil {
			log.V(1).Info("finishing a budget's moves between shards failed", "budget", uid, "error", err.Error())
		} else if n > 0 {
			log.Info("finished moves of money between budget shards that were cut short", "budget", uid, "moves", n)
		}
		cancel()
	}
	var (
		mu       sync.Mutex
		expired  int
		refunded int64
		wg       sync.WaitGroup
	)
	for i := range h.N() {
		wg.Go(func() {
			for ctx.Err() == nil && time.Now().Before(deadline) {
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
	e.mu.Lock()
	e.expired += int64(expired)
	e.refunded += refunded
	e.mu.Unlock()
	return expired, refunded
}

// observeOverdue sets the named budget's overdue age gauge, unless the budget was
// forgotten (or tracked anew) meanwhile: a deleted budget's series stays deleted.
func (e *BudgetExpiry) observeOverdue(ctx context.Context, uid types.UID, t *trackedBudget, h budgetExpirer,
	key types.NamespacedName, timeout time.Duration) {
	o, ok := h.(budgetOverdue)
	if !ok || key.Name == "" {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	age, err := o.OverdueAge(cctx)
	cancel()
	if err != nil {
		ctrl.LoggerFrom(ctx).V(1).Info("reading a budget's overdue age failed", "budget", uid, "error", err.Error())
		return
	}
	m := e.Metrics
	if m == nil {
		m = budgetMetrics
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.budgets[uid] == t {
		m.ObserveOverdueAge(key, age)
	}
}

// Start starts, every Interval, a pass of each tracked budget whose previous pass is
// over, each budget's pass on its own, until ctx ends; it returns once every pass
// under way has ended.
func (e *BudgetExpiry) Start(ctx context.Context) error {
	interval := e.Interval
	if interval <= 0 {
		interval = DefaultBudgetExpiryInterval
	}
	var passes sync.WaitGroup
	defer passes.Wait()
	return everyInterval(ctx, interval, func(ctx context.Context) {
		e.mu.Lock()
		defer e.mu.Unlock()
		for uid, t := range e.budgets {
			if t.busy {
				continue
			}
			t.busy = true
			passes.Go(func() {
				defer func() {
					e.mu.Lock()
					t.busy = false
					e.mu.Unlock()
				}()
				e.passBudget(ctx, uid, t)
			})
		}
	})
}

// NeedLeaderElection is true: only the leader expires packets.
func (e *BudgetExpiry) NeedLeaderElection() bool { return true }
