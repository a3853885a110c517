package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// watcher is a client that can run optimistic transactions (WATCH, MULTI, EXEC): a
// plain or cluster client, not the auto-pipeliner.
type watcher interface {
	Watch(ctx context.Context, fn func(*redis.Tx) error, keys ...string) error
}

// errStageByScript says a chunk must go through seed_stage.lua: the staging list
// belongs to another split, which only the script may discard.
var errStageByScript = errors.New("staging holds another split")

// stageDirect appends one chunk of packets to staging with a plain RPUSH inside an
// optimistic transaction, with the same guarantees as seed_stage.lua at a fraction of
// its server time (the script copies every packet into Lua and back, which is most of
// its cost): WATCH meta and staging, read that the activity is not committed, that
// staging holds this split's fingerprint and ends exactly at offset, then MULTI,
// RPUSH, EXEC. EXEC does nothing when either key changed after the WATCH (another
// seeder appended, the commit renamed staging), and the chunk is tried again from
// what Redis then holds, so it lands once, at its offset. It returns what
// seed_stage.lua returns: -1 when the activity is committed, else the staging length
// after the call.
func stageDirect(ctx context.Context, w watcher, k Keys, offset int64, fp string, packets []any) (int64, error) {
	for {
		var n int64
		err := w.Watch(ctx, func(tx *redis.Tx) error {
			pipe := tx.Pipeline()
			committed := pipe.HExists(ctx, k.Meta, fieldState)
			stagingFP := pipe.HGet(ctx, k.Meta, fieldStagingFP)
			staged := pipe.LLen(ctx, k.Staging)
			if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
				return err
			}
			switch {
			case committed.Val():
				n = -1
				return nil
			case stagingFP.Val() != fp:
				return errStageByScript
			case staged.Val() != offset:
				n = staged.Val()
				return nil
			}
			_, err := tx.TxPipelined(ctx, func(p redis.Pipeliner) error {
				p.RPush(ctx, k.Staging, packets...)
				return nil
			})
			n = offset + int64(len(packets))
			return err
		}, k.Meta, k.Staging)
		switch {
		case errors.Is(err, redis.TxFailedErr):
			continue
		case err != nil:
			return 0, fmt.Errorf("seed stage at %d: %w", offset, err)
		}
		return n, nil
	}
}
