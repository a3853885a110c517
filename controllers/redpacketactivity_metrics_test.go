package controllers_test

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
)

// TestActivityMetrics: the gauges follow an activity's status, export the
// conservation error only when the three amounts are set, carry the Stalled reason,
// and disappear with the activity.
func TestActivityMetrics(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m := controllers.NewActivityMetrics(reg)
	a := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "quiz"},
		Spec:       redpacketv1alpha1.RedPacketActivitySpec{TotalAmount: 1000, Count: 10},
	}
	a.Status.Phase = redpacketv1alpha1.PhaseActive
	a.Status.Conditions = []metav1.Condition{{Type: redpacketv1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: "Active"}}
	a.Status.RemainingCount, a.Status.RemainingAmount = ptr[int64](7), ptr[int64](640)
	a.Status.ClaimedCount, a.Status.ClaimedAmount = ptr[int64](3), ptr[int64](360)
	m.Observe(a)

	expect := func(names ...string) func(string) {
		return func(want string) {
			t.Helper()
			if err := testutil.GatherAndCompare(reg, strings.NewReader(want), names...); err != nil {
				t.Error(err)
			}
		}
	}
	expect("redpacket_activity_ready", "redpacket_activity_claimed_amount", "redpacket_activity_remaining_packets")(`
# HELP redpacket_activity_claimed_amount status.claimedAmount: money granted to users, in minor units.
# TYPE redpacket_activity_claimed_amount gauge
redpacket_activity_claimed_amount{name="quiz",namespace="shop"} 360
# HELP redpacket_activity_ready 1 while the activity's Ready condition is True, else 0.
# TYPE redpacket_activity_ready gauge
redpacket_activity_ready{name="quiz",namespace="shop"} 1
# HELP redpacket_activity_remaining_packets status.remainingCount: packets not yet claimed.
# TYPE redpacket_activity_remaining_packets gauge
redpacket_activity_remaining_packets{name="quiz",namespace="shop"} 7
`)
	if n, _ := testutil.GatherAndCount(reg, "redpacket_activity_phase"); n != len(controllers.AllPhases) {
		t.Errorf("%d phase series, want one per phase (%d)", n, len(controllers.AllPhases))
	}
	if n, err := testutil.GatherAndCount(reg, "redpacket_activity_conservation_error"); err != nil || n != 0 {
		t.Errorf("conservation error exported before refundedAmount is set: %d series, %v", n, err)
	}

	// Closed with a refund that does not add up, and fenced.
	a.Status.Phase = redpacketv1alpha1.PhaseFailed
	a.Status.RemainingCount, a.Status.RemainingAmount = ptr[int64](0), ptr[int64](0)
	a.Status.RefundedAmount = ptr[int64](600)
	a.Status.Conditions = []metav1.Condition{
		{Type: redpacketv1alpha1.ConditionReady, Status: metav1.ConditionFalse, Reason: "RedisRolledBack"},
		{Type: "Stalled", Status: metav1.ConditionTrue, Reason: "RedisRolledBack"},
	}
	m.Observe(a)
	expect("redpacket_activity_ready", "redpacket_activity_stalled", "redpacket_activity_conservation_error")(`
# HELP redpacket_activity_conservation_error totalAmount - (claimedAmount + remainingAmount + refundedAmount) from one status, in minor units; must be 0. Exported only when all three status amounts are set.
# TYPE redpacket_activity_conservation_error gauge
redpacket_activity_conservation_error{name="quiz",namespace="shop"} 40
# HELP redpacket_activity_ready 1 while the activity's Ready condition is True, else 0.
# TYPE redpacket_activity_ready gauge
redpacket_activity_ready{name="quiz",namespace="shop"} 0
# HELP redpacket_activity_stalled 1 while the activity's Stalled condition is True (it cannot go on without a person: DataLost, RedisRolledBack), with the condition's reason; absent otherwise.
# TYPE redpacket_activity_stalled gauge
redpacket_activity_stalled{name="quiz",namespace="shop",reason="RedisRolledBack"} 1
`)
	expect("redpacket_activity_phase")(phaseSeries("shop", "quiz", redpacketv1alpha1.PhaseFailed))

	// A prewarm window: 0 while warming, 1 once startTime came short, absent without
	// the condition.
	prewarmed := func(status metav1.ConditionStatus, reason string) {
		a.Status.Conditions = []metav1.Condition{a.Status.Conditions[0], a.Status.Conditions[1],
			{Type: redpacketv1alpha1.ConditionPrewarmed, Status: status, Reason: reason}}
		m.Observe(a)
	}
	notPrewarmed := func(v string) string {
		return `
# HELP redpacket_activity_not_prewarmed 1 while the activity's Prewarmed condition is False with reason NotPrewarmed (startTime has come and fewer than prewarm.replicas grab pods are available), 0 while it has another reason or is True; absent without prewarm.
# TYPE redpacket_activity_not_prewarmed gauge
redpacket_activity_not_prewarmed{name="quiz",namespace="shop"} ` + v + "\n"
	}
	prewarmed(metav1.ConditionFalse, redpacketv1alpha1.ReasonWarming)
	expect("redpacket_activity_not_prewarmed")(notPrewarmed("0"))
	prewarmed(metav1.ConditionFalse, redpacketv1alpha1.ReasonNotPrewarmed)
	expect("redpacket_activity_not_prewarmed")(notPrewarmed("1"))
	prewarmed(metav1.ConditionTrue, redpacketv1alpha1.ReasonWarmed)
	expect("redpacket_activity_not_prewarmed")(notPrewarmed("0"))
	a.Status.Conditions = a.Status.Conditions[:2]
	m.Observe(a)
	if n, _ := testutil.GatherAndCount(reg, "redpacket_activity_not_prewarmed"); n != 0 {
		t.Errorf("%d not_prewarmed series without a Prewarmed condition, want 0", n)
	}

	// The Stalled condition goes away: so does the series.
	a.Status.Conditions = a.Status.Conditions[:1]
	a.Status.RefundedAmount = ptr[int64](640)
	m.Observe(a)
	if n, _ := testutil.GatherAndCount(reg, "redpacket_activity_stalled"); n != 0 {
		t.Errorf("%d stalled series after the condition went away, want 0", n)
	}
	expect("redpacket_activity_conservation_error")(`
# HELP redpacket_activity_conservation_error totalAmount - (claimedAmount + remainingAmount + refundedAmount) from one status, in minor units; must be 0. Exported only when all three status amounts are set.
# TYPE redpacket_activity_conservation_error gauge
redpacket_activity_conservation_error{name="quiz",namespace="shop"} 0
`)

	// Another activity, then the first is gone: only the other's series are left.
	b := a.DeepCopy()
	b.Name = "other"
	m.Observe(b)
	m.Forget(types.NamespacedName{Namespace: "shop", Name: "quiz"})
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := 0
	for _, f := range families {
		for _, s := range f.GetMetric() {
			series++
			for _, l := range s.GetLabel() {
				if l.GetName() == "name" && l.GetValue() == "quiz" {
					t.Errorf("%s still has a series of the deleted activity", f.GetName())
				}
			}
		}
	}
	if series == 0 {
		t.Error("the other activity's series went too")
	}
}

// phaseSeries is the phase gauge's exposition for an activity in phase p.
func phaseSeries(ns, name string, p redpacketv1alpha1.Phase) string {
	var b strings.Builder
	b.WriteString("# HELP redpacket_activity_phase 1 for the activity's current phase, 0 for every other phase.\n")
	b.WriteString("# TYPE redpacket_activity_phase gauge\n")
	for _, ph := range controllers.AllPhases {
		v := "0"
		if ph == p {
			v = "1"
		}
		b.WriteString(`redpacket_activity_phase{name="` + name + `",namespace="` + ns + `",phase="` + string(ph) + `"} ` + v + "\n")
	}
	return b.String()
}
