package store_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// assertNoClaimWritten checks that refused grabs left no trace: no claim, no
// stream entry, no counter moved, every packet still listed.
func assertNoClaimWritten(t *testing.T, c *redis.Client, k store.Keys, count int64) {
	t.Helper()
	ctx := t.Context()
	if n, _ := c.HLen(ctx, k.Claims).Result(); n != 0 {
		t.Fatalf("refused grabs wrote %d claims", n)
	}
	if n, _ := c.XLen(ctx, k.Stream).Result(); n != 0 {
		t.Fatalf("refused grabs wrote %d stream entries", n)
	}
	snap, err := handle(c, k).Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.ClaimedCount != 0 || snap.ClaimedAmount != 0 || snap.RemainingCount != count {
		t.Fatalf("refused grabs moved counters: %+v", snap)
	}
}

func grabOne(t *testing.T, c redisClient, k store.Keys, user string) store.GrabResult {
	t.Helper()
	res, err := shardOf(c, k).Grab(t.Context(), user)
	if err != nil {
		t.Fatalf("grab for %s: %v", user, err)
	}
	return res
}

func configure(t *testing.T, c redisClient, k store.Keys, startMs, endMs int64, paused, open bool) string {
	t.Helper()
	res, err := handle(c, k).Configure(t.Context(), startMs, endMs, paused, open)
	if err != nil {
		t.Fatalf("configure: %v", err)
	}
	if !res.Found {
		return string(store.Missing)
	}
	return string(res.State)
}

