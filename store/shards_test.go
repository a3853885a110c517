package store_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// skewedUsers returns n user ids whose home shards (of len(weights)) follow weights,
// so that the heavy shards run dry long before the light ones and must refill.
func skewedUsers(n int, weights []float64, seed uint64) []string {
	var sum float64
	for _, w := range weights {
		sum += w
	}
	want := make([]int, len(weights))
	left := n
	for i, w := range weights {
		want[i] = int(float64(n) * w / sum)
		left -= want[i]
	}
	want[0] += left
	users := make([]string, 0, n)
	for k := 0; len(users) < n; k++ {
		id := "u" + strconv.Itoa(k)
		if h := homeOf(id, len(weights)); want[h] > 0 {
			want[h]--
			users = append(users, id)
		}
	}
	rand.New(rand.NewPCG(seed, seed)).Shuffle(len(users), func(i, j int) { users[i], users[j] = users[j], users[i] })
	return users
}

// grabCall is one grab as its caller saw it.
type grabCall struct {
	user      string
	call, ret time.Time
	res       store.GrabResult
	err       error
	home      int
	granted   bool
}

// shardedRain runs users against the activity from workers goroutines, while a
// checker reads every shard and records any steady view that is not conserved.
// between, when set, runs once when half the users have been served.
type shardedRain struct {
	calls      []grabCall
	imbalances []string
	steady     int
	views      int
}

func runShardedRain(t *testing.T, ctx context.Context, act *store.Activity, users []string, workers int, between func()) *shardedRain {
	t.Helper()
	out := &shardedRain{calls: make([]grabCall, len(users))}
	stop := make(chan struct{})
	var checker sync.WaitGroup
	checker.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(25 * time.Millisecond):
			}
			v, err := act.ReadShards(ctx)
			if err != nil {
				continue // a shard's master may be down on purpose
			}
			out.views++
			if !v.Steady {
				continue
			}
			out.steady++
			if im := v.Conservation(); !im.Zero() {
				out.imbalances = append(out.imbalances, fmt.Sprintf("%+v (in transfer %d)", im, v.InTransferCount))
			}
		}
	})
	var next atomic.Int64
	var half sync.Once
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(users) {
					return
				}
				if between != nil && i == len(users)/2 {
					half.Do(between)
				}
				c := grabCall{user: users[i], call: time.Now()}
				c.res, c.home, c.err = act.Grab(ctx, users[i], nil)
				c.ret = time.Now()
				out.calls[i] = c
			}
		})
	}
	wg.Wait()
	close(stop)
	checker.Wait()
	return out
}

