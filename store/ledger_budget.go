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

// The operator's settlement ledger of a RedPacketBudget. Packets are created at
// runtime, so there is no split to check an entry against: the ledger alone decides
// whether an entry may be credited, in one atomic step per batch
// (ledger_packets_credit.lua), so that each Idempotency-Key ("<uid>/<packetId>/<share>",
// "<uid>/<packetId>/refund") is credited at most once and the grants and refunds
// together never exceed the budget total announced to the balance system.
//
// Keys, with the budget's UID as hash tag (one slot) and the rpl: prefix that the
// budget's Redis user (~rpb:{<uid>.*) cannot reach:
//
//	rpl:{<uid>}:ledger       hash  the announced total ("total"), the announcement under
//	                               way ("announcing"), the sums credited ("credited",
//	                               "grants", "granted", "refunds", "refunded"), what the
//	                               booked packets drew ("drawn" in "packets"), and the
//	                               marks "tombstones_since" and "accounts_since"
//	rpl:{<uid>}:p:<packetId> hash  the packet's account, booked from its creation record
//	                               ("open", "sh", "paid"), and share (or "refund") ->
//	                               "<amount>:<at ms>:<user>", for each key credited; kept
//	                               PacketLedgerRetention after its last write, so the
//	                               ledger does not grow with every packet a long-lived
//	                               budget ever made; "ev", the packet's events delivered
//	                               (events.go)
//	rpl:{<uid>}:evdead       stream the events that could not be delivered (events.go)
//
// Every packet of a budget leaves a creation record in its shard's stream, before
// anything else of it (packet_create.lua). Settlement books it first, as the packet's
// account: what it drew, its shares and its sender, with the packets' draws together
// never above the announced total. From then on each share is credited at most once,
// for the amount the account records, and the refund only to the sender, after the
// packet's expiry, and only of what its credited grants left. A grant or refund
// appended since the ledger's accounts_since whose packet has no account names a
// packet that no creation record announced: it is refused (packet_unknown).
//
// A packet's ledger outlives the packet by far (its entries are written within its
// time to live, at most a day): an entry older than the retention is refused by the
// settlement worker (stale) rather than decided by a ledger that forgot it, so a key
// is never credited twice.

// DefaultPacketLedgerRetention is how long a packet's ledger is kept after its last
// credit: a week beyond the longest time to live (a day).
const DefaultPacketLedgerRetention = 8 * 24 * time.Hour

// BudgetLedger is the handle of a budget's settlement ledger (see above).
type BudgetLedger struct {
	c redis.Cmdable
	// clock is the budget's own Redis, whose TIME stamps the entries' ids
	// (KnownSince); c when the ledger lives beside the budget.
	clock redis.Cmdable
	uid   string
	key   string
	// retention is how long a packet's ledger is kept after its last credit.
	retention time.Duration
}

// SettlementLedger is the budget's settlement ledger, keeping each packet's ledger
// for retention after its last credit (DefaultPacketLedgerRetention when 0 or less).
func (b *Budget) SettlementLedger(retention time.Duration) *BudgetLedger {
	if retention <= 0 {
		retention = DefaultPacketLedgerRetention
	}
	c := b.c
	if b.ledger != nil {
		c = b.ledger
	}
	return &BudgetLedger{c: c, clock: b.c, uid: b.uid, key: ledgerKey(b.uid), retention: retention}
}

// WithLedger returns a handle of the same budget whose settlement ledger
// (SettlementLedger) lives on c instead of the budget's own Redis: the operator's
// Redis, for a budget whose Redis is the tenant's (spec.redis), so that neither the
// tenant, who holds that Redis's credentials, nor a loss of its data can raise the
// announced total, reset the sums credited or forget a key credited. Everything else
// stays on the budget's Redis.
func (b *Budget) WithLedger(c redis.Cmdable) *Budget {
	return &Budget{c: b.c, uid: b.uid, keys: b.keys, restores: b.restores, ledger: c}
}

// Key is the budget ledger's Redis key.
func (l *BudgetLedger) Key() string { return l.key }

// Retention is how long a packet's ledger is kept after its last credit.
func (l *BudgetLedger) Retention() time.Duration { return l.retention }

