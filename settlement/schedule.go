package settlement

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"redpacket.io/operator/store"
)

// step is what an entry needs next.
type step int

const (
	stepDeliver    step = iota // POST it (and acknowledge on success)
	stepAck                    // delivered; the acknowledgement failed and is retried
	stepDeadLetter             // given up; parking it failed and is retried
)

// laterStep is the step an entry needs after two jobs of it ended with a and b: a
// delivery that went through needs only its acknowledgement, whatever the other
// job saw.
func laterStep(a, b step) step {
	switch {
	case a == stepAck || b == stepAck:
		return stepAck
	case a == stepDeadLetter || b == stepDeadLetter:
		return stepDeadLetter
	}
	return stepDeliver
}

// entry is one stream entry this worker holds. Only the scheduling goroutine
// touches it; jobs get copies of what they need.
type entry struct {
	id     string
	entry  store.StreamEntry // Malformed says why it cannot be delivered, if it cannot
	forged error             // why no script of the activity wrote it, if none did
	// attempts is the deliveries Redis has counted so far, as far as this worker
	// knows; started is the delivery number of the latest job started (one more than
	// attempts while a re-claiming job runs).
	attempts, started int64
	fresh             bool // the read or claim that brought it in counted the next delivery
	touched           time.Time
	step              step
	lastErr           string
	// running are the entry's jobs in flight, by job number: at most two, a slow
	// delivery and its hedge or retry.
	running  map[uint64]context.CancelFunc
	queued   bool // waiting in a ready queue or for its retry
	removed  bool
	due      time.Time
	failedAt time.Time // when its last attempt failed (due is counted from it)
	probe    bool      // its next job is the scheduler's probe (probeWhenIdle)
}

// undeliverable says why e must be dead-lettered without a delivery, or nil.
func (e *entry) undeliverable() error {
	var fe *ForgedError
	if errors.As(e.forged, &fe) {
		return e.forged // a budget's check counts a malformed entry as forged too
	}
	if e.entry.Malformed != nil {
		return fmt.Errorf("malformed entry: %w", e.entry.Malformed)
	}
	return e.forged
}

// acquired is an entry read or claimed by the reader.
type acquired struct {
	entry    store.StreamEntry
	forged   error
	attempts int64
	at       time.Time
}

// lane is one of the two bounded sets of jobs in flight.
type lane int

const (
	laneFirst lane = iota // first deliveries of entries, up to the adaptive limit (limiter)
	laneRetry             // everything else (retries, hedges, acknowledgements, parking), up to Config.retryBound of it
)

// outcome is how a job ended.
type outcome int

const (
	outcomeDone  outcome = iota // acknowledged or dead-lettered (by this worker or another)
	outcomeRetry                // try again after a backoff
	outcomeLost                 // another consumer owns it now
)

// job is one attempt at an entry's next step.
type job struct {
	id            string
	seq           uint64 // the job's number, unique in the worker
	entry         store.StreamEntry
	undeliverable error // dead-letter it with this reason, without delivering
	lane          lane
	step          step
	claim         bool          // re-claim before delivering: counts the delivery and checks ownership
	minIdle       time.Duration // for the re-claim
	attempts      int64
	lastErr       string
	// hedgeAfter, when positive, is how long the POST may go unanswered before the
	// job says so on slow (the scheduler may then start a hedge).
	hedgeAfter time.Duration
	slow       chan<- slowNotice
	// answered hears how the POST ended (an answer, or none before the timeout)
	// as soon as it does, before the entry is acknowledged or parked.
	answered chan<- answerNotice
}

// slowNotice says that a job's delivery has gone unanswered for its hedgeAfter.
type slowNotice struct {
	id  string
	seq uint64
}

