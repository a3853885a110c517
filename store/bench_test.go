package store_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
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

// evalshaStats reads the server's EVALSHA calls and their total time in µs (INFO
// commandstats).
func evalshaStats(tb testing.TB, ctx context.Context, c *redis.Client) (calls, usec int64) {
	tb.Helper()
	info, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		tb.Fatalf("INFO commandstats: %v", err)
	}
	for _, line := range strings.Split(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_evalsha:")
		if !ok {
			continue
		}
		for _, f := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(f, "=")
			n, _ := strconv.ParseInt(v, 10, 64)
			switch k {
			case "calls":
				calls = n
			case "usec":
				usec = n
			}
		}
	}
	return calls, usec
}

// BenchmarkGrabTransferMark measures what the transfer mark adds to a grant on the
// gate's path, on one shard of a sharded activity that took a transfer: rounds of
// 1,000 grants with the claims watermark alone and 1,000 with the transfer mark too
// (grab.lua's ARGV[4]: one HGET of transfer_seq), alternating on the same server so
// that a busy machine weighs on both alike. It reports the server's own time per
// grab script (INFO commandstats, EVALSHA), the median over the rounds of each, and
// their ratio.
func BenchmarkGrabTransferMark(b *testing.B) {
	ctx := context.Background()
	c := redistest.Start(b).Client(b)
	if err := lua.LoadAll(ctx, c); err != nil {
		b.Fatal(err)
	}
	const rounds, perRound = 20, 1000
	var without, with []float64
	run := 0
	for b.Loop() {
		b.StopTimer()
		run++
		act, marks := openMarkedPair(b, c, fmt.Sprintf("bench-mark-%d", run), 2*(2*rounds*perRound+2))
		if moved, err := act.Transfer(ctx, 1, 0, 1); err != nil || moved != 1 {
			b.Fatalf("transfer: %d, %v", moved, err)
		}
		sh := act.Shard(0)
		if r, err := sh.Grab(ctx, "first"); err != nil || r.Outcome != store.Granted {
			b.Fatalf("first grab: %+v, %v", r, err)
		}
		claimsOnly := store.Watermark{ClaimedCount: 1}
		withSeq := store.Watermark{ClaimedCount: 1, TransferSeq: marks.Mark(0).TransferSeq}
		if withSeq.TransferSeq == 0 {
			b.Fatal("no transfer mark")
		}
		b.StartTimer()
		u := 0
		for range rounds {
			for _, mark := range []store.Watermark{claimsOnly, withSeq} {
				calls0, usec0 := evalshaStats(b, ctx, c)
				for range perRound {
					u++
					r, err := sh.GrabAbove(ctx, "u-"+strconv.Itoa(u), mark)
					if err != nil || r.Outcome != store.Granted {
						b.Fatalf("grab %d: %+v, %v", u, r, err)
					}
				}
				calls1, usec1 := evalshaStats(b, ctx, c)
				per := float64(usec1-usec0) / float64(calls1-calls0)
				if mark.TransferSeq == 0 {
					without = append(without, per)
				} else {
					with = append(with, per)
				}
			}
		}
	}
	median := func(v []float64) float64 {
		v = append([]float64(nil), v...)
		slices.Sort(v)
		return v[len(v)/2]
	}
	b.ReportMetric(median(without), "claims-µs/grab")
	b.ReportMetric(median(with), "claims+transfer-µs/grab")
	b.ReportMetric(median(with)/median(without), "ratio")
}

// commandUsec reads the total time in µs the server spent in each of the named
// commands (INFO commandstats), summed.
func commandUsec(tb testing.TB, ctx context.Context, c *redis.Client, names ...string) int64 {
	tb.Helper()
	info, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		tb.Fatalf("INFO commandstats: %v", err)
	}
	var usec int64
	for _, line := range strings.Split(info, "\n") {
		for _, name := range names {
			rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_"+name+":")
			if !ok {
				continue
			}
			for _, f := range strings.Split(rest, ",") {
				if k, v, _ := strings.Cut(f, "="); k == "usec" {
					n, _ := strconv.ParseInt(v, 10, 64)
					usec += n
				}
			}
		}
	}
	return usec
}

