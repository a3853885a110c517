package history

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// controller stands for the operator's reconcile on the Redis side: it keeps each
// activity's desired state (the spec: opened once seeded, paused, the window, and
// an end asked for) and writes it with the same calls the reconcile makes
// (store.Shard.Configure and Close), through the fault proxy, one call of an
// activity at a time. It is not the controllers package: the real reconcile turns
// spec edits into these calls some time after the edit, so an edit has no call and
// return to put in a history; this stand-in issues the calls at known instants and
// records each one.
//
// Restart cuts it: its context is cancelled and its Redis client closed, so calls in
// flight fail (unknown outcomes), and while it is down spec edits only change the
// desired state. The restarted controller opens new clients and, per activity,
// re-reads the snapshot and re-issues what the snapshot lacks, as a reconcile after a
// restart does (reconcileGate, then reconcileSchedule): a configure unless the
// snapshot already holds the desired gate, then a close as expired when an end was
// asked for or the window has ended on the Redis clock, or as exhausted when no
// packet is left. Configure and close are idempotent, so re-issuing is safe.
type controller struct {
	redis   string        // the address the controller dials (the proxy's)
	timeout time.Duration // the deadline of each call
	rec     *recorder

	mu     sync.Mutex
	up     bool
	client redis.UniversalClient
	ctx    context.Context
	cancel context.CancelFunc
	acts   map[string]*ctrlActivity
	resync sync.WaitGroup

	// restarts, cut and reissued count restarts, calls cut by one, and calls a
	// restarted controller re-issued.
	restarts, cut, reissued int
}

// ctrlActivity is the controller's view of one activity; mu serializes its calls,
// as controller-runtime runs one reconcile of an object at a time.
type ctrlActivity struct {
	uid    string
	client int // the history's client id for this activity's controller calls
	mu     sync.Mutex
	want   desired
}

// desired is an activity's spec as the controller writes it into Redis.
type desired struct {
	opened, paused, expired bool
	startMs, endMs          int64
}

func newController(redisAddr string, timeout time.Duration, rec *recorder) *controller {
	c := &controller{redis: redisAddr, timeout: timeout, rec: rec, acts: map[string]*ctrlActivity{}}
	c.connect()
	return c
}

func (c *controller) connect() {
	c.client = adminConn(c.redis).NewClient(
		redisconn.ClientOptions{Timeout: c.timeout, MaxRetries: 1})
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.up = true
}

// track registers an activity whose window (unix ms on the Redis clock, 0 for an
// open side) the controller writes with every configure.
func (c *controller) track(uid string, client int, startMs, endMs int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.acts[uid] = &ctrlActivity{uid: uid, client: client, want: desired{startMs: startMs, endMs: endMs}}
}

// session is what a call uses: the running controller's context and client, or
// ok false while it is down.
func (c *controller) session() (ctx context.Context, cl redis.UniversalClient, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ctx, c.client, c.up
}

// Apply makes one spec edit or reconcile step of the schedule: open, pause and
// resume change the desired gate and configure it, close-expired asks for the end
// and closes, close-exhausted closes when nothing is left. While the controller is
// down only the desired state changes; the restart re-issues it.
func (c *controller) Apply(uid string, op Op) {
	c.mu.Lock()
	a := c.acts[uid]
	c.mu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	switch op {
	case OpOpen:
		a.want.opened = true
	case OpPause, OpResume:
		a.want.opened, a.want.paused = true, op == OpPause
	case OpCloseExpired:
		a.want.expired = true
	}
	ctx, cl, up := c.session()
	if !up {
		return
	}
	switch op {
	case OpOpen, OpPause, OpResume:
		c.configure(ctx, cl, a)
	case OpCloseExpired, OpCloseExhausted:
		reason := store.CloseExpired
		if op == OpCloseExhausted {
			reason = store.CloseExhausted
		}
		c.close(ctx, cl, a, reason)
	}
}

// configure writes a's desired gate and records the call; it returns the state
// Configure answered, "" when the outcome is unknown.
func (c *controller) configure(ctx context.Context, cl redis.UniversalClient, a *ctrlActivity) store.State {
	op := OpResume
	if a.want.paused {
		op = OpPause
	}
	in := Input{Activity: a.uid, Op: op, StartMs: a.want.startMs, EndMs: a.want.endMs}
	cctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	call := time.Now()
	res, err := store.NewActivity(cl, a.uid, 1).Configure(cctx, a.want.startMs, a.want.endMs, a.want.paused, true)
	out := configureOutput(res, err)
	c.rec.add(a.client, in, out, call, time.Now())
	c.noteCut(ctx, err)
	return store.State(out.State)
}