// answerNotice is how a job's POST ended, told as soon as it did: the scheduler judges
// the balance system (the adaptive limit, the health verdict, the pace and latency of
// its answers) by the answers in the order they come. A delivery that succeeded then
// waits for its acknowledgement, which takes a Redis round trip (and longer while
// Redis is slow), and one that failed does not: judged when their jobs end, failures
// would come in runs ahead of the successes of the same moment.
type answerNotice struct {
	seq    uint64
	posted posted // postedOK or postedFailed
	took   time.Duration
	slow   bool
}

// posted is what a job's POST to the webhook came to.
type posted int

const (
	postedNone   posted = iota // no POST, or one cut short (shutdown, a hedge won)
	postedOK                   // a 2xx answer
	postedFailed               // another answer, or none
)

type result struct {
	id       string
	seq      uint64
	lane     lane
	outcome  outcome
	step     step
	attempts int64
	lastErr  string
	// posted, took and slow describe the job's POST, for its answerNotice.
	posted posted
	took   time.Duration // how long the POST took
	slow   bool          // the POST went unanswered past the job's hedge delay
}

// scheduler owns the entries a worker holds. It runs jobs in two lanes, each within
// its bound: first deliveries (the adaptive limit, limiter) and everything else (the
// limit scaled by RetryConcurrency/Concurrency), so retries never wait behind new
// work nor new work behind retries. Every delivery's outcome feeds the limit; a
// lower limit lets the jobs in flight finish and starts no new one until fewer run
// than the bound. A delivery left
// unanswered past the hedge delay is sent again (see hedge), so a delivery the
// balance system holds costs about the hedge delay, not the HTTP timeout, and never
// holds a lane. Only the schedule goroutine touches it.
type scheduler struct {
	w        *Worker
	ctx      context.Context
	entries  map[string]*entry
	ready    [2][]*entry // by lane, in order
	inflight [2]int
	bound    [2]int // the lanes' bounds, from limit
	limit    *limiter
	delayed  entryHeap
	results  chan result
	slow     chan slowNotice
	answers  chan answerNotice
	receiver health
	// pace is whether the latest deliveries, in the order they started, were
	// answered within their hedge delay.
	pace pace
	// declined are the slow notices hedge turned down while most deliveries went
	// slow; they are looked at again once a prompt answer makes the pace healthy, so
	// a delivery the balance system holds is hedged all the same when the answers
	// that come in show it is not slow for every delivery (see answer).
	declined []slowNotice
	// latency is a moving average of how long answered deliveries took.
	latency time.Duration
	jobs    uint64 // jobs started
	// answered is when the latest delivery ended with an answer or none (posted);
	// probe is the job number of the probe in flight (see probe), 0 when none.
	answered time.Time
	probe    uint64
}

// schedule runs the scheduler until ctx is done, then waits for its jobs.
func (w *Worker) schedule(ctx context.Context, batches <-chan []acquired) {
	n := w.cfg.maxInFlight()
	s := &scheduler{w: w, ctx: ctx, entries: map[string]*entry{},
		limit:   newLimiter(w.cfg.Concurrency, w.cfg.MinConcurrency, w.cfg.MaxConcurrency),
		results: make(chan result, n), slow: make(chan slowNotice, n), answers: make(chan answerNotice, 2*n)}
	s.setBounds()
	defer func() { w.m.limit.Sub(float64(s.bound[laneFirst])) }()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	heartbeat := time.NewTicker(w.cfg.ClaimIdle / 3)
	defer heartbeat.Stop()

	for {
		s.startReady()
		s.probeWhenIdle()
		var timerC <-chan time.Time
		if s.delayed.Len() > 0 {
			timer.Reset(time.Until(s.delayed[0].due))
			timerC = timer.C
		}
		select {
		case <-ctx.Done():
			for n := s.inflight[laneFirst] + s.inflight[laneRetry]; n > 0; n-- {
				<-s.results
			}
			return
		case batch := <-batches:
			s.add(batch)
		case a := <-s.answers:
			s.answer(a)
		case r := <-s.results:
			// A job tells its answer before it ends: judge the answers first, so a
			// failed entry's backoff follows the verdict its own answer moved.
			s.answerWaiting()
			s.finished(r)
		case n := <-s.slow:
			s.hedge(n)
		case <-timerC:
			now := time.Now()
			for s.delayed.Len() > 0 && !s.delayed[0].due.After(now) {
				e := heap.Pop(&s.delayed).(*entry)
				s.ready[laneRetry] = append(s.ready[laneRetry], e)
			}
		case <-heartbeat.C:
			for _, e := range w.refresh(ctx, s.entries) {
				s.remove(e)
			}
		}
	}
}

