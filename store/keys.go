package store

import (
	"fmt"
	"strconv"
	"strings"
)

// Keys are the Redis keys of one shard of an activity.
type Keys struct {
	Meta        string
	Staging     string
	Packets     string
	Claims      string
	Stream      string
	DeadLetters string
	// Transfers is the journal of packets moved out to another shard (transfer.go).
	Transfers string
	// Applied records the transfers from other shards that were applied here.
	Applied string
}

// keysFor returns the keys of the shard whose hash tag is {<uid>}.
func keysFor(uid string) Keys {
	p := "rpa:{" + uid + "}:"
	return Keys{
		Meta:        p + "meta",
		Staging:     p + "staging",
		Packets:     p + "packets",
		Claims:      p + "claims",
		Stream:      p + "stream",
		DeadLetters: p + "dead",
		Transfers:   p + "xout",
		Applied:     p + "xin",
	}
}

// All lists every key of the activity, for deletion.
func (k Keys) All() []string {
	return []string{k.Meta, k.Staging, k.Packets, k.Claims, k.Stream, k.DeadLetters, k.Transfers, k.Applied}
}

// Meta hash fields.
const (
	fieldState         = "state"
	fieldCloseReason   = "close_reason"
	fieldTotal         = "total"
	fieldCount         = "count"
	fieldStartMs       = "start_ms"
	fieldEndMs         = "end_ms"
	fieldPaused        = "paused"
	fieldSponsor       = "sponsor"
	fieldClaimedCount  = "claimed_count" // not a meta field: the snapshot's HLEN of the claims hash
	fieldClaimedAmount = "claimed_amount"
	fieldRefunded      = "refunded"
	fieldSettledCount  = "settled_count"
	fieldSettledAmount = "settled_amount"
	fieldRefundSettled = "refund_settled"
	fieldDeadCount     = "dead_count"
	fieldSeededMs      = "seeded_ms"
	fieldCurrency      = "currency"
	fieldFenced        = "fenced"
	fieldEpoch         = "epoch"
	// fieldTransferSeq counts the shard's transfer steps (transfer_out.lua).
	fieldTransferSeq = "transfer_seq"
	// fieldStagingFP is the fingerprint of the split being staged (seed_stage.lua).
	fieldStagingFP = "staging_fp"
	// The snapshot's list lengths, reported under these names.
	fieldRemainingCount = "remaining_count"
	fieldStagedCount    = "staged_count"
)

// State is the state of an activity inside Redis (the meta hash's "state" field);
// "" means Redis does not hold the committed activity.
type State string

// The states an activity can be in inside Redis.
const (
	// StateReady means the packets are committed but grabbing has not been opened.
	StateReady State = "ready"
	// StateOpen means grabs are served, subject to the pause flag and the schedule.
	StateOpen State = "open"
	// StateClosed means grabbing ended for good (expired or exhausted).
	StateClosed State = "closed"
)

// ListedPacket is one entry of a packets list.
type ListedPacket struct {
	ID     string
	Amount int64
	// CountBefore and AmountBefore are what was claimed from the packet's list before
	// it: the claims made there so far plus the packets ahead of it (see grab.lua).
	CountBefore, AmountBefore int64
}

// parseListedPacket reads a packets-list entry,
// "<id>:<amount>@<countBefore>:<amountBefore>".
func parseListedPacket(entry string) (ListedPacket, error) {
	body, numbers, numbered := strings.Cut(entry, "@")
	id, amount, ok := strings.Cut(body, ":")
	if !numbered || !ok || id == "" {
		return ListedPacket{}, fmt.Errorf("packet %q is not <id>:<amount>@<countBefore>:<amountBefore>", entry)
	}
	p := ListedPacket{ID: id}
	var err error
	if p.Amount, err = strconv.ParseInt(amount, 10, 64); err != nil || p.Amount <= 0 {
		return ListedPacket{}, fmt.Errorf("packet %q: amount %q is not a positive integer", entry, amount)
	}
	count, money, ok := strings.Cut(numbers, ":")
	if p.CountBefore, err = strconv.ParseInt(count, 10, 64); !ok || err != nil || p.CountBefore < 0 {
		return ListedPacket{}, fmt.Errorf("packet %q: %q is not <countBefore>:<amountBefore>", entry, numbers)
	}
	if p.AmountBefore, err = strconv.ParseInt(money, 10, 64); err != nil || p.AmountBefore < 0 {
		return ListedPacket{}, fmt.Errorf("packet %q: %q is not <countBefore>:<amountBefore>", entry, numbers)
	}
	return p, nil
}
