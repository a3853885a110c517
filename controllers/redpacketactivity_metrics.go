package controllers

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// conditionStalled is the condition a fenced or DataLost activity carries (True, with
// the reason). The gauges treat its reason as an opaque, bounded string.
const conditionStalled = "Stalled"

// AllPhases lists every phase an activity can be in; the phase gauge has one series
// per phase and activity.
var AllPhases = []redpacketv1alpha1.Phase{
	redpacketv1alpha1.PhasePending, redpacketv1alpha1.PhaseSeeding, redpacketv1alpha1.PhaseScheduled,
	redpacketv1alpha1.PhaseActive, redpacketv1alpha1.PhasePaused, redpacketv1alpha1.PhaseExhausted,
	redpacketv1alpha1.PhaseExpired, redpacketv1alpha1.PhaseFailed,
}

// ActivityMetrics are the controller's per-activity gauges, read from the status the
// controller last saw of each activity. Their labels are the activity's namespace and
// name (and, for phase and stalled, a value from a small fixed set): never a user id.
// Money is in the currency's minor unit (fen, cents).
//
// They are exported only by the replica that holds the leader lease, since only it
// reconciles; a query that aggregates over replicas with max by (namespace, name)
// sees each activity once.
type ActivityMetrics struct {
	phase            *prometheus.GaugeVec
	ready            *prometheus.GaugeVec
	stalled          *prometheus.GaugeVec
	notPrewarmed     *prometheus.GaugeVec
	totalAmount      *prometheus.GaugeVec
	packets          *prometheus.GaugeVec
	remainingPackets *prometheus.GaugeVec
	remainingAmount  *prometheus.GaugeVec
	claimedPackets   *prometheus.GaugeVec
	claimedAmount    *prometheus.GaugeVec
	settledPackets   *prometheus.GaugeVec
	settledAmount    *prometheus.GaugeVec
	refundedAmount   *prometheus.GaugeVec
	deadLetters      *prometheus.GaugeVec
	conservation     *prometheus.GaugeVec
	redisImbalance   *prometheus.GaugeVec

	// mu orders observe and forget of one activity, so a forget that follows an
	// observe is never undone by it.
	mu sync.Mutex
}

// activityMetrics is the controller's instance, registered on controller-runtime's
// registry, which the manager serves at /metrics.
var activityMetrics = NewActivityMetrics(metrics.Registry)

// NewActivityMetrics creates the gauges and registers them with reg.
func NewActivityMetrics(reg prometheus.Registerer) *ActivityMetrics {
	activity := []string{"namespace", "name"}
	gauge := func(name, help string, labels ...string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "redpacket", Subsystem: "activity", Name: name, Help: help},
			append(append([]string{}, activity...), labels...))
	}
	m := &ActivityMetrics{
		phase:   gauge("phase", "1 for the activity's current phase, 0 for every other phase.", "phase"),
		ready:   gauge("ready", "1 while the activity's Ready condition is True, else 0."),
		stalled: gauge("stalled", "1 while the activity's Stalled condition is True (it cannot go on without a person: DataLost, RedisRolledBack), with the condition's reason; absent otherwise.", "reason"),
		notPrewarmed: gauge("not_prewarmed", "1 while the activity's Prewarmed condition is False with reason NotPrewarmed (startTime has come and fewer than "+
			"prewarm.replicas grab pods are available), 0 while it has another reason or is True; absent without prewarm."),
		totalAmount:      gauge("total_amount", "spec.totalAmount: the money split into packets, in minor units."),
		packets:          gauge("packets", "spec.count: the number of packets."),
		remainingPackets: gauge("remaining_packets", "status.remainingCount: packets not yet claimed."),
		remainingAmount:  gauge("remaining_amount", "status.remainingAmount: money not yet claimed or refunded, in minor units."),
		claimedPackets:   gauge("claimed_packets", "status.claimedCount: packets granted to users."),
		claimedAmount:    gauge("claimed_amount", "status.claimedAmount: money granted to users, in minor units."),
		settledPackets:   gauge("settled_packets", "status.settledCount: grants credited by the balance system."),
		settledAmount:    gauge("settled_amount", "status.settledAmount: money credited to users, in minor units."),
		refundedAmount:   gauge("refunded_amount", "status.refundedAmount: the unclaimed remainder returned to the sponsor at close, in minor units."),
		deadLetters:      gauge("dead_letters", "status.deadLetterCount: settlement deliveries parked after too many failures."),
		conservation: gauge("conservation_error", "totalAmount - (claimedAmount + remainingAmount + refundedAmount) from one status, in minor units; "+
			"must be 0. Exported only when all three status amounts are set."),
		redisImbalance: gauge("redis_imbalance", "Packets (unit=packets) or minor units (unit=amount) out of place in Redis, from a reading of every shard "+
			"while no packet moved between them: each open shard's listed plus claimed packets against its count, the shards' counts and totals "+
			"plus packets in transfer against the activity's, and after close claimed plus refunded against the total. Must be 0. "+
			"Set at every resync of a seeded activity.", "unit"),
	}
	reg.MustRegister(m.collectors()...)
	return m
}

