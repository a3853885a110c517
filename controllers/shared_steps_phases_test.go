package controllers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ranStep is a step of either kind that records its name in ran and answers res and
// err; set, when not nil, runs first (a step that writes the scope itself).
func ranStep[S scoped](ran *[]string, name string, keepGoing bool, res stepResult, err error, set func(*reconcileScope)) step[S] {
	return step[S]{name: name, keepGoing: keepGoing, run: func(_ context.Context, s S) (stepResult, error) {
		*ran = append(*ran, name)
		if set != nil {
			set(s.shared())
		}
		return res, err
	}}
}

// runnerCase is one chain, run on an activity's scope and on a budget's.
type runnerCase struct {
	name  string
	steps []chainStep
	rule  []blockerRule

	wantRan     string
	wantErr     string
	wantRequeue time.Duration
	wantBlocker string
	wantHalted  bool
	wantFinal   bool
	wantClean   bool
}

// runBoth runs tc's chain on both kinds' scopes and checks each.
func runBoth(t *testing.T, tc runnerCase) {
	t.Helper()
	check := func(t *testing.T, ran []string, sc *reconcileScope, res time.Duration, err error) {
		t.Helper()
		if got := strings.Join(ran, ""); got != tc.wantRan {
			t.Errorf("steps run %q, want %q", got, tc.wantRan)
		}
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("error %v, want none", err)
		case tc.wantErr != "" && (err == nil || err.Error() != tc.wantErr):
			t.Errorf("error %v, want %q", err, tc.wantErr)
		}
		if err == nil && res != tc.wantRequeue {
			t.Errorf("requeue %s, want %s", res, tc.wantRequeue)
		}
		got := ""
		if sc.notReady != nil {
			got = sc.notReady.reason
		}
		if got != tc.wantBlocker {
			t.Errorf("Ready's blocker %q, want %q", got, tc.wantBlocker)
		}
		if sc.halted != tc.wantHalted || sc.final != tc.wantFinal {
			t.Errorf("halted %t final %t, want %t %t", sc.halted, sc.final, tc.wantHalted, tc.wantFinal)
		}
		if c := sc.clean(err); c != tc.wantClean {
			t.Errorf("clean %t, want %t", c, tc.wantClean)
		}
	}
	t.Run("activity", func(t *testing.T) {
		var ran []string
		var steps []reconcileStep
		for _, st := range tc.steps {
			steps = append(steps, ranStep[*activityScope](&ran, st.name, st.keepGoing, st.res, st.err, st.set))
		}
		s := newActivityScope(testActivity(), testNow)
		res, err := runSteps(context.Background(), s, steps, tc.rule...)
		check(t, ran, &s.reconcileScope, res.RequeueAfter, err)
	})
	t.Run("budget", func(t *testing.T) {
		var ran []string
		var steps []budgetStep
		for _, st := range tc.steps {
			steps = append(steps, ranStep[*budgetScope](&ran, st.name, st.keepGoing, st.res, st.err, st.set))
		}
		s := newBudgetScope(phaseBudget(), testNow)
		res, err := runSteps(context.Background(), s, steps, tc.rule...)
		check(t, ran, &s.reconcileScope, res.RequeueAfter, err)
	})
}

// chainStep is a step of a runnerCase: its name, whether it keeps going, what it
// answers, and what it sets on the scope itself first.
type chainStep struct {
	name      string
	keepGoing bool
	res       stepResult
	err       error
	set       func(*reconcileScope)
}

