package settlement

import (
	"fmt"
	"testing"
	"time"
)

// round is a run of identical outcomes fed to a limiter.
type round struct {
	n    int
	kind outcomeKind
	took time.Duration
	busy bool
}

// The controller's decisions as data: a start, a floor and a ceiling, the outcomes
// fed in order, and the limit and phase they must leave.
func TestLimiterDecisions(t *testing.T) {
	ms := time.Millisecond
	ok := func(n int, took time.Duration) round { return round{n: n, kind: deliveredOK, took: took, busy: true} }
	idle := func(n int) round { return round{n: n, kind: deliveredOK, took: ms} }
	fail := func(n int) round { return round{n: n, kind: deliveryFailed, busy: true} }
	tests := []struct {
		name                  string
		start, floor, ceiling int
		feed                  []round
		want                  int
		wantSlowStart         bool
	}{
		{"nothing seen keeps the start", 8, 2, 64, nil, 8, true},
		{"the start is clamped into the bounds", 100, 2, 64, nil, 64, true},
		{"the start is clamped up to the floor", 1, 4, 64, nil, 4, true},
		{"slow start: one more per prompt 2xx while the limit is used", 8, 2, 64, []round{ok(10, ms)}, 18, true},
		{"slow start stops at the ceiling", 8, 2, 20, []round{ok(100, ms)}, 20, true},
		{"no growth while the limit is not used", 8, 2, 64, []round{idle(200)}, 8, true},
		{"most of a round failing halves the limit", 40, 2, 64, []round{fail(64)}, 20, false},
		{"failures of a round whose limit was not used still cut", 40, 2, 64, []round{fail(33), idle(31)}, 20, false},
		// 32 failed of 64 is not more than half: the round passes, and its 2xx
		// answers grew the limit in slow start.
		{"half failing is not most", 8, 2, 64, []round{fail(32), ok(32, ms)}, 40, true},
		{"30 % failing at random still grows", 8, 2, 64, []round{fail(3), ok(7, ms), fail(3), ok(7, ms), fail(3), ok(7, ms),
			fail(3), ok(7, ms), fail(3), ok(7, ms), fail(3), ok(7, ms), ok(4, ms)}, 54, true},
		{"a cut never goes below the floor", 8, 6, 64, []round{fail(64)}, 6, false},
		{"repeated cuts end at the floor", 64, 2, 64, []round{fail(64), fail(64), fail(64), fail(64), fail(64), fail(64)}, 2, false},
		{"one cut per round, however many failures", 64, 2, 64, []round{fail(63)}, 64, true},
		{"after a cut, one more per round of prompt answers", 40, 2, 64, []round{fail(64), ok(64, ms), ok(64, ms)}, 22, false},
		{"after a cut, no growth for a round that did not use the limit", 40, 2, 64, []round{fail(64), idle(64)}, 20, false},
		// Baseline 1 ms from the first round (which grew the limit to 72); answers of
		// 20 ms are slower than 2× and 10 ms above it, answers of 10 ms are not.
		{"markedly slower answers cut by a quarter", 8, 2, 200, []round{ok(64, ms), ok(72, 20*ms)}, 54, false},
		{"slower but within the slack is prompt", 8, 2, 200, []round{ok(64, ms), ok(72, 10*ms)}, 144, true},
		{"fixed bounds never move", 8, 8, 8, []round{ok(100, ms), fail(128)}, 8, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l := newLimiter(tc.start, tc.floor, tc.ceiling)
			for _, r := range tc.feed {
				for range r.n {
					l.observe(r.kind, r.took, r.busy)
				}
			}
			if got := l.current(); got != tc.want || l.slowStart != tc.wantSlowStart {
				t.Errorf("limit %d (slow start %v), want %d (slow start %v)", got, l.slowStart, tc.want, tc.wantSlowStart)
			}
			if got := l.current(); got < max(tc.floor, 1) || got > max(tc.ceiling, tc.floor) {
				t.Errorf("limit %d outside [%d, %d]", got, tc.floor, tc.ceiling)
			}
		})
	}
}

// What a round's judgement decides, as data: the outcomes of one round of 64 at a
// limit of 64 after slow start, with a baseline of 2 ms.
func TestLimiterRoundJudgement(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		failed    int
		took      time.Duration
		busy      bool
		want      limitDecision
		wantLimit int
	}{
		{0, 2 * ms, true, limitGrew, 65},
		{0, 2 * ms, false, limitKept, 64},
		{20, 2 * ms, true, limitGrew, 65},
		{32, 2 * ms, true, limitGrew, 65},
		{33, 2 * ms, true, limitCutFails, 32},
		{64, 2 * ms, false, limitCutFails, 32},
		{0, 12 * ms, true, limitGrew, 65},
		{0, 13 * ms, true, limitCutSlow, 48},
		{40, 13 * ms, true, limitCutFails, 32},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%d failed %s busy %v", tc.failed, tc.took, tc.busy), func(t *testing.T) {
			l := newLimiter(64, 2, 128)
			l.slowStart, l.baseline = false, 2*ms
			var got limitDecision
			for i := range 64 {
				k, took := deliveredOK, tc.took
				if i < tc.failed {
					k, took = deliveryFailed, 0
				}
				got = l.observe(k, took, tc.busy)
				if i < 63 && got != limitKept {
					t.Fatalf("decision %s within the round, at outcome %d", got, i)
				}
			}
			if got != tc.want || l.current() != tc.wantLimit {
				t.Errorf("decided %s, limit %d; want %s, limit %d", got, l.current(), tc.want, tc.wantLimit)
			}
		})
	}
}

// The baseline follows the best round down at once and slower rounds up slowly, so a
// balance system slower for good stops cutting the limit after a while.
func TestLimiterBaselineDrifts(t *testing.T) {
	ms := time.Millisecond
	l := newLimiter(32, 2, 64)
	for range limitMinRound {
		l.observe(deliveredOK, 4*ms, false)
	}
	if l.baseline != 4*ms {
		t.Fatalf("baseline %s after a round of 4ms, want 4ms", l.baseline)
	}
	for range limitMinRound {
		l.observe(deliveredOK, 2*ms, false)
	}
	if l.baseline != 2*ms {
		t.Fatalf("baseline %s after a faster round, want 2ms", l.baseline)
	}
	cuts := 0
	for range 200 {
		if l.judgeAfter(limitMinRound, deliveredOK, 20*ms) == limitCutSlow {
			cuts++
		}
	}
	if cuts == 0 || cuts > 60 {
		t.Errorf("%d cuts in 200 rounds at 20ms against a 2ms baseline; want some, then none", cuts)
	}
	if d := l.judgeAfter(limitMinRound, deliveredOK, 20*ms); d == limitCutSlow {
		t.Errorf("still cutting after 200 rounds at 20ms (baseline %s)", l.baseline)
	}
}

// judgeAfter feeds n outcomes of kind, as a round of a used limit, and returns the
// last decision.
func (l *limiter) judgeAfter(n int, k outcomeKind, took time.Duration) limitDecision {
	var d limitDecision
	for range n {
		d = l.observe(k, took, true)
	}
	return d
}
