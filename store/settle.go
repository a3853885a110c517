package store

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// Settlement entry kinds.
const (
	KindGrant  = "grant"
	KindRefund = "refund"
)

// ack acknowledges a delivered stream entry and counts it as settled. It returns
// false when the entry had been acknowledged before, so nothing is counted twice.
func ack(ctx context.Context, c redis.Scripter, k Keys, group, entryID, kind string, amount int64) (bool, error) {
	n, err := lua.SettleAckScript.Run(ctx, c, []string{k.Meta, k.Stream}, group, entryID, kind, amount).Int64()
	if err != nil {
		return false, fmt.Errorf("settle ack of %s: %w", entryID, err)
	}
	return n == 1, nil
}

// deadLetter parks an undeliverable entry with its fields and the last error. It
// returns false when the entry had been acknowledged before.
func deadLetter(ctx context.Context, c redis.Scripter, k Keys, group, entryID, lastErr string, fields map[string]any) (bool, error) {
	args := []any{group, entryID, lastErr}
	for f, v := range fields {
		args = append(args, f, v)
	}
	n, err := lua.DeadLetterScript.Run(ctx, c, []string{k.Meta, k.Stream, k.DeadLetters}, args...).Int64()
	if err != nil {
		return false, fmt.Errorf("dead-letter of %s: %w", entryID, err)
	}
	return n == 1, nil
}

// Ack acknowledges a delivered stream entry and counts it as settled, once.
func (a *Shard) Ack(ctx context.Context, group, entryID, kind string, amount int64) (bool, error) {
	return ack(ctx, a.c, a.keys, group, entryID, kind, amount)
}

// DeadLetter parks an undeliverable entry with its fields and the last error, once.
func (a *Shard) DeadLetter(ctx context.Context, group, entryID, lastErr string, fields map[string]any) (bool, error) {
	return deadLetter(ctx, a.c, a.keys, group, entryID, lastErr, fields)
}
