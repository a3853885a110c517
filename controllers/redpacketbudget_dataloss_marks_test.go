package controllers

import (
	"testing"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// budgetBelowMarks: a budget never configured has no marks; one whose Redis holds
// none of it lost its data; one whose Redis holds any figure below its mark went back
// in time; growth and equality are no loss.
func TestBudgetBelowMarks(t *testing.T) {
	marks := redpacketv1alpha1.RedPacketBudgetStatus{Total: new(int64(1000)), Claimed: new(int64(500)),
		Refunded: new(int64(100)), CreatedPackets: new(int64(3)), GrabbedShares: new(int64(4))}
	now := store.BudgetSnapshot{Total: 1000, Claimed: 500, Refunded: 100, CreatedPackets: 3, GrabbedShares: 4}
	for _, tc := range []struct {
		name string
		st   redpacketv1alpha1.RedPacketBudgetStatus
		snap func(s store.BudgetSnapshot) store.BudgetSnapshot
		want string
	}{
		{"never configured", redpacketv1alpha1.RedPacketBudgetStatus{}, func(s store.BudgetSnapshot) store.BudgetSnapshot { return store.BudgetSnapshot{} }, ""},
		{"as recorded", marks, func(s store.BudgetSnapshot) store.BudgetSnapshot { return s }, ""},
		{"grown", marks, func(s store.BudgetSnapshot) store.BudgetSnapshot { s.Total, s.Claimed = 2000, 900; return s }, ""},
		{"flushed", marks, func(s store.BudgetSnapshot) store.BudgetSnapshot { return store.BudgetSnapshot{} }, redpacketv1alpha1.ReasonDataLost},
		{"a shard missing", marks, func(s store.BudgetSnapshot) store.BudgetSnapshot { s.Total, s.MissingShards = 500, []int{1}; return s }, redpacketv1alpha1.ReasonDataLost},
		{"a shard missing, the rest grown", marks, func(s store.BudgetSnapshot) store.BudgetSnapshot { s.Total, s.MissingShards = 2000, []int{3}; return s }, redpacketv1alpha1.ReasonDataLost},
		{"total lower", marks, func(s store.BudgetSnapshot) store.BudgetSnapshot { s.Total = 500; return s }, redpacketv1alpha1.ReasonRedisRolledBack},
		{"claimed lower", marks, func(s store.BudgetSnapshot) store.BudgetSnapshot { s.Claimed = 499; return s }, redpacketv1alpha1.ReasonRedisRolledBack},
		{"refunded lower", marks, func(s store.BudgetSnapshot) store.BudgetSnapshot { s.Refunded = 0; return s }, redpacketv1alpha1.ReasonRedisRolledBack},
		{"fewer packets", marks, func(s store.BudgetSnapshot) store.BudgetSnapshot { s.CreatedPackets = 2; return s }, redpacketv1alpha1.ReasonRedisRolledBack},
		{"an older epoch", redpacketv1alpha1.RedPacketBudgetStatus{Total: new(int64(1000)), Epoch: new(int64(7))},
			func(s store.BudgetSnapshot) store.BudgetSnapshot {
				s.Total, s.Claimed, s.Epoch = 1000, 900, 6
				return s
			}, redpacketv1alpha1.ReasonRedisRolledBack},
		{"the recorded epoch", redpacketv1alpha1.RedPacketBudgetStatus{Total: new(int64(1000)), Epoch: new(int64(7))},
			func(s store.BudgetSnapshot) store.BudgetSnapshot { s.Epoch = 7; return s }, ""},
		{"fewer grabs", marks, func(s store.BudgetSnapshot) store.BudgetSnapshot { s.GrabbedShares = 3; return s }, redpacketv1alpha1.ReasonRedisRolledBack},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got, why := budgetBelowMarks(tc.st, tc.snap(now)); got != tc.want {
				t.Errorf("reason %q (%s), want %q", got, why, tc.want)
			}
		})
	}
}
