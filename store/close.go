package store

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// CloseReason is why an activity closed.
type CloseReason string

// The reasons an activity closes.
const (
	CloseExpired   CloseReason = "expired"
	CloseExhausted CloseReason = "exhausted"
)

// CloseOutcome is what a close did.
type CloseOutcome string

// The outcomes of a close.
const (
	// Closed: the activity is closed (now or by an earlier close, whose figures are
	// returned).
	Closed CloseOutcome = "closed"
	// CloseStillOpen: exhausted was asked for while packets remain; nothing changed.
	CloseStillOpen CloseOutcome = "open"
	// CloseMissing: Redis does not hold the activity.
	CloseMissing CloseOutcome = "missing"
	// CloseFenced: the activity is fenced after a rollback; nothing changed.
	CloseFenced CloseOutcome = "fenced"
)

// CloseResult says what Close found or did.
type CloseResult struct {
	Outcome CloseOutcome
	// Reason is why the activity closed.
	Reason CloseReason
	// Refunded is the unclaimed remainder handed to the sponsor.
	Refunded int64
}

// Close ends grabbing on every shard and refunds the remainder to the sponsor, in
// the same steps for any number of shards. An exhausted close happens only when a
// steady reading finds no packet listed or in transfer anywhere. Every shard is
// closed without a refund (close.lua), and then the one refund of the activity is
// written on shard 0 (refund_activity.lua, the only script that writes a refund): the
// total minus every shard's claimed amount, read after all of them closed, so
// packets left in a transfer journal are refunded too. A close that stopped between
// the two steps leaves the activity open for the next close to finish. Closing twice
// returns the first figures.
func (s *Activity) Close(ctx context.Context, reason CloseReason) (CloseResult, error) {
	root := s.shards[0]
	snap0, err := root.snapshot(ctx)
	if err != nil {
		return CloseResult{}, fmt.Errorf("shard 0: %w", err)
	}
	if snap0.activityRefunded {
		return CloseResult{Outcome: Closed, Reason: snap0.activityReason, Refunded: snap0.activityRefund}, nil
	}
	if reason == CloseExhausted {
		// Packets still journalled are on their way to a home shard: finish the moves
		// first, so that they are counted as listed.
		if _, err := s.Resolve(ctx); err != nil {
			return CloseResult{}, err
		}
		stock, steady, err := s.readStock(ctx)
		if err != nil {
			return CloseResult{}, err
		}
		for _, st := range stock {
			if st.listed > 0 || st.journal > 0 || !steady {
				return CloseResult{Outcome: CloseStillOpen}, nil
			}
		}
	}
	results, err := onEveryShard(s, func(a *Shard) (CloseResult, error) { return closeShard(ctx, a.c, a.keys, reason) })
	if err != nil {
		return CloseResult{}, err
	}
	for _, r := range results {
		if r.Outcome != Closed {
			return CloseResult{Outcome: r.Outcome}, nil
		}
	}
	// Every shard is closed: no claim can be added, so the claimed amounts are final.
	view, err := s.ReadShards(ctx)
	if err != nil {
		return CloseResult{}, err
	}
	if !view.Whole.Exists() {
		return CloseResult{Outcome: CloseMissing}, nil
	}
	for i, sh := range view.Shards {
		switch {
		case sh.Fenced != "":
			return CloseResult{Outcome: CloseFenced}, nil
		case sh.State != StateClosed:
			return CloseResult{}, fmt.Errorf("shard %d is %s after its close; the refund is not written", i, sh.State)
		}
	}
	refund := view.Whole.Total - view.Whole.ClaimedAmount
	why := results[0].Reason
	got, err := lua.RefundActivityScript.Run(ctx, root.c, []string{root.keys.Meta, root.keys.Stream}, refund, string(why)).Int64()
	if err != nil {
		return CloseResult{}, fmt.Errorf("writing the activity's refund on shard 0: %w", err)
	}
	return CloseResult{Outcome: Closed, Reason: why, Refunded: got}, nil
}

// closeShard runs close.lua on one shard: it ends grabbing there for good and records
// the claimed amount, writing no refund (the activity's one refund is
// refund_activity's, Activity.Close).
func closeShard(ctx context.Context, c redis.Scripter, k Keys, reason CloseReason) (CloseResult, error) {
	vals, err := lua.CloseScript.Run(ctx, c, []string{k.Meta, k.Packets}, string(reason)).Slice()
	if err != nil {
		return CloseResult{}, fmt.Errorf("close script: %w", err)
	}
	if len(vals) != 2 {
		return CloseResult{}, fmt.Errorf("close script: %d values in reply, want 2", len(vals))
	}
	res, _ := vals[0].(string)
	why, _ := vals[1].(string)
	return CloseResult{Outcome: CloseOutcome(res), Reason: CloseReason(why)}, nil
}