// add takes in entries the reader brought.
func (s *scheduler) add(batch []acquired) {
	for _, a := range batch {
		if e, ok := s.entries[a.entry.ID]; ok {
			// Claimed back from our own pending list: it sat idle too long.
			e.attempts = max(e.attempts, a.attempts)
			e.touched = a.at
			s.w.release(1)
			continue
		}
		e := &entry{id: a.entry.ID, entry: a.entry, forged: a.forged, attempts: a.attempts, started: a.attempts,
			fresh: true, touched: a.at, running: map[uint64]context.CancelFunc{}, queued: true}
		if errors.Is(a.forged, errBooked) {
			// Booked by the check (a creation record): only its acknowledgement is left.
			e.forged, e.step = nil, stepAck
		}
		s.entries[e.id] = e
		// An entry delivered before (read back from an earlier run's pending list,
		// or taken over from a dead worker) is a retry.
		l := laneFirst
		if e.attempts > 1 {
			l = laneRetry
		}
		s.ready[l] = append(s.ready[l], e)
	}
}

// startReady starts the ready entries' jobs while their lanes have room.
func (s *scheduler) startReady() {
	for l := range s.ready {
		for s.inflight[l] < s.bound[l] && len(s.ready[l]) > 0 {
			e := s.ready[l][0]
			s.ready[l][0] = nil
			s.ready[l] = s.ready[l][1:]
			e.queued = false
			if e.removed || !s.mayRunAnother(e) {
				continue // the result of a delivery in flight reschedules it
			}
			s.start(e, lane(l), false)
		}
	}
}

// start runs the next attempt at e in lane l; a hedge is a second delivery of an
// entry whose delivery is still in flight.
func (s *scheduler) start(e *entry, l lane, hedge bool) {
	j := s.w.jobFor(e, l, time.Now(), hedge)
	s.jobs++
	j.seq = s.jobs
	if j.step == stepDeliver && j.undeliverable == nil && s.w.cfg.HedgeAfter > 0 {
		j.hedgeAfter = max(s.w.cfg.HedgeAfter, 4*s.latency)
		j.slow = s.slow
	}
	if e.probe {
		e.probe, s.probe = false, j.seq
	}
	j.answered = s.answers
	jctx, cancel := context.WithCancel(s.ctx)
	e.running[j.seq] = cancel
	s.inflight[l]++
	go func() { s.results <- s.w.runJob(jctx, j) }()
}

// mayRunAnother reports whether a job of e may start now: none is in flight, or
// one is and the new one would not be the entry's last allowed attempt, so two
// deliveries in flight never dead-letter an entry while the other may still
// succeed.
func (s *scheduler) mayRunAnother(e *entry) bool {
	switch len(e.running) {
	case 0:
		return true
	case 1:
		return e.started+1 < int64(s.w.cfg.MaxAttempts)
	}
	return false
}

