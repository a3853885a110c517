package controllers

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"redpacket.io/operator/store"
)

// BudgetMetrics are the controller's per-budget gauges, set from the snapshot of the
// budget's shards each reconcile reads. Their labels are the budget's namespace and
// name, never a packet or user id. Money is in the currency's minor unit. Like the
// activities' gauges, only the replica that holds the leader lease exports them.
type BudgetMetrics struct {
	total, available, inPackets, claimed, refunded *prometheus.GaugeVec
	live, created, expired, overdue                *prometheus.GaugeVec
	conservation, moneyFaults                      *prometheus.GaugeVec
	// overdueAge is set by the expiry driver at the start of each of the budget's
	// passes, not by the reconcile (ObserveOverdueAge).
	overdueAge *prometheus.GaugeVec

	// mu orders observe and forget of one budget.
	mu sync.Mutex
}

// budgetMetrics is the controller's instance, on controller-runtime's registry.
var budgetMetrics = NewBudgetMetrics(metrics.Registry)

// NewBudgetMetrics creates the gauges and registers them with reg.
func NewBudgetMetrics(reg prometheus.Registerer) *BudgetMetrics {
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "redpacket", Subsystem: "budget", Name: name, Help: help},
			[]string{"namespace", "name"})
	}
	m := &BudgetMetrics{
		total:        gauge("total_amount", "The money allotted to the budget's shards (spec.total once configured), in minor units."),
		available:    gauge("available_amount", "Money new packets may still draw, in minor units."),
		inPackets:    gauge("in_packets_amount", "Money in live packets, not grabbed and not refunded, in minor units."),
		claimed:      gauge("claimed_amount", "Money granted to users from the budget's packets, in minor units."),
		refunded:     gauge("refunded_amount", "Money refunded to senders when their packets expired, in minor units."),
		live:         gauge("live_packets", "Packets not expired yet."),
		created:      gauge("created_packets", "Packets created since the budget was configured."),
		expired:      gauge("expired_packets", "Packets expired since the budget was configured."),
		overdue:      gauge("overdue_packets", "Live packets past their expiry by the Redis clock that were not expired yet: the expiry driver's backlog."),
		conservation: gauge("conservation_error", "total - (available + in packets + claimed + refunded) from one snapshot, in minor units; anything but 0 means money is out of place."),
		moneyFaults: gauge("money_faults", "How many of the money checks the last snapshot broke: the budget's sums, a shard's own sums, more borrowed between shards than lent, negative money, more credited by the settlement ledger than the shards paid out. "+
			"No run of the budget's scripts breaks one, so anything but 0 is a write outside them, even when conservation_error is 0."),
		overdueAge: gauge("expiry_overdue_seconds", "How long the budget's oldest packet past its expiry has waited to be expired, by the Redis clock, read by the expiry driver at the start of each of the budget's passes; 0 when none is due. "+
			"It stays under the driver's interval plus one pass while the driver keeps up, whatever other budgets hold; a packet forged into the due index with an old score reads as old as that score."),
	}
	for _, c := range m.collectors() {
		reg.MustRegister(c)
	}
	return m
}

func (m *BudgetMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.total, m.available, m.inPackets, m.claimed, m.refunded,
		m.live, m.created, m.expired, m.overdue, m.conservation, m.moneyFaults, m.overdueAge}
}

// ObserveOverdueAge sets the budget's overdue age gauge (the expiry driver's).
func (m *BudgetMetrics) ObserveOverdueAge(key types.NamespacedName, age time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.overdueAge.WithLabelValues(key.Namespace, key.Name).Set(age.Seconds())
}

// Observe sets the budget's gauges from a snapshot of its shards and, when not nil,
// the settlement ledger read just before it (money_faults counts its faults too).
func (m *BudgetMetrics) Observe(key types.NamespacedName, s store.BudgetSnapshot, ledger *store.BudgetLedgerSums) {
	faults := len(s.MoneyFaults())
	if ledger != nil {
		faults += len(s.LedgerFaults(*ledger))
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	ns, name := key.Namespace, key.Name
	for g, v := range map[*prometheus.GaugeVec]int64{
		m.total: s.Total, m.available: s.Available, m.inPackets: s.Live, m.claimed: s.Claimed, m.refunded: s.Refunded,
		m.live: s.LivePackets, m.created: s.CreatedPackets, m.expired: s.ExpiredPackets, m.overdue: s.OverduePackets,
		m.conservation: s.Total - (s.Available + s.Live + s.Claimed + s.Refunded),
		m.moneyFaults:  int64(faults),
	} {
		g.WithLabelValues(ns, name).Set(float64(v))
	}
}

// Forget deletes every series of the budget: it is gone.
func (m *BudgetMetrics) Forget(key types.NamespacedName) {
	m.mu.Lock()
	defer m.mu.Unlock()
	labels := prometheus.Labels{"namespace": key.Namespace, "name": key.Name}
	for _, c := range m.collectors() {
		c.(*prometheus.GaugeVec).DeletePartialMatch(labels)
	}
}
