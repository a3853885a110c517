package store_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// The sharding layer under races and faults: rollbacks of one shard, transfers cut
// between their halves, closes racing refills, forged refunds.

// usersOn returns n user ids at home on shard i of n shards, named after prefix.
func usersOn(prefix string, i, shards, n int) []string {
	var out []string
	for k := 0; len(out) < n; k++ {
		if u := fmt.Sprintf("%s-%d", prefix, k); homeOf(u, shards) == i {
			out = append(out, u)
		}
	}
	return out
}

// shardImage is the keys of one shard as a lagging replica (or a restored backup)
// would hold them: the DUMP of each key, nil for a key that did not exist.
type shardImage map[string][]byte

func dumpShard(t *testing.T, ctx context.Context, c redis.Cmdable, k store.Keys) shardImage {
	t.Helper()
	img := shardImage{}
	for _, key := range k.All() {
		d, err := c.Dump(ctx, key).Result()
		switch {
		case errors.Is(err, redis.Nil):
			img[key] = nil
		case err != nil:
			t.Fatalf("dumping %s: %v", key, err)
		default:
			img[key] = []byte(d)
		}
	}
	return img
}

// restoreShard puts a shard back to img: what a master holds after a failover to a
// replica that had not received the later writes.
func restoreShard(t *testing.T, ctx context.Context, c redis.Cmdable, img shardImage) {
	t.Helper()
	for key, d := range img {
		if d == nil {
			if err := c.Del(ctx, key).Err(); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := c.RestoreReplace(ctx, key, 0, string(d)).Err(); err != nil {
			t.Fatalf("restoring %s: %v", key, err)
		}
	}
}

// A source shard whose master comes back without its last transfer_out (with
// durability Fsync a crash cannot do that and with Replicas a transfer waits for the
// replicas, so it takes a restored backup) holds the moved packets again while the
// destination holds them too. No claim was lost, so the claims watermark does not
// see it; the shards then hold more packets than were seeded, which a steady reading
// shows (ShardsView.Duplicated), and the reporter and the controller fence every
// shard on it before another grant.
func TestShardSourceRollbackIsSeenAsDuplication(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	act := store.NewActivity(c, "rv-src-rollback", 2)
	// Shard 0: packets 1 (100) and 3 (300); shard 1: packets 2 (200) and 4 (400).
	seedOpenShards(t, ctx, act, []int64{100, 200, 300, 400})
	on0, on1 := usersOn("z", 0, 2, 3), usersOn("o", 1, 2, 2)

	// The grab pod's watermarks, as grabsvc keeps them (RollbackGuard.SawShard).
	marks := make([]store.Watermark, 2)
	markOf := func(i int) store.Watermark { return marks[i] }
	grab := func(u string) store.GrabResult {
		t.Helper()
		r, h, err := act.Grab(ctx, u, markOf)
		if err != nil {
			t.Fatalf("grab of %s: %v", u, err)
		}
		if r.Outcome == store.Granted {
			marks[h] = marks[h].Raise(r.Seen)
		}
		return r
	}
	if r := grab(on1[0]); r.Outcome != store.Granted {
		t.Fatalf("first grab on shard 1: %+v", r)
	}
	// The replica of shard 1's master holds everything up to here, the grant included.
	replica := dumpShard(t, ctx, c, act.Shard(1).Keys())

	// Shard 0 runs dry and refills from shard 1.
	byPacket := map[string]string{}
	for _, u := range on0 {
		r := grab(u)
		if r.Outcome != store.Granted {
			t.Fatalf("grab of %s on shard 0: %+v", u, r)
		}
		byPacket[r.PacketID] = u
	}
	v, err := act.ReadShards(ctx)
	if err != nil || v.Shards[0].Count != 3 {
		t.Fatalf("after the refill: shard 0 count %d, %v; want 3 (one packet moved in)", v.Shards[0].Count, err)
	}

	// Shard 1's master fails over to that replica: the transfer_out is gone.
	restoreShard(t, ctx, c, replica)

	v, err = act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !v.Steady || !v.Duplicated() {
		t.Fatalf("after the source lost its transfer_out: steady %v, duplicated %v, imbalance %+v; want the duplication seen",
			v.Steady, v.Duplicated(), v.Conservation())
	}
	if _, err := act.Fence(ctx, "rolled_back"); err != nil {
		t.Fatal(err)
	}
	if r := grab(on1[1]); r.Outcome != store.Fenced {
		t.Fatalf("grab on the fenced activity: %+v, want fenced", r)
	}
	_ = byPacket
}

// One shard rolls back below what the status recorded, while the other shards went
// on granting, so the summed counters hide it. status.shardWatermarks does not: the
// view says it rolled back, and a grab pod with no watermark of its own for that
// shard (restarted, or new) takes the shard's figure from the status and is fenced
// by its first grab there.
func TestShardRollbackCaughtByStatusWatermarks(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	act := store.NewActivity(c, "rv-masked", 2)
	amounts := make([]int64, 40)
	for i := range amounts {
		amounts[i] = int64(10 + i)
	}
	seedOpenShards(t, ctx, act, amounts)
	on0, on1 := usersOn("z", 0, 2, 10), usersOn("o", 1, 2, 6)

	grant := func(u string) store.GrabResult {
		t.Helper()
		r, _, err := act.Grab(ctx, u, nil)
		if err != nil || r.Outcome != store.Granted {
			t.Fatalf("grab of %s: %+v, %v", u, r, err)
		}
		return r
	}
	grant(on1[0])
	backup := dumpShard(t, ctx, c, act.Shard(1).Keys())
	lost := map[string]string{}
	for _, u := range on1[1:4] {
		lost[grant(u).PacketID] = u
	}
	// The status records the counters now: 4 claims, all on shard 1.
	v, err := act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var st redpacketv1alpha1.RedPacketActivityStatus
	st.Phase = redpacketv1alpha1.PhaseActive
	redpacketv1alpha1.SetCounters(&st, v.Whole.Counters())
	st.ShardWatermarks = v.Watermarks(&st)

	// Shard 0 goes on granting; shard 1 comes back from before its last 3 claims.
	for _, u := range on0[:5] {
		grant(u)
	}
	restoreShard(t, ctx, c, backup)

	v, err = act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if why := v.Whole.RolledBack(&st); why != "" {
		t.Fatalf("the summed counters already show it (%s): the test does not test the watermarks", why)
	}
	why := v.RolledBack(&st)
	if why == "" {
		t.Fatalf("shard 1 holds %d claims, below the 4 recorded in status.shardWatermarks, and the view does not say so",
			v.Shards[1].ClaimedCount)
	}
	// A fresh grab pod: its watermarks come from the status alone.
	r, _, err := act.Grab(ctx, on1[4], func(i int) store.Watermark { return statusMark(&st, i) })
	if err != nil {
		t.Fatal(err)
	}
	if r.Outcome != store.Fenced {
		t.Fatalf("grab on the rolled-back shard with the status's watermark: %+v, want fenced (lost packets %v)", r, lost)
	}
}

// A handle that found the activity sold out answers sold_out at once for a second
// only: an operator who accepts a rolled-back state can bring packets back, and they
// are handed out after that second.
func TestSoldOutIsRememberedForASecondOnly(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	act := store.NewActivity(c, "rv-soldout", 2)
	seedOpenShards(t, ctx, act, []int64{100, 200, 300, 400})
	on0, on1 := usersOn("z", 0, 2, 4), usersOn("o", 1, 2, 2)

	backup := dumpShard(t, ctx, c, act.Shard(1).Keys())
	for _, u := range on1 {
		if r, _, err := act.Grab(ctx, u, nil); err != nil || r.Outcome != store.Granted {
			t.Fatalf("grab of %s: %+v %v", u, r, err)
		}
	}
	for _, u := range on0[:2] {
		if r, _, err := act.Grab(ctx, u, nil); err != nil || r.Outcome != store.Granted {
			t.Fatalf("grab of %s: %+v %v", u, r, err)
		}
	}
	if r, _, err := act.Grab(ctx, on0[2], nil); err != nil || r.Outcome != store.SoldOut {
		t.Fatalf("grab with every packet granted: %+v %v, want sold_out", r, err)
	}
	// Shard 1 rolls back to before its two grants; the fence goes up and an operator
	// accepts the state as it is: packets 2 and 4 are listed again.
	restoreShard(t, ctx, c, backup)
	if _, err := act.Fence(ctx, "rolled_back"); err != nil {
		t.Fatal(err)
	}
	if _, err := act.Accept(ctx, 0); err != nil {
		t.Fatal(err)
	}
	v, err := act.ReadShards(ctx)
	if err != nil || v.Shards[1].RemainingCount != 2 {
		t.Fatalf("after the accept: shard 1 lists %d, %v; want 2", v.Shards[1].RemainingCount, err)
	}
	time.Sleep(1100 * time.Millisecond)
	r, _, err := act.Grab(ctx, on0[3], nil)
	if err != nil {
		t.Fatal(err)
	}
	if r.Outcome != store.Granted {
		t.Fatalf("user %s: %s a second after the sold-out reading, while shard 1 lists %d packets; want granted",
			on0[3], r.Outcome, v.Shards[1].RemainingCount)
	}
}

// The grab pods log in as the activity's user; with durability Replicas they wait
// for replicas on the master of the grant's shard (store.ReplicaWaiter: HINCRBY of a
// marker, then WAIT). The user must be allowed to run both.
func TestActivityUserCanWaitForReplicas(t *testing.T) {
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	const own = "rv-acl-wait"
	admin := store.NewActivity(op, own, 2)
	seedOpenShards(t, ctx, admin, []int64{10, 20, 30, 40})
	if _, err := admin.EnsureUser(ctx, "rv-wait-pw-0123456789"); err != nil {
		t.Fatal(err)
	}
	uc := userConn([]string{srv.Addr}, redisconn.ModeStandalone, own, "rv-wait-pw-0123456789").NewClient()
	t.Cleanup(func() { _ = uc.Close() })
	w := store.NewActivity(uc, own, 2).Shard(1).ReplicaWaiter(1, 50*time.Millisecond)
	err := w.Wait(ctx)
	t.Logf("Wait as the activity's user on a master without replicas: %v", err)
	if isNoPerm(err) {
		t.Errorf("the activity's user may not wait for replicas: %v", err)
	}
}

// Close computes the activity's refund from a reading of every shard after they all
// closed, and writes it once for good; a reading that is not the whole activity (a
// shard's master came back empty, or a shard was fenced, between the closes and the
// reading) writes no refund.
func TestShardedCloseRefundsOnlyFromACompleteReading(t *testing.T) {
	ctx := redistest.Context(t)
	srv := redistest.Start(t)
	admin := srv.Client(t)
	c := srv.Client(t)
	act := store.NewActivity(c, "rv-refund", 2)
	amounts := []int64{100, 200, 300, 400}
	seedOpenShards(t, ctx, act, amounts)
	r, _, err := act.Grab(ctx, usersOn("o", 1, 2, 1)[0], nil)
	if err != nil || r.Outcome != store.Granted {
		t.Fatalf("grab: %+v %v", r, err)
	}
	// Shard 1's master restarts empty right after the shards closed: the hook drops
	// its keys as soon as both close scripts have run.
	k1 := act.Shard(1).Keys()
	c.AddHook(&afterCloses{n: 2, do: func() {
		for _, key := range k1.All() {
			_ = admin.Del(context.Background(), key).Err()
		}
	}})
	res, err := act.Close(ctx, store.CloseExpired)
	t.Logf("Close with shard 1 lost after closing: %+v, %v", res, err)
	if err == nil && res.Outcome == store.Closed {
		t.Errorf("Close wrote the activity's refund, %d, from a reading without shard 1; the activity's total is %d "+
			"and %d of it was claimed, so the sponsor is owed %d, and the refund can never be written again",
			res.Refunded, sum(amounts), r.Amount, sum(amounts)-r.Amount)
	}
}

// afterCloses runs do once, right after the n-th close script returned.
type afterCloses struct {
	n, seen int
	do      func()
}

func (h *afterCloses) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *afterCloses) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		args := cmd.Args()
		if len(args) > 1 && (args[0] == "evalsha" || args[0] == "eval") {
			if s, _ := args[1].(string); s == lua.CloseScript.SHA() || s == lua.CloseScript.Source() {
				h.seen++
				if h.seen == h.n {
					h.do()
				}
			}
		}
		return err
	}
}

