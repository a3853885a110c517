package store

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
)

// Shard is one shard of an activity: the keys under one hash tag, {<uid>} for an
// activity of one shard and {<uid>.<i>} for shard i of more, on a client. The
// activity's handle (Activity) owns its shards and is the one way the rest of the
// project reaches an activity; a Shard is what Activity.Shard(i) hands out for the
// calls that are one shard's own: its grabs, its claims, its settlement stream and
// consumer group, and its server's clock and durability.
//
// The client may be a plain or cluster client, or the grab path's auto-pipeliner:
// every key of a shard shares one hash tag, so every call lands on one slot. The
// consumer-group reads block for a while, so settlement uses a plain client of its
// own, never the auto-pipeliner.
type Shard struct {
	c    redis.Cmdable
	keys Keys
	// grabCall is the grab script's call on keys, its fixed arguments boxed once.
	grabCall *grabCall
}

// newShard returns the handle of the shard whose hash tag is {<uid>} on client c.
func newShard(c redis.Cmdable, uid string) *Shard {
	k := keysFor(uid)
	return &Shard{c: c, keys: k, grabCall: newGrabCall(k)}
}

// Keys are the shard's keys, for checks that reach past the scripts (a test that
// deletes a key to stand for lost data, a benchmark of the raw commands).
func (a *Shard) Keys() Keys { return a.keys }

// Grab decides one claim for userID (grab.lua), checking no watermark. The user id
// travels as an ARGV, never a KEY.
func (a *Shard) Grab(ctx context.Context, userID string) (GrabResult, error) {
	return a.grabCall.grab(ctx, a.c, userID, Watermark{})
}

// GrabAbove decides one claim for userID on a Redis that must not be below mark: a
// Redis that rolled back below it is fenced and the answer is Fenced (grab.lua).
func (a *Shard) GrabAbove(ctx context.Context, userID string, mark Watermark) (GrabResult, error) {
	return a.grabCall.grab(ctx, a.c, userID, mark)
}

// snapshot reads every counter of the shard at one instant.
func (a *Shard) snapshot(ctx context.Context) (Snapshot, error) {
	return readSnapshot(ctx, a.c, a.keys)
}

// Time is the Redis server's clock, the one the grab script gates on.
func (a *Shard) Time(ctx context.Context) (time.Time, error) {
	t, err := a.c.Time(ctx).Result()
	if err != nil {
		return time.Time{}, fmt.Errorf("reading the Redis clock: %w", err)
	}
	return t, nil
}

// Ping checks that Redis answers.
func (a *Shard) Ping(ctx context.Context) error {
	if err := a.c.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("pinging Redis: %w", err)
	}
	return nil
}

// Claim is one user's entry in the claims hash: the packet the user holds.
type Claim struct {
	PacketID string
	Amount   int64
	// EntryID is the id of the settlement stream entry the grant wrote.
	EntryID string
}

// Claims reads the whole claims hash: who holds which packet, by user id. It reads
// every claim at once, so it is for checks after the fact (the demo's), not for a
// running activity's hot path.
func (a *Shard) Claims(ctx context.Context) (map[string]Claim, error) {
	raw, err := a.c.HGetAll(ctx, a.keys.Claims).Result()
	if err != nil {
		return nil, fmt.Errorf("reading the claims hash %s: %w", a.keys.Claims, err)
	}
	claims := make(map[string]Claim, len(raw))
	for user, v := range raw {
		c, ok := parseClaim(v)
		if !ok {
			return nil, fmt.Errorf("claims hash %s: user %q holds %q, not <packetId>:<amount>:<entryId>", a.keys.Claims, user, v)
		}
		claims[user] = c
	}
	return claims, nil
}

// Listed reads the shard's packets list: the packets not yet claimed, in the order
// grabs take them. It reads the whole list, so it is for checks after the fact.
func (a *Shard) Listed(ctx context.Context) ([]ListedPacket, error) {
	entries, err := a.c.LRange(ctx, a.keys.Packets, 0, -1).Result()
	if err != nil {
		return nil, fmt.Errorf("reading the packets list %s: %w", a.keys.Packets, err)
	}
	out := make([]ListedPacket, len(entries))
	for i, e := range entries {
		if out[i], err = parseListedPacket(e); err != nil {
			return nil, fmt.Errorf("packets list %s: %w", a.keys.Packets, err)
		}
	}
	return out, nil
}

