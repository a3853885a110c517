package balance

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/test/pgtest"
)

// testKey signs the tests' deliveries (v1); testEd25519 is the operator's Ed25519
// key (v1a), whose public key the balance system holds.
var (
	testKey     = []byte("balance-test-key")
	testEd25519 = ed25519.NewKeyFromSeed(sha256Sum("balance-test-ed25519"))
)

func sha256Sum(s string) []byte {
	sum := sha256.Sum256([]byte(s))
	return sum[:]
}

// testClock is a balance system's clock that a test can move: the real time plus an
// offset, so a captured request can be replayed "later" without a sleep.
type testClock struct{ offset atomic.Int64 }

func (c *testClock) now() time.Time { return time.Now().Add(time.Duration(c.offset.Load())) }

// advance moves the clock d ahead.
func (c *testClock) advance(d time.Duration) { c.offset.Add(int64(d)) }

// env is a balance system on a fresh database of a real PostgreSQL, served over real
// HTTP by httptest.
type env struct {
	t      testing.TB
	pool   *pgxpool.Pool
	book   *Book
	url    string
	client *http.Client
	clock  *testClock
}

// newEnv makes a database on pg, migrates it and serves a Handler on it that
// verifies signatures made with keys (testKey when none) and testEd25519's public
// key.
func newEnv(t testing.TB, pg *pgtest.Server, keys ...[]byte) *env {
	t.Helper()
	if len(keys) == 0 {
		keys = [][]byte{testKey}
	}
	return newEnvWith(t, pg, Config{Keys: keys, PublicKeys: []ed25519.PublicKey{testEd25519.Public().(ed25519.PublicKey)}})
}