func (h *afterCloses) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A shard of a sharded activity closes with "refunded" 0 and its stream never
// carries a refund: the one refund is on shard 0 and says the activity's refund. A
// refund entry that someone with the activity's credentials appends to another
// shard's stream, for that shard's share and to the sponsor, is refused as forged
// (it would be delivered under the activity's one Idempotency-Key, "<uid>/refund",
// with another amount).
func TestForgedRefundOnAShardIsRefused(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	act := store.NewActivity(c, "rv-forged-refund", 2)
	seedOpenShards(t, ctx, act, []int64{100, 200, 300, 400})
	if r, _, err := act.Grab(ctx, usersOn("o", 1, 2, 1)[0], nil); err != nil || r.Outcome != store.Granted {
		t.Fatalf("grab: %+v %v", r, err)
	}
	res, err := act.Close(ctx, store.CloseExpired)
	if err != nil || res.Outcome != store.Closed {
		t.Fatalf("close: %+v %v", res, err)
	}
	s1 := act.Shard(1)
	share, err := c.HGet(ctx, s1.Keys().Meta, "refunded").Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := s1.EnsureGroup(ctx, "g"); err != nil {
		t.Fatal(err)
	}
	if err := c.XAdd(ctx, &redis.XAddArgs{Stream: s1.Keys().Stream, Values: []string{
		"kind", "refund", "packet", "refund", "user", "merchant-001", "amount", share, "currency", "CNY", "at", "1",
	}}).Err(); err != nil {
		t.Fatal(err)
	}
	entries, err := s1.ReadNew(ctx, "g", "w", 100, 0)
	if err != nil {
		t.Fatal(err)
	}
	var refund *store.StreamEntry
	for i := range entries {
		if entries[i].Kind == store.KindRefund {
			refund = &entries[i]
		}
	}
	if refund == nil {
		t.Fatalf("the appended refund entry was not read back: %+v", entries)
	}
	forged, err := s1.VerifyEntries(ctx, []store.StreamEntry{*refund})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("activity refund %d; shard 1's own refunded field %s; verification of a refund of %s on shard 1: %v",
		res.Refunded, share, share, forged[refund.ID])
	if forged[refund.ID] == nil {
		t.Errorf("a refund entry of %s on shard 1 passes verification, while the activity's one refund is %d on shard 0",
			share, res.Refunded)
	}
}

