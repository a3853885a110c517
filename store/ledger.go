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

// The operator's settlement ledger of an activity: which packet was credited to
// whom, the sums credited so far, and whether the allowance was announced. Settlement
// decides there, in one atomic step per batch (ledger_credit.lua), whether an entry
// may be delivered, so each packet is credited at most once and the credits plus
// the refund never exceed the activity's total, across operator restarts.
//
// Its key, rpl:{<uid>}:ledger, carries the activity's hash tag (so it lives on the
// slot of an unsharded activity's keys) but not the rpa: prefix that the activity's
// ACL user is confined to (rpa:{<uid>}:* and its shards'): the tenant, who holds
// that user's password, can neither read nor write it. Only the operator's user
// runs the ledger scripts.

// ledgerKey is the ledger of the activity with the given UID.
func ledgerKey(uid string) string { return "rpl:{" + uid + "}:ledger" }

// Verdicts of Ledger.Decide, one per entry.
const (
	// LedgerCredit: recorded now, deliver the entry.
	LedgerCredit = "ok"
	// LedgerAgain: the same packet was recorded for the same user before (a
	// redelivery or a replayed dead letter): deliver it again, nothing changes.
	LedgerAgain = "again"
	// LedgerDuplicatePacket: the packet was credited to another user already.
	LedgerDuplicatePacket = "duplicate_packet"
	// LedgerOverBudget: the credits and the refund would exceed the total.
	LedgerOverBudget = "over_budget"
	// LedgerOverCount: more grants than the activity has packets.
	LedgerOverCount = "over_count"

	// Verdicts of a budget's ledger only (BudgetLedger.Decide), on the packet's
	// account booked from its creation record:

	// LedgerPacketUnknown: no creation record was booked for the entry's packet,
	// and the entry was appended since the ledger's accounts_since.
	LedgerPacketUnknown = "packet_unknown"
	// LedgerPacketOutOfRange: a grant of a share the packet does not have.
	LedgerPacketOutOfRange = "packet_out_of_range"
	// LedgerAmountMismatch: a grant of another amount than the packet's share.
	LedgerAmountMismatch = "amount_mismatch"
	// LedgerClaimMismatch: a refund to another user than the packet's sender.
	LedgerClaimMismatch = "claim_mismatch"
	// LedgerOverPacket: what was credited against the packet and this credit would
	// exceed its total.
	LedgerOverPacket = "over_packet"
)

// LedgerVerdict is the ledger's decision on one entry.
type LedgerVerdict struct {
	// Verdict is one of the Ledger* constants.
	Verdict string
	// CreditedTo is, for LedgerDuplicatePacket, the user the packet was credited to.
	CreditedTo string
}

// Deliver reports whether the entry may be delivered.
func (v LedgerVerdict) Deliver() bool { return v.Verdict == LedgerCredit || v.Verdict == LedgerAgain }

// Ledger is the handle of an activity's settlement ledger (see above).
type Ledger struct {
	c   redis.Cmdable
	key string
}

// Ledger is the activity's settlement ledger; one for all its shards.
func (s *Activity) Ledger() *Ledger { return &Ledger{c: s.base.c, key: ledgerKey(s.uid)} }

// Key is the ledger's Redis key.
func (l *Ledger) Key() string { return l.key }

// Decide decides for each entry, in order, whether it may be credited, and records
// each entry it lets through for the first time, in one atomic step
// (ledger_credit.lua): a grant's packet is credited to one user at most, the number
// of grants never exceeds count, and the grants plus the refund never exceed total.
// The entries must be well-formed grants or refunds that passed every other check.
func (l *Ledger) Decide(ctx context.Context, total, count int64, entries []StreamEntry) ([]LedgerVerdict, error) {
	if len(entries) == 0 {
		return nil, nil
	}
	args := make([]any, 0, 2+4*len(entries))
	args = append(args, total, count)
	for _, e := range entries {
		if e.Malformed != nil {
			return nil, fmt.Errorf("ledger: entry %s is malformed: %w", e.ID, e.Malformed)
		}
		args = append(args, e.Kind, e.PacketID, e.UserID, e.Amount)
	}
	res, err := lua.LedgerCreditScript.Run(ctx, l.c, []string{l.key}, args...).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("deciding %d settlement entries in %s: %w", len(entries), l.key, err)
	}
	return parseVerdicts(l.key, res, len(entries))
}

