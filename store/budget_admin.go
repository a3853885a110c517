package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
)

// The operator's calls on a budget: its scripts run with EVALSHA (Script.Run) under
// the operator's Redis user; the budget's own user may only FCALL the grab fleet's
// functions (budget_packets.go).

// MaxPacketShares is the most shares a budget may let one packet have: the cap of
// BudgetLimits.MaxCount, which bounds every script's work on one packet and keeps
// the create's arguments within what one Lua call may unpack.
const MaxPacketShares = 1000

// MaxPacketTotal is the most money one packet may hold, in minor units: 15 decimal
// digits, below 2^53, so the scripts read any packet's amounts exactly as Lua
// numbers (packet_create.lua).
const MaxPacketTotal = 999_999_999_999_999

// MaxExpireBatch is the most packets one ExpireDue call expires: one script call
// runs three commands per packet, so a batch holds Redis for a bounded time.
const MaxExpireBatch = 500

// DefaultExpireBatch is the batch the operator asks for: on two busy shared cores a
// call of this many packets stays well under 5 ms (TestExpiryBurst), so an expiry
// burst never stalls the grabs on the same server.
const DefaultExpireBatch = 50

// ErrBudgetLowered is returned by Configure for a total below what the shards were
// already allotted: a budget is raised (refilled), never lowered.
var ErrBudgetLowered = errors.New("a budget's total is never lowered")

// ErrInvalidLimits wraps the reasons BudgetLimits.Validate gives.
var ErrInvalidLimits = errors.New("invalid packet limits")

// ErrPacketLive is returned by ForgetPacket for a packet that has not expired.
var ErrPacketLive = errors.New("the packet has not expired")

// Validate reports why the limits cannot be a budget's, or nil.
func (l BudgetLimits) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidLimits}, args...)...)
	}
	if l.Currency == "" || len(l.Currency) > 16 || strings.ContainsFunc(l.Currency, func(r rune) bool {
		return (r < 'A' || r > 'Z') && (r < '0' || r > '9')
	}) {
		return bad("currency %q is not 1 to 16 of [A-Z0-9]", l.Currency)
	}
	if l.MaxTotal < 1 || l.MaxTotal > MaxPacketTotal {
		return bad("maxTotal %d is not within 1 and %d", l.MaxTotal, int64(MaxPacketTotal))
	}
	if l.MaxCount < 1 || l.MaxCount > MaxPacketShares {
		return bad("maxCount %d is not within 1 and %d", l.MaxCount, MaxPacketShares)
	}
	if l.MinShare < 1 || l.MinShare > l.MaxTotal {
		return bad("minShare %d is not within 1 and maxTotal %d", l.MinShare, l.MaxTotal)
	}
	if len(l.Distributions) == 0 {
		return bad("no distribution allowed")
	}
	for _, d := range l.Distributions {
		if d != split.TypeRandom && d != split.TypeLineCut && d != split.TypeFixed {
			return bad("distribution %q is not %s, %s or %s", d, split.TypeRandom, split.TypeLineCut, split.TypeFixed)
		}
	}
	if l.DefaultTTL < time.Millisecond || l.MaxTTL < l.DefaultTTL {
		return bad("defaultTTL %v must be at least 1ms and at most maxTTL %v", l.DefaultTTL, l.MaxTTL)
	}
	if l.MaxTTL > 10*366*24*time.Hour {
		return bad("maxTTL %v is above ten years", l.MaxTTL)
	}
	return nil
}

// allotments splits total over n shards: shard i gets total/n, and one more when
// i < total%n. Each shard's part never decreases as the total grows, so a raise
// raises every shard or leaves it as it was.
func allotments(total int64, n int) []int64 {
	out := make([]int64, n)
	q, r := total/int64(n), total%int64(n)
	for i := range out {
		out[i] = q
		if int64(i) < r {
			out[i]++
		}
	}
	return out
}

