package store_test

import (
	"errors"
	"testing"

	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// A grab with a watermark above what Redis holds fences the activity: nothing is
// granted again, configure does not reopen it and close does not refund from it,
// until Accept starts a new epoch; then earlier watermarks no longer count, and a
// Redis restored from before the accept is fenced again.
func TestRollbackFence(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	k := seedOpen(t, ctx, c, "rolled", []int64{100, 200, 300, 400, 500, 600})

	listed, err := c.LRange(ctx, k.Packets, 0, 2).Result()
	if err != nil {
		t.Fatal(err)
	}
	var seen store.Watermark
	for i, u := range []string{"u1", "u2", "u3"} {
		res, err := shardOf(c, k).GrabAbove(ctx, u, seen)
		if err != nil || res.Outcome != store.Granted {
			t.Fatalf("grab %s: %+v %v", u, res, err)
		}
		if res.Seen != (store.Watermark{ClaimedCount: int64(i + 1)}) {
			t.Fatalf("grant %d reported watermark %+v", i+1, res.Seen)
		}
		seen = seen.Raise(res.Seen)
	}
	// A snapshot taken now, restored below: the rollback.
	dump, err := c.Dump(ctx, k.Meta).Result()
	if err != nil {
		t.Fatal(err)
	}
	snapAt1 := func() {
		t.Helper()
		// Back to one claim: u2 and u3 are gone from claims and their packets are
		// listed again, as a Redis restored from that moment holds them.
		if err := c.HDel(ctx, k.Claims, "u2", "u3").Err(); err != nil {
			t.Fatal(err)
		}
		if err := c.LPush(ctx, k.Packets, listed[2], listed[1]).Err(); err != nil {
			t.Fatal(err)
		}
	}
	snapAt1()

	res, err := shardOf(c, k).GrabAbove(ctx, "u4", seen)
	if err != nil || res.Outcome != store.Fenced {
		t.Fatalf("grab above a rolled-back Redis: %+v %v, want fenced", res, err)
	}
	// Fenced for everyone, whatever watermark they carry. A repeat still reads its
	// own claim: whatever an older Redis holds in claims did happen.
	if res, err := shardOf(c, k).Grab(ctx, "u5"); err != nil || res.Outcome != store.Fenced {
		t.Fatalf("grab after the fence: %+v %v, want fenced", res, err)
	}
	if res, err := shardOf(c, k).Grab(ctx, "u1"); err != nil || res.Outcome != store.AlreadyClaimed || res.PacketID != "1" {
		t.Fatalf("repeat after the fence: %+v %v, want already_claimed of packet 1", res, err)
	}
	snap, err := handle(c, k).Snapshot(ctx)
	if err != nil || snap.Fenced != "rolled_back" || snap.RemainingCount != 5 {
		t.Fatalf("snapshot after the fence: %+v %v", snap, err)
	}
	if cr, err := handle(c, k).Configure(ctx, 0, 0, false, true); err != nil || !cr.Fenced {
		t.Fatalf("configure of a fenced activity: %+v %v, want fenced", cr, err)
	}
	if cl, err := handle(c, k).Close(ctx, store.CloseExpired); err != nil || cl.Outcome != store.CloseFenced {
		t.Fatalf("close of a fenced activity: %+v %v, want fenced", cl, err)
	}
	if n, err := c.XLen(ctx, k.Stream).Result(); err != nil || n != 3 {
		t.Fatalf("stream holds %d entries (%v), want the 3 grants and no refund", n, err)
	}

	// Accepting an epoch that is not Redis's does nothing.
	if _, err := handle(c, k).Accept(ctx, 4); !errors.Is(err, store.ErrEpochMoved) {
		t.Fatalf("accept of epoch 4: %v, want ErrEpochMoved", err)
	}
	epoch, err := handle(c, k).Accept(ctx, 0)
	if err != nil || epoch != 1 {
		t.Fatalf("accept: %d %v, want epoch 1", epoch, err)
	}
	// The old watermark (epoch 0, 3 claims) no longer fences.
	res, err = shardOf(c, k).GrabAbove(ctx, "u6", seen)
	if err != nil || res.Outcome != store.Granted || res.Seen != (store.Watermark{Epoch: 1, ClaimedCount: 2}) {
		t.Fatalf("grab after the accept: %+v %v, want granted at epoch 1, count 2", res, err)
	}
	seen = seen.Raise(res.Seen)

	// A Redis restored from before the accept carries epoch 0: fenced again.
	if err := c.RestoreReplace(ctx, k.Meta, 0, dump).Err(); err != nil {
		t.Fatal(err)
	}
	if res, err := shardOf(c, k).GrabAbove(ctx, "u7", seen); err != nil || res.Outcome != store.Fenced {
		t.Fatalf("grab on a Redis restored from before the accept: %+v %v, want fenced", res, err)
	}
}

// The payee: configure keeps the sponsor and currency current, the refund goes to
// the sponsor of close time, and each settlement entry keeps the currency of its own
// grant.
func TestPayeeKeptCurrent(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	k := keysOf("payee")
	if _, err := seeding(c, k, store.Seeder{}).Seed(ctx, []int64{10, 20, 30}, store.SeedParams{Count: 3, Total: 60, Currency: "CNY"}); err != nil {
		t.Fatal(err)
	}
	if _, err := handle(c, k).Configure(ctx, 0, 0, false, true); err != nil {
		t.Fatal(err)
	}
	first, err := shardOf(c, k).Grab(ctx, "early")
	if err != nil || first.Outcome != store.Granted {
		t.Fatalf("grab: %+v %v", first, err)
	}
	// Settlement and the sponsor are added after creation; the currency changes.
	if _, err := handle(c, k).ConfigureWith(ctx, store.Settings{Open: true, Sponsor: "merchant-late", Currency: "HKD"}); err != nil {
		t.Fatal(err)
	}
	second, err := shardOf(c, k).Grab(ctx, "late")
	if err != nil || second.Outcome != store.Granted {
		t.Fatalf("grab: %+v %v", second, err)
	}
	closed, err := handle(c, k).Close(ctx, store.CloseExpired)
	if err != nil || closed.Refunded != 60-first.Amount-second.Amount {
		t.Fatalf("close: %+v %v", closed, err)
	}
	entries, err := shardOf(c, k).Entries(ctx)
	if err != nil || len(entries) != 3 {
		t.Fatalf("stream: %d entries, %v", len(entries), err)
	}
	want := []struct{ kind, user, currency string }{
		{"grant", "early", "CNY"}, {"grant", "late", "HKD"}, {"refund", "merchant-late", "HKD"},
	}
	for i, e := range entries {
		w := want[i]
		if e.Malformed != nil || e.Kind != w.kind || e.UserID != w.user || e.Currency != w.currency {
			t.Errorf("entry %d: %v, want kind %s user %s currency %s", i, e.Fields, w.kind, w.user, w.currency)
		}
	}
}