// PacketKey is the ledger of one packet.
func (l *BudgetLedger) PacketKey(packetID string) string {
	return "rpl:{" + l.uid + "}:p:" + packetID
}

// BudgetCredit is one entry to decide: a grant of share Share of packet PacketID (or
// its refund, Share RefundShare) to UserID of Amount, made At (what the delivery's
// body says); or a packet's creation record (Kind KindCreate, Share OpenShare): its
// total in Amount, its sender in UserID, its Shares and Expires, made At. Appended
// is when Redis appended the entry (its id's time).
type BudgetCredit struct {
	Kind, PacketID, Share, UserID string
	Amount                        int64
	At, Appended                  time.Time
	Shares                        []int64
	Expires                       time.Time
}

// RefundShare is the share of a packet's refund: its key is "<packetId>/refund".
const RefundShare = "refund"

// OpenShare is the share of a packet's creation record: the ledger books it as the
// packet's account.
const OpenShare = "open"

// Credit is the credit to decide for the budget entry e of packet packetID, share
// share (the parts of its packet key; for a creation record OpenShare).
func (e StreamEntry) Credit(packetID, share string) BudgetCredit {
	c := BudgetCredit{Kind: e.Kind, PacketID: packetID, Share: share, UserID: e.UserID, Amount: e.Amount, At: e.At,
		Shares: e.Shares, Expires: e.Expires}
	c.Appended, _ = entryTime(e.ID)
	return c
}

// paddedShares is the ledger's form of a packet's shares: each a 15-digit
// zero-padded decimal (a share is below 10^15), read at a fixed place.
func paddedShares(shares []int64) (string, error) {
	var b strings.Builder
	b.Grow(15 * len(shares))
	for i, a := range shares {
		if a < 1 || a >= 1e15 {
			return "", fmt.Errorf("share %d of %d is not a positive amount of at most 15 digits", i, a)
		}
		fmt.Fprintf(&b, "%015d", a)
	}
	return b.String(), nil
}

// ErrNotAnnounced is returned by Decide when no budget total was announced yet.
var ErrNotAnnounced = errors.New("the budget was not announced to the balance system")

// Decide decides for each credit, in order, whether it may be delivered, and records
// each one it lets through for the first time, in one atomic step
// (ledger_packets_credit.lua): a key (packet and share) is credited with one body at
// most (user, amount and time; the same body again passes as LedgerAgain), and everything credited never exceeds the announced total.
// Verdicts are LedgerCredit, LedgerAgain, LedgerDuplicatePacket (with CreditedTo) or
// LedgerOverBudget. It wraps ErrNotAnnounced when no total was announced.
//
// The credits are decided LedgerDecideStep at a time, each step one atomic call, in
// order: a step's verdicts count every credit the steps before it recorded, so the
// verdicts are those of one call over all of them.
func (l *BudgetLedger) Decide(ctx context.Context, credits []BudgetCredit) ([]LedgerVerdict, error) {
	out := make([]LedgerVerdict, 0, len(credits))
	for len(credits) > 0 {
		n := min(len(credits), LedgerDecideStep)
		got, err := l.decideStep(ctx, credits[:n])
		if err != nil {
			return nil, err
		}
		out = append(out, got...)
		credits = credits[n:]
	}
	return out, nil
}

// LedgerDecideStep is how many credits one ledger_packets_credit.lua call decides at
// most. It is sized by measured cost so that no call holds Redis over 5 ms: a batch
// of 64 grants of distinct packets (the worst case: each writes its packet's ledger,
// its expiry and the sums) took up to 5.2 ms in a 20,000-packet expiry burst, about
// four times a step of 16. TestLedgerDecideStepStaysUnder5ms measures every step's
// cost as the server main thread's CPU time (mean 0.5-0.7 ms, slowest 1.0-1.3 ms on
// a 2-core machine, loaded or not; docs/operations.md, "Who can do what").
const LedgerDecideStep = 16