// The mirror image: the destination's master comes back without the transfer_in it
// answered, after the source already forgot the transfer (transfer_done). Replication
// is ordered, so that master also lost the grant that followed the refill, and a
// grab pod that saw the grant fences the shard: this is covered. What stays is that
// the moved packets are in no list, claim or journal: after an accept, the
// conservation gauge stays above 0 for the rest of the activity's life.
func TestShardDestinationRollbackIsFenced(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	act := store.NewActivity(c, "rv-dst-rollback", 2)
	seedOpenShards(t, ctx, act, []int64{100, 200, 300, 400, 500, 600})
	on0 := usersOn("z", 0, 2, 6)
	marks := make([]store.Watermark, 2)
	markOf := func(i int) store.Watermark { return marks[i] }
	grab := func(u string) store.GrabResult {
		t.Helper()
		r, h, err := act.Grab(ctx, u, markOf)
		if err != nil {
			t.Fatalf("grab of %s: %v", u, err)
		}
		if r.Outcome == store.Granted {
			marks[h] = marks[h].Raise(r.Seen)
		}
		return r
	}
	for _, u := range on0[:3] {
		if r := grab(u); r.Outcome != store.Granted {
			t.Fatalf("grab of %s: %+v", u, r)
		}
	}
	replica := dumpShard(t, ctx, c, act.Shard(0).Keys())
	// Shard 0 is dry: the next grab refills it from shard 1 and takes one packet.
	if r := grab(on0[3]); r.Outcome != store.Granted {
		t.Fatalf("refilling grab: %+v", r)
	}
	// Shard 0's master fails over to a replica from before the transfer_in.
	restoreShard(t, ctx, c, replica)
	if r := grab(on0[4]); r.Outcome != store.Fenced {
		t.Errorf("grab on the rolled-back destination with watermark %+v: %s, want fenced", marks[0], r.Outcome)
	}
	v, err := act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after the destination's rollback: listed %d + %d, in transfer %d, claimed %d of %d; imbalance %+v",
		v.Shards[0].RemainingCount, v.Shards[1].RemainingCount, v.InTransferCount, v.Whole.ClaimedCount,
		v.Whole.Count, v.Conservation())
}

