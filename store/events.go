package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// The events of a RedPacketBudget's packets (docs/budgets.md, "Events"). They are
// derived, never written by the grab path: a consumer group of its own on each budget
// shard's settlement stream (EventsGroup) reads the same entries settlement reads,
// after settlement decided them, and the operator's ledger says what each entry
// was: a packet's account booked from its creation record (packet.created), the last
// share credited (packet.exhausted), the refund credited (packet.expired), and the
// packet forgotten once its refund was delivered (packet.refunded). Which events of a
// packet were delivered is the account's "ev" field (events_mark.lua), so that none is
// sent again and none before its predecessors. Events that could not be delivered go
// to the budget's events dead letters, rpl:{<uid>}:evdead, on the ledger's Redis,
// capped at EventDeadLettersCap entries and kept the ledger's retention after the
// last one.

// EventsGroup is the consumer group that reads a budget shard's settlement stream
// for its events; it is not the settlement group and acknowledges nothing of it.
const EventsGroup = "events"

// EventDeadLettersCap bounds a budget's events dead letters (XADD MAXLEN ~).
const EventDeadLettersCap = 10000

// EnsureEventsGroup creates the consumer group group on the stream for a budget's
// events (ensure_group.lua, "end"): at the stream's end when the stream exists, so that a
// webhook set on a budget that ran before is told what happens from then on, at the
// start of a new stream otherwise. A group that exists already is left as it is.
// live says the caller knows the budget is live (its reconcile, which creates the
// groups before a new budget's shards are configured); otherwise, when neither the
// shard nor its stream is in Redis (purged), nothing is created and the error wraps
// ErrMissing.
func (s *Stream) EnsureEventsGroup(ctx context.Context, group string, live bool) error {
	mode := ""
	if live {
		mode = "live"
	}
	res, err := lua.EnsureGroupScript.Run(ctx, s.c, []string{s.keys.Meta, s.keys.Stream}, group, "end", mode).Text()
	if err != nil {
		return fmt.Errorf("creating consumer group %s on %s: %w", group, s.keys.Stream, err)
	}
	if res == string(Missing) {
		return fmt.Errorf("creating consumer group %s on %s: %w", group, s.keys.Stream, ErrMissing)
	}
	return nil
}

// AckGroup acknowledges ids in group and counts nothing: a group that only reads the
// stream (EventsGroup), never the settlement group (settle_ack.lua counts).
func (s *Stream) AckGroup(ctx context.Context, group string, ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	if err := s.c.XAck(ctx, s.keys.Stream, group, ids...).Err(); err != nil {
		return groupErr("acknowledging "+strconv.Itoa(len(ids))+" entries of group "+group, err)
	}
	return nil
}

// Unfinished says which of ids group has not finished with: not handed out yet (after
// the group's last delivered id) or handed out and not acknowledged (pending). An
// entry the settlement group finished with was delivered and acknowledged, or
// dead-lettered. The error wraps ErrNoGroup when the group does not exist.
func (s *Stream) Unfinished(ctx context.Context, group string, ids []string) (map[string]bool, error) {
	out := map[string]bool{}
	if len(ids) == 0 {
		return out, nil
	}
	groups, err := s.c.XInfoGroups(ctx, s.keys.Stream).Result()
	if err != nil {
		return nil, fmt.Errorf("reading the consumer groups of %s: %w", s.keys.Stream, err)
	}
	last, found := "", false
	for _, g := range groups {
		if g.Name == group {
			last, found = g.LastDeliveredID, true
		}
	}
	if !found {
		return nil, fmt.Errorf("reading group %s of %s: %w", group, s.keys.Stream, ErrNoGroup)
	}
	lo, hi := ids[0], ids[0]
	for _, id := range ids {
		if compareStreamIDs(id, lo) < 0 {
			lo = id
		}
		if compareStreamIDs(id, hi) > 0 {
			hi = id
		}
		if compareStreamIDs(id, last) > 0 {
			out[id] = true
		}
	}
	if compareStreamIDs(lo, last) > 0 {
		return out, nil
	}
	pending, err := s.c.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: s.keys.Stream, Group: group,
		Start: lo, End: hi, Count: 100_000}).Result()
	if err != nil {
		return nil, groupErr("reading the pending entries of group "+group, err)
	}
	want := make(map[string]bool, len(ids))
	for _, id := range ids {
		want[id] = true
	}
	for _, p := range pending {
		if want[p.ID] {
			out[p.ID] = true
		}
	}
	return out, nil
}

// PacketAccount is what a budget's ledger holds of one packet, as its events need it.
type PacketAccount struct {
	// Known is false when the ledger holds no account of the packet (no creation
	// record was booked, or the ledger forgot it); the rest is then empty.
	Known bool
	// Sender, Total, Count, CreatedAt and ExpiresAt are the account's, booked from the
	// packet's creation record.
	Sender    string
	Total     int64
	Count     int64
	CreatedAt time.Time
	ExpiresAt time.Time
	// Sent are the letters of the events delivered (or dead-lettered) so far.
	Sent string
	// Credits are the asked shares (and RefundShare) the ledger credited.
	Credits map[string]PacketCredit
}

