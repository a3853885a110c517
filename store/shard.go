package store

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// Shard is one shard of an activity: the keys under one hash tag, {<uid>} for an
// activity of one shard and {<uid>.<i>} for shard i of more, on a client. The
// activity's handle (Activity) owns its shards and is the one way the rest of the
// project reaches an activity; a Shard is what Activity.Shard(i) hands out for the
// calls that are one shard's own: its grabs, its claims, its settlement stream
// (the Stream it embeds) and its server's clock and durability.
//
// The client may be a plain or cluster client, or the grab path's auto-pipeliner:
// every key of a shard shares one hash tag, so every call lands on one slot. The
// consumer-group reads block for a while, so settlement uses a plain client of its
// own, never the auto-pipeliner.
type Shard struct {
	// Stream is the shard's settlement stream, consumer group and dead letters
	// (Activity.Stream(i) is the same): its calls are the shard's.
	*Stream
	c    redis.Cmdable
	keys Keys
	// grabCall is the grab function's call on keys, its fixed arguments boxed once.
	grabCall *grabCall
	// restores is set on the operator's handles (Activity.RestoreFunctions): a call
	// that finds the function library missing loads it and retries once.
	restores bool
}

// newShard returns the handle of the shard whose hash tag is {<uid>} on client c.
func newShard(c redis.Cmdable, uid string) *Shard {
	k := keysFor(uid)
	return &Shard{Stream: streamOf(c, k), c: c, keys: k, grabCall: newGrabCall(k)}
}

// Keys are the shard's keys, for checks that reach past the scripts (a test that
// deletes a key to stand for lost data, a benchmark of the raw commands).
func (a *Shard) Keys() Keys { return a.keys }

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

// LoadScripts loads the operator's scripts into the script cache and the grab-side
// function library (lua.GrabLibrary), on every master of a cluster. It needs a plain
// or cluster client (not a pipeliner). The operator's scripts fall back to EVAL
// anyway; the grab side's functions work only once the library is loaded.
func (a *Shard) LoadScripts(ctx context.Context) error {
	u, ok := a.c.(redis.UniversalClient)
	if !ok {
		return fmt.Errorf("loading scripts needs a plain or cluster client, not %T", a.c)
	}
	return lua.LoadAll(ctx, u)
}
