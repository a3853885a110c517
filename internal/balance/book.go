package balance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Book is the ledger in PostgreSQL. Its invariants, each held by the database:
//
//   - an Idempotency-Key is booked once: the primary keys of credits and
//     announcements; a repeat with the same digest is answered as a replay, one
//     with another digest is refused;
//   - a source's grants plus refunds never exceed its announced total, and an
//     activity's grants never exceed its count: a batch of credits adds to its
//     source's running sums in the transaction that inserts them, under the
//     source row's lock, only where they stay within the bounds (the whole batch
//     by an UPDATE that requires them, or, judged credit by credit, each credit in
//     order against the sums read FOR UPDATE), and the sources table's CHECK
//     constraints refuse anything else;
//   - a user's balance is the sum of the credits booked to them: it changes only in
//     the transaction that inserts a credit;
//   - a source's total only grows: an announcement raises it to the highest amount
//     announced, never lowers it.
//
// Nothing is acknowledged before its transaction has committed (synchronous_commit
// is left on), so a 2xx survives a crash of the balance system or of PostgreSQL.
//
// The credits of one source that arrive together share a transaction and its
// commit (groupcommit.go); a key queued or being booked in this process is
// answered ErrInFlight at once, as the key's advisory lock answers it across
// replicas.
type Book struct {
	pool *pgxpool.Pool
	// maxBatch bounds the credits one transaction books.
	maxBatch int

	mu sync.Mutex
	// queues holds, by source UID, the credits waiting for a batch and the keys
	// this process is booking; a source has a queue while its batches run.
	queues map[string]*sourceQueue
}

// NewBook returns the book kept in pool's database, whose schema Migrate made.
func NewBook(pool *pgxpool.Pool) *Book {
	return &Book{pool: pool, maxBatch: DefaultMaxBatch, queues: map[string]*sourceQueue{}}
}

// Outcome is what a POST did, when it did not fail.
type Outcome int

const (
	// Booked: the key was new and its credit or announcement is now booked.
	Booked Outcome = iota
	// Replayed: the key was booked before with the same digest; nothing changed.
	Replayed
)

// The reasons a POST is refused by the book, each with its status code in the
// handler (status.go).
var (
	// ErrInFlight: another request with the same key is being booked right now, in
	// this process (queued or in a running batch) or in another transaction.
	ErrInFlight = errors.New("another request with this Idempotency-Key is in flight")
	// ErrKeyReused: the key was booked with another body.
	ErrKeyReused = errors.New("the Idempotency-Key was booked with another body")
	// ErrUnknownSource: no announcement made the credit's source.
	ErrUnknownSource = errors.New("no budget was announced for this source")
	// ErrOverBudget: the credit would take the source's grants plus refunds beyond
	// its announced total.
	ErrOverBudget = errors.New("the credit would exceed the source's announced total")
	// ErrOverCount: the grant would take an activity's grants beyond its count.
	ErrOverCount = errors.New("the grant would exceed the activity's announced count of packets")
	// ErrSourceMismatch: the source exists with another kind or currency.
	ErrSourceMismatch = errors.New("the source was announced with another kind or currency")
)

// lockKey takes the transaction-scoped advisory lock of an Idempotency-Key without
// waiting: false when another transaction holds it. The lock's key is the 64-bit
// hash of the Idempotency-Key; two keys that share a hash only make one of them wait
// for a retry (409), never book anything wrong: the primary key decides.
func lockKey(ctx context.Context, tx pgx.Tx, key string) (bool, error) {
	var ok bool
	if err := tx.QueryRow(ctx, "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))", key).Scan(&ok); err != nil {
		return false, fmt.Errorf("locking the Idempotency-Key: %w", err)
	}
	return ok, nil
}

