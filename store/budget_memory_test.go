package store_test

import (
	"fmt"
	"testing"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// Redis memory per live 5-share packet, its due entry included, and per claimed
// share (the claim in the packet hash and the grant's stream entry), against an
// activity's per claimed packet on the same server. A live 5-share packet must take
// at most 1 KiB, and a claimed share no more than an activity's claim.
func TestBudgetMemory(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const packets = 10_000
	limits := testLimits()
	b := configuredBudget(t, ctx, c, "9a0c5e2b-6a8f-4a57-9d0e-3f1b2c4d5e6f", 16, packets*20_000, limits)
	// Ids and users the size of real ones: an 18-digit order id, a 12-char user id.
	id := func(p int) string { return fmt.Sprintf("%018d", 202612310000000000+p) }
	before := usedMemory(t, ctx, c)
	for p := range packets {
		createOrFail(t, ctx, b, store.NewPacket{ID: id(p), Sender: "merchant-001", Total: 100 + int64(p%19_900), Count: 5,
			Distribution: split.TypeRandom}, store.CreateCreated)
	}
	created := usedMemory(t, ctx, c)
	perPacket := float64(created-before) / packets
	k := b.ShardKeys(b.ShardOf(id(0)))
	hashUsage, err := c.MemoryUsage(ctx, k.Packet(id(0))).Result()
	if err != nil {
		t.Fatal(err)
	}
	encoding, _ := c.ObjectEncoding(ctx, k.Packet(id(0))).Result()
	dueUsage, _ := c.MemoryUsage(ctx, k.Due).Result()
	dueLen, _ := c.ZCard(ctx, k.Due).Result()

	// Every share of every packet claimed.
	for p := range packets {
		for u := range 5 {
			grabOrFail(t, ctx, b, id(p), fmt.Sprintf("wx-user-%04d", (p+u)%10_000), store.PacketGranted)
		}
	}
	claimed := usedMemory(t, ctx, c)
	perShare := float64(claimed-created) / (packets * 5)
	claimedUsage, _ := c.MemoryUsage(ctx, k.Packet(id(0))).Result()

	// An activity of as many packets, all claimed by users of the same ids.
	amounts := splitOrFail(t, split.TypeRandom, packets*5*1000, packets*5)
	activityBefore := usedMemory(t, ctx, c)
	ak := seedOpen(t, ctx, c, "0b1c2d3e-4f50-4617-8829-3a4b5c6d7e8f", amounts)
	seeded := usedMemory(t, ctx, c)
	shard := shardOf(c, ak)
	for u := range len(amounts) {
		r, err := shard.Grab(ctx, fmt.Sprintf("wx-user-%05d", u))
		if err != nil || r.Outcome != store.Granted {
			t.Fatalf("activity grab %d: %+v, %v", u, r, err)
		}
	}
	activityClaimed := usedMemory(t, ctx, c)
	perActivityPacket := float64(seeded-activityBefore) / float64(len(amounts))
	perActivityClaim := float64(activityClaimed-activityBefore) / float64(len(amounts))

	t.Logf("live 5-share packet: %.0f B of used_memory each over %d (packet hash %d B, %s; due index %d B for %d packets)",
		perPacket, packets, hashUsage, encoding, dueUsage, dueLen)
	t.Logf("claimed share: %.0f B each over %d (a fully claimed packet hash: %d B); activity: %.0f B per listed packet, %.0f B per claimed packet (listed, then claimed, all in)",
		perShare, packets*5, claimedUsage, perActivityPacket, perActivityClaim)
	if perPacket > 1024 {
		t.Fatalf("a live 5-share packet takes %.0f B, more than 1 KiB", perPacket)
	}
	if encoding != "listpack" {
		t.Fatalf("a 5-share packet's hash is a %s, want a listpack", encoding)
	}
	// A share's claim against an activity's: the activity's claim replaces a listed
	// packet, the budget's share was written at creation, so the claim costs what it
	// adds on top.
	if perShare > perActivityClaim {
		t.Fatalf("a claimed share takes %.0f B, an activity's claimed packet %.0f B", perShare, perActivityClaim)
	}
}