// hedge sends the entry whose delivery n is slow again, unless the new delivery
// would be the entry's last allowed attempt, or most of the latest deliveries went
// slow too: against a balance system that is slow for every delivery, hedging would
// double its load and cut every delivery short, so they run to their answers and
// the latency average (and with it the hedge delay) catches up. With
// room in the retry lane, n keeps running and the hedge runs next to it (any older
// delivery of the entry, which n hedged, is abandoned: at most two are in flight).
// With the retry lane full, n is abandoned and the entry goes first in the retry
// lane's queue, so deliveries the balance system holds never fill a lane for the
// length of the HTTP timeout. The verdict on the balance system's health does not
// hold hedges back: it changes only with answers, and with every slot taken by
// deliveries the balance system holds none would come before the HTTP timeout; the
// lanes' bounds, which follow the adaptive limit, bound the load hedges add.
//
// An abandoned delivery is cancelled; if the balance system did apply it, the
// later delivery carries the same Idempotency-Key.
func (s *scheduler) hedge(n slowNotice) {
	s.pace.record(n.seq, true)
	e := s.entries[n.id]
	if e == nil || e.queued || e.running[n.seq] == nil || n.seq != maxKey(e.running) {
		return // finished, rescheduled, or no longer its latest delivery
	}
	if e.step != stepDeliver || e.undeliverable() != nil || e.started+1 >= int64(s.w.cfg.MaxAttempts) {
		return
	}
	if !s.pace.healthy() {
		// The delivery runs to its answer or its timeout, unless the pace turns.
		s.declined = append(s.declined, n)
		return
	}
	s.w.m.hedges.Inc()
	room := s.inflight[laneRetry] < s.bound[laneRetry]
	for seq, cancel := range e.running {
		if seq != n.seq || !room {
			cancel() // its result is ignored (see finished)
			delete(e.running, seq)
		}
	}
	if room {
		s.start(e, laneRetry, true)
		return
	}
	e.queued = true
	s.ready[laneRetry] = append([]*entry{e}, s.ready[laneRetry]...)
}

// maxKey is the largest key of m (0 when empty).
func maxKey[V any](m map[uint64]V) uint64 {
	var top uint64
	for k := range m {
		top = max(top, k)
	}
	return top
}

// answer judges the balance system by one delivery's answer (or its timeout): the
// adaptive limit, the health verdict, the pace and the latency of its answers. A
// delivery cancelled because its hedge won, or abandoned, tells nothing.
func (s *scheduler) answer(a answerNotice) {
	switch a.posted {
	case postedOK:
		s.observe(deliveredOK, a.took)
	case postedFailed:
		s.observe(deliveryFailed, 0)
	default:
		return
	}
	if !a.slow {
		s.pace.record(a.seq, false)
		if len(s.declined) > 0 && s.pace.healthy() {
			// hedge checks each again: a delivery answered or replaced since is left.
			declined := s.declined
			s.declined = nil
			for _, n := range declined {
				s.hedge(n)
			}
		}
	}
	s.answered = time.Now()
	if a.seq == s.probe && a.posted == postedOK && !s.receiver.healthy() {
		// The balance system answered the probe: it is back, as far as this
		// worker can tell without waiting for a window of answers.
		s.w.bringForward(&s.delayed)
	}
	wasHealthy := s.receiver.healthy()
	s.receiver.record(a.posted == postedOK)
	if a.posted == postedOK {
		if s.latency == 0 {
			s.latency = a.took
		} else {
			s.latency += (a.took - s.latency) / 8
		}
	}
	if !wasHealthy && s.receiver.healthy() {
		s.w.bringForward(&s.delayed)
	}
}

// answerWaiting judges the answers told and not judged yet.
func (s *scheduler) answerWaiting() {
	for {
		select {
		case a := <-s.answers:
			s.answer(a)
		default:
			return
		}
	}
}

