package store_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// 100,000 packets due in the same second on one server, partly grabbed, expired
// by ExpireDue in batches: every refund is exact (the sum of the refund entries is
// the sum of the remainders, packet by packet), and a batch costs well under 5 ms by
// SLOWLOG. Half of the shards are expired with SLOWLOG's threshold at 5 ms, the
// other half at 0 (it logs every command: the median, p99 and slowest are reported).
func TestExpiryBurst(t *testing.T) {
	// The packets are due lead ahead, then expire: longer than redistest.Context.
	ctx, cancel := context.WithTimeout(t.Context(), 6*time.Minute)
	t.Cleanup(cancel)
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: srv.Username, Password: srv.Password, PoolSize: 64})
	t.Cleanup(func() { _ = c.Close() })
	const (
		packets = 100_000
		shards  = 16
		// lead is how far ahead the packets are due: creation and grabs must end
		// within it. They take 10 to 30 s on a quiet 2-core machine and have taken
		// over 60 s on a loaded one; the wait is idle time the other packages' tests
		// use.
		lead = 150 * time.Second
	)
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 1000, MaxCount: 5, MinShare: 1,
		Distributions: []string{split.TypeRandom}, DefaultTTL: lead, MaxTTL: 2 * lead}
	b := configuredBudget(t, ctx, c, "expiry-burst", shards, packets*1000, limits)
	start := time.Now()
	// Every packet expires at the same whole second, by the Redis clock.
	now, err := c.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	// The server runs on this machine's clock; each packet's time to live aims 100 ms
	// into the second, so that the latency of its creation keeps it in that second.
	due := now.Add(lead).Truncate(time.Second).Add(time.Second)
	id := func(p int) string { return fmt.Sprintf("burst-%06d", p) }
	totalOf := func(p int) int64 { return 5 + int64(p%996) }

	// Create every packet, and grab p%4 shares of packet p.
	remainders := make([]int64, packets)
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for range 32 {
		wg.Go(func() {
			for {
				p := int(next.Add(1)) - 1
				if p >= packets {
					return
				}
				ttl := time.Until(due.Add(100 * time.Millisecond)).Truncate(time.Millisecond)
				r, err := b.Create(ctx, store.NewPacket{ID: id(p), Sender: "sharer", Total: totalOf(p), Count: 5,
					Distribution: split.TypeRandom, TTL: ttl})
				if err == nil && r.Outcome != store.CreateCreated {
					err = fmt.Errorf("packet %d: %s (%s)", p, r.Outcome, r.Reason)
				}
				rem := totalOf(p)
				for u := 0; err == nil && u < p%4; u++ {
					var g store.PacketGrab
					g, err = b.GrabPacket(ctx, id(p), fmt.Sprintf("u%d", u))
					if err == nil && g.Outcome != store.PacketGranted {
						err = fmt.Errorf("packet %d: grab %d: %s", p, u, g.Outcome)
					}
					rem -= g.Amount
				}
				if err != nil {
					errs <- err
					return
				}
				remainders[p] = rem
			}
		})
	}
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	ready := time.Since(start)
	if ready > lead {
		t.Fatalf("creating and grabbing took %v, beyond the lead of %v: the packets are not due at once", ready, lead)
	}
	var due0, due1 int64
	for i := range shards {
		k := b.ShardKeys(i)
		n0, _ := c.ZCount(ctx, k.Due, "-inf", fmt.Sprint(due.UnixMilli()-1)).Result()
		n1, _ := c.ZCount(ctx, k.Due, fmt.Sprint(due.UnixMilli()+1000), "+inf").Result()
		due0 += n0
		due1 += n1
	}
	if due0 != 0 || due1 != 0 {
		t.Fatalf("%d packets due before the second and %d after it", due0, due1)
	}
	time.Sleep(time.Until(due) + 1200*time.Millisecond)

	// The expiry.
	slowlog := func(threshold string) {
		t.Helper()
		for _, kv := range [][2]string{{"slowlog-log-slower-than", threshold}, {"slowlog-max-len", "100000"}} {
			if err := c.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Do(ctx, "SLOWLOG", "RESET").Err(); err != nil {
			t.Fatal(err)
		}
	}
	expireShards := func(from, to int) (int, int64, int) {
		n, refunded, calls := 0, int64(0), 0
		for i := from; i < to; i++ {
			for {
				got, r, err := b.ExpireDue(ctx, i, store.DefaultExpireBatch)
				if err != nil {
					t.Fatal(err)
				}
				calls++
				n += got
				refunded += r
				if got == 0 {
					break
				}
			}
		}
		return n, refunded, calls
	}
	expiryStart := time.Now()
	slowlog("5000")
	n1, r1, calls1 := expireShards(0, shards/2)
	slowAt5, err := c.SlowLogGet(ctx, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	slowlog("0")
	n2, r2, calls2 := expireShards(shards/2, shards)
	expiry := time.Since(expiryStart)
	slow, err := c.SlowLogGet(ctx, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	slowlog("10000")
	var slowest redis.SlowLog
	var scriptTimes []time.Duration
	over := 0
	for _, e := range slow {
		if len(e.Args) > 0 && strings.EqualFold(e.Args[0], "evalsha") {
			scriptTimes = append(scriptTimes, e.Duration)
		}
		if e.Duration > slowest.Duration {
			slowest = e
		}
		if e.Duration >= 5*time.Millisecond {
			over++
		}
	}
	slices.Sort(scriptTimes)
	if len(scriptTimes) == 0 {
		t.Fatal("SLOWLOG at 0 logged no expiry call")
	}
	median, p99 := scriptTimes[len(scriptTimes)/2], scriptTimes[len(scriptTimes)*99/100]
	// The SLOWLOG checks come last, after the refunds are checked and the figures
	// logged (below). What is checked is what a batch costs, as the script's own
	// distribution shows it: the median and the 99th percentile of the expiry calls
	// under 5 ms, and at most one call in a hundred over it. A command over 5 ms
	// here and there is the machine descheduling redis-server while the test binary
	// and other test packages share its two cores, not the batch's work (a quiet run
	// logs none: the figures of a quiet run are in docs/benchmarks.md).
	defer func() {
		if median >= 5*time.Millisecond || p99 >= 5*time.Millisecond {
			t.Errorf("expiry calls: median %v, p99 %v; a batch of %d must cost well under 5 ms", median, p99, store.DefaultExpireBatch)
		}
		if limit := calls1/100 + 1; len(slowAt5) > limit {
			var took []string
			for _, e := range slowAt5 {
				took = append(took, fmt.Sprintf("%s %v", e.Args[0], e.Duration))
			}
			t.Errorf("SLOWLOG at 5 ms holds %d entries over %d calls (at most %d): %v", len(slowAt5), calls1, limit, took)
		}
		if limit := len(slow)/100 + 1; over > limit {
			t.Errorf("SLOWLOG at 0: %d of %d commands took 5 ms or more (at most %d), the slowest %v taking %v", over, len(slow), limit, slowest.Args, slowest.Duration)
		}
	}()

	if n1+n2 != packets {
		t.Fatalf("expired %d packets, want %d", n1+n2, packets)
	}
	// Every refund exact: one entry per packet with a remainder, of that remainder.
	var want int64
	refunds := map[string]int64{}
	for i := range shards {
		entries, err := b.Stream(i).Entries(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if e.Malformed != nil {
				t.Fatalf("malformed entry %+v", e)
			}
			if e.Kind != store.KindRefund {
				continue
			}
			pid, ok := strings.CutSuffix(e.PacketID, "/refund")
			if _, dup := refunds[pid]; !ok || dup || e.UserID != "sharer" {
				t.Fatalf("refund entry %+v: not a packet's one refund to its sender", e)
			}
			refunds[pid] = e.Amount
		}
	}
	var sum int64
	for p, rem := range remainders {
		want += rem
		if refunds[id(p)] != rem {
			t.Fatalf("packet %d refunded %d, its remainder is %d", p, refunds[id(p)], rem)
		}
		sum += refunds[id(p)]
	}
	if len(refunds) != packets || sum != want || r1+r2 != want {
		t.Fatalf("%d refunds summing to %d (ExpireDue said %d), want %d summing to %d", len(refunds), sum, r1+r2, packets, want)
	}
	s := conserved(t, ctx, b)
	if s.Live != 0 || s.LivePackets != 0 || s.ExpiredPackets != packets || s.Refunded != want {
		t.Fatalf("after the burst: %+v", s)
	}
	t.Logf("%d packets created and partly grabbed in %v; expired in %v by %d calls of at most %d; refunded %d exactly; "+
		"SLOWLOG at 5 ms: %d entries over %d packets; at 0 over %d packets: expiry call median %v µs, p99 %v µs, slowest command %v µs (%s)",
		packets, ready.Round(time.Millisecond), expiry.Round(time.Millisecond), calls1+calls2, store.DefaultExpireBatch, want,
		len(slowAt5), n1, n2, median.Microseconds(), p99.Microseconds(), slowest.Duration.Microseconds(), strings.Join(slowest.Args[:min(2, len(slowest.Args))], " "))
}
