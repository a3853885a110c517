package balance

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/test/pgtest"
)

// Every status code of POST /v1/credits, on a real PostgreSQL: what it answers, and
// that a refused POST leaves the database exactly as it was.
func TestStatusCodes(t *testing.T) {
	pg := pgtest.Start(t)
	e := newEnv(t, pg)

	t.Run("201 for a new credit, 200 replayed for an identical repeat", func(t *testing.T) {
		expectBooked(t, e.post(announceActivity("act-new", 1000, 10)))
		expectBooked(t, e.post(grant("act-new", 1, "alice", 300)))
		before := e.snapshot()
		for range 3 {
			expectReplayed(t, e.post(grant("act-new", 1, "alice", 300)))
		}
		expectReplayed(t, e.post(announceActivity("act-new", 1000, 10)))
		if after := e.snapshot(); after != before {
			t.Fatalf("a replay changed the book:\n%s\nthen\n%s", before, after)
		}
		s := e.source("act-new")
		if s.Grants != (Tally{Count: 1, Sum: 300}) || s.Credited != 300 || s.Total != 1000 || *s.Count != 10 {
			t.Fatalf("source %+v", s)
		}
	})

	t.Run("400 for a missing key or a malformed body", func(t *testing.T) {
		expectBooked(t, e.post(announceActivity("act-400", 1000, 10)))
		before := e.snapshot()
		body := mustJSON(t, grant("act-400", 1, "alice", 100))
		a, err := e.postRaw("", body, sign(testKey, body))
		if err != nil {
			t.Fatal(err)
		}
		expectError(t, a, StatusMalformed, CodeMissingKey)
		for name, c := range map[string]struct {
			key  string
			body []byte
		}{
			"not JSON":                   {"act-400/1", []byte(`{"kind":"grant",`)},
			"two values":                 {"act-400/1", append(mustJSON(t, grant("act-400", 1, "alice", 100)), []byte(` {}`)...)},
			"key of another packet":      {"act-400/2", mustJSON(t, grant("act-400", 1, "alice", 100))},
			"zero amount":                {"act-400/1", mustJSON(t, grant("act-400", 1, "alice", 0))},
			"negative amount":            {"act-400/1", mustJSON(t, grant("act-400", 1, "alice", -5))},
			"no user":                    {"act-400/1", mustJSON(t, grant("act-400", 1, "", 100))},
			"packet 0":                   {"act-400/0", mustJSON(t, grant("act-400", 0, "alice", 100))},
			"unknown kind":               {"act-400/1", []byte(`{"kind":"gift","activityUID":"act-400","packetId":"1","userId":"a","amount":1,"currency":"CNY","at":"` + testAt + `"}`)},
			"no time":                    {"act-400/1", []byte(`{"kind":"grant","activityUID":"act-400","packetId":"1","userId":"a","amount":1,"currency":"CNY"}`)},
			"announcement without count": {"act-400/budget", mustJSON(t, announceActivity("act-400", 1000, 0))},
			"budget key of a credit":     {"act-400/budget", mustJSON(t, refund("act-400", "sponsor", 10))},
			"sourceRef of another uid":   {"bud-x/p/0", mustJSON(t, func() Delivery { d := budgetGrant("bud-x", "p", 0, "a", 1); d.SourceRef.UID = "other"; return d }())},
		} {
			a, err := e.postRaw(c.key, c.body, sign(testKey, c.body))
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: %s", name, a)
			expectError(t, a, StatusMalformed, CodeMalformed)
		}
		// A source announced as one kind or currency, credited as another.
		d := grant("act-400", 1, "alice", 100)
		d.Currency = "USD"
		expectError(t, e.post(d), StatusMalformed, CodeSourceMismatch)
		expectError(t, e.post(announceBudget("act-400", 5000)), StatusMalformed, CodeSourceMismatch)
		if after := e.snapshot(); after != before {
			t.Fatalf("a refused POST changed the book:\n%s\nthen\n%s", before, after)
		}
	})

	t.Run("401 for a missing, bad or stale signature", func(t *testing.T) {
		expectBooked(t, e.post(announceActivity("act-401", 1000, 10)))
		before := e.snapshot()
		body := mustJSON(t, grant("act-401", 1, "mallory", 100))
		now := time.Now()
		_, stranger, _ := ed25519.GenerateKey(rand.Reader)
		noTimestamp := func(h http.Header, k string) {
			sign(testKey, body)(h, k)
			h.Del(webhooksig.HeaderTimestamp)
		}
		for name, c := range map[string]struct {
			sig  signer
			code string
		}{
			"none":                         {nil, CodeBadSignature},
			"v1 by another key":            {sign([]byte("not the key"), body), CodeBadSignature},
			"v1 of another body":           {sign(testKey, mustJSON(t, grant("act-401", 1, "mallory", 99))), CodeBadSignature},
			"v1a by another key":           {signAt(webhooksig.Keys{Ed25519: []ed25519.PrivateKey{stranger}}, nil, body, now), CodeBadSignature},
			"no webhook-timestamp":         {noTimestamp, CodeBadSignature},
			"X-Signature alone":            {xSignature(webhooksig.XSignature(testKey, body)), CodeBadSignature},
			"not hex":                      {xSignature("sha256=zz"), CodeBadSignature},
			"signed 6 minutes ago":         {signAt(webhooksig.Keys{HMAC: [][]byte{testKey}}, testKey, body, now.Add(-6*time.Minute)), CodeStaleSignature},
			"signed 6 minutes from now":    {signAt(webhooksig.Keys{Ed25519: []ed25519.PrivateKey{testEd25519}}, nil, body, now.Add(6*time.Minute)), CodeStaleSignature},
			"malformed body, no signature": {nil, CodeBadSignature},
		} {
			b := body
			if name == "malformed body, no signature" {
				b = []byte("not even JSON")
			}
			a, err := e.postRaw("act-401/1", b, c.sig)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: %s", name, a)
			expectError(t, a, StatusBadSignature, c.code)
		}
		// Nor does an unsigned POST learn whether the key exists.
		a, err := e.postRaw("", body, nil)
		if err != nil {
			t.Fatal(err)
		}
		expectError(t, a, StatusBadSignature, CodeBadSignature)
		if after := e.snapshot(); after != before {
			t.Fatalf("an unsigned POST changed the book:\n%s\nthen\n%s", before, after)
		}
	})

	t.Run("422 for a key reused with another body", func(t *testing.T) {
		expectBooked(t, e.post(announceActivity("act-422", 1000, 10)))
		expectBooked(t, e.post(grant("act-422", 1, "alice", 100)))
		before := e.snapshot()
		for name, d := range map[string]Delivery{
			"another user":   grant("act-422", 1, "bob", 100),
			"another amount": grant("act-422", 1, "alice", 101),
			"another time":   func() Delivery { d := grant("act-422", 1, "alice", 100); d.At = "2026-12-04T10:00:01.000Z"; return d }(),
			"another count":  announceActivity("act-422", 1000, 11),
			"another total":  announceActivity("act-422", 2000, 10),
		} {
			a := e.post(d)
			t.Logf("%s: %s", name, a)
			expectError(t, a, StatusKeyReused, CodeKeyReused)
		}
		// The same booking in another JSON form (field order, spacing, the same instant
		// in another offset) is a replay: the digest is of the canonical form.
		body := []byte(`{ "at":"2026-12-04T18:00:00+08:00", "amount":100, "userId":"alice", "packetId":"1",
			"activityUID":"act-422", "kind":"grant", "currency":"CNY", "activity":"renamed/label" }`)
		a, err := e.postRaw("act-422/1", body, sign(testKey, body))
		if err != nil {
			t.Fatal(err)
		}
		expectReplayed(t, a)
		if after := e.snapshot(); after != before {
			t.Fatalf("a reused key changed the book:\n%s\nthen\n%s", before, after)
		}
	})

	t.Run("409 while the same key is in flight", func(t *testing.T) {
		ctx := t.Context()
		expectBooked(t, e.post(announceActivity("act-409", 1000, 10)))
		before := e.snapshot()
		// Another transaction holds the source's row, so the first POST stops inside
		// its own transaction, the key's lock held, until that one ends.
		blocker, err := e.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer blocker.Rollback(context.WithoutCancel(ctx))
		if _, err := blocker.Exec(ctx, "SELECT 1 FROM sources WHERE uid = 'act-409' FOR UPDATE"); err != nil {
			t.Fatal(err)
		}
		first := make(chan answer, 1)
		go func() {
			body := mustJSON(t, grant("act-409", 1, "alice", 100))
			a, err := e.postRaw("act-409/1", body, sign(testKey, body))
			if err != nil {
				a = answer{status: -1, body: []byte(err.Error())}
			}
			first <- a
		}()
		waitForLockWait(t, e.pool)

		a := e.post(grant("act-409", 1, "alice", 100))
		expectError(t, a, StatusInFlight, CodeInFlight)
		if a.header.Get("Retry-After") == "" {
			t.Error("a 409 without Retry-After")
		}
		if after := e.snapshot(); after != before {
			t.Fatalf("the 409 (or the POST in flight) changed the book:\n%s\nthen\n%s", before, after)
		}
		if err := blocker.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		expectBooked(t, <-first)
		expectReplayed(t, e.post(grant("act-409", 1, "alice", 100)))
	})

	t.Run("424 for a credit of a source never announced", func(t *testing.T) {
		before := e.snapshot()
		for _, d := range []Delivery{grant("act-unknown", 1, "alice", 100), refund("act-unknown", "sponsor", 5),
			budgetGrant("bud-unknown", "p1", 0, "alice", 5)} {
			expectError(t, e.post(d), StatusUnknownSource, CodeUnknownSource)
		}
		if after := e.snapshot(); after != before {
			t.Fatalf("a credit of an unknown source changed the book:\n%s\nthen\n%s", before, after)
		}
		// Once announced, the same credit is booked: the operator's retry heals.
		expectBooked(t, e.post(announceActivity("act-unknown", 1000, 10)))
		expectBooked(t, e.post(grant("act-unknown", 1, "alice", 100)))
	})

	t.Run("403 for a credit over the announced total or count", func(t *testing.T) {
		expectBooked(t, e.post(announceActivity("act-403", 100, 3)))
		expectBooked(t, e.post(grant("act-403", 1, "alice", 60)))
		before := e.snapshot()
		expectError(t, e.post(grant("act-403", 2, "bob", 41)), StatusOverBudget, CodeOverBudget)
		expectError(t, e.post(refund("act-403", "sponsor", 41)), StatusOverBudget, CodeOverBudget)
		if after := e.snapshot(); after != before {
			t.Fatalf("an over-budget credit changed the book:\n%s\nthen\n%s", before, after)
		}
		expectBooked(t, e.post(grant("act-403", 2, "bob", 20)))
		expectBooked(t, e.post(grant("act-403", 3, "carol", 1)))
		before = e.snapshot()
		// Three grants of three packets: a fourth is over the count, though the total
		// has room.
		expectError(t, e.post(grant("act-403", 4, "dave", 1)), StatusOverBudget, CodeOverCount)
		if after := e.snapshot(); after != before {
			t.Fatalf("a grant over the count changed the book:\n%s\nthen\n%s", before, after)
		}
		// The refund of the remainder fits exactly.
		expectBooked(t, e.post(refund("act-403", "sponsor", 19)))
		if s := e.source("act-403"); s.Credited != 100 || s.Grants.Count != 3 || s.Refunds != (Tally{Count: 1, Sum: 19}) {
			t.Fatalf("source %+v", s)
		}
	})

	t.Run("a budget's total is its highest announcement", func(t *testing.T) {
		expectBooked(t, e.post(announceBudget("bud-1", 100)))
		expectBooked(t, e.post(budgetGrant("bud-1", "p1", 0, "alice", 70)))
		expectBooked(t, e.post(budgetGrant("bud-1", "p1", 1, "bob", 30)))
		before := e.snapshot()
		expectError(t, e.post(budgetGrant("bud-1", "p1", 2, "carol", 1)), StatusOverBudget, CodeOverBudget)
		if after := e.snapshot(); after != before {
			t.Fatalf("an over-budget credit changed the book:\n%s\nthen\n%s", before, after)
		}
		expectBooked(t, e.post(announceBudget("bud-1", 150)))
		expectReplayed(t, e.post(announceBudget("bud-1", 150)))
		// A lower announcement (a late resend of an old one) is booked, and lowers
		// nothing.
		expectBooked(t, e.post(announceBudget("bud-1", 120)))
		if s := e.source("bud-1"); s.Total != 150 || s.Count != nil || s.Kind != SourceKindBudget {
			t.Fatalf("source %+v, want a budget of 150", s)
		}
		expectBooked(t, e.post(budgetGrant("bud-1", "p1", 2, "carol", 40)))
		expectBooked(t, e.post(budgetRefund("bud-1", "p1", "sender", 10)))
		expectError(t, e.post(budgetRefund("bud-1", "p2", "sender", 1)), StatusOverBudget, CodeOverBudget)
		if s := e.source("bud-1"); s.Credited != 150 || s.Grants != (Tally{Count: 3, Sum: 140}) || s.Refunds != (Tally{Count: 1, Sum: 10}) {
			t.Fatalf("source %+v", s)
		}
	})

	t.Run("a rotation accepts every key held", func(t *testing.T) {
		old, cur := []byte("old key"), []byte("new key")
		e2 := newEnv(t, pg, old, cur)
		for _, k := range [][]byte{old, cur} {
			d := announceActivity("act-rot-"+string(k[:3]), 10, 1)
			body := mustJSON(t, d)
			a, err := e2.postRaw(keyOf(d), body, sign(k, body))
			if err != nil {
				t.Fatal(err)
			}
			expectBooked(t, a)
		}
	})
}