// LoadScripts loads every script ahead of use, on every master of a cluster. It
// needs a plain or cluster client (not a pipeliner). The grab path falls back to
// EVAL anyway.
func (a *Shard) LoadScripts(ctx context.Context) error {
	u, ok := a.c.(redis.UniversalClient)
	if !ok {
		return fmt.Errorf("loading scripts needs a plain or cluster client, not %T", a.c)
	}
	return lua.LoadAll(ctx, u)
}

// Ack acknowledges a delivered stream entry and counts it as settled, once.
func (a *Shard) Ack(ctx context.Context, group, entryID, kind string, amount int64) (bool, error) {
	return ack(ctx, a.c, a.keys, group, entryID, kind, amount)
}

// DeadLetter parks an undeliverable entry with its fields and the last error, once.
func (a *Shard) DeadLetter(ctx context.Context, group, entryID, lastErr string, fields map[string]any) (bool, error) {
	return deadLetter(ctx, a.c, a.keys, group, entryID, lastErr, fields)
}

// Phase is the activity's phase as Redis and the server clock now say, and false
// when Redis cannot say: the activity is not in Redis, or is committed but not yet
// open (the resource's status knows better then). Both the controller and the grab
// service decide the phase here.
func (s Snapshot) Phase(now time.Time) (redpacketv1alpha1.Phase, bool) {
	switch s.State {
	case StateClosed:
		if s.CloseReason == CloseExhausted {
			return redpacketv1alpha1.PhaseExhausted, true
		}
		return redpacketv1alpha1.PhaseExpired, true
	case StateOpen:
		ms := now.UnixMilli()
		switch {
		case s.EndMs > 0 && ms >= s.EndMs:
			return redpacketv1alpha1.PhaseExpired, true
		case s.RemainingCount == 0:
			return redpacketv1alpha1.PhaseExhausted, true
		case s.Paused:
			return redpacketv1alpha1.PhasePaused, true
		case ms < s.StartMs:
			return redpacketv1alpha1.PhaseScheduled, true
		default:
			return redpacketv1alpha1.PhaseActive, true
		}
	}
	return "", false
}

// Counters are the snapshot's money counters, the status fields they are reported as.
func (s Snapshot) Counters() redpacketv1alpha1.Counters {
	return redpacketv1alpha1.Counters{
		RemainingCount:  s.RemainingCount,
		RemainingAmount: s.RemainingAmount(),
		ClaimedCount:    s.ClaimedCount,
		ClaimedAmount:   s.ClaimedAmount,
		RefundedAmount:  s.Refunded,
		SettledCount:    s.SettledCount,
		SettledAmount:   s.SettledAmount,
		DeadLetterCount: s.DeadCount,
	}
}

// RolledBack says how this snapshot of a Redis is older than what the status st
// already records, or "" when it is not. A Redis is older when it is fenced, when
// its epoch is below status.redisEpoch, when in the same epoch a cumulative counter
// is below the recorded one, or when it holds open an activity that the status
// records as closed. A snapshot of a later epoch than the status is not compared:
// the status has not caught up with an accept yet.
func (s Snapshot) RolledBack(st *redpacketv1alpha1.RedPacketActivityStatus) string {
	if !s.Exists() {
		return ""
	}
	if s.Fenced != "" {
		return "the activity is fenced in Redis (" + s.Fenced + ")"
	}
	var epoch int64
	if st.RedisEpoch != nil {
		epoch = *st.RedisEpoch
	}
	switch {
	case s.Epoch < epoch:
		return fmt.Sprintf("Redis is at epoch %d, status records epoch %d: it was restored from before an accepted rollback", s.Epoch, epoch)
	case s.Epoch > epoch:
		return ""
	}
	if recorded, ok := redpacketv1alpha1.RecordedCounters(st); ok {
		if why := s.Counters().Behind(recorded); why != "" {
			return why
		}
	}
	closed := st.Phase == redpacketv1alpha1.PhaseExhausted || st.Phase == redpacketv1alpha1.PhaseExpired
	if closed && s.State != StateClosed {
		return fmt.Sprintf("Redis holds the activity in state %q, status records it %s", s.State, st.Phase)
	}
	return ""
}