// Configure writes the budget's limits to every shard and raises the shards'
// allotments so that they sum to total, creating the shards on the first call. The
// total never decreases: a smaller one than already allotted is refused
// (ErrBudgetLowered) before any shard is written. Idempotent.
//
// Each shard's raise is a compare-and-set on the allotment the call read
// (budget_configure.lua), so two operators configuring at once never add a raise
// twice: the second finds the allotment moved, reads it again, and has nothing
// left to add.
func (b *Budget) Configure(ctx context.Context, total int64, limits BudgetLimits) error {
	if err := limits.Validate(); err != nil {
		return err
	}
	if total < 0 {
		return fmt.Errorf("configuring budget %s: total %d is negative", b.uid, total)
	}
	current := make([]int64, len(b.keys))
	var sum int64
	for i := range b.keys {
		a, err := b.allotted(ctx, i)
		if err != nil {
			return err
		}
		current[i] = a
		sum += a
	}
	if total < sum {
		return fmt.Errorf("configuring budget %s with total %d: %w (%d already allotted)", b.uid, total, ErrBudgetLowered, sum)
	}
	dists := "," + strings.Join(limits.Distributions, ",") + ","
	want := allotments(total, len(b.keys))
	for i, k := range b.keys {
		for attempt := 0; ; attempt++ {
			if want[i] < current[i] {
				return fmt.Errorf("configuring budget shard %d to %d: %w (%d allotted)", i, want[i], ErrBudgetLowered, current[i])
			}
			reply, err := lua.BudgetConfigureScript.Run(ctx, b.c, []string{k.Meta},
				current[i], want[i], want[i]-current[i], limits.Currency, limits.MaxTotal, limits.MaxCount,
				limits.MinShare, dists, limits.DefaultTTL.Milliseconds(), limits.MaxTTL.Milliseconds()).StringSlice()
			if err != nil {
				return fmt.Errorf("configuring budget shard %d: %w", i, err)
			}
			if len(reply) != 2 {
				return fmt.Errorf("configuring budget shard %d: reply %q", i, reply)
			}
			if reply[0] == "ok" {
				break
			}
			if reply[0] == "currency" {
				return fmt.Errorf("configuring budget shard %d in %s: it holds money in %s", i, limits.Currency, reply[1])
			}
			if reply[0] == "lowered" || attempt >= 5 {
				return fmt.Errorf("configuring budget shard %d to %d: %w (%s allotted)", i, want[i], ErrBudgetLowered, reply[1])
			}
			// moved: another call raised it since it was read.
			if current[i], err = strconv.ParseInt(reply[1], 10, 64); err != nil {
				return fmt.Errorf("configuring budget shard %d: allotment %q: %w", i, reply[1], err)
			}
		}
	}
	b.limits.Store(&cachedLimits{BudgetLimits: limits, at: time.Now()})
	return nil
}

// allotted reads shard i's allotment, 0 for a shard not created yet.
func (b *Budget) allotted(ctx context.Context, i int) (int64, error) {
	v, err := b.c.HGet(ctx, b.keys[i].Meta, "allotted").Result()
	if errors.Is(err, redis.Nil) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("reading budget shard %d's allotment: %w", i, err)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("budget shard %d's allotment %q: %w", i, v, err)
	}
	return n, nil
}

// BudgetShardSnapshot is one budget shard's money and counters, read at one instant.
type BudgetShardSnapshot struct {
	// State is "open" or "closed", "" for a shard never configured.
	State                                                   string
	Allotted, Available, Live, Claimed, Refunded            int64
	Created, Expired, Grabbed                               int64
	SettledCount, SettledAmount, RefundSettled, DeadLetters int64
	// Lent and Borrowed are the money this shard lent to dry siblings and borrowed
	// from them (budget_lend.lua, budget_borrow.lua), over its life.
	Lent, Borrowed int64
	// Epoch is the operator's reconcile epoch the shard holds (AdvanceEpoch).
	Epoch int64
	// Overdue is how many live packets are past their expiry by the Redis clock and
	// not expired yet: the expiry driver's backlog.
	Overdue int64
}

// Conserved reports whether the shard's money adds up: what it was allotted and
// borrowed, less what it lent, is available, live, claimed or refunded.
func (s BudgetShardSnapshot) Conserved() bool {
	return s.Allotted+s.Borrowed-s.Lent == s.Available+s.Live+s.Claimed+s.Refunded
}

