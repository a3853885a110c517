package grabsvc

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
)

// BenchmarkGrabsWithAStuckEventsReceiver is POST /v1/packets/{id}/grab through HTTP
// on real redis-servers, for three budgets alike but for their events, each on a
// redis-server of its own with its packet server and its settlement workers
// crediting every grant to a balance system that answers at once: one without
// events; one whose events workers run from the start against a receiver that holds
// every request and never answers; one whose events workers deliver to a receiver
// that answers at once. Each iteration, for each budget in turn, 1,000 packets of 5
// shares are created (not timed) and their 5,000 shares grabbed from 64 keep-alive
// clients (timed). It reports grabs/s of each and the ratios to the budget without
// events.
func BenchmarkGrabsWithAStuckEventsReceiver(b *testing.B) {
	ctx := context.Background()
	answer := func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusNoContent)
	}
	balance := httptest.NewServer(http.HandlerFunc(answer))
	b.Cleanup(balance.Close)
	healthy := httptest.NewServer(http.HandlerFunc(answer))
	b.Cleanup(healthy.Close)
	release := make(chan struct{})
	stuck := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	b.Cleanup(stuck.Close)
	b.Cleanup(func() { close(release) })
	quiet := slog.New(slog.DiscardHandler)

	// budget makes a budget with its settlement workers and, with an events URL, its
	// events workers on a client of their own, all running until the end.
	budget := func(eventsURL string) *packetHarness {
		h := newPacketHarness(b, 1_000_000_000_000, 16)
		if _, err := lua.GrabLibrary.Ensure(ctx, h.admin); err != nil {
			b.Fatal(err)
		}
		cfg := settlement.BudgetConfigFor(h.budget.Namespace, h.budget.Name, string(h.budget.UID), "CNY", balance.URL, 0,
			[]byte("operator-signing-key"), settlement.Packets{MaxCount: packetLimits().MaxCount})
		cfg.Redis, cfg.Consumer, cfg.Logger = h.redis.Client(b), "bench", quiet
		if _, err := settlement.AnnounceBudgetTotal(ctx, cfg, h.handle, 1_000_000_000_000); err != nil {
			b.Fatal(err)
		}
		ws, err := settlement.NewBudgetWorkers(cfg, h.handle)
		if err != nil {
			b.Fatal(err)
		}
		wctx, stop := context.WithCancel(ctx)
		var wg sync.WaitGroup
		wg.Go(func() { _ = settlement.RunAll(wctx, ws) })
		b.Cleanup(func() { stop(); wg.Wait() })
		if eventsURL == "" {
			return h
		}
		if err := settlement.EnsureEventsGroups(ctx, h.handle); err != nil {
			b.Fatal(err)
		}
		ecfg := cfg
		ecfg.WebhookURL, ecfg.HTTPClient = eventsURL, &http.Client{Timeout: 10 * time.Second}
		ecfg.Redis = h.redis.Client(b)
		ews, err := settlement.NewBudgetEventsWorkers(ecfg, store.NewBudget(ecfg.Redis, string(h.budget.UID), h.budget.Shards))
		if err != nil {
			b.Fatal(err)
		}
		wg.Go(func() { settlement.RunEvents(wctx, ews) })
		return h
	}
	modes := []struct {
		name string
		h    *packetHarness
	}{{"off", budget("")}, {"stuck", budget(stuck.URL)}, {"healthy", budget(healthy.URL)}}

	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 128}}
	var next atomic.Int64
	const packets, shares = 1_000, 5
	// round creates packets on h and times the grabs of all their shares from 64
	// clients.
	round := func(h *packetHarness) time.Duration {
		first := next.Add(packets) - packets
		var wg sync.WaitGroup
		for w := range 16 {
			wg.Go(func() {
				for p := first + int64(w); p < first+packets; p += 16 {
					if _, o, err := h.handle.CreatePacket(ctx, store.NewPacket{ID: "e-" + strconv.FormatInt(p, 10), Sender: "m",
						Total: 500, Count: shares, Distribution: "Fixed"}); err != nil || o != store.CreateCreated {
						b.Errorf("creating e-%d: %s, %v", p, o, err)
						return
					}
				}
			})
		}
		wg.Wait()
		var grab atomic.Int64
		start := time.Now()
		for range 64 {
			wg.Go(func() {
				for {
					g := grab.Add(1) - 1
					if g >= packets*shares {
						return
					}
					id := "e-" + strconv.FormatInt(first+g/shares, 10)
					body := `{"userId":"u-` + strconv.FormatInt(g%shares, 10) + `"}`
					resp, err := c.Post(h.http.URL+"/v1/packets/"+id+"/grab", "application/json", strings.NewReader(body))
					if err != nil {
						b.Error(err)
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					_ = resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						b.Errorf("grab of %s: status %d", id, resp.StatusCode)
						return
					}
				}
			})
		}
		wg.Wait()
		return time.Since(start)
	}
	took := make([]time.Duration, len(modes))
	for m := range modes { // a warm-up of each
		round(modes[m].h)
	}
	b.ResetTimer()
	for i := range b.N {
		// Each budget goes first in turn, so none always runs right after another's
		// settlement and events catch up.
		for k := range modes {
			m := (i + k) % len(modes)
			took[m] += round(modes[m].h)
		}
	}
	b.StopTimer()
	rate := func(m int) float64 { return float64(packets*shares*b.N) / took[m].Seconds() }
	b.ReportMetric(rate(0), "grabs/s-events-off")
	b.ReportMetric(rate(1), "grabs/s-events-stuck")
	b.ReportMetric(rate(2), "grabs/s-events-healthy")
	b.ReportMetric(rate(1)/rate(0), "ratio-stuck/off")
	b.ReportMetric(rate(2)/rate(0), "ratio-healthy/off")
	b.Logf("%.0f grabs/s without events, %.0f with a stuck events receiver (%.3f), %.0f with a healthy one (%.3f)",
		rate(0), rate(1), rate(1)/rate(0), rate(2), rate(2)/rate(0))
}