// decideStep decides at most LedgerDecideStep credits in one atomic call.
func (l *BudgetLedger) decideStep(ctx context.Context, credits []BudgetCredit) ([]LedgerVerdict, error) {
	keys := make([]string, 0, 1+len(credits))
	keys = append(keys, l.key)
	args := make([]any, 0, 1+7*len(credits))
	args = append(args, l.retention.Milliseconds())
	for _, c := range credits {
		if c.PacketID == "" || c.Share == "" || c.UserID == "" || c.Amount < 0 {
			return nil, fmt.Errorf("ledger %s: credit %+v is incomplete", l.key, c)
		}
		extra := ""
		if c.Kind == KindCreate {
			sh, err := paddedShares(c.Shares)
			if err != nil || len(c.Shares) == 0 {
				return nil, fmt.Errorf("ledger %s: creation record of packet %s: shares %v: %v", l.key, c.PacketID, c.Shares, err)
			}
			extra = strconv.FormatInt(c.Expires.UnixMilli(), 10) + ":" + sh
		}
		keys = append(keys, l.PacketKey(c.PacketID))
		args = append(args, c.Kind, c.Share, c.UserID, c.Amount, c.At.UnixMilli(), c.Appended.UnixMilli(), extra)
	}
	res, err := lua.LedgerPacketsCreditScript.Run(ctx, l.c, keys, args...).StringSlice()
	if err != nil {
		if strings.Contains(err.Error(), "was not announced") {
			return nil, fmt.Errorf("deciding %d settlement entries in %s: %w", len(credits), l.key, ErrNotAnnounced)
		}
		return nil, fmt.Errorf("deciding %d settlement entries in %s: %w", len(credits), l.key, err)
	}
	return parseVerdicts(l.key, res, len(credits))
}

// BudgetAnnouncement is the budget total recorded as announced and the announcement
// under way.
type BudgetAnnouncement struct {
	// Total is the highest total the balance system acknowledged; 0 when none.
	Total int64
	// Pending is the total being announced, and At its time (the body of every
	// resend); Pending is 0 when none is under way.
	Pending int64
	At      time.Time
}

// announcementOp runs ledger_packets_total.lua.
func (l *BudgetLedger) announcementOp(ctx context.Context, args ...any) (BudgetAnnouncement, error) {
	res, err := lua.LedgerPacketsTotalScript.Run(ctx, l.c, []string{l.key}, args...).StringSlice()
	if err != nil {
		return BudgetAnnouncement{}, fmt.Errorf("%s of the announced budget in %s: %w", args[0], l.key, err)
	}
	if len(res) != 2 {
		return BudgetAnnouncement{}, fmt.Errorf("%s of the announced budget in %s: %d values", args[0], l.key, len(res))
	}
	var a BudgetAnnouncement
	if res[0] != "" {
		if a.Total, err = strconv.ParseInt(res[0], 10, 64); err != nil {
			return BudgetAnnouncement{}, fmt.Errorf("the announced total %q in %s is not a number", res[0], l.key)
		}
	}
	if res[1] != "" {
		total, at, ok := strings.Cut(res[1], ":")
		ms, err2 := strconv.ParseInt(at, 10, 64)
		a.Pending, err = strconv.ParseInt(total, 10, 64)
		if !ok || err != nil || err2 != nil {
			return BudgetAnnouncement{}, fmt.Errorf("the announcement under way %q in %s is not <total>:<ms>", res[1], l.key)
		}
		a.At = time.UnixMilli(ms).UTC()
	}
	return a, nil
}

// Announcement reads the announced total and the announcement under way.
func (l *BudgetLedger) Announcement(ctx context.Context) (BudgetAnnouncement, error) {
	return l.announcementOp(ctx, "get")
}

// PrepareAnnouncement records that total is being announced at at, unless it is
// not above the announced total or another announcement is under way (which is to
// be finished first), and returns the state.
func (l *BudgetLedger) PrepareAnnouncement(ctx context.Context, total int64, at time.Time) (BudgetAnnouncement, error) {
	return l.announcementOp(ctx, "prepare", total, at.UnixMilli())
}

// CommitAnnouncement records that the balance system acknowledged the announcement
// of total: the announced total becomes at least total.
func (l *BudgetLedger) CommitAnnouncement(ctx context.Context, total int64) (BudgetAnnouncement, error) {
	return l.announcementOp(ctx, "commit", total)
}

