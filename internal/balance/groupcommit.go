package balance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Group commit. The credits of one source are booked in batches: while a batch's
// transaction runs, the credits of that source that arrive meanwhile wait in its
// queue, and the next transaction books up to DefaultMaxBatch of them together,
// with one update of the source's row and one commit (one WAL flush) for all of
// them. One batch of a source runs at a time in a process, so a batch is as large
// as what arrived while the one before it ran: on two shared CPUs, letting a second
// batch run while the first commits made smaller batches and booked fewer grants
// per second (BenchmarkGrantsIntoPostgres at 20,000 grants, grants over plain
// inserts 0.97, 0.84 and 0.85 with two batches at a time against 1.49, 1.35 and
// 1.18 with one, in alternate runs).
//
// A batch is first booked whole, in one round trip (bookAllFresh): every key's
// advisory lock, none of the keys booked, the inserts, the balances, and the
// source's sums updated only where the whole batch fits, then COMMIT, all in one
// pgx.Batch pipeline. That is every batch unless something is amiss. When any
// credit is not new, not in the source's kind and currency, or not within the
// bounds, that transaction fails and books nothing, and the batch is judged credit
// by credit (judgeAndBook), in a transaction of its own, in READ COMMITTED, in two
// round trips (BEGIN opens the first pipeline, COMMIT closes the second):
//
//  1. takes every key's advisory lock without waiting (a key another transaction
//     holds, in this process or another replica, is ErrInFlight), reads the keys
//     already booked (a same digest is Replayed, another ErrKeyReused), and reads
//     the source's row FOR UPDATE, which waits for any other transaction writing
//     that source (another replica's batch, an announcement) and then sees its
//     committed sums;
//  2. judges the remaining credits in their order of arrival against those sums,
//     each one counted into the sums only when it stays within the total and the
//     count, so a refused credit (ErrOverBudget, ErrOverCount, ErrUnknownSource,
//     ErrSourceMismatch) never aborts the others and writes nothing;
//  3. inserts the accepted credits, adds them to their users' balances (one upsert
//     per user, in user order, so that two batches never deadlock on balances),
//     and adds their sum to the source's row with an UPDATE that again requires
//     the bounds, with the sources table's CHECKs behind it;
//  4. commits.
//
// Either way, no request of a batch is answered before its transaction has
// committed (or, for a refusal, rolled back), and every invariant of Book is still
// held by PostgreSQL: replicas each batch their own requests, and their batches of
// one source take turns on its row lock. The queue adds one thing in the process:
// a key posted again while the same key is queued or in a running batch here is
// ErrInFlight at once, as the advisory lock answers it across replicas.

// DefaultMaxBatch bounds the credits one transaction books.
const DefaultMaxBatch = 256

// defaultBatchTimeout bounds a batch's transaction when none of its requests has a
// deadline.
const defaultBatchTimeout = 10 * time.Second

// creditResult is what a queued credit's batch answered for it.
type creditResult struct {
	out Outcome
	err error
}

// queuedCredit is one credit waiting for its batch.
type queuedCredit struct {
	ctx context.Context
	r   request
	// done receives the credit's result once, after its batch has ended; buffered,
	// so that a request that stopped waiting does not hold up its batch.
	done chan creditResult
}

// sourceQueue is a source's credits waiting for a batch, and the keys this process
// holds for it: the queued ones and those of the batch running.
type sourceQueue struct {
	waiting []*queuedCredit
	keys    map[string]struct{}
}

// credit books a grant or a refund in its source's next batch and waits for the
// batch to end. A key already queued or being booked here is ErrInFlight.
func (b *Book) credit(ctx context.Context, r request) (Outcome, error) {
	uid := r.d.ActivityUID
	q := &queuedCredit{ctx: ctx, r: r, done: make(chan creditResult, 1)}
	b.mu.Lock()
	sq, draining := b.queues[uid]
	if !draining {
		sq = &sourceQueue{keys: map[string]struct{}{}}
		b.queues[uid] = sq
	}
	if _, held := sq.keys[r.key]; held {
		b.mu.Unlock()
		return 0, ErrInFlight
	}
	sq.keys[r.key] = struct{}{}
	sq.waiting = append(sq.waiting, q)
	b.mu.Unlock()
	if !draining {
		go b.drain(uid, sq)
	}
	select {
	case res := <-q.done:
		return res.out, res.err
	case <-ctx.Done():
		return 0, fmt.Errorf("waiting for the batch of credit %s: %w", r.key, ctx.Err())
	}
}

