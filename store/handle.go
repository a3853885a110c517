package store

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
)

// Shard is one activity's data in Redis, and the one way the rest of the project
// reaches it: every Redis call about an activity (the scripts, the snapshot, the
// claims, the settlement stream and its consumer group, the server clock, purging)
// is a method here, built from a client and the activity's UID. Outside this package
// nothing issues a Redis command; clients are opened here too (Conn.NewClient,
// Conn.NewPipelinedClient).
//
// The client may be a plain or cluster client, or the grab path's auto-pipeliner:
// every key of an activity shares one hash tag, so every call lands on one slot.
// The consumer-group reads block for a while, so settlement uses a plain client of
// its own, never the auto-pipeliner.
type Shard struct {
	c    redis.Cmdable
	keys Keys
	// grabCall is the grab script's call on keys, its fixed arguments boxed once.
	grabCall *grabCall
	// Seeder stages and commits the packets; its zero value is what production uses.
	Seeder Seeder
}

// NewShard returns the handle of the activity with the given UID on client c.
func NewShard(c redis.Cmdable, uid string) *Shard {
	k := KeysFor(uid)
	return &Shard{c: c, keys: k, grabCall: newGrabCall(k)}
}

// Keys are the activity's keys.
func (a *Shard) Keys() Keys { return a.keys }

// Grab decides one claim for userID (grab.lua), checking no watermark.
func (a *Shard) Grab(ctx context.Context, userID string) (GrabResult, error) {
	return a.grabCall.grab(ctx, a.c, userID, Watermark{})
}

// GrabAbove decides one claim for userID on a Redis that must not be below mark: a
// Redis that rolled back below it is fenced and the answer is Fenced (grab.lua).
func (a *Shard) GrabAbove(ctx context.Context, userID string, mark Watermark) (GrabResult, error) {
	return a.grabCall.grab(ctx, a.c, userID, mark)
}

// Seed stages and commits the packets exactly once (see Seeder).
func (a *Shard) Seed(ctx context.Context, amounts []int64, p SeedParams) (SeedResult, error) {
	return a.Seeder.Seed(ctx, a.c, a.keys, amounts, p)
}

// Configure writes the schedule and pause flag; open moves a ready activity to open.
func (a *Shard) Configure(ctx context.Context, startMs, endMs int64, paused, open bool) (ConfigureResult, error) {
	return Configure(ctx, a.c, a.keys, startMs, endMs, paused, open)
}

// ConfigureWith writes the settings: the schedule, the pause flag, opening, and the
// refund's payee and the currency of later settlement entries. It writes nothing to
// a fenced activity.
func (a *Shard) ConfigureWith(ctx context.Context, st Settings) (ConfigureResult, error) {
	return ConfigureWith(ctx, a.c, a.keys, st)
}

// Fence stops the activity after a rollback; see Fence.
func (a *Shard) Fence(ctx context.Context, why string) (string, error) {
	return Fence(ctx, a.c, a.keys, why)
}

// Accept lifts the fence and starts a new epoch, provided Redis is at epoch seen.
func (a *Shard) Accept(ctx context.Context, seen int64) (int64, error) {
	return Accept(ctx, a.c, a.keys, seen)
}

// Close ends grabbing for the given reason and refunds the remainder.
func (a *Shard) Close(ctx context.Context, reason CloseReason) (CloseResult, error) {
	return Close(ctx, a.c, a.keys, reason)
}

// Snapshot reads every counter of the activity at one instant.
func (a *Shard) Snapshot(ctx context.Context) (Snapshot, error) {
	return ReadSnapshot(ctx, a.c, a.keys)
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

// Purge deletes every key of the activity.
func (a *Shard) Purge(ctx context.Context) error { return Purge(ctx, a.c, a.keys) }

// PurgeKeepingUnsettled deletes the activity's keys except the settlement and
// dead-letter streams, kept for retention; it returns the keys kept.
func (a *Shard) PurgeKeepingUnsettled(ctx context.Context, retention time.Duration) ([]string, error) {
	return PurgeKeepingUnsettled(ctx, a.c, a.keys, retention)
}

// Ack acknowledges a delivered stream entry and counts it as settled, once.
func (a *Shard) Ack(ctx context.Context, group, entryID, kind string, amount int64) (bool, error) {
	return Ack(ctx, a.c, a.keys, group, entryID, kind, amount)
}

// DeadLetter parks an undeliverable entry with its fields and the last error, once.
func (a *Shard) DeadLetter(ctx context.Context, group, entryID, lastErr string, fields map[string]any) (bool, error) {
	return DeadLetter(ctx, a.c, a.keys, group, entryID, lastErr, fields)
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
