package controllers

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/settlement"
)

// Reconciliation (对账) runs beside each source's settlement workers, on the elected
// operator: every ReconcileInterval, and at once when a deletion asks
// (ReconcileSoon), settlement.Reconciler compares the source's ledger with the
// balance system's book, delivers again what the book lacks and names what it holds
// that the operator never paid. The last round's result is kept per UID in the
// settlement registry (SettlementRunner), read by the controllers for the Reconciled
// condition and the deletion's wait, and exported as
// redpacket_reconciliation_mismatch{source,kind}.

// DefaultReconcileInterval is how often a source is reconciled when nothing asks
// sooner.
const DefaultReconcileInterval = 5 * time.Minute

// firstReconcileDelay is how long after its workers start a source is first
// reconciled, when its interval is longer and nothing asks sooner.
const firstReconcileDelay = 30 * time.Second

// reconcileRoundTimeout bounds one round: a source of a million credits compares
// key by key well within it.
const reconcileRoundTimeout = 10 * time.Minute

// reconciliationMismatch is redpacket_reconciliation_mismatch{source,kind}: per
// source ("rpa/<namespace>/<name>" for an activity, "rpb/<namespace>/<name>" for a
// budget), the last round's count of each kind of difference
// (settlement.Reconciliation.Mismatches).
var reconciliationMismatch = func() *prometheus.GaugeVec {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "redpacket", Name: "reconciliation_mismatch",
		Help: "Credits on which the operator's ledger and the balance system's book disagree, by kind (missing: paid and not booked " +
			"after a re-delivery; parked: paid and waiting in the dead letters; unpaid: booked and never paid; differing: booked " +
			"with another user, amount or kind), as of the source's last reconciliation."},
		[]string{"source", "kind"})
	metrics.Registry.MustRegister(g)
	return g
}()

// reconcileState is one source's reconciliation as its loop last left it.
type reconcileState struct {
	source string
	last   settlement.Reconciliation
	err    error
	// done is true once a round finished, with a result or an error.
	done bool
	kick chan struct{}
	// askedAt is when a deletion first asked for a round (reconciledForDeletion).
	askedAt time.Time
}

// reconcilerRegistry holds each running source's reconcileState.
type reconcilerRegistry struct {
	mu     sync.Mutex
	states map[types.UID]*reconcileState
}

func (g *reconcilerRegistry) state(uid types.UID, source string) *reconcileState {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.states == nil {
		g.states = map[types.UID]*reconcileState{}
	}
	s := g.states[uid]
	if s == nil {
		s = &reconcileState{source: source, kick: make(chan struct{}, 1)}
		g.states[uid] = s
	}
	return s
}

// forget drops the source's state and its metric series.
func (g *reconcilerRegistry) forget(uid types.UID) {
	g.mu.Lock()
	s := g.states[uid]
	delete(g.states, uid)
	g.mu.Unlock()
	if s != nil {
		reconciliationMismatch.DeletePartialMatch(prometheus.Labels{"source": s.source})
	}
}

// Reconciliation is the source's last reconciliation: ok is false before its first
// round finished; err is set when that round could not compare.
func (g *reconcilerRegistry) Reconciliation(uid types.UID) (last settlement.Reconciliation, err error, ok bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	s := g.states[uid]
	if s == nil || !s.done {
		return settlement.Reconciliation{}, nil, false
	}
	return s.last, s.err, true
}