// The one runner settles what the activity's and the budget's runners did
// differently, for both kinds alike: which blocker Ready shows (the one option),
// that an error does not mark the scope halted, that only a halt of a step that
// stops the chain is final, and that a step may end the chain as done.
func TestRunStepsSettledDifferences(t *testing.T) {
	errDown := errors.New("redis down")
	sideIssue := stepResult{blocker: notReady("NotAdopted", "someone else's")}
	moneyIssue := stepResult{blocker: notReady("RedisUnavailable", "down")}
	deleting := func(s *reconcileScope) { s.notReady = notReady("Deleting", "deleting") }
	cases := []runnerCase{
		{
			name:    "latest blocker (the default, the activity's): a later step's blocker replaces a keepGoing step's",
			steps:   []chainStep{{name: "a", keepGoing: true, res: sideIssue}, {name: "b", res: moneyIssue}},
			wantRan: "ab", wantBlocker: "RedisUnavailable", wantClean: true,
		},
		{
			name:    "earliest blocker (the budget's): a keepGoing step's blocker stays",
			steps:   []chainStep{{name: "a", keepGoing: true, res: sideIssue}, {name: "b", res: moneyIssue}},
			rule:    []blockerRule{earliestBlocker},
			wantRan: "ab", wantBlocker: "NotAdopted", wantClean: true,
		},
		{
			name: "earliest blocker: one a step set on the scope itself stays when a later step fails",
			steps: []chainStep{{name: "a", set: deleting},
				{name: "b", res: blocked("RedisUnavailable", "down"), err: errDown}, {name: "c"}},
			rule:    []blockerRule{earliestBlocker},
			wantRan: "ab", wantErr: "b: redis down", wantBlocker: "Deleting",
		},
		{
			name: "latest blocker: the failing step's blocker replaces one set before",
			steps: []chainStep{{name: "a", set: deleting},
				{name: "b", res: blocked("RedisUnavailable", "down"), err: errDown}, {name: "c"}},
			wantRan: "ab", wantErr: "b: redis down", wantBlocker: "RedisUnavailable",
		},
		{
			name:    "an error stops the chain without marking it halted; the reconcile is not clean",
			steps:   []chainStep{{name: "a", res: stepResult{requeueAfter: time.Second}}, {name: "b", err: errDown}, {name: "c"}},
			wantRan: "ab", wantErr: "b: redis down",
		},
		{
			name:    "a keepGoing step's error does not mark it halted either; it is returned after the chain",
			steps:   []chainStep{{name: "a", keepGoing: true, err: errDown}, {name: "b", res: stepResult{requeueAfter: time.Second}}},
			wantRan: "ab", wantErr: "a: redis down",
		},
		{
			name: "a final halt stops the chain and keeps the reconcile clean",
			steps: []chainStep{{name: "a", res: stepResult{halt: true, final: true, requeueAfter: time.Minute,
				blocker: notReady("DataLost", "gone")}}, {name: "b"}},
			wantRan: "a", wantRequeue: time.Minute, wantBlocker: "DataLost", wantHalted: true, wantFinal: true, wantClean: true,
		},
		{
			name:    "a keepGoing step's halt is never final: the chain goes on, the reconcile is not clean",
			steps:   []chainStep{{name: "a", keepGoing: true, res: stepResult{halt: true, final: true}}, {name: "b"}},
			wantRan: "ab", wantHalted: true,
		},
		{
			name:    "a halt that is not final leaves the reconcile not clean",
			steps:   []chainStep{{name: "a", res: stepResult{halt: true}}, {name: "b"}},
			wantRan: "a", wantHalted: true,
		},
		{
			name: "done ends the chain without a halt, with its requeue; the reconcile stays clean",
			steps: []chainStep{{name: "a", res: stepResult{requeueAfter: time.Hour}},
				{name: "b", res: stepResult{done: true, requeueAfter: 2 * time.Second}}, {name: "c"}},
			wantRan: "ab", wantRequeue: 2 * time.Second, wantClean: true,
		},
	}
	for i, tc := range cases {
		t.Run(fmt.Sprintf("%d %s", i, tc.name), func(t *testing.T) { runBoth(t, tc) })
	}
}

// setCondition is one for both kinds: it writes into the kind's status, with the
// resource's generation and the reconcile's clock to the second.
func TestSetConditionOnBothKinds(t *testing.T) {
	a := testActivity()
	a.Generation = 7
	as := newActivityScope(a, testNow.Add(400*time.Millisecond))
	as.setCondition("Ready", "True", "Why", "n=%d", 1)
	b := phaseBudget()
	b.Generation = 9
	bs := newBudgetScope(b, testNow.Add(400*time.Millisecond))
	bs.setCondition("Ready", "False", "WhyNot", "n=%d", 2)
	for _, tc := range []struct {
		kind      string
		got       []string
		wantGen   int64
		wantShown string
	}{
		{"activity", condStrings(as.status.Conditions), 7, "Ready=True/Why n=1"},
		{"budget", condStrings(bs.status.Conditions), 9, "Ready=False/WhyNot n=2"},
	} {
		if len(tc.got) != 1 || tc.got[0] != fmt.Sprintf("%s gen=%d at=%s", tc.wantShown, tc.wantGen, testNow.Truncate(time.Second).UTC().Format(time.RFC3339)) {
			t.Errorf("%s conditions %q", tc.kind, tc.got)
		}
	}
}

// condStrings shows each condition as "Type=Status/Reason message gen=G at=T".
func condStrings(conds []metav1.Condition) []string {
	var out []string
	for _, c := range conds {
		out = append(out, fmt.Sprintf("%s=%s/%s %s gen=%d at=%s", c.Type, c.Status, c.Reason, c.Message,
			c.ObservedGeneration, c.LastTransitionTime.UTC().Format(time.RFC3339)))
	}
	return out
}
