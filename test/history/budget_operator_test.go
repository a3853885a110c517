package history

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"

	"redpacket.io/operator/controllers"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// budgetOperator is everything the operator process runs for a budget in a budget
// run, each on a faulted link of the operator's: the real expiry runner
// (controllers.BudgetExpiry) and function keeper (controllers.FunctionKeeper) on
// one, and the budget's settlement (the workers of settlement.NewBudgetWorkers in a
// controllers.SettlementRunner, as BudgetSettlementRunner.EnsureTarget starts them,
// the total announced first as its reconcile does) on the other.
//
// Restart kills all of it as the death of the process would: every context
// cancelled and every Redis client closed at once, without waiting for the
// settlement's deliveries in flight (a delivery may still be at the webhook, and its
// acknowledgement and ledger write held on the link or lost). When the fault says
// so, the settlement link is cut at the kill, so held commands never reach Redis. After a
// while down it starts fresh ones that track the budget again, as a new operator's
// first reconcile does; the new settlement consumer has a name of its own (a new
// pod's), so the entries the dead one held are taken over once idle.
type budgetOperator struct {
	addr, settleAddr string
	settleLink       *Proxy
	uid              string
	shards           int
	total            int64
	// cfg is the settlement's configuration without its Redis client, consumer and
	// HTTP client, which each start makes anew.
	cfg settlement.Config

	mu     sync.Mutex
	gen    int
	client redis.UniversalClient
	// settleClient is the settlement's client, closed at the kill.
	settleClient redis.UniversalClient
	cancel       context.CancelFunc
	running      sync.WaitGroup
	// settling holds every settlement ever started: a killed one is not waited for
	// until Stop.
	settling sync.WaitGroup
	inflight atomic.Int32
	// restarts and cut count restarts and the expiry calls in flight when one came;
	// linkCuts the restarts that cut the settlement link, midDelivery those that
	// came with a delivery in flight.
	restarts, cut, linkCuts, midDelivery int
	expired                              atomic.Int64

	dmu sync.Mutex
	// open and answered are, per generation, the deliveries in flight by
	// Idempotency-Key and when each was last answered 2xx; lastGen is the latest
	// generation that sent each key; cutKeys the keys each killed generation left
	// unfinished (in flight, or answered while its link was held).
	open     map[int]map[string]int
	answered map[int]map[string]time.Time
	lastGen  map[string]int
	cutKeys  map[int][]string
	errs     []error
}

func startBudgetOperator(addr string, settleLink *Proxy, uid string, shards int, total int64, cfg settlement.Config) *budgetOperator {
	o := &budgetOperator{addr: addr, settleAddr: settleLink.Addr(), settleLink: settleLink, uid: uid, shards: shards, total: total,
		cfg:  cfg,
		open: map[int]map[string]int{}, answered: map[int]map[string]time.Time{}, lastGen: map[string]int{}, cutKeys: map[int][]string{}}
	o.start()
	return o
}

func (o *budgetOperator) start() {
	conn := adminConn(o.addr)
	o.client = conn.NewClient(redisconn.ClientOptions{Timeout: controllerTimeout, MaxRetries: 1})
	ctx, cancel := context.WithCancel(context.Background())
	o.cancel = cancel
	expiry := &controllers.BudgetExpiry{Timeout: controllerTimeout}
	expiry.Track(types.UID(o.uid), &countedExpirer{Budget: store.NewBudget(o.client, o.uid, o.shards), op: o})
	client := o.client
	keeper := controllers.NewFunctionKeeper(func(redisconn.Conn) redis.UniversalClient { return client })
	keeper.Track(types.UID(o.uid), conn)
	o.running.Add(2)
	go func() { defer o.running.Done(); _ = expiry.Start(ctx) }()
	go func() { defer o.running.Done(); _ = keeper.Start(ctx) }()

	// The settlement, with the options the operator opens its clients with.
	gen := o.gen
	o.gen++
	sconn := adminConn(o.settleAddr)
	o.settleClient = sconn.NewClient(redisconn.ClientOptions{})
	cfg := o.cfg
	cfg.Redis = o.settleClient
	cfg.Consumer = fmt.Sprintf("operator-%d", gen)
	tr := &http.Transport{}
	cfg.HTTPClient = &http.Client{Timeout: o.cfg.HTTPClient.Timeout, Transport: &settleTransport{next: tr, op: o, gen: gen}}
	budget := store.NewBudget(o.settleClient, o.uid, o.shards)
	registry := controllers.NewSettlementRunner()
	registry.Ensure(types.UID(o.uid), types.NamespacedName{Namespace: "default", Name: "history"}, cfg.Fingerprint(),
		func(ctx context.Context) {
			defer tr.CloseIdleConnections()
			for {
				if _, err := settlement.AnnounceBudgetTotal(ctx, cfg, budget, o.total); err == nil {
					break
				}
				if !sleepCtx(ctx, 50*time.Millisecond) {
					return
				}
			}
			ws, err := settlement.NewBudgetWorkers(cfg, budget)
			if err != nil {
				o.fail(fmt.Errorf("settlement workers of generation %d: %w", gen, err))
				return
			}
			if err := settlement.RunAll(ctx, ws); err != nil && !errors.Is(err, context.Canceled) {
				o.fail(fmt.Errorf("settlement workers of generation %d: %w", gen, err))
			}
		})
	o.settling.Add(1)
	go func() { defer o.settling.Done(); _ = registry.Start(ctx) }()
}

