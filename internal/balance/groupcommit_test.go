package balance

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"redpacket.io/operator/test/pgtest"
)

// waiting is how many credits of source uid wait for a batch in this process.
func (b *Book) waiting(uid string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if sq := b.queues[uid]; sq != nil {
		return len(sq.waiting)
	}
	return 0
}

// One batch holding a new credit, a replay, a key reused with another body, a
// credit in another currency and two credits of which only one fits: each gets its
// own answer, the refusals book nothing and abort nothing, and the credits that fit
// are booked. A key posted again while it waits in the queue is 409 at once.
func TestBatchJudgesEachCredit(t *testing.T) {
	pg := pgtest.Start(t)
	e := newEnv(t, pg)
	ctx := t.Context()
	expectBooked(t, e.post(announceBudget("bud-b", 100)))
	expectBooked(t, e.post(budgetGrant("bud-b", "p0", 0, "alice", 5)))
	expectBooked(t, e.post(budgetGrant("bud-b", "p0", 1, "gina", 5)))

	// Another transaction holds the source's row, so the first batch (one credit)
	// waits inside its transaction and the credits posted meanwhile queue up for the
	// next one.
	blocker, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback(context.WithoutCancel(ctx))
	if _, err := blocker.Exec(ctx, "SELECT 1 FROM sources WHERE uid = 'bud-b' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	first := make(chan answer, 1)
	firstCredit := budgetGrant("bud-b", "p1", 0, "bob", 10)
	firstBody := mustJSON(t, firstCredit)
	go func() { first <- e.postAsync(firstCredit, firstBody) }()
	waitForLockWait(t, e.pool)

	inUSD := budgetGrant("bud-b", "p2", 1, "dave", 1)
	inUSD.Currency = "USD"
	batch := map[string]Delivery{
		"fits":           budgetGrant("bud-b", "p2", 0, "carol", 20),
		"replay":         budgetGrant("bud-b", "p0", 0, "alice", 5),
		"reused":         budgetGrant("bud-b", "p0", 1, "gina", 6),
		"other-currency": inUSD,
		"sixty":          budgetGrant("bud-b", "p3", 0, "erin", 60),
		"fifty":          budgetGrant("bud-b", "p3", 1, "frank", 50),
	}
	answers := map[string]answer{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for name, d := range batch {
		body := mustJSON(t, d)
		wg.Go(func() {
			a := e.postAsync(d, body)
			mu.Lock()
			answers[name] = a
			mu.Unlock()
		})
	}
	for deadline := time.Now().Add(10 * time.Second); e.book.waiting("bud-b") < len(batch); {
		if time.Now().After(deadline) {
			mu.Lock()
			t.Fatalf("%d credits queued, want %d; answered meanwhile: %v", e.book.waiting("bud-b"), len(batch), answers)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The same key again, while it waits in the queue.
	a := e.post(batch["sixty"])
	expectError(t, a, StatusInFlight, CodeInFlight)
	if a.header.Get("Retry-After") == "" {
		t.Error("a 409 without Retry-After")
	}

	if err := blocker.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	expectBooked(t, <-first)
	wg.Wait()
	for name, a := range answers {
		t.Logf("%s: %s", name, a)
	}
	expectBooked(t, answers["fits"])
	expectReplayed(t, answers["replay"])
	expectError(t, answers["reused"], StatusKeyReused, CodeKeyReused)
	expectError(t, answers["other-currency"], StatusMalformed, CodeSourceMismatch)
	// 5 + 5 + 10 + 20 booked before them: 60 and 50 do not both fit in 100;
	// whichever came first in the batch is booked.
	sixty, fifty := answers["sixty"], answers["fifty"]
	if !(sixty.status == StatusBooked && fifty.status == StatusOverBudget) && !(fifty.status == StatusBooked && sixty.status == StatusOverBudget) {
		t.Fatalf("60 answered %s and 50 answered %s, want one booked and one refused 403", sixty, fifty)
	}
	want := int64(5 + 5 + 10 + 20 + 60)
	if fifty.status == StatusBooked {
		want = 5 + 5 + 10 + 20 + 50
	}
	if s := e.source("bud-b"); s.Credited != want || s.Grants.Count != 5 {
		t.Fatalf("source %+v, want %d credited in 5 grants", s, want)
	}
	var rows int64
	if err := e.pool.QueryRow(ctx, "SELECT count(*) FROM credits WHERE source_uid = 'bud-b'").Scan(&rows); err != nil || rows != 5 {
		t.Fatalf("%d credit rows (%v), want 5", rows, err)
	}
}

// postAsync posts d's body as post does, from another goroutine than the test's:
// an error is an answer of status -1.
func (e *env) postAsync(d Delivery, body []byte) answer {
	a, err := e.postRaw(keyOf(d), body, sign(testKey, body))
	if err != nil {
		return answer{status: -1, body: []byte(fmt.Sprint(err))}
	}
	return a
}

// A batch whose amounts add up beyond an int64 is judged credit by credit, never
// summed whole: three credits of 2^62 against what is left of a budget of the
// largest total (2^62 - 1) are each refused 403, and none is booked.
func TestBatchSumBeyondInt64IsJudged(t *testing.T) {
	pg := pgtest.Start(t)
	e := newEnv(t, pg)
	ctx := t.Context()
	const quarter = int64(1) << 62
	expectBooked(t, e.post(announceBudget("bud-max", math.MaxInt64)))
	expectBooked(t, e.post(budgetGrant("bud-max", "p0", 0, "alice", quarter)))

	blocker, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback(context.WithoutCancel(ctx))
	if _, err := blocker.Exec(ctx, "SELECT 1 FROM sources WHERE uid = 'bud-max' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	first := budgetGrant("bud-max", "p1", 0, "bob", 1)
	firstBody := mustJSON(t, first)
	firstAnswer := make(chan answer, 1)
	go func() { firstAnswer <- e.postAsync(first, firstBody) }()
	waitForLockWait(t, e.pool)

	// Three users, so that no balance of theirs would overflow either.
	users := []string{"carol", "dave", "erin"}
	answers := make([]answer, len(users))
	var wg sync.WaitGroup
	for i, user := range users {
		d := budgetGrant("bud-max", "p2", i, user, quarter)
		body := mustJSON(t, d)
		wg.Go(func() { answers[i] = e.postAsync(d, body) })
	}
	for deadline := time.Now().Add(10 * time.Second); e.book.waiting("bud-max") < len(answers); {
		if time.Now().After(deadline) {
			t.Fatalf("%d credits queued, want %d", e.book.waiting("bud-max"), len(answers))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := blocker.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	expectBooked(t, <-firstAnswer)
	wg.Wait()
	for i, a := range answers {
		t.Logf("credit %d: %s", i, a)
		expectError(t, a, StatusOverBudget, CodeOverBudget)
	}
	if s := e.source("bud-max"); s.Credited != quarter+1 || s.Grants.Count != 2 {
		t.Fatalf("source %+v, want %d credited in 2 grants", s, quarter+1)
	}
	var rows, balances int64
	if err := e.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM credits WHERE source_uid = 'bud-max'),
		(SELECT count(*) FROM balances WHERE user_id = ANY($1))`, users).Scan(&rows, &balances); err != nil || rows != 2 || balances != 0 {
		t.Fatalf("%d credit rows and %d balances of %v (%v), want 2 and none", rows, balances, users, err)
	}
}