// BudgetLedgerSums are what a budget's ledger recorded as credited.
type BudgetLedgerSums struct {
	// Total is the announced total.
	Total int64
	// Credited is everything credited: Granted in Grants grants and Refunded in
	// Refunds refunds.
	Credited, Grants, Granted, Refunds, Refunded int64
	// Drawn is what the Packets booked from their creation records drew.
	Drawn, Packets int64
}

// LedgerSums reads what the budget's settlement ledger recorded (SettlementLedger's
// Sums): zeros for a budget that never settled.
func (b *Budget) LedgerSums(ctx context.Context) (BudgetLedgerSums, error) {
	return b.SettlementLedger(0).Sums(ctx)
}

// LedgerFaults lists where the ledger, read before the snapshot s, holds more than
// the budget's shards ever paid out: grants credited beyond the money every grab
// moved to claimed, or refunds beyond the money every expiry moved to refunded. A
// grab writes its claim before its entry, and an entry is credited after it is
// read, so a ledger read first never counts a credit the shards read after it lack.
// More is money credited for entries no script wrote with its money: a packet
// hash or tombstone written by hand, with its grant.
func (s BudgetSnapshot) LedgerFaults(l BudgetLedgerSums) []string {
	var faults []string
	if l.Granted > s.Claimed {
		faults = append(faults, fmt.Sprintf("the settlement ledger credited %d in grants, more than the %d the shards ever granted: "+
			"grants no grab paid for (a packet hash or tombstone written by hand, with its entry) were credited", l.Granted, s.Claimed))
	}
	if l.Refunded > s.Refunded {
		faults = append(faults, fmt.Sprintf("the settlement ledger credited %d in refunds, more than the %d the shards ever refunded: "+
			"refunds no expiry paid for were credited", l.Refunded, s.Refunded))
	}
	if drew := s.Live + s.Claimed + s.Refunded; l.Drawn > drew || l.Packets > s.CreatedPackets {
		faults = append(faults, fmt.Sprintf("the settlement ledger booked %d packets drawing %d, more than the %d packets and %d the shards "+
			"ever created: creation records no creation wrote were booked", l.Packets, l.Drawn, s.CreatedPackets, drew))
	}
	return faults
}

// Sums reads what the ledger recorded.
func (l *BudgetLedger) Sums(ctx context.Context) (BudgetLedgerSums, error) {
	v, err := l.c.HMGet(ctx, l.key, "total", "credited", "grants", "granted", "refunds", "refunded", "drawn", "packets").Result()
	if err != nil {
		return BudgetLedgerSums{}, fmt.Errorf("reading %s: %w", l.key, err)
	}
	num := func(x any) int64 {
		s, _ := x.(string)
		n, _ := strconv.ParseInt(s, 10, 64)
		return n
	}
	return BudgetLedgerSums{Total: num(v[0]), Credited: num(v[1]), Grants: num(v[2]), Granted: num(v[3]),
		Refunds: num(v[4]), Refunded: num(v[5]), Drawn: num(v[6]), Packets: num(v[7])}, nil
}

// Drained reports whether every entry of the shard's settlement stream was settled
// or dead-lettered by group: the group has read up to the stream's last entry and
// holds none pending. A shard without a stream is drained; a stream with entries and
// no group is not.
func (s *Stream) Drained(ctx context.Context, group string) (bool, error) {
	info, err := s.c.XInfoStream(ctx, s.keys.Stream).Result()
	if err != nil {
		if strings.Contains(err.Error(), "no such key") {
			return true, nil
		}
		return false, fmt.Errorf("reading %s: %w", s.keys.Stream, err)
	}
	if info.Length == 0 {
		return true, nil
	}
	groups, err := s.c.XInfoGroups(ctx, s.keys.Stream).Result()
	if err != nil {
		return false, fmt.Errorf("reading the consumer groups of %s: %w", s.keys.Stream, err)
	}
	for _, g := range groups {
		if g.Name != group {
			continue
		}
		return g.Pending == 0 && compareStreamIDs(g.LastDeliveredID, info.LastGeneratedID) >= 0, nil
	}
	return false, nil
}

