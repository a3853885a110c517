package store_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// redisClient is what the helpers need: scripts plus plain reads. A plain client,
// a cluster client and an auto-pipeliner all qualify.
type redisClient interface {
	redis.Scripter
	redis.Cmdable
}

const sponsor = "merchant-001"

// keysOf is the keys of the one-shard activity uid.
func keysOf(uid string) store.Keys { return store.NewActivity(nil, uid, 1).Shard(0).Keys() }

// handle is the handle on c of the one-shard activity whose keys are k.
func handle(c redis.Cmdable, k store.Keys) *store.Activity {
	uid, prefixed := strings.CutPrefix(k.Meta, "rpa:{")
	uid, suffixed := strings.CutSuffix(uid, "}:meta")
	if !prefixed || !suffixed {
		panic("not an activity's meta key: " + k.Meta)
	}
	return store.NewActivity(c, uid, 1).RestoreFunctions()
}

// shardOf is the one shard of the activity whose keys are k, on c.
func shardOf(c redis.Cmdable, k store.Keys) *store.Shard { return handle(c, k).Shard(0) }

// homeOf is the home shard of userID in an activity of n shards.
func homeOf(userID string, n int) int { return store.NewActivity(nil, "home", n).Home(userID) }

// statusMark is the watermark status st records for shard i, as a grab pod that
// has seen nothing but the status sends it.
func statusMark(st *redpacketv1alpha1.RedPacketActivityStatus, i int) store.Watermark {
	w := st.ShardWatermarks
	if w == nil || i >= len(w.ClaimedCounts) {
		return store.Watermark{}
	}
	m := store.Watermark{Epoch: w.Epoch, ClaimedCount: w.ClaimedCounts[i]}
	if i < len(w.TransferSeqs) {
		m.TransferSeq = w.TransferSeqs[i]
	}
	return m
}

// seeding is handle(c, k) seeding with s.
func seeding(c redis.Cmdable, k store.Keys, s store.Seeder) *store.Activity {
	a := handle(c, k)
	a.Seeder = s
	return a
}

// splitOrFail splits with the given algorithm and a fixed seed.
func splitOrFail(t testing.TB, typ string, total, count int64) []int64 {
	t.Helper()
	amounts, err := split.Split(split.Params{Type: typ, Total: total, Count: count, Min: 1, Seed: 20261231})
	if err != nil {
		t.Fatalf("split: %v", err)
	}
	return amounts
}

func sumOf(amounts []int64) int64 {
	var s int64
	for _, a := range amounts {
		s += a
	}
	return s
}

// seedOpen seeds amounts into the activity uid and opens it with no schedule.
func seedOpen(t testing.TB, ctx context.Context, c redisClient, uid string, amounts []int64) store.Keys {
	t.Helper()
	k := seedReady(t, ctx, c, uid, amounts)
	state, err := handle(c, k).Configure(ctx, 0, 0, false, true)
	if err != nil {
		t.Fatalf("configure: %v", err)
	}
	if state.State != store.StateOpen {
		t.Fatalf("configure returned state %q, want %q", state.State, store.StateOpen)
	}
	return k
}

// seedReady seeds amounts into the activity uid and leaves it ready (not open).
func seedReady(t testing.TB, ctx context.Context, c redisClient, uid string, amounts []int64) store.Keys {
	t.Helper()
	k := keysOf(uid)
	loadFunctions(t, ctx, c)
	res, err := seeding(c, k, store.Seeder{}).Seed(ctx, amounts, store.SeedParams{
		Count: int64(len(amounts)), Total: sumOf(amounts), Sponsor: sponsor,
	})
	if err != nil {
		t.Fatalf("seed %s: %v", uid, err)
	}
	if !res.Committed {
		t.Fatalf("seed %s: not committed by this call", uid)
	}
	return k
}

// answer is one grab call's user and result.
type answer struct {
	user string
	res  store.GrabResult
}

