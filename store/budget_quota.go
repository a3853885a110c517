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

// A budget's quotas (spec.packets.quotas) limit, per sender, the packets created a
// minute and a day and the money they hold a day, and, per recipient, the shares
// grabbed a day across the budget. They are counted in Redis, in the same atomic
// step as the creation or the grant they count:
//
//	rpb:T:qd:<yyyymmdd>  hash  sender → "<packets>:<money>:<minute>:<packets>": what it
//	                           created that day, and in the last minute it created in
//	rpb:T:qr:<yyyymmdd>  hash  recipient → shares granted that day
//
// on the sender's (or the recipient's) home shard, T = {<uid>.<h>} with h =
// BudgetShardOf(who, shards): one place per person, whichever shards their packets
// land on, so the count is exact with any number of budget shards. The minute and
// the day are the grab service's (QuotaTimeAt: its clock, the day in the budget's
// time zone), written into the key names and the arguments, never Redis's clock.
// Each hash expires on its own an hour after its day ends, so the quota state is one
// field per sender or recipient active in the day, and nothing after.
//
// When the packet's shard is the home shard (always with one budget shard), or
// every shard is on one server (OnOneServer: a standalone Redis), packet_create or
// packet_grab checks and counts the quota itself: a refusal and the creation or
// grant are one step. On another shard, packet_quota takes the
// quota on the home shard first, then the creation or grab runs on the packet's
// shard, and a creation that did not create (a grab that did not grant) gives the
// quota back. Between the two steps the count is one ahead of what happened, never
// behind, so concurrent callers can never pass a limit; a caller that dies between
// them, or a Redis error on the second step, leaves that one use counted until the
// day (or the minute) ends: a quota may then allow one fewer, never one more. An
// answer existing (already_claimed) after a take is given back only for a packet
// created (a share granted) more than QuotaClockMargin before the take: one made
// after it may be this call's, whose first run's reply was lost and whose retry
// found it (the grab path's client retries a command once after a connection
// error), and stays counted.

// QuotaClockMargin is how far the Redis clocks of two masters may disagree without
// a quota passing its limit: an answer existing (already_claimed) after a take on
// another shard is taken for a packet (share) made before the take only when its
// time, on its master's clock, is more than this before the take's, on the home
// master's. A retry closer to its creation stays counted (one fewer allowed).
const QuotaClockMargin = time.Second

// Quotas are a budget's per-sender and per-recipient limits; 0 is no limit.
type Quotas struct {
	// PacketsPerMinute caps a sender's packets created in one minute (a calendar
	// minute on the grab service's clock).
	PacketsPerMinute int64
	// PacketsPerDay caps a sender's packets created in one day.
	PacketsPerDay int64
	// AmountPerDay caps the money of a sender's packets created in one day, in
	// minor units.
	AmountPerDay int64
	// SharesPerDay caps the shares one user grabs in one day, over every packet of
	// the budget.
	SharesPerDay int64
}

// Sender reports whether any per-sender quota is set.
func (q Quotas) Sender() bool {
	return q.PacketsPerMinute > 0 || q.PacketsPerDay > 0 || q.AmountPerDay > 0
}

// QuotaTime is the instant quotas count at: its minute and its calendar day in the
// budget's time zone.
type QuotaTime struct {
	// Minute is the unix minute (unix seconds / 60).
	Minute int64
	// Day is the calendar day in the zone, yyyymmdd.
	Day string
	// DayEnd is the start of the next day in the zone (a day is 23 or 25 hours
	// when the clocks change).
	DayEnd time.Time
}

// QuotaTimeAt is the quota time of t in loc (nil is UTC): the instant a creation or
// a grab at t on the caller's clock is counted at. It depends on nothing of the
// budget; it is a method so that callers outside the store go through the handle.
func (b *Budget) QuotaTimeAt(t time.Time, loc *time.Location) QuotaTime { return quotaTimeAt(t, loc) }

// quotaTimeAt is QuotaTimeAt.
func quotaTimeAt(t time.Time, loc *time.Location) QuotaTime {
	if loc == nil {
		loc = time.UTC
	}
	local := t.In(loc)
	start := time.Date(local.Year(), local.Month(), local.Day(), 0, 0, 0, 0, loc)
	return QuotaTime{Minute: t.Unix() / 60, Day: local.Format("20060102"), DayEnd: start.AddDate(0, 0, 1)}
}

// MinuteEnd is when the minute ends.
func (t QuotaTime) MinuteEnd() time.Time { return time.Unix((t.Minute+1)*60, 0) }

// dayExpiry is when a day's counters may go: an hour after the day ends (a grab pod
// whose clock lags a little still finds them).
func (t QuotaTime) dayExpiry() int64 { return t.DayEnd.Add(time.Hour).UnixMilli() }

// QuotaCheck is what a creation or a grab is counted against: the limits and the
// instant.
type QuotaCheck struct {
	Limits Quotas
	At     QuotaTime
}

// QuotaRefusal names the rule a creation or a grab broke.
type QuotaRefusal struct {
	// Rule is packetsPerMinute, packetsPerDay, amountPerDay or sharesPerDay.
	Rule string
	// Limit is the rule's limit.
	Limit int64
}

// Quota rules, as QuotaRefusal.Rule names them.
const (
	RulePacketsPerMinute = "packetsPerMinute"
	RulePacketsPerDay    = "packetsPerDay"
	RuleAmountPerDay     = "amountPerDay"
	RuleSharesPerDay     = "sharesPerDay"
)

// Quota outcomes: a creation or a grab that a quota refused; nothing was written.
const (
	CreateQuotaExceeded CreateOutcome     = "quota_exceeded"
	PacketQuotaExceeded PacketGrabOutcome = "quota_exceeded"
)