// Two processes (two handles: their own transfer ids and refill locks) rain on four
// shards with skewed users, a third resolves journals all the time, and the activity
// is closed as expired in the middle of the rain. Every packet is granted at most
// once, no user twice, no grant lands after the close returned, and the one refund
// is exactly what is left: close racing refills, transfers and Resolve.
func TestShardedCloseDuringRefillsFromTwoProcesses(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const uid, shards = "rv-close-race", 4
	amounts := testAmounts(3000)
	a1 := store.NewActivity(c, uid, shards)
	a1.TransferBatch = 16
	seedOpenShards(t, ctx, a1, amounts)
	a2 := store.NewActivity(c, uid, shards)
	a2.TransferBatch = 16
	users := skewedUsers(6000, []float64{60, 20, 15, 5}, 7)

	type call struct {
		res    store.GrabResult
		err    error
		retAt  time.Time
		callAt time.Time
	}
	calls := make([]call, len(users))
	var closedAt time.Time
	var closeRes store.CloseResult
	var closeErr error
	stop := make(chan struct{})
	resolved := make(chan int)
	go func() {
		n := 0
		for {
			select {
			case <-stop:
				resolved <- n
				return
			default:
			}
			if _, err := store.NewActivity(c, uid, shards).Resolve(ctx); err == nil {
				n++
			}
		}
	}()
	done := make(chan struct{})
	next := make(chan int)
	go func() {
		for i := range users {
			if i == len(users)/3 {
				closeRes, closeErr = a1.Close(ctx, store.CloseExpired)
				closedAt = time.Now()
			}
			next <- i
		}
		close(next)
	}()
	workers := 8
	finished := make(chan struct{}, workers)
	for w := range workers {
		h := a1
		if w%2 == 1 {
			h = a2
		}
		go func() {
			for i := range next {
				cl := call{callAt: time.Now()}
				cl.res, _, cl.err = h.Grab(ctx, users[i], nil)
				cl.retAt = time.Now()
				calls[i] = cl
			}
			finished <- struct{}{}
		}()
	}
	for range workers {
		<-finished
	}
	close(done)
	close(stop)
	t.Logf("journals resolved %d times meanwhile; close: %+v, %v", <-resolved, closeRes, closeErr)
	if closeErr != nil || closeRes.Outcome != store.Closed {
		t.Fatalf("close: %+v, %v", closeRes, closeErr)
	}
	byPacket := map[string]string{}
	var claimed int64
	for i, cl := range calls {
		if cl.err != nil {
			t.Fatalf("user %s: %v", users[i], cl.err)
		}
		if cl.res.Outcome != store.Granted {
			continue
		}
		if prev, dup := byPacket[cl.res.PacketID]; dup {
			t.Fatalf("packet %s granted to %s and %s", cl.res.PacketID, prev, users[i])
		}
		byPacket[cl.res.PacketID] = users[i]
		claimed += cl.res.Amount
		if cl.callAt.After(closedAt) {
			t.Errorf("user %s granted packet %s in a call made after the close returned", users[i], cl.res.PacketID)
		}
	}
	v, err := a1.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if v.Whole.ClaimedAmount != claimed || closeRes.Refunded != sum(amounts)-claimed || !v.Conservation().Zero() {
		t.Fatalf("claimed %d (users were told %d), refund %d (want %d), in transfer %d, imbalance %+v",
			v.Whole.ClaimedAmount, claimed, closeRes.Refunded, sum(amounts)-claimed, v.InTransferCount, v.Conservation())
	}
	t.Logf("%d grants before the close; %d packets refunded (%d of them journalled to a closed shard)",
		len(byPacket), len(amounts)-len(byPacket), v.InTransferCount)
}