// finished applies a job's result.
func (s *scheduler) finished(r result) {
	s.inflight[r.lane]--
	e := s.entries[r.id]
	if e == nil {
		return // finished before: a hedge that lost, or an entry given up
	}
	cancel, current := e.running[r.seq]
	if !current {
		// An abandoned delivery: only news that the entry is finished matters.
		if r.outcome != outcomeRetry {
			s.remove(e)
		}
		return
	}
	cancel()
	delete(e.running, r.seq)
	switch r.outcome {
	case outcomeDone, outcomeLost:
		s.remove(e)
	case outcomeRetry:
		e.attempts = max(e.attempts, r.attempts)
		e.step = laterStep(e.step, r.step)
		if r.lastErr != "" {
			e.lastErr = r.lastErr
		}
		if e.queued || !s.mayRunAnother(e) {
			return // already rescheduled, or the delivery still in flight decides
		}
		if len(e.running) == 0 {
			e.started = e.attempts
		}
		// With a delivery still in flight (a slow one, since this job was its hedge
		// or the other is), the retry does not wait for it.
		e.failedAt = time.Now()
		e.due = e.failedAt.Add(s.w.backoff(e.attempts, s.receiver.healthy()))
		e.queued = true
		heap.Push(&s.delayed, e)
	}
}

// observe feeds one delivery's outcome to the limit and applies what it decides.
// The limit was put to the test when jobs wait for a slot or fill a lane.
func (s *scheduler) observe(k outcomeKind, took time.Duration) {
	busy := false
	for l := range s.ready {
		busy = busy || len(s.ready[l]) > 0 || s.inflight[l] >= s.bound[l]
	}
	if d := s.limit.observe(k, took, busy); d != limitKept {
		s.setBounds()
	}
}

// setBounds sets the lanes' bounds from the limit, and the limit's gauge (the sum
// over the activity's workers).
func (s *scheduler) setBounds() {
	first := s.limit.current()
	s.w.m.limit.Add(float64(first - s.bound[laneFirst]))
	s.bound = [2]int{first, s.w.cfg.retryBound(first)}
}

// remove forgets e, cancelling any job of it still in flight; it no longer counts
// among the failing deliveries (Config.Health).
func (s *scheduler) remove(e *entry) {
	if e.removed {
		return
	}
	e.removed = true
	s.w.cfg.Health.finished(e.id)
	for _, cancel := range e.running {
		cancel()
	}
	delete(s.entries, e.id)
	s.w.release(1)
}

// probeWhenIdle keeps a worker that judges the balance system down from waiting out
// long delays on an old verdict: the verdict changes only with answers, and a worker
// with nothing in flight and nothing ready gets none. Then the entry due first is
// brought forward to BackoffBase after the latest answer (a probe, one at a time);
// if the balance system answers it with a 2xx, the other entries are brought
// forward as on recovery (bringForward). During an outage this costs one delivery
// per BackoffBase, of the entry due first.
func (s *scheduler) probeWhenIdle() {
	if s.delayed.Len() == 0 || s.receiver.healthy() || s.inflight[laneFirst]+s.inflight[laneRetry] > 0 ||
		len(s.ready[laneFirst])+len(s.ready[laneRetry]) > 0 {
		return
	}
	e := s.delayed[0]
	if e.step != stepDeliver {
		return
	}
	if at := s.answered.Add(s.w.cfg.BackoffBase); e.due.After(at) {
		e.due = at // still the earliest: the heap's order holds
		e.probe = true
	}
}

// bringForward shortens the delays of the entries waiting to retry a delivery to
// what they would have been had the balance system been healthy when they failed:
// it is healthy again, so the long waits of an outage no longer serve a purpose.
func (w *Worker) bringForward(delayed *entryHeap) {
	changed := false
	for _, e := range *delayed {
		if e.step != stepDeliver {
			continue
		}
		if due := e.failedAt.Add(w.backoff(e.attempts, true)); due.Before(e.due) {
			e.due = due
			changed = true
		}
	}
	if changed {
		heap.Init(delayed)
	}
}