func TestGates(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeFixed, 1000, 10)
	now := time.Now().UnixMilli()
	hour := time.Hour.Milliseconds()

	t.Run("missing", func(t *testing.T) {
		k := keysOf("never-seeded")
		if res := grabOne(t, c, k, "u"); res.Outcome != store.Missing {
			t.Fatalf("grab on a missing activity: %+v, want missing", res)
		}
		if state := configure(t, c, k, 0, 0, false, true); state != string(store.Missing) {
			t.Fatalf("configure on a missing activity returned %q, want missing", state)
		}
		if cr, err := handle(c, k).Close(ctx, store.CloseExpired); err != nil || string(cr.Outcome) != "missing" {
			t.Fatalf("close on a missing activity: %+v, %v", cr, err)
		}
		if snap, err := handle(c, k).Snapshot(ctx); err != nil || snap.Exists() {
			t.Fatalf("snapshot of a missing activity: %+v, %v", snap, err)
		}
		// Nothing was created by any of it.
		if n, err := c.Exists(ctx, k.All()...).Result(); err != nil || n != 0 {
			t.Fatalf("calls on a missing activity created %d keys (%v)", n, err)
		}
	})

	t.Run("ready but not open", func(t *testing.T) {
		k := seedReady(t, ctx, c, "gate-ready", amounts)
		if res := grabOne(t, c, k, "u"); res.Outcome != store.NotStarted {
			t.Fatalf("grab on a ready activity: %+v, want not_started", res)
		}
		// Configure without open keeps it ready.
		if state := configure(t, c, k, 0, 0, false, false); state != string(store.StateReady) {
			t.Fatalf("configure without open: %q", state)
		}
		if res := grabOne(t, c, k, "u"); res.Outcome != store.NotStarted {
			t.Fatalf("grab on a ready activity: %+v, want not_started", res)
		}
		assertNoClaimWritten(t, c, k, 10)
		if state := configure(t, c, k, 0, 0, false, true); state != string(store.StateOpen) {
			t.Fatalf("configure with open: %q", state)
		}
		if res := grabOne(t, c, k, "u"); res.Outcome != store.Granted {
			t.Fatalf("grab once open: %+v", res)
		}
	})

	t.Run("not started", func(t *testing.T) {
		k := seedReady(t, ctx, c, "gate-future", amounts)
		configure(t, c, k, now+hour, now+2*hour, false, true)
		if res := grabOne(t, c, k, "u"); res.Outcome != store.NotStarted {
			t.Fatalf("grab before start: %+v, want not_started", res)
		}
		assertNoClaimWritten(t, c, k, 10)
		// Moving the start into the past opens it, with the end still ahead.
		configure(t, c, k, now-hour, now+hour, false, true)
		if res := grabOne(t, c, k, "u"); res.Outcome != store.Granted {
			t.Fatalf("grab inside the window: %+v, want granted", res)
		}
	})

	t.Run("ended", func(t *testing.T) {
		k := seedReady(t, ctx, c, "gate-past", amounts)
		configure(t, c, k, now-2*hour, now-1000, false, true)
		if res := grabOne(t, c, k, "u"); res.Outcome != store.Ended {
			t.Fatalf("grab after the end: %+v, want ended", res)
		}
		assertNoClaimWritten(t, c, k, 10)
		// No end at all: open.
		configure(t, c, k, now-2*hour, 0, false, true)
		if res := grabOne(t, c, k, "u"); res.Outcome != store.Granted {
			t.Fatalf("grab without an end: %+v, want granted", res)
		}
	})

	t.Run("paused", func(t *testing.T) {
		k := seedReady(t, ctx, c, "gate-paused", amounts)
		configure(t, c, k, 0, 0, true, true)
		if res := grabOne(t, c, k, "u"); res.Outcome != store.Paused {
			t.Fatalf("grab while paused: %+v, want paused", res)
		}
		assertNoClaimWritten(t, c, k, 10)
		if snap, _ := handle(c, k).Snapshot(ctx); !snap.Paused {
			t.Fatalf("snapshot %+v: want paused", snap)
		}
		configure(t, c, k, 0, 0, false, true)
		first := grabOne(t, c, k, "u")
		if first.Outcome != store.Granted {
			t.Fatalf("grab after resuming: %+v, want granted", first)
		}
		// Pausing again: the user who has a packet still sees it; others wait.
		configure(t, c, k, 0, 0, true, true)
		if res := grabOne(t, c, k, "u"); res.Outcome != store.AlreadyClaimed || res.PacketID != first.PacketID {
			t.Fatalf("repeat grab while paused: %+v, want already_claimed %+v", res, first)
		}
		if res := grabOne(t, c, k, "v"); res.Outcome != store.Paused {
			t.Fatalf("new grab while paused: %+v, want paused", res)
		}
		verify(t, ctx, c, k, amounts, map[string]store.GrabResult{"u": first})
	})

	t.Run("seeded with a schedule", func(t *testing.T) {
		// The schedule written at commit holds until configure changes it.
		k := keysOf("gate-seed-schedule")
		if _, err := seeding(c, k, store.Seeder{}).Seed(ctx, amounts, store.SeedParams{
			Count: 10, Total: 1000, StartMs: now + hour, EndMs: now + 2*hour, Paused: true, Sponsor: sponsor,
		}); err != nil {
			t.Fatal(err)
		}
		snap, err := handle(c, k).Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if snap.State != store.StateReady || snap.StartMs != now+hour || snap.EndMs != now+2*hour || !snap.Paused ||
			snap.SeededMs < now-time.Minute.Milliseconds() {
			t.Fatalf("snapshot after a scheduled seed: %+v", snap)
		}
	})
}