// Two processes refill the same dry shards at once (their refill locks do not see
// each other) while a third resolves journals: every packet is granted exactly once,
// and nobody is told sold_out before the last packet went.
func TestShardedSoldOutWithRefillsFromTwoProcesses(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const uid, shards = "rv-two-procs", 4
	amounts := testAmounts(2000)
	handles := []*store.Activity{store.NewActivity(c, uid, shards), store.NewActivity(c, uid, shards), store.NewActivity(c, uid, shards)}
	for _, h := range handles {
		h.TransferBatch = 8
	}
	seedOpenShards(t, ctx, handles[0], amounts)
	stop := make(chan struct{})
	var resolver = make(chan struct{})
	go func() {
		defer close(resolver)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_, _ = store.NewActivity(c, uid, shards).Resolve(ctx)
		}
	}()
	rain := &shardedRain{calls: make([]grabCall, 3000)}
	users := skewedUsers(3000, []float64{70, 15, 10, 5}, 11)
	next := make(chan int)
	go func() {
		for i := range users {
			next <- i
		}
		close(next)
	}()
	finished := make(chan struct{})
	for w := range 12 {
		h := handles[w%3]
		go func() {
			defer func() { finished <- struct{}{} }()
			for i := range next {
				cl := grabCall{user: users[i], call: time.Now()}
				cl.res, cl.home, cl.err = h.Grab(ctx, users[i], nil)
				cl.ret = time.Now()
				rain.calls[i] = cl
			}
		}()
	}
	for range 12 {
		<-finished
	}
	close(stop)
	<-resolver
	rain.steady = 1 // no checker ran; checkShardedRain wants one steady view
	checkShardedRain(t, ctx, handles[0], rain, amounts, true)
}