// Unsettled counts the entries of the shard's settlement stream that group has not
// settled or dead-lettered yet: those read and not acknowledged, and those not read
// yet (the group's lag; when Redis cannot tell the lag, the entries after the last
// one read are not counted, so the figure may be low, never high). A shard without a
// stream has none; a stream with no group has all of its entries unsettled.
func (s *Stream) Unsettled(ctx context.Context, group string) (int64, error) {
	info, err := s.c.XInfoStream(ctx, s.keys.Stream).Result()
	if err != nil {
		if strings.Contains(err.Error(), "no such key") {
			return 0, nil
		}
		return 0, fmt.Errorf("reading %s: %w", s.keys.Stream, err)
	}
	if info.Length == 0 {
		return 0, nil
	}
	groups, err := s.c.XInfoGroups(ctx, s.keys.Stream).Result()
	if err != nil {
		return 0, fmt.Errorf("reading the consumer groups of %s: %w", s.keys.Stream, err)
	}
	for _, g := range groups {
		if g.Name == group {
			return g.Pending + max(g.Lag, 0), nil
		}
	}
	return info.Length, nil
}

// ErrPacketUnknown wraps ErrForged for an entry of a packet that was never created:
// neither its hash nor its tombstone is in Redis, and the entry was written after the
// budget's ledger began to count on tombstones (BudgetLedger.KnownSince).
var ErrPacketUnknown = fmt.Errorf("%w: no such packet was created", ErrForged)

// KnownSince is the time from which every packet of the budget leaves a tombstone for
// the ledger's retention once it is gone (packet_forget.lua, packet_expire.lua): an
// entry written since then whose packet has neither hash nor tombstone names a packet
// that was never created. It is recorded once, the first time it is asked, in the
// ledger's hash, which the budget's Redis user cannot write; a budget settled by an
// operator without tombstones before then keeps the old rule for its older entries
// (their packets may be gone without a trace). The time is the budget's Redis's
// (TIME), the clock that stamps the entries' ids, wherever the ledger lives. The announcement of the budget's total asks first
// (settlement.AnnounceBudgetTotal), before the budget is configured, so before its
// first packet; settlement asks again at its first check, for a budget announced by
// an operator that did not record it.
func (l *BudgetLedger) KnownSince(ctx context.Context) (time.Time, error) {
	now, err := l.clock.Time(ctx).Result()
	if err != nil {
		return time.Time{}, fmt.Errorf("reading Redis's clock for the budget's tombstones: %w", err)
	}
	if err := l.c.HSetNX(ctx, l.key, "tombstones_since", now.UnixMilli()).Err(); err != nil {
		return time.Time{}, fmt.Errorf("recording when the budget's packets began to leave tombstones: %w", err)
	}
	v, err := l.c.HGet(ctx, l.key, "tombstones_since").Int64()
	if err != nil {
		return time.Time{}, fmt.Errorf("reading when the budget's packets began to leave tombstones: %w", err)
	}
	return time.UnixMilli(v), nil
}

// purgeMarkRetention is how long the mark of a budget's purge is kept: a purge cut
// short is finished by the next reconciles, long before.
const purgeMarkRetention = 7 * 24 * time.Hour

// purgeKey is the mark that the purge of the budget's keys began, beside its ledger
// (operator-only, and on the operator's Redis with spec.redis).
func (l *BudgetLedger) purgeKey() string { return "rpl:{" + l.uid + "}:purging" }

// MarkPurge records that the purge of the budget's keys begins (Budget.Purge): from
// now on their absence is the purge's doing, not a loss of data. It is kept a week.
func (l *BudgetLedger) MarkPurge(ctx context.Context) error {
	if err := l.c.Set(ctx, l.purgeKey(), time.Now().UnixMilli(), purgeMarkRetention).Err(); err != nil {
		return fmt.Errorf("marking the purge of the budget's keys: %w", err)
	}
	return nil
}

// PurgeBegun reports whether MarkPurge was recorded for the budget.
func (l *BudgetLedger) PurgeBegun(ctx context.Context) (bool, error) {
	n, err := l.c.Exists(ctx, l.purgeKey()).Result()
	if err != nil {
		return false, fmt.Errorf("reading whether the budget's purge began: %w", err)
	}
	return n == 1, nil
}

