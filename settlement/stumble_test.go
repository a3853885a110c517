package settlement

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"redpacket.io/operator/test/wait"
)

// A balance system that fails 30 % of deliveries at random and holds 5 % until the
// worker gives up on them still gets every grant credited exactly once in effect:
// each acknowledged after a 2xx, duplicates only under the same Idempotency-Key,
// nothing dead-lettered but the entry it always rejects, and that one only after
// MaxAttempts deliveries. The deliveries in flight never exceed the two lanes'
// bounds at the ceiling.
func TestStumblingBalanceSystemCreditsEveryGrantOnce(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-stumble", 600, 600_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	grants := a.grab(t, 0, 501)
	var poison grant
	for _, g := range grants {
		poison = g
		break
	}
	delete(grants, poison.packet)

	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(20261231, 6))
	var failed, held, heldCancelled atomic.Int64
	rcv.setReject(func(r *http.Request, d Delivery) int {
		if d.PacketID == poison.packet {
			return http.StatusUnprocessableEntity
		}
		mu.Lock()
		roll := rng.Float64()
		mu.Unlock()
		switch {
		case roll < 0.30:
			failed.Add(1)
			return http.StatusServiceUnavailable
		case roll < 0.35:
			held.Add(1)
			<-r.Context().Done() // held until the worker gives up on it
			if errors.Is(r.Context().Err(), context.Canceled) {
				heldCancelled.Add(1)
			}
			return http.StatusServiceUnavailable
		}
		return 0
	})

	reg := prometheus.NewRegistry()
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	// Backoffs short enough for the poison entry to use its attempts quickly (once
	// the others are settled, its failures are all the worker sees of the balance
	// system, which then counts as down), and MaxAttempts high enough that no other
	// entry fails that often by chance (0.35^16 per entry).
	cfg.BackoffBase, cfg.BackoffMax = 50*time.Millisecond, 500*time.Millisecond
	cfg.HealthyBackoffBase = 20 * time.Millisecond
	cfg.HealthyBackoffMax = 200 * time.Millisecond
	cfg.MaxAttempts = 16
	sender := &countingTransport{base: http.DefaultTransport.(*http.Transport).Clone()}
	cfg.HTTPClient = &http.Client{Timeout: DefaultHTTPTimeout, Transport: sender}
	cfg.Registerer = reg
	w, _ := startWorker(t, cfg)

	wait.Until(t, 2*time.Minute, "every grant settled and the poison entry dead-lettered", func() (bool, string) {
		s := a.snapshot(t)
		return s.SettledCount == int64(len(grants)) && s.DeadCount == 1,
			fmt.Sprintf("%d settled, %d dead", s.SettledCount, s.DeadCount)
	})
	rcv.checkCredits(t, grants)
	var sum int64
	for _, g := range grants {
		sum += g.amount
	}
	s := a.snapshot(t)
	if s.SettledAmount != sum || s.ClaimedCount != int64(len(grants))+1 {
		t.Errorf("settled %d of %d granted (claimed %d)", s.SettledAmount, sum, s.ClaimedCount)
	}
	if p := a.pending(t, DefaultGroup); p != 0 {
		t.Errorf("%d entries still pending", p)
	}
	if n := rcv.requestsFor(a.uid + "/" + poison.packet); n != cfg.MaxAttempts {
		t.Errorf("the poison entry was delivered %d times, want MaxAttempts = %d", n, cfg.MaxAttempts)
	}
	dead, err := a.handle.Shard(0).DeadLetters(context.Background())
	if err != nil || len(dead) != 1 || dead[0].PacketID != poison.packet {
		t.Fatalf("dead letters %v, %v; want the poison entry %s only", dead, err, poison.packet)
	}
	if e := dead[0].Fields["error"]; !strings.Contains(e, "422") {
		t.Errorf("dead letter error %q, want the 422 answer", e)
	}

	st := rcv.stats()
	if limit := int64(w.cfg.maxInFlight()); sender.max.Load() > limit {
		t.Errorf("%d deliveries in flight at once, above the bound %d", sender.max.Load(), limit)
	}
	// The mix really happened, and held deliveries were hedged: cancelled, not
	// waited out.
	if failed.Load() == 0 || held.Load() == 0 {
		t.Fatalf("the receiver failed %d and held %d deliveries; the test needs both", failed.Load(), held.Load())
	}
	if got := metricValue(t, reg, "redpacket_settlement_hedges_total", ""); got == 0 || heldCancelled.Load() == 0 {
		t.Errorf("%v hedges, %d held deliveries cancelled; want held deliveries hedged", got, heldCancelled.Load())
	}
	t.Logf("%d requests for %d grants: %d failed, %d held (%d cancelled by a hedge), %d duplicates, at most %d in flight",
		st.requests, len(grants)+1, failed.Load(), held.Load(), heldCancelled.Load(), st.duplicates, sender.max.Load())
}

