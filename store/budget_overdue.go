package store

import (
	"context"
	"fmt"
	"time"
)

// OverdueAge is how long the oldest entry of any of the budget's due indexes has
// been due, by the Redis clock: the wait of the packet the expiry driver has left
// longest, 0 when no entry is due. It reads each shard's lowest score (ZRANGE 0 0,
// O(log N)) and the clock once, so it is cheap enough for every expiry pass. An
// entry is read by its score alone: a packet forged into the index with an old
// score counts as overdue from that score until the driver takes it out.
func (b *Budget) OverdueAge(ctx context.Context) (time.Duration, error) {
	now, err := b.c.Time(ctx).Result()
	if err != nil {
		return 0, fmt.Errorf("reading the Redis clock for the budget's overdue age: %w", err)
	}
	nowMs := now.UnixMilli()
	var oldest time.Duration
	for i, k := range b.keys {
		zs, err := b.c.ZRangeWithScores(ctx, k.Due, 0, 0).Result()
		if err != nil {
			return 0, fmt.Errorf("reading budget shard %d's oldest due packet: %w", i, err)
		}
		if len(zs) == 0 || zs[0].Score > float64(nowMs) {
			continue
		}
		// A score below 0 (a forged -inf) reads as 0: the age stays a valid duration.
		due := int64(max(zs[0].Score, 0))
		if age := time.Duration(nowMs-due) * time.Millisecond; age > oldest {
			oldest = age
		}
	}
	return oldest, nil
}
