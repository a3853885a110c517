package store_test

import (
	"strings"
	"testing"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

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
	if k != keysOf("lost-claims") {
		t.Fatalf("one shard's keys %+v are not the activity's", k)
	}
	for _, u := range []string{"u1", "u2"} {
		if g, err := shardOf(c, k).Grab(ctx, u); err != nil || g.Outcome != store.Granted {
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
