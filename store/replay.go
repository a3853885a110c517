package store

import (
	"context"
	"fmt"

	"redpacket.io/operator/lua"
)

// replayDead moves up to limit (>= 1) of the oldest dead-lettered entries back into the
// activity's stream as new entries, deletes them from the dead-letter stream and
// lowers dead_count by as many, in one atomic step. It returns how many it moved.
func (s *Stream) replayDead(ctx context.Context, limit int) (int, error) {
	k := s.keys
	if limit < 1 {
		return 0, fmt.Errorf("replaying dead letters: limit %d, want at least 1", limit)
	}
	n, err := s.call(ctx, lua.ReplayDeadScript, []string{k.Meta, k.Stream, k.DeadLetters, k.claims}, limit).Int64()
	if err != nil {
		return 0, fmt.Errorf("replay dead letters: %w", err)
	}
	return int(n), nil
}

// replayChunk is how many dead letters one atomic replay step moves, so a large
// replay never blocks Redis for long; replay_dead.lua moves no more than this per
// call whatever it is asked.
const replayChunk = 500

// ReplayDeadLetters moves up to max dead-lettered entries (all of them when max <= 0)
// back into the activity's settlement stream, oldest first, and returns how many it
// moved.
//
// Each entry is moved atomically, in steps of at most 500 (replayDead): it is
// appended to the stream as a new entry with its original fields (a grant's packed
// field, plus an "at" field with the original entry's time, or the refund's kind,
// packet, user, amount, currency and at), deleted from the dead-letter stream, and the activity's
// dead_count (status deadLetterCount) goes down by one. The running settlement
// workers then deliver it again like any new claim, with the same Idempotency-Key as
// before, so the balance system credits it at most once even if an earlier delivery
// did reach it. Fix the cause first (the balance system rejected the delivery, see
// the "error" field of each entry in the dead-letter stream, rpa:{<uid>}:dead); an
// entry that fails again maxAttempts times goes back to the dead-letter stream.
//
// Operators run it through the grab binary's replay-dead-letters command; it is
// safe to run while workers are delivering and to run twice.
func (s *Stream) ReplayDeadLetters(ctx context.Context, max int) (int, error) {
	moved := 0
	for max <= 0 || moved < max {
		n := replayChunk
		if max > 0 {
			n = min(n, max-moved)
		}
		got, err := s.replayDead(ctx, n)
		if err != nil {
			return moved, fmt.Errorf("replaying dead letters after %d moved: %w", moved, err)
		}
		moved += got
		if got < n {
			break
		}
	}
	return moved, nil
}

// ReplayDeadLetters moves up to max dead letters of every shard back into its
// settlement stream (Shard.ReplayDeadLetters), shard by shard, and returns how
// many moved in all; max <= 0 means all of them.
func (s *Activity) ReplayDeadLetters(ctx context.Context, max int) (int, error) {
	moved := 0
	for i, a := range s.shards {
		left := 0
		if max > 0 {
			if left = max - moved; left <= 0 {
				break
			}
		}
		n, err := a.ReplayDeadLetters(ctx, left)
		moved += n
		if err != nil {
			return moved, fmt.Errorf("shard %d: %w", i, err)
		}
	}
	return moved, nil
}
