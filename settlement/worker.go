// Package settlement credits the claims and refunds of an activity or a budget (its
// Source) to the balance system.
//
// Every grant and the refund at close are entries in the activity's Redis stream,
// written by the script that decided them (see package lua). A Worker is one
// consumer in the activity's consumer group: it reads entries, POSTs each to the
// balance system's webhook (the body and headers the public contract fixes) and
// acknowledges an entry only after a 2xx answer, in the same atomic step that counts
// it as settled (store.Stream.Ack), so the settled counters are exact and never count an
// entry twice.
//
// Before an entry is delivered it is checked against what the script that wrote it
// recorded in the same atomic step (store.Shard.VerifyEntries): a grant against its
// user's claim, the refund against the close. An entry that does not match was
// appended by someone else and is dead-lettered at once, with the reason, never
// delivered.
//
// First deliveries and retries run in parallel, each within its own bound (the
// adaptive limit and its RetryConcurrency share), so a failing delivery never holds up
// the entries behind it, and retries never wait behind new work. A delivery left
// unanswered past HedgeAfter is sent again (a hedge, same body and Idempotency-Key)
// and the loser cancelled, so one the balance system holds costs about HedgeAfter,
// not the HTTP timeout; an entry has at most two deliveries in flight, and two never
// include its last allowed attempt. Hedging pauses only while most of the deliveries
// started last went unanswered that long (a balance system slow for every delivery),
// never for the verdict on its health: with every slot taken by deliveries it holds,
// no answer would come to change that verdict before the HTTP timeout. Failed
// deliveries are retried with exponential backoff and jitter, from a short delay
// while the balance system answers most deliveries (a failure is then the entry's bad
// luck) and from a long one while it fails most of them (it is down: waiting saves
// the entries' attempts); when it recovers, entries waiting out a long delay are
// brought forward. A worker with nothing in flight that judges it down probes it with
// the entry due first, BackoffBase after the latest answer, since only answers change
// that verdict. The first deliveries in flight follow an adaptive limit (AIMD,
// limit.go) within [MinConcurrency, MaxConcurrency], and the retries' bound follows
// it; delivered entries are acknowledged in batches (acks.go). The limit and the
// verdict take each answer when it comes, before its entry is acknowledged, so a slow
// acknowledgement does not make the failures of a moment look like most of its
// answers. Deliveries are counted by Redis itself (the pending entry's delivery
// counter, raised by every read, claim and retry), so the count survives a worker's
// death; an entry delivered MaxAttempts times without success moves to the
// dead-letter stream (store.Stream.DeadLetter), once. A worker re-reads its own pending
// entries when it starts, keeps the entries it holds fresh while it backs off, and
// periodically takes over entries left idle longer than ClaimIdle by dead workers
// (XAUTOCLAIM). The stream is never trimmed. store.Stream.ReplayDeadLetters puts dead
// letters back into the stream.
//
// Every Redis call of a worker is a method of its shard's settlement stream
// (store.Stream, which an activity's and a budget's shards hand out alike): the
// consumer-group reads and claims, the delivery counts, the acknowledgement and the
// dead-lettering. The entries it reads are decoded there (store.StreamEntry). What
// differs between the kinds is the worker's Verifier: the check before delivery and
// the step before the acknowledgement (verifier.go).
//
// Delivery is at least once: the balance system dedups by the Idempotency-Key
// header, "<activityUID>/<packetId>" ("<activityUID>/refund" for the refund).
package settlement

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"redpacket.io/operator/store"
)

// redisOpTimeout bounds the acknowledging and dead-lettering calls, which run even
// while the worker shuts down so a finished delivery is not sent again.
const redisOpTimeout = 5 * time.Second

// Worker delivers one activity's settlement entries as one consumer of the group.
type Worker struct {
	cfg    Config
	stream *store.Stream // the shard's settlement stream on cfg.Redis
	// verifier is the source's check before delivery and step before the
	// acknowledgement (an activity's or a budget's).
	verifier Verifier
	// shard is the index of the worker's shard.
	shard int
	m     *metrics
	log   *slog.Logger
	held  atomic.Int64  // entries read or claimed and not yet finished
	space chan struct{} // signalled when held goes down
	acks  chan ackCall  // delivered entries for the acknowledger (acks.go)
	// transport is the HTTP transport the worker made for itself (nil when the
	// configured client brought one); its idle connections close when Run returns.
	transport *http.Transport
}

// NewWorker checks cfg, fills in its defaults and registers the metrics.
func NewWorker(cfg Config) (*Worker, error) {
	ws, err := newWorkers(cfg, 1)
	if err != nil {
		return nil, err
	}
	return ws[0], nil
}