// BenchmarkGrabRecordedMark measures what reading the siblings' transfer marks
// (Activity.RecordedMark) adds to a grant of a sharded activity: rounds of 1000
// grants through Activity.Grab (the read, then the grab script) alternate, on the
// same activity of 2 shards, with rounds through the home shard's GrabAbove with the
// same mark (the grab script alone: Activity.Grab before the read). Each is
// measured sequentially on a plain client (wall µs per grant, one round trip or
// two) and as server time (µs per grant in FCALL and HGET), and 32 concurrent
// callers through the grab service's auto-pipeliner measure grants per second.
// Medians of the rounds, and each ratio after/before.
func BenchmarkGrabRecordedMark(b *testing.B) {
	ctx := context.Background()
	c := redistest.Start(b).Client(b)
	if err := lua.LoadAll(ctx, c); err != nil {
		b.Fatal(err)
	}
	ap, err := c.AutoPipelineWithOptions(redisconn.GrabPipelineOptions())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = ap.Close() })
	const rounds, perRound, workers = 10, 1000, 32
	// Users at home on shard 0: a sequential and a concurrent round of each kind per
	// round.
	users := usersOn("bench-u", 0, 2, 4*rounds*perRound)
	var wallBefore, wallAfter, srvBefore, srvAfter, rateBefore, rateAfter []float64
	run := 0
	for b.Loop() {
		b.StopTimer()
		run++
		uid := fmt.Sprintf("bench-recorded-%d", run)
		act, marks := openMarkedPair(b, c, uid, 2*(len(users)+2))
		// A transfer out of shard 0: shard 1 keeps shard 0's mark, which every grab on
		// shard 0 reads.
		if moved, err := act.Transfer(ctx, 0, 1, 1); err != nil || moved != 1 {
			b.Fatalf("transfer: %d, %v", moved, err)
		}
		if w, err := act.RecordedMark(ctx, 0); err != nil || w.TransferSeq == 0 {
			b.Fatalf("recorded mark of shard 0: %+v, %v", w, err)
		}
		piped := store.NewActivity(ap, uid, 2)
		sh, pipedShard := act.Shard(0), piped.Shard(0)
		grab := func(a *store.Activity, shard *store.Shard, after bool, u string) {
			var r store.GrabResult
			var err error
			if after {
				r, _, err = a.Grab(ctx, u, marks.Mark)
			} else {
				r, err = shard.GrabAbove(ctx, u, marks.Mark(0))
			}
			if err != nil || r.Outcome != store.Granted {
				b.Fatalf("grab of %s: %+v, %v", u, r, err)
			}
		}
		b.StartTimer()
		next := 0
		for range rounds {
			for _, after := range []bool{false, true} {
				batch := users[next : next+perRound]
				next += perRound
				usec0 := commandUsec(b, ctx, c, "fcall", "hget")
				t0 := time.Now()
				for _, u := range batch {
					grab(act, sh, after, u)
				}
				wall := float64(time.Since(t0).Microseconds()) / perRound
				srv := float64(commandUsec(b, ctx, c, "fcall", "hget")-usec0) / perRound

				batch = users[next : next+perRound]
				next += perRound
				t0 = time.Now()
				var wg sync.WaitGroup
				for w := range workers {
					wg.Go(func() {
						for i := w; i < len(batch); i += workers {
							grab(piped, pipedShard, after, batch[i])
						}
					})
				}
				wg.Wait()
				rate := perRound / time.Since(t0).Seconds()
				if after {
					wallAfter, srvAfter, rateAfter = append(wallAfter, wall), append(srvAfter, srv), append(rateAfter, rate)
				} else {
					wallBefore, srvBefore, rateBefore = append(wallBefore, wall), append(srvBefore, srv), append(rateBefore, rate)
				}
			}
		}
	}
	median := func(v []float64) float64 {
		v = append([]float64(nil), v...)
		slices.Sort(v)
		return v[len(v)/2]
	}
	b.ReportMetric(median(wallBefore), "before-wall-µs/grab")
	b.ReportMetric(median(wallAfter), "after-wall-µs/grab")
	b.ReportMetric(median(wallAfter)/median(wallBefore), "wall-ratio")
	b.ReportMetric(median(srvBefore), "before-server-µs/grab")
	b.ReportMetric(median(srvAfter), "after-server-µs/grab")
	b.ReportMetric(median(srvAfter)/median(srvBefore), "server-ratio")
	b.ReportMetric(median(rateBefore), "before-grabs/s")
	b.ReportMetric(median(rateAfter), "after-grabs/s")
	b.ReportMetric(median(rateAfter)/median(rateBefore), "rate-ratio")
}

// openMarkedPair seeds an activity uid over two shards with n packets of 100, opens
// it and gives it a marksKept, which it returns with it.
func openMarkedPair(b *testing.B, c redis.Cmdable, uid string, n int) (*store.Activity, *marksKept) {
	b.Helper()
	ctx := context.Background()
	act := store.NewActivity(c, uid, 2)
	amounts := make([]int64, n)
	for i := range amounts {
		amounts[i] = 100
	}
	p := store.SeedParams{Count: int64(n), Total: sum(amounts), Sponsor: sponsor, Currency: "CNY"}
	if _, err := act.Seed(ctx, amounts, p); err != nil {
		b.Fatal(err)
	}
	if _, err := act.ConfigureWith(ctx, store.Settings{Open: true}); err != nil {
		b.Fatal(err)
	}
	marks := &marksKept{}
	act.Marks = marks
	return act, marks
}
