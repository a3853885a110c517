package settlement

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
)

func TestNormalFlowSettlesEveryGrantOnce(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-normal", 300, 50_000, "merchant-001")
	key := []byte("balance-signing-key")
	rcv := newReceiver(t, a.uid, key)
	start := time.Now()
	grants := a.grab(t, 0, 200)

	reg := prometheus.NewRegistry()
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.SigningKey = key
	cfg.Registerer = reg
	startWorker(t, cfg)
	cfg.Consumer = "w2"
	startWorker(t, cfg) // a second worker in the group shares the work and the metrics

	// Grants made while the workers run are delivered too.
	for id, g := range a.grab(t, 200, 50) {
		grants[id] = g
	}
	eventually(t, 15*time.Second, "every grant settled", func() bool {
		return a.snapshot(t).SettledCount == 250
	})
	s := a.checkSettledExactly(t)
	if s.ClaimedCount != 250 {
		t.Fatalf("claimed %d, want 250", s.ClaimedCount)
	}
	rcv.checkCredits(t, grants)
	var granted int64
	for _, g := range grants {
		granted += g.amount
	}
	if st := rcv.stats(); st.total != granted || s.SettledAmount != granted {
		t.Fatalf("credited %d, settled %d, granted %d", st.total, s.SettledAmount, granted)
	}

	// The delivery carries the contract's values.
	for _, g := range grants {
		d, _ := rcv.creditedFor(a.uid + "/" + g.packet)
		at, err := time.Parse(time.RFC3339, d.At)
		if err != nil || at.Before(start.Add(-time.Second)) || at.After(time.Now().Add(time.Second)) {
			t.Fatalf("delivery at %q (%v), want between %s and now", d.At, err, start)
		}
		if d.Activity != "default/uid-normal" || d.Currency != "CNY" || d.ActivityUID != a.uid {
			t.Fatalf("delivery %+v", d)
		}
		break
	}

	// Metrics: every settled delivery counted once and observed in the lag histogram.
	if got := metricValue(t, reg, "redpacket_settlement_deliveries_total", ResultSettled); got != 250 {
		t.Fatalf("settled deliveries metric %v, want 250", got)
	}
	if got := metricValue(t, reg, "redpacket_settlement_lag_seconds", ""); got != 250 {
		t.Fatalf("lag histogram has %v samples, want 250", got)
	}
	if got := metricValue(t, reg, "redpacket_settlement_pending_entries", ""); got < 0 {
		t.Fatalf("pending gauge %v", got)
	}
}