// ReconcileSoon asks the source's loop for a round now.
func (g *reconcilerRegistry) ReconcileSoon(uid types.UID) {
	g.mu.Lock()
	s := g.states[uid]
	g.mu.Unlock()
	if s == nil {
		return
	}
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// reconciledForDeletion says whether a deleted source, its settlement drained, may
// let its keys go as far as reconciliation goes: once a round that started after
// the deletion first asked found the books agreeing, or found that the balance
// system has no read endpoint. The first call asks for a round at once. Otherwise
// it says why the deletion waits; differ is true when the books differ (a person
// must look, or the platform team abandon), false while a round is awaited.
func (g *reconcilerRegistry) reconciledForDeletion(uid types.UID, now time.Time) (ok, differ bool, why string) {
	g.mu.Lock()
	s := g.states[uid]
	if s == nil {
		g.mu.Unlock()
		return false, false, "its reconciliation with the balance system has not started"
	}
	if s.askedAt.IsZero() {
		s.askedAt = now
		g.mu.Unlock()
		g.ReconcileSoon(uid)
		return false, false, "it waits for a reconciliation with the balance system"
	}
	last, err, done, asked := s.last, s.err, s.done, s.askedAt
	g.mu.Unlock()
	switch {
	case !done || last.At.Before(asked):
		return false, false, "it waits for a reconciliation with the balance system"
	case err != nil:
		g.ReconcileSoon(uid)
		return false, false, fmt.Sprintf("its reconciliation with the balance system failed: %v", err)
	case last.Outcome == settlement.ReconcileAgreed, last.Outcome == settlement.ReconcileUnsupported:
		return true, false, ""
	case last.Outcome == settlement.ReconcileDiffers:
		return false, true, "the balance system's book differs from what the operator paid: " + last.String()
	default:
		g.ReconcileSoon(uid)
		return false, false, "its reconciliation waits for settlement to finish delivering"
	}
}

// run reconciles the source every interval, and when asked, until ctx ends.
func (g *reconcilerRegistry) run(ctx context.Context, uid types.UID, source string, rc *settlement.Reconciler, every time.Duration, log *slog.Logger) {
	s := g.state(uid, source)
	// The first round comes a little after the workers start (nothing is paid
	// before), or as soon as a deletion asks.
	select {
	case <-ctx.Done():
		return
	case <-s.kick:
	case <-time.After(min(every, firstReconcileDelay)):
	}
	for {
		rctx, cancel := context.WithTimeout(ctx, reconcileRoundTimeout)
		r, err := rc.Reconcile(rctx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		g.mu.Lock()
		s.last, s.err, s.done = r, err, true
		g.mu.Unlock()
		if err != nil {
			log.Warn("reconciling with the balance system failed", "source", source, "err", err)
		} else {
			for kind, n := range r.Mismatches() {
				reconciliationMismatch.WithLabelValues(source, kind).Set(float64(n))
			}
			if r.Outcome == settlement.ReconcileDiffers || r.Redelivered > 0 {
				log.Warn("reconciled with the balance system", "source", source, "outcome", r.Outcome, "result", r.String())
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-s.kick:
		case <-time.After(every):
		}
	}
}

// reconciliationView is a source's last reconciliation as one reconcile read it.
type reconciliationView struct {
	last settlement.Reconciliation
	err  error
	ok   bool
}

// viewOf reads the source's last reconciliation.
func (g *reconcilerRegistry) viewOf(uid types.UID) *reconciliationView {
	last, err, ok := g.Reconciliation(uid)
	return &reconciliationView{last: last, err: err, ok: ok}
}

// newDifference reports whether the view holds a difference that the stored
// Reconciled condition does not say yet: a Warning event BooksDiffer is due.
func (v *reconciliationView) newDifference(stored []metav1.Condition) bool {
	if v == nil || !v.ok || v.err != nil || v.last.Outcome != settlement.ReconcileDiffers {
		return false
	}
	c := meta.FindStatusCondition(stored, redpacketv1alpha1.ConditionReconciled)
	return c == nil || c.Reason != redpacketv1alpha1.ReasonBooksDiffer || c.Message != boundedMessage(v.last.String())
}

// boundedMessage bounds a condition's message.
func boundedMessage(m string) string {
	if len(m) > 1024 {
		return m[:1021] + "..."
	}
	return m
}

// reconciledCondition sets Reconciled from the source's last reconciliation: True
// when the books agree, False with the difference, Unknown while settlement is in
// flight, before the first round, when a round failed, or when the balance system
// has no read endpoint. Without a webhook the condition goes.
func reconciledCondition(conds *[]metav1.Condition, generation int64, hasWebhook bool, last settlement.Reconciliation, err error, ok bool) (changed bool) {
	const condType = redpacketv1alpha1.ConditionReconciled
	if !hasWebhook {
		return meta.RemoveStatusCondition(conds, condType)
	}
	c := metav1.Condition{Type: condType, ObservedGeneration: generation}
	switch {
	case !ok:
		c.Status, c.Reason, c.Message = metav1.ConditionUnknown, redpacketv1alpha1.ReasonReconciliationPending,
			"the operator has not compared its ledger with the balance system's book yet"
	case err != nil:
		c.Status, c.Reason, c.Message = metav1.ConditionUnknown, redpacketv1alpha1.ReasonReconciliationFailed,
			fmt.Sprintf("the last comparison with the balance system's book failed: %v", err)
	default:
		c.Message = last.String()
		switch last.Outcome {
		case settlement.ReconcileAgreed:
			c.Status, c.Reason = metav1.ConditionTrue, redpacketv1alpha1.ReasonBooksAgree
		case settlement.ReconcileDiffers:
			c.Status, c.Reason = metav1.ConditionFalse, redpacketv1alpha1.ReasonBooksDiffer
		case settlement.ReconcileUnsupported:
			c.Status, c.Reason = metav1.ConditionUnknown, redpacketv1alpha1.ReasonReconciliationUnsupported
		default:
			c.Status, c.Reason = metav1.ConditionUnknown, redpacketv1alpha1.ReasonSettlementInFlight
		}
	}
	c.Message = boundedMessage(c.Message)
	return meta.SetStatusCondition(conds, c)
}
