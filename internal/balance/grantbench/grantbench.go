// Package grantbench measures how fast the reference balance system books grants:
// grants of one budget posted over HTTP by concurrent clients to balance.Handler,
// signed as the operator signs them (Standard Webhooks v1), into a real PostgreSQL,
// and, in the same run on the same server and pool, plain INSERT … ON CONFLICT DO
// NOTHING of the same keys by as many clients: the reference the grants are
// compared with. BenchmarkGrantsIntoPostgres (internal/balance) and hack/bench
// (docs/benchmarks.md) both run it.
package grantbench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/pkg/webhooksig"
)

// The goals for the balance system on PostgreSQL with fsync on.
const (
	// GoalGrants grants must be booked within GoalSeconds.
	GoalGrants  = 100_000
	GoalSeconds = 60
	// GoalRatio is the least grants/s over plain inserts/s.
	GoalRatio = 0.7
)

// Config is one measurement's.
type Config struct {
	// DSN is the connection string of an empty database the measurement may
	// migrate and write into.
	DSN string
	// Grants is how many grants are booked, and how many plain rows inserted.
	Grants int
	// Clients is how many concurrent clients post the grants, and insert the plain
	// rows; 0: 64.
	Clients int
	// MaxConns bounds the pool that both the balance system and the plain inserts
	// use; 0: 32.
	MaxConns int32
}

// Result is one measurement's figures.
type Result struct {
	Grants, Clients int
	// Plain is how long the plain inserts took, Booked how long the grants took.
	Plain, Booked time.Duration
}

// GrantsPerSecond is the rate grants were booked at.
func (r Result) GrantsPerSecond() float64 { return float64(r.Grants) / r.Booked.Seconds() }

// PlainPerSecond is the rate of the plain inserts.
func (r Result) PlainPerSecond() float64 { return float64(r.Grants) / r.Plain.Seconds() }

// Ratio is grants per second over plain inserts per second.
func (r Result) Ratio() float64 { return r.Plain.Seconds() / r.Booked.Seconds() }

// SecondsFor is how long n grants take at the measured rate: the time measured
// when n is Grants, a projection otherwise.
func (r Result) SecondsFor(n int) float64 { return float64(n) / r.GrantsPerSecond() }

// signingKey signs the measurement's deliveries; the handler holds it.
var signingKey = []byte("grantbench-signing-key")

// budgetUID is the budget every grant draws from.
const budgetUID = "bench"