// waitForLockWait waits until a backend of pool's database waits for a lock.
func waitForLockWait(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		var n int
		if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("no POST waits for the source's lock")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// The read API: a user's balances, a source's book, and its credits paged in key
// order, which is what reconciliation reads.
func TestReadAPI(t *testing.T) {
	pg := pgtest.Start(t)
	e := newEnv(t, pg)
	expectBooked(t, e.post(announceActivity("act-read", 1000, 5)))
	for i, u := range []string{"alice", "bob", "alice", "carol", "dave"} {
		expectBooked(t, e.post(grant("act-read", i+1, u, int64(100+i))))
	}
	expectBooked(t, e.post(refund("act-read", "sponsor", 490)))
	expectBooked(t, e.post(announceBudget("bud-read", 50)))
	expectBooked(t, e.post(budgetGrant("bud-read", "order-1", 0, "alice", 7)))

	var bal balanceAnswer
	a := e.get("/v1/users/alice/balance")
	if err := json.Unmarshal(a.body, &bal); a.status != http.StatusOK || err != nil {
		t.Fatalf("balance: %s (%v)", a, err)
	}
	if len(bal.Balances) != 1 || bal.Balances[0] != (UserBalance{Currency: "CNY", Amount: 100 + 102 + 7, Credits: 3}) {
		t.Fatalf("alice's balance %+v", bal)
	}
	a = e.get("/v1/users/nobody/balance")
	if err := json.Unmarshal(a.body, &bal); a.status != http.StatusOK || err != nil || len(bal.Balances) != 0 {
		t.Fatalf("a user never credited: %s (%v)", a, err)
	}

	s := e.source("act-read")
	if s.Grants != (Tally{Count: 5, Sum: 510}) || s.Refunds != (Tally{Count: 1, Sum: 490}) || s.Credited != 1000 ||
		s.Total != 1000 || s.Kind != SourceKindActivity || s.Name != "default/act-read" || s.Currency != "CNY" {
		t.Fatalf("source %+v", s)
	}
	expectError(t, e.get("/v1/sources/nope"), http.StatusNotFound, CodeNotFound)
	expectError(t, e.get("/v1/sources/nope/credits"), http.StatusNotFound, CodeNotFound)
	expectError(t, e.get("/v1/sources/act-read/credits?limit=0"), http.StatusBadRequest, CodeMalformed)

	var keys []string
	after := ""
	for pages := 0; ; pages++ {
		var page creditsAnswer
		a := e.get("/v1/sources/act-read/credits?limit=2&after=" + after)
		if err := json.Unmarshal(a.body, &page); a.status != http.StatusOK || err != nil {
			t.Fatalf("credits: %s (%v)", a, err)
		}
		for _, c := range page.Credits {
			if len(c.Digest) != 64 || c.Amount <= 0 || c.UserID == "" {
				t.Fatalf("credit %+v", c)
			}
			keys = append(keys, c.Key)
		}
		if page.Next == "" {
			break
		}
		after = page.Next
		if pages > 10 {
			t.Fatal("paging does not end")
		}
	}
	want := []string{"act-read/1", "act-read/2", "act-read/3", "act-read/4", "act-read/5", "act-read/refund"}
	if len(keys) != len(want) {
		t.Fatalf("paged keys %v, want %v", keys, want)
	}
	for i := range want {
		if keys[i] != want[i] {
			t.Fatalf("paged keys %v, want %v", keys, want)
		}
	}
	// The digest the read API shows is the one the POST booked.
	var page creditsAnswer
	_ = json.Unmarshal(e.get("/v1/sources/bud-read/credits").body, &page)
	d := budgetGrant("bud-read", "order-1", 0, "alice", 7)
	r, err := parse(keyOf(d), mustJSON(t, d))
	if err != nil || len(page.Credits) != 1 || page.Credits[0].Digest != hex.EncodeToString(r.digest) || page.Credits[0].PacketID != "order-1/0" {
		t.Fatalf("budget credits %+v (%v)", page, err)
	}
	if a := e.get("/healthz"); a.status != http.StatusOK {
		t.Fatalf("healthz: %s", a)
	}
}

// Migrations are idempotent, also when several processes start at once.
func TestMigrateIsIdempotent(t *testing.T) {
	pg := pgtest.Start(t)
	e := newEnv(t, pg)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() {
			applied, err := Migrate(t.Context(), e.pool)
			if err == nil && len(applied) != 0 {
				err = fmt.Errorf("applied %v again", applied)
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	// On a fresh database, concurrent first runs apply each migration once.
	dsn, err := pg.NewDatabase(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var mu sync.Mutex
	total := 0
	for range 4 {
		wg.Go(func() {
			applied, err := Migrate(t.Context(), pool)
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			total += len(applied)
			mu.Unlock()
		})
	}
	wg.Wait()
	names, _ := migrations.ReadDir("migrations")
	if total != len(names) {
		t.Fatalf("%d migrations applied by 4 concurrent first runs, want %d", total, len(names))
	}
}
