package settlement

import (
	"context"
	"errors"
	"fmt"

	"redpacket.io/operator/store"
)

// Verifier is what one kind of source adds to the worker, which is the same for
// every kind: the check of its entries before they are delivered, and the step
// between a delivery's 2xx and its acknowledgement. An activity's
// (activityVerifier) checks each entry against the claims and the close and,
// with an Allowance, the seeded split and the activity's ledger; a
// RedPacketBudget's (packetsCheck) against its packets and its ledger, and forgets
// a packet whose refund was delivered.
type Verifier interface {
	// Verify returns why each forged entry is, by id (a *ForgedError); genuine and
	// malformed entries that may be delivered are not in the map; an entry that was
	// booked and has nothing to deliver (a budget packet's creation record) maps to
	// errBooked, and is acknowledged. An error means nothing was decided: the worker
	// asks again, and never delivers an entry unverified.
	Verify(ctx context.Context, entries []store.StreamEntry) (map[string]error, error)
	// BeforeAck runs after the balance system accepted the entries' deliveries and
	// before they are acknowledged. It returns one error for each entry, in order
	// (nil: acknowledge it; else it stays pending and the step is tried again), or
	// nil when all may be acknowledged.
	BeforeAck(ctx context.Context, entries []store.StreamEntry) []error
}

// errBooked is Verify's answer for an entry booked in the operator's ledger with
// nothing to deliver: the worker acknowledges it, and counts it as no delivery.
var errBooked = errors.New("booked in the operator's ledger: nothing to deliver")

// activityVerifier is the Verifier of an activity's shard.
type activityVerifier struct {
	// shard is the activity's shard whose stream the worker delivers.
	shard *store.Shard
	// ledger is the activity's settlement ledger, allowance what the operator
	// seeded (nil: only the claims check, for tests of the delivery mechanics).
	ledger    *store.Ledger
	allowance *Allowance
	// shards is how many shards the activity has.
	shards int
}

// Verify checks entries against the claims and the close
// (store.Shard.VerifyEntries) and, with an Allowance, against the seeded split and
// the ledger (checkAllowance).
func (v *activityVerifier) Verify(ctx context.Context, entries []store.StreamEntry) (map[string]error, error) {
	forged, err := v.shard.VerifyEntries(ctx, entries)
	if err != nil {
		return nil, err
	}
	for id, why := range forged {
		forged[id] = &ForgedError{Reason: ReasonClaimMismatch, Detail: why.Error()}
	}
	if v.allowance != nil {
		if err := v.checkAllowance(ctx, entries, forged); err != nil {
			return nil, err
		}
	}
	return forged, nil
}

// BeforeAck has nothing to do for an activity.
func (v *activityVerifier) BeforeAck(context.Context, []store.StreamEntry) []error { return nil }

// Verify checks a budget's entries (checkPackets).
func (c *packetsCheck) Verify(ctx context.Context, entries []store.StreamEntry) (map[string]error, error) {
	return c.checkPackets(ctx, entries)
}

// BeforeAck forgets the packets of the delivered refunds among entries
// (packetsCheck.forget).
func (c *packetsCheck) BeforeAck(ctx context.Context, entries []store.StreamEntry) []error {
	var ids []string
	var at []int
	for i, e := range entries {
		if id, ok := refundedPacket(e); ok {
			ids = append(ids, id)
			at = append(at, i)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	errs := make([]error, len(entries))
	for k, err := range c.forget(ctx, ids, c.cfg.LedgerRetention) {
		if err != nil {
			errs[at[k]] = fmt.Errorf("forgetting packet %q after its refund was delivered: %w", ids[k], err)
		}
	}
	return errs
}
