// Package reconcilebench measures one reconciliation round of a large source: a
// budget whose ledger paid Credits credits (packets of 10 shares) against the
// reference balance system's book on a real PostgreSQL that lost 5 of them and holds
// 5 the operator never paid. BenchmarkReconcileAMillionCredits (settlement) and
// make bench's (n) run it.
package reconcilebench

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
)

// The figure: a source of a million credits that differs in 10 keys.
const (
	GoalCredits = 1_000_000
	// Differences is how many keys differ: half lost by the book, half forged in it.
	Differences = 10
)

// shares is the number of shares of each packet.
const shares = 10

// Config says what to measure on which servers.
type Config struct {
	// DSN is a fresh database of a PostgreSQL server, Redis an empty Redis.
	DSN   string
	Redis *redis.Client
	// Credits is the size of the source, a multiple of 10.
	Credits int
}

// Result is one measured round.
type Result struct {
	Credits int
	// Round is how long the round took; PeakHeap the most heap in use while it ran
	// (sampled every 10 ms), Allocated what it allocated in all, in bytes.
	Round               time.Duration
	PeakHeap, Allocated uint64
	// Outcome is the round's finding.
	Outcome settlement.Reconciliation
}

// Measure fills the ledger and the book, then runs and measures one round. It fails
// unless the round delivers the lost credits again and names the forged ones.
func Measure(ctx context.Context, cfg Config) (Result, error) {
	if cfg.Credits < 100 || cfg.Credits%shares != 0 {
		return Result{}, fmt.Errorf("reconcilebench: %d credits, want a multiple of %d from 100", cfg.Credits, shares)
	}
	pool, err := pgxpool.New(ctx, cfg.DSN)
	if err != nil {
		return Result{}, fmt.Errorf("connecting to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if _, err := balance.Migrate(ctx, pool); err != nil {
		return Result{}, err
	}
	key := []byte("operator-signing-key")
	url, stop, err := serve(pool, key)
	if err != nil {
		return Result{}, err
	}
	defer stop()

	const uid = "rpb-reconcile-bench"
	packets := cfg.Credits / shares
	bud := store.NewBudget(cfg.Redis, uid, 1)
	ledger := bud.SettlementLedger(0)
	at := time.Now().Add(-time.Hour).UnixMilli()
	amount := func(i int) int64 { return int64(1 + i%7) }
	var granted int64
	pipe := cfg.Redis.Pipeline()
	for p := range packets {
		fields := []any{"open", fmt.Sprintf("%d:%d:%d:merchant", shares*7, at, at+3_600_000), "sh", "", "paid", 0}
		for s := range shares {
			i := p*shares + s
			fields = append(fields, strconv.Itoa(s), fmt.Sprintf("%d:%d:user-%d", amount(i), at, i%50_000))
			granted += amount(i)
		}
		pipe.HSet(ctx, ledger.PacketKey("p"+strconv.Itoa(p)), fields...)
		if pipe.Len() >= 5000 {
			if _, err := pipe.Exec(ctx); err != nil {
				return Result{}, fmt.Errorf("writing the ledger: %w", err)
			}
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return Result{}, fmt.Errorf("writing the ledger: %w", err)
	}
	if err := cfg.Redis.HSet(ctx, ledger.Key(), "total", granted+10_000, "credited", granted, "grants", cfg.Credits, "granted", granted).Err(); err != nil {
		return Result{}, fmt.Errorf("writing the ledger: %w", err)
	}
	exec := func(sql string, args ...any) error {
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			return fmt.Errorf("filling the book: %w", err)
		}
		return nil
	}
	if err := exec(`INSERT INTO sources (uid, kind, name, currency, total, grants, grant_sum)
		VALUES ($1, 'budget', 'bench/reconcile', 'CNY', $2, $3, $4)`, uid, granted+10_000, cfg.Credits, granted); err != nil {
		return Result{}, err
	}
	if err := exec(`INSERT INTO credits (idempotency_key, digest, kind, user_id, amount, currency, source_uid, packet_id, at)
		SELECT $1 || '/p' || (i / 10) || '/' || (i % 10), sha256(i::text::bytea), 'grant', 'user-' || (i % 50000), 1 + i % 7, 'CNY', $1,
			'p' || (i / 10) || '/' || (i % 10), to_timestamp($2 / 1000.0)
		FROM generate_series(0, $3 - 1) AS i`, uid, at, cfg.Credits); err != nil {
		return Result{}, err
	}
	for i := range Differences / 2 {
		if err := exec(`DELETE FROM credits WHERE idempotency_key = $1`, fmt.Sprintf("%s/p%d/3", uid, packets/(Differences/2)*i)); err != nil {
			return Result{}, err
		}
		if err := exec(`INSERT INTO credits (idempotency_key, digest, kind, user_id, amount, currency, source_uid, packet_id, at)
			VALUES ($1, sha256('forged'), 'grant', 'mallory', 1000, 'CNY', $2, $3, now())`,
			fmt.Sprintf("%s/forged-%d/0", uid, i), uid, fmt.Sprintf("forged-%d/0", i)); err != nil {
			return Result{}, err
		}
	}
	if err := exec(`ANALYZE credits`); err != nil {
		return Result{}, err
	}

	scfg := settlement.BudgetConfigFor("bench", "reconcile", uid, "CNY", url, 3, key, settlement.Packets{MaxCount: shares})
	scfg.Redis, scfg.Consumer = cfg.Redis, "operator-bench"
	rc, err := settlement.NewBudgetReconciler(scfg, bud)
	if err != nil {
		return Result{}, err
	}
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	var peak atomic.Uint64
	halt, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		var m runtime.MemStats
		for {
			runtime.ReadMemStats(&m)
			if m.HeapInuse > peak.Load() {
				peak.Store(m.HeapInuse)
			}
			select {
			case <-halt:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	start := time.Now()
	r, err := rc.Reconcile(ctx)
	round := time.Since(start)
	close(halt)
	<-sampled
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if err != nil {
		return Result{}, fmt.Errorf("the round: %w", err)
	}
	if r.Redelivered != Differences/2 || r.Unpaid != Differences/2 || r.Outcome != settlement.ReconcileDiffers {
		return Result{}, fmt.Errorf("the round found %s; want %d delivered again and %d named", r, Differences/2, Differences/2)
	}
	return Result{Credits: cfg.Credits, Round: round, PeakHeap: peak.Load(), Allocated: after.TotalAlloc - before.TotalAlloc, Outcome: r}, nil
}

// serve runs the reference balance system on pool over loopback HTTP, verifying key.
func serve(pool *pgxpool.Pool, key []byte) (url string, stop func(), err error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: balance.Handler(balance.Config{
		Book: balance.NewBook(pool), Keys: [][]byte{key}, Log: slog.New(slog.DiscardHandler)})}
	go func() { _ = srv.Serve(l) }()
	return "http://" + l.Addr().String() + "/v1/credits", func() { _ = srv.Close() }, nil
}