// Measure migrates cfg.DSN's database, serves balance.Handler on it over loopback
// HTTP, announces a budget large enough for every grant, then inserts cfg.Grants
// plain rows and books cfg.Grants grants of that budget (each 201, or the
// measurement fails), and checks the budget's sums against them.
func Measure(ctx context.Context, cfg Config) (Result, error) {
	if cfg.Grants <= 0 {
		return Result{}, fmt.Errorf("grants %d: it must be above 0", cfg.Grants)
	}
	if cfg.Clients == 0 {
		cfg.Clients = 64
	}
	if cfg.MaxConns == 0 {
		cfg.MaxConns = 32
	}
	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return Result{}, fmt.Errorf("parsing the database URL: %w", err)
	}
	pcfg.MaxConns = cfg.MaxConns
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return Result{}, fmt.Errorf("connecting to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if _, err := balance.Migrate(ctx, pool); err != nil {
		return Result{}, fmt.Errorf("migrating: %w", err)
	}
	book := balance.NewBook(pool)
	srv := httptest.NewServer(balance.Handler(balance.Config{Book: book, Keys: [][]byte{signingKey},
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}))
	defer srv.Close()
	transport := &http.Transport{MaxIdleConnsPerHost: 2 * cfg.Clients}
	defer transport.CloseIdleConnections()
	client := &http.Client{Transport: transport, Timeout: 30 * time.Second}

	const amount = 10
	at := time.Now().UTC().Format(time.RFC3339Nano)
	announcement := balance.Delivery{Kind: balance.KindBudget, Source: balance.SourceBudget, Activity: "default/" + budgetUID,
		ActivityUID: budgetUID, Amount: 1 << 50, Currency: "CNY", At: at}
	announcementBody, err := json.Marshal(announcement)
	if err != nil {
		return Result{}, fmt.Errorf("encoding the announcement: %w", err)
	}
	if err := post(ctx, client, srv.URL, fmt.Sprintf("%s/budget:%d", budgetUID, announcement.Amount), announcementBody); err != nil {
		return Result{}, fmt.Errorf("announcing the budget: %w", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE plain (k text PRIMARY KEY, user_id text NOT NULL, amount bigint NOT NULL)`); err != nil {
		return Result{}, fmt.Errorf("making the plain table: %w", err)
	}
	// The grants' bodies are encoded before the clock starts, as the operator's are
	// before it sends them; each is signed when it is posted.
	keys, users, bodies := make([]string, cfg.Grants), make([]string, cfg.Grants), make([][]byte, cfg.Grants)
	for i := range cfg.Grants {
		// Packets of five shares, to a thousand users.
		packetID := fmt.Sprintf("p-%d/%d", i/5, i%5)
		keys[i], users[i] = budgetUID+"/"+packetID, fmt.Sprintf("user-%d", i%1000)
		if bodies[i], err = json.Marshal(balance.Delivery{Kind: balance.KindGrant, Source: balance.SourceBudget,
			Activity: "default/" + budgetUID, ActivityUID: budgetUID, PacketID: packetID, UserID: users[i], Amount: amount,
			Currency: "CNY", At: at,
			SourceRef: &balance.SourceRef{Kind: "RedPacketBudget", Namespace: "default", Name: budgetUID, UID: budgetUID}}); err != nil {
			return Result{}, fmt.Errorf("encoding grant %s: %w", keys[i], err)
		}
	}

	res := Result{Grants: cfg.Grants, Clients: cfg.Clients}
	if res.Plain, err = closedLoop(cfg.Grants, cfg.Clients, func(i int) error {
		_, err := pool.Exec(ctx, `INSERT INTO plain VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`, keys[i], users[i], int64(amount))
		return err
	}); err != nil {
		return Result{}, fmt.Errorf("plain inserts: %w", err)
	}
	if res.Booked, err = closedLoop(cfg.Grants, cfg.Clients, func(i int) error {
		return post(ctx, client, srv.URL, keys[i], bodies[i])
	}); err != nil {
		return Result{}, fmt.Errorf("grants: %w", err)
	}
	s, ok, err := book.Source(ctx, budgetUID)
	if err != nil || !ok || s.Grants.Count != int64(cfg.Grants) || s.Grants.Sum != amount*int64(cfg.Grants) {
		return Result{}, fmt.Errorf("the budget after %d grants of %d: %+v (found %v, %v)", cfg.Grants, amount, s, ok, err)
	}
	return res, nil
}

// closedLoop runs op(0) … op(n-1) from clients goroutines, each taking the next
// index as soon as its last op returned, and returns how long they all took; the
// first error stops the loop.
func closedLoop(n, clients int, op func(i int) error) (time.Duration, error) {
	var next atomic.Int64
	var failed atomic.Value
	var wg sync.WaitGroup
	start := time.Now()
	for range clients {
		wg.Go(func() {
			for failed.Load() == nil {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				if err := op(i); err != nil {
					failed.CompareAndSwap(nil, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err, ok := failed.Load().(error); ok {
		return 0, err
	}
	return time.Since(start), nil
}

// post sends body under key, signed now as the operator signs it, and wants 201.
func post(ctx context.Context, client *http.Client, base, key string, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/credits", bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("posting %s: %w", key, err)
	}
	id, now := webhooksig.MessageID(key), time.Now().Unix()
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set(webhooksig.HeaderID, id)
	req.Header.Set(webhooksig.HeaderTimestamp, strconv.FormatInt(now, 10))
	req.Header.Set(webhooksig.HeaderSignature, webhooksig.Sign(webhooksig.Keys{HMAC: [][]byte{signingKey}}, id, now, body))
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("posting %s: %w", key, err)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("reading the answer to %s: %w", key, err)
	}
	if resp.StatusCode != balance.StatusBooked {
		return fmt.Errorf("%s answered %d %s, want %d", key, resp.StatusCode, bytes.TrimSpace(answer), balance.StatusBooked)
	}
	return nil
}
