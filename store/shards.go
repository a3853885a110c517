package store

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"redpacket.io/operator/lua"
)

// MaxShards is the most shards one activity may have (spec.shards).
const MaxShards = 64

// DefaultTransferBatch is the most packets one refill moves between shards.
const DefaultTransferBatch = 128

// soldOutFor is how long a steady reading that found no packet anywhere answers for
// the grabs that follow it.
const soldOutFor = time.Second

// Activity is one activity spread over n hash tags, so that a Redis Cluster can place
// its parts on different masters: shard i is an ordinary activity (Activity, every
// script unchanged) whose keys carry the tag {<uid>.<i>}. A one-shard activity is
// the activity itself, under {<uid>}, so n = 1 is exactly the unsharded layout.
//
// The rules that keep a sharded activity as exact as one on a single slot:
//
//   - A user's claim is decided by their home shard alone (Home, a stable hash
//     of the user id), so that shard's claims hash is the whole truth about whether
//     the user holds a packet: one packet per user across all shards.
//   - Packets move between shards only by a journalled transfer (transfer_out,
//     transfer_in, transfer_done). At every instant a packet is in exactly one of: a
//     shard's list, a claim, or a source's journal entry that the destination has not
//     applied. A transfer has an id; the destination applies an id at most once and
//     the source keeps the entry until the destination has applied it, so a crash
//     anywhere between the halves neither loses nor duplicates a packet: whoever
//     finds the entry (Resolve) finishes the move.
//   - Each shard's meta "count" and "total" follow its packets in and out, so on an
//     open shard LLEN(packets) + claimed_count = count, and across shards
//     Σ count + packets in transfer = the activity's count (the same for amounts).
//     ReadShards checks both (Conservation).
//   - A home shard that runs dry refills from the sibling with the most stock
//     before its user is told sold_out; sold_out is answered only after a reading of
//     every shard in which no packet moved between shards (the transfer sequences
//     did not change) showed no packet listed or in transfer anywhere. Since grabs
//     only remove packets, no packet was left anywhere at that instant, and none can
//     appear later.
//   - Closing closes every shard without refund entries, then writes one refund for
//     the activity on shard 0: the total minus every shard's claimed amount, read
//     after all of them closed. A packet still in a journal is neither claimed nor
//     listed, so the refund counts it; a closed shard refuses transfers in and out.
//
// Activity is safe for concurrent use; refills of one home shard are serialized within
// the process (other processes may refill at the same time: the journal keeps that
// exact too).
type Activity struct {
	uid    string
	shards []*Shard
	// base is the activity's handle under {<uid>}: shard 0 when there is one shard;
	// its ACL user's key patterns cover every shard (EnsureUser).
	base *Shard
	// Seeder stages and commits each shard's packets; its zero value is what
	// production uses.
	Seeder Seeder
	// TransferBatch is the most packets one refill moves; 0 means
	// DefaultTransferBatch. A refill takes half of its source's list, up to this.
	TransferBatch int
	// Replicated, when set, returns once enough replicas of shard i's master hold
	// every write made to it so far (a ReplicaWaiter's Wait), and an error when they
	// do not in time. A transfer then goes on only once its first half is on the
	// source's replicas, and forgets its journal entry only once its second half is on
	// the destination's: a failover to a replica can then neither give the source its
	// packets back while the destination has them (granting them twice) nor take them
	// from the destination after the source forgot them. Set it for durability
	// Replicas; without replicas a crash is covered by fsync (durability Fsync).
	Replicated func(ctx context.Context, shard int) error

	idPrefix string
	nextID   atomic.Uint64
	refill   []sync.Mutex
	// soldOutAt is when a steady reading last found no packet anywhere (unix nanos,
	// 0 for never). Stock does not come back (short of an operator accepting a
	// rolled-back state), so for soldOutFor after it a grab that finds its home dry is
	// sold out at once, without reading every shard again.
	soldOutAt atomic.Int64
}