// TestShardedActivity runs rains over six shards on a real cluster of three masters,
// with users hashed unevenly so that heavy shards refill from light ones.
func TestShardedActivity(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	c := redisconn.Conn{Addresses: cluster.Addrs[:1], Mode: redisconn.ModeCluster, Username: cluster.Username, Password: cluster.Password}.NewClient(redisconn.ClientOptions{Timeout: 5 * time.Second})
	t.Cleanup(func() { _ = c.Close() })
	weights := []float64{35, 25, 15, 10, 10, 5}

	t.Run("sold out", func(t *testing.T) {
		// 50,000 users for 30,000 packets: 5,000 per shard, while shard 0's users
		// alone are 17,500.
		ctx := redistest.Context(t)
		act := store.NewActivity(c, "rain-sold-out", len(weights))
		amounts := testAmounts(30000)
		seedOpenShards(t, ctx, act, amounts)
		checkShardPlacement(t, ctx, cluster, act)
		rain := runShardedRain(t, ctx, act, skewedUsers(50000, weights, 1), 48, nil)
		checkShardedRain(t, ctx, act, rain, amounts, true)
		closeAndCheckRefund(t, ctx, c, act, store.CloseExhausted, amounts)
	})

	t.Run("stock left", func(t *testing.T) {
		// 50,000 users for 60,000 packets: everyone must get one, though shard 0's
		// 17,500 users start with 10,000.
		ctx := redistest.Context(t)
		act := store.NewActivity(c, "rain-stock-left", len(weights))
		amounts := testAmounts(60000)
		seedOpenShards(t, ctx, act, amounts)
		rain := runShardedRain(t, ctx, act, skewedUsers(50000, weights, 2), 48, nil)
		checkShardedRain(t, ctx, act, rain, amounts, false)
		for _, call := range rain.calls {
			if !call.granted {
				t.Fatalf("user %s was answered %s / %v while 10,000 packets were left", call.user, call.res.Outcome, call.err)
			}
		}
		closeAndCheckRefund(t, ctx, c, act, store.CloseExpired, amounts)
	})

	t.Run("journalled transfer survives a crash", func(t *testing.T) {
		ctx := redistest.Context(t)
		act := store.NewActivity(c, "rain-journal", 3)
		amounts := testAmounts(30)
		seedOpenShards(t, ctx, act, amounts)
		// A transfer whose mover died after its first half: the packets are in shard
		// 1's journal only, taken from the tail as transfer_out.lua takes them.
		keys := act.Shard(1).Keys()
		listed, err := act.Shard(1).Listed(ctx)
		if err != nil {
			t.Fatal(err)
		}
		taken, err := c.RPopCount(ctx, keys.Packets, 4).Result()
		if err != nil {
			t.Fatal(err)
		}
		var amount int64
		for i := range taken {
			packet := listed[len(listed)-1-i]
			taken[i] = packet.ID + ":" + strconv.FormatInt(packet.Amount, 10)
			amount += packet.Amount
		}
		entry := fmt.Sprintf("0|%d|%d|%s", len(taken), amount, strings.Join(taken, ","))
		if err := c.HSet(ctx, keys.Transfers, "crashed-1", entry).Err(); err != nil {
			t.Fatal(err)
		}
		if err := c.HIncrBy(ctx, keys.Meta, "count", -int64(len(taken))).Err(); err != nil {
			t.Fatal(err)
		}
		if err := c.HIncrBy(ctx, keys.Meta, "total", -amount).Err(); err != nil {
			t.Fatal(err)
		}
		v, err := act.ReadShards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !v.Steady || v.InTransferCount != 4 || v.InTransferAmount != amount || !v.Conservation().Zero() {
			t.Fatalf("with a transfer journalled: steady %v, in transfer %d/%d (want 4/%d), imbalance %+v",
				v.Steady, v.InTransferCount, v.InTransferAmount, amount, v.Conservation())
		}
		// Resolving twice applies it once.
		for range 2 {
			if left, err := act.Resolve(ctx); err != nil || left != 0 {
				t.Fatalf("Resolve: %d left, %v", left, err)
			}
		}
		v, err = act.ReadShards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v.InTransferCount != 0 || v.Shards[0].RemainingCount != 14 || v.Shards[1].RemainingCount != 6 || !v.Conservation().Zero() {
			t.Fatalf("after Resolve: in transfer %d, shard 0 lists %d (want 14), shard 1 lists %d (want 6), imbalance %+v",
				v.InTransferCount, v.Shards[0].RemainingCount, v.Shards[1].RemainingCount, v.Conservation())
		}
		// A packet that vanished is caught.
		if err := c.LPop(ctx, act.Shard(2).Keys().Packets).Err(); err != nil {
			t.Fatal(err)
		}
		v, err = act.ReadShards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if im := v.Conservation(); im.Count != 1 {
			t.Fatalf("a packet popped outside any script: imbalance %+v, want a count of 1", im)
		}
	})
}