// countingTransport counts the requests in flight through it, now and at most.
type countingTransport struct {
	base     http.RoundTripper
	now, max atomic.Int64
}

func (c *countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	n := c.now.Add(1)
	for {
		m := c.max.Load()
		if n <= m || c.max.CompareAndSwap(m, n) {
			break
		}
	}
	defer c.now.Add(-1)
	return c.base.RoundTrip(req)
}

// A delivery the balance system holds does not wait for the HTTP timeout: the entry
// is sent again (a hedge), settles, and the held request is cancelled.
func TestHeldDeliveryIsHedged(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-hedge", 20, 2_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	grants := a.grab(t, 0, 10)
	var mu sync.Mutex
	first := map[string]bool{}
	var cancelled atomic.Int64
	rcv.setReject(func(r *http.Request, d Delivery) int {
		mu.Lock()
		seen := first[d.PacketID]
		first[d.PacketID] = true
		hold := !seen && len(first) <= 3
		mu.Unlock()
		if hold {
			<-r.Context().Done()
			cancelled.Add(1)
			return http.StatusServiceUnavailable
		}
		return 0
	})
	reg := prometheus.NewRegistry()
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.HTTPClient = &http.Client{Timeout: time.Hour}
	cfg.Registerer = reg
	startWorker(t, cfg)
	eventually(t, 30*time.Second, "every grant settled (long before the HTTP timeout)", func() bool {
		return a.snapshot(t).SettledCount == 10
	})
	a.checkSettledExactly(t)
	rcv.checkCredits(t, grants)
	eventually(t, 10*time.Second, "the held requests cancelled", func() bool { return cancelled.Load() == 3 })
	if got := metricValue(t, reg, "redpacket_settlement_hedges_total", ""); got != 3 {
		t.Errorf("%v hedges, want one per held delivery (3)", got)
	}
}

// Against a balance system that is slow for every delivery, the worker stops hedging
// once most deliveries go slow, and waits for the answers: it does not double the
// load nor cut every delivery short.
func TestUniformlySlowBalanceSystemIsNotFloodedWithHedges(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-slow", 30, 3_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	grants := a.grab(t, 0, 24)
	const slowness = 1200 * time.Millisecond // above the hedge delay
	rcv.setReject(func(r *http.Request, _ Delivery) int {
		select {
		case <-time.After(slowness):
			return 0
		case <-r.Context().Done():
			return http.StatusServiceUnavailable
		}
	})
	reg := prometheus.NewRegistry()
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.HTTPClient = &http.Client{Timeout: DefaultHTTPTimeout}
	cfg.Registerer = reg
	startWorker(t, cfg)
	eventually(t, time.Minute, "every grant settled", func() bool {
		return a.snapshot(t).SettledCount == 24
	})
	a.checkSettledExactly(t)
	rcv.checkCredits(t, grants)
	hedges := metricValue(t, reg, "redpacket_settlement_hedges_total", "")
	if hedges >= healthQuorum {
		t.Errorf("%v hedges against a uniformly slow balance system, want fewer than %d", hedges, healthQuorum)
	}
	if st := rcv.stats(); st.requests > len(grants)+healthQuorum {
		t.Errorf("%d requests for %d grants", st.requests, len(grants))
	}
}

