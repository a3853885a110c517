package balance

import (
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"redpacket.io/operator/test/pgtest"
)

// BenchmarkGrantsIntoPostgres books b.N grants of one budget, posted by 64 clients
// over HTTP to the handler on a real PostgreSQL (fsync and synchronous_commit on),
// signed as the operator signs them, and, in the same run on the same server and
// pool, b.N plain INSERT … ON CONFLICT DO NOTHING of the same keys by 64 clients: the
// reference. It reports both rates and their ratio. Every credit of one source
// updates the source's row, under its lock, to the commit, so the grants of one
// budget commit one after another.
//
//	go test -run '^$' -bench BenchmarkGrantsIntoPostgres -benchtime 20000x ./internal/balance/
func BenchmarkGrantsIntoPostgres(b *testing.B) {
	pg := pgtest.Start(b)
	e := newEnv(b, pg)
	if a := e.post(announceBudget("bench", 1<<50)); a.status != http.StatusCreated {
		b.Fatalf("announcing: %s", a)
	}
	ctx := b.Context()
	if _, err := e.pool.Exec(ctx, `CREATE TABLE plain (k text PRIMARY KEY, user_id text NOT NULL, amount bigint NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	keys, bodies := make([]string, b.N), make([][]byte, b.N)
	for i := range b.N {
		d := budgetGrant("bench", fmt.Sprintf("p-%d", i/5), i%5, fmt.Sprintf("user-%d", i%1000), 10)
		keys[i], bodies[i] = keyOf(d), mustJSON(b, d)
	}
	const clients = 64
	run := func(op func(i int) error) time.Duration {
		var next atomic.Int64
		var wg sync.WaitGroup
		var failed atomic.Value
		start := time.Now()
		for range clients {
			wg.Go(func() {
				for {
					i := int(next.Add(1)) - 1
					if i >= b.N {
						return
					}
					if err := op(i); err != nil {
						failed.Store(err)
						return
					}
				}
			})
		}
		wg.Wait()
		if err, ok := failed.Load().(error); ok {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	b.ResetTimer()
	plain := run(func(i int) error {
		_, err := e.pool.Exec(ctx, `INSERT INTO plain VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`, keys[i], "user", 10)
		return err
	})
	booked := run(func(i int) error {
		a, err := e.postRaw(keys[i], bodies[i], sign(testKey, bodies[i]))
		if err == nil && a.status != http.StatusCreated {
			err = fmt.Errorf("grant %d: %s", i, a)
		}
		return err
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/booked.Seconds(), "grants/s")
	b.ReportMetric(float64(b.N)/plain.Seconds(), "plain-inserts/s")
	b.ReportMetric(plain.Seconds()/booked.Seconds(), "grants/plain")
	if s := e.source("bench"); s.Grants.Count != int64(b.N) || s.Grants.Sum != 10*int64(b.N) {
		b.Fatalf("the source after %d grants: %+v", b.N, s)
	}
}
