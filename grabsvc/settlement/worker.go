// Package settlement credits an activity's claims and refunds to the balance system.
//
// Every grant and the refund at close are entries in the activity's Redis stream,
// written by the script that decided them (see package lua). A Worker is one
// consumer in the activity's consumer group: it reads entries, POSTs each to the
// balance system's webhook (the body and headers the public contract fixes) and
// acknowledges an entry only after a 2xx answer, in the same atomic step that counts
// it as settled (lua.Ack), so the settled counters are exact and never count an
// entry twice.
//
// Failed deliveries are retried with exponential backoff and jitter without holding
// up other entries. Deliveries are counted by Redis itself (the pending entry's
// delivery counter, raised by every read, claim and retry), so the count survives a
// worker's death; an entry delivered MaxAttempts times without success moves to the
// dead-letter stream (lua.DeadLetter), once. A worker re-reads its own pending
// entries when it starts, keeps the entries it holds fresh while it backs off, and
// periodically takes over entries left idle longer than ClaimIdle by dead workers
// (XAUTOCLAIM). The stream is never trimmed. lua.Activity.ReplayDeadLetters puts
// dead letters back into the stream.
//
// Every Redis call of a worker is a method of the activity's handle (lua.Activity):
// the consumer-group reads and claims, the delivery counts, the acknowledgement and
// the dead-lettering. The entries it reads are decoded there (lua.StreamEntry).
//
// Delivery is at least once: the balance system dedups by the Idempotency-Key
// header, "<activityUID>/<packetId>" ("<activityUID>/refund" for the refund).
package settlement

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"redpacket.io/operator/lua"
)

// redisOpTimeout bounds the acknowledging and dead-lettering calls, which run even
// while the worker shuts down so a finished delivery is not sent again.
const redisOpTimeout = 5 * time.Second

// Worker delivers one activity's settlement entries as one consumer of the group.
type Worker struct {
	cfg   Config
	redis *lua.Activity // the activity's handle on cfg.Redis
	m     *metrics
	log   *slog.Logger
	held  atomic.Int64  // entries read or claimed and not yet finished
	space chan struct{} // signalled when held goes down
}

// NewWorker checks cfg, fills in its defaults and registers the metrics.
func NewWorker(cfg Config) (*Worker, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Registerer, cfg.Activity)
	if err != nil {
		return nil, err
	}
	log := cfg.Logger.With("activity", cfg.Activity, "consumer", cfg.Consumer)
	return &Worker{cfg: cfg, redis: lua.NewActivity(cfg.Redis, cfg.ActivityUID), m: m, log: log,
		space: make(chan struct{}, 1)}, nil
}