// newEnvWith is newEnv with the handler's keys and options from cfg; its Book, Log
// and Now are the env's.
func newEnvWith(t testing.TB, pg *pgtest.Server, hcfg Config) *env {
	t.Helper()
	ctx := t.Context()
	dsn, err := pg.NewDatabase(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 32
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	clock := &testClock{}
	hcfg.Book, hcfg.Now = NewBook(pool), clock.now
	hcfg.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	srv := httptest.NewServer(Handler(hcfg))
	t.Cleanup(srv.Close)
	tr := &http.Transport{MaxIdleConnsPerHost: 128}
	t.Cleanup(tr.CloseIdleConnections)
	return &env{t: t, pool: pool, book: hcfg.Book, url: srv.URL, client: &http.Client{Transport: tr, Timeout: 30 * time.Second}, clock: clock}
}

// answer is an HTTP answer, read whole.
type answer struct {
	status int
	header http.Header
	body   []byte
}

func (a answer) String() string { return fmt.Sprintf("%d %s", a.status, bytes.TrimSpace(a.body)) }

// signer sets the signature headers of a request with the given Idempotency-Key.
type signer func(h http.Header, idempotencyKey string)

// sign signs body as the operator does, now: X-Signature and a Standard Webhooks v1
// signature with key, the webhook-id of the request's Idempotency-Key.
func sign(key, body []byte) signer {
	return signAt(webhooksig.Keys{HMAC: [][]byte{key}}, key, body, time.Now())
}

// signAt signs body with keys (the Standard Webhooks headers, at the time at) and,
// with xKey, X-Signature.
func signAt(keys webhooksig.Keys, xKey, body []byte, at time.Time) signer {
	return func(h http.Header, idempotencyKey string) {
		if xKey != nil {
			h.Set(webhooksig.XSignatureHeader, webhooksig.XSignature(xKey, body))
		}
		if keys.Empty() {
			return
		}
		id := webhooksig.MessageID(idempotencyKey)
		h.Set(webhooksig.HeaderID, id)
		h.Set(webhooksig.HeaderTimestamp, strconv.FormatInt(at.Unix(), 10))
		h.Set(webhooksig.HeaderSignature, webhooksig.Sign(keys, id, at.Unix(), body))
	}
}

// xSignature sets X-Signature alone, to value.
func xSignature(value string) signer {
	return func(h http.Header, _ string) { h.Set(webhooksig.XSignatureHeader, value) }
}

// postRaw POSTs body with the Idempotency-Key (none when empty), signed by
// signature (unsigned when nil).
func (e *env) postRaw(key string, body []byte, signature signer) (answer, error) {
	req, err := http.NewRequest(http.MethodPost, e.url+"/v1/credits", bytes.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if signature != nil {
		signature(req.Header, key)
	}
	resp, err := e.client.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{}, err
	}
	return answer{status: resp.StatusCode, header: resp.Header, body: b}, nil
}

// post sends d, signed with testKey, under its own key, as the operator does.
func (e *env) post(d Delivery) answer {
	e.t.Helper()
	body := mustJSON(e.t, d)
	a, err := e.postRaw(keyOf(d), body, sign(testKey, body))
	if err != nil {
		e.t.Fatal(err)
	}
	return a
}

func (e *env) get(path string) answer {
	e.t.Helper()
	resp, err := e.client.Get(e.url + path)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	return answer{status: resp.StatusCode, header: resp.Header, body: b}
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// keyOf is the Idempotency-Key the operator sends with d.
func keyOf(d Delivery) string {
	switch {
	case d.Kind == KindBudget && d.Source == SourceBudget:
		return fmt.Sprintf("%s/budget:%d", d.ActivityUID, d.Amount)
	case d.Kind == KindBudget:
		return d.ActivityUID + "/budget"
	}
	return d.ActivityUID + "/" + d.PacketID
}

const testAt = "2026-12-04T10:00:00.000Z"

func announceActivity(uid string, amount, count int64) Delivery {
	return Delivery{Kind: KindBudget, Activity: "default/" + uid, ActivityUID: uid, Amount: amount, Count: count, Currency: "CNY", At: testAt}
}

func announceBudget(uid string, total int64) Delivery {
	return Delivery{Kind: KindBudget, Source: SourceBudget, Activity: "default/" + uid, ActivityUID: uid, Amount: total, Currency: "CNY", At: testAt}
}

func grant(uid string, packet int, user string, amount int64) Delivery {
	return Delivery{Kind: KindGrant, Activity: "default/" + uid, ActivityUID: uid, PacketID: fmt.Sprint(packet), UserID: user,
		Amount: amount, Currency: "CNY", At: testAt}
}

func refund(uid, sponsor string, amount int64) Delivery {
	return Delivery{Kind: KindRefund, Activity: "default/" + uid, ActivityUID: uid, PacketID: "refund", UserID: sponsor,
		Amount: amount, Currency: "CNY", At: testAt}
}

func budgetGrant(uid, packet string, share int, user string, amount int64) Delivery {
	return Delivery{Kind: KindGrant, Source: SourceBudget, Activity: "default/" + uid, ActivityUID: uid,
		PacketID: fmt.Sprintf("%s/%d", packet, share), UserID: user, Amount: amount, Currency: "CNY", At: testAt,
		SourceRef: &SourceRef{Kind: "RedPacketBudget", Namespace: "default", Name: uid, UID: uid}}
}

func budgetRefund(uid, packet, sender string, amount int64) Delivery {
	return Delivery{Kind: KindRefund, Source: SourceBudget, Activity: "default/" + uid, ActivityUID: uid,
		PacketID: packet + "/refund", UserID: sender, Amount: amount, Currency: "CNY", At: testAt}
}

// snapshot is every row of the book but the booking times, in a fixed order: two
// equal snapshots are the same book.
func (e *env) snapshot() string {
	e.t.Helper()
	return snapshot(e.t, e.pool)
}

func snapshot(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	ctx := context.Background()
	var out strings.Builder
	for _, q := range []string{
		`SELECT uid, kind, name, currency, total, count, grants, grant_sum, refunds, refund_sum FROM sources ORDER BY uid`,
		`SELECT idempotency_key, source_uid, amount, count, encode(digest, 'hex'), at FROM announcements ORDER BY idempotency_key`,
		`SELECT idempotency_key, encode(digest, 'hex'), kind, user_id, amount, currency, source_uid, packet_id, at FROM credits ORDER BY idempotency_key`,
		`SELECT user_id, currency, amount, credits FROM balances ORDER BY user_id, currency`,
	} {
		rows, err := pool.Query(ctx, q)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				t.Fatal(err)
			}
			fmt.Fprintln(&out, vals...)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		out.WriteString("--\n")
	}
	return out.String()
}

// expectError checks an error answer: its status, and its JSON body's error code
// and message.
func expectError(t *testing.T, a answer, status int, code string) {
	t.Helper()
	if a.status != status {
		t.Fatalf("answer %s, want %d %s", a, status, code)
	}
	if ct := a.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("error answer's Content-Type %q", ct)
	}
	var e apiError
	if err := json.Unmarshal(a.body, &e); err != nil || e.Error != code || e.Message == "" {
		t.Fatalf("error body %s (%v), want {\"error\":%q,\"message\":...}", a.body, err, code)
	}
}

// expectBooked checks a 201 for a new key.
func expectBooked(t *testing.T, a answer) {
	t.Helper()
	if a.status != StatusBooked || a.header.Get(ReplayedHeader) != "" {
		t.Fatalf("answer %s (replayed %q), want %d", a, a.header.Get(ReplayedHeader), StatusBooked)
	}
}

// expectReplayed checks a 200 marked as a replay.
func expectReplayed(t *testing.T, a answer) {
	t.Helper()
	if a.status != StatusReplayed || a.header.Get(ReplayedHeader) != "true" {
		t.Fatalf("answer %s (replayed %q), want %d with %s: true", a, a.header.Get(ReplayedHeader), StatusReplayed, ReplayedHeader)
	}
}

// source reads a source through the read API.
func (e *env) source(uid string) Source {
	e.t.Helper()
	a := e.get("/v1/sources/" + uid)
	if a.status != http.StatusOK {
		e.t.Fatalf("GET source %s: %s", uid, a)
	}
	var s Source
	if err := json.Unmarshal(a.body, &s); err != nil {
		e.t.Fatal(err)
	}
	return s
}
