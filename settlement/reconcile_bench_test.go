package settlement

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"redpacket.io/operator/store"
	"redpacket.io/operator/test/pgtest"
)

// BenchmarkReconcileAMillionCredits reconciles a budget whose ledger paid 1,000,000
// credits (100,000 packets of 10 shares) with the reference balance system's book on
// a real PostgreSQL that lost 5 of them and holds 5 the operator never paid: one
// round pages through both sides, delivers the 5 again and names the 5. It reports
// the round's seconds and the operator's heap: the peak in use during the round
// (sampled every 10 ms) and what the round allocated in all. Run it with
//
//	go test -run '^$' -bench BenchmarkReconcileAMillionCredits -benchtime 1x ./settlement/
//
// RECONCILE_BENCH_CREDITS sets another size (a multiple of 10).
func BenchmarkReconcileAMillionCredits(b *testing.B) {
	credits := 1_000_000
	if v := os.Getenv("RECONCILE_BENCH_CREDITS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 100 || n%10 != 0 {
			b.Fatalf("RECONCILE_BENCH_CREDITS=%q: want a multiple of 10 from 100", v)
		}
		credits = n
	}
	const shares = 10
	packets := credits / shares
	pg := pgtest.Start(b)
	ctx := context.Background()
	key := []byte("operator-signing-key")
	bal := newReferenceBalance(b, pg, key)
	rdb := newRedis(b)
	const uid = "rpb-million"
	bud := store.NewBudget(rdb, uid, 1)
	ledger := bud.SettlementLedger(0)
	at := time.Now().Add(-time.Hour).UnixMilli()
	amount := func(p, s int) int64 { return int64(1 + (p*shares+s)%7) }

	// The operator's side: the packets' accounts and the ledger's sums.
	var granted int64
	pipe := rdb.Pipeline()
	for p := range packets {
		fields := []any{"open", fmt.Sprintf("%d:%d:%d:merchant", shares*7, at, at+3_600_000), "sh", "", "paid", 0}
		for s := range shares {
			fields = append(fields, strconv.Itoa(s), fmt.Sprintf("%d:%d:user-%d", amount(p, s), at, (p*shares+s)%50_000))
			granted += amount(p, s)
		}
		pipe.HSet(ctx, ledger.PacketKey("p"+strconv.Itoa(p)), fields...)
		if pipe.Len() >= 5000 {
			if _, err := pipe.Exec(ctx); err != nil {
				b.Fatal(err)
			}
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		b.Fatal(err)
	}
	if err := rdb.HSet(ctx, ledger.Key(), "total", granted+10_000, "credited", granted, "grants", credits, "granted", granted).Err(); err != nil {
		b.Fatal(err)
	}

	// The balance system's book: the same credits, all but 5, and 5 never paid.
	bal.exec(b, `INSERT INTO sources (uid, kind, name, currency, total, grants, grant_sum)
		VALUES ($1, 'budget', 'bench/million', 'CNY', $2, $3, $4)`, uid, granted+10_000, credits, granted)
	bal.exec(b, `INSERT INTO credits (idempotency_key, digest, kind, user_id, amount, currency, source_uid, packet_id, at)
		SELECT $1 || '/p' || (i / 10) || '/' || (i % 10), sha256(i::text::bytea), 'grant', 'user-' || (i % 50000), 1 + i % 7, 'CNY', $1,
			'p' || (i / 10) || '/' || (i % 10), to_timestamp($2 / 1000.0)
		FROM generate_series(0, $3 - 1) AS i`, uid, at, credits)
	for i := range 5 {
		p := packets / 5 * i
		bal.exec(b, `DELETE FROM credits WHERE idempotency_key = $1`, fmt.Sprintf("%s/p%d/3", uid, p))
		bal.exec(b, `INSERT INTO credits (idempotency_key, digest, kind, user_id, amount, currency, source_uid, packet_id, at)
			VALUES ($1, sha256('forged'), 'grant', 'mallory', 1000, 'CNY', $2, $3, now())`,
			fmt.Sprintf("%s/forged-%d/0", uid, i), uid, fmt.Sprintf("forged-%d/0", i))
	}
	bal.exec(b, `ANALYZE credits`)

	cfg := BudgetConfigFor("bench", "million", uid, "CNY", bal.url(), 3, key, Packets{MaxCount: shares})
	cfg.Redis, cfg.Consumer = rdb, "operator-bench"
	rc, err := NewBudgetReconciler(cfg, bud)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for range b.N {
		runtime.GC()
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		var peak atomic.Uint64
		stop := make(chan struct{})
		sampled := make(chan struct{})
		go func() {
			defer close(sampled)
			var m runtime.MemStats
			for {
				runtime.ReadMemStats(&m)
				if m.HeapInuse > peak.Load() {
					peak.Store(m.HeapInuse)
				}
				select {
				case <-stop:
					return
				case <-time.After(10 * time.Millisecond):
				}
			}
		}()
		start := time.Now()
		r, err := rc.Reconcile(ctx)
		elapsed := time.Since(start)
		close(stop)
		<-sampled
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		if err != nil {
			b.Fatal(err)
		}
		if r.Redelivered != 5 || r.Unpaid != 5 || r.Outcome != ReconcileDiffers {
			b.Fatalf("round: %+v, want 5 delivered again and 5 unpaid", r)
		}
		b.ReportMetric(elapsed.Seconds(), "round-s")
		b.ReportMetric(float64(peak.Load())/(1<<20), "peak-heap-MB")
		b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/(1<<20), "alloc-MB")
		b.ReportMetric(float64(credits), "credits")
		b.Logf("%d credits reconciled in %s: %s", credits, elapsed, r.String()[:200])
		// The 5 are booked again: the next round deletes nothing more.
		bal.exec(b, `DELETE FROM credits WHERE idempotency_key LIKE $1`, uid+"/forged-%")
	}
}