// Run delivers entries until ctx is done, then waits for its deliveries in flight to
// stop and returns nil. Redis and webhook failures are retried, never returned. With
// no webhook URL configured it only waits for ctx: claims stay in the stream.
//
// The consumer group is created (from the stream's first entry) when Run starts; a
// group that disappears while running is not recreated, since re-reading entries
// acknowledged before would count them as settled again.
func (w *Worker) Run(ctx context.Context) error {
	if w.cfg.WebhookURL == "" {
		w.log.Info("no settlement webhook configured; claims wait in the stream")
		<-ctx.Done()
		return nil
	}
	if !w.ensureGroup(ctx) {
		return nil
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	batches := make(chan []acquired)
	var wg sync.WaitGroup
	wg.Go(func() { w.read(ctx, batches) })
	w.schedule(ctx, batches)
	cancel()
	wg.Wait()
	return nil
}

// ensureGroup creates the consumer group at the stream's start (and the stream if
// need be), retrying until it exists or ctx is done.
func (w *Worker) ensureGroup(ctx context.Context) bool {
	for failures := 0; ; failures++ {
		err := w.redis.EnsureGroup(ctx, w.cfg.Group)
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		w.log.Error("creating the settlement consumer group", "err", err)
		if !sleep(ctx, retryPause(failures)) {
			return false
		}
	}
}

// step is what an entry needs next.
type step int

const (
	stepDeliver    step = iota // POST it (and acknowledge on success)
	stepAck                    // delivered; the acknowledgement failed and is retried
	stepDeadLetter             // given up; parking it failed and is retried
)

// entry is one stream entry this worker holds. Only the scheduling goroutine
// touches it; jobs get copies of what they need.
type entry struct {
	id       string
	entry    lua.StreamEntry // Malformed says why it cannot be delivered, if it cannot
	attempts int64           // deliveries counted by Redis so far
	fresh    bool            // the read or claim that brought it in counted the next delivery
	touched  time.Time
	step     step
	lastErr  string
	inflight bool
	removed  bool
	due      time.Time
}

// acquired is an entry read or claimed by the reader.
type acquired struct {
	entry    lua.StreamEntry
	attempts int64
	at       time.Time
}

// outcome is how a job ended.
type outcome int

const (
	outcomeDone  outcome = iota // acknowledged or dead-lettered (by this worker or another)
	outcomeRetry                // try again after a backoff
	outcomeLost                 // another consumer owns it now
)

// job is one attempt at an entry's next step.
type job struct {
	id       string
	entry    lua.StreamEntry
	step     step
	claim    bool          // re-claim before delivering: counts the delivery and checks ownership
	minIdle  time.Duration // for the re-claim
	attempts int64
	lastErr  string
}

type result struct {
	id       string
	outcome  outcome
	step     step
	attempts int64
	lastErr  string
}

// schedule owns the held entries: it starts due jobs up to Concurrency, applies
// their results, schedules retries and keeps the held entries fresh.
func (w *Worker) schedule(ctx context.Context, batches <-chan []acquired) {
	entries := map[string]*entry{}
	var ready []*entry
	delayed := &entryHeap{}
	results := make(chan result, w.cfg.Concurrency)
	inflight := 0
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	heartbeat := time.NewTicker(w.cfg.ClaimIdle / 3)
	defer heartbeat.Stop()

	for {
		for inflight < w.cfg.Concurrency && len(ready) > 0 {
			e := ready[0]
			ready = ready[1:]
			if e.removed {
				continue
			}
			j := w.jobFor(e, time.Now())
			e.inflight = true
			inflight++
			go func() { results <- w.runJob(ctx, j) }()
		}
		var timerC <-chan time.Time
		if delayed.Len() > 0 {
			timer.Reset(time.Until((*delayed)[0].due))
			timerC = timer.C
		}

		select {
		case <-ctx.Done():
			for ; inflight > 0; inflight-- {
				<-results
			}
			return
		case batch := <-batches:
			for _, a := range batch {
				if e, ok := entries[a.entry.ID]; ok {
					// Claimed back from our own pending list: it sat idle too long.
					e.attempts = max(e.attempts, a.attempts)
					e.touched = a.at
					w.release(1)
					continue
				}
				e := &entry{id: a.entry.ID, entry: a.entry, attempts: a.attempts, fresh: true, touched: a.at}
				entries[e.id] = e
				ready = append(ready, e)
			}
		case r := <-results:
			inflight--
			e := entries[r.id]
			if e == nil {
				continue
			}
			e.inflight = false
			switch r.outcome {
			case outcomeDone, outcomeLost:
				e.removed = true
				delete(entries, e.id)
				w.release(1)
			case outcomeRetry:
				e.step, e.lastErr = r.step, r.lastErr
				e.attempts = max(e.attempts, r.attempts)
				e.due = time.Now().Add(w.backoff(e.attempts))
				heap.Push(delayed, e)
			}
		case <-timerC:
			now := time.Now()
			for delayed.Len() > 0 && !(*delayed)[0].due.After(now) {
				e := heap.Pop(delayed).(*entry)
				if !e.removed {
					ready = append(ready, e)
				}
			}
		case <-heartbeat.C:
			for _, e := range w.refresh(ctx, entries) {
				e.removed = true
				delete(entries, e.id)
				w.release(1)
			}
		}
	}
}

// jobFor prepares the next attempt at e.
func (w *Worker) jobFor(e *entry, now time.Time) job {
	j := job{id: e.id, entry: e.entry, step: e.step, attempts: e.attempts, lastErr: e.lastErr}
	if e.step == stepDeliver && e.entry.Malformed == nil {
		if e.fresh {
			e.fresh = false
		} else {
			j.claim = true
			j.minIdle = w.leaseIdle(e, now)
			e.touched = now
		}
	}
	return j
}

// leaseIdle is the min-idle time for re-claiming e: smaller than its idle time if
// this worker still owns it, larger if another worker took it over since (which
// happens only after the entry sat idle ClaimIdle).
func (w *Worker) leaseIdle(e *entry, now time.Time) time.Duration {
	return max(0, now.Sub(e.touched)-w.cfg.ClaimIdle/2)
}

// refresh resets the idle time of held entries not touched for a third of
// ClaimIdle, so live workers' entries are never taken over. It returns the entries
// (not in flight) that another worker owns now or that are no longer pending.
func (w *Worker) refresh(ctx context.Context, entries map[string]*entry) []*entry {
	now := time.Now()
	var stale []*entry
	var held []lua.HeldEntry
	for _, e := range entries {
		if now.Sub(e.touched) < w.cfg.ClaimIdle/3 {
			continue
		}
		stale = append(stale, e)
		held = append(held, lua.HeldEntry{ID: e.id, MinIdle: w.leaseIdle(e, now)})
	}
	if len(held) == 0 {
		return nil
	}
	owned, err := w.redis.RefreshHeld(ctx, w.cfg.Group, w.cfg.Consumer, held)
	if err != nil && ctx.Err() == nil {
		w.log.Warn("refreshing held settlement entries", "err", err)
	}
	var lost []*entry
	for _, e := range stale {
		mine, answered := owned[e.id]
		switch {
		case !answered:
		case mine:
			e.touched = now
		case !e.inflight:
			lost = append(lost, e)
		}
	}
	return lost
}

// runJob performs one attempt at an entry's next step.
func (w *Worker) runJob(ctx context.Context, j job) result {
	r := result{id: j.id, outcome: outcomeRetry, step: j.step, attempts: j.attempts, lastErr: j.lastErr}
	if j.claim {
		mine, err := w.redis.ClaimForRetry(ctx, w.cfg.Group, w.cfg.Consumer, j.id, j.minIdle)
		if err != nil {
			if ctx.Err() == nil {
				w.log.Warn("re-claiming a settlement entry for retry", "entry", j.id, "err", err)
			}
			return r
		}
		if !mine {
			return result{id: j.id, outcome: outcomeLost}
		}
		r.attempts++
	}
	switch j.step {
	case stepAck:
		return w.ack(ctx, j, r)
	case stepDeadLetter:
		return w.deadLetter(ctx, j, r)
	}
	if j.entry.Malformed != nil {
		r.lastErr = "malformed entry: " + j.entry.Malformed.Error()
		return w.deadLetter(ctx, j, r)
	}
	if r.attempts > int64(w.cfg.MaxAttempts) {
		if r.lastErr == "" {
			r.lastErr = fmt.Sprintf("no acknowledgement after %d deliveries", r.attempts-1)
		}
		return w.deadLetter(ctx, j, r)
	}
	err := w.post(ctx, w.delivery(j.entry))
	if err == nil {
		return w.ack(ctx, j, r)
	}
	if ctx.Err() != nil {
		return r // shutting down: the entry stays pending for the next owner
	}
	var de *deliveryError
	if errors.As(err, &de) && de.status != 0 {
		w.m.deliveries.WithLabelValues(ResultRejected).Inc()
	} else {
		w.m.deliveries.WithLabelValues(ResultNoAnswer).Inc()
	}
	r.lastErr = err.Error()
	if r.attempts >= int64(w.cfg.MaxAttempts) {
		return w.deadLetter(ctx, j, r)
	}
	w.m.retries.Inc()
	w.log.Debug("settlement delivery failed; retrying", "entry", j.id, "packet", j.entry.PacketID,
		"attempts", r.attempts, "err", err)
	return r
}

// ack acknowledges a delivered entry and counts it as settled, once.
func (w *Worker) ack(ctx context.Context, j job, r result) result {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), redisOpTimeout)
	defer cancel()
	settled, err := w.redis.Ack(actx, w.cfg.Group, j.id, j.entry.Kind, j.entry.Amount)
	if err != nil {
		w.log.Warn("acknowledging a delivered settlement entry", "entry", j.id, "err", err)
		r.step = stepAck
		r.outcome = outcomeRetry
		return r
	}
	if settled {
		w.m.deliveries.WithLabelValues(ResultSettled).Inc()
		lag := time.Since(j.entry.At)
		w.m.lag.Observe(max(0, lag.Seconds()))
	} else {
		w.m.deliveries.WithLabelValues(ResultAlreadySettled).Inc()
	}
	r.outcome = outcomeDone
	return r
}

