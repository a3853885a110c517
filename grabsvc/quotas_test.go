package grabsvc

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"

	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// quotaClock is a service clock the test sets, in Asia/Shanghai. The days are in
// 2030, after the Redis clock's today: the quota keys expire by the Redis clock an
// hour after their day ends.
type quotaClock struct {
	loc *time.Location
	ns  atomic.Int64
}

func newQuotaClock(t testing.TB) *quotaClock {
	t.Helper()
	loc, err := time.LoadLocation("Asia/Shanghai")
	if err != nil {
		t.Fatal(err)
	}
	return &quotaClock{loc: loc}
}

// set moves the clock to 2030-06-14 + day, h:m:s in Shanghai.
func (c *quotaClock) set(day, h, m, s int) {
	c.ns.Store(time.Date(2030, 6, 14+day, h, m, s, 0, c.loc).UnixNano())
}

func (c *quotaClock) now() time.Time { return time.Unix(0, c.ns.Load()) }

// withQuotas configures a packet server with quotas q, counted on clock c.
func withQuotas(q store.Quotas, c *quotaClock) func(*PacketConfig) {
	return func(cfg *PacketConfig) {
		cfg.Quotas, cfg.TimeZone, cfg.Now = q, c.loc, c.now
	}
}

// wantQuotaRefusal fails unless a is a quota refusal of rule with status and
// Retry-After.
func wantQuotaRefusal(t testing.TB, what string, a answer, status int, rule, retryAfter string) {
	t.Helper()
	code := a.str("error")
	if a.str("outcome") != "" {
		code = a.str("outcome")
	}
	if a.Status != status || code != OutcomeQuotaExceeded || a.str("rule") != rule || a.Header.Get("Retry-After") != retryAfter {
		t.Fatalf("%s: %d %s, Retry-After %q; want %d quota_exceeded of rule %s, Retry-After %s", what, a.Status, a.Raw,
			a.Header.Get("Retry-After"), status, rule, retryAfter)
	}
}