// jobFor prepares the next attempt at e, or a hedge of the one in flight.
func (w *Worker) jobFor(e *entry, l lane, now time.Time, hedge bool) job {
	j := job{id: e.id, entry: e.entry, undeliverable: e.undeliverable(), lane: l, step: e.step,
		attempts: e.attempts, lastErr: e.lastErr}
	if e.step == stepDeliver && j.undeliverable == nil {
		if e.fresh && !hedge {
			e.fresh = false
		} else {
			j.claim = true
			j.attempts = e.started
			j.minIdle = w.leaseIdle(e, now)
			e.touched = now
			e.started++
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
	var held []store.HeldEntry
	for _, e := range entries {
		if now.Sub(e.touched) < w.cfg.ClaimIdle/3 {
			continue
		}
		stale = append(stale, e)
		held = append(held, store.HeldEntry{ID: e.id, MinIdle: w.leaseIdle(e, now)})
	}
	if len(held) == 0 {
		return nil
	}
	owned, err := w.stream.RefreshHeld(ctx, w.cfg.Group, w.cfg.Consumer, held)
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
		case len(e.running) == 0:
			lost = append(lost, e)
		}
	}
	return lost
}

// healthWindow is how many of the latest deliveries decide whether the balance
// system is healthy, and healthQuorum how many failures it takes at least to call it
// unhealthy.
const (
	healthWindow = 32
	healthQuorum = 5
)

// health is the outcome of the latest deliveries to the balance system. It is
// healthy while at most half of them failed, or fewer than healthQuorum: a few
// unlucky first deliveries do not make it unhealthy.
type health struct {
	failed [healthWindow]bool
	n      int // outcomes recorded, up to healthWindow
	next   int // where the next outcome goes
	fails  int // failures among the recorded outcomes
}

// record adds the outcome of one delivery, forgetting the oldest beyond the window.
func (h *health) record(ok bool) {
	if h.n == healthWindow {
		if h.failed[h.next] {
			h.fails--
		}
	} else {
		h.n++
	}
	h.failed[h.next] = !ok
	if !ok {
		h.fails++
	}
	h.next = (h.next + 1) % healthWindow
}

// healthy reports whether at most half of the recorded deliveries failed, or fewer
// than healthQuorum.
func (h *health) healthy() bool { return h.fails < healthQuorum || 2*h.fails <= h.n }

// pace is whether the latest deliveries were answered within their hedge delay: of
// the healthWindow deliveries started last (by job number) whose pace is known, how
// many went unanswered that long. A delivery's pace is known when it is answered
// within its delay (prompt) or when the delay runs out first (slow), so a slow one is
// known a hedge delay after the prompt ones started with it; ordering them by start,
// not by when they became known, keeps the slow ones of a burst from outnumbering its
// prompt ones once the burst has ended (or the lanes were cut), when nothing new
// starts and only the hedge delays of deliveries the balance system holds run out.
type pace struct {
	seqs []uint64 // ascending, at most healthWindow
	slow []bool   // by position in seqs
	n    int      // slow ones among them
}

// record adds the pace of delivery seq, forgetting the earliest started beyond the
// window; a delivery started before every one in a full window is ignored.
func (p *pace) record(seq uint64, slow bool) {
	if len(p.seqs) == healthWindow && seq < p.seqs[0] {
		return
	}
	i, found := slices.BinarySearch(p.seqs, seq)
	if found {
		return // known already
	}
	p.seqs = slices.Insert(p.seqs, i, seq)
	p.slow = slices.Insert(p.slow, i, slow)
	if slow {
		p.n++
	}
	if len(p.seqs) > healthWindow {
		if p.slow[0] {
			p.n--
		}
		p.seqs = slices.Delete(p.seqs, 0, 1)
		p.slow = slices.Delete(p.slow, 0, 1)
	}
}

// healthy reports whether at most half of the known deliveries went slow, or fewer
// than healthQuorum: the balance system is not slow for every delivery.
func (p *pace) healthy() bool { return p.n < healthQuorum || 2*p.n <= len(p.seqs) }

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
