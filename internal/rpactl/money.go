package rpactl

import (
	"fmt"
	"strconv"
	"strings"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// Verdicts of the conservation check.
const (
	VerdictOK       = "OK"
	VerdictViolated = "VIOLATED"
	VerdictUnknown  = "UNKNOWN"
)

// Money is an activity's figures as its status reports them, in packets and in minor
// units. The refunded packets are not a status field: they are the packets neither
// claimed nor remaining, which exist only once the activity closed with a refund.
type Money struct {
	TotalCount, TotalAmount         int64
	ClaimedCount, ClaimedAmount     int64
	RemainingCount, RemainingAmount int64
	RefundedCount, RefundedAmount   int64
	// Reported is false while the status has no counters yet (before seeding).
	Reported bool
}

// MoneyOf reads the figures of an activity. A missing refundedAmount is 0: nothing was
// refunded before the activity closed.
func MoneyOf(a *redpacketv1alpha1.RedPacketActivity) Money {
	st := a.Status
	m := Money{TotalCount: a.Spec.Count, TotalAmount: a.Spec.TotalAmount}
	if st.RefundedAmount != nil {
		m.RefundedAmount = *st.RefundedAmount
	}
	if st.ClaimedCount == nil || st.ClaimedAmount == nil || st.RemainingCount == nil || st.RemainingAmount == nil {
		return m
	}
	m.Reported = true
	m.ClaimedCount, m.ClaimedAmount = *st.ClaimedCount, *st.ClaimedAmount
	m.RemainingCount, m.RemainingAmount = *st.RemainingCount, *st.RemainingAmount
	m.RefundedCount = m.TotalCount - m.ClaimedCount - m.RemainingCount
	return m
}

// Invariant is the outcome of the conservation check.
type Invariant struct {
	// Verdict is VerdictOK, VerdictViolated or VerdictUnknown.
	Verdict string
	// Equation shows the sum, such as "52000 + 148000 + 0 = 200000".
	Equation string
	// Problems lists what does not add up; empty unless the verdict is VerdictViolated.
	Problems []string
}

// Check checks the conservation invariant of the public contract,
// claimedAmount + remainingAmount + refundedAmount == totalAmount, and its
// counterpart for packets: claimed and remaining packets never exceed the count, and
// packets that are neither (refunded when the activity closed) exist exactly when
// money was refunded, since every packet holds at least one minor unit. The verdict is
// VerdictUnknown while the counters are not reported.
func (m Money) Check() Invariant {
	if !m.Reported {
		return Invariant{Verdict: VerdictUnknown, Equation: "no counters reported yet"}
	}
	sum := m.ClaimedAmount + m.RemainingAmount + m.RefundedAmount
	inv := Invariant{Verdict: VerdictOK,
		Equation: fmt.Sprintf("%d + %d + %d = %d", m.ClaimedAmount, m.RemainingAmount, m.RefundedAmount, sum)}
	if sum != m.TotalAmount {
		inv.Problems = append(inv.Problems, fmt.Sprintf("claimed + remaining + refunded = %d, total is %d (off by %+d)",
			sum, m.TotalAmount, sum-m.TotalAmount))
	}
	for _, f := range []struct {
		name string
		v    int64
	}{{"claimedAmount", m.ClaimedAmount}, {"remainingAmount", m.RemainingAmount}, {"refundedAmount", m.RefundedAmount},
		{"claimedCount", m.ClaimedCount}, {"remainingCount", m.RemainingCount}} {
		if f.v < 0 {
			inv.Problems = append(inv.Problems, fmt.Sprintf("%s is negative (%d)", f.name, f.v))
		}
	}
	switch {
	case m.RefundedCount < 0:
		inv.Problems = append(inv.Problems, fmt.Sprintf("claimed %d + remaining %d packets exceed the count %d",
			m.ClaimedCount, m.RemainingCount, m.TotalCount))
	case m.RefundedCount > 0 && m.RefundedAmount == 0:
		inv.Problems = append(inv.Problems, fmt.Sprintf("%d packets are neither claimed nor remaining, but nothing was refunded",
			m.RefundedCount))
	case m.RefundedCount == 0 && m.RefundedAmount > 0:
		inv.Problems = append(inv.Problems, fmt.Sprintf("%d was refunded, but every packet is claimed or remaining",
			m.RefundedAmount))
	}
	if len(inv.Problems) > 0 {
		inv.Verdict = VerdictViolated
	}
	return inv
}

// minorDigits are the ISO 4217 currencies whose minor unit is not the hundredth.
var minorDigits = map[string]int{
	// No minor unit.
	"BIF": 0, "CLP": 0, "DJF": 0, "GNF": 0, "ISK": 0, "JPY": 0, "KMF": 0, "KRW": 0,
	"PYG": 0, "RWF": 0, "UGX": 0, "UYI": 0, "VND": 0, "VUV": 0, "XAF": 0, "XOF": 0, "XPF": 0,
	// A thousandth.
	"BHD": 3, "IQD": 3, "JOD": 3, "KWD": 3, "LYD": 3, "OMR": 3, "TND": 3,
	// A ten-thousandth.
	"CLF": 4, "UYW": 4,
}

// FormatMajor shows an amount in minor units in the currency's major unit, with
// integer arithmetic only: FormatMajor(200000, "CNY") is "2000.00 CNY",
// FormatMajor(-5, "USD") is "-0.05 USD", FormatMajor(1500, "JPY") is "1500 JPY".
// Currencies not listed in minorDigits have two decimal digits.
func FormatMajor(amount int64, currency string) string {
	if currency == "" {
		currency = redpacketv1alpha1.DefaultCurrency
	}
	digits, ok := minorDigits[currency]
	if !ok {
		digits = 2
	}
	sign := ""
	abs := strconv.FormatInt(amount, 10)
	if amount < 0 {
		sign, abs = "-", abs[1:]
	}
	if digits == 0 {
		return sign + abs + " " + currency
	}
	if len(abs) <= digits {
		abs = strings.Repeat("0", digits-len(abs)+1) + abs
	}
	return sign + abs[:len(abs)-digits] + "." + abs[len(abs)-digits:] + " " + currency
}

// percent is part/whole in whole percent, rounded down, with integer arithmetic; "-"
// when whole is 0.
func percent(part, whole int64) string {
	if whole == 0 {
		return "-"
	}
	// Amounts are at most 10^15 (the CRD's bound), so part*100 does not overflow.
	return strconv.FormatInt(part*100/whole, 10) + "%"
}
