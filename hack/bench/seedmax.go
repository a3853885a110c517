package main

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
)

// seedMaxRun is an activity at the CRD's limits: 10,000,000 packets split and seeded
// as the controller does it.
type seedMaxRun struct {
	count           int64
	split, seed     time.Duration
	bytesPerPacket  float64
	totalAmountSeen int64
}

// measureSeedMax splits count packets (Random, the default) and seeds them into one
// activity, timing both, then reads the memory they take and purges them.
func measureSeedMax(ctx context.Context, rc redis.UniversalClient, count int64) (seedMaxRun, error) {
	r := seedMaxRun{count: count}
	const uid = "bench-seed-max"
	total := count * 200 // about ¥2 a packet, in fen
	before, err := usedMemory(ctx, rc)
	if err != nil {
		return r, err
	}
	start := time.Now()
	amounts, err := split.Split(split.Params{Type: split.TypeRandom, Total: total, Count: count, Min: 1, Seed: split.SeedFromUID(uid)})
	if err != nil {
		return r, fmt.Errorf("splitting %d packets: %w", count, err)
	}
	r.split = time.Since(start)
	a := store.NewActivity(rc, uid, 1)
	res, err := a.Seed(ctx, amounts, store.SeedParams{Count: count, Total: total, Sponsor: "bench"})
	if err != nil || !res.Committed {
		return r, fmt.Errorf("seeding %d packets: committed %v, %v", count, res.Committed, err)
	}
	r.seed = time.Since(start) - r.split
	after, err := usedMemory(ctx, rc)
	if err != nil {
		return r, err
	}
	r.bytesPerPacket = float64(after-before) / float64(count)
	snap, err := a.Snapshot(ctx)
	if err != nil {
		return r, err
	}
	if snap.RemainingCount != count || snap.Total != total {
		return r, fmt.Errorf("after seeding: %d packets of %d, want %d of %d", snap.RemainingCount, snap.Total, count, total)
	}
	r.totalAmountSeen = snap.Total
	return r, a.Purge(ctx)
}

func (r seedMaxRun) took() time.Duration { return r.split + r.seed }

func (r seedMaxRun) summary() string {
	return fmt.Sprintf("(k) split and seed %d packets: %s (split %s, seed %s; goal < 5s), %.1f bytes per seeded packet\n",
		r.count, r.took().Round(time.Millisecond), r.split.Round(time.Millisecond), r.seed.Round(time.Millisecond), r.bytesPerPacket)
}

func (r seedMaxRun) markdown() string {
	return fmt.Sprintf(`## An activity at the CRD's limit

Splitting (Random, the default) and seeding %d packets, the largest count the CRD allows,
as the controller does it (chunks of 10,000 staged in optimistic transactions, then one
commit): **%s** (split %s, seed %s; goal < 5 s). The seeded list takes %.1f bytes per
packet (used_memory before and after).

`, r.count, r.took().Round(time.Millisecond), r.split.Round(time.Millisecond), r.seed.Round(time.Millisecond), r.bytesPerPacket)
}