// MarkPurge records that the purge of the budget's keys begins
// (BudgetLedger.MarkPurge on its settlement ledger's Redis).
func (b *Budget) MarkPurge(ctx context.Context) error { return b.SettlementLedger(0).MarkPurge(ctx) }

// PurgeBegun reports whether the purge of the budget's keys began
// (BudgetLedger.PurgeBegun).
func (b *Budget) PurgeBegun(ctx context.Context) (bool, error) {
	return b.SettlementLedger(0).PurgeBegun(ctx)
}

// AccountsSince is the time from which every grant and refund of the budget is held
// to its packet's account (ledger_packets_credit.lua): an entry appended since then
// whose packet has no booked creation record is refused as packet_unknown. It is
// recorded once, the first time it is asked, by Redis's clock (the budget's, which
// stamps the entries' ids). For a budget that announced no total yet, nothing of it
// was ever created: it is now. For a budget announced before (settled by a release
// whose packets left no creation record), it is now plus upgradeDelay, which must
// cover the longest time to live and the fleet's rollout to this release: a packet
// created before then by the older functions may still be grabbed.
func (l *BudgetLedger) AccountsSince(ctx context.Context, upgradeDelay time.Duration) (time.Time, error) {
	v, err := l.c.HMGet(ctx, l.key, "accounts_since", "total", "announcing").Result()
	if err != nil {
		return time.Time{}, fmt.Errorf("reading when the budget's packets were first booked: %w", err)
	}
	if s, ok := v[0].(string); ok {
		ms, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return time.Time{}, fmt.Errorf("accounts_since %q in %s is not unix milliseconds", s, l.key)
		}
		return time.UnixMilli(ms), nil
	}
	now, err := l.clock.Time(ctx).Result()
	if err != nil {
		return time.Time{}, fmt.Errorf("reading Redis's clock for the budget's packet accounts: %w", err)
	}
	if v[1] != nil || v[2] != nil {
		now = now.Add(upgradeDelay)
	}
	if err := l.c.HSetNX(ctx, l.key, "accounts_since", now.UnixMilli()).Err(); err != nil {
		return time.Time{}, fmt.Errorf("recording when the budget's packets were first booked: %w", err)
	}
	ms, err := l.c.HGet(ctx, l.key, "accounts_since").Int64()
	if err != nil {
		return time.Time{}, fmt.Errorf("reading when the budget's packets were first booked: %w", err)
	}
	return time.UnixMilli(ms), nil
}

// CreationRecord finds the creation record of packet id in its shard's stream: the
// entry its packet_create.lua appended at the creation time its hash records (ct), or
// within creationRecordWindow after it.
// It returns false when the packet or the record is not there. Settlement reads it
// for a grant whose packet has no account yet: after a worker's crash, its group may
// hand out a packet's grants before the record that an older, unfinished read
// holds; the record is then booked first (booking is idempotent). The hash and the
// stream are the budget's Redis user's to write, so a record found this way is
// worth no more than one the worker reads in order, and is booked the same way.
func (b *Budget) CreationRecord(ctx context.Context, id string) (StreamEntry, bool, error) {
	k := b.keys[b.ShardOf(id)]
	ct, err := b.c.HGet(ctx, k.Packet(id), "ct").Result()
	if errors.Is(err, redis.Nil) {
		return StreamEntry{}, false, nil
	}
	if err != nil {
		return StreamEntry{}, false, fmt.Errorf("reading the creation time of packet %s: %w", id, err)
	}
	ms, err := strconv.ParseUint(ct, 10, 64)
	if err != nil {
		return StreamEntry{}, false, nil
	}
	// The record's id is the time Redis appended it, which the script's TIME reading
	// (ct) may precede by a millisecond or a few: the entries from ct to
	// creationRecordWindow later are read, a page at a time, creationRecordPages at most.
	start, end := fmt.Sprintf("%d-0", ms), fmt.Sprintf("%d-18446744073709551615", ms+uint64(creationRecordWindow.Milliseconds()))
	for range creationRecordPages {
		msgs, err := b.c.XRangeN(ctx, k.Stream, start, end, 256).Result()
		if err != nil {
			return StreamEntry{}, false, fmt.Errorf("reading the creation record of packet %s: %w", id, err)
		}
		for _, e := range decodeMessages(msgs) {
			if e.Malformed == nil && e.Kind == KindCreate && e.PacketID == id {
				return e, true, nil
			}
		}
		if len(msgs) < 256 {
			break
		}
		start = "(" + msgs[len(msgs)-1].ID
	}
	return StreamEntry{}, false, nil
}