// metricValue reads a counter, gauge or histogram sample count from reg; result
// selects the deliveries counter's series. Every series must carry the activity label.
func metricValue(t *testing.T, reg *prometheus.Registry, name, result string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["activity"] == "" {
				t.Fatalf("%s has no activity label: %v", name, labels)
			}
			if result != "" && labels["result"] != result {
				continue
			}
			switch {
			case m.GetCounter() != nil:
				return m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				return m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				return float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	t.Fatalf("metric %s{result=%q} not registered", name, result)
	return 0
}

func TestReceiverDownThenUpSettlesEverythingOnce(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-down", 120, 30_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	// Phase 1: the balance system answers 503; for every other packet it has applied
	// the credit before failing (the answer is lost), so redeliveries are duplicates.
	rcv.setReject(func(_ *http.Request, d Delivery) int {
		if strings.HasSuffix(d.PacketID, "1") {
			return 0
		}
		return http.StatusServiceUnavailable
	})
	rcv.setAfter(func(*http.Request, Delivery) int { return http.StatusServiceUnavailable })

	grants := a.grab(t, 0, 100)
	for i, c := range []string{"w1", "w2"} {
		cfg := baseConfig(a, rcv.url("/credit"), c)
		cfg.MaxAttempts = 10_000
		cfg.Concurrency = 2 + i
		startWorker(t, cfg)
	}
	eventually(t, 10*time.Second, "retries while the receiver fails", func() bool {
		return rcv.stats().requests >= 300
	})
	// Phase 2: no answer at all.
	rcv.down()
	time.Sleep(300 * time.Millisecond)
	if s := a.snapshot(t); s.SettledCount != 0 {
		t.Fatalf("settled %d while the receiver never answered 2xx", s.SettledCount)
	}
	before := rcv.stats()
	if before.credited == 0 {
		t.Fatalf("no credit applied in phase 1; the test needs some")
	}
	// Phase 3: the balance system is back and healthy.
	rcv.setReject(nil)
	rcv.setAfter(nil)
	rcv.up()
	eventually(t, 15*time.Second, "every grant settled", func() bool {
		return a.snapshot(t).SettledCount == 100
	})
	a.checkSettledExactly(t)
	rcv.checkCredits(t, grants)
	st := rcv.stats()
	if st.duplicates < before.credited {
		t.Fatalf("%d duplicates, want at least the %d credits whose answers were lost", st.duplicates, before.credited)
	}
	t.Logf("%d requests for %d grants, %d duplicates credited once", st.requests, len(grants), st.duplicates)
}

func TestKilledWorkersEntriesAreTakenOver(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-kill", 80, 20_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	// Worker A's deliveries (path /a): the first 10 are answered; after that the
	// balance system credits and then hangs until A goes away.
	var answered atomic.Int64
	rcv.setAfter(func(r *http.Request, _ Delivery) int {
		if r.URL.Path != "/a" || answered.Add(1) <= 10 {
			return 0
		}
		<-r.Context().Done()
		return http.StatusServiceUnavailable
	})
	grants := a.grab(t, 0, 60)

	cfgA := baseConfig(a, rcv.url("/a"), "worker-a")
	cfgA.Concurrency = 4
	cfgA.BatchSize = 20
	cfgA.ClaimIdle = time.Minute
	_, stopA := startWorker(t, cfgA)
	eventually(t, 10*time.Second, "worker A holding a hung batch", func() bool {
		return rcv.requestsOn("/a") >= 14 && a.pendingOf(t, DefaultGroup, "worker-a") == 50
	})
	stopA() // dies in the middle of its batch
	heldByA := a.pendingOf(t, DefaultGroup, "worker-a")
	if heldByA != 50 {
		t.Fatalf("worker A left %d pending entries, want 50", heldByA)
	}
	if s := a.snapshot(t); s.SettledCount != 10 {
		t.Fatalf("settled %d before the takeover, want 10", s.SettledCount)
	}
	creditedByA := rcv.stats().credited

	cfgB := baseConfig(a, rcv.url("/b"), "worker-b")
	cfgB.ClaimIdle = 300 * time.Millisecond
	startWorker(t, cfgB)
	eventually(t, 15*time.Second, "worker B settling A's entries", func() bool {
		return a.snapshot(t).SettledCount == 60
	})
	a.checkSettledExactly(t)
	rcv.checkCredits(t, grants)
	if got := rcv.requestsOn("/b"); got < 50 {
		t.Fatalf("worker B delivered %d entries, want at least A's 50", got)
	}
	if st := rcv.stats(); st.duplicates < creditedByA-10 {
		t.Fatalf("%d duplicates, want at least the %d credited by A but never acknowledged", st.duplicates, creditedByA-10)
	}
	// Every packet was delivered at least once and credited once.
	for _, g := range grants {
		if n := rcv.requestsFor(a.uid + "/" + g.packet); n < 1 {
			t.Fatalf("packet %s delivered %d times", g.packet, n)
		}
	}
}

func TestRestartedWorkerResumesItsPendingAndKeepsAttemptCounts(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-restart", 30, 3_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	grants := a.grab(t, 0, 20)
	var poison string
	for id := range grants {
		poison = id
		break
	}
	poisonKey := a.uid + "/" + poison
	rcv.setReject(func(_ *http.Request, d Delivery) int {
		if d.PacketID == poison {
			return http.StatusUnprocessableEntity
		}
		return http.StatusServiceUnavailable
	})

	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.MaxAttempts = 5
	cfg.BackoffBase = 150 * time.Millisecond
	cfg.BackoffMax = 150 * time.Millisecond
	cfg.ClaimIdle = time.Hour // nothing is taken over: the restart alone resumes the entries
	_, stop := startWorker(t, cfg)
	eventually(t, 10*time.Second, "two deliveries of the poison entry", func() bool {
		return rcv.requestsFor(poisonKey) >= 2
	})
	stop()
	if p := a.pendingOf(t, DefaultGroup, "w1"); p != 20 {
		t.Fatalf("%d entries pending after the stop, want 20", p)
	}
	firstRun := rcv.requestsFor(poisonKey)

	rcv.setReject(func(_ *http.Request, d Delivery) int {
		if d.PacketID == poison {
			return http.StatusUnprocessableEntity
		}
		return 0
	})
	startWorker(t, cfg)
	eventually(t, 10*time.Second, "all but the poison entry settled, the poison dead-lettered", func() bool {
		s := a.snapshot(t)
		return s.SettledCount == 19 && s.DeadCount == 1
	})
	// The attempt count survived the restart: MaxAttempts deliveries in all, not per run.
	if total := rcv.requestsFor(poisonKey); total > cfg.MaxAttempts || total <= firstRun {
		t.Fatalf("poison entry delivered %d times (%d before the restart), want at most %d in all and some after",
			total, firstRun, cfg.MaxAttempts)
	}
	if p := a.pending(t, DefaultGroup); p != 0 {
		t.Fatalf("%d entries pending", p)
	}
}

func TestPoisonEntryIsDeadLetteredAndReplayed(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-poison", 60, 12_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	grants := a.grab(t, 0, 40)
	var poison grant
	for _, g := range grants {
		poison = g
		break
	}
	poisonKey := a.uid + "/" + poison.packet
	var fixed atomic.Bool
	rcv.setReject(func(_ *http.Request, d Delivery) int {
		if d.PacketID == poison.packet && !fixed.Load() {
			return http.StatusUnprocessableEntity
		}
		return 0
	})

	reg := prometheus.NewRegistry()
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.MaxAttempts = 3
	cfg.Concurrency = 2
	cfg.BackoffBase = time.Second // the poison entry takes over a second to give up on
	cfg.BackoffMax = time.Second
	cfg.HealthyBackoffBase = time.Second
	cfg.HealthyBackoffMax = time.Second
	cfg.Registerer = reg
	startWorker(t, cfg)

	// The rest flow while the poison entry waits for its retries.
	eventually(t, 10*time.Second, "the other 39 settled", func() bool {
		return a.snapshot(t).SettledCount == 39
	})
	if s := a.snapshot(t); s.DeadCount != 0 {
		t.Fatalf("dead count %d before the poison entry used its attempts", s.DeadCount)
	}
	eventually(t, 10*time.Second, "the poison entry dead-lettered", func() bool {
		return a.snapshot(t).DeadCount == 1
	})
	if n := rcv.requestsFor(poisonKey); n != cfg.MaxAttempts {
		t.Fatalf("poison entry delivered %d times, want %d", n, cfg.MaxAttempts)
	}
	dead, err := a.handle.Shard(0).DeadLetters(context.Background())
	if err != nil || len(dead) != 1 {
		t.Fatalf("dead-letter stream: %v, %v", dead, err)
	}
	f := dead[0].Fields
	if d := dead[0]; d.Malformed != nil || d.PacketID != poison.packet || d.UserID != poison.user ||
		d.Kind != store.KindGrant || d.Amount != poison.amount || f["entry"] == "" {
		t.Fatalf("dead letter fields %v, want packet %s of %s", f, poison.packet, poison.user)
	}
	if e := f["error"]; !strings.Contains(e, "422") {
		t.Fatalf("dead letter error %q, want the 422 answer", e)
	}
	if got := metricValue(t, reg, "redpacket_settlement_dead_letters_total", ""); got != 1 {
		t.Fatalf("dead letters metric %v, want 1", got)
	}
	if got := metricValue(t, reg, "redpacket_settlement_deliveries_total", ResultRejected); got != float64(cfg.MaxAttempts) {
		t.Fatalf("rejected deliveries metric %v, want %d", got, cfg.MaxAttempts)
	}
	if got := metricValue(t, reg, "redpacket_settlement_retries_total", ""); got != float64(cfg.MaxAttempts-1) {
		t.Fatalf("retries metric %v, want %d", got, cfg.MaxAttempts-1)
	}
	if p := a.pending(t, DefaultGroup); p != 0 {
		t.Fatalf("%d entries pending", p)
	}
	if st := rcv.stats(); st.credited != 39 {
		t.Fatalf("%d credited before the replay, want 39", st.credited)
	}

	// The balance system is fixed; the dead letter is replayed and settles.
	fixed.Store(true)
	n, err := a.handle.ReplayDeadLetters(context.Background(), 0)
	if err != nil || n != 1 {
		t.Fatalf("replay: %d, %v", n, err)
	}
	if l := rdb.XLen(context.Background(), a.keys.DeadLetters).Val(); l != 0 {
		t.Fatalf("dead-letter stream holds %d after the replay", l)
	}
	eventually(t, 10*time.Second, "the replayed entry settled", func() bool {
		return a.snapshot(t).SettledCount == 40
	})
	a.checkSettledExactly(t)
	rcv.checkCredits(t, grants)
	if n, err := a.handle.ReplayDeadLetters(context.Background(), 0); err != nil || n != 0 {
		t.Fatalf("second replay: %d, %v", n, err)
	}
}

func TestExpiryRefundSettlesToTheSponsor(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-expiry", 50, 10_000, "merchant-001")
	rcv := newReceiver(t, a.uid, []byte("k"))
	grants := a.grab(t, 0, 20)
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.SigningKey = []byte("k")
	startWorker(t, cfg)

	res, err := a.handle.Close(context.Background(), store.CloseExpired)
	if err != nil || string(res.Outcome) != "closed" || res.Refunded <= 0 {
		t.Fatalf("close: %+v, %v", res, err)
	}
	eventually(t, 10*time.Second, "grants and the refund settled", func() bool {
		s := a.snapshot(t)
		return s.SettledCount == 20 && s.RefundSettled == res.Refunded
	})
	s := a.checkSettledExactly(t)
	if s.ClaimedAmount+s.Refunded != s.Total || s.Total != 10_000 {
		t.Fatalf("claimed %d + refunded %d != total %d", s.ClaimedAmount, s.Refunded, s.Total)
	}
	d, ok := rcv.creditedFor(a.uid + "/refund")
	if !ok {
		t.Fatalf("refund never credited")
	}
	if d.Kind != store.KindRefund || d.UserID != "merchant-001" || d.PacketID != "refund" || d.Amount != res.Refunded {
		t.Fatalf("refund delivered as %+v, want %d to merchant-001", d, res.Refunded)
	}
	st := rcv.stats()
	if len(st.problems) > 0 {
		t.Fatalf("receiver saw bad deliveries: %v", st.problems)
	}
	var granted int64
	for _, g := range grants {
		granted += g.amount
	}
	if st.credited != 21 || st.total != granted+res.Refunded || st.total != s.Total {
		t.Fatalf("credited %d deliveries totalling %d, want 21 totalling %d", st.credited, st.total, s.Total)
	}
}

func TestNoWebhookLeavesClaimsInTheStream(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-idle", 10, 1_000, "merchant-001")
	a.grab(t, 0, 5)
	_, stop := startWorker(t, baseConfig(a, "", "w1"))
	time.Sleep(200 * time.Millisecond)
	stop()
	groups, err := rdb.XInfoGroups(context.Background(), a.keys.Stream).Result()
	if err != nil || len(groups) != 0 {
		t.Fatalf("groups %v, %v; want none", groups, err)
	}
	if n := rdb.XLen(context.Background(), a.keys.Stream).Val(); n != 5 {
		t.Fatalf("stream holds %d entries, want 5", n)
	}
}

func TestNewWorkerChecksConfig(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer rdb.Close()
	good := Config{Redis: rdb, Source: Source{UID: "u"}, Consumer: "c",
		WebhookURL: "http://127.0.0.1:1/credit"}
	if _, err := NewWorker(good); err != nil {
		t.Fatalf("good config: %v", err)
	}
	for name, mutate := range map[string]func(*Config){
		"no redis":       func(c *Config) { c.Redis = nil },
		"no uid":         func(c *Config) { c.Source.UID = "" },
		"no consumer":    func(c *Config) { c.Consumer = "" },
		"relative url":   func(c *Config) { c.WebhookURL = "/credit" },
		"bad scheme":     func(c *Config) { c.WebhookURL = "ftp://x/credit" },
		"negative max":   func(c *Config) { c.MaxAttempts = -1 },
		"tiny idle":      func(c *Config) { c.ClaimIdle = time.Millisecond },
		"unparsable url": func(c *Config) { c.WebhookURL = "http://[::1" },
	} {
		cfg := good
		mutate(&cfg)
		if _, err := NewWorker(cfg); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	w, _ := NewWorker(good)
	if w.cfg.MaxAttempts != DefaultMaxAttempts || w.cfg.Group != DefaultGroup || w.cfg.ClaimIdle != DefaultClaimIdle ||
		w.cfg.HTTPClient == nil || w.cfg.HTTPClient.Timeout != DefaultHTTPTimeout {
		t.Fatalf("defaults not applied: %+v", w.cfg)
	}
}

func TestBackoffGrowsWithJitterUpToTheCap(t *testing.T) {
	w := &Worker{cfg: Config{BackoffBase: 100 * time.Millisecond, BackoffMax: time.Second,
		HealthyBackoffBase: 10 * time.Millisecond, HealthyBackoffMax: 50 * time.Millisecond}}
	for attempts, want := range map[int64]time.Duration{1: 100 * time.Millisecond, 2: 200 * time.Millisecond,
		3: 400 * time.Millisecond, 4: 800 * time.Millisecond, 5: time.Second, 60: time.Second} {
		for range 50 {
			if d := w.backoff(attempts, false); d < want/2 || d > want {
				t.Fatalf("backoff after %d attempts %s, want in [%s, %s]", attempts, d, want/2, want)
			}
		}
	}
	// While the balance system is healthy, the short base and cap apply.
	for attempts, want := range map[int64]time.Duration{1: 10 * time.Millisecond, 2: 20 * time.Millisecond,
		3: 40 * time.Millisecond, 4: 50 * time.Millisecond, 60: 50 * time.Millisecond} {
		for range 50 {
			if d := w.backoff(attempts, true); d < want/2 || d > want {
				t.Fatalf("healthy backoff after %d attempts %s, want in [%s, %s]", attempts, d, want/2, want)
			}
		}
	}
}

// The balance system is healthy while at most half of the latest 32 deliveries
// failed, and only the latest 32 count.
func TestHealthFollowsTheLatestDeliveries(t *testing.T) {
	var h health
	if !h.healthy() {
		t.Fatal("unhealthy before any delivery")
	}
	for i := range healthQuorum {
		if !h.healthy() {
			t.Fatalf("unhealthy after %d failures, fewer than the quorum", i)
		}
		h.record(false)
	}
	if h.healthy() {
		t.Fatalf("healthy after %d failures and no success", healthQuorum)
	}
	for range healthQuorum {
		h.record(true)
	}
	if !h.healthy() {
		t.Fatal("unhealthy with half of the deliveries failed")
	}
	for range healthWindow {
		h.record(false)
	}
	if h.healthy() || h.fails != healthWindow || h.n != healthWindow {
		t.Fatalf("after a window of failures: healthy %v, %d failures in %d", h.healthy(), h.fails, h.n)
	}
	for range healthWindow / 2 {
		h.record(true)
	}
	if !h.healthy() {
		t.Fatal("unhealthy with half of the window successes")
	}
	// 30 % of deliveries failing at random leaves it healthy.
	h = health{}
	for i := range 1000 {
		h.record(i%10 >= 3)
		if i >= healthWindow && !h.healthy() {
			t.Fatalf("unhealthy at delivery %d with 30%% failing", i)
		}
	}
}

// Defaults of the retry settings: the healthy backoff never exceeds the other.
func TestRetryDefaults(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer rdb.Close()
	cfg := Config{Redis: rdb, Source: Source{UID: "u"}, Consumer: "c"}
	w, err := NewWorker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if w.cfg.RetryConcurrency != DefaultRetryConcurrency || w.cfg.HealthyBackoffBase != DefaultHealthyBackoffBase ||
		w.cfg.HealthyBackoffMax != DefaultHealthyBackoffMax || w.transport == nil ||
		w.transport.MaxIdleConnsPerHost != 2*DefaultMaxConcurrency {
		t.Fatalf("defaults: %+v", w.cfg)
	}
	cfg.BackoffBase, cfg.BackoffMax = 10*time.Millisecond, 20*time.Millisecond
	cfg.HTTPClient = &http.Client{Transport: &http.Transport{}}
	w, err = NewWorker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if w.cfg.HealthyBackoffBase != 10*time.Millisecond || w.cfg.HealthyBackoffMax != 20*time.Millisecond {
		t.Fatalf("healthy backoff %s..%s above the backoff %s..%s", w.cfg.HealthyBackoffBase,
			w.cfg.HealthyBackoffMax, cfg.BackoffBase, cfg.BackoffMax)
	}
	if w.transport != nil || w.cfg.HTTPClient.Transport != cfg.HTTPClient.Transport {
		t.Fatal("the configured transport was replaced")
	}
}

func TestSignAndDeliveryBody(t *testing.T) {
	// The X-Signature of a known body under a known key (HMAC-SHA256 test vector).
	got := Sign([]byte("key"), []byte("The quick brown fox jumps over the lazy dog"))
	if want := "sha256=f7bc83f430538424b13298e6aa6fb143ef4d59a14946175997479dbc2d1a3cd8"; got != want {
		t.Fatalf("signature %s, want %s", got, want)
	}
	w := &Worker{cfg: Config{Source: Source{Namespace: "ns", Name: "a", UID: "u", Currency: "CNY"}}}
	// The grant as the store decodes it (the store's tests cover the decoding).
	f := store.StreamEntry{ID: "1767225600123-0", Kind: store.KindGrant, PacketID: "7", UserID: "alice", Amount: 123,
		At: time.UnixMilli(1767225600123).UTC()}
	d := w.delivery(f)
	if d.At != "2026-01-01T00:00:00.123Z" || d.Amount != 123 || d.IdempotencyKey() != "u/7" {
		t.Fatalf("delivery %+v key %s", d, d.IdempotencyKey())
	}
}

func TestLiveWorkerKeepsItsEntriesWhileBackingOff(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-live", 20, 2_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	// Worker A's deliveries fail, and it backs off far longer than ClaimIdle.
	rcv.setReject(func(r *http.Request, _ Delivery) int {
		if r.URL.Path == "/a" {
			return http.StatusServiceUnavailable
		}
		return 0
	})
	grants := a.grab(t, 0, 10)
	cfgA := baseConfig(a, rcv.url("/a"), "worker-a")
	cfgA.ClaimIdle = 300 * time.Millisecond
	cfgA.BackoffBase = 5 * time.Second
	cfgA.BackoffMax = 5 * time.Second
	cfgA.HealthyBackoffBase = 5 * time.Second
	cfgA.HealthyBackoffMax = 5 * time.Second
	_, stopA := startWorker(t, cfgA)
	eventually(t, 10*time.Second, "worker A holding every entry", func() bool {
		return rcv.requestsOn("/a") == 10 && a.pendingOf(t, DefaultGroup, "worker-a") == 10
	})
	cfgB := baseConfig(a, rcv.url("/b"), "worker-b")
	cfgB.ClaimIdle = 300 * time.Millisecond
	startWorker(t, cfgB)
	// Several ClaimIdle periods: A is alive and keeps its entries fresh, so B takes none.
	time.Sleep(1500 * time.Millisecond)
	if n := rcv.requestsOn("/b"); n != 0 {
		t.Fatalf("worker B delivered %d entries of a live worker", n)
	}
	// Nobody claimed them either: each was handed out once, to A.
	pend, err := rdb.XPendingExt(context.Background(), &redis.XPendingExtArgs{Stream: a.keys.Stream,
		Group: DefaultGroup, Start: "-", End: "+", Count: 100}).Result()
	if err != nil || len(pend) != 10 {
		t.Fatalf("pending %v, %v; want 10 entries", pend, err)
	}
	for _, p := range pend {
		if p.Consumer != "worker-a" || p.RetryCount != 1 {
			t.Fatalf("entry %s held by %s, delivered %d times; want worker-a, once", p.ID, p.Consumer, p.RetryCount)
		}
	}
	// Once A is gone, B takes its entries over.
	stopA()
	eventually(t, 10*time.Second, "worker B settling A's entries", func() bool {
		return a.snapshot(t).SettledCount == 10
	})
	a.checkSettledExactly(t)
	rcv.checkCredits(t, grants)
}