// drain books a source's queue in batches, one at a time, until it is empty, then
// forgets the queue: the next credit of the source starts a new one.
func (b *Book) drain(uid string, sq *sourceQueue) {
	for {
		b.mu.Lock()
		if len(sq.waiting) == 0 {
			delete(b.queues, uid)
			b.mu.Unlock()
			return
		}
		n := min(len(sq.waiting), b.maxBatch)
		batch := slices.Clone(sq.waiting[:n])
		sq.waiting = slices.Delete(sq.waiting, 0, n)
		b.mu.Unlock()

		results := b.bookBatch(uid, batch)

		b.mu.Lock()
		for _, q := range batch {
			delete(sq.keys, q.r.key)
		}
		b.mu.Unlock()
		for i, q := range batch {
			q.done <- results[i]
		}
	}
}

// bookBatch books a batch of one source's credits: whole in one round trip when
// it can (bookAllFresh), else judged credit by credit (judgeAndBook) in one
// transaction, retried whole on a deadlock or on a key booked under our feet (a
// unique violation: the next attempt reads it as a replay or a reuse). It returns
// each credit's result, in the batch's order. A credit whose request gave up before
// its batch started is left out.
func (b *Book) bookBatch(uid string, batch []*queuedCredit) []creditResult {
	results := make([]creditResult, len(batch))
	live := make([]*queuedCredit, 0, len(batch))
	liveAt := make([]int, 0, len(batch))
	var deadline time.Time
	for i, q := range batch {
		if err := q.ctx.Err(); err != nil {
			results[i] = creditResult{err: fmt.Errorf("credit %s given up before its batch: %w", q.r.key, err)}
			continue
		}
		live, liveAt = append(live, q), append(liveAt, i)
		if d, ok := q.ctx.Deadline(); !ok {
			deadline = maxTime(deadline, time.Now().Add(defaultBatchTimeout))
		} else {
			deadline = maxTime(deadline, d)
		}
	}
	if len(live) == 0 {
		return results
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	if b.bookAllFresh(ctx, uid, live) {
		for _, i := range liveAt {
			results[i] = creditResult{out: Booked}
		}
		return results
	}
	var verdicts []creditResult
	var err error
	for attempt := 1; ; attempt++ {
		verdicts, err = b.judgeAndBook(ctx, uid, live)
		var pgErr *pgconn.PgError
		if attempt < 3 && errors.As(err, &pgErr) && (pgErr.Code == "23505" || pgErr.Code == "40P01") {
			continue
		}
		break
	}
	for j, i := range liveAt {
		if err != nil {
			results[i] = creditResult{err: fmt.Errorf("booking the batch of %d credits of %s: %w", len(live), uid, err)}
		} else {
			results[i] = verdicts[j]
		}
	}
	return results
}

// maxTime is the later of a and b.
func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// sourceRow is a source's row as a batch reads it under its lock.
type sourceRow struct {
	kind, currency                       string
	total                                int64
	count                                *int64
	grants, grantSum, refunds, refundSum int64
}

// bookAllFresh books the whole batch in one round trip, on the guess that every
// credit is new and that they all fit in the source, as they do unless something
// is amiss. One pipeline: BEGIN; every key's advisory lock, and none of the keys
// booked; the credits inserted; the balances upserted; the source's sums updated
// only where the whole batch stays within the total and the count and the source
// is of the credits' kind and currency; COMMIT. A statement that finds the guess
// wrong fails (a division by zero where a key is held or booked, or where the
// update found no row within the bounds; the foreign key where the source is
// unknown; the primary key where a key was booked after the statement's
// snapshot), the server skips the rest of the pipeline, COMMIT included, and false
// says nothing was booked: judgeAndBook then judges the credits one by one. (A
// COMMIT whose outcome is unknown, the connection lost, is false too: if it did
// commit, judgeAndBook finds the keys booked and answers them as replays.) The
// source's row is locked last, by the update, so it is held only for the commit.
func (b *Book) bookAllFresh(ctx context.Context, uid string, batch []*queuedCredit) bool {
	first := batch[0].r
	accepted := make([]request, len(batch))
	keys := make([]string, len(batch))
	var grants, grantSum, refunds, refundSum int64
	for i, q := range batch {
		r := q.r
		if r.source != first.source || r.d.Currency != first.d.Currency {
			return false
		}
		// Amounts are above 0; a batch whose sum would not fit in an int64 cannot
		// fit in any total, and is left to judgeAndBook, which never sums past one.
		if r.d.Amount > math.MaxInt64-(grantSum+refundSum) {
			return false
		}
		accepted[i], keys[i] = r, r.key
		if r.d.Kind == KindGrant {
			grants, grantSum = grants+1, grantSum+r.d.Amount
		} else {
			refunds, refundSum = refunds+1, refundSum+r.d.Amount
		}
	}
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return false
	}
	defer conn.Release()
	defer func() {
		if conn.Conn().PgConn().TxStatus() != 'I' {
			_, _ = conn.Exec(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()
	pipeline := &pgx.Batch{}
	pipeline.Queue("BEGIN")
	pipeline.Queue(`SELECT 1 / (bool_and(pg_try_advisory_xact_lock(hashtextextended(k, 0)))
			AND bool_and(NOT EXISTS (SELECT FROM credits WHERE idempotency_key = k)))::int
		FROM unnest($1::text[]) AS k`, keys)
	queueCreditInserts(pipeline, uid, first.d.Currency, accepted)
	queueBalanceUpserts(pipeline, first.d.Currency, accepted)
	pipeline.Queue(`WITH updated AS (
			UPDATE sources SET grants = grants + $2, grant_sum = grant_sum + $3, refunds = refunds + $4, refund_sum = refund_sum + $5
			WHERE uid = $1 AND kind = $6 AND currency = $7
			  AND grant_sum + refund_sum + $3 + $5 <= total AND (count IS NULL OR grants + $2 <= count)
			RETURNING 1)
		SELECT 1 / count(*)::int FROM updated`,
		uid, grants, grantSum, refunds, refundSum, first.source, first.d.Currency)
	pipeline.Queue("COMMIT")
	res := conn.SendBatch(ctx, pipeline)
	defer func() { _ = res.Close() }()
	for range 5 { // BEGIN, the keys, the credits, the balances, the source
		if _, err := res.Exec(); err != nil {
			return false
		}
	}
	tag, err := res.Exec()
	if err != nil || tag.String() != "COMMIT" {
		return false
	}
	return res.Close() == nil
}

// judgeAndBook is one attempt at a batch's transaction, credit by credit (see the
// top of this file). Its error fails the whole batch, which is rolled back;
// otherwise each credit has its verdict, and the accepted ones are committed.
func (b *Book) judgeAndBook(ctx context.Context, uid string, batch []*queuedCredit) ([]creditResult, error) {
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("acquiring a connection: %w", err)
	}
	// Released here: a connection left inside a transaction (an error on the way)
	// is closed by the pool rather than reused, which ends the transaction.
	defer conn.Release()
	defer func() {
		if conn.Conn().PgConn().TxStatus() != 'I' {
			_, _ = conn.Exec(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()

	keys := make([]string, len(batch))
	for i, q := range batch {
		keys[i] = q.r.key
	}
	// 1. Begin, claim the keys, read those booked, and lock the source's row: one
	// round trip.
	reads := &pgx.Batch{}
	reads.Queue("BEGIN")
	// Per key, in this order: its advisory lock, then its booked digest, if any
	// (a lookup of the primary key per key: a plan that stays an index scan however
	// the table has grown since the statement was prepared, which "= ANY($1)" does
	// not).
	reads.Queue(`SELECT k, pg_try_advisory_xact_lock(hashtextextended(k, 0)),
		(SELECT digest FROM credits WHERE idempotency_key = k)
		FROM unnest($1::text[]) AS k`, keys)
	reads.Queue(`SELECT kind, currency, total, count, grants, grant_sum, refunds, refund_sum FROM sources WHERE uid = $1 FOR UPDATE`, uid)
	res := conn.SendBatch(ctx, reads)
	if _, err := res.Exec(); err != nil {
		_ = res.Close()
		return nil, fmt.Errorf("beginning: %w", err)
	}
	locked := make(map[string]bool, len(keys))
	bookedDigest := map[string][]byte{}
	if err := scanRows(res, func(row pgx.Rows) error {
		var k string
		var ok bool
		var d []byte
		if err := row.Scan(&k, &ok, &d); err != nil {
			return err
		}
		locked[k] = ok
		if ok && d != nil {
			bookedDigest[k] = d
		}
		return nil
	}); err != nil {
		_ = res.Close()
		return nil, fmt.Errorf("locking and reading the Idempotency-Keys: %w", err)
	}
	var src sourceRow
	err = res.QueryRow().Scan(&src.kind, &src.currency, &src.total, &src.count, &src.grants, &src.grantSum, &src.refunds, &src.refundSum)
	sourceKnown := err == nil
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		_ = res.Close()
		return nil, fmt.Errorf("reading source %s: %w", uid, err)
	}
	if err := res.Close(); err != nil {
		return nil, fmt.Errorf("reading the batch's keys and source: %w", err)
	}

	// 2. Judge each credit in order against the sums, counting in the accepted ones.
	verdicts := make([]creditResult, len(batch))
	var accepted []request
	var grants, grantSum, refunds, refundSum int64
	for i, q := range batch {
		r := q.r
		d := r.d
		switch digest, booked := bookedDigest[r.key]; {
		case !locked[r.key]:
			verdicts[i].err = ErrInFlight
		case booked && bytes.Equal(digest, r.digest):
			verdicts[i].out = Replayed
		case booked:
			verdicts[i].err = ErrKeyReused
		case !sourceKnown:
			verdicts[i].err = ErrUnknownSource
		case src.kind != r.source || src.currency != d.Currency:
			verdicts[i].err = fmt.Errorf("%w: it is a %s in %q, the credit is for a %s in %q", ErrSourceMismatch, src.kind, src.currency, r.source, d.Currency)
		case d.Kind == KindGrant && src.count != nil && src.grants+grants+1 > *src.count:
			verdicts[i].err = fmt.Errorf("%w: %d grants of %d booked", ErrOverCount, src.grants+grants, *src.count)
		// credited never exceeds total, so total-credited cannot overflow.
		case d.Amount > src.total-(src.grantSum+src.refundSum+grantSum+refundSum):
			verdicts[i].err = fmt.Errorf("%w: %d of %d credited, %d more asked", ErrOverBudget,
				src.grantSum+src.refundSum+grantSum+refundSum, src.total, d.Amount)
		default:
			verdicts[i].out = Booked
			accepted = append(accepted, r)
			if d.Kind == KindGrant {
				grants, grantSum = grants+1, grantSum+d.Amount
			} else {
				refunds, refundSum = refunds+1, refundSum+d.Amount
			}
		}
	}
	if len(accepted) == 0 {
		// Nothing to write: the rollback releases the locks.
		return verdicts, nil
	}

	// 3 and 4. Write the accepted credits, their balances and the source's sums, and
	// commit: one round trip. A statement that fails aborts the transaction, and the
	// server skips the rest of the pipeline, COMMIT included.
	writes := &pgx.Batch{}
	queueCreditInserts(writes, uid, src.currency, accepted)
	queueBalanceUpserts(writes, src.currency, accepted)
	writes.Queue(`UPDATE sources SET grants = grants + $2, grant_sum = grant_sum + $3, refunds = refunds + $4, refund_sum = refund_sum + $5
		WHERE uid = $1 AND grant_sum + refund_sum + $3 + $5 <= total AND (count IS NULL OR grants + $2 <= count)`,
		uid, grants, grantSum, refunds, refundSum)
	writes.Queue("COMMIT")
	res = conn.SendBatch(ctx, writes)
	if tag, err := res.Exec(); err != nil || tag.RowsAffected() != int64(len(accepted)) {
		_ = res.Close()
		return nil, fmt.Errorf("inserting %d credits (%d inserted): %w", len(accepted), tag.RowsAffected(), errOr(err, errors.New("a credit was not inserted")))
	}
	if _, err := res.Exec(); err != nil {
		_ = res.Close()
		return nil, fmt.Errorf("adding %d credits to their users' balances: %w", len(accepted), err)
	}
	if tag, err := res.Exec(); err != nil || tag.RowsAffected() != 1 {
		_ = res.Close()
		return nil, fmt.Errorf("adding %d credits to source %s: %w", len(accepted), uid, errOr(err, errors.New("the source's row refused the sums read under its lock")))
	}
	// Nothing is answered before the commit has returned.
	if tag, err := res.Exec(); err != nil || tag.String() != "COMMIT" {
		_ = res.Close()
		return nil, fmt.Errorf("committing %d credits: %w", len(accepted), errOr(err, fmt.Errorf("the commit answered %s", tag)))
	}
	if err := res.Close(); err != nil {
		return nil, fmt.Errorf("writing %d credits: %w", len(accepted), err)
	}
	return verdicts, nil
}

// scanRows reads the next query's rows of a batch's results with scan.
func scanRows(res pgx.BatchResults, scan func(pgx.Rows) error) error {
	rows, err := res.Query()
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := scan(rows); err != nil {
			return err
		}
	}
	return rows.Err()
}

// queueCreditInserts queues one INSERT of every accepted credit of source uid.
func queueCreditInserts(batch *pgx.Batch, uid, currency string, accepted []request) {
	n := len(accepted)
	keys, digests, kinds, users := make([]string, n), make([][]byte, n), make([]string, n), make([]string, n)
	amounts, packets, ats := make([]int64, n), make([]string, n), make([]time.Time, n)
	for i, r := range accepted {
		keys[i], digests[i], kinds[i], users[i] = r.key, r.digest, r.d.Kind, r.d.UserID
		amounts[i], packets[i], ats[i] = r.d.Amount, r.d.PacketID, r.at
	}
	batch.Queue(`INSERT INTO credits (idempotency_key, digest, kind, user_id, amount, currency, source_uid, packet_id, at)
		SELECT k, d, kind, u, a, $6, $7, p, at
		FROM unnest($1::text[], $2::bytea[], $3::text[], $4::text[], $5::bigint[], $8::text[], $9::timestamptz[]) AS t(k, d, kind, u, a, p, at)`,
		keys, digests, kinds, users, amounts, currency, uid, packets, ats)
}

// queueBalanceUpserts queues one upsert of the balances of the accepted credits'
// users: one row per user, with the sum and the number of their credits, in user
// order, so that concurrent batches lock balances rows in one order.
func queueBalanceUpserts(batch *pgx.Batch, currency string, accepted []request) {
	sums, counts := map[string]int64{}, map[string]int64{}
	for _, r := range accepted {
		sums[r.d.UserID] += r.d.Amount
		counts[r.d.UserID]++
	}
	users := make([]string, 0, len(sums))
	for u := range sums {
		users = append(users, u)
	}
	slices.Sort(users)
	amounts, credits := make([]int64, len(users)), make([]int64, len(users))
	for i, u := range users {
		amounts[i], credits[i] = sums[u], counts[u]
	}
	batch.Queue(`INSERT INTO balances (user_id, currency, amount, credits)
		SELECT u, $2, a, c FROM unnest($1::text[], $3::bigint[], $4::bigint[]) AS t(u, a, c) ORDER BY u COLLATE "C"
		ON CONFLICT (user_id, currency) DO UPDATE SET amount = balances.amount + excluded.amount, credits = balances.credits + excluded.credits`,
		users, currency, amounts, credits)
}
