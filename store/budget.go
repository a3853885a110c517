package store

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// A RedPacketBudget is the long-lived source of packets created at runtime (seed 004:
// one pool per order, all day long). Its money is spread over N budget shards, each
// one hash tag, {<uid>.<i>}, and every packet lives under the tag of the shard its id
// hashes to (BudgetShardOf), so that creating one is a single script: the draw from
// the shard's available money, the split, the packet and its due-time entry are
// written in one atomic step, on one slot, with no cross-slot journal to recover.
// Packets spread over the masters of a cluster through the shards.
//
// The keys of budget shard i (tag T = {<uid>.<i>}):
//
//	rpb:T:meta     hash   the shard's money and counters, its limits, its state
//	rpb:T:p:<id>   hash   one packet: its body, its shares, and who got which
//	rpb:T:due      zset   live packets by their expiry, in unix milliseconds
//	rpb:T:stream   stream the shard's settlement entries (grants and refunds)
//	rpb:T:dead     stream dead letters
//
// Conservation, per shard and so for the budget, after every script:
//
//	allotted = available + live + claimed + refunded
//
// where live is the money still in live packets.
//
// Settlement entries have the activities' formats, with the packet id
// "<packetId>/<share>" for a grant (share is the 0-based grab order) and
// "<packetId>/refund" for an expired packet's remainder, so the delivery's
// Idempotency-Key, "<budget uid>/<packet id>", is "<budget uid>/<packetId>/<share>"
// and "<budget uid>/<packetId>/refund".

// MaxBudgetShards is the most budget shards a budget may have.
const MaxBudgetShards = 256

// MaxPacketIDLength bounds a packet id, which is the caller's order id.
const MaxPacketIDLength = 64

// ErrBudgetClosed is returned by creation once the budget is being deleted.
var ErrBudgetClosed = errors.New("the budget takes no new packets")

// ErrBudgetFenced is returned (wrapped, with the fence's reason) by creation and by
// a grab on a shard that the operator fenced (Budget.Fence): its Redis lost or rolled
// back its data, so nothing is created, granted or expired there.
var ErrBudgetFenced = errors.New("the budget is fenced: its Redis lost or rolled back its data, and nothing is created or granted until the platform team decides")

// FencedError is the error of a creation or a grab on a fenced shard: it is
// ErrBudgetFenced (errors.Is), with the fence's reason as the operator wrote it.
type FencedError struct {
	// What is the call refused ("creating packet order-1").
	What string
	// Reason is the fence's reason (DataLost, RedisRolledBack).
	Reason string
}

func (e *FencedError) Error() string {
	return fmt.Sprintf("%s: %v (%s)", e.What, ErrBudgetFenced, e.Reason)
}

// Is makes a FencedError ErrBudgetFenced.
func (e *FencedError) Is(target error) bool { return target == ErrBudgetFenced }

// BudgetShardOf is the budget shard that holds packetID: FNV-1a (64 bit) of the id,
// modulo n. It depends on nothing but the id and n, so every grab pod, restart and
// version agrees; n is immutable for that reason.
func BudgetShardOf(packetID string, n int) int {
	if n <= 1 {
		return 0
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte(packetID))
	return int(h.Sum64() % uint64(n))
}

// BudgetKeys are the keys of one budget shard.
type BudgetKeys struct {
	Meta, Due, Stream, DeadLetters string
	// packetPrefix + id is a packet's hash.
	packetPrefix string
}

// budgetKeysFor returns the keys of budget shard i of budget uid.
func budgetKeysFor(uid string, i int) BudgetKeys {
	p := "rpb:{" + uid + "." + strconv.Itoa(i) + "}:"
	return BudgetKeys{Meta: p + "meta", Due: p + "due", Stream: p + "stream", DeadLetters: p + "dead",
		packetPrefix: p + "p:"}
}

// Packet is the key of packet id's hash.
func (k BudgetKeys) Packet(id string) string { return k.packetPrefix + id }

// BudgetLimits are what one packet may be, written to every shard's meta by the
// operator (Budget.Configure) and checked by the create script.
type BudgetLimits struct {
	// Currency is the budget's currency code.
	Currency string
	// MaxTotal caps one packet's money, in minor units.
	MaxTotal int64
	// MaxCount caps one packet's shares.
	MaxCount int64
	// MinShare is the smallest share, at least 1.
	MinShare int64
	// Distributions are the split types a packet may use (split.Type*).
	Distributions []string
	// DefaultTTL is a packet's time to live when its creation names none.
	DefaultTTL time.Duration
	// MaxTTL caps a packet's time to live.
	MaxTTL time.Duration
}