func TestCloseExpiredRefundsTheRest(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const total, count = 100_000, 50
	amounts := splitOrFail(t, split.TypeRandom, total, count)
	k := seedOpen(t, ctx, c, "close-expired", amounts)

	_, grants := tally(t, grabConcurrently(t, ctx, c, k, userIDs("p", 20), 10))
	if len(grants) != 20 {
		t.Fatalf("%d grants, want 20", len(grants))
	}
	claimed := grantsSum(grants)

	cr, err := handle(c, k).Close(ctx, store.CloseExpired)
	if err != nil {
		t.Fatal(err)
	}
	want := store.CloseResult{Outcome: store.Closed, Reason: store.CloseExpired, Refunded: total - claimed}
	if cr != want {
		t.Fatalf("close: %+v, want %+v", cr, want)
	}
	snap := verify(t, ctx, c, k, amounts, grants)
	if snap.State != store.StateClosed || snap.CloseReason != store.CloseExpired || snap.Refunded != total-claimed ||
		snap.RemainingCount != 0 || snap.RemainingAmount() != 0 || snap.ClaimedAmount+snap.Refunded != total {
		t.Fatalf("snapshot after close: %+v", snap)
	}
	entries, err := c.XRange(ctx, k.Stream, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	last := entries[len(entries)-1].Values
	if len(entries) != 21 || last["kind"] != store.KindRefund || last["user"] != sponsor || last["packet"] != "refund" ||
		last["amount"] != strconv.FormatInt(total-claimed, 10) {
		t.Fatalf("stream after close: %d entries, last %v; want 21 with the refund last", len(entries), last)
	}

	// Closing again, for either reason, returns the first close's figures and adds nothing.
	for _, reason := range []store.CloseReason{store.CloseExpired, store.CloseExhausted} {
		again, err := handle(c, k).Close(ctx, reason)
		if err != nil || again != want {
			t.Fatalf("second close (%s): %+v, %v; want %+v", reason, again, err, want)
		}
	}
	if n, _ := c.XLen(ctx, k.Stream).Result(); n != 21 {
		t.Fatalf("stream has %d entries after closing again, want 21", n)
	}

	// New grabs end; users with a packet still get it back.
	if res := grabOne(t, c, k, "latecomer"); res.Outcome != store.Ended {
		t.Fatalf("grab after close: %+v, want ended", res)
	}
	for user, g := range grants {
		res := grabOne(t, c, k, user)
		if res != (store.GrabResult{Outcome: store.AlreadyClaimed, PacketID: g.PacketID, Amount: g.Amount}) {
			t.Fatalf("grab of %s after close: %+v, want already_claimed %+v", user, res, g)
		}
	}
	// Configure cannot reopen a closed activity.
	if state := configure(t, c, k, 0, 0, false, true); state != string(store.StateClosed) {
		t.Fatalf("configure after close: %q, want closed", state)
	}
	if res := grabOne(t, c, k, "latecomer"); res.Outcome != store.Ended {
		t.Fatalf("grab after configure on a closed activity: %+v, want ended", res)
	}
	verify(t, ctx, c, k, amounts, grants)
}

func TestCloseExpiredWithNothingClaimed(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeLineCut, 5000, 40)
	k := seedOpen(t, ctx, c, "close-untouched", amounts)
	cr, err := handle(c, k).Close(ctx, store.CloseExpired)
	if err != nil || cr.Refunded != 5000 {
		t.Fatalf("close: %+v, %v; want all 5000 refunded", cr, err)
	}
	snap := verify(t, ctx, c, k, amounts, nil)
	if snap.Refunded != 5000 || snap.ClaimedCount != 0 {
		t.Fatalf("snapshot %+v", snap)
	}
}

