package balance_test

import (
	"testing"

	"redpacket.io/operator/internal/balance/grantbench"
	"redpacket.io/operator/test/pgtest"
)

// BenchmarkGrantsIntoPostgres books b.N grants of one budget, posted by 64 clients
// over HTTP to the handler on a real PostgreSQL (fsync and synchronous_commit on),
// signed as the operator signs them, and, in the same run on the same server and
// pool, b.N plain INSERT … ON CONFLICT DO NOTHING of the same keys by 64 clients:
// the reference (grantbench.Measure). It reports both rates, their ratio, and the
// seconds 100,000 grants take at the measured rate: the time measured when b.N is
// 100,000, a projection otherwise. The grants of the budget share transactions and
// commits (group commit, groupcommit.go).
//
//	go test -run '^$' -bench BenchmarkGrantsIntoPostgres -benchtime 20000x ./internal/balance/
//	go test -run '^$' -bench BenchmarkGrantsIntoPostgres -benchtime 100000x ./internal/balance/
func BenchmarkGrantsIntoPostgres(b *testing.B) {
	pg := pgtest.Start(b)
	dsn, err := pg.NewDatabase(b.Context())
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	res, err := grantbench.Measure(b.Context(), grantbench.Config{DSN: dsn, Grants: b.N})
	if err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	b.ReportMetric(res.GrantsPerSecond(), "grants/s")
	b.ReportMetric(res.PlainPerSecond(), "plain-inserts/s")
	b.ReportMetric(res.Ratio(), "grants/plain")
	b.ReportMetric(res.SecondsFor(grantbench.GoalGrants), "s/100000-grants")
}