// Post books one checked request: a credit in its source's next batch
// (groupcommit.go), an announcement in a transaction of its own.
func (b *Book) Post(ctx context.Context, r request) (Outcome, error) {
	if !r.announce {
		return b.credit(ctx, r)
	}
	for attempt := 1; ; attempt++ {
		var out Outcome
		err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
			var err error
			out, err = b.announce(ctx, tx, r)
			return err
		})
		var pgErr *pgconn.PgError
		if attempt < 3 && errors.As(err, &pgErr) && (pgErr.Code == "23505" || pgErr.Code == "40P01") {
			// A unique violation on the key (a transaction that held it committed
			// between our lock and our read: booked now, so the next attempt reads
			// it as a replay or a reuse) or a deadlock: try again.
			continue
		}
		if errors.As(err, &pgErr) && pgErr.Code == "23505" {
			return 0, ErrInFlight
		}
		return out, err
	}
}

// announce books an announcement: it makes the source, or raises its total to the
// highest amount announced (a budget's), and records the announcement's key.
func (b *Book) announce(ctx context.Context, tx pgx.Tx, r request) (Outcome, error) {
	if booked, out, err := claimKey(ctx, tx, r, "announcements"); booked || err != nil {
		return out, err
	}
	d := r.d
	var count *int64
	if r.source == SourceKindActivity {
		count = &d.Count
	}
	// An activity is announced once (its only announcement key is "<uid>/budget"), so
	// it never meets its own row here; a budget's total becomes the highest announced.
	tag, err := tx.Exec(ctx, `INSERT INTO sources (uid, kind, name, currency, total, count) VALUES ($1, $2, $3, $4, $5, $6)
		ON CONFLICT (uid) DO UPDATE SET total = GREATEST(sources.total, excluded.total)
		WHERE sources.kind = 'budget' AND excluded.kind = 'budget' AND sources.currency = excluded.currency`,
		d.ActivityUID, r.source, d.Activity, d.Currency, d.Amount, count)
	if err != nil {
		return 0, fmt.Errorf("announcing source %s: %w", d.ActivityUID, err)
	}
	if tag.RowsAffected() != 1 {
		return 0, fmt.Errorf("%w: source %s", ErrSourceMismatch, d.ActivityUID)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO announcements (idempotency_key, source_uid, amount, count, digest, at)
		VALUES ($1, $2, $3, $4, $5, $6)`, r.key, d.ActivityUID, d.Amount, count, r.digest, r.at); err != nil {
		return 0, fmt.Errorf("recording announcement %s: %w", r.key, err)
	}
	return Booked, nil
}

// claimKey takes r's Idempotency-Key in tx (lockKey) and looks it up in table
// (credits or announcements): booked is true, with Replayed, when the key was booked
// with r's digest; a key booked with another digest is ErrKeyReused, one another
// transaction holds ErrInFlight. booked false with no error: the key is new and
// this transaction holds it.
func claimKey(ctx context.Context, tx pgx.Tx, r request, table string) (booked bool, out Outcome, err error) {
	if ok, err := lockKey(ctx, tx, r.key); err != nil || !ok {
		return false, 0, errOr(err, ErrInFlight)
	}
	var digest []byte
	err = tx.QueryRow(ctx, "SELECT digest FROM "+table+" WHERE idempotency_key = $1", r.key).Scan(&digest)
	switch {
	case err == nil:
		if bytes.Equal(digest, r.digest) {
			return true, Replayed, nil
		}
		return false, 0, ErrKeyReused
	case !errors.Is(err, pgx.ErrNoRows):
		return false, 0, fmt.Errorf("reading %s %s: %w", table, r.key, err)
	}
	return false, 0, nil
}

// errOr is err, or else fallback.
func errOr(err, fallback error) error {
	if err != nil {
		return err
	}
	return fallback
}

// Source is one source's book: what was announced and what was credited against it.
type Source struct {
	UID      string `json:"uid"`
	Kind     string `json:"kind"`
	Name     string `json:"name"`
	Currency string `json:"currency"`
	// Total is the announced total (a budget's highest announcement).
	Total int64 `json:"total"`
	// Count is an activity's announced number of packets; nil for a budget.
	Count   *int64 `json:"count,omitempty"`
	Grants  Tally  `json:"grants"`
	Refunds Tally  `json:"refunds"`
	// Credited is Grants.Sum + Refunds.Sum, never above Total.
	Credited int64 `json:"credited"`
}

// Tally is a number of credits and their sum.
type Tally struct {
	Count int64 `json:"count"`
	Sum   int64 `json:"sum"`
}

// Source reads a source's book; ok is false when no announcement made it.
func (b *Book) Source(ctx context.Context, uid string) (s Source, ok bool, err error) {
	err = b.pool.QueryRow(ctx, `SELECT uid, kind, name, currency, total, count, grants, grant_sum, refunds, refund_sum
		FROM sources WHERE uid = $1`, uid).Scan(&s.UID, &s.Kind, &s.Name, &s.Currency, &s.Total, &s.Count,
		&s.Grants.Count, &s.Grants.Sum, &s.Refunds.Count, &s.Refunds.Sum)
	if errors.Is(err, pgx.ErrNoRows) {
		return Source{}, false, nil
	}
	if err != nil {
		return Source{}, false, fmt.Errorf("reading source %s: %w", uid, err)
	}
	s.Credited = s.Grants.Sum + s.Refunds.Sum
	return s, true, nil
}

// Credit is one booked credit as the read API shows it.
type Credit struct {
	Key      string `json:"key"`
	Kind     string `json:"kind"`
	UserID   string `json:"userId"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	PacketID string `json:"packetId"`
	At       string `json:"at"`
	// Digest is the hex SHA-256 of the delivery's canonical form (delivery.go).
	Digest string `json:"digest"`
}

// Credits reads up to limit credits of a source whose keys sort after after (all
// when after is empty), in key order (byte order: the "C" collation).
func (b *Book) Credits(ctx context.Context, uid, after string, limit int) ([]Credit, error) {
	rows, err := b.pool.Query(ctx, `SELECT `+creditColumns+`
		FROM credits WHERE source_uid = $1 AND idempotency_key COLLATE "C" > $2
		ORDER BY idempotency_key COLLATE "C" LIMIT $3`, uid, after, limit)
	if err != nil {
		return nil, fmt.Errorf("reading the credits of %s: %w", uid, err)
	}
	credits, err := collectCredits(rows)
	if err != nil {
		return nil, fmt.Errorf("reading the credits of %s: %w", uid, err)
	}
	return credits, nil
}

// creditColumns are the columns collectCredits reads, in its order.
const creditColumns = `idempotency_key, kind, user_id, amount, currency, packet_id, at, encode(digest, 'hex')`

// collectCredits reads every row of a query of creditColumns, and closes rows.
func collectCredits(rows pgx.Rows) ([]Credit, error) {
	defer rows.Close()
	credits := []Credit{}
	for rows.Next() {
		var c Credit
		var at time.Time
		if err := rows.Scan(&c.Key, &c.Kind, &c.UserID, &c.Amount, &c.Currency, &c.PacketID, &at, &c.Digest); err != nil {
			return nil, err
		}
		c.At = at.UTC().Format(time.RFC3339Nano)
		credits = append(credits, c)
	}
	return credits, rows.Err()
}

// UserBalance is a user's balance in one currency.
type UserBalance struct {
	Currency string `json:"currency"`
	Amount   int64  `json:"amount"`
	// Credits is how many credits make it up.
	Credits int64 `json:"credits"`
}

// Balances reads a user's balances, one per currency (none when nothing was
// credited to them).
func (b *Book) Balances(ctx context.Context, user string) ([]UserBalance, error) {
	rows, err := b.pool.Query(ctx, "SELECT currency, amount, credits FROM balances WHERE user_id = $1 ORDER BY currency", user)
	if err != nil {
		return nil, fmt.Errorf("reading the balance of %s: %w", user, err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (UserBalance, error) {
		var u UserBalance
		err := row.Scan(&u.Currency, &u.Amount, &u.Credits)
		return u, err
	})
	if err != nil {
		return nil, fmt.Errorf("reading the balance of %s: %w", user, err)
	}
	if out == nil {
		out = []UserBalance{}
	}
	return out, nil
}

// Ping checks that the database answers.
func (b *Book) Ping(ctx context.Context) error { return b.pool.Ping(ctx) }
