package grabsvc

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// quotaBenchLimits are quotas no benchmark sender or recipient reaches: every rule
// is counted, none refuses.
var quotaBenchLimits = store.Quotas{PacketsPerMinute: 1_000_000, PacketsPerDay: 1_000_000_000,
	AmountPerDay: 1_000_000_000_000_000, SharesPerDay: 1_000_000}

// BenchmarkPacketQuotas measures what the quotas cost the create path, and their
// memory. One budget (QUOTA_BENCH_SHARDS budget shards, 16 by default) on a real
// redis-server has two packet servers over HTTP, one with every quota on
// (quotaBenchLimits) and one with none; each iteration creates 2,000 packets of 5
// shares through each, in turn, from 64 keep-alive clients, for 1,000 senders (so
// with N shards, all but one in N of the packets land off their sender's home
// shard: counted in the same call on one server, or taken there first with
// QUOTA_BENCH_TWO_STEP=1, as on a cluster).
// It reports created/s with quotas on and off and their ratio, then the Redis bytes
// of quota state per sender (10,000 senders each creating one packet: MEMORY USAGE
// of the day's hashes of senders) and per recipient (10,000 users each granted
// one share: the day's hash of recipients).
func BenchmarkPacketQuotas(b *testing.B) {
	shards := 16
	if v, err := strconv.Atoi(os.Getenv("QUOTA_BENCH_SHARDS")); err == nil && v > 0 {
		shards = v
	}
	// The servers count each quota in one step on the one server (PacketConfig.
	// OneServer), as a budget on a standalone Redis does; QUOTA_BENCH_TWO_STEP=1
	// makes them take and give back as on a cluster.
	oneServer := os.Getenv("QUOTA_BENCH_TWO_STEP") != "1"
	h := newPacketHarness(b, 1_000_000_000_000, shards)
	servers := map[bool]*httptest.Server{}
	for _, on := range []bool{false, true} {
		rc, err := h.redis.Conn().NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = rc.Close() })
		sender, _ := NewSenderCredential([]byte(senderSecret))
		cfg := PacketConfig{Budget: h.budget, Redis: rc.Pipeliner, Ping: rc.Client, Sender: sender,
			RedisTimeout: 2 * time.Second, Metrics: NewPacketMetrics(prometheus.NewRegistry()), OneServer: oneServer}
		if on {
			cfg.Quotas = quotaBenchLimits
		}
		srv, err := NewPacketServer(cfg)
		if err != nil {
			b.Fatal(err)
		}
		hs := httptest.NewServer(srv.Handler())
		b.Cleanup(hs.Close)
		servers[on] = hs
	}
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 128}}
	var next atomic.Int64
	// load creates n packets through base from 64 clients, sender i%senders, and
	// returns the time it took.
	load := func(base string, n, senders int64) time.Duration {
		var wg sync.WaitGroup
		var done atomic.Int64
		start := time.Now()
		for range 64 {
			wg.Go(func() {
				for done.Add(1) <= n {
					i := next.Add(1)
					body := `{"id":"q-` + strconv.FormatInt(i, 10) + `","sender":"merchant-` + strconv.FormatInt(i%senders, 10) +
						`","totalAmount":500,"count":5,"distribution":"Fixed"}`
					if !createForBench(b, c, base, body) {
						return
					}
				}
			})
		}
		wg.Wait()
		return time.Since(start)
	}
	const perRound = 2_000
	// A warm-up of each, so that connections and the function library are ready.
	load(servers[false].URL, 200, 1000)
	load(servers[true].URL, 200, 1000)
	var on, off time.Duration
	b.ResetTimer()
	for i := range b.N {
		// Alternate which goes first, so neither always runs on a warmer server.
		if i%2 == 0 {
			off += load(servers[false].URL, perRound, 1000)
			on += load(servers[true].URL, perRound, 1000)
		} else {
			on += load(servers[true].URL, perRound, 1000)
			off += load(servers[false].URL, perRound, 1000)
		}
	}
	b.StopTimer()
	rateOn := float64(perRound*b.N) / on.Seconds()
	rateOff := float64(perRound*b.N) / off.Seconds()
	b.ReportMetric(rateOn, "created/s-quotas-on")
	b.ReportMetric(rateOff, "created/s-quotas-off")
	b.ReportMetric(rateOn/rateOff, "ratio-on/off")

	// Memory: 10,000 new senders and 10,000 new recipients on a fresh day's keys.
	ctx := context.Background()
	const people = 10_000
	if err := h.admin.FlushAll(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	if err := h.handle.Configure(ctx, 1_000_000_000_000, packetLimits()); err != nil {
		b.Fatal(err)
	}
	next.Store(0)
	load(servers[true].URL, people, people)
	perSender := float64(quotaKeyBytes(b, h.admin, "qd")) / people
	// 1,000 packets of 10 shares, each share granted to a new user.
	for p := range people / 10 {
		if _, o, err := h.handle.CreatePacket(ctx, store.NewPacket{ID: "r-" + strconv.Itoa(p), Sender: "m", Total: 10, Count: 10,
			Distribution: "Fixed"}); err != nil || o != store.CreateCreated {
			b.Fatalf("creating r-%d: %s, %v", p, o, err)
		}
	}
	if oneServer {
		h.handle.OnOneServer()
	}
	quota := &store.QuotaCheck{Limits: quotaBenchLimits, At: h.handle.QuotaTimeAt(time.Now(), time.UTC)}
	var wg sync.WaitGroup
	for w := range 32 {
		wg.Go(func() {
			for u := w; u < people; u += 32 {
				g, err := h.handle.GrabPacketWithin(ctx, "r-"+strconv.Itoa(u/10), "user-"+strconv.Itoa(u), quota)
				if err != nil || g.Outcome != store.PacketGranted {
					b.Errorf("grab by user-%d: %+v, %v", u, g, err)
					return
				}
			}
		})
	}
	wg.Wait()
	perRecipient := float64(quotaKeyBytes(b, h.admin, "qr")) / people
	b.ReportMetric(perSender, "B/sender")
	b.ReportMetric(perRecipient, "B/recipient")
	b.Logf("%d shards, one step on one server %v: %.0f created/s with quotas, %.0f without, ratio %.2f; %.0f B per sender, %.0f B per recipient",
		shards, oneServer, rateOn, rateOff, rateOn/rateOff, perSender, perRecipient)
}

// quotaKeyBytes is the MEMORY USAGE (every element counted) of every quota key of
// one kind (qd, qm or qr) on the server.
func quotaKeyBytes(b *testing.B, c *redis.Client, kind string) int64 {
	b.Helper()
	ctx := context.Background()
	keys, err := c.Keys(ctx, "rpb:*:"+kind+":*").Result()
	if err != nil {
		b.Fatal(err)
	}
	if len(keys) == 0 {
		b.Fatalf("no %s keys", kind)
	}
	var sum int64
	for _, k := range keys {
		n, err := c.MemoryUsage(ctx, k, 0).Result()
		if err != nil {
			b.Fatal(fmt.Errorf("MEMORY USAGE %s: %w", k, err))
		}
		sum += n
	}
	return sum
}