// Hedging does not wait for a verdict that only answers can change. The balance
// system fails the first deliveries of five grants at once, so the worker judges it
// down (however many of their retries are credited before the hedge delay), and holds
// those of six more: with the failed entries waiting out a long retry delay and those
// six in flight, no answer would come before the HTTP timeout (an hour here) or the
// first long delay (30 s or more). The held deliveries are hedged after the hedge
// delay all the same, their hedges are credited, the verdict turns, and every grant
// settles within seconds.
func TestHeldDeliveriesAreHedgedWhileTheBalanceSystemIsJudgedDown(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-hedge-down", 20, 2_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	const failing, holding = 5, 6
	grants := a.grab(t, 0, failing+holding)
	var mu sync.Mutex
	seen := map[string]bool{}
	var cancelled atomic.Int64
	rcv.setReject(func(r *http.Request, d Delivery) int {
		mu.Lock()
		first := !seen[d.PacketID]
		seen[d.PacketID] = true
		n := len(seen)
		mu.Unlock()
		switch {
		case !first:
			return 0
		case n <= failing:
			return http.StatusServiceUnavailable
		}
		<-r.Context().Done() // held until the worker gives up on it
		cancelled.Add(1)
		return http.StatusServiceUnavailable
	})
	reg := prometheus.NewRegistry()
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.Concurrency, cfg.MinConcurrency, cfg.MaxConcurrency = 16, 16, 16 // every first delivery at once
	cfg.BackoffBase, cfg.BackoffMax = time.Minute, time.Minute
	cfg.HTTPClient = &http.Client{Timeout: time.Hour}
	cfg.Registerer = reg
	startWorker(t, cfg)
	start := time.Now()
	wait.Until(t, 10*time.Second, "every grant settled", func() (bool, string) {
		s := a.snapshot(t)
		return s.SettledCount == int64(len(grants)), fmt.Sprintf("%d settled, %.0f hedges", s.SettledCount,
			metricValue(t, reg, "redpacket_settlement_hedges_total", ""))
	})
	t.Logf("every grant settled %s after the worker started", time.Since(start).Round(time.Millisecond))
	a.checkSettledExactly(t)
	rcv.checkCredits(t, grants)
	eventually(t, 10*time.Second, "the held requests cancelled", func() bool { return cancelled.Load() == holding })
	if got := metricValue(t, reg, "redpacket_settlement_hedges_total", ""); got != holding {
		t.Errorf("%v hedges, want one per held delivery (%d)", got, holding)
	}
}

// Held deliveries at the end of a burst are hedged too. The balance system holds the
// first delivery of every tenth grant and credits the rest at once (a hedge after
// 50 ms): the burst's prompt answers all come before the hedge delay, and the
// held deliveries' hedge delays then run out together, with nothing new started in
// between. One in ten of the deliveries went slow, not most of them, so every held
// delivery is hedged and every grant settles, long before the HTTP timeout (an hour).
func TestHeldDeliveriesAtTheEndOfABurstAreHedged(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-burst-end", 400, 40_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	grants := a.grab(t, 0, 400)
	var mu sync.Mutex
	seen := map[string]bool{}
	held := map[string]bool{}
	var cancelled atomic.Int64
	rcv.setReject(func(r *http.Request, d Delivery) int {
		mu.Lock()
		first := !seen[d.PacketID]
		seen[d.PacketID] = true
		hold := first && len(seen)%10 == 0
		again := !first && held[d.PacketID]
		if hold {
			held[d.PacketID] = true
		}
		mu.Unlock()
		switch {
		case hold:
			<-r.Context().Done() // held until the worker gives up on it
			cancelled.Add(1)
			return http.StatusServiceUnavailable
		case again:
			time.Sleep(50 * time.Millisecond)
		}
		return 0
	})
	reg := prometheus.NewRegistry()
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.Concurrency, cfg.MinConcurrency, cfg.MaxConcurrency = 64, 64, 64
	cfg.HTTPClient = &http.Client{Timeout: time.Hour}
	cfg.Registerer = reg
	startWorker(t, cfg)
	start := time.Now()
	wait.Until(t, 20*time.Second, "every grant settled", func() (bool, string) {
		s := a.snapshot(t)
		return s.SettledCount == int64(len(grants)), fmt.Sprintf("%d settled, %.0f hedges", s.SettledCount,
			metricValue(t, reg, "redpacket_settlement_hedges_total", ""))
	})
	t.Logf("every grant settled %s after the worker started", time.Since(start).Round(time.Millisecond))
	a.checkSettledExactly(t)
	rcv.checkCredits(t, grants)
	mu.Lock()
	holding := int64(len(held))
	mu.Unlock()
	eventually(t, 10*time.Second, "the held requests cancelled", func() bool { return cancelled.Load() == holding })
	// A prompt delivery slowed past the hedge delay by a loaded machine may be hedged
	// too; every held one must be.
	if got := metricValue(t, reg, "redpacket_settlement_hedges_total", ""); got < float64(holding) {
		t.Errorf("%v hedges, want at least one per held delivery (%d)", got, holding)
	}
}
