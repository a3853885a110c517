package store_test

import (
	"strconv"
	"strings"
	"testing"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// An activity seeded before packets carried their numbering ("<id>:<amount>", no
// "@<countBefore>:<amountBefore>") is still counted exactly: its grants raise the claimed_amount field,
// packets a transfer appends behind them are numbered on from the shard's total, and
// the snapshot and the close read whichever the head packet is. The snapshot's
// claimed amount equals what the claims hold at every step, and the refund is the
// rest of the total.
func TestUnnumberedPacketsAreStillCounted(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := []int64{10, 20, 30, 40, 50, 60}
	k := seedOpen(t, ctx, c, "unnumbered", amounts)
	listed, err := c.LRange(ctx, k.Packets, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	old := make([]any, len(listed))
	for i, p := range listed {
		body, _, numbered := strings.Cut(p, "@")
		if !numbered {
			t.Fatalf("seeded packet %q carries no numbering", p)
		}
		old[i] = body
	}
	if err := c.Del(ctx, k.Packets).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.RPush(ctx, k.Packets, old...).Err(); err != nil {
		t.Fatal(err)
	}

	claimed := int64(0)
	checkClaimed := func(when string) {
		t.Helper()
		snap, err := store.ReadSnapshot(ctx, c, k)
		if err != nil {
			t.Fatal(err)
		}
		claims, err := c.HGetAll(ctx, k.Claims).Result()
		if err != nil {
			t.Fatal(err)
		}
		var held int64
		for _, v := range claims {
			parts := strings.Split(v, ":")
			n, _ := strconv.ParseInt(parts[1], 10, 64)
			held += n
		}
		if snap.ClaimedAmount != held || held != claimed {
			t.Fatalf("%s: snapshot says %d claimed, claims hold %d, callers were granted %d", when, snap.ClaimedAmount, held, claimed)
		}
	}
	grab := func(user string) {
		t.Helper()
		g, err := store.Grab(ctx, c, k, user)
		if err != nil || g.Outcome != store.Granted {
			t.Fatalf("grab %s: %+v %v", user, g, err)
		}
		claimed += g.Amount
	}
	grab("u1")
	grab("u2")
	checkClaimed("two unnumbered grants")

	// A transfer appends two packets behind the unnumbered ones.
	if res, err := lua.TransferInScript.Run(ctx, c, []string{k.Meta, k.Packets, k.Applied},
		"t-1", 2, 150, "7:70", "8:80").Text(); err != nil || res != "applied" {
		t.Fatalf("transfer_in: %q %v", res, err)
	}
	tail, err := c.LRange(ctx, k.Packets, -2, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	// The shard held 6 packets of 210 before the transfer: 2 of them (30) claimed,
	// 4 (180) listed.
	if tail[0] != "7:70@6:210" || tail[1] != "8:80@7:280" {
		t.Fatalf("transferred packets listed as %q, want 7:70@6:210 and 8:80@7:280", tail)
	}
	checkClaimed("after the transfer")
	for i := 3; i <= 7; i++ {
		grab("u" + strconv.Itoa(i))
		checkClaimed("grant " + strconv.Itoa(i))
	}
	res, err := store.Close(ctx, c, k, store.CloseExpired)
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(360) - claimed; res.Refunded != want {
		t.Fatalf("refund %d, want %d (total 360, claimed %d)", res.Refunded, want, claimed)
	}
	checkClaimed("after the close")
}

// Grab reads the claimed count from the popped packet, not from the claims hash, so a
// claims hash lost on its own (the list kept) must be caught elsewhere: the view the
// reporter and the controller read says so, and a repeat grab of a user whose claim
// vanished is what it guards against.
func TestLostClaimsAreCaught(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	act := store.NewActivity(c, "lost-claims", 1)
	k := act.Shard(0).Keys()
	seedOpen(t, ctx, c, "lost-claims", []int64{10, 20, 30})
	if k != store.KeysFor("lost-claims") {
		t.Fatalf("one shard's keys %+v are not the activity's", k)
	}
	for _, u := range []string{"u1", "u2"} {
		if g, err := store.Grab(ctx, c, k, u); err != nil || g.Outcome != store.Granted {
			t.Fatalf("grab %s: %+v %v", u, g, err)
		}
	}
	v, err := act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if why := v.ClaimsLost(); why != "" {
		t.Fatalf("nothing lost, yet: %s", why)
	}
	if err := c.HDel(ctx, k.Claims, "u2").Err(); err != nil {
		t.Fatal(err)
	}
	v, err = act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	why := v.ClaimsLost()
	if !strings.Contains(why, "claims were lost") {
		t.Fatalf("a lost claim is not reported: %q", why)
	}
	if got := v.RolledBack(&redpacketv1alpha1.RedPacketActivityStatus{}); got != why {
		t.Fatalf("RolledBack says %q, want %q", got, why)
	}
}