// NewShardWorkers checks cfg and returns one worker per shard of an activity spread
// over n shards (store.Activity): worker i delivers shard i's stream in its own consumer
// group, all of them under one set of metrics. Deliveries carry the activity's UID,
// so Idempotency-Keys are those of an unsharded activity (packet ids are unique
// across shards). With n <= 1 it is NewWorker.
func NewShardWorkers(cfg Config, n int) ([]*Worker, error) {
	return newWorkers(cfg, max(n, 1))
}

// newWorkers checks cfg, fills in its defaults, registers the metrics once and
// returns a worker for each of the n shards' streams.
func newWorkers(cfg Config, n int) ([]*Worker, error) {
	ownTransport := cfg.HTTPClient == nil || cfg.HTTPClient.Transport == nil
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Registerer, cfg.Source.Ref())
	if err != nil {
		return nil, err
	}
	act := store.NewActivity(cfg.Redis, cfg.Source.UID, n)
	ws := make([]*Worker, n)
	for i := range ws {
		// One transport for all of them: the first worker closes its idle connections.
		v := &activityVerifier{shard: act.Shard(i), ledger: act.Ledger(), allowance: cfg.Allowance, shards: n}
		ws[i] = newWorker(cfg, m, act.Stream(i), v, ownTransport && i == 0)
		ws[i].shard = i
	}
	return ws, nil
}