// Budget is the handle of one budget's keys over its shards on a client that
// reaches every shard's slot. It makes every Redis call the budget needs: the
// operator's (Configure, Snapshot, ExpireDue, Close, Purge) through cached scripts,
// the grab fleet's (CreatePacket, GrabPacket, Packet) through the function library.
type Budget struct {
	c    redis.Cmdable
	uid  string
	keys []BudgetKeys
	// restores is set on the operator's handles (RestoreFunctions): a function call
	// that finds the library missing loads it and retries once.
	restores bool
	// limits caches what the shards' meta says one packet may be (limitsFor), for the
	// split's minimum share.
	limits atomic.Pointer[cachedLimits]
	// ledger, when set, is where the budget's settlement ledger lives (WithLedger);
	// nil: on c, beside the budget.
	ledger redis.Cmdable
	// oneServer is set when every shard is on one server (OnOneServer): a quota is
	// then counted by the create or grab itself whatever shard it lives on.
	oneServer bool
}

// NewBudget returns the handle of budget uid spread over n shards (n ≤ 1 is one).
func NewBudget(c redis.Cmdable, uid string, n int) *Budget {
	n = max(n, 1)
	b := &Budget{c: c, uid: uid, keys: make([]BudgetKeys, n)}
	for i := range b.keys {
		b.keys[i] = budgetKeysFor(uid, i)
	}
	return b
}

// UID is the budget's UID.
func (b *Budget) UID() string { return b.uid }

// Ping checks that the Redis of the budget's client answers (PING).
func (b *Budget) Ping(ctx context.Context) error {
	if err := b.c.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("pinging Redis: %w", err)
	}
	return nil
}

// N is the number of budget shards.
func (b *Budget) N() int { return len(b.keys) }

// ShardKeys are the keys of shard i.
func (b *Budget) ShardKeys(i int) BudgetKeys { return b.keys[i] }

// ShardOf is the shard that holds packetID.
func (b *Budget) ShardOf(packetID string) int { return BudgetShardOf(packetID, len(b.keys)) }

// NewPacket is a request to create one packet.
type NewPacket struct {
	// ID is the caller's order id: [A-Za-z0-9][A-Za-z0-9._-]{0,63}.
	ID string
	// Sender is credited the refund of what is not grabbed before expiry.
	Sender string
	// Total is the packet's money in minor units; Count its shares.
	Total, Count int64
	// Distribution is a split type the budget allows (split.Type*).
	Distribution string
	// TTL is how long it may be grabbed; 0 means the budget's default.
	TTL time.Duration
	// Quota, when set, counts the creation against the sender's quotas
	// (budget_quota.go); it is not part of the body (Fingerprint).
	Quota *QuotaCheck
}

// CreateOutcome is what a creation decided.
type CreateOutcome string

// Creation outcomes. Every outcome but CreateCreated and CreateExisting changed
// nothing.
const (
	CreateCreated         CreateOutcome = "created"
	CreateExisting        CreateOutcome = "existing" // the same id with the same body
	CreateConflict        CreateOutcome = "conflict" // the same id with another body
	CreateBudgetExhausted CreateOutcome = "budget_exhausted"
	CreateLimitExceeded   CreateOutcome = "limit_exceeded"
	CreateInvalid         CreateOutcome = "invalid_request"
	CreateClosed          CreateOutcome = "closed"
)

// PacketGrabOutcome is what a grab of a runtime packet decided.
type PacketGrabOutcome string

// Grab outcomes of a runtime packet.
const (
	PacketGranted        PacketGrabOutcome = "granted"
	PacketAlreadyClaimed PacketGrabOutcome = "already_claimed"
	PacketSoldOut        PacketGrabOutcome = "sold_out"
	PacketExpired        PacketGrabOutcome = "expired"
	PacketMissing        PacketGrabOutcome = "missing"
)

// PacketGrab is one grab's answer: the share and amount for a grant or a repeat.
type PacketGrab struct {
	Outcome PacketGrabOutcome
	Share   int
	Amount  int64
	// Quota is the rule of a PacketQuotaExceeded.
	Quota *QuotaRefusal
}

// PacketShare is one granted share, in grab order.
type PacketShare struct {
	Share  int
	UserID string
	Amount int64
	At     time.Time
}