func TestCloseExhaustedOnlyWhenNothingLeft(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeRandom, 3000, 3)
	k := seedOpen(t, ctx, c, "close-exhausted", amounts)

	grants := map[string]store.GrabResult{}
	for _, u := range []string{"a", "b"} {
		grants[u] = grabOne(t, c, k, u)
	}
	cr, err := handle(c, k).Close(ctx, store.CloseExhausted)
	if err != nil || cr != (store.CloseResult{Outcome: store.CloseStillOpen}) {
		t.Fatalf("close exhausted with a packet left: %+v, %v; want open", cr, err)
	}
	snap := verify(t, ctx, c, k, amounts, grants)
	if snap.State != store.StateOpen || snap.RemainingCount != 1 || snap.Refunded != 0 {
		t.Fatalf("snapshot after a refused close: %+v", snap)
	}
	grants["c"] = grabOne(t, c, k, "c")
	if grants["c"].Outcome != store.Granted {
		t.Fatalf("last packet: %+v", grants["c"])
	}
	if res := grabOne(t, c, k, "d"); res.Outcome != store.SoldOut {
		t.Fatalf("after the last packet: %+v, want sold_out", res)
	}
	cr, err = handle(c, k).Close(ctx, store.CloseExhausted)
	if err != nil || cr != (store.CloseResult{Outcome: store.Closed, Reason: store.CloseExhausted}) {
		t.Fatalf("close exhausted when sold out: %+v, %v", cr, err)
	}
	snap = verify(t, ctx, c, k, amounts, grants)
	if snap.State != store.StateClosed || snap.CloseReason != store.CloseExhausted || snap.ClaimedAmount != 3000 {
		t.Fatalf("snapshot after exhausting: %+v", snap)
	}
	if n, _ := c.XLen(ctx, k.Stream).Result(); n != 3 {
		t.Fatalf("stream has %d entries, want the 3 grants and no refund", n)
	}
	if res := grabOne(t, c, k, "d"); res.Outcome != store.SoldOut {
		t.Fatalf("grab after an exhausted close: %+v, want sold_out", res)
	}
}

// readAll creates the consumer group and delivers every entry to one consumer.
func readAll(t *testing.T, c *redis.Client, k store.Keys, group string) []store.StreamEntry {
	t.Helper()
	ctx := t.Context()
	s := shardOf(c, k)
	if err := s.EnsureGroup(ctx, group); err != nil {
		t.Fatal(err)
	}
	entries, err := s.ReadNew(ctx, group, "worker-1", 1000, 0)
	if err != nil {
		t.Fatal(err)
	}
	return entries
}

// decoded fails the test when a settlement stream entry is malformed.
func decoded(t *testing.T, e store.StreamEntry) store.StreamEntry {
	t.Helper()
	if e.Malformed != nil {
		t.Fatalf("entry %s %v: %v", e.ID, e.Fields, e.Malformed)
	}
	return e
}

// entryAmount is the amount of a well-formed entry.
func entryAmount(t *testing.T, m store.StreamEntry) int64 {
	t.Helper()
	return decoded(t, m).Amount
}

// settledActivity is an activity of total split in 10 packets, 6 of them granted and
// the rest refunded at close, with its 7 entries delivered to the group
// "settlement"; claimed is what the grants took.
func settledActivity(t *testing.T, uid string, total int64) (c *redis.Client, k store.Keys, msgs []store.StreamEntry, claimed int64) {
	t.Helper()
	ctx := redistest.Context(t)
	c = redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeRandom, total, 10)
	k = seedOpen(t, ctx, c, uid, amounts)
	_, grants := tally(t, grabConcurrently(t, ctx, c, k, userIDs("s", 6), 6))
	if _, err := handle(c, k).Close(ctx, store.CloseExpired); err != nil {
		t.Fatal(err)
	}
	msgs = readAll(t, c, k, "settlement")
	if len(msgs) != 7 {
		t.Fatalf("%d entries delivered, want 6 grants and 1 refund", len(msgs))
	}
	return c, k, msgs, grantsSum(grants)
}