// quotaBase is the key prefix of shard k, rpb:{<uid>.<i>}:.
func (k BudgetKeys) quotaBase() string { return strings.TrimSuffix(k.packetPrefix, "p:") }

// QuotaDay and QuotaRecipients are the keys of a shard's counters of a day: its
// senders', its recipients'.
func (k BudgetKeys) QuotaDay(day string) string        { return k.quotaBase() + "qd:" + day }
func (k BudgetKeys) QuotaRecipients(day string) string { return k.quotaBase() + "qr:" + day }

// OnOneServer says that every shard of the budget is on one Redis server (a
// standalone connection), where one function call may touch keys of several hash
// tags: a quota whose home shard is not the packet's is then checked and counted by
// the create or grab function itself, in one step, as on the home shard, instead of
// a take before it and a give after. Never on a Redis Cluster, which refuses such a
// call (CROSSSLOT). It returns the handle.
func (b *Budget) OnOneServer() *Budget {
	b.oneServer = true
	return b
}

// QuotaShardOf is the home shard of a sender or a recipient: where their counters live.
func (b *Budget) QuotaShardOf(who string) int { return BudgetShardOf(who, len(b.keys)) }

// parseQuotaRefusal reads {'quota_exceeded', rule, limit}.
func parseQuotaRefusal(reply []string) (*QuotaRefusal, error) {
	if len(reply) != 3 {
		return nil, fmt.Errorf("quota refusal %q", reply)
	}
	limit, err := strconv.ParseInt(reply[2], 10, 64)
	if err != nil {
		return nil, fmt.Errorf("quota refusal %q: %w", reply, err)
	}
	return &QuotaRefusal{Rule: reply[1], Limit: limit}, nil
}

// senderQuotaArgs are packet_create's quota arguments, after the shares.
func senderQuotaArgs(q *QuotaCheck) []any {
	return []any{q.Limits.PacketsPerMinute, q.Limits.PacketsPerDay, q.Limits.AmountPerDay, q.At.dayExpiry(), q.At.Minute}
}

// quota runs packet_quota on shard h: op take or give, kind send or recv. A take
// answers the refusal, or nil and the Redis clock when it counted.
func (b *Budget) quota(ctx context.Context, h int, op, kind, who string, amount int64, q *QuotaCheck) (*QuotaRefusal, time.Time, error) {
	k := b.keys[h]
	keys := []string{k.Meta, k.QuotaDay(q.At.Day)}
	var perMinute, perDay, perDayAmount int64
	if kind == "send" {
		perMinute, perDay, perDayAmount = q.Limits.PacketsPerMinute, q.Limits.PacketsPerDay, q.Limits.AmountPerDay
	} else {
		keys[1] = k.QuotaRecipients(q.At.Day)
		perDay = q.Limits.SharesPerDay
	}
	reply, err := b.call(ctx, lua.PacketQuotaScript, keys, op, kind, who, amount, perMinute, perDay, perDayAmount,
		q.At.dayExpiry(), q.At.Minute).StringSlice()
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("%s quota of %s on budget shard %d: %w", op, kind, h, err)
	}
	switch {
	case len(reply) == 1 && reply[0] == "ok" && op == "give":
		return nil, time.Time{}, nil
	case len(reply) == 2 && reply[0] == "ok" && op == "take":
		if ms, err := strconv.ParseInt(reply[1], 10, 64); err == nil {
			return nil, time.UnixMilli(ms), nil
		}
	case len(reply) > 0 && reply[0] == "fenced":
		return nil, time.Time{}, &FencedError{What: fmt.Sprintf("counting a quota on budget shard %d", h), Reason: strings.Join(reply[1:], " ")}
	case len(reply) > 0 && reply[0] == "quota_exceeded" && op == "take":
		r, err := parseQuotaRefusal(reply)
		return r, time.Time{}, err
	}
	return nil, time.Time{}, fmt.Errorf("%s quota of %s on budget shard %d: reply %q", op, kind, h, reply)
}

// QuotaUse is what a sender or a recipient used of the day's quotas, and of the
// minute's, as counted on their home shard.
type QuotaUse struct {
	// Packets and Amount are a sender's packets and money of the day, Minute its
	// packets of the minute; Shares a recipient's shares of the day.
	Packets, Amount, Minute, Shares int64
}

// QuotaUsed reads what who used at t as a sender and as a recipient: the counters
// on its home shard (an operator's or a test's read; the scripts count).
func (b *Budget) QuotaUsed(ctx context.Context, who string, at QuotaTime) (QuotaUse, error) {
	k := b.keys[b.QuotaShardOf(who)]
	pipe := b.c.Pipeline()
	d := pipe.HGet(ctx, k.QuotaDay(at.Day), who)
	r := pipe.HGet(ctx, k.QuotaRecipients(at.Day), who)
	_, _ = pipe.Exec(ctx)
	var u QuotaUse
	for _, c := range []interface{ Err() error }{d, r} {
		if err := c.Err(); err != nil && !errors.Is(err, redis.Nil) {
			return u, fmt.Errorf("reading the quotas of %q: %w", who, err)
		}
	}
	if v := d.Val(); v != "" {
		f := strings.Split(v, ":")
		if len(f) != 4 {
			return u, fmt.Errorf("reading the quotas of %q: counter %q", who, v)
		}
		u.Packets, _ = strconv.ParseInt(f[0], 10, 64)
		u.Amount, _ = strconv.ParseInt(f[1], 10, 64)
		if f[2] == strconv.FormatInt(at.Minute, 10) {
			u.Minute, _ = strconv.ParseInt(f[3], 10, 64)
		}
	}
	u.Shares, _ = strconv.ParseInt(r.Val(), 10, 64)
	return u, nil
}