// ShardSnapshot reads shard i's money and counters at one instant (budget_snapshot.lua).
func (b *Budget) ShardSnapshot(ctx context.Context, i int) (BudgetShardSnapshot, error) {
	v, err := lua.BudgetSnapshotScript.Run(ctx, b.c, []string{b.keys[i].Meta, b.keys[i].Due}).StringSlice()
	if err != nil {
		return BudgetShardSnapshot{}, fmt.Errorf("reading budget shard %d: %w", i, err)
	}
	if len(v) != 17 {
		return BudgetShardSnapshot{}, fmt.Errorf("reading budget shard %d: %d values, want 17", i, len(v))
	}
	s := BudgetShardSnapshot{State: v[0]}
	for j, dst := range []*int64{&s.Allotted, &s.Available, &s.Live, &s.Claimed, &s.Refunded, &s.Created,
		&s.Expired, &s.Grabbed, &s.SettledCount, &s.SettledAmount, &s.RefundSettled, &s.DeadLetters, &s.Lent,
		&s.Borrowed, &s.Epoch, &s.Overdue} {
		if v[j+1] == "" {
			continue
		}
		if *dst, err = strconv.ParseInt(v[j+1], 10, 64); err != nil {
			return BudgetShardSnapshot{}, fmt.Errorf("budget shard %d: value %q: %w", i, v[j+1], err)
		}
	}
	return s, nil
}

// Snapshot reads every shard, each at one instant, and sums them. SettledAmount is
// the grants' money settled; the refunds settled are RefundSettled. When the pass
// counts more borrowed than lent, every shard's lent is read again after it
// (BudgetSnapshot.LentAfter), so that a move lent during the pass is not taken for
// money borrowed from nowhere.
func (b *Budget) Snapshot(ctx context.Context) (BudgetSnapshot, error) {
	var out BudgetSnapshot
	var lent int64
	configured, closed := 0, 0
	for i := range b.keys {
		s, err := b.ShardSnapshot(ctx, i)
		if err != nil {
			return BudgetSnapshot{}, err
		}
		if s.State != "" {
			configured++
		} else {
			out.MissingShards = append(out.MissingShards, i)
		}
		if i == 0 || s.Epoch < out.Epoch {
			out.Epoch = s.Epoch
		}
		if s.State == "closed" {
			closed++
		}
		out.Total += s.Allotted
		// Money lent and not yet borrowed is in transit between two shards: still
		// available to the budget (budget_lend.lua). Each shard is read at its own
		// instant, so a move may show on both sides or neither: lent - borrowed
		// corrects either way, and the sum stays conserved.
		out.Available += s.Available + s.Lent - s.Borrowed
		lent += s.Lent
		out.Borrowed += s.Borrowed
		if !s.Conserved() {
			out.UnconservedShards = append(out.UnconservedShards, i)
		}
		out.Live += s.Live
		out.Claimed += s.Claimed
		out.Refunded += s.Refunded
		out.OverduePackets += s.Overdue
		out.CreatedPackets += s.Created
		out.ExpiredPackets += s.Expired
		out.GrabbedShares += s.Grabbed
		out.SettledCount += s.SettledCount
		out.SettledAmount += s.SettledAmount
		out.RefundSettled += s.RefundSettled
		out.DeadLetters += s.DeadLetters
	}
	out.LivePackets = out.CreatedPackets - out.ExpiredPackets
	out.Closed = configured > 0 && closed == configured
	out.LentAfter = lent
	if out.Borrowed > lent {
		lentAfter, err := b.lentNow(ctx)
		if err != nil {
			return BudgetSnapshot{}, err
		}
		out.LentAfter = lentAfter
	}
	return out, nil
}

