package settlement

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/test/wait"
)

// The adaptive limit on a real worker, real Redis and a real HTTP balance system
// that takes 5 ms per answer, so the limit decides the pace: it rises while the
// balance system answers promptly (more deliveries really go out at once than the
// worker started with), holds up under 30 % failures and 5 % held deliveries, falls
// to the floor while every delivery fails, and rises again once the balance system
// is back. Every grant is credited exactly once in effect and settled once.
func TestAdaptiveLimitFollowsTheBalanceSystem(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-adaptive", 3400, 3_400_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)

	var mode atomic.Int32 // 0 healthy, 1 the failure mix, 2 down
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(20261202, 9))
	var failed, held atomic.Int64
	rcv.setReject(func(r *http.Request, d Delivery) int {
		switch mode.Load() {
		case 2:
			return http.StatusServiceUnavailable
		case 1:
			mu.Lock()
			roll := rng.Float64()
			mu.Unlock()
			switch {
			case roll < 0.30:
				failed.Add(1)
				return http.StatusInternalServerError
			case roll < 0.35:
				held.Add(1)
				<-r.Context().Done() // held until the worker gives up on it
				return http.StatusServiceUnavailable
			}
		}
		time.Sleep(5 * time.Millisecond)
		return 0
	})

	reg := prometheus.NewRegistry()
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.Concurrency, cfg.MinConcurrency, cfg.MaxConcurrency = 4, 2, 48
	cfg.RetryConcurrency = 4
	cfg.MaxAttempts = 1000 // the outage must not dead-letter anything
	sender := &countingTransport{base: http.DefaultTransport.(*http.Transport).Clone()}
	cfg.HTTPClient = &http.Client{Timeout: DefaultHTTPTimeout, Transport: sender}
	cfg.Registerer = reg
	w, _ := startWorker(t, cfg)
	limit := func() float64 { return metricValue(t, reg, "redpacket_settlement_concurrency_limit", "") }
	settled := func(want int) {
		t.Helper()
		wait.Until(t, 2*time.Minute, fmt.Sprintf("%d grants settled", want), func() (bool, string) {
			s := a.snapshot(t)
			return s.SettledCount == int64(want), fmt.Sprintf("%d settled, limit %.0f", s.SettledCount, limit())
		})
	}

	// Healthy: the limit grows from 4, and more than the starting lanes' 4 + 4
	// deliveries go out at once.
	grants := a.grab(t, 0, 1500)
	settled(len(grants))
	healthy := limit()
	if healthy < 16 || sender.max.Load() <= 8 {
		t.Fatalf("after 1500 prompt deliveries the limit is %.0f and at most %d went out at once; want it grown from 4 past 16, above 8 in flight",
			healthy, sender.max.Load())
	}

	// The failure mix: 30 % failing at random is not most of a round, so the limit is
	// not cut for it.
	mode.Store(1)
	maps.Copy(grants, a.grab(t, 1500, 600))
	settled(len(grants))
	if failed.Load() == 0 || held.Load() == 0 {
		t.Fatalf("the receiver failed %d and held %d deliveries; the test needs both", failed.Load(), held.Load())
	}
	mixed := limit()
	t.Logf("limit %.0f after the healthy phase, %.0f after the failure mix (%d failed, %d held)", healthy, mixed, failed.Load(), held.Load())

	// Down: every delivery fails, and the limit falls to the floor.
	mode.Store(2)
	maps.Copy(grants, a.grab(t, 2100, 300))
	wait.Until(t, time.Minute, "the limit at the floor", func() (bool, string) {
		return limit() == float64(cfg.MinConcurrency), fmt.Sprintf("limit %.0f", limit())
	})

	// Back: everything is delivered, and the limit grows again under a new burst.
	mode.Store(0)
	settled(len(grants))
	maps.Copy(grants, a.grab(t, 2400, 1000))
	settled(len(grants))
	if got := limit(); got <= float64(cfg.MinConcurrency) {
		t.Errorf("the limit stayed at %.0f after the balance system came back and 1000 more were delivered", got)
	}
	if m := sender.max.Load(); m > int64(w.cfg.maxInFlight()) {
		t.Errorf("%d deliveries in flight at once, above the bound %d", m, w.cfg.maxInFlight())
	}
	rcv.checkCredits(t, grants)
	a.checkSettledExactly(t)
	st := rcv.stats()
	t.Logf("%d requests for %d grants, %d duplicates (same key, credited once), at most %d in flight; limit at the end %.0f",
		st.requests, len(grants), st.duplicates, sender.max.Load(), limit())
}

