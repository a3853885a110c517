package store

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// Purge deletes every key of every shard, and the operator's ledger of the
// activity.
func (s *Activity) Purge(ctx context.Context) error {
	if err := s.eachShard(func(_ int, a *Shard) error { return purge(ctx, a.c, a.keys) }); err != nil {
		return err
	}
	return s.Ledger().purge(ctx)
}

// PurgeKeepingUnsettled purges every shard but its settlement and dead-letter
// streams (purgeKeepingUnsettled), keeps the operator's ledger of the activity for
// as long (what was credited, for the entries still to be replayed), and returns the
// keys kept.
func (s *Activity) PurgeKeepingUnsettled(ctx context.Context, retention time.Duration) ([]string, error) {
	kept, err := onEveryShard(s, func(a *Shard) ([]string, error) {
		return purgeKeepingUnsettled(ctx, a.c, a.keys, retention)
	})
	var all []string
	for _, k := range kept {
		all = append(all, k...)
	}
	if err != nil {
		return all, err
	}
	l := s.Ledger()
	ok, err := l.keepFor(ctx, retention)
	if ok {
		all = append(all, l.Key())
	}
	return all, err
}

// purge deletes every key of one shard with UNLINK: the memory of a large
// activity (millions of packets and claims) is freed off the event loop, so a shared
// Redis does not stall while it goes.
func purge(ctx context.Context, c redis.Cmdable, k Keys) error {
	// One UNLINK per key keeps cluster clients happy whatever their slot checks.
	for _, key := range k.All() {
		if err := c.Unlink(ctx, key).Err(); err != nil {
			return fmt.Errorf("deleting %s: %w", key, err)
		}
	}
	return nil
}

// purgeKeepingUnsettled deletes one shard's keys except its settlement stream and
// dead-letter stream, which still record claims and refunds that were never
// credited; those two are kept for retention, then expire. It returns the keys kept.
func purgeKeepingUnsettled(ctx context.Context, c redis.Cmdable, k Keys, retention time.Duration) ([]string, error) {
	for _, key := range []string{k.Meta, k.Staging, k.Packets, k.Claims, k.Transfers, k.Applied} {
		if err := c.Unlink(ctx, key).Err(); err != nil {
			return nil, fmt.Errorf("deleting %s: %w", key, err)
		}
	}
	var kept []string
	for _, key := range []string{k.Stream, k.DeadLetters} {
		ok, err := c.Expire(ctx, key, retention).Result()
		if err != nil {
			return nil, fmt.Errorf("setting the retention of %s: %w", key, err)
		}
		if ok {
			kept = append(kept, key)
		}
	}
	return kept, nil
}