// AdvanceEpoch adds one to every shard's reconcile epoch (the meta's "epoch") and
// returns the lowest epoch a shard holds after it. The operator calls it at every
// reconcile of a configured budget and records what it returns in the budget's
// status; nothing else writes it. A shard's epoch only grows while Redis keeps the
// shard, however busy the fleet is, so a shard that holds an epoch below the one
// recorded came back from before that reconcile (an older backup or AOF), even when
// the packets created since have taken its counters past their marks again.
func (b *Budget) AdvanceEpoch(ctx context.Context) (int64, error) {
	cmds := make([]*redis.IntCmd, len(b.keys))
	_, err := b.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range b.keys {
			cmds[i] = p.HIncrBy(ctx, k.Meta, "epoch", 1)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("advancing budget %s's epoch: %w", b.uid, err)
	}
	var low int64
	for i, c := range cmds {
		if i == 0 || c.Val() < low {
			low = c.Val()
		}
	}
	return low, nil
}

// lentNow sums what every shard lent over its life, each read now.
func (b *Budget) lentNow(ctx context.Context) (int64, error) {
	var lent int64
	for i := range b.keys {
		s, err := b.ShardSnapshot(ctx, i)
		if err != nil {
			return 0, err
		}
		lent += s.Lent
	}
	return lent, nil
}

// ExpiredPacket is one packet an expiry call expired, with the money refunded to
// its sender (0 when every share had been granted: no refund entry then).
type ExpiredPacket struct {
	ID       string
	Refunded int64
}

// ExpireDue expires at most limit of shard i's packets whose time is up by the Redis
// clock: each one's remainder is refunded through the shard's settlement stream and
// its grabs are refused from then on. It reports how many it expired and the money
// refunded.
func (b *Budget) ExpireDue(ctx context.Context, i, limit int) (int, int64, error) {
	expired, err := b.ExpireDuePackets(ctx, i, limit)
	var refunded int64
	for _, p := range expired {
		refunded += p.Refunded
	}
	return len(expired), refunded, err
}

// ExpireDuePackets is ExpireDue naming the packets it expired (packet_expire.lua).
// limit is clamped to 1..MaxExpireBatch.
func (b *Budget) ExpireDuePackets(ctx context.Context, i, limit int) ([]ExpiredPacket, error) {
	limit = min(MaxExpireBatch, max(limit, 1))
	k := b.keys[i]
	v, err := lua.PacketExpireScript.Run(ctx, b.c, []string{k.Meta, k.Due, k.Stream}, limit,
		GrabbedTombstoneRetention.Milliseconds()).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("expiring budget shard %d: %w", i, err)
	}
	if len(v)%2 != 0 {
		return nil, fmt.Errorf("expiring budget shard %d: %d values, want pairs", i, len(v))
	}
	out := make([]ExpiredPacket, 0, len(v)/2)
	for j := 0; j < len(v); j += 2 {
		n, err := strconv.ParseInt(v[j+1], 10, 64)
		if err != nil {
			return out, fmt.Errorf("expiring budget shard %d: refund %q of %s: %w", i, v[j+1], v[j], err)
		}
		out = append(out, ExpiredPacket{ID: v[j], Refunded: n})
	}
	return out, nil
}

// Close stops creation on every shard (the budget is being deleted); ExpireDue then
// expires every live packet at once, whatever its time.
func (b *Budget) Close(ctx context.Context) error {
	for i, k := range b.keys {
		if err := lua.BudgetCloseScript.Run(ctx, b.c, []string{k.Meta}).Err(); err != nil {
			return fmt.Errorf("closing budget shard %d: %w", i, err)
		}
	}
	return nil
}

// Fence writes reason as "fenced" into every shard's meta, unless a fence is there
// already (the first reason stays): from then on packet_create and packet_grab answer
// fenced, which the grab fleet answers 503, and packet_expire expires nothing, so
// nothing is granted, created or refunded from data older than what was
// acknowledged. The operator writes it when the budget's Redis lost its data or came
// back below the marks its status recorded, and again at every reconcile of the
// fenced budget, since a shard that lost everything again, or the budget's own Redis
// user (HDEL on its meta), can take it away. A shard that lost its meta gets one
// holding the fence alone, which is still not configured.
func (b *Budget) Fence(ctx context.Context, reason string) error {
	if reason == "" || len(reason) > 64 {
		return fmt.Errorf("fencing the budget: reason %q must be 1 to 64 bytes", reason)
	}
	for i, k := range b.keys {
		if err := b.c.HSetNX(ctx, k.Meta, "fenced", reason).Err(); err != nil {
			return fmt.Errorf("fencing budget shard %d: %w", i, err)
		}
	}
	return nil
}

