package controllers

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/apimachinery/pkg/types"

	"redpacket.io/operator/store"
)

// The budget's gauges follow its snapshot: the money columns, the expiry backlog and
// the conservation error (0 when the money adds up, the difference when it does
// not), and they go with the budget.
func TestBudgetMetricsFollowTheSnapshot(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewBudgetMetrics(reg)
	key := types.NamespacedName{Namespace: "shop", Name: "group"}
	m.Observe(key, store.BudgetSnapshot{Total: 1000, Available: 600, Live: 200, Claimed: 150, Refunded: 50,
		LivePackets: 3, CreatedPackets: 9, ExpiredPackets: 6, OverduePackets: 2}, &store.BudgetLedgerSums{Granted: 150, Refunded: 50})
	for g, want := range map[*prometheus.GaugeVec]float64{m.total: 1000, m.available: 600, m.inPackets: 200,
		m.claimed: 150, m.refunded: 50, m.live: 3, m.created: 9, m.expired: 6, m.overdue: 2, m.conservation: 0, m.moneyFaults: 0} {
		if got := testutil.ToFloat64(g.WithLabelValues("shop", "group")); got != want {
			t.Errorf("gauge %v = %v, want %v", g, got, want)
		}
	}
	m.Observe(key, store.BudgetSnapshot{Total: 1000, Available: 600, Live: 200, Claimed: 150, Refunded: 43}, nil)
	if got := testutil.ToFloat64(m.conservation.WithLabelValues("shop", "group")); got != 7 {
		t.Errorf("conservation error %v, want 7", got)
	}
	if got := testutil.ToFloat64(m.moneyFaults.WithLabelValues("shop", "group")); got != 1 {
		t.Errorf("money faults %v, want 1 (the sums)", got)
	}
	// Sums that agree, over shards that borrowed more than was lent and two shards
	// off: the conservation error is 0, the faults are not.
	m.Observe(key, store.BudgetSnapshot{Total: 1000, Available: 1000, Borrowed: 9, UnconservedShards: []int{0, 1}}, nil)
	if c, f := testutil.ToFloat64(m.conservation.WithLabelValues("shop", "group")), testutil.ToFloat64(m.moneyFaults.WithLabelValues("shop", "group")); c != 0 || f != 2 {
		t.Errorf("conservation error %v, money faults %v; want 0 and 2", c, f)
	}
	// Sums that agree, and a ledger that credited more grants than the shards paid.
	m.Observe(key, store.BudgetSnapshot{Total: 1000, Available: 600, Live: 200, Claimed: 150, Refunded: 50},
		&store.BudgetLedgerSums{Granted: 2150, Refunded: 50})
	if f := testutil.ToFloat64(m.moneyFaults.WithLabelValues("shop", "group")); f != 1 {
		t.Errorf("money faults %v with the ledger ahead of the shards; want 1", f)
	}
	m.Forget(key)
	if n := testutil.CollectAndCount(m.total) + testutil.CollectAndCount(m.conservation); n != 0 {
		t.Errorf("%d series left after the budget went", n)
	}
}
