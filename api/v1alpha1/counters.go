package v1alpha1

import "fmt"

// Counters are the money counters of an activity's status, in minor units and
// packets. They are always written together, from one Redis snapshot, so that
// ClaimedAmount + RemainingAmount + RefundedAmount == totalAmount (and ClaimedCount
// + RemainingCount == count) in every status anyone can read.
// +kubebuilder:object:generate=false
type Counters struct {
	RemainingCount  int64
	RemainingAmount int64
	ClaimedCount    int64
	ClaimedAmount   int64
	RefundedAmount  int64
	SettledCount    int64
	SettledAmount   int64
	DeadLetterCount int64
}

// StatusFields are the counters as status fields, for a server-side apply.
func (c Counters) StatusFields() map[string]any {
	return map[string]any{
		"remainingCount":  c.RemainingCount,
		"remainingAmount": c.RemainingAmount,
		"claimedCount":    c.ClaimedCount,
		"claimedAmount":   c.ClaimedAmount,
		"refundedAmount":  c.RefundedAmount,
		"settledCount":    c.SettledCount,
		"settledAmount":   c.SettledAmount,
		"deadLetterCount": c.DeadLetterCount,
	}
}

// RecordedCounters are the counters a status records; an absent counter is 0. ok
// is false when the status records none yet.
func RecordedCounters(st *RedPacketActivityStatus) (c Counters, ok bool) {
	get := func(v *int64) int64 {
		if v == nil {
			return 0
		}
		ok = true
		return *v
	}
	c = Counters{
		RemainingCount:  get(st.RemainingCount),
		RemainingAmount: get(st.RemainingAmount),
		ClaimedCount:    get(st.ClaimedCount),
		ClaimedAmount:   get(st.ClaimedAmount),
		RefundedAmount:  get(st.RefundedAmount),
		SettledCount:    get(st.SettledCount),
		SettledAmount:   get(st.SettledAmount),
		DeadLetterCount: get(st.DeadLetterCount),
	}
	return c, ok
}

// Behind says how c falls below recorded in a cumulative counter (claims, their
// money, settlements, the refund), or "" when it does not. (Dead letters are not
// cumulative: a replay takes them back.) Those
// counters only grow; counters behind recorded ones come from a Redis that rolled
// back.
func (c Counters) Behind(recorded Counters) string {
	for _, f := range []struct {
		name      string
		have, was int64
	}{
		{"claimedCount", c.ClaimedCount, recorded.ClaimedCount},
		{"claimedAmount", c.ClaimedAmount, recorded.ClaimedAmount},
		{"settledCount", c.SettledCount, recorded.SettledCount},
		{"settledAmount", c.SettledAmount, recorded.SettledAmount},
		{"refundedAmount", c.RefundedAmount, recorded.RefundedAmount},
	} {
		if f.have < f.was {
			return fmt.Sprintf("Redis holds %s %d, status already recorded %d", f.name, f.have, f.was)
		}
	}
	return ""
}

// SetCounters writes c into st.
func SetCounters(st *RedPacketActivityStatus, c Counters) {
	set := func(v int64) *int64 { return &v }
	st.RemainingCount, st.RemainingAmount = set(c.RemainingCount), set(c.RemainingAmount)
	st.ClaimedCount, st.ClaimedAmount = set(c.ClaimedCount), set(c.ClaimedAmount)
	st.RefundedAmount = set(c.RefundedAmount)
	st.SettledCount, st.SettledAmount = set(c.SettledCount), set(c.SettledAmount)
	st.DeadLetterCount = set(c.DeadLetterCount)
}
