package store_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// usedMemory reads used_memory from INFO memory.
func usedMemory(tb testing.TB, ctx context.Context, c *redis.Client) int64 {
	tb.Helper()
	info, err := c.InfoMap(ctx, "memory").Result()
	if err != nil {
		tb.Fatalf("INFO memory: %v", err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(info["Memory"]["used_memory"]), 10, 64)
	if err != nil {
		tb.Fatalf("used_memory: %v", err)
	}
	return n
}

// keyMemory reads MEMORY USAGE of a key, counting every element.
func keyMemory(tb testing.TB, ctx context.Context, c *redis.Client, key string) int64 {
	tb.Helper()
	n, err := c.MemoryUsage(ctx, key, 0).Result()
	if err != nil {
		tb.Fatalf("MEMORY USAGE %s: %v", key, err)
	}
	return n
}

// BenchmarkSeed1M splits 1,000,000 packets and seeds them into a fresh activity on a
// real redis-server per iteration. Besides ns/op it reports the time of each half
// and the Redis memory per packet (INFO used_memory before and after). After the
// loop it grabs claimsToMeasure packets of the last activity and reports the
// memory each claim costs: its claims-hash field plus its stream entry.
func BenchmarkSeed1M(b *testing.B) {
	const count = 1_000_000
	const total = 200_000_000 // ¥2,000,000 in fen, about ¥2 a packet
	const claimsToMeasure = 50_000
	ctx := context.Background()
	srv := redistest.Start(b)
	c := srv.Client(b)
	if err := lua.LoadAll(ctx, c); err != nil {
		b.Fatal(err)
	}

	var splitTime, seedTime time.Duration
	var grew int64
	var k store.Keys
	i := 0
	for b.Loop() {
		i++
		b.StopTimer()
		before := usedMemory(b, ctx, c)
		uid := fmt.Sprintf("bench-seed-%d", i)
		b.StartTimer()

		t0 := time.Now()
		amounts, err := split.Split(split.Params{Type: split.TypeRandom, Total: total, Count: count, Min: 1,
			Seed: split.SeedFromUID(uid)})
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		k = keysOf(uid)
		res, err := seeding(c, k, store.Seeder{}).Seed(ctx, amounts, store.SeedParams{Count: count, Total: total, Sponsor: sponsor})
		if err != nil || !res.Committed {
			b.Fatalf("seed: %+v, %v", res, err)
		}
		splitTime += t1.Sub(t0)
		seedTime += time.Since(t1)

		b.StopTimer()
		grew += usedMemory(b, ctx, c) - before
		b.StartTimer()
	}
	b.StopTimer()
	n := int64(b.N)
	b.ReportMetric(float64(splitTime.Milliseconds())/float64(n), "split-ms/op")
	b.ReportMetric(float64(seedTime.Milliseconds())/float64(n), "seed-ms/op")
	b.ReportMetric(float64(grew)/float64(n*count), "bytes/packet")
	b.ReportMetric(float64(keyMemory(b, ctx, c, k.Packets))/count, "list-bytes/packet")

	// Claims: grab from the last activity through an auto-pipeliner.
	if _, err := handle(c, k).Configure(ctx, 0, 0, false, true); err != nil {
		b.Fatal(err)
	}
	ap, err := c.AutoPipelineWithOptions(redisconn.GrabPipelineOptions())
	if err != nil {
		b.Fatal(err)
	}
	before := usedMemory(b, ctx, c)
	t0 := time.Now()
	answers, err := grabAll(ctx, ap, k, userIDs("user-", claimsToMeasure), 200)
	if err != nil {
		b.Fatal(err)
	}
	grabTime := time.Since(t0)
	counts, _ := tally(b, answers)
	if counts[store.Granted] != claimsToMeasure {
		b.Fatalf("outcomes %v, want %d granted", counts, claimsToMeasure)
	}
	after := usedMemory(b, ctx, c)
	claimsBytes := keyMemory(b, ctx, c, k.Claims) + keyMemory(b, ctx, c, k.Stream)
	b.ReportMetric(float64(claimsBytes)/claimsToMeasure, "claim+stream-bytes/claim")
	b.ReportMetric(float64(after-before)/claimsToMeasure, "net-bytes/claim")
	b.ReportMetric(float64(claimsToMeasure)/grabTime.Seconds(), "grabs/s")
}
