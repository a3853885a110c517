package store

import "github.com/redis/go-redis/v9"

// Stream is one shard's settlement stream, with its consumer group and its dead
// letters, on a client: everything settlement does with a shard, for an activity's
// shard (Activity.Stream, or the Stream a Shard embeds) and a budget's
// (Budget.Stream) alike. Its entries are decoded into StreamEntry; what they may
// credit is the caller's to check (Shard.VerifyEntries for an activity, the
// budget's ledger for a budget).
//
// The keys are the shard's meta hash, which holds the settled and dead-letter
// counters settle_ack.lua and dead_letter.lua keep, the stream and the dead-letter
// stream, all under the shard's one hash tag, so every call lands on one slot. The
// consumer-group reads block for a while, so settlement uses a plain or cluster
// client of its own, never the grab path's auto-pipeliner.
type Stream struct {
	c    redis.Cmdable
	keys streamKeys
	// restores is set on the operator's handles: a library function (the replay of
	// dead letters) that finds the library missing loads it and is called once more.
	restores bool
}

// streamKeys are the keys of one shard's settlement.
type streamKeys struct {
	// Meta holds the settled and dead-letter counters.
	Meta string
	// Stream is the settlement stream, DeadLetters the dead-letter stream.
	Stream, DeadLetters string
	// claims is the hash replay_dead.lua moves a replayed grant's claim in: an
	// activity shard's claims hash; for a budget shard, which has no claims hash, a
	// key under the shard's tag that nothing writes (every key of one call must be in
	// one slot).
	claims string
}

// StreamKeys are the names of a settlement stream's keys, for checks that reach
// past the calls (a test that reads the stream's counters).
type StreamKeys struct {
	Meta, Stream, DeadLetters string
}

// Keys are the stream's keys.
func (s *Stream) Keys() StreamKeys {
	return StreamKeys{Meta: s.keys.Meta, Stream: s.keys.Stream, DeadLetters: s.keys.DeadLetters}
}

// streamOf is the settlement stream of an activity shard's keys on c.
func streamOf(c redis.Cmdable, k Keys) *Stream {
	return &Stream{c: c, keys: streamKeys{Meta: k.Meta, Stream: k.Stream, DeadLetters: k.DeadLetters, claims: k.Claims}}
}

// Stream is shard i's settlement stream.
func (s *Activity) Stream(i int) *Stream { return s.shards[i].Stream }

// Stream is budget shard i's settlement stream. It restores the function library
// when the budget's handle does (RestoreFunctions).
func (b *Budget) Stream(i int) *Stream {
	k := b.keys[i]
	return &Stream{c: b.c, restores: b.restores, keys: streamKeys{Meta: k.Meta, Stream: k.Stream,
		DeadLetters: k.DeadLetters, claims: k.packetPrefix[:len(k.packetPrefix)-2] + "noclaims"}}
}