// PacketDetail is a packet as its group sees it.
type PacketDetail struct {
	ID, Sender, Distribution, Currency string
	Total, Count                       int64
	RemainingAmount, RemainingCount    int64
	CreatedAt, ExpiresAt               time.Time
	// Expired is set once the packet's remainder was refunded (or nothing was left).
	Expired bool
	// Forgotten is set once the packet's refund settled and its hash became a
	// tombstone (packet_forget.lua): Grabs is then empty, the rest is as it ended.
	// ForgottenAt is when, by Redis's clock (zero when unknown).
	Forgotten   bool
	ForgottenAt time.Time
	// Grabs are the granted shares in grab order (seed 004's detail list).
	Grabs []PacketShare
}

// BudgetSnapshot is the budget's money and counters, summed over its shards; each
// shard is read at one instant by one script.
type BudgetSnapshot struct {
	// Total is the money allotted to the shards: the spec's total once configured.
	Total int64
	// Available may still be drawn by new packets.
	Available int64
	// Live is the money still in live packets (not grabbed, not yet refunded).
	Live int64
	// Claimed was granted to users; Refunded was returned to senders at expiry.
	Claimed, Refunded int64
	// Packet and share counts.
	LivePackets, CreatedPackets, ExpiredPackets, GrabbedShares int64
	// OverduePackets are live packets past their expiry, not expired yet (the
	// expiry backlog, each shard read at its own instant).
	OverduePackets int64
	// Settled and dead-lettered settlement entries: the grants settled and their
	// money, the refunds' money settled, and the dead letters.
	SettledCount, SettledAmount, RefundSettled, DeadLetters int64
	// Closed is set once creation was closed (deletion).
	Closed bool
	// Epoch is the lowest reconcile epoch a shard holds (AdvanceEpoch); 0 for a
	// budget no operator advanced yet.
	Epoch int64
	// MissingShards are the shards whose meta holds no state: never configured, or
	// gone with the Redis data that held them (a fenced shard that was lost holds
	// the fence alone). Each shard is read at its own instant, so a loss during a
	// snapshot shows some shards as they were and the rest as missing.
	MissingShards []int
	// Borrowed is what the shards took from their siblings over their life
	// (budget_borrow.lua), summed from the pass; LentAfter is what they lent
	// (budget_lend.lua), summed from a read of every shard made after that pass.
	// A move is lent before it is borrowed, and both sums only grow, so every move
	// a borrower counted is in LentAfter: Borrowed ≤ LentAfter whatever the moves
	// under way. More borrowed than lent is money a shard took that no sibling gave.
	Borrowed, LentAfter int64
	// UnconservedShards are the shards whose own money did not add up at the
	// instant each was read (BudgetShardSnapshot.Conserved). Every script keeps a
	// shard's sum at every instant, so a shard off is a write outside them, even
	// when the budget's sums still agree.
	UnconservedShards []int
}

// Conserved reports whether the snapshot's money adds up.
func (s BudgetSnapshot) Conserved() bool {
	return s.Total == s.Available+s.Live+s.Claimed+s.Refunded
}

// MoneyFaults lists what in the snapshot no run of the budget's scripts can leave,
// in any order and with any move under way: the budget's sums off, a shard's own
// sums off, more money borrowed than lent, or negative money available or in
// packets (a grab of a packet hash written by hand takes its amount from the money
// of the real packets, which goes below zero once they are spent). Each is a write outside the scripts
// (the budget's Redis user may send HINCRBY, HSET and FCALL budget_borrow with
// anything), and nil means none was seen.
func (s BudgetSnapshot) MoneyFaults() []string {
	var faults []string
	if !s.Conserved() {
		faults = append(faults, fmt.Sprintf("total %d ≠ available %d + in packets %d + claimed %d + refunded %d",
			s.Total, s.Available, s.Live, s.Claimed, s.Refunded))
	}
	if len(s.UnconservedShards) > 0 {
		faults = append(faults, fmt.Sprintf("shards %v: allotted + borrowed - lent ≠ available + in packets + claimed + refunded",
			s.UnconservedShards))
	}
	if s.Borrowed > s.LentAfter {
		faults = append(faults, fmt.Sprintf("the shards borrowed %d, more than the %d their siblings lent", s.Borrowed, s.LentAfter))
	}
	if s.Available < 0 || s.Live < 0 {
		faults = append(faults, fmt.Sprintf("negative money: available %d, in packets %d", s.Available, s.Live))
	}
	return faults
}