// parseVerdicts reads a ledger script's answer, one verdict per entry in order
// ("duplicate_packet:<user>" names the user the packet was credited to), for both
// the activity's ledger and a budget's. An answer of another length is an error.
func parseVerdicts(key string, res []string, entries int) ([]LedgerVerdict, error) {
	if len(res) != entries {
		return nil, fmt.Errorf("deciding settlement entries in %s: %d verdicts for %d entries", key, len(res), entries)
	}
	out := make([]LedgerVerdict, len(res))
	for i, v := range res {
		if to, ok := strings.CutPrefix(v, LedgerDuplicatePacket+":"); ok {
			out[i] = LedgerVerdict{Verdict: LedgerDuplicatePacket, CreditedTo: to}
			continue
		}
		out[i] = LedgerVerdict{Verdict: v}
	}
	return out, nil
}

// LedgerSums are what the ledger recorded as credited.
type LedgerSums struct {
	// Credited is the sum of the grants let through, Grants their number.
	Credited, Grants int64
	// Refund is the refund let through (0 when none).
	Refund int64
	// Allowance is the announced allowance, "<amount>:<count>", or "" (the
	// ledger's "budget" field).
	Allowance string
}

// Sums reads what the ledger recorded.
func (l *Ledger) Sums(ctx context.Context) (LedgerSums, error) {
	v, err := l.c.HMGet(ctx, l.key, "credited", "grants", "refund", "budget").Result()
	if err != nil {
		return LedgerSums{}, fmt.Errorf("reading %s: %w", l.key, err)
	}
	num := func(x any) int64 {
		s, _ := x.(string)
		n, _ := strconv.ParseInt(s, 10, 64)
		return n
	}
	allowance, _ := v[3].(string)
	return LedgerSums{Credited: num(v[0]), Grants: num(v[1]), Refund: num(v[2]), Allowance: allowance}, nil
}

// AllowanceAnnounced returns the activity's allowance recorded as announced, "<amount>:<count>", or
// "" when none was.
func (l *Ledger) AllowanceAnnounced(ctx context.Context) (string, error) {
	v, err := lua.LedgerAllowanceScript.Run(ctx, l.c, []string{l.key}, "get").Text()
	if errors.Is(err, redis.Nil) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("reading the announced allowance in %s: %w", l.key, err)
	}
	return v, nil
}

// RecordAllowance records that the allowance of amount and count was announced (the first
// record stays) and returns the recorded one.
func (l *Ledger) RecordAllowance(ctx context.Context, amount, count int64) (string, error) {
	v, err := lua.LedgerAllowanceScript.Run(ctx, l.c, []string{l.key}, "set", fmt.Sprintf("%d:%d", amount, count)).Text()
	if err != nil {
		return "", fmt.Errorf("recording the announced allowance in %s: %w", l.key, err)
	}
	return v, nil
}

// purge deletes the ledger.
func (l *Ledger) purge(ctx context.Context) error {
	if err := l.c.Unlink(ctx, l.key).Err(); err != nil {
		return fmt.Errorf("deleting %s: %w", l.key, err)
	}
	return nil
}

// keepFor keeps the ledger for retention, then lets it expire; it reports whether
// the ledger existed.
func (l *Ledger) keepFor(ctx context.Context, retention time.Duration) (bool, error) {
	ok, err := l.c.Expire(ctx, l.key, retention).Result()
	if err != nil {
		return false, fmt.Errorf("setting the retention of %s: %w", l.key, err)
	}
	return ok, nil
}

// FirstListedPacket is the numeric id of the packet at the head of the shard's
// packets list, the next one a grab hands out, and false when the list is empty.
// An unsharded activity's packets are listed, and popped, in id order: every packet
// from this id on is still listed, so no grab granted it.
func (a *Shard) FirstListedPacket(ctx context.Context) (int64, bool, error) {
	head, err := a.c.LIndex(ctx, a.keys.Packets, 0).Result()
	if errors.Is(err, redis.Nil) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("reading the head of %s: %w", a.keys.Packets, err)
	}
	p, err := parseListedPacket(head)
	if err != nil {
		return 0, false, fmt.Errorf("reading the head of %s: %w", a.keys.Packets, err)
	}
	id, err := strconv.ParseInt(p.ID, 10, 64)
	if err != nil {
		return 0, false, nil // not numbered by the seeder: nothing is known
	}
	return id, true, nil
}