// grabConcurrently runs one grab per entry of users from a pool of workers, all
// released at once, and returns every answer. Any error fails the test.
func grabConcurrently(t testing.TB, ctx context.Context, c redisClient, k store.Keys, users []string, workers int) []answer {
	t.Helper()
	out, err := grabAll(ctx, c, k, users, workers)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// grabAll is grabConcurrently for any goroutine: it returns the first error.
func grabAll(ctx context.Context, c redisClient, k store.Keys, users []string, workers int) ([]answer, error) {
	jobs := make(chan int, len(users))
	for i := range users {
		jobs <- i
	}
	close(jobs)
	out := make([]answer, len(users))
	start := make(chan struct{})
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			<-start
			for i := range jobs {
				res, err := shardOf(c, k).Grab(ctx, users[i])
				if err != nil {
					errs <- fmt.Errorf("grab for %s: %w", users[i], err)
					return
				}
				out[i] = answer{user: users[i], res: res}
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	return out, <-errs
}

func userIDs(prefix string, n int) []string {
	users := make([]string, n)
	for i := range users {
		users[i] = prefix + strconv.Itoa(i)
	}
	return users
}

// tally counts the outcomes of a set of answers and checks what holds for any set:
// a granted answer carries a packet and a positive amount, no packet is granted
// twice and no user is granted twice. It returns the grants by user.
func tally(t testing.TB, answers []answer) (map[store.Outcome]int, map[string]store.GrabResult) {
	t.Helper()
	counts := map[store.Outcome]int{}
	grants := map[string]store.GrabResult{}
	packets := map[string]string{}
	for _, a := range answers {
		counts[a.res.Outcome]++
		if a.res.Outcome != store.Granted {
			continue
		}
		if a.res.PacketID == "" || a.res.Amount <= 0 {
			t.Fatalf("grant to %s without packet or amount: %+v", a.user, a.res)
		}
		if prev, ok := grants[a.user]; ok {
			t.Fatalf("user %s granted twice: %+v and %+v", a.user, prev, a.res)
		}
		if prev, ok := packets[a.res.PacketID]; ok {
			t.Fatalf("packet %s granted twice: to %s and %s", a.res.PacketID, prev, a.user)
		}
		grants[a.user] = a.res
		packets[a.res.PacketID] = a.user
	}
	return counts, grants
}

// verify reads everything Redis holds for the activity and checks it against the
// grants the callers saw and the seeded amounts:
//   - the claims hash holds exactly the grants, user by user;
//   - the stream holds exactly one grant entry per grant (plus refunds);
//   - claimed and still-listed packets together are packet ids 1..count, each
//     once, and each with the amount it was seeded with;
//   - the snapshot's counters equal what was found, and claimed + remaining +
//     refunded == total, with the remaining amount summed from the packets list.
func verify(t testing.TB, ctx context.Context, c redisClient, k store.Keys, amounts []int64, grants map[string]store.GrabResult) store.Snapshot {
	t.Helper()
	total, count := sumOf(amounts), int64(len(amounts))

	snap, err := handle(c, k).Snapshot(ctx)
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	if snap.Total != total || snap.Count != count {
		t.Fatalf("snapshot total/count %d/%d, want %d/%d", snap.Total, snap.Count, total, count)
	}

	claims, err := c.HGetAll(ctx, k.Claims).Result()
	if err != nil {
		t.Fatalf("reading claims: %v", err)
	}
	if len(claims) != len(grants) {
		t.Fatalf("claims hash has %d users, callers saw %d grants", len(claims), len(grants))
	}
	seen := make([]bool, count+1)
	mark := func(id string, a int64, where string) int64 {
		n, err := strconv.ParseInt(id, 10, 64)
		if err != nil || n < 1 || n > count || a <= 0 {
			t.Fatalf("%s entry %s:%d: bad packet id or amount", where, id, a)
		}
		if seen[n] {
			t.Fatalf("packet %d appears twice (%s)", n, where)
		}
		seen[n] = true
		if a != amounts[n-1] {
			t.Fatalf("packet %d has amount %d in %s, seeded %d", n, a, where, amounts[n-1])
		}
		return a
	}
	var claimedAmount int64
	for user, entry := range claims {
		g, ok := grants[user]
		if !ok {
			t.Fatalf("claims hash has user %s whom no caller saw granted", user)
		}
		// "<packetId>:<amount>:<stream entry id>"
		packet, entryID, ok := strings.Cut(entry, ":")
		if ok {
			var amount string
			amount, entryID, ok = strings.Cut(entryID, ":")
			packet += ":" + amount
		}
		if !ok || entryID == "" {
			t.Fatalf("claim of %s is %q, not <packetId>:<amount>:<entryId>", user, entry)
		}
		if want := g.PacketID + ":" + strconv.FormatInt(g.Amount, 10); packet != want {
			t.Fatalf("claim of %s is %q, caller saw %q", user, entry, want)
		}
		id, amount, _ := strings.Cut(packet, ":")
		a, err := strconv.ParseInt(amount, 10, 64)
		if err != nil {
			t.Fatalf("claim of %s is %q: amount: %v", user, entry, err)
		}
		claimedAmount += mark(id, a, "claims")
	}

	left, err := shardOf(c, k).Listed(ctx)
	if err != nil {
		t.Fatalf("reading packets: %v", err)
	}
	// Each listed packet is numbered with what was claimed plus what is listed ahead
	// of it: the head's numbers are the claimed count and amount.
	var remainingAmount int64
	for i, p := range left {
		if p.CountBefore != int64(len(claims)+i) || p.AmountBefore != claimedAmount+remainingAmount {
			t.Fatalf("listed packet %d is %+v: want %d claimed + %d listed ahead, of %d + %d",
				i, p, len(claims), i, claimedAmount, remainingAmount)
		}
		remainingAmount += mark(p.ID, p.Amount, "packets")
	}
	if snap.State != store.StateClosed {
		for n := int64(1); n <= count; n++ {
			if !seen[n] {
				t.Fatalf("packet %d is neither claimed nor listed", n)
			}
		}
	}

	entries, err := shardOf(c, k).Entries(ctx)
	if err != nil {
		t.Fatalf("reading stream: %v", err)
	}
	streamGrants := map[string]bool{}
	var refunds int64
	for _, e := range entries {
		if e.Malformed != nil {
			t.Fatalf("stream entry %s %v: %v", e.ID, e.Fields, e.Malformed)
		}
		switch e.Kind {
		case store.KindGrant:
			g, ok := grants[e.UserID]
			if !ok || g.PacketID != e.PacketID || g.Amount != e.Amount {
				t.Fatalf("stream grant %v does not match the caller's grant %+v", e.Fields, g)
			}
			if streamGrants[e.UserID] {
				t.Fatalf("stream has two grants for %s", e.UserID)
			}
			streamGrants[e.UserID] = true
		case store.KindRefund:
			if e.UserID != sponsor || e.PacketID != "refund" {
				t.Fatalf("refund entry %v: want user %s and packet refund", e.Fields, sponsor)
			}
			refunds += e.Amount
		}
		if e.At.IsZero() || e.At.Year() < 2000 {
			t.Fatalf("stream entry %s %v: time %v", e.ID, e.Fields, e.At)
		}
	}
	if len(streamGrants) != len(grants) {
		t.Fatalf("stream has %d grants, callers saw %d", len(streamGrants), len(grants))
	}
	if refunds != snap.Refunded {
		t.Fatalf("stream refunds sum to %d, snapshot says %d refunded", refunds, snap.Refunded)
	}

	if snap.ClaimedCount != int64(len(grants)) {
		t.Fatalf("claimed_count %d, want %d", snap.ClaimedCount, len(grants))
	}
	if snap.ClaimedAmount != claimedAmount {
		t.Fatalf("claimed_amount %d, claims sum to %d", snap.ClaimedAmount, claimedAmount)
	}
	if snap.RemainingCount != int64(len(left)) {
		t.Fatalf("remaining count %d, packets list has %d", snap.RemainingCount, len(left))
	}
	if snap.State != store.StateClosed && snap.RemainingCount+snap.ClaimedCount != count {
		t.Fatalf("remaining %d + claimed %d != count %d", snap.RemainingCount, snap.ClaimedCount, count)
	}
	if snap.RemainingAmount() != remainingAmount {
		t.Fatalf("remaining amount %d, packets list sums to %d", snap.RemainingAmount(), remainingAmount)
	}
	if claimedAmount+remainingAmount+snap.Refunded != total {
		t.Fatalf("claimed %d + remaining %d + refunded %d != total %d",
			claimedAmount, remainingAmount, snap.Refunded, total)
	}
	return snap
}

// grantsSum adds up granted amounts.
func grantsSum(grants map[string]store.GrabResult) int64 {
	var s int64
	for _, g := range grants {
		s += g.Amount
	}
	return s
}

// clientOf is c itself for the variant "plain", and an auto-pipeliner over c with the
// grab service's options for "autopipeline".
func clientOf(t testing.TB, c *redis.Client, variant string) redisClient {
	t.Helper()
	if variant != "autopipeline" {
		return c
	}
	ap, err := c.AutoPipelineWithOptions(redisconn.GrabPipelineOptions())
	if err != nil {
		t.Fatalf("auto-pipeliner: %v", err)
	}
	return ap
}

// loadFunctions loads the scripts and the grab-side function library, as the
// controller's "load scripts" step does, when c is a plain or cluster client (an
// auto-pipeliner cannot reach every master).
func loadFunctions(t testing.TB, ctx context.Context, c redis.Cmdable) {
	t.Helper()
	if u, ok := c.(redis.UniversalClient); ok {
		if err := store.NewActivity(u, "functions", 1).LoadScripts(ctx); err != nil {
			t.Fatalf("loading the scripts: %v", err)
		}
	}
}
