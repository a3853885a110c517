package settlement

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// countingBalance answers 200 to every POST and signals once it has counted want
// distinct credits and the budget's one announcement: the cheapest balance system,
// so that a settlement run's time is the operator's.
type countingBalance struct {
	mu   sync.Mutex
	keys map[string]bool
	want int
	full chan struct{}
}

func (c *countingBalance) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	key := r.Header.Get("Idempotency-Key")
	c.mu.Lock()
	if key != "" && !c.keys[key] {
		c.keys[key] = true
		if len(c.keys) == c.want+1 { // the announcement is one of the keys
			close(c.full)
		}
	}
	c.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

// uncheckedPackets is a budget's check with Verify left out: every entry is delivered
// as read, and BeforeAck does what the check's does. It is the reference of
// BenchmarkBudgetSettlementCheck, never a configuration of the product.
type uncheckedPackets struct{ *packetsCheck }

func (uncheckedPackets) Verify(context.Context, []store.StreamEntry) (map[string]error, error) {
	return nil, nil
}

// BenchmarkBudgetSettlementCheck measures what the check of a budget's entries costs
// per entry (checkPackets: the key's form, the packet's hash or tombstone, and the
// ledger's verdicts in one script per batch), against the same settlement without
// it, in the same run: each iteration settles the grants of packets created and
// grabbed by the store's functions on a fresh budget of 4 shards, once checked and
// once unchecked (alternately, the order swapped every iteration), to a balance
// system that answers 200 at once. It reports ns/entry of both and their ratio.
func BenchmarkBudgetSettlementCheck(b *testing.B) {
	const packets, shares = 400, 5
	ctx := context.Background()
	srv := redistest.Start(b)
	rdb := srv.Client(b)
	if _, err := lua.GrabLibrary.Ensure(ctx, rdb); err != nil {
		b.Fatal(err)
	}
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 10_000, MaxCount: shares, MinShare: 1,
		Distributions: []string{split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: time.Hour}
	seq := 0
	settle := func(checked bool) time.Duration {
		b.StopTimer()
		seq++
		uid := fmt.Sprintf("bench-check-%v-%d", checked, seq)
		bud := store.NewBudget(rdb, uid, 4)
		bal := &countingBalance{keys: map[string]bool{}, want: packets * shares, full: make(chan struct{})}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		hs := &http.Server{Handler: bal, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = hs.Serve(l) }()
		defer func() { _ = hs.Close() }()
		cfg := BudgetConfigFor("shop", uid, uid, "CNY", "http://"+l.Addr().String()+"/credit", 3, []byte("bench-key"),
			Packets{MaxCount: shares})
		cfg.Redis, cfg.Consumer = rdb, "bench"
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
		cfg.Registerer = prometheus.NewRegistry()
		total := int64(packets * shares * 100)
		if _, err := AnnounceBudgetTotal(ctx, cfg, bud, total); err != nil {
			b.Fatal(err)
		}
		if err := bud.Configure(ctx, total, limits); err != nil {
			b.Fatal(err)
		}
		for p := range packets {
			id := fmt.Sprintf("order-%d", p)
			if _, outcome, err := bud.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "merchant", Total: shares * 100, Count: shares,
				Distribution: split.TypeFixed}); err != nil || outcome != store.CreateCreated {
				b.Fatalf("creating %s: %v, %v", id, outcome, err)
			}
			for u := range shares {
				if g, err := bud.GrabPacket(ctx, id, fmt.Sprintf("user-%d", u)); err != nil || g.Outcome != store.PacketGranted {
					b.Fatalf("grab of %s: %+v, %v", id, g, err)
				}
			}
		}
		ws, err := NewBudgetWorkers(cfg, bud)
		if err != nil {
			b.Fatal(err)
		}
		if !checked {
			for _, w := range ws {
				w.verifier = uncheckedPackets{w.verifier.(*packetsCheck)}
			}
		}
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		b.StartTimer()
		start := time.Now()
		go func() { done <- RunAll(wctx, ws) }()
		select {
		case <-bal.full:
		case <-time.After(2 * time.Minute):
			b.Fatalf("%d of %d credits after 2 minutes", len(bal.keys)-1, packets*shares)
		}
		took := time.Since(start)
		b.StopTimer()
		cancel()
		<-done
		if err := bud.Purge(ctx); err != nil {
			b.Fatal(err)
		}
		return took
	}
	var checked, unchecked time.Duration
	b.ResetTimer()
	for i := range b.N {
		if i%2 == 0 {
			unchecked += settle(false)
			checked += settle(true)
		} else {
			checked += settle(true)
			unchecked += settle(false)
		}
	}
	entries := float64(b.N * packets * shares)
	b.ReportMetric(float64(checked.Nanoseconds())/entries, "ns/entry-checked")
	b.ReportMetric(float64(unchecked.Nanoseconds())/entries, "ns/entry-unchecked")
	b.ReportMetric(float64(checked)/float64(unchecked), "checked/unchecked")
}
