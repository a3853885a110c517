package controllers

import (
	"context"
	"errors"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"

	"redpacket.io/operator/store/redisconn"
)

// reconcileScope is the part of one reconcile's scope that every kind shares: the
// clock, the conditions of the status to apply, why Ready is False and why the
// resource is Stalled, the Redis connection, and how the chain of steps ended. Each
// kind's scope (activityScope, budgetScope) embeds it next to its own status and what
// its steps learn from Redis.
type reconcileScope struct {
	// object is the resource reconciled: its generation is every condition's
	// observedGeneration.
	object metav1.Object
	// conditions are the conditions of the status to apply, inside the kind's scope.
	conditions *[]metav1.Condition
	// now is the controller's clock when the reconcile started.
	now time.Time

	// notReady, when set, is why Ready is False whatever else the status says: a
	// step's blocker (runSteps), or one a step set itself.
	notReady *readyBlocker
	// stalled, when set, is why the resource cannot go on without a person: the
	// Stalled condition is True with its reason, and absent otherwise.
	stalled *readyBlocker

	// conn is the resource's Redis connection, once the Redis connection step
	// resolved it.
	conn redisconn.Conn
	// snapshotRead is true once the kind's snapshot holds what Redis said in this
	// reconcile.
	snapshotRead bool

	// halted is true once a step stopped the chain, or a keepGoing step halted,
	// without an error. A halted reconcile does not observe the generation, unless
	// final is set too.
	halted bool
	// final is true when the step that stopped the chain reached a final outcome for
	// this spec (an activity's DataLost, RedisRolledBack): nothing will change
	// without a person, so the generation counts as observed.
	final bool
	// released is true once the deletion let the resource go (the finalizer is being
	// removed): it is no longer the controller's, and no status is applied.
	released bool
}

// newReconcileScope is the shared part of a scope of obj, whose status to apply
// holds conditions.
func newReconcileScope(obj metav1.Object, conditions *[]metav1.Condition, now time.Time) reconcileScope {
	return reconcileScope{object: obj, conditions: conditions, now: now}
}

// shared returns the shared part of a kind's scope (runSteps reaches it so).
func (s *reconcileScope) shared() *reconcileScope { return s }

// setCondition sets one of the controller's conditions on the status to apply, with
// the resource's generation and the reconcile's clock (to the second).
func (s *reconcileScope) setCondition(condType string, status metav1.ConditionStatus, reason, format string, args ...any) {
	meta.SetStatusCondition(s.conditions, metav1.Condition{
		Type:               condType,
		Status:             status,
		Reason:             reason,
		Message:            fmt.Sprintf(format, args...),
		ObservedGeneration: s.object.GetGeneration(),
		LastTransitionTime: metav1.NewTime(s.now.Truncate(time.Second)),
	})
}

// clean reports whether the reconcile that ended with err counts as observing the
// generation: no error, and no step halted unless its halt was final.
func (s *reconcileScope) clean(err error) bool {
	return err == nil && (!s.halted || s.final)
}

// readyBlocker is why Ready is False whatever the phase says.
type readyBlocker struct {
	reason  string
	message string
}

// notReady returns a blocker with reason and a formatted message.
func notReady(reason, format string, args ...any) *readyBlocker {
	return &readyBlocker{reason: reason, message: fmt.Sprintf(format, args...)}
}

// stepResult is what one step of a reconcile decided, besides an error: when to look
// at the resource again, whether the chain stops here, and why Ready is False. An
// error stops the chain too (the request is retried with backoff); the result's
// blocker still says why Ready is False.
type stepResult struct {
	// requeueAfter asks to reconcile again this soon; 0 asks nothing. The soonest
	// any step asked for wins.
	requeueAfter time.Duration
	// halt stops the chain after this step: the step could not do its part, and no
	// later step can make sense yet. A halted reconcile does not observe the
	// generation.
	halt bool
	// blocker, when set, makes Ready False with its reason, whatever the phase says.
	blocker *readyBlocker
	// final marks a halt that is the final outcome for this spec: the generation is
	// still observed.
	final bool
	// done ends the chain after this step without a halt: the step settled what this
	// reconcile does (a deletion that holds, waits for settlement or let the resource
	// go), so the later steps have nothing to do, and the reconcile stays clean.
	done bool
}