// TestShardedActivityMasterRestart kills one master with SIGKILL in the middle of a
// rain over six shards and restarts it on its files (appendfsync always): every
// grant acknowledged before the kill survives, no packet is granted twice, users
// whose calls failed get their packet (or already_claimed) on retry, and the shards
// stay conserved.
func TestShardedActivityMasterRestart(t *testing.T) {
	cluster := redistest.StartClusterWith(t, 3, "--appendonly", "yes", "--appendfsync", "always",
		"--cluster-require-full-coverage", "no")
	c := cluster.Conn().NewClient(redisconn.ClientOptions{Timeout: 2 * time.Second})
	t.Cleanup(func() { _ = c.Close() })
	ctx := redistest.Context(t)
	weights := []float64{35, 25, 15, 10, 10, 5}
	act := store.NewActivity(c, "rain-restart", len(weights))
	amounts := testAmounts(30000)
	seedOpenShards(t, ctx, act, amounts)

	victim := 1
	var downFor time.Duration
	kill := func() {
		start := time.Now()
		if err := cluster.Kill(victim); err != nil {
			t.Errorf("killing %s: %v", cluster.Addrs[victim], err)
			return
		}
		time.Sleep(300 * time.Millisecond)
		if err := cluster.Restart(victim); err != nil {
			t.Errorf("restarting %s: %v", cluster.Addrs[victim], err)
		}
		downFor = time.Since(start)
	}
	users := skewedUsers(50000, weights, 3)
	rain := runShardedRain(t, ctx, act, users, 48, kill)
	failed := 0
	for i, call := range rain.calls {
		if call.err == nil {
			continue
		}
		failed++
		// Retry until Redis answers: the call either took effect or it did not.
		for attempt := 0; ; attempt++ {
			r, h, err := act.Grab(ctx, call.user, nil)
			if err == nil {
				rain.calls[i].res, rain.calls[i].home, rain.calls[i].err = r, h, nil
				rain.calls[i].ret = time.Now()
				break
			}
			if attempt > 50 {
				t.Fatalf("retrying user %s: %v", call.user, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	t.Logf("master %s down and back in %v; %d calls failed and were retried", cluster.Addrs[victim], downFor.Round(time.Millisecond), failed)
	if failed == 0 {
		t.Fatalf("no call failed while a master was down: the fault did not happen")
	}
	checkShardedRain(t, ctx, act, rain, amounts, true)
	closeAndCheckRefund(t, ctx, c, act, store.CloseExhausted, amounts)
}

func testAmounts(n int) []int64 {
	amounts := make([]int64, n)
	for i := range amounts {
		amounts[i] = int64(1 + (i*7919)%997)
	}
	return amounts
}

func sum(amounts []int64) int64 {
	var t int64
	for _, a := range amounts {
		t += a
	}
	return t
}

func seedOpenShards(t *testing.T, ctx context.Context, act *store.Activity, amounts []int64) {
	t.Helper()
	if err := act.LoadScripts(ctx); err != nil {
		t.Fatal(err)
	}
	p := store.SeedParams{Count: int64(len(amounts)), Total: sum(amounts), Sponsor: "merchant-001", Currency: "CNY"}
	if _, err := act.Seed(ctx, amounts, p); err != nil {
		t.Fatalf("seeding: %v", err)
	}
	// Seeding again adopts what is there.
	if r, err := act.Seed(ctx, amounts, p); err != nil || r.Committed {
		t.Fatalf("seeding again: committed %v, %v", r.Committed, err)
	}
	if r, err := act.ConfigureWith(ctx, store.Settings{Open: true}); err != nil || r.State != store.StateOpen {
		t.Fatalf("opening: %+v, %v", r, err)
	}
	v, err := act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if v.Whole.Count != int64(len(amounts)) || v.Whole.Total != sum(amounts) || v.Whole.RemainingCount != int64(len(amounts)) || !v.Conservation().Zero() {
		t.Fatalf("after seeding: %+v, imbalance %+v", v.Whole, v.Conservation())
	}
}

// checkShardPlacement checks that the shards do not all live on one master.
func checkShardPlacement(t *testing.T, ctx context.Context, cluster *redistest.Cluster, act *store.Activity) {
	t.Helper()
	cc := cluster.Client(t)
	masters := map[int]bool{}
	shards, err := cc.ClusterShards(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	for i := range act.N() {
		slot, err := cc.ClusterKeySlot(ctx, act.Shard(i).Keys().Meta).Result()
		if err != nil {
			t.Fatal(err)
		}
		for m, sh := range shards {
			for _, r := range sh.Slots {
				if slot >= r.Start && slot <= r.End {
					masters[m] = true
				}
			}
		}
	}
	if len(masters) < 2 {
		t.Fatalf("the %d shards live on %d master(s)", act.N(), len(masters))
	}
	t.Logf("%d shards over %d masters", act.N(), len(masters))
}

// checkShardedRain checks a rain from outside: what the users were told against the
// claims of every shard.
func checkShardedRain(t *testing.T, ctx context.Context, act *store.Activity, rain *shardedRain, amounts []int64, wantSoldOut bool) {
	t.Helper()
	byPacket := map[string]string{}
	granted := 0
	var grantedSum int64
	var lastSoldOut time.Time
	var firstSoldOutRet time.Time
	for i := range rain.calls {
		call := &rain.calls[i]
		if call.err != nil {
			t.Fatalf("user %s: %v", call.user, call.err)
		}
		if call.home != act.Home(call.user) {
			t.Fatalf("user %s was decided on shard %d, home %d", call.user, call.home, act.Home(call.user))
		}
		switch call.res.Outcome {
		case store.Granted, store.AlreadyClaimed:
			call.granted = true
			if prev, dup := byPacket[call.res.PacketID]; dup {
				t.Fatalf("packet %s went to %s and %s", call.res.PacketID, prev, call.user)
			}
			byPacket[call.res.PacketID] = call.user
			granted++
			grantedSum += call.res.Amount
		case store.SoldOut:
			if firstSoldOutRet.IsZero() || call.ret.Before(firstSoldOutRet) {
				firstSoldOutRet = call.ret
			}
			if call.ret.After(lastSoldOut) {
				lastSoldOut = call.ret
			}
		default:
			t.Fatalf("user %s: outcome %s", call.user, call.res.Outcome)
		}
	}
	// No user was refused while stock remained: nobody who called after a sold_out
	// had returned was granted.
	if !firstSoldOutRet.IsZero() {
		for _, call := range rain.calls {
			if call.granted && call.call.After(firstSoldOutRet) {
				t.Fatalf("user %s was granted packet %s in a call made after another user was told sold_out", call.user, call.res.PacketID)
			}
		}
	}
	if wantSoldOut && granted != len(amounts) {
		t.Fatalf("%d packets granted of %d, with users left over", granted, len(amounts))
	}
	if wantSoldOut && lastSoldOut.IsZero() {
		t.Fatalf("more users than packets, and nobody was told sold_out")
	}
	// Every grant is in its home shard's claims and nowhere else.
	held := map[string]store.Claim{}
	claimedOn := make([]int64, act.N())
	for i := range act.N() {
		claims, err := act.Shard(i).Claims(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for user, cl := range claims {
			if act.Home(user) != i {
				t.Fatalf("user %s holds a claim on shard %d, not on their home shard", user, i)
			}
			held[user] = cl
			claimedOn[i] += cl.Amount
		}
	}
	if len(held) != granted {
		t.Fatalf("the shards' claims hold %d users, the users were granted %d", len(held), granted)
	}
	for _, call := range rain.calls {
		if call.granted && held[call.user].PacketID != call.res.PacketID {
			t.Fatalf("user %s was told packet %s, the claims say %s", call.user, call.res.PacketID, held[call.user].PacketID)
		}
	}
	// Every id granted is a seeded one, with its seeded amount.
	ids := make([]int, 0, len(byPacket))
	for id := range byPacket {
		n, err := strconv.Atoi(id)
		if err != nil || n < 1 || n > len(amounts) {
			t.Fatalf("granted packet id %q is not one of 1..%d", id, len(amounts))
		}
		if held[byPacket[id]].Amount != amounts[n-1] {
			t.Fatalf("packet %d was granted with %d, seeded with %d", n, held[byPacket[id]].Amount, amounts[n-1])
		}
		ids = append(ids, n)
	}
	sort.Ints(ids)
	v, err := act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !v.Steady || !v.Conservation().Zero() {
		t.Fatalf("after the rain: steady %v, imbalance %+v", v.Steady, v.Conservation())
	}
	if v.Whole.ClaimedCount != int64(granted) || v.Whole.ClaimedAmount != grantedSum {
		t.Fatalf("the shards count %d claims of %d, the users were granted %d of %d",
			v.Whole.ClaimedCount, v.Whole.ClaimedAmount, granted, grantedSum)
	}
	if v.Whole.RemainingCount != int64(len(amounts)-granted) {
		t.Fatalf("%d packets left, want %d", v.Whole.RemainingCount, len(amounts)-granted)
	}
	if len(rain.imbalances) > 0 {
		t.Fatalf("%d steady views during the rain were not conserved, first %s", len(rain.imbalances), rain.imbalances[0])
	}
	if rain.steady == 0 {
		t.Fatalf("no steady view of the shards during the rain (%d views)", rain.views)
	}
	// Each shard's claimed amount is read from its list's numbering (snapshot.lua),
	// which transfers out and in renumber: it must still be what its claims hold.
	moved := 0
	for i, sh := range v.Shards {
		if sh.Count != int64(len(amounts)/act.N()) {
			moved++
		}
		if sh.ClaimedAmount != claimedOn[i] {
			t.Fatalf("shard %d says %d claimed, its claims hold %d", i, sh.ClaimedAmount, claimedOn[i])
		}
	}
	if moved == 0 {
		t.Fatalf("no shard's count changed: nothing was transferred, the hashing was not uneven enough")
	}
	t.Logf("%d users, %d granted (sum %d), %d shards refilled or gave; conservation checked in %d steady views of %d",
		len(rain.calls), granted, grantedSum, moved, rain.steady, rain.views)
}

func closeAndCheckRefund(t *testing.T, ctx context.Context, c redis.Cmdable, act *store.Activity, reason store.CloseReason, amounts []int64) {
	t.Helper()
	res, err := act.Close(ctx, reason)
	if err != nil || res.Outcome != store.Closed {
		t.Fatalf("close %s: %+v, %v", reason, res, err)
	}
	again, err := act.Close(ctx, reason)
	if err != nil || again != res {
		t.Fatalf("closing again: %+v, %v; first %+v", again, err, res)
	}
	v, err := act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	a := v.Whole
	if a.State != store.StateClosed || a.ClaimedAmount+a.Refunded != sum(amounts) || res.Refunded != a.Refunded || !v.Conservation().Zero() {
		t.Fatalf("after close: state %s, claimed %d + refunded %d != total %d (close said %d), imbalance %+v",
			a.State, a.ClaimedAmount, a.Refunded, sum(amounts), res.Refunded, v.Conservation())
	}
	// One refund entry for the activity, on shard 0, and none elsewhere.
	refunds := 0
	for i := range act.N() {
		entries, err := c.XRange(ctx, act.Shard(i).Keys().Stream, "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if e.Values["kind"] == store.KindRefund {
				refunds++
				if i != 0 || e.Values["amount"] != strconv.FormatInt(a.Refunded, 10) {
					t.Fatalf("refund entry on shard %d: %v", i, e.Values)
				}
			}
		}
	}
	if want := map[bool]int{true: 1, false: 0}[a.Refunded > 0]; refunds != want {
		t.Fatalf("%d refund entries, want %d", refunds, want)
	}
}