// PacketAccounts reads the accounts of the packets asked for, each with the credits
// of the shares asked (a share index, or RefundShare): one pipelined HMGET and
// HSTRLEN per packet.
func (l *BudgetLedger) PacketAccounts(ctx context.Context, asked map[string][]string) (map[string]PacketAccount, error) {
	out := make(map[string]PacketAccount, len(asked))
	if len(asked) == 0 {
		return out, nil
	}
	type reads struct {
		fields *redis.SliceCmd
		shares *redis.IntCmd
	}
	cmds := make(map[string]reads, len(asked))
	pipe := l.c.Pipeline()
	for id, shares := range asked {
		fields := append([]string{OpenShare, "ev"}, shares...)
		cmds[id] = reads{fields: pipe.HMGet(ctx, l.PacketKey(id), fields...), shares: pipe.HStrLen(ctx, l.PacketKey(id), "sh")}
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("reading %d packet accounts of %s: %w", len(asked), l.key, err)
	}
	for id, shares := range asked {
		vals := cmds[id].fields.Val()
		open, _ := vals[0].(string)
		if open == "" {
			out[id] = PacketAccount{}
			continue
		}
		parts := strings.SplitN(open, ":", 4)
		if len(parts) != 4 {
			return nil, fmt.Errorf("the account of packet %q holds %q, not <total>:<created>:<expires>:<sender>", id, open)
		}
		total, err1 := strconv.ParseInt(parts[0], 10, 64)
		created, err2 := strconv.ParseInt(parts[1], 10, 64)
		expires, err3 := strconv.ParseInt(parts[2], 10, 64)
		if err := errors.Join(err1, err2, err3); err != nil {
			return nil, fmt.Errorf("the account of packet %q holds %q: %w", id, open, err)
		}
		a := PacketAccount{Known: true, Sender: parts[3], Total: total, Count: cmds[id].shares.Val() / 15,
			CreatedAt: time.UnixMilli(created).UTC(), ExpiresAt: time.UnixMilli(expires).UTC(), Credits: map[string]PacketCredit{}}
		a.Sent, _ = vals[1].(string)
		for i, share := range shares {
			record, _ := vals[2+i].(string)
			if record == "" {
				continue
			}
			c, err := parsePacketCredit(id, share, record)
			if err != nil {
				return nil, fmt.Errorf("the ledger of packet %q: %w", id, err)
			}
			a.Credits[share] = c
		}
		out[id] = a
	}
	return out, nil
}

// MarkEvents adds letters (one per event) to what the packet's account says was
// delivered (events_mark.lua); an account the ledger no longer holds is left alone.
func (l *BudgetLedger) MarkEvents(ctx context.Context, packetID, letters string) error {
	err := lua.EventsMarkScript.Run(ctx, l.c, []string{l.PacketKey(packetID)}, letters).Err()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("recording events %q of packet %q: %w", letters, packetID, err)
	}
	return nil
}

// EventDeadLettersKey is the budget's events dead letters.
func (l *BudgetLedger) EventDeadLettersKey() string { return "rpl:{" + l.uid + "}:evdead" }

// DeadLetterEvent parks an event that could not be delivered: its Idempotency-Key,
// its body and why, in the budget's events dead letters (capped at
// EventDeadLettersCap, oldest dropped first), which are kept the ledger's retention
// after the last one, like a packet's account.
func (l *BudgetLedger) DeadLetterEvent(ctx context.Context, key, body, why string) error {
	pipe := l.c.TxPipeline()
	pipe.XAdd(ctx, &redis.XAddArgs{Stream: l.EventDeadLettersKey(), MaxLen: EventDeadLettersCap, Approx: true,
		Values: []any{"key", key, "body", body, "error", why}})
	pipe.PExpire(ctx, l.EventDeadLettersKey(), l.retention)
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("dead-lettering event %s: %w", key, err)
	}
	return nil
}

// EventDeadLetter is one parked event.
type EventDeadLetter struct {
	Key, Body, Error string
}

// EventDeadLetters reads the budget's events dead letters, oldest first.
func (l *BudgetLedger) EventDeadLetters(ctx context.Context) ([]EventDeadLetter, error) {
	msgs, err := l.c.XRange(ctx, l.EventDeadLettersKey(), "-", "+").Result()
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", l.EventDeadLettersKey(), err)
	}
	out := make([]EventDeadLetter, 0, len(msgs))
	for _, m := range msgs {
		key, _ := m.Values["key"].(string)
		body, _ := m.Values["body"].(string)
		why, _ := m.Values["error"].(string)
		out = append(out, EventDeadLetter{Key: key, Body: body, Error: why})
	}
	return out, nil
}

// ForgottenAt is, for each packet of ids that settlement forgot once its refund was
// delivered (or that expired fully grabbed), when its tombstone was made: one
// pipelined HGET per packet. A packet still whole, or gone, is absent.
func (b *Budget) ForgottenAt(ctx context.Context, ids []string) (map[string]time.Time, error) {
	out := map[string]time.Time{}
	if len(ids) == 0 {
		return out, nil
	}
	cmds := make([]*redis.StringCmd, len(ids))
	pipe := b.c.Pipeline()
	for i, id := range ids {
		cmds[i] = pipe.HGet(ctx, b.keys[b.ShardOf(id)].Packet(id), "f")
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("reading when %d packets were forgotten: %w", len(ids), err)
	}
	for i, id := range ids {
		if ms, err := strconv.ParseInt(cmds[i].Val(), 10, 64); err == nil && ms > 0 {
			out[id] = time.UnixMilli(ms).UTC()
		}
	}
	return out, nil
}
