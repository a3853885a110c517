package store_test

import (
	"strconv"
	"testing"
	"time"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// The gate field caches "plainly open, with this window" for the grab script's fast
// path. Every change of the state, the pause flag, the window or the fence must be
// seen by the next grab, however many grabs went through the fast path before.
func TestGateFollowsEveryChange(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeFixed, 1000, 20)
	k := seedOpen(t, ctx, c, "gate-cached", amounts)
	grants := map[string]store.GrabResult{}
	grant := func(user string, wantCount int64) {
		t.Helper()
		res := grabOne(t, c, k, user)
		if res.Outcome != store.Granted || res.Seen.ClaimedCount != wantCount {
			t.Fatalf("grab by %s: %+v, want granted raising the count to %d", user, res, wantCount)
		}
		grants[user] = res
	}
	gate := func() string {
		t.Helper()
		g, _ := c.HGet(ctx, k.Meta, "gate").Result()
		return g
	}
	refused := func(user string, want store.Outcome) {
		t.Helper()
		if res := grabOne(t, c, k, user); res.Outcome != want {
			t.Fatalf("grab by %s: %+v, want %s", user, res, want)
		}
	}

	grant("a", 1)
	grant("b", 2)
	if g := gate(); g != "0:" {
		t.Fatalf("gate after grants without a window: %q, want epoch 0 and no currency", g)
	}

	// Pause, resume.
	configure(t, c, k, 0, 0, true, true)
	refused("p", store.Paused)
	refused("p", store.Paused)
	if g := gate(); g != "-" {
		t.Fatalf("gate while paused: %q, want -", g)
	}
	configure(t, c, k, 0, 0, false, true)
	grant("c", 3)

	// A window on the Redis clock: the gate carries it and every grab reads TIME.
	now, err := c.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	ms := now.UnixMilli()
	configure(t, c, k, ms-60_000, ms+60_000, false, true)
	grant("d", 4)
	if g, want := gate(), "w"+strconv.FormatInt(ms-60_000, 10)+":"+strconv.FormatInt(ms+60_000, 10)+":0:"; g != want {
		t.Fatalf("gate with a window: %q, want %q", g, want)
	}
	configure(t, c, k, ms+60_000, ms+120_000, false, true)
	refused("e", store.NotStarted)
	refused("e", store.NotStarted)
	// An end a little ahead: granted through the cached gate until the Redis clock
	// reaches it, ended after.
	configure(t, c, k, ms-60_000, ms+400, false, true)
	grant("e", 5)
	for {
		now, err := c.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		if now.UnixMilli() >= ms+400 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	refused("f", store.Ended)
	configure(t, c, k, 0, 0, false, true)
	grant("f", 6)

	// The fence, from outside (the controller) and from a grab's watermark.
	if why, err := handle(c, k).Fence(ctx, "rolled_back"); err != nil || why != "rolled_back" {
		t.Fatalf("fence: %q %v", why, err)
	}
	refused("g", store.Fenced)
	if g := gate(); g != "-" {
		t.Fatalf("gate of a fenced activity: %q, want -", g)
	}
	if epoch, err := handle(c, k).Accept(ctx, 0); err != nil || epoch != 1 {
		t.Fatalf("accept: %d %v", epoch, err)
	}
	res, err := shardOf(c, k).GrabAbove(ctx, "g", store.Watermark{ClaimedCount: 6})
	if err != nil || res.Outcome != store.Granted || res.Seen != (store.Watermark{Epoch: 1, ClaimedCount: 7}) {
		t.Fatalf("grab after the accept: %+v %v, want granted at epoch 1, count 7", res, err)
	}
	grants["g"] = res
	if g := gate(); g != "1:" {
		t.Fatalf("gate after the accept: %q, want epoch 1", g)
	}
	if res, err := shardOf(c, k).GrabAbove(ctx, "h", store.Watermark{Epoch: 1, ClaimedCount: 8}); err != nil || res.Outcome != store.Fenced {
		t.Fatalf("grab above the count: %+v %v, want fenced", res, err)
	}
	refused("h", store.Fenced)
	if cr, err := handle(c, k).Configure(ctx, 0, 0, false, true); err != nil || !cr.Fenced {
		t.Fatalf("configure of a fenced activity: %+v %v", cr, err)
	}
	if _, err := handle(c, k).Accept(ctx, 1); err != nil {
		t.Fatal(err)
	}
	grant("h", 8)

	// Close: the cached gate is gone and the slow path answers.
	if cr, err := handle(c, k).Close(ctx, store.CloseExpired); err != nil || cr.Outcome != store.Closed {
		t.Fatalf("close: %+v %v", cr, err)
	}
	refused("i", store.Ended)
	if g := gate(); g != "-" {
		t.Fatalf("gate of a closed activity: %q, want -", g)
	}
	for u, g := range grants {
		if res := grabOne(t, c, k, u); res.Outcome != store.AlreadyClaimed || res.PacketID != g.PacketID || res.Amount != g.Amount {
			t.Fatalf("repeat by %s after close: %+v, want %+v", u, res, g)
		}
	}
	verify(t, ctx, c, k, amounts, grants)
}

// An activity written by the version that counted claims in the meta hash and had
// no gate: grabs go on where it left off, and the snapshot counts the claims hash,
// not the old field.
func TestGrabOnActivityWithoutGate(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeFixed, 500, 5)
	k := seedOpen(t, ctx, c, "gate-upgrade", amounts)
	first := grabOne(t, c, k, "before")
	// As the earlier script left it: no gate, a claimed_count field.
	if err := c.HDel(ctx, k.Meta, "gate").Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.HSet(ctx, k.Meta, "claimed_count", 1).Err(); err != nil {
		t.Fatal(err)
	}
	second := grabOne(t, c, k, "after")
	if second.Outcome != store.Granted || second.Seen.ClaimedCount != 2 {
		t.Fatalf("grab after the upgrade: %+v, want granted raising the count to 2", second)
	}
	snap := verify(t, ctx, c, k, amounts, map[string]store.GrabResult{"before": first, "after": second})
	if snap.ClaimedCount != 2 || snap.ClaimedAmount != 200 {
		t.Fatalf("snapshot %+v, want 2 claimed for 200", snap)
	}
}