// RunAll runs every worker (NewShardWorkers) until ctx is done and returns their
// errors joined.
func RunAll(ctx context.Context, ws []*Worker) error {
	errs := make([]error, len(ws))
	var wg sync.WaitGroup
	for i, w := range ws {
		wg.Go(func() { errs[i] = w.Run(ctx) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// newWorker is a worker of cfg (already checked) on the stream h, with the source's
// verifier v.
func newWorker(cfg Config, m *metrics, h *store.Stream, v Verifier, ownTransport bool) *Worker {
	log := cfg.Logger.With("activity", cfg.Source.Ref(), "consumer", cfg.Consumer)
	w := &Worker{cfg: cfg, stream: h, verifier: v, m: m, log: log, space: make(chan struct{}, 1), acks: make(chan ackCall, maxAckBatch)}
	if ownTransport {
		w.transport, _ = cfg.HTTPClient.Transport.(*http.Transport)
	}
	return w
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
	if w.transport != nil {
		defer w.transport.CloseIdleConnections()
	}
	// The acknowledger outlives the jobs: they acknowledge even while the worker
	// shuts down, so a finished delivery is not sent again.
	actx, stopAcks := context.WithCancel(context.WithoutCancel(ctx))
	var acks sync.WaitGroup
	acks.Go(func() { w.runAcks(actx) })
	defer func() {
		stopAcks()
		acks.Wait()
	}()
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
		err := w.stream.EnsureGroup(ctx, w.cfg.Group)
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

// runJob performs one attempt at an entry's next step. A job cancelled through ctx
// (shutdown, or its entry's other delivery won) leaves the entry pending.
func (w *Worker) runJob(ctx context.Context, j job) result {
	r := result{id: j.id, seq: j.seq, lane: j.lane, outcome: outcomeRetry, step: j.step, attempts: j.attempts, lastErr: j.lastErr}
	if j.claim {
		mine, err := w.stream.ClaimForRetry(ctx, w.cfg.Group, w.cfg.Consumer, j.id, j.minIdle)
		if err != nil {
			if ctx.Err() == nil {
				w.log.Warn("re-claiming a settlement entry for retry", "entry", j.id, "err", err)
			}
			return r
		}
		if !mine {
			return result{id: j.id, seq: j.seq, lane: j.lane, outcome: outcomeLost}
		}
		r.attempts++
	}
	switch j.step {
	case stepAck:
		return w.ack(ctx, j, r)
	case stepDeadLetter:
		return w.deadLetter(ctx, j, r)
	}
	if j.undeliverable != nil {
		r.lastErr = j.undeliverable.Error()
		return w.deadLetter(ctx, j, r)
	}
	if r.attempts > int64(w.cfg.MaxAttempts) {
		if r.lastErr == "" {
			r.lastErr = fmt.Sprintf("no acknowledgement after %d deliveries", r.attempts-1)
		}
		return w.deadLetter(ctx, j, r)
	}
	err := w.postTimed(ctx, j, &r)
	if err == nil {
		r.posted = postedOK
		tell(ctx, j, r)
		return w.ack(ctx, j, r)
	}
	if ctx.Err() != nil {
		return r // shutting down: the entry stays pending for the next owner
	}
	r.posted = postedFailed
	tell(ctx, j, r)
	w.m.deliveries.WithLabelValues(failedResult(err)).Inc()
	r.lastErr = err.Error()
	if r.attempts >= int64(w.cfg.MaxAttempts) {
		return w.deadLetter(ctx, j, r)
	}
	w.m.retries.Inc()
	class := ErrorClass(err)
	if logIt, streak := w.cfg.Health.failed(j.id, j.entry.At, class, time.Now()); logIt {
		// The first failure after a quiet time, then at most once a minute: a broken
		// webhook shows in the log without a line per delivery.
		w.log.Warn("settlement deliveries are failing; retrying", "entry", j.id, "packet", j.entry.PacketID,
			"attempts", r.attempts, "errorClass", class, "failuresSinceHealthy", streak, "err", err)
	}
	w.log.Debug("settlement delivery failed; retrying", "entry", j.id, "packet", j.entry.PacketID,
		"attempts", r.attempts, "errorClass", class, "err", err)
	return r
}

// tell sends the scheduler how j's POST ended (r.posted), unless ctx ends first.
func tell(ctx context.Context, j job, r result) {
	if j.answered == nil {
		return
	}
	select {
	case j.answered <- answerNotice{seq: r.seq, posted: r.posted, took: r.took, slow: r.slow}:
	case <-ctx.Done():
	}
}

// postTimed delivers j's entry and records in r how long it took; when the answer
// takes longer than j.hedgeAfter, it says so on j.slow meanwhile.
func (w *Worker) postTimed(ctx context.Context, j job, r *result) error {
	if j.hedgeAfter > 0 && j.slow != nil {
		t := time.AfterFunc(j.hedgeAfter, func() {
			select {
			case j.slow <- slowNotice{id: j.id, seq: j.seq}:
			case <-ctx.Done():
			}
		})
		defer t.Stop()
	}
	start := time.Now()
	err := w.post(ctx, w.delivery(j.entry))
	r.took = time.Since(start)
	r.slow = j.hedgeAfter > 0 && r.took >= j.hedgeAfter
	return err
}

// ack acknowledges a delivered entry and counts it as settled, once (through the
// worker's acknowledger, acks.go); a budget's refund has its packet forgotten first.
func (w *Worker) ack(ctx context.Context, j job, r result) result {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), redisOpTimeout)
	defer cancel()
	a := w.acknowledge(actx, j.id, j.entry)
	if a.beforeErr != nil {
		w.log.Warn("preparing the acknowledgement of a delivered entry", "entry", j.id, "err", a.beforeErr)
		r.step = stepAck
		r.outcome = outcomeRetry
		return r
	}
	if a.err != nil {
		w.log.Warn("acknowledging a delivered settlement entry", "entry", j.id, "err", a.err)
		r.step = stepAck
		r.outcome = outcomeRetry
		return r
	}
	if j.entry.Kind == store.KindCreate {
		r.outcome = outcomeDone // booked, not delivered: no delivery to count
		return r
	}
	if a.settled {
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
	parked, err := w.stream.DeadLetter(actx, w.cfg.Group, j.id, r.lastErr, j.entry.FieldValues())
	if err != nil {
		w.log.Warn("dead-lettering a settlement entry", "entry", j.id, "err", err)
		r.step = stepDeadLetter
		r.outcome = outcomeRetry
		return r
	}
	if parked {
		w.m.deadLetters.Inc()
		w.forgedParked(j)
		if errors.Is(j.undeliverable, store.ErrForged) {
			w.log.Error("settlement entry not written by the activity's scripts dead-lettered, not delivered",
				"entry", j.id, "fields", j.entry.Fields, "err", r.lastErr)
		} else {
			w.log.Warn("settlement entry dead-lettered", "entry", j.id, "packet", j.entry.PacketID,
				"attempts", r.attempts, "err", r.lastErr)
		}
	}
	r.outcome = outcomeDone
	return r
}

// backoff is the delay after the given number of failed deliveries: the base
// doubled per attempt, capped, with "equal jitter" (uniform in the upper half) so
// retries of many entries spread out. While the balance system is healthy the base
// and cap are HealthyBackoffBase and HealthyBackoffMax, else BackoffBase and
// BackoffMax.
func (w *Worker) backoff(attempts int64, healthy bool) time.Duration {
	base, limit := w.cfg.BackoffBase, w.cfg.BackoffMax
	if healthy {
		base, limit = w.cfg.HealthyBackoffBase, w.cfg.HealthyBackoffMax
	}
	return jitteredBackoff(base, limit, attempts)
}

// jitteredBackoff is the delay after the given number of failed attempts: base
// doubled per attempt after the first, capped at limit, with equal jitter.
func jitteredBackoff(base, limit time.Duration, attempts int64) time.Duration {
	d := base
	for i := int64(1); i < attempts && d < limit; i++ {
		d *= 2
	}
	d = min(d, limit)
	half := d / 2
	return half + rand.N(d-half+1)
}

// failedResult is the deliveries_total result of a failed delivery: ResultRejected
// for an answer that is not a 2xx, ResultNoAnswer for none.
func failedResult(err error) string {
	var de *deliveryError
	if errors.As(err, &de) && de.status != 0 {
		return ResultRejected
	}
	return ResultNoAnswer
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