// creationRecordWindow and creationRecordPages bound CreationRecord's search: the
// entries of the creationRecordWindow after the creation time, at most
// creationRecordPages pages of 256.
const (
	creationRecordWindow = 100 * time.Millisecond
	creationRecordPages  = 8
)

// VerifyPacketEntries checks each credit against its packet's hash, when the packet
// is still in Redis, and returns why each one that does not match is forged (by
// index in credits, wrapping ErrForged):
//
//   - a grant of share s of amount a to user u: the packet records u's grab as share
//     s of a (packet_grab.lua writes it in the step that appends the grant; the
//     entry id is not compared, so a replayed dead letter still matches);
//
//   - a refund of a to user u: the packet expired, its sender is u and its
//     remainder, which packet_expire.lua refunded, is a.
//
//   - any entry written at or after knownSince: its packet has a hash or a tombstone
//     (ErrPacketUnknown otherwise). A packet forgotten (its tombstone left) keeps no
//     claims: its entries are bounded by the ledger alone, as are entries written
//     before knownSince of a packet that is gone.
//
// All reads go in one pipeline.
func (b *Budget) VerifyPacketEntries(ctx context.Context, credits []BudgetCredit, knownSince time.Time) (map[int]error, error) {
	forged := map[int]error{}
	if len(credits) == 0 {
		return forged, nil
	}
	pipe := b.c.Pipeline()
	reads := make([]*redis.SliceCmd, len(credits))
	for i, c := range credits {
		if c.Kind == KindCreate {
			continue // a creation record is the account itself: the ledger books it
		}
		reads[i] = pipe.HMGet(ctx, b.keys[b.ShardOf(c.PacketID)].Packet(c.PacketID), "cnt", "x", "snd", "r", "u:"+c.UserID, "f")
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("verifying settlement entries against their packets: %w", err)
	}
	for i, c := range credits {
		if reads[i] == nil {
			continue
		}
		v, err := reads[i].Result()
		if err != nil {
			return nil, fmt.Errorf("verifying settlement entries: reading packet %s: %w", c.PacketID, err)
		}
		str := func(x any) string { s, _ := x.(string); return s }
		count, expired, sender, remainder, claim := str(v[0]), str(v[1]), str(v[2]), str(v[3]), str(v[4])
		if count == "" && expired == "" {
			if !c.At.Before(knownSince) {
				forged[i] = fmt.Errorf("%w: %s %s/%s of %d to %q, written at %s", ErrPacketUnknown, c.Kind, c.PacketID, c.Share,
					c.Amount, c.UserID, c.At.UTC().Format(time.RFC3339Nano))
			}
			continue // not in Redis
		}
		if str(v[5]) != "" {
			continue // its tombstone (packet_forget.lua), which keeps no claims
		}
		amount := strconv.FormatInt(c.Amount, 10)
		switch c.Kind {
		case KindRefund:
			switch {
			case expired == "":
				forged[i] = fmt.Errorf("%w: a refund of packet %s, which has not expired", ErrForged, c.PacketID)
			case sender != c.UserID:
				forged[i] = fmt.Errorf("%w: a refund of packet %s to %q, whose sender is %q", ErrForged, c.PacketID, c.UserID, sender)
			case remainder != amount:
				forged[i] = fmt.Errorf("%w: a refund of %s of packet %s, which had %s left", ErrForged, amount, c.PacketID, remainder)
			}
		default:
			share, rest, _ := strings.Cut(claim, ":")
			got, _, _ := strings.Cut(rest, ":")
			if claim == "" || share != c.Share || got != amount {
				forged[i] = fmt.Errorf("%w: share %s of %s of packet %s to %q, but the packet records %q for that user",
					ErrForged, c.Share, amount, c.PacketID, c.UserID, claim)
			}
		}
	}
	return forged, nil
}
