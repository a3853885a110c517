package grabsvc

import (
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// RollbackGuard is what one grab service knows about how far its activity's Redis
// has got, shared by the grab path and the reporter. Its watermark (the highest
// claimed count seen, within an epoch) goes with every grab, so that the grab script
// fences a Redis that came back older than what was acknowledged instead of granting
// from it (see grab.lua). It rises with every grant answered and with every status
// read from the API server; it never falls within an epoch.
//
// It also holds why the service cannot serve its activity (the activity is fenced,
// or its data is not in Redis): /readyz then answers 503, so that a Service stops
// routing to a replica whose every grab would be refused.
//
// The zero value is ready to use.
//
// A sharded activity has a watermark per shard, each the highest claimed count and
// transfer sequence seen on that shard: from grants, from the transfer scripts'
// answers and the stock readings of refills (store.Activity.Marks), from the
// reporter's reading of the shard, and from status.shardWatermarks (the status's
// counters are sums over the shards, so they raise no shard's watermark). A shard
// below its transfer sequence came back from before a transfer and may list again
// packets that left it: the grab and transfer scripts fence it.
type RollbackGuard struct {
	cur    atomic.Pointer[guardState]
	shards atomic.Pointer[shardMarks]
}

// shardMarks are the watermarks of the shards of one sharded activity.
type shardMarks struct {
	uid   types.UID
	marks []atomic.Pointer[store.Watermark]
}

type guardState struct {
	uid     types.UID
	mark    store.Watermark
	problem string
}

// statusMark is the watermark a status records.
func statusMark(st *redpacketv1alpha1.RedPacketActivityStatus) store.Watermark {
	var w store.Watermark
	if st.RedisEpoch != nil {
		w.Epoch = *st.RedisEpoch
	}
	if st.ClaimedCount != nil {
		w.ClaimedCount = *st.ClaimedCount
	}
	return w
}

// shardMark is the watermark status st gives shard i: its figures in
// status.shardWatermarks (claimed count and transfer sequence), in that epoch; the
// zero watermark when there is none.
func shardMark(st *redpacketv1alpha1.RedPacketActivityStatus, i int) store.Watermark {
	w := st.ShardWatermarks
	if w == nil {
		return store.Watermark{}
	}
	m := store.Watermark{Epoch: w.Epoch}
	if i < len(w.ClaimedCounts) {
		m.ClaimedCount = w.ClaimedCounts[i]
	}
	if i < len(w.TransferSeqs) {
		m.TransferSeq = w.TransferSeqs[i]
	}
	if m == (store.Watermark{Epoch: w.Epoch}) {
		return store.Watermark{}
	}
	return m
}

// guardMarks are the guard's watermarks of the shards of the activity uid as a
// handle's transfers use them (store.ShardMarks): a transfer sends each shard's
// MarkShard and raises it with what the scripts answer.
type guardMarks struct {
	g        *RollbackGuard
	uid      types.UID
	n        int
	resource func() *Resource
}

var _ store.ShardMarks = guardMarks{}

// Mark is MarkShard of the current activity; the zero watermark when the activity
// is not uid any more (its handle is then replaced too).
func (m guardMarks) Mark(i int) store.Watermark {
	act := m.resource()
	if act == nil || act.Object.UID != m.uid {
		return store.Watermark{}
	}
	return m.g.MarkShard(act, i)
}

// Saw raises shard i's watermark.
func (m guardMarks) Saw(i int, w store.Watermark) { m.g.SawShard(m.uid, i, m.n, w) }

// Mark is the watermark to send with a grab of act: the higher of what this service
// saw and what act's status records.
func (g *RollbackGuard) Mark(act *Resource) store.Watermark {
	w := statusMark(&act.Object.Status)
	if cur := g.cur.Load(); cur != nil && cur.uid == act.Object.UID {
		return cur.mark.Raise(w)
	}
	return w
}

// MarkShard is the watermark to send with a grab on shard i of act: Mark(act) when
// act has one shard.
func (g *RollbackGuard) MarkShard(act *Resource, i int) store.Watermark {
	n := act.Object.Spec.ShardCount()
	if n == 1 {
		return g.Mark(act)
	}
	w := shardMark(&act.Object.Status, i)
	if sm := g.shards.Load(); sm != nil && sm.uid == act.Object.UID && i < len(sm.marks) {
		if seen := sm.marks[i].Load(); seen != nil {
			return seen.Raise(w)
		}
	}
	return w
}

// SawShard raises the watermark of shard i of the n shards of activity uid to w: Saw
// when n is 1.
func (g *RollbackGuard) SawShard(uid types.UID, i, n int, w store.Watermark) {
	if n <= 1 {
		g.Saw(uid, w)
		return
	}
	sm := g.shards.Load()
	if sm == nil || sm.uid != uid || len(sm.marks) != n {
		next := &shardMarks{uid: uid, marks: make([]atomic.Pointer[store.Watermark], n)}
		if !g.shards.CompareAndSwap(sm, next) {
			g.SawShard(uid, i, n, w)
			return
		}
		sm = next
	}
	for {
		cur := sm.marks[i].Load()
		next := w
		if cur != nil {
			if next = cur.Raise(w); next == *cur {
				return
			}
		}
		if sm.marks[i].CompareAndSwap(cur, &next) {
			return
		}
	}
}

// Saw raises the watermark of activity uid to w.
func (g *RollbackGuard) Saw(uid types.UID, w store.Watermark) {
	g.update(uid, func(st *guardState) { st.mark = st.mark.Raise(w) })
}

// SetProblem records why activity uid cannot be served; "" clears it.
func (g *RollbackGuard) SetProblem(uid types.UID, why string) {
	g.update(uid, func(st *guardState) { st.problem = why })
}

// Problem is why activity uid cannot be served, "" when it can.
func (g *RollbackGuard) Problem(uid types.UID) string {
	if cur := g.cur.Load(); cur != nil && cur.uid == uid {
		return cur.problem
	}
	return ""
}

// update applies f to a copy of the state of uid (a fresh one when the guard held
// another activity's) and installs it, retrying when another goroutine got there
// first.
func (g *RollbackGuard) update(uid types.UID, f func(*guardState)) {
	for {
		cur := g.cur.Load()
		next := &guardState{uid: uid}
		if cur != nil && cur.uid == uid {
			*next = *cur
		}
		f(next)
		if cur != nil && *cur == *next {
			return
		}
		if g.cur.CompareAndSwap(cur, next) {
			return
		}
	}
}

// Why a grab service cannot serve its activity, as /readyz says.
const (
	problemMissing = "the activity's data is not in Redis (the operator reports DataLost on the resource)"
	problemFenced  = "the activity is fenced: its Redis came back older than what was granted (the operator reports RedisRolledBack on the resource)"
)

// durableWaiters keeps the ReplicaWaiter of the current activity, built from its
// spec.durability; nil when the activity answers grabs without waiting for replicas.
type durableWaiters struct {
	cur atomic.Pointer[durableWaiter]
}

type durableWaiter struct {
	uid      types.UID
	replicas int32
	timeout  int32
	// w is the waiter of each shard: WAIT must run on the master that took the grant.
	w []*store.ReplicaWaiter
}

// DefaultReplicaTimeout is how long a grab waits for replicas when
// spec.durability.timeoutMilliseconds is not set.
const DefaultReplicaTimeout = store.DefaultReplicaTimeout

// of returns the waiter for shard i of act on c, nil when act's durability is not
// Replicas.
func (ws *durableWaiters) of(c redis.Cmdable, act *Resource, i int) *store.ReplicaWaiter {
	d := act.Object.Spec.Durability
	if c == nil || d == nil || d.Mode != redpacketv1alpha1.DurabilityReplicas || d.Replicas < 1 {
		return nil
	}
	cur := ws.cur.Load()
	if cur != nil && cur.uid == act.Object.UID && cur.replicas == d.Replicas && cur.timeout == d.TimeoutMilliseconds {
		return cur.w[i]
	}
	timeout := DefaultReplicaTimeout
	if d.TimeoutMilliseconds > 0 {
		timeout = time.Duration(d.TimeoutMilliseconds) * time.Millisecond
	}
	n := act.Object.Spec.ShardCount()
	next := &durableWaiter{uid: act.Object.UID, replicas: d.Replicas, timeout: d.TimeoutMilliseconds,
		w: make([]*store.ReplicaWaiter, n)}
	h := store.NewActivity(c, string(act.Object.UID), n)
	for k := range next.w {
		next.w[k] = h.Shard(k).ReplicaWaiter(int(d.Replicas), timeout)
	}
	if ws.cur.CompareAndSwap(cur, next) {
		return next.w[i]
	}
	return ws.of(c, act, i)
}