func TestSettleAckCountsOnce(t *testing.T) {
	ctx := redistest.Context(t)
	const total = 10_000
	c, k, msgs, claimed := settledActivity(t, "settle", total)

	// An entry that was never delivered to the group cannot be acked into the counters.
	if err := c.XGroupCreate(ctx, k.Stream, "other", "$").Err(); err != nil {
		t.Fatal(err)
	}
	if ok, err := shardOf(c, k).Ack(ctx, "other", msgs[0].ID, store.KindGrant, entryAmount(t, msgs[0])); err != nil || ok {
		t.Fatalf("ack of an undelivered entry: %v, %v; want false", ok, err)
	}

	for _, m := range msgs {
		kind := decoded(t, m).Kind
		for attempt := range 2 {
			ok, err := shardOf(c, k).Ack(ctx, "settlement", m.ID, kind, entryAmount(t, m))
			if err != nil {
				t.Fatal(err)
			}
			if ok != (attempt == 0) {
				t.Fatalf("ack %d of %s returned %v", attempt+1, m.ID, ok)
			}
		}
	}
	snap, err := handle(c, k).Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.SettledCount != 6 || snap.SettledAmount != claimed || snap.RefundSettled != total-claimed || snap.DeadCount != 0 {
		t.Fatalf("after acking: %+v; want 6 settled for %d and %d refund settled", snap, claimed, total-claimed)
	}
	pending, err := c.XPending(ctx, k.Stream, "settlement").Result()
	if err != nil || pending.Count != 0 {
		t.Fatalf("pending after acking: %+v, %v", pending, err)
	}
}

// AckMany acknowledges a batch in one round trip with Ack's guarantees: each entry
// counted once, a second batch of the same entries counting nothing, entries of a
// group they were not delivered to counting nothing, and a script missing from the
// cache loaded on the way.
func TestSettleAckManyCountsOnce(t *testing.T) {
	ctx := redistest.Context(t)
	const total = 10_000
	c, k, msgs, claimed := settledActivity(t, "settle-many", total)
	reqs := make([]store.AckRequest, len(msgs))
	for i, m := range msgs {
		reqs[i] = store.AckRequest{EntryID: m.ID, Kind: decoded(t, m).Kind, Amount: entryAmount(t, m)}
	}
	if err := c.XGroupCreate(ctx, k.Stream, "other", "$").Err(); err != nil {
		t.Fatal(err)
	}
	for _, r := range shardOf(c, k).AckMany(ctx, "other", reqs) {
		if r.Err != nil || r.Settled {
			t.Fatalf("ack of an undelivered entry: %+v; want false", r)
		}
	}
	if err := c.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	for attempt := range 2 {
		for i, r := range shardOf(c, k).AckMany(ctx, "settlement", reqs) {
			if r.Err != nil || r.Settled != (attempt == 0) {
				t.Fatalf("batch %d: ack of %s: %+v", attempt+1, reqs[i].EntryID, r)
			}
		}
	}
	snap, err := handle(c, k).Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.SettledCount != 6 || snap.SettledAmount != claimed || snap.RefundSettled != total-claimed {
		t.Fatalf("after acking: %+v; want 6 settled for %d and %d refund settled", snap, claimed, total-claimed)
	}
	if pending, err := c.XPending(ctx, k.Stream, "settlement").Result(); err != nil || pending.Count != 0 {
		t.Fatalf("pending after acking: %+v, %v", pending, err)
	}
}

func TestDeadLetterOnce(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeFixed, 300, 3)
	k := seedOpen(t, ctx, c, "dead", amounts)
	for _, u := range []string{"x", "y"} {
		grabOne(t, c, k, u)
	}
	msgs := readAll(t, c, k, "settlement")
	poison := msgs[0]
	fields := map[string]any{}
	for f, v := range poison.Fields {
		fields[f] = v
	}
	for attempt := range 2 {
		ok, err := shardOf(c, k).DeadLetter(ctx, "settlement", poison.ID, "webhook answered 500", fields)
		if err != nil {
			t.Fatal(err)
		}
		if ok != (attempt == 0) {
			t.Fatalf("dead-letter %d returned %v", attempt+1, ok)
		}
	}
	dead, err := c.XRange(ctx, k.DeadLetters, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dead))
	}
	d := dead[0].Values
	if d["entry"] != poison.ID || d["error"] != "webhook answered 500" || d["grant"] != poison.Fields["grant"] ||
		len(d) != len(poison.Fields)+2 {
		t.Fatalf("dead letter %v does not carry entry %s %v", d, poison.ID, poison.Fields)
	}
	// A parked entry is no longer pending and cannot be settled afterwards.
	if ok, err := shardOf(c, k).Ack(ctx, "settlement", poison.ID, store.KindGrant, entryAmount(t, poison)); err != nil || ok {
		t.Fatalf("ack of a dead-lettered entry: %v, %v", ok, err)
	}
	// The other entry settles normally.
	if ok, err := shardOf(c, k).Ack(ctx, "settlement", msgs[1].ID, store.KindGrant, entryAmount(t, msgs[1])); err != nil || !ok {
		t.Fatalf("ack of the healthy entry: %v, %v", ok, err)
	}
	snap, err := handle(c, k).Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.DeadCount != 1 || snap.SettledCount != 1 || snap.SettledAmount != 100 {
		t.Fatalf("snapshot %+v: want 1 dead, 1 settled for 100", snap)
	}
}

