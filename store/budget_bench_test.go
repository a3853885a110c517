package store_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// benchBudget is a budget of 16 shards, big enough for any run, on a fresh server,
// and the grab fleet's handle of it on the grab service's auto-pipeliner.
func benchBudget(b *testing.B, uid string) *store.Budget {
	ctx := context.Background()
	c := redistest.Start(b).Client(b)
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 20_000, MaxCount: 100, MinShare: 1,
		Distributions: []string{split.TypeRandom}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
	if err := store.NewBudget(c, uid, 16).Configure(ctx, 1<<50, limits); err != nil {
		b.Fatal(err)
	}
	ap, err := c.AutoPipelineWithOptions(redisconn.GrabPipelineOptions())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = ap.Close() })
	return store.NewBudget(ap, uid, 16)
}

// BenchmarkCreatePacket creates 5-share packets of ¥20 from many goroutines through
// the auto-pipeliner: the store's share of POST /v1/packets.
func BenchmarkCreatePacket(b *testing.B) {
	budget := benchBudget(b, "bench-create")
	ctx := context.Background()
	var n atomic.Int64
	b.SetParallelism(32)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			id := fmt.Sprintf("order-%d", n.Add(1))
			r, err := budget.Create(ctx, store.NewPacket{ID: id, Sender: "m", Total: 2000, Count: 5, Distribution: split.TypeRandom})
			if err != nil || r.Outcome != store.CreateCreated {
				b.Fatalf("create %s: %+v, %v", id, r, err)
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "packets/s")
}

// BenchmarkGrabPacket grabs 5-share packets from many goroutines through the
// auto-pipeliner, 10 users a packet (5 granted, 5 sold out): the store's share of
// POST /v1/packets/{id}/grab.
func BenchmarkGrabPacket(b *testing.B) {
	budget := benchBudget(b, "bench-grab")
	ctx := context.Background()
	const usersPerPacket = 10
	packets := b.N/usersPerPacket + 1
	for p := range packets {
		if _, err := budget.Create(ctx, store.NewPacket{ID: fmt.Sprintf("p%d", p), Sender: "m", Total: 2000, Count: 5,
			Distribution: split.TypeRandom}); err != nil {
			b.Fatal(err)
		}
	}
	var n atomic.Int64
	b.SetParallelism(32)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			a := int(n.Add(1)) - 1
			g, err := budget.GrabPacket(ctx, fmt.Sprintf("p%d", a/usersPerPacket), fmt.Sprintf("u%d", a%usersPerPacket))
			if err != nil || g.Outcome != store.PacketGranted && g.Outcome != store.PacketSoldOut {
				b.Fatalf("grab %d: %+v, %v", a, g, err)
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "grabs/s")
}
