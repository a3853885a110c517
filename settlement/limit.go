package settlement

import (
	"math"
	"time"
)

// The adaptive bound on deliveries in flight.
//
// A worker starts with Concurrency first deliveries in flight and adapts that limit
// to what the balance system bears, as TCP adapts its window (AIMD): while
// deliveries are answered with a 2xx promptly and the limit is used, it grows, by
// one per prompt 2xx at first (slow start: it doubles every round of deliveries)
// and, once it was cut, by one per round (additive increase); when the balance
// system fails most of a round's deliveries (an error answer, or none before the
// HTTP timeout) or answers them markedly slower than it did at its best, the limit
// is cut (multiplicative decrease), at most once a round. A delivery counts when its
// answer comes (or the timeout), before its entry is acknowledged, so the round holds
// the answers in the order the balance system gave them; one the balance system
// held, cancelled because its hedge won, does not count (its hedge does), so
// holding a few requests does not cut the limit, while
// a balance system too slow for hedging (which pauses then) shows in the latency of
// its answers and in its timeouts. It never leaves
// [MinConcurrency, MaxConcurrency], the bounds the platform sets. A round is as many
// delivery outcomes as the limit, and at least limitMinRound, so a few unlucky
// deliveries of a small round do not cut it: against a balance system that fails
// 30 % of the deliveries at random but answers them promptly the limit still grows.
//
// The controller only decides; the scheduler feeds it outcomes (observe) and reads
// the limit (current) for its lanes.

// Constants of the controller.
const (
	// limitMinRound is the fewest outcomes a round judges: with deliveries failing at
	// random 30 % of the time, more than half of a round of 64 fail less than once in
	// a thousand rounds.
	limitMinRound = 64
	// limitFailShare: more than this share of a round's deliveries failing cuts the
	// limit (the health check's threshold).
	limitFailShare = 0.5
	// limitFailCut is what the limit is multiplied by on failures.
	limitFailCut = 0.5
	// limitLatencyFactor and limitLatencySlack: a round whose answered deliveries took
	// on average more than factor × the best round's average, and more than slack
	// above it, cuts the limit by limitLatencyCut. The slack keeps the scheduling
	// noise of sub-millisecond answers from reading as a slower balance system.
	limitLatencyFactor = 2.0
	limitLatencySlack  = 10 * time.Millisecond
	limitLatencyCut    = 0.75
	// limitBaselineDrift is how fast the best round's average follows slower rounds
	// (1/drift of the gap per round): a balance system that became slower for good
	// is, after some rounds, the new normal rather than a reason to stay at the floor.
	limitBaselineDrift = 16
)

// outcomeKind is what one delivery came to, for the controller.
type outcomeKind int

const (
	deliveredOK    outcomeKind = iota // a 2xx answer
	deliveryFailed                    // another answer, or none before the timeout
)

// limitDecision is what a round's judgement did to the limit.
type limitDecision int

const (
	limitKept     limitDecision = iota
	limitGrew                   // additive increase at the round's end
	limitCutFails               // most deliveries failed
	limitCutSlow                // answers markedly slower than the best round
)

func (d limitDecision) String() string {
	switch d {
	case limitGrew:
		return "grew"
	case limitCutFails:
		return "cut_failures"
	case limitCutSlow:
		return "cut_latency"
	}
	return "kept"
}

// limiter is the AIMD controller of one worker. Its limit is always within [floor,
// ceiling]. Only the scheduling goroutine uses it.
type limiter struct {
	floor, ceiling int
	limit          float64
	slowStart      bool // no cut yet: grow by one per prompt 2xx
	// The current round.
	round        int // outcomes it judges (the limit when it began, at least limitMinRound)
	seen, failed int
	answered     int
	latencySum   time.Duration
	busy         bool // the limit was reached during the round: it was put to the test
	// baseline is the best round's average latency of 2xx answers, drifting towards
	// slower rounds (limitBaselineDrift); 0 until a round had an answer.
	baseline time.Duration
}

// newLimiter starts at start, within [floor, ceiling] (floor ≥ 1, ceiling ≥ floor).
func newLimiter(start, floor, ceiling int) *limiter {
	floor = max(floor, 1)
	ceiling = max(ceiling, floor)
	l := &limiter{floor: floor, ceiling: ceiling, limit: float64(min(max(start, floor), ceiling)), slowStart: true}
	l.newRound()
	return l
}

// current is the limit on first deliveries in flight.
func (l *limiter) current() int { return int(l.limit) }

func (l *limiter) newRound() {
	l.round = max(l.current(), limitMinRound)
	l.seen, l.failed, l.answered, l.latencySum, l.busy = 0, 0, 0, 0, false
}

// prompt reports whether an answer that took d is prompt: not markedly slower than
// the best round's average.
func (l *limiter) prompt(d time.Duration) bool {
	return l.baseline == 0 || !l.slowerThanBaseline(d)
}

func (l *limiter) slowerThanBaseline(d time.Duration) bool {
	return float64(d) > limitLatencyFactor*float64(l.baseline) && d > l.baseline+limitLatencySlack
}

// observe takes one delivery's outcome (took is how long a 2xx answer took); busy
// says whether the limit was reached when it ended (first deliveries were waiting
// for a slot, or all slots were taken). At the end of a round it judges the round
// and returns the decision; within a round it returns limitKept (slow start's
// growth aside, which returns limitGrew).
func (l *limiter) observe(k outcomeKind, took time.Duration, busy bool) limitDecision {
	l.seen++
	l.busy = l.busy || busy
	decision := limitKept
	switch k {
	case deliveredOK:
		l.answered++
		l.latencySum += took
		if l.slowStart && busy && l.prompt(took) && l.current() < l.ceiling {
			l.limit = min(l.limit+1, float64(l.ceiling))
			decision = limitGrew
		}
	default:
		l.failed++
	}
	if l.seen < l.round {
		return decision
	}
	return l.judge()
}

// judge ends the round: a cut when most deliveries failed or answers came markedly
// slower than the baseline, else one more slot after slow start when the limit was
// put to the test; then the baseline moves and a new round begins.
func (l *limiter) judge() limitDecision {
	decision := limitKept
	var mean time.Duration
	if l.answered > 0 {
		mean = l.latencySum / time.Duration(l.answered)
	}
	switch {
	case float64(l.failed) > limitFailShare*float64(l.seen):
		decision = limitCutFails
		l.limit = max(float64(l.floor), math.Floor(l.limit*limitFailCut))
		l.slowStart = false
	case l.answered > 0 && l.baseline > 0 && l.slowerThanBaseline(mean):
		decision = limitCutSlow
		l.limit = max(float64(l.floor), math.Floor(l.limit*limitLatencyCut))
		l.slowStart = false
	case !l.slowStart && l.busy && l.current() < l.ceiling:
		decision = limitGrew
		l.limit = min(l.limit+1, float64(l.ceiling))
	}
	if mean > 0 {
		switch {
		case l.baseline == 0 || mean < l.baseline:
			l.baseline = mean
		default:
			l.baseline += (mean - l.baseline) / limitBaselineDrift
		}
	}
	l.newRound()
	return decision
}
