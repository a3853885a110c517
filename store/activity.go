package store

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Activity is the handle of one activity, spread over n hash tags so that a Redis
// Cluster can place its parts on different masters: shard i (Shard, every script
// unchanged) has the keys under the tag {<uid>.<i>}. An activity of one shard has its
// keys under {<uid>}; it is the ordinary case of the same rules, not a separate
// layout: every operation takes the same steps for every n.
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
//   - Closing closes every shard without a refund, then writes one refund for the
//     activity on shard 0 (refund_activity.lua, the only script that writes one): the
//     total minus every shard's claimed amount, read after all of them closed. A
//     packet still in a journal is neither claimed nor listed, so the refund counts
//     it; a closed shard refuses transfers in and out.
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
	// Marks, when set, is what the caller has seen each shard reach (the grab
	// service's guard): every transfer script gets the mark of the shard it runs on
	// and fences a shard below it (transfer_out.lua), and the transfer sequences the
	// scripts and the stock readings answer with raise the marks. Grab takes the
	// grab's marks from its own argument.
	Marks ShardMarks

	// markFields are the meta fields in which the siblings keep each shard's transfer
	// mark (RecordedMark), built once.
	markFields []string

	idPrefix string
	nextID   atomic.Uint64
	refill   []sync.Mutex
	// soldOutAt is when a steady reading last found no packet anywhere (unix nanos,
	// 0 for never). Stock does not come back (short of an operator accepting a
	// rolled-back state), so for soldOutFor after it a grab that finds its home dry is
	// sold out at once, without reading every shard again.
	soldOutAt atomic.Int64
}

// MaxShards is the most shards one activity may have (spec.shards).
const MaxShards = 64

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
		s.markFields = make([]string, n)
		for i := range s.markFields {
			s.markFields[i] = markField(i)
		}
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

// Meta fields of the activity as a whole, on shard 0.
const (
	fieldActivityCount  = "activity_count"
	fieldActivityTotal  = "activity_total"
	fieldActivityRefund = "activity_refund"
	fieldActivityReason = "activity_close_reason"
	fieldShards         = "shards"
)

// eachShard runs fn for every shard at the same time and returns the first error.
func (s *Activity) eachShard(fn func(i int, a *Shard) error) error {
	errs := make([]error, len(s.shards))
	var wg sync.WaitGroup
	for i, a := range s.shards {
		wg.Go(func() {
			if err := fn(i, a); err != nil {
				errs[i] = fmt.Errorf("shard %d: %w", i, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// onEveryShard runs op on every shard at once (eachShard) and returns each shard's
// result at its index, also where op failed.
func onEveryShard[T any](s *Activity, op func(a *Shard) (T, error)) ([]T, error) {
	out := make([]T, len(s.shards))
	err := s.eachShard(func(i int, a *Shard) error {
		r, err := op(a)
		out[i] = r
		return err
	})
	return out, err
}

// Time is the Redis clock of shard 0's master.
func (s *Activity) Time(ctx context.Context) (time.Time, error) { return s.shards[0].Time(ctx) }

// Ping checks that every shard's master answers.
func (s *Activity) Ping(ctx context.Context) error {
	return s.eachShard(func(_ int, a *Shard) error { return a.Ping(ctx) })
}

// LoadScripts loads every script on every master (see Shard.LoadScripts).
func (s *Activity) LoadScripts(ctx context.Context) error { return s.shards[0].LoadScripts(ctx) }

// CheckFsync checks every shard's master (Shard.CheckFsync).
func (s *Activity) CheckFsync(ctx context.Context) error {
	return s.eachShard(func(_ int, a *Shard) error { return a.CheckFsync(ctx) })
}

// CheckReplicas checks that every shard's master has at least n replicas connected.
func (s *Activity) CheckReplicas(ctx context.Context, n int) error {
	return s.eachShard(func(_ int, a *Shard) error { return a.CheckReplicas(ctx, n) })
}

// EnsureUser gives the activity's ACL user, whose key patterns cover every shard,
// the password on every node (Shard.EnsureUser).
func (s *Activity) EnsureUser(ctx context.Context, password string) (UserChange, error) {
	return s.base.EnsureUser(ctx, password)
}

// UserName is the name of the activity's Redis ACL user (EnsureUser).
func (s *Activity) UserName() string { return s.base.keys.userName() }

// DeleteUser removes the activity's ACL user from every node.
func (s *Activity) DeleteUser(ctx context.Context) (int, error) { return s.base.DeleteUser(ctx) }

// ErrMissing is returned by callers that need a committed activity and find none.
var ErrMissing = errors.New("activity not found in Redis")

func boolArg(b bool) string {
	if b {
		return "1"
	}
	return "0"
}