// The concurrency bounds' defaults and checks.
func TestConcurrencyBounds(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer rdb.Close()
	tests := []struct {
		start, floor, ceiling, retry      int
		wantStart, wantFloor, wantCeiling int
		wantInFlight                      int
		wantErr                           bool
	}{
		{0, 0, 0, 0, DefaultConcurrency, DefaultMinConcurrency, DefaultMaxConcurrency, 2 * DefaultMaxConcurrency, false},
		// Retries keep the ratio 8:100 of the configured values at the ceiling.
		{100, 0, 0, 0, DefaultMaxConcurrency, DefaultMinConcurrency, DefaultMaxConcurrency, DefaultMaxConcurrency + 6, false},
		{0, 0, 1, 0, 1, 1, 1, 2, false},
		{0, 12, 0, 0, 12, 12, DefaultMaxConcurrency, 2 * DefaultMaxConcurrency, false},
		{8, 8, 8, 8, 8, 8, 8, 16, false},
		{8, 0, 32, 4, 8, DefaultMinConcurrency, 32, 32 + 16, false},
		{8, 0, 32, 3, 8, DefaultMinConcurrency, 32, 32 + 12, false},
		{0, 10, 5, 0, 0, 0, 0, 0, true},
		{0, -1, 0, 0, 0, 0, 0, 0, true},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%d in %d..%d retry %d", tc.start, tc.floor, tc.ceiling, tc.retry), func(t *testing.T) {
			cfg, err := Config{Redis: rdb, Source: Source{UID: "u"}, Consumer: "c", Concurrency: tc.start,
				MinConcurrency: tc.floor, MaxConcurrency: tc.ceiling, RetryConcurrency: tc.retry}.withDefaults()
			if tc.wantErr {
				if err == nil {
					t.Fatalf("no error for bounds %d..%d", tc.floor, tc.ceiling)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			start := newLimiter(cfg.Concurrency, cfg.MinConcurrency, cfg.MaxConcurrency).current()
			if start != tc.wantStart || cfg.MinConcurrency != tc.wantFloor || cfg.MaxConcurrency != tc.wantCeiling ||
				cfg.maxInFlight() != tc.wantInFlight {
				t.Errorf("start %d in %d..%d, %d in flight at most; want %d in %d..%d, %d", start, cfg.MinConcurrency,
					cfg.MaxConcurrency, cfg.maxInFlight(), tc.wantStart, tc.wantFloor, tc.wantCeiling, tc.wantInFlight)
			}
		})
	}
}

// A worker that judged the balance system down and has nothing in flight does not
// wait out the long delays of its entries: it probes with the entry due first
// BackoffBase after the latest answer, and once the balance system answers the probe
// the others follow at once. Without the probe, entries delivered six times while it
// was down would wait 8 s or more.
func TestIdleWorkerProbesABalanceSystemJudgedDown(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-probe", 10, 10_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	var down atomic.Bool
	down.Store(true)
	rcv.setReject(func(*http.Request, Delivery) int {
		if down.Load() {
			return http.StatusServiceUnavailable
		}
		return 0
	})
	grants := a.grab(t, 0, 3)
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.BackoffBase, cfg.BackoffMax = 500*time.Millisecond, 5*time.Minute
	cfg.HealthyBackoffBase, cfg.HealthyBackoffMax = 10*time.Millisecond, 20*time.Millisecond
	cfg.MaxAttempts = 1000
	startWorker(t, cfg)
	wait.Until(t, time.Minute, "every grant delivered six times", func() (bool, string) {
		least := 1 << 30
		for _, g := range grants {
			least = min(least, rcv.requestsFor(a.uid+"/"+g.packet))
		}
		return least >= 6, fmt.Sprintf("the least delivered grant had %d deliveries", least)
	})
	down.Store(false)
	back := time.Now()
	wait.Until(t, 5*time.Second, "every grant settled within 5s of the balance system's return", func() (bool, string) {
		s := a.snapshot(t)
		return s.SettledCount == int64(len(grants)), fmt.Sprintf("%d settled", s.SettledCount)
	})
	t.Logf("settled %s after the balance system came back", time.Since(back).Round(time.Millisecond))
	rcv.checkCredits(t, grants)
}

// The limit and the health verdict judge the balance system by its answers in the
// order they come, not by when the jobs that got them end. Redis holds every write
// for a second (CLIENT PAUSE ... WRITE) while deliveries are in flight: the
// deliveries the balance system credits wait for their acknowledgement, those it
// fails (two in five) do not. Judged when their jobs end, the failures would make
// most of a round and cut the limit; judged when the answers come, two in five
// failing is not most of a round, and the limit stays at the ceiling.
func TestSlowAcknowledgementsDoNotCutTheLimit(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-slow-acks", 1000, 100_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	var mu sync.Mutex
	seen := map[string]bool{}
	rcv.setReject(func(_ *http.Request, d Delivery) int {
		time.Sleep(10 * time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		if seen[d.PacketID] {
			return 0
		}
		seen[d.PacketID] = true
		if n := len(seen) % 5; n == 1 || n == 3 {
			return http.StatusServiceUnavailable
		}
		return 0
	})
	grants := a.grab(t, 0, 1000)
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.Concurrency, cfg.MinConcurrency, cfg.MaxConcurrency = 64, 2, 64
	cfg.MaxAttempts = 100
	w, _ := startWorker(t, cfg)
	var lowest atomic.Int64
	lowest.Store(int64(cfg.MaxConcurrency))
	done := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			select {
			case <-done:
				return
			case <-time.After(time.Millisecond):
			}
			if v := int64(testutil.ToFloat64(w.m.limit)); v > 0 && v < lowest.Load() {
				lowest.Store(v)
			}
		}
	}()
	eventually(t, 30*time.Second, "200 deliveries", func() bool { return rcv.stats().requests >= 200 })
	if err := rdb.Do(context.Background(), "CLIENT", "PAUSE", "1000", "WRITE").Err(); err != nil {
		t.Fatalf("pausing Redis writes: %v", err)
	}
	wait.Until(t, time.Minute, "every grant settled", func() (bool, string) {
		s := a.snapshot(t)
		return s.SettledCount == int64(len(grants)), fmt.Sprintf("%d settled, lowest limit %d", s.SettledCount, lowest.Load())
	})
	close(done)
	<-sampled
	a.checkSettledExactly(t)
	rcv.checkCredits(t, grants)
	// A cut for failures halves the limit; one for latency takes a quarter off, and
	// two of those (a loaded machine) leave it above half.
	if got := lowest.Load(); got <= int64(cfg.MaxConcurrency)/2 {
		t.Errorf("the limit fell to %d while the acknowledgements waited, want above %d", got, cfg.MaxConcurrency/2)
	}
	t.Logf("lowest limit %d, %d requests", lowest.Load(), rcv.stats().requests)
}
