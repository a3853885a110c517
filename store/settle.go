package store

import (
	"context"
	"fmt"
	"sort"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// Settlement entry kinds.
const (
	KindGrant  = "grant"
	KindRefund = "refund"
	// KindCreate is a budget packet's creation record (packet_create.lua): settlement
	// books it in the operator's ledger and delivers nothing for it.
	KindCreate = "create"
)

// ack acknowledges a delivered stream entry and counts it as settled. It returns
// false when the entry had been acknowledged before, so nothing is counted twice.
func (s *Stream) ack(ctx context.Context, group, entryID, kind string, amount int64) (bool, error) {
	k := s.keys
	n, err := lua.SettleAckScript.Run(ctx, s.c, []string{k.Meta, k.Stream}, group, entryID, kind, amount).Int64()
	if err != nil {
		return false, fmt.Errorf("settle ack of %s: %w", entryID, err)
	}
	return n == 1, nil
}

// deadLetter parks an undeliverable entry with its fields and the last error. It
// returns false when the entry had been acknowledged before.
func (s *Stream) deadLetter(ctx context.Context, group, entryID, lastErr string, fields map[string]any) (bool, error) {
	k := s.keys
	args := []any{group, entryID, lastErr}
	for _, f := range deadLetterFields(fields) {
		args = append(args, f, fields[f])
	}
	n, err := lua.DeadLetterScript.Run(ctx, s.c, []string{k.Meta, k.Stream, k.DeadLetters}, args...).Int64()
	if err != nil {
		return false, fmt.Errorf("dead-letter of %s: %w", entryID, err)
	}
	return n == 1, nil
}

// Ack acknowledges a delivered stream entry and counts it as settled, once.
func (s *Stream) Ack(ctx context.Context, group, entryID, kind string, amount int64) (bool, error) {
	return s.ack(ctx, group, entryID, kind, amount)
}

// DeadLetter parks an undeliverable entry with its fields and the last error, once.
func (s *Stream) DeadLetter(ctx context.Context, group, entryID, lastErr string, fields map[string]any) (bool, error) {
	return s.deadLetter(ctx, group, entryID, lastErr, fields)
}

// maxDeadLetterFields is the most fields of an entry a dead letter keeps: the cap of
// dead_letter.lua (64 field/value pairs). A genuine entry has one to seven; one with
// more was written by someone else and is parked with the first of them.
const maxDeadLetterFields = 64

// deadLetterFields are the names of the fields a dead letter keeps, in order: all
// of them, or the first maxDeadLetterFields by name.
func deadLetterFields(fields map[string]any) []string {
	names := make([]string, 0, len(fields))
	for f := range fields {
		names = append(names, f)
	}
	sort.Strings(names)
	if len(names) > maxDeadLetterFields {
		names = names[:maxDeadLetterFields]
	}
	return names
}

// AckRequest is one delivered entry to acknowledge (Shard.AckMany).
type AckRequest struct {
	EntryID, Kind string
	Amount        int64
}

// AckResult is what acknowledging one entry came to: Settled when this call counted
// it (false: it had been acknowledged before), or the error.
type AckResult struct {
	Settled bool
	Err     error
}

// AckMany acknowledges delivered entries in one round trip: settle_ack.lua for each,
// pipelined, every call its own atomic step exactly as Ack's, so each entry is
// counted once whatever happens to the others. An entry whose call Redis did not
// know the script for is acknowledged again on its own (Ack, which falls back to
// EVAL). The results are in the order of reqs.
func (s *Stream) AckMany(ctx context.Context, group string, reqs []AckRequest) []AckResult {
	out := make([]AckResult, len(reqs))
	k := s.keys
	pipe := s.c.Pipeline()
	cmds := make([]*redis.Cmd, len(reqs))
	for i, r := range reqs {
		cmds[i] = pipe.EvalSha(ctx, lua.SettleAckScript.SHA(), []string{k.Meta, k.Stream}, group, r.EntryID, r.Kind, r.Amount)
	}
	_, _ = pipe.Exec(ctx) // each command carries its own error
	for i, r := range reqs {
		n, err := cmds[i].Int64()
		switch {
		case lua.IsNoScript(err):
			out[i].Settled, out[i].Err = s.ack(ctx, group, r.EntryID, r.Kind, r.Amount)
		case err != nil:
			out[i].Err = fmt.Errorf("settle ack of %s: %w", r.EntryID, err)
		default:
			out[i].Settled = n == 1
		}
	}
	return out
}