// close closes a for reason and records the call.
func (c *controller) close(ctx context.Context, cl redis.UniversalClient, a *ctrlActivity, reason store.CloseReason) {
	op := OpCloseExpired
	if reason == store.CloseExhausted {
		op = OpCloseExhausted
	}
	cctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	call := time.Now()
	res, err := store.NewActivity(cl, a.uid, 1).Close(cctx, reason)
	c.rec.add(a.client, Input{Activity: a.uid, Op: op}, closeOutput(res, err), call, time.Now())
	c.noteCut(ctx, err)
}

func (c *controller) noteCut(ctx context.Context, err error) {
	if err != nil && ctx.Err() != nil {
		c.mu.Lock()
		c.cut++
		c.mu.Unlock()
	}
}

// Restart cuts the running controller, stays down for down, and starts a fresh one
// that re-reconciles every activity in the background (Wait waits for that).
func (c *controller) Restart(down time.Duration) {
	c.mu.Lock()
	c.up = false
	c.cancel()
	_ = c.client.Close()
	c.mu.Unlock()
	time.Sleep(down)
	c.mu.Lock()
	c.connect()
	c.restarts++
	acts := make([]*ctrlActivity, 0, len(c.acts))
	for _, a := range c.acts {
		acts = append(acts, a)
	}
	c.mu.Unlock()
	for _, a := range acts {
		c.resync.Add(1)
		go func() {
			defer c.resync.Done()
			c.reconcile(a)
		}()
	}
}

// reconcile is the restarted controller's first reconcile of a: read the snapshot
// (retrying while Redis does not answer, until the next restart), then re-issue
// what it lacks.
func (c *controller) reconcile(a *ctrlActivity) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ctx, cl, up := c.session()
	if !up {
		return // cut again: the next restart reconciles
	}
	h := store.NewActivity(cl, a.uid, 1)
	var snap store.Snapshot
	var now time.Time
	for giveUp := time.Now().Add(5 * time.Second); ; {
		sctx, cancel := context.WithTimeout(ctx, c.timeout)
		var err error
		if snap, err = h.Snapshot(sctx); err == nil {
			now, err = h.Time(sctx)
		}
		cancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil || time.Now().After(giveUp) {
			return // cut again, or Redis stays away: nothing was written
		}
		time.Sleep(20 * time.Millisecond)
	}
	if snap.State == store.StateClosed || snap.Fenced != "" {
		return // a fenced activity's configure and close would fail the check anyway
	}
	w := a.want
	state := snap.State
	if w.opened && !(snap.State == store.StateOpen && snap.Paused == w.paused && snap.StartMs == w.startMs && snap.EndMs == w.endMs) {
		state = c.configure(ctx, cl, a)
		c.countReissued()
	}
	if state != store.StateOpen {
		return // still ready, closed meanwhile, or unknown: a later reconcile decides
	}
	switch {
	case w.expired || w.endMs > 0 && now.UnixMilli() >= w.endMs:
		c.close(ctx, cl, a, store.CloseExpired)
		c.countReissued()
	case snap.RemainingCount == 0:
		c.close(ctx, cl, a, store.CloseExhausted)
		c.countReissued()
	}
}

func (c *controller) countReissued() {
	c.mu.Lock()
	c.reissued++
	c.mu.Unlock()
}

// Wait waits for the restarted controllers' reconciles.
func (c *controller) Wait() { c.resync.Wait() }

// Close stops the controller.
func (c *controller) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.up = false
	c.cancel()
	_ = c.client.Close()
}

// configureOutput is the model's output of a Configure call: the state it answered
// ("fenced" or "" for a fenced or missing activity, which no model state accepts).
func configureOutput(res store.ConfigureResult, err error) Output {
	if err != nil {
		return Output{Unknown: true}
	}
	if res.Fenced {
		return Output{State: string(store.Fenced)}
	}
	return Output{State: string(res.State)}
}

// closeOutput is the model's output of a Close call.
func closeOutput(res store.CloseResult, err error) Output {
	if err != nil {
		return Output{Unknown: true}
	}
	return Output{State: string(res.Outcome), Reason: res.Reason}
}

// String summarizes what the restarts did.
func (c *controller) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return fmt.Sprintf("%d restarts, %d calls cut, %d re-issued", c.restarts, c.cut, c.reissued)
}