// Unfence removes the fence from every shard's meta (Fence): the platform team
// accepted the budget's Redis state as it is.
func (b *Budget) Unfence(ctx context.Context) error {
	for i, k := range b.keys {
		if err := b.c.HDel(ctx, k.Meta, "fenced").Err(); err != nil {
			return fmt.Errorf("lifting the fence of budget shard %d: %w", i, err)
		}
	}
	return nil
}

// GrabbedTombstoneRetention is how long the tombstone of a packet that expired with
// nothing left is kept (packet_expire.lua): its grants' keys may be credited up to
// the settlement worker's stale bound after they were written, which is less than
// the ledger's retention, and the ledger keeps them a retention after that; twice
// DefaultPacketLedgerRetention covers both, for any ledger retention up to the
// default (settlement refuses a longer one).
const GrabbedTombstoneRetention = 2 * DefaultPacketLedgerRetention

// ForgetPacket shrinks an expired packet's hash to its tombstone once its refund
// settled, kept for keep (the ledger's retention: the refund was the packet's last
// credit). A packet that has not expired is kept (ErrPacketLive); one already gone
// or a tombstone already is no error. While the tombstone lasts, a creation with the
// same id answers existing or conflict (packet_forget.lua).
func (b *Budget) ForgetPacket(ctx context.Context, packetID string, keep time.Duration) error {
	if !ValidPacketID(packetID) {
		return fmt.Errorf("forgetting packet %q: not a packet id", packetID)
	}
	k := b.keys[b.ShardOf(packetID)]
	return forgetError(packetID, lua.PacketForgetScript.Run(ctx, b.c, []string{k.Packet(packetID)}, tombstoneMillis(keep)).Err())
}

// ForgetPackets is ForgetPacket for many packets in one round trip (pipelined, each
// packet's call its own step); the errors are in the order of packetIDs, nil for a
// packet forgotten or gone.
func (b *Budget) ForgetPackets(ctx context.Context, packetIDs []string, keep time.Duration) []error {
	errs := make([]error, len(packetIDs))
	cmds := make([]*redis.Cmd, len(packetIDs))
	pipe := b.c.Pipeline()
	for i, id := range packetIDs {
		if !ValidPacketID(id) {
			errs[i] = fmt.Errorf("forgetting packet %q: not a packet id", id)
			continue
		}
		k := b.keys[b.ShardOf(id)]
		cmds[i] = pipe.EvalSha(ctx, lua.PacketForgetScript.SHA(), []string{k.Packet(id)}, tombstoneMillis(keep))
	}
	_, _ = pipe.Exec(ctx) // each command carries its own error
	for i, cmd := range cmds {
		switch {
		case cmd == nil:
		case lua.IsNoScript(cmd.Err()):
			errs[i] = b.ForgetPacket(ctx, packetIDs[i], keep)
		default:
			errs[i] = forgetError(packetIDs[i], cmd.Err())
		}
	}
	return errs
}

// tombstoneMillis is keep in whole milliseconds, DefaultPacketLedgerRetention when
// keep is under a millisecond.
func tombstoneMillis(keep time.Duration) int64 {
	if keep < time.Millisecond {
		keep = DefaultPacketLedgerRetention
	}
	return keep.Milliseconds()
}

// forgetError is what a forget call's error means: nil, ErrPacketLive, or the error.
func forgetError(packetID string, err error) error {
	if err != nil && strings.Contains(err.Error(), "has not expired") {
		return fmt.Errorf("forgetting packet %s: %w", packetID, ErrPacketLive)
	}
	if err != nil {
		return fmt.Errorf("forgetting packet %s: %w", packetID, err)
	}
	return nil
}

