package settlement_test

import (
	"os"
	"strconv"
	"testing"

	"redpacket.io/operator/settlement/reconcilebench"
	"redpacket.io/operator/test/pgtest"
	"redpacket.io/operator/test/redistest"
)

// BenchmarkReconcileAMillionCredits runs reconcilebench: one reconciliation round of
// a budget whose ledger paid 1,000,000 credits against the reference balance
// system's book on a real PostgreSQL, which lost 5 and holds 5 never paid. It reports
// the round's seconds and the operator's heap (the peak in use during the round,
// and what it allocated in all). Run it with
//
//	go test -run '^$' -bench BenchmarkReconcileAMillionCredits -benchtime 1x ./settlement/
//
// RECONCILE_BENCH_CREDITS sets another size (a multiple of 10).
func BenchmarkReconcileAMillionCredits(b *testing.B) {
	credits := reconcilebench.GoalCredits
	if v := os.Getenv("RECONCILE_BENCH_CREDITS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			b.Fatalf("RECONCILE_BENCH_CREDITS=%q: %v", v, err)
		}
		credits = n
	}
	for range b.N {
		b.StopTimer()
		pg := pgtest.Start(b)
		dsn, err := pg.NewDatabase(b.Context())
		if err != nil {
			b.Fatal(err)
		}
		rdb := redistest.Start(b).Client(b)
		b.StartTimer()
		res, err := reconcilebench.Measure(b.Context(), reconcilebench.Config{DSN: dsn, Redis: rdb, Credits: credits})
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(res.Round.Seconds(), "round-s")
		b.ReportMetric(float64(res.PeakHeap)/(1<<20), "peak-heap-MB")
		b.ReportMetric(float64(res.Allocated)/(1<<20), "alloc-MB")
		b.ReportMetric(float64(res.Credits), "credits")
		b.Logf("%d credits reconciled in %s: %s", res.Credits, res.Round, res.Outcome)
	}
}
