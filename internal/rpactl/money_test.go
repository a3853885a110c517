package rpactl

import (
	"strings"
	"testing"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

func ptr(v int64) *int64 { return &v }

// activityWith is an activity of 200000 in 5000 packets with the given counters.
func activityWith(claimedCount, claimedAmount, remainingCount, remainingAmount int64, refunded *int64) *redpacketv1alpha1.RedPacketActivity {
	a := &redpacketv1alpha1.RedPacketActivity{}
	a.Name, a.Namespace = "quiz-night", "default"
	a.Spec.TotalAmount, a.Spec.Count, a.Spec.Currency = 200000, 5000, "CNY"
	a.Status.ClaimedCount, a.Status.ClaimedAmount = ptr(claimedCount), ptr(claimedAmount)
	a.Status.RemainingCount, a.Status.RemainingAmount = ptr(remainingCount), ptr(remainingAmount)
	a.Status.RefundedAmount = refunded
	return a
}

// The conservation check passes for the states an activity goes through (open,
// exhausted, expired with a refund) and names each way the figures can fail to add up.
func TestInvariant(t *testing.T) {
	for _, tc := range []struct {
		name     string
		a        *redpacketv1alpha1.RedPacketActivity
		verdict  string
		equation string
		problem  string
	}{
		{"open, nothing claimed", activityWith(0, 0, 5000, 200000, nil), VerdictOK, "0 + 200000 + 0 = 200000", ""},
		{"open, some claimed", activityWith(1200, 52000, 3800, 148000, ptr(0)), VerdictOK, "52000 + 148000 + 0 = 200000", ""},
		{"exhausted", activityWith(5000, 200000, 0, 0, ptr(0)), VerdictOK, "200000 + 0 + 0 = 200000", ""},
		{"expired with a refund", activityWith(1200, 52000, 0, 0, ptr(148000)), VerdictOK, "52000 + 0 + 148000 = 200000", ""},
		{"amounts off by one fen", activityWith(1200, 52000, 3800, 147999, nil), VerdictViolated, "52000 + 147999 + 0 = 199999",
			"claimed + remaining + refunded = 199999, total is 200000 (off by -1)"},
		{"refund counted twice", activityWith(1200, 52000, 3800, 148000, ptr(148000)), VerdictViolated, "",
			"(off by +148000)"},
		{"more packets than the count", activityWith(1201, 52000, 3800, 148000, nil), VerdictViolated, "",
			"claimed 1201 + remaining 3800 packets exceed the count 5000"},
		{"packets gone without a refund", activityWith(1200, 52000, 3000, 148000, nil), VerdictViolated, "",
			"800 packets are neither claimed nor remaining, but nothing was refunded"},
		{"a refund with every packet accounted for", activityWith(1200, 52000, 3800, 0, ptr(148000)), VerdictViolated, "",
			"148000 was refunded, but every packet is claimed or remaining"},
		{"a negative counter", activityWith(1200, 52000, 3800, 148001, ptr(-1)), VerdictViolated, "",
			"refundedAmount is negative (-1)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inv := MoneyOf(tc.a).Check()
			if inv.Verdict != tc.verdict {
				t.Fatalf("verdict %s, want %s (%+v)", inv.Verdict, tc.verdict, inv)
			}
			if tc.equation != "" && inv.Equation != tc.equation {
				t.Errorf("equation %q, want %q", inv.Equation, tc.equation)
			}
			if tc.problem == "" && len(inv.Problems) != 0 {
				t.Errorf("problems %q, want none", inv.Problems)
			}
			if tc.problem != "" && !strings.Contains(strings.Join(inv.Problems, "\n"), tc.problem) {
				t.Errorf("problems %q do not say %q", inv.Problems, tc.problem)
			}
		})
	}

	// Before the first report there is nothing to check, and the check says so.
	a := activityWith(0, 0, 0, 0, nil)
	a.Status.ClaimedCount = nil
	if inv := MoneyOf(a).Check(); inv.Verdict != VerdictUnknown || len(inv.Problems) != 0 {
		t.Errorf("without counters: %+v, want UNKNOWN", inv)
	}
}

// Amounts in minor units are shown in the currency's major unit with integer
// arithmetic, with the currency's own number of decimals.
func TestFormatMajor(t *testing.T) {
	for _, tc := range []struct {
		amount   int64
		currency string
		want     string
	}{
		{200000, "CNY", "2000.00 CNY"},
		{52, "CNY", "0.52 CNY"},
		{5, "USD", "0.05 USD"},
		{0, "EUR", "0.00 EUR"},
		{-5, "USD", "-0.05 USD"},
		{-123456, "CNY", "-1234.56 CNY"},
		{1500, "JPY", "1500 JPY"},
		{1500, "KWD", "1.500 KWD"},
		{7, "BHD", "0.007 BHD"},
		{1000000000000000, "CNY", "10000000000000.00 CNY"},
		{99, "", "0.99 CNY"},
	} {
		if got := FormatMajor(tc.amount, tc.currency); got != tc.want {
			t.Errorf("FormatMajor(%d, %q) = %q, want %q", tc.amount, tc.currency, got, tc.want)
		}
	}
}

func TestPercent(t *testing.T) {
	for _, tc := range []struct {
		part, whole int64
		want        string
	}{{0, 0, "-"}, {0, 10, "0%"}, {1, 3, "33%"}, {2, 3, "66%"}, {3, 3, "100%"},
		{999999999999999, 1000000000000000, "99%"}} {
		if got := percent(tc.part, tc.whole); got != tc.want {
			t.Errorf("percent(%d, %d) = %q, want %q", tc.part, tc.whole, got, tc.want)
		}
	}
}