// failAfter makes every third transfer script "fail" after Redis ran it: the caller
// sees an error, as when its process dies or its connection drops between the
// halves of a transfer. The script's effect stays.
type failAfter struct {
	n      atomic.Int64
	failed atomic.Int64
}

func (h *failAfter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *failAfter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		args := cmd.Args()
		if err == nil && len(args) > 1 && args[0] == "fcall" {
			switch s, _ := args[1].(string); s {
			case lua.TransferOutScript.Function(), lua.TransferInScript.Function(), lua.TransferDoneScript.Function():
				if h.n.Add(1)%3 == 0 {
					h.failed.Add(1)
					return errors.New("connection lost after the script ran")
				}
			}
		}
		return err
	}
}

func (h *failAfter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// Transfers whose callers die between the halves, a third of them, during a rain
// that sells out: users whose call failed retry; every packet is still granted
// exactly once, nobody hears sold_out while a packet is listed or journalled, and
// the shards stay conserved.
func TestShardTransfersInterruptedBetweenHalves(t *testing.T) {
	ctx := redistest.Context(t)
	srv := redistest.Start(t)
	c := srv.Client(t)
	hook := &failAfter{}
	c.AddHook(hook)
	const uid, shards = "rv-interrupted", 4
	amounts := testAmounts(1500)
	act := store.NewActivity(c, uid, shards)
	act.TransferBatch = 8
	seedOpenShards(t, ctx, act, amounts)
	users := skewedUsers(2500, []float64{70, 15, 10, 5}, 5)
	rain := &shardedRain{calls: make([]grabCall, len(users))}
	next := make(chan int)
	go func() {
		for i := range users {
			next <- i
		}
		close(next)
	}()
	finished := make(chan struct{})
	var retries atomic.Int64
	for range 8 {
		go func() {
			defer func() { finished <- struct{}{} }()
			for i := range next {
				cl := grabCall{user: users[i], call: time.Now()}
				for attempt := 0; ; attempt++ {
					cl.res, cl.home, cl.err = act.Grab(ctx, users[i], nil)
					if cl.err == nil || attempt > 100 {
						break
					}
					retries.Add(1)
				}
				if cl.res.Outcome == store.AlreadyClaimed {
					cl.res.Outcome = store.Granted // the retry of a grant whose refill call failed
				}
				cl.ret = time.Now()
				rain.calls[i] = cl
			}
		}()
	}
	for range 8 {
		<-finished
	}
	t.Logf("%d transfer replies lost, %d grab calls retried", hook.failed.Load(), retries.Load())
	if hook.failed.Load() == 0 {
		t.Fatalf("no transfer was interrupted")
	}
	rain.steady = 1
	checkShardedRain(t, ctx, act, rain, amounts, true)
}

// A transfer whose mover died after its first half is still journalled when the
// activity closes: the refund counts its packets, a Resolve after the close cannot
// push them into a closed shard, and conservation holds before and after.
func TestShardedCloseWithJournalPending(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	act := store.NewActivity(c, "rv-journal-close", 3)
	amounts := testAmounts(30)
	seedOpenShards(t, ctx, act, amounts)
	var claimed int64
	for _, u := range usersOn("z", 2, 3, 4) {
		r, _, err := act.Grab(ctx, u, nil)
		if err != nil || r.Outcome != store.Granted {
			t.Fatalf("grab: %+v %v", r, err)
		}
		claimed += r.Amount
	}
	k1 := act.Shard(1).Keys()
	out, err := lua.TransferOutScript.Run(ctx, c, []string{k1.Meta, k1.Packets, k1.Transfers}, "dead-mover-1", 0, 3).StringSlice()
	if err != nil || out[0] != "moved" {
		t.Fatalf("transfer_out: %v %v", out, err)
	}
	res, err := act.Close(ctx, store.CloseExpired)
	if err != nil || res.Outcome != store.Closed {
		t.Fatalf("close: %+v %v", res, err)
	}
	if res.Refunded != sum(amounts)-claimed {
		t.Errorf("refund %d with a transfer journalled at close, want %d", res.Refunded, sum(amounts)-claimed)
	}
	if left, err := act.Resolve(ctx); err != nil || left != 1 {
		t.Errorf("Resolve after the close: %d left, %v; want the one transfer refused", left, err)
	}
	v, err := act.ReadShards(ctx)
	if err != nil || v.InTransferCount != 3 || !v.Conservation().Zero() || v.Whole.State != store.StateClosed {
		t.Errorf("after close: %s, in transfer %d, imbalance %+v, %v", v.Whole.State, v.InTransferCount, v.Conservation(), err)
	}
	// Close(exhausted) with a transfer journalled finishes the move first and stays open.
	act2 := store.NewActivity(c, "rv-journal-exh", 3)
	seedOpenShards(t, ctx, act2, amounts)
	k := act2.Shard(1).Keys()
	if err := lua.TransferOutScript.Run(ctx, c, []string{k.Meta, k.Packets, k.Transfers}, "dead-mover-2", 0, 100).Err(); err != nil {
		t.Fatal(err)
	}
	if r, err := act2.Close(ctx, store.CloseExhausted); err != nil || r.Outcome != store.CloseStillOpen {
		t.Errorf("close as exhausted with packets journalled: %+v, %v; want still open", r, err)
	}
}