func TestLargeAmountsStayExact(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const big = 999_999_999_999_999
	// The API's largest total is 1e15; one packet takes all but one minor unit.
	amounts := []int64{1, big}
	total := sumOf(amounts)
	k := seedOpen(t, ctx, c, "large", amounts)
	a := grabOne(t, c, k, "first")
	b := grabOne(t, c, k, "second")
	grants := map[string]store.GrabResult{"first": a, "second": b}
	if b.PacketID != "2" || b.Amount != big || a.Amount != 1 {
		t.Fatalf("grants %+v and %+v, want packet 2 worth %d", a, b, big)
	}
	if again := grabOne(t, c, k, "second"); again.Amount != big {
		t.Fatalf("repeat grab: %+v", again)
	}
	snap := verify(t, ctx, c, k, amounts, grants)
	if snap.ClaimedAmount != total || snap.Total != 1_000_000_000_000_000 {
		t.Fatalf("snapshot %+v: want %d claimed", snap, total)
	}
	msgs := readAll(t, c, k, "g")
	for _, m := range msgs {
		if ok, err := shardOf(c, k).Ack(ctx, "g", m.ID, store.KindGrant, entryAmount(t, m)); err != nil || !ok {
			t.Fatalf("ack: %v %v", ok, err)
		}
	}
	if e := decoded(t, msgs[1]); e.Amount != big || e.Fields["grant"] != "2:999999999999999:0::second" {
		t.Fatalf("stream entry %v, want packet 2 of 999999999999999 to second", e.Fields)
	}
	if snap, _ = handle(c, k).Snapshot(ctx); snap.SettledAmount != total {
		t.Fatalf("settled %d, want %d", snap.SettledAmount, total)
	}

	// A large remainder refunds exactly.
	amounts = []int64{big, big, big, 7}
	total = sumOf(amounts)
	k = seedOpen(t, ctx, c, "large-refund", amounts)
	first := grabOne(t, c, k, "only")
	cr, err := handle(c, k).Close(ctx, store.CloseExpired)
	if err != nil || cr.Refunded != total-first.Amount {
		t.Fatalf("close: %+v, %v; want %d refunded", cr, err, total-first.Amount)
	}
	verify(t, ctx, c, k, amounts, map[string]store.GrabResult{"only": first})
}

func TestPurgeRemovesEverything(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeRandom, 500, 5)
	k := seedOpen(t, ctx, c, "purge", amounts)
	grabOne(t, c, k, "u")
	readAll(t, c, k, "g")
	// A neighbouring activity keeps its keys.
	other := keysOf("neighbour")
	seedOpen(t, ctx, c, "neighbour", amounts)
	if err := handle(c, k).Purge(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := c.Exists(ctx, k.All()...).Result(); err != nil || n != 0 {
		t.Fatalf("%d keys left after purge (%v)", n, err)
	}
	if res := grabOne(t, c, k, "u"); res.Outcome != store.Missing {
		t.Fatalf("grab after purge: %+v, want missing", res)
	}
	if snap, _ := handle(c, other).Snapshot(ctx); snap.RemainingCount != 5 {
		t.Fatalf("neighbour after purge: %+v", snap)
	}
}