// sleepCtx waits d or until ctx is done; it reports whether ctx is still live.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}

func (o *budgetOperator) fail(err error) {
	o.dmu.Lock()
	o.errs = append(o.errs, err)
	o.dmu.Unlock()
}

// settleTransport is the HTTP transport of one generation's settlement: it notes
// each delivery by Idempotency-Key while it is in flight and when it was answered
// 2xx, so that a restart knows which deliveries it cut.
type settleTransport struct {
	next http.RoundTripper
	op   *budgetOperator
	gen  int
}

func (t *settleTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	key := req.Header.Get("Idempotency-Key")
	o := t.op
	o.dmu.Lock()
	if o.open[t.gen] == nil {
		o.open[t.gen], o.answered[t.gen] = map[string]int{}, map[string]time.Time{}
	}
	o.open[t.gen][key]++
	o.lastGen[key] = max(o.lastGen[key], t.gen)
	o.dmu.Unlock()
	resp, err := t.next.RoundTrip(req)
	o.dmu.Lock()
	if o.open[t.gen][key]--; o.open[t.gen][key] == 0 {
		delete(o.open[t.gen], key)
	}
	if err == nil && resp.StatusCode/100 == 2 {
		o.answered[t.gen][key] = time.Now()
	}
	o.dmu.Unlock()
	return resp, err
}

// countedExpirer is the budget handle the expiry runner calls, counting the calls in
// flight so that a restart knows how many it cut.
type countedExpirer struct {
	*store.Budget
	op *budgetOperator
}

func (c *countedExpirer) ExpireDue(ctx context.Context, i, limit int) (int, int64, error) {
	c.op.inflight.Add(1)
	defer c.op.inflight.Add(-1)
	n, money, err := c.Budget.ExpireDue(ctx, i, limit)
	c.op.expired.Add(int64(n))
	return n, money, err
}

// Restart kills the running operator part, cutting the settlement's link when
// cutLink, and starts a new one after down. heldUntil, when set, is the end of a
// hold of the operator's links that began as long before the call as it ends after
// it.
func (o *budgetOperator) Restart(down time.Duration, cutLink bool, heldUntil time.Time) {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := time.Now()
	if n := int(o.inflight.Load()); n > 0 {
		o.cut += n
	}
	// What is unfinished is noted first: the kill ends the deliveries in flight.
	o.noteCut(o.gen-1, now, heldUntil)
	o.kill()
	if cutLink {
		o.settleLink.Reset()
		o.linkCuts++
	}
	o.running.Wait()
	time.Sleep(down)
	o.start()
	o.restarts++
}

// kill cancels everything running and closes its Redis clients, waiting for none of
// it.
func (o *budgetOperator) kill() {
	o.cancel()
	_ = o.client.Close()
	_ = o.settleClient.Close()
}

// noteCut records the deliveries generation gen left unfinished at its kill at now:
// those in flight, and, when the links were held until heldUntil, those answered
// since the hold began, whose acknowledgement was held.
func (o *budgetOperator) noteCut(gen int, now, heldUntil time.Time) {
	o.dmu.Lock()
	defer o.dmu.Unlock()
	cut := map[string]bool{}
	for key := range o.open[gen] {
		cut[key] = true
	}
	if len(o.open[gen]) > 0 {
		o.midDelivery++
	}
	if !heldUntil.IsZero() {
		holdStart := now.Add(-heldUntil.Sub(now))
		for key, at := range o.answered[gen] {
			if !at.Before(holdStart) {
				cut[key] = true
			}
		}
	}
	for key := range cut {
		o.cutKeys[gen] = append(o.cutKeys[gen], key)
	}
}

// settlementCut returns how many deliveries the restarts cut and how many of those
// a later generation delivered again.
func (o *budgetOperator) settlementCut() (cut, redelivered int) {
	o.dmu.Lock()
	defer o.dmu.Unlock()
	for gen, keys := range o.cutKeys {
		cut += len(keys)
		for _, k := range keys {
			if o.lastGen[k] > gen {
				redelivered++
			}
		}
	}
	return cut, redelivered
}

// Errors returns what the settlement reported as failed.
func (o *budgetOperator) Errors() []error {
	o.dmu.Lock()
	defer o.dmu.Unlock()
	return append([]error(nil), o.errs...)
}

// Stop stops the running operator part and waits for every part ever started.
func (o *budgetOperator) Stop() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.kill()
	o.running.Wait()
	o.settling.Wait()
}