// Every quota over HTTP on a real redis-server, with the packet server's clock set
// by the test and crossing midnight in Asia/Shanghai (16:00 UTC): each refusal
// names its rule, answers 429 (the per-minute rate) or 403 (a daily quota) with
// Retry-After to the minute's or the day's end, and changes nothing in Redis; a
// retry of a packet created answers existing and a repeated grab already_claimed
// at the quota; each quota starts again with its next minute or day. With one
// budget shard and with four (the counters then live on each person's home shard).
func TestQuotasOverHTTP(t *testing.T) {
	for _, tc := range []struct {
		shards    int
		oneServer bool
	}{{1, false}, {4, false}, {4, true}} {
		shards := tc.shards
		t.Run(fmt.Sprintf("%d shards, one server %v", shards, tc.oneServer), func(t *testing.T) {
			clock := newQuotaClock(t)
			h := newPacketHarness(t, 1_000_000, shards, withQuotas(store.Quotas{PacketsPerMinute: 2, PacketsPerDay: 3,
				AmountPerDay: 600, SharesPerDay: 1}, clock), func(c *PacketConfig) { c.OneServer = tc.oneServer })
			body := func(id string, total int) string {
				return fmt.Sprintf(`{"id":%q,"sender":"merchant-7","totalAmount":%d,"count":2}`, id, total)
			}
			unchanged := func(what string, f func()) {
				t.Helper()
				before := h.dump()
				f()
				if after := h.dump(); fmt.Sprint(after) != fmt.Sprint(before) {
					t.Fatalf("%s changed Redis", what)
				}
			}
			clock.set(0, 23, 58, 30)
			for _, id := range []string{"order-1", "order-2"} {
				if a := h.create(body(id, 200)); a.Status != http.StatusCreated {
					t.Fatalf("%s: %d %s", id, a.Status, a.Raw)
				}
			}
			unchanged("a third packet in the minute", func() {
				wantQuotaRefusal(t, "a third packet in the minute", h.create(body("order-3", 200)), http.StatusTooManyRequests,
					"perSender.packetsPerMinute", "30")
			})
			clock.set(0, 23, 59, 0)
			if a := h.create(body("order-3", 200)); a.Status != http.StatusCreated {
				t.Fatalf("order-3 in the next minute: %d %s", a.Status, a.Raw)
			}
			unchanged("a fourth packet in the day", func() {
				wantQuotaRefusal(t, "a fourth packet in the day", h.create(body("order-4", 100)), http.StatusForbidden,
					"perSender.packetsPerDay", "60")
			})
			unchanged("a retry at the quota", func() {
				if a := h.create(body("order-1", 200)); a.Status != http.StatusOK || a.str("outcome") != "existing" {
					t.Fatalf("a retry of order-1 at the quota: %d %s, want 200 existing", a.Status, a.Raw)
				}
			})

			// Recipients: one share a day.
			if a := h.grab("order-1", "member-1", nil); a.str("outcome") != "granted" {
				t.Fatalf("grab: %d %s", a.Status, a.Raw)
			}
			unchanged("a second share in the day", func() {
				wantQuotaRefusal(t, "a second share in the day", h.grab("order-2", "member-1", nil), http.StatusForbidden,
					"perRecipient.sharesPerDay", "60")
			})
			unchanged("a repeated grab at the quota", func() {
				if a := h.grab("order-1", "member-1", nil); a.Status != http.StatusOK || a.str("outcome") != "already_claimed" {
					t.Fatalf("a repeated grab at the quota: %d %s", a.Status, a.Raw)
				}
			})

			// Midnight in Shanghai: a new day for both, the money quota still holds.
			clock.set(1, 0, 0, 0)
			unchanged("money past the day's", func() {
				wantQuotaRefusal(t, "money past the day's", h.create(body("order-4", 601)), http.StatusForbidden,
					"perSender.amountPerDay", "86400")
			})
			if a := h.create(body("order-4", 600)); a.Status != http.StatusCreated {
				t.Fatalf("order-4 on the new day: %d %s", a.Status, a.Raw)
			}
			if a := h.grab("order-2", "member-1", nil); a.str("outcome") != "granted" {
				t.Fatalf("a grab on the new day: %d %s", a.Status, a.Raw)
			}
			if snap := h.conserved(); snap.CreatedPackets != 4 || snap.GrabbedShares != 2 {
				t.Fatalf("%d packets created, %d shares grabbed; want 4 and 2", snap.CreatedPackets, snap.GrabbedShares)
			}
			// Three creations and one grab were refused by a quota.
			if c, g := testutil.ToFloat64(h.metrics.Creates.WithLabelValues(OutcomeQuotaExceeded)),
				testutil.ToFloat64(h.metrics.Grabs.WithLabelValues(OutcomeQuotaExceeded)); c != 3 || g != 1 {
				t.Fatalf("quota refusals counted: %v creations, %v grabs; want 3 and 1", c, g)
			}
		})
	}
}

// quotaFleet is n packet servers of one budget on one Redis (standalone or a
// cluster), each with its own clients, as the grab Deployment's pods are.
func quotaFleet(t testing.TB, conn redisconn.Conn, admin redis.Cmdable, shards, n int, oneServer bool, q store.Quotas, clock *quotaClock) ([]*httptest.Server, *store.Budget) {
	t.Helper()
	budget := Budget{Namespace: "shop", Name: "quotas", UID: types.UID(uuid.NewUUID()), Shards: shards}
	handle := store.NewBudget(admin, string(budget.UID), shards)
	if err := handle.Configure(context.Background(), 100_000_000, packetLimits()); err != nil {
		t.Fatal(err)
	}
	var out []*httptest.Server
	for range n {
		rc, err := conn.NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = rc.Close() })
		sender, _ := NewSenderCredential([]byte(senderSecret))
		srv, err := NewPacketServer(PacketConfig{Budget: budget, Redis: rc.Pipeliner, Ping: rc.Client, Sender: sender,
			RedisTimeout: 2 * time.Second, Metrics: NewPacketMetrics(prometheus.NewRegistry()),
			Quotas: q, TimeZone: clock.loc, Now: clock.now, OneServer: oneServer})
		if err != nil {
			t.Fatal(err)
		}
		hs := httptest.NewServer(srv.Handler())
		t.Cleanup(hs.Close)
		out = append(out, hs)
	}
	return out, handle
}