// deadLetter parks an entry that will not be delivered, with its last error.
func (w *Worker) deadLetter(ctx context.Context, j job, r result) result {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), redisOpTimeout)
	defer cancel()
	parked, err := w.redis.DeadLetter(actx, w.cfg.Group, j.id, r.lastErr, j.entry.FieldValues())
	if err != nil {
		w.log.Warn("dead-lettering a settlement entry", "entry", j.id, "err", err)
		r.step = stepDeadLetter
		r.outcome = outcomeRetry
		return r
	}
	if parked {
		w.m.deadLetters.Inc()
		w.log.Warn("settlement entry dead-lettered", "entry", j.id, "packet", j.entry.PacketID,
			"attempts", r.attempts, "err", r.lastErr)
	}
	r.outcome = outcomeDone
	return r
}

// backoff is the delay after the given number of failed deliveries: BackoffBase
// doubled per attempt, capped at BackoffMax, with "equal jitter" (uniform in the
// upper half) so retries of many entries spread out.
func (w *Worker) backoff(attempts int64) time.Duration {
	d := w.cfg.BackoffBase
	for i := int64(1); i < attempts && d < w.cfg.BackoffMax; i++ {
		d *= 2
	}
	d = min(d, w.cfg.BackoffMax)
	half := d / 2
	return half + rand.N(d-half+1)
}

// release gives back capacity for n held entries.
func (w *Worker) release(n int64) {
	w.held.Add(-n)
	select {
	case w.space <- struct{}{}:
	default:
	}
}

// retryPause is the pause after consecutive failures of a Redis call.
func retryPause(failures int) time.Duration {
	d := 100 * time.Millisecond << min(failures, 7)
	return d/2 + rand.N(d/2+1)
}

// sleep waits d or until ctx is done; it reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// entryHeap orders entries waiting to retry by due time.
type entryHeap []*entry

func (h entryHeap) Len() int           { return len(h) }
func (h entryHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h entryHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }

// Push adds an entry (heap.Interface).
func (h *entryHeap) Push(x any) { *h = append(*h, x.(*entry)) }

// Pop removes the last entry (heap.Interface).
func (h *entryHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return e
}
