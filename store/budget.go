package store

import (
	"context"
	"errors"
	"hash/fnv"
	"strconv"
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
	// Settled and dead-lettered settlement entries.
	SettledCount, SettledAmount, DeadLetters int64
	// Closed is set once creation was closed (deletion).
	Closed bool
}

// Conserved reports whether the snapshot's money adds up.
func (s BudgetSnapshot) Conserved() bool {
	return s.Total == s.Available+s.Live+s.Claimed+s.Refunded
}

// errBudgetNotBuilt marks the calls whose scripts are not written yet.
var errBudgetNotBuilt = errors.New("runtime packets are not built yet")

// Configure writes the budget's limits to every shard and raises the shards'
// allotments so that they sum to total, creating the shards on the first call. The
// total never decreases: a smaller one than already allotted is refused. Idempotent.
func (b *Budget) Configure(ctx context.Context, total int64, limits BudgetLimits) error {
	return errBudgetNotBuilt
}

// Snapshot reads every shard, each at one instant, and sums them.
func (b *Budget) Snapshot(ctx context.Context) (BudgetSnapshot, error) {
	return BudgetSnapshot{}, errBudgetNotBuilt
}

// ExpireDue expires at most max of shard i's packets whose time is up by the Redis
// clock: each one's remainder is refunded through the shard's settlement stream and
// its grabs are refused from then on. It reports how many it expired and the money
// refunded.
func (b *Budget) ExpireDue(ctx context.Context, i, max int) (int, int64, error) {
	return 0, 0, errBudgetNotBuilt
}

// Close stops creation on every shard (the budget is being deleted); ExpireDue then
// expires every live packet at once, whatever its time.
func (b *Budget) Close(ctx context.Context) error { return errBudgetNotBuilt }

// ForgetPacket deletes an expired packet's hash once its refund settled.
func (b *Budget) ForgetPacket(ctx context.Context, packetID string) error { return errBudgetNotBuilt }

// Purge deletes every key of the budget.
func (b *Budget) Purge(ctx context.Context) error { return errBudgetNotBuilt }

// CreatePacket splits p.Total into p.Count shares (lua/split, seeded by the budget's
// UID and the packet id, so a repeat yields the same shares), draws the money from
// the packet's shard and seeds the packet, in one script.
func (b *Budget) CreatePacket(ctx context.Context, p NewPacket) (PacketDetail, CreateOutcome, error) {
	return PacketDetail{}, "", errBudgetNotBuilt
}

// GrabPacket decides one user's grab of a packet, once per user per packet.
func (b *Budget) GrabPacket(ctx context.Context, packetID, userID string) (PacketGrab, error) {
	return PacketGrab{}, errBudgetNotBuilt
}

// Packet reads a packet and its grabs; false when there is no such packet.
func (b *Budget) Packet(ctx context.Context, packetID string) (PacketDetail, bool, error) {
	return PacketDetail{}, false, errBudgetNotBuilt
}

// LivePackets lists at most limit live packets of shard i, soonest expiry first.
func (b *Budget) LivePackets(ctx context.Context, i, limit int) ([]PacketDetail, error) {
	return nil, errBudgetNotBuilt
}

// SettlementShard is a handle on shard i's settlement stream, dead letters and
// settled counters (its Keys name the budget shard's meta, stream and dead
// letters), for the settlement workers.
func (b *Budget) SettlementShard(i int) *Shard {
	k := b.keys[i]
	return &Shard{c: b.c, keys: Keys{Meta: k.Meta, Stream: k.Stream, DeadLetters: k.DeadLetters}}
}