// 64 clients send packets at once as one sender, through two packet servers, past
// the sender's daily quota of 50: exactly 50 are created and every other creation
// is refused 403 perSender.packetsPerDay; on a real redis-server and on a real
// 3-master Redis Cluster, with one budget shard and with eight, where the sender's
// packets land on every shard and its counters on one.
func TestSenderQuota64Clients(t *testing.T) {
	standalone := redistest.Start(t)
	cluster := redistest.StartCluster(t, 3)
	for _, tc := range []struct {
		name      string
		conn      redisconn.Conn
		admin     redis.Cmdable
		shards    int
		oneServer bool
	}{
		{"standalone, 1 shard", standalone.Conn(), standalone.Client(t), 1, false},
		{"standalone, 8 shards, take and give", standalone.Conn(), standalone.Client(t), 8, false},
		{"standalone, 8 shards, one step on one server", standalone.Conn(), standalone.Client(t), 8, true},
		{"cluster, 1 shard", cluster.Conn(), cluster.Client(t), 1, false},
		{"cluster, 8 shards", cluster.Conn(), cluster.Client(t), 8, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const quota, clients, each = 50, 64, 2
			clock := newQuotaClock(t)
			clock.set(0, 23, 59, 59)
			fleet, handle := quotaFleet(t, tc.conn, tc.admin, tc.shards, 2, tc.oneServer, store.Quotas{PacketsPerDay: quota}, clock)
			var created, refused atomic.Int64
			var wg sync.WaitGroup
			for i := range clients {
				wg.Go(func() {
					h := &packetHarness{t: t, http: fleet[i%len(fleet)]}
					for j := range each {
						a := h.create(fmt.Sprintf(`{"id":"c%d-%d","sender":"hot-sender","totalAmount":10,"count":1}`, i, j))
						switch {
						case a.Status == http.StatusCreated:
							created.Add(1)
						case a.Status == http.StatusForbidden && a.str("error") == OutcomeQuotaExceeded && a.str("rule") == "perSender.packetsPerDay":
							refused.Add(1)
						default:
							t.Errorf("c%d-%d: %d %s", i, j, a.Status, a.Raw)
						}
					}
				})
			}
			wg.Wait()
			snap, err := handle.Snapshot(context.Background())
			if err != nil || !snap.Conserved() {
				t.Fatalf("snapshot %+v, %v", snap, err)
			}
			if created.Load() != quota || refused.Load() != clients*each-quota || snap.CreatedPackets != quota {
				t.Fatalf("created %d, refused %d, the budget holds %d packets; want exactly %d created", created.Load(),
					refused.Load(), snap.CreatedPackets, quota)
			}
			used, err := handle.QuotaUsed(context.Background(), "hot-sender", handle.QuotaTimeAt(clock.now(), clock.loc))
			if err != nil || used.Packets != quota || used.Amount != 10*quota {
				t.Fatalf("the sender's counter: %+v, %v", used, err)
			}
			// The next second is the next day: the sender creates again.
			clock.set(1, 0, 0, 0)
			h := &packetHarness{t: t, http: fleet[0]}
			if a := h.create(`{"id":"next-day","sender":"hot-sender","totalAmount":10,"count":1}`); a.Status != http.StatusCreated {
				t.Fatalf("the next day: %d %s", a.Status, a.Raw)
			}
			t.Logf("%d created, %d refused of %d creations", created.Load(), refused.Load(), clients*each)
		})
	}
}