func (m *ActivityMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.phase, m.ready, m.stalled, m.notPrewarmed, m.totalAmount, m.packets, m.remainingPackets,
		m.remainingAmount, m.claimedPackets, m.claimedAmount, m.settledPackets, m.settledAmount, m.refundedAmount,
		m.deadLetters, m.conservation, m.redisImbalance}
}

// Observe sets the activity's gauges from a (its spec and status as last seen). A
// status counter that is not set has no series.
func (m *ActivityMetrics) Observe(a *redpacketv1alpha1.RedPacketActivity) {
	m.mu.Lock()
	defer m.mu.Unlock()
	ns, name := a.Namespace, a.Name
	st := &a.Status

	for _, p := range AllPhases {
		v := 0.0
		if st.Phase == p {
			v = 1
		}
		m.phase.WithLabelValues(ns, name, string(p)).Set(v)
	}
	m.ready.WithLabelValues(ns, name).Set(boolGauge(meta.IsStatusConditionTrue(st.Conditions, redpacketv1alpha1.ConditionReady)))

	m.stalled.DeletePartialMatch(prometheus.Labels{"namespace": ns, "name": name})
	if c := meta.FindStatusCondition(st.Conditions, conditionStalled); c != nil && c.Status == metav1.ConditionTrue {
		m.stalled.WithLabelValues(ns, name, c.Reason).Set(1)
	}

	if c := meta.FindStatusCondition(st.Conditions, redpacketv1alpha1.ConditionPrewarmed); c != nil {
		short := c.Status == metav1.ConditionFalse && c.Reason == redpacketv1alpha1.ReasonNotPrewarmed
		m.notPrewarmed.WithLabelValues(ns, name).Set(boolGauge(short))
	} else {
		m.notPrewarmed.DeleteLabelValues(ns, name)
	}

	m.totalAmount.WithLabelValues(ns, name).Set(float64(a.Spec.TotalAmount))
	m.packets.WithLabelValues(ns, name).Set(float64(a.Spec.Count))
	setOptional(m.remainingPackets, ns, name, st.RemainingCount)
	setOptional(m.remainingAmount, ns, name, st.RemainingAmount)
	setOptional(m.claimedPackets, ns, name, st.ClaimedCount)
	setOptional(m.claimedAmount, ns, name, st.ClaimedAmount)
	setOptional(m.settledPackets, ns, name, st.SettledCount)
	setOptional(m.settledAmount, ns, name, st.SettledAmount)
	setOptional(m.refundedAmount, ns, name, st.RefundedAmount)
	setOptional(m.deadLetters, ns, name, st.DeadLetterCount)
	var conservation *int64
	if st.ClaimedAmount != nil && st.RemainingAmount != nil && st.RefundedAmount != nil {
		diff := a.Spec.TotalAmount - (*st.ClaimedAmount + *st.RemainingAmount + *st.RefundedAmount)
		conservation = &diff
	}
	setOptional(m.conservation, ns, name, conservation)
}

// ObserveImbalance sets the activity's Redis imbalance (reconcileConservation).
func (m *ActivityMetrics) ObserveImbalance(ns, name string, im store.Imbalance) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.redisImbalance.WithLabelValues(ns, name, "packets").Set(float64(im.Count))
	m.redisImbalance.WithLabelValues(ns, name, "amount").Set(float64(im.Amount))
}

// Forget deletes every series of the activity: it is gone.
func (m *ActivityMetrics) Forget(key types.NamespacedName) {
	m.mu.Lock()
	defer m.mu.Unlock()
	labels := prometheus.Labels{"namespace": key.Namespace, "name": key.Name}
	for _, c := range m.collectors() {
		c.(*prometheus.GaugeVec).DeletePartialMatch(labels)
	}
}

// observeActivityMetrics is the reconcile hook: it records the activity as the
// controller leaves it, its own status fields as last applied and the grab service's
// counters as read at the start of the reconcile.
func observeActivityMetrics(s *activityScope) {
	activityMetrics.Observe(s.activity)
}

// forgetActivityMetrics is the hook of an activity that no longer exists.
func forgetActivityMetrics(key types.NamespacedName) {
	activityMetrics.Forget(key)
}

func setOptional(g *prometheus.GaugeVec, ns, name string, v *int64) {
	if v == nil {
		g.DeleteLabelValues(ns, name)
		return
	}
	g.WithLabelValues(ns, name).Set(float64(*v))
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