// shardUID is the UID whose hash tag holds shard i of an activity of n shards: the
// activity's own UID when n is 1, "<uid>.<i>" otherwise.
func shardUID(uid string, i, n int) string {
	if n <= 1 {
		return uid
	}
	return uid + "." + strconv.Itoa(i)
}

// homeShard is the shard that decides userID's claims: FNV-1a (64 bit) of the user
// id, modulo n. It depends on nothing but the id and n, so every grab pod, restart
// and version agrees; n is immutable for that reason.
func homeShard(userID string, n int) int {
	if n <= 1 {
		return 0
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte(userID))
	return int(h.Sum64() % uint64(n))
}

// NewActivity returns the handle of the activity uid spread over n shards (n ≤ 1 is
// one shard) on client c, which must reach every shard's slot (a cluster client, or
// any client of a single server).
func NewActivity(c redis.Cmdable, uid string, n int) *Activity {
	n = max(n, 1)
	s := &Activity{uid: uid, shards: make([]*Shard, n), refill: make([]sync.Mutex, n)}
	for i := range s.shards {
		s.shards[i] = newShard(c, shardUID(uid, i, n))
	}
	s.base = s.shards[0]
	if n > 1 {
		s.base = newShard(c, uid)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	s.idPrefix = hex.EncodeToString(b[:]) + "-"
	return s
}

// UID is the activity's UID.
func (s *Activity) UID() string { return s.uid }

// N is the number of shards.
func (s *Activity) N() int { return len(s.shards) }

// Shard is the handle of shard i: its grabs, settlement stream and consumer group.
func (s *Activity) Shard(i int) *Shard { return s.shards[i] }

// Home is the index of userID's home shard.
func (s *Activity) Home(userID string) int { return homeShard(userID, len(s.shards)) }

// Seed seeds the split amounts (packet i+1 gets amounts[i]) over the shards: packet
// j goes to shard j mod n and keeps its id j+1, so ids are unique across shards and
// every shard gets an even share of large and small packets. Each shard is seeded
// exactly once (Seeder); shard 0 also records the activity's count and total, the
// figures conservation is checked against. Committed is true when any shard was
// committed by this call.
func (s *Activity) Seed(ctx context.Context, amounts []int64, p SeedParams) (SeedResult, error) {
	n := len(s.shards)
	if err := checkSplit(amounts, p); err != nil {
		return SeedResult{}, err
	}
	if p.Count < int64(n) {
		return SeedResult{}, fmt.Errorf("seeding: %d packets cannot fill %d shards", p.Count, n)
	}
	var res SeedResult
	for i, a := range s.shards {
		part := make([]int64, 0, (len(amounts)+n-1)/n)
		var total int64
		for j := i; j < len(amounts); j += n {
			part = append(part, amounts[j])
			total += amounts[j]
		}
		sp := p
		sp.Count, sp.Total = int64(len(part)), total
		seeder := s.Seeder
		seeder.IDStride, seeder.IDOffset = int64(n), int64(i)
		r, err := seeder.seed(ctx, a.c, a.keys, part, sp)
		if err != nil {
			return SeedResult{}, fmt.Errorf("shard %d: %w", i, err)
		}
		res.Committed = res.Committed || r.Committed
	}
	root := s.shards[0]
	if err := root.c.HSet(ctx, root.keys.Meta, fieldActivityCount, p.Count, fieldActivityTotal, p.Total,
		fieldShards, n).Err(); err != nil {
		return SeedResult{}, fmt.Errorf("recording the activity's totals on shard 0: %w", err)
	}
	return res, nil
}

// Meta fields of the activity as a whole, on shard 0.
const (
	fieldActivityCount  = "activity_count"
	fieldActivityTotal  = "activity_total"
	fieldActivityRefund = "activity_refund"
	fieldActivityReason = "activity_close_reason"
	fieldShards         = "shards"
)

// Grab decides one claim for userID on their home shard, which must not be below
// markOf(home) (nil checks no watermark). When the home shard has run dry it refills
// from its siblings and tries again, so sold_out means no packet was left anywhere.
// It returns the home shard with the result.
func (s *Activity) Grab(ctx context.Context, userID string, markOf func(shard int) Watermark) (GrabResult, int, error) {
	h := s.Home(userID)
	home := s.shards[h]
	for {
		var mark Watermark
		if markOf != nil {
			mark = markOf(h)
		}
		r, err := home.GrabAbove(ctx, userID, mark)
		if err != nil || r.Outcome != SoldOut || len(s.shards) == 1 || s.recentlySoldOut() {
			return r, h, err
		}
		refilled, err := s.Refill(ctx, h)
		if err != nil {
			return GrabResult{}, h, fmt.Errorf("refilling shard %d: %w", h, err)
		}
		if !refilled {
			return r, h, nil
		}
	}
}

// recentlySoldOut reports whether a steady reading found nothing within soldOutFor.
func (s *Activity) recentlySoldOut() bool {
	at := s.soldOutAt.Load()
	return at != 0 && time.Since(time.Unix(0, at)) < soldOutFor
}

// ErrShardUnavailable is wrapped when packets are left only on shards that cannot
// give them now.
var ErrShardUnavailable = errors.New("the shard cannot give packets now")

// ErrUnsteady is returned when the shards' stock could not be read without packets
// moving between shards meanwhile, after several tries.
var ErrUnsteady = errors.New("packets kept moving between shards while their stock was read")

// stockReads is how many times Refill and ReadShards read every shard before they
// give up with ErrUnsteady.
const stockReads = 8

// Refill gives shard h packets from the sibling with the most, in one journalled
// transfer of up to TransferBatch. It returns true when h holds packets afterwards
// (moved now, or by someone else meanwhile), false when a steady reading found no
// packet listed or in transfer on any shard: the activity is sold out.
func (s *Activity) Refill(ctx context.Context, h int) (bool, error) {
	mu := &s.refill[h]
	mu.Lock()
	defer mu.Unlock()
	// Another caller may have refilled it while this one waited for the lock.
	if home, err := s.stockOf(ctx, h); err != nil {
		return false, err
	} else if home.listed > 0 {
		return true, nil
	}
	for range stockReads {
		stock, steady, err := s.readStock(ctx)
		if err != nil {
			return false, err
		}
		if stock[h].listed > 0 {
			return true, nil
		}
		src, journalled, held := -1, false, -1
		for i, st := range stock {
			if st.journal > 0 {
				journalled = true
			}
			if i != h && st.listed > 0 {
				held = i
			}
			// Only an open shard gives: a closed, fenced or missing one refuses, and one
			// whose window ended gives nothing (transfer_out checks the clock).
			if i != h && st.state == string(StateOpen) && st.listed > 0 && (src < 0 || st.listed > stock[src].listed) {
				src = i
			}
		}
		switch {
		case src >= 0:
			batch := int64(s.TransferBatch)
			if batch <= 0 {
				batch = DefaultTransferBatch
			}
			batch = max(1, min(batch, (stock[src].listed+1)/2))
			moved, err := s.Transfer(ctx, src, h, batch)
			if err != nil {
				return false, err
			}
			if moved > 0 {
				return true, nil
			}
		case journalled:
			if _, err := s.Resolve(ctx); err != nil {
				return false, err
			}
		case held >= 0:
			// Packets are left on a shard that cannot give them now (not open yet,
			// fenced): not sold out, and not grantable either.
			return false, fmt.Errorf("shard %d holds %d packets but is %q: %w", held, stock[held].listed, stock[held].state, ErrShardUnavailable)
		case steady:
			s.soldOutAt.Store(time.Now().UnixNano())
			return false, nil
		}
	}
	return false, ErrUnsteady
}

// shardStock is one shard's stock as stock.lua reads it.
type shardStock struct {
	seq, listed, journal int64
	state                string
}

// readStock reads every shard's stock three times over (transfer sequences, stock,
// sequences again) and returns the middle reading. steady is true when no shard's
// sequence moved between the first and the last reading: no packet moved between
// shards while the stock was read, and grabs could only lower it, so the middle
// reading's zeroes were all true at once when it ended.
func (s *Activity) readStock(ctx context.Context) ([]shardStock, bool, error) {
	before, err := s.stockOnce(ctx)
	if err != nil {
		return nil, false, err
	}
	stock, err := s.stockOnce(ctx)
	if err != nil {
		return nil, false, err
	}
	after, err := s.stockOnce(ctx)
	if err != nil {
		return nil, false, err
	}
	for i := range before {
		if before[i].seq != after[i].seq {
			return stock, false, nil
		}
	}
	return stock, true, nil
}

// stockOnce reads every shard's stock, the shards in parallel.
func (s *Activity) stockOnce(ctx context.Context) ([]shardStock, error) {
	out := make([]shardStock, len(s.shards))
	err := s.eachShard(func(i int, _ *Shard) error {
		st, err := s.stockOf(ctx, i)
		out[i] = st
		return err
	})
	return out, err
}

// stockOf reads shard i's stock (stock.lua).
func (s *Activity) stockOf(ctx context.Context, i int) (shardStock, error) {
	a := s.shards[i]
	vals, err := lua.StockScript.Run(ctx, a.c, []string{a.keys.Meta, a.keys.Packets, a.keys.Transfers}).Slice()
	if err != nil {
		return shardStock{}, fmt.Errorf("reading the stock of shard %d: %w", i, err)
	}
	if len(vals) != 4 {
		return shardStock{}, fmt.Errorf("reading the stock of shard %d: %d values, want 4", i, len(vals))
	}
	seq, _ := vals[0].(int64)
	listed, _ := vals[1].(int64)
	journal, _ := vals[2].(int64)
	state, _ := vals[3].(string)
	return shardStock{seq: seq, listed: listed, journal: journal, state: state}, nil
}

// eachShard runs fn for every shard at the same time and returns the first error.
func (s *Activity) eachShard(fn func(i int, a *Shard) error) error {
	errs := make([]error, len(s.shards))
	var wg sync.WaitGroup
	for i, a := range s.shards {
		wg.Go(func() { errs[i] = fn(i, a) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// transfer is a journal entry: "<dest>|<count>|<amount>|<id>:<amount>,...".
type transfer struct {
	dest          int
	count, amount int64
	packets       []string
}

func parseTransfer(entry string) (transfer, error) {
	parts := strings.SplitN(entry, "|", 4)
	if len(parts) != 4 {
		return transfer{}, fmt.Errorf("transfer journal entry %q: want dest|count|amount|packets", entry)
	}
	var t transfer
	var err error
	if t.dest, err = strconv.Atoi(parts[0]); err != nil {
		return transfer{}, fmt.Errorf("transfer journal entry %q: destination: %w", entry, err)
	}
	if t.count, err = strconv.ParseInt(parts[1], 10, 64); err != nil {
		return transfer{}, fmt.Errorf("transfer journal entry %q: count: %w", entry, err)
	}
	if t.amount, err = strconv.ParseInt(parts[2], 10, 64); err != nil {
		return transfer{}, fmt.Errorf("transfer journal entry %q: amount: %w", entry, err)
	}
	t.packets = strings.Split(parts[3], ",")
	if int64(len(t.packets)) != t.count {
		return transfer{}, fmt.Errorf("transfer journal entry: %d packets, count says %d", len(t.packets), t.count)
	}
	return t, nil
}

// Transfer moves up to batch packets from shard src to shard dst in one journalled
// transfer and returns how many moved (0 when src had none, or is closed, ended or
// fenced). Refill uses it; so may an operator's rebalancing.
func (s *Activity) Transfer(ctx context.Context, src, dst int, batch int64) (int64, error) {
	if src < 0 || src >= len(s.shards) || dst < 0 || dst >= len(s.shards) || src == dst {
		return 0, fmt.Errorf("transfer from shard %d to shard %d of %d", src, dst, len(s.shards))
	}
	id := s.idPrefix + strconv.FormatUint(s.nextID.Add(1), 10)
	a := s.shards[src]
	vals, err := lua.TransferOutScript.Run(ctx, a.c, []string{a.keys.Meta, a.keys.Packets, a.keys.Transfers},
		id, dst, batch).StringSlice()
	if err != nil {
		return 0, fmt.Errorf("transfer %s out of shard %d: %w", id, src, err)
	}
	if len(vals) != 2 {
		return 0, fmt.Errorf("transfer %s out of shard %d: %d values, want 2", id, src, len(vals))
	}
	if vals[0] != "moved" && vals[0] != "pending" {
		return 0, nil // empty, closed, ended, fenced or missing: nothing left the source
	}
	return s.apply(ctx, src, id, vals[1])
}

// replicated waits for shard i's replicas when Replicated is set.
func (s *Activity) replicated(ctx context.Context, i int, what string) error {
	if s.Replicated == nil {
		return nil
	}
	if err := s.Replicated(ctx, i); err != nil {
		return fmt.Errorf("%s: shard %d's replicas: %w", what, i, err)
	}
	return nil
}

// apply finishes the journalled transfer id of shard src: once the source's replicas
// hold the entry (Replicated), the destination applies it (at most once, whoever
// calls), and once the destination's replicas hold that, the source forgets it. It returns how many
// packets the destination holds from it, 0 when the destination refused (closed,
// fenced or missing): the entry then stays in the journal and the packets stay out
// of every list, counted by the refund at close.
func (s *Activity) apply(ctx context.Context, src int, id, entry string) (int64, error) {
	t, err := parseTransfer(entry)
	if err != nil {
		return 0, fmt.Errorf("shard %d: %w", src, err)
	}
	if t.dest < 0 || t.dest >= len(s.shards) || t.dest == src {
		return 0, fmt.Errorf("transfer %s of shard %d names destination %d of %d shards", id, src, t.dest, len(s.shards))
	}
	if err := s.replicated(ctx, src, "transfer "+id+" out"); err != nil {
		return 0, err
	}
	d := s.shards[t.dest]
	args := make([]any, 0, 3+len(t.packets))
	args = append(args, id, t.count, t.amount)
	for _, p := range t.packets {
		args = append(args, p)
	}
	res, err := lua.TransferInScript.Run(ctx, d.c, []string{d.keys.Meta, d.keys.Packets, d.keys.Applied}, args...).Text()
	if err != nil {
		return 0, fmt.Errorf("transfer %s into shard %d: %w", id, t.dest, err)
	}
	if res != "applied" {
		return 0, nil
	}
	if err := s.replicated(ctx, t.dest, "transfer "+id+" in"); err != nil {
		return 0, err
	}
	a := s.shards[src]
	if err := lua.TransferDoneScript.Run(ctx, a.c, []string{a.keys.Meta, a.keys.Transfers}, id).Err(); err != nil {
		return 0, fmt.Errorf("transfer %s done on shard %d: %w", id, src, err)
	}
	return t.count, nil
}

// Resolve finishes every transfer left in a journal (by a process that died between
// the halves, or one racing this call: applying is idempotent). It returns how many
// transfers are still journalled because their destination refused them.
func (s *Activity) Resolve(ctx context.Context) (int, error) {
	var left atomic.Int64
	err := s.eachShard(func(i int, a *Shard) error {
		entries, err := a.c.HGetAll(ctx, a.keys.Transfers).Result()
		if err != nil {
			return fmt.Errorf("reading the transfer journal of shard %d: %w", i, err)
		}
		for id, entry := range entries {
			n, err := s.apply(ctx, i, id, entry)
			if err != nil {
				return err
			}
			if n == 0 {
				left.Add(1)
			}
		}
		return nil
	})
	return int(left.Load()), err
}