// blocked is the result of a step that could not do its part: Ready is False with
// reason and message, and the chain halts.
func blocked(reason, format string, args ...any) stepResult {
	return stepResult{halt: true, blocker: notReady(reason, format, args...)}
}

// step is one step of a reconcile of the kind whose scope is S.
type step[S any] struct {
	name string
	run  func(context.Context, S) (stepResult, error)
	// keepGoing lets the later steps run when this one fails or halts: its failure
	// must never hold up what comes after (an activity's closing and refunding, a
	// budget's status and expiry). Its blocker still makes Ready False, its error is
	// still returned (after the chain), and the reconcile is not clean.
	keepGoing bool
}

// reconcileStep is one step of an activity's reconcile.
type reconcileStep = step[*activityScope]

// budgetStep is one step of a budget's reconcile.
type budgetStep = step[*budgetScope]

// scoped is a kind's scope: it embeds reconcileScope.
type scoped interface {
	shared() *reconcileScope
}

// blockerRule says which blocker Ready shows when several steps of one chain report
// one.
type blockerRule int

const (
	// latestBlocker: each step's blocker replaces the one before. The activity's
	// chain puts the steps whose blockers say most about its money (open and
	// configure, schedule and close, counters) after its keepGoing grab workload
	// steps, so the latest is the one to show.
	latestBlocker blockerRule = iota
	// earliestBlocker: the first blocker stays, whether a step reported it or set it
	// on the scope itself. The budget's chain puts its money steps (durability,
	// settlement, configure) before its keepGoing workload steps, and its deletion
	// says Deleting before the steps that may fail under it.
	earliestBlocker
)

// runSteps runs the steps of one reconcile in order; every step is idempotent.
// It is the one runner of both kinds:
//
//   - A step's blocker makes Ready False. Which of several blockers Ready shows is the
//     one setting that differs by kind, said by rule (latestBlocker when none is
//     given, as for activities; earliestBlocker for budgets).
//   - An error stops the chain and is retried with backoff, named by its step. It
//     does not mark the scope halted: the error alone makes the reconcile unclean.
//   - A halt stops the chain and marks the scope halted; a final halt marks it final
//     too (the generation is observed all the same). A step that is done stops the
//     chain without marking anything.
//   - A keepGoing step's error does not stop the chain: it is returned, joined with
//     any later one, once the chain has run. Its halt only marks the scope halted,
//     never final.
//   - The soonest requeue any step that did not fail asked for wins.
func runSteps[S scoped](ctx context.Context, s S, steps []step[S], rule ...blockerRule) (ctrl.Result, error) {
	keepFirst := len(rule) > 0 && rule[0] == earliestBlocker
	sc := s.shared()
	var requeue time.Duration
	var deferred []error
	for _, st := range steps {
		res, err := st.run(ctx, s)
		if res.blocker != nil && (!keepFirst || sc.notReady == nil) {
			sc.notReady = res.blocker
		}
		if err != nil {
			err = fmt.Errorf("%s: %w", st.name, err)
			if !st.keepGoing {
				return ctrl.Result{}, errors.Join(append(deferred, err)...)
			}
			deferred = append(deferred, err)
			continue
		}
		requeue = soonest(requeue, res.requeueAfter)
		if res.halt {
			sc.halted = true
			if st.keepGoing {
				continue
			}
			sc.final = res.final
			break
		}
		if res.done {
			break
		}
	}
	return ctrl.Result{RequeueAfter: requeue}, errors.Join(deferred...)
}