// Purge deletes every key of the budget: each shard's meta, due index, streams, and
// every packet hash, found by SCAN of the budget's key pattern on every master (a
// packet that expired and was forgotten or not is in no index). Keys go by UNLINK,
// one at a time, so a cluster client never sends a multi-key command across slots.
func (b *Budget) Purge(ctx context.Context) error {
	for i, k := range b.keys {
		for _, key := range []string{k.Meta, k.Due, k.Stream, k.DeadLetters} {
			if err := b.c.Unlink(ctx, key).Err(); err != nil {
				return fmt.Errorf("purging budget shard %d: deleting %s: %w", i, key, err)
			}
		}
	}
	pattern := "rpb:{" + globEscape(b.uid) + ".*}:p:*"
	purgeNode := func(ctx context.Context, node redis.Cmdable) error {
		var cursor uint64
		for {
			keys, next, err := node.Scan(ctx, cursor, pattern, 1000).Result()
			if err != nil {
				return fmt.Errorf("purging budget %s: SCAN: %w", b.uid, err)
			}
			for _, key := range keys {
				if err := node.Unlink(ctx, key).Err(); err != nil {
					return fmt.Errorf("purging budget %s: deleting %s: %w", b.uid, key, err)
				}
			}
			if cursor = next; cursor == 0 {
				return nil
			}
		}
	}
	switch c := b.c.(type) {
	case *redis.ClusterClient:
		return c.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error { return purgeNode(ctx, node) })
	case *redis.Client:
		return purgeNode(ctx, c)
	default:
		return fmt.Errorf("purging budget %s: a %T cannot SCAN every master", b.uid, b.c)
	}
}

// globEscape quotes the glob characters of s for a SCAN MATCH pattern.
func globEscape(s string) string {
	var sb strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\`, r) {
			sb.WriteByte('\\')
		}
		sb.WriteRune(r)
	}
	return sb.String()
}

// cachedLimits are limits read from a shard's meta, and when.
type cachedLimits struct {
	BudgetLimits
	at time.Time
}

// limitsFresh is how long CreatePacket trusts limits it read from Redis: a change
// of the minimum share reaches every grab pod within it (the create script checks
// the limits it holds itself, so a stale value can only be refused, never pass).
const limitsFresh = 5 * time.Second

// limitsFor returns the budget's limits as shard i's meta holds them, read at most
// every limitsFresh. ok is false when the shard was never configured.
func (b *Budget) limitsFor(ctx context.Context, i int) (BudgetLimits, bool, error) {
	if l := b.limits.Load(); l != nil && time.Since(l.at) < limitsFresh {
		return l.BudgetLimits, true, nil
	}
	v, err := b.c.HMGet(ctx, b.keys[i].Meta, "currency", "max_total", "max_count", "min_share", "dists",
		"default_ttl_ms", "max_ttl_ms").Result()
	if err != nil {
		return BudgetLimits{}, false, fmt.Errorf("reading budget shard %d's limits: %w", i, err)
	}
	str := func(j int) string { s, _ := v[j].(string); return s }
	if str(0) == "" {
		return BudgetLimits{}, false, nil
	}
	num := func(j int) int64 { n, _ := strconv.ParseInt(str(j), 10, 64); return n }
	l := BudgetLimits{Currency: str(0), MaxTotal: num(1), MaxCount: num(2), MinShare: num(3),
		Distributions: strings.Split(strings.Trim(str(4), ","), ","),
		DefaultTTL:    time.Duration(num(5)) * time.Millisecond, MaxTTL: time.Duration(num(6)) * time.Millisecond}
	if l.MinShare < 1 || l.MinShare > math.MaxInt64/MaxPacketShares {
		return BudgetLimits{}, false, fmt.Errorf("budget shard %d's minimum share %q is not a positive integer", i, str(3))
	}
	b.limits.Store(&cachedLimits{BudgetLimits: l, at: time.Now()})
	return l, true, nil
}

// DeadLetterCount counts the entries in every shard's dead-letter stream: the
// credits the balance system refused, waiting for a replay.
func (b *Budget) DeadLetterCount(ctx context.Context) (int64, error) {
	var n int64
	for i, k := range b.keys {
		l, err := b.c.XLen(ctx, k.DeadLetters).Result()
		if err != nil {
			return 0, fmt.Errorf("budget shard %d: XLEN %s: %w", i, k.DeadLetters, err)
		}
		n += l
	}
	return n, nil
}
