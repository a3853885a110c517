package settlement

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/pgtest"
	"redpacket.io/operator/test/redistest"
)

// startBalanceProcess builds cmd/balance and runs it as a real process on a fresh
// database of pg, verifying v1a signatures with pub alone, with the given
// tolerance; it returns its URL and a pool on its book.
func startBalanceProcess(t *testing.T, pg *pgtest.Server, pub ed25519.PublicKey, tolerance time.Duration) (string, *pgxpool.Pool) {
	t.Helper()
	dsn, err := pg.NewDatabase(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "balance")
	if out, err := exec.Command("go", "build", "-o", bin, "redpacket.io/operator/cmd/balance").CombinedOutput(); err != nil {
		t.Fatalf("building cmd/balance: %v: %s", err, out)
	}
	keyFile := filepath.Join(dir, "operator.pub")
	if err := os.WriteFile(keyFile, []byte(webhooksig.FormatPublicKey(pub)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	var logs bytes.Buffer
	cmd := exec.Command(bin, "--listen", addr, "--public-key-file", keyFile, "--tolerance", tolerance.String())
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dsn)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("cmd/balance's log:\n%s", logs.String())
		}
	})
	base := "http://" + addr
	eventually(t, 30*time.Second, "cmd/balance answers /healthz", func() bool {
		resp, err := http.Get(base + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	pool, err := pgxpool.New(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return base, pool
}

// wireRequest is a delivery as it went over the wire.
type wireRequest struct {
	header http.Header
	body   []byte
}

// Black-box forgery, with every part real: the budget's own Redis user (whose
// password the tenant holds) appends a grant of a packet never created, a grant of
// a real packet's share with another amount and user, and a refund of a live packet
// to itself; the operator's workers deliver into cmd/balance, a real process on a
// real PostgreSQL that holds only the operator's Ed25519 public key. None of the
// forgeries reaches PostgreSQL: each is dead-lettered, and the book holds bob's
// genuine grant alone. Then the requests an attacker could make straight to the
// balance system are refused 401 and book nothing: a credit to mallory signed with
// another Ed25519 key, one signed with an HMAC key, and a genuine delivery captured
// on the wire and replayed after the tolerance.
func TestForgeriesNeverReachPostgres(t *testing.T) {
	pg := pgtest.Start(t)
	ctx := context.Background()
	const uid = "rpb-uid-blackbox"
	operatorKey := ed25519.NewKeyFromSeed(sha256Of("the operator's key"))
	const tolerance = 2 * time.Second
	base, pool := startBalanceProcess(t, pg, operatorKey.Public().(ed25519.PublicKey), tolerance)

	// A proxy in front of it keeps the first grant delivered, as an attacker on the
	// path would.
	var mu sync.Mutex
	var captured *wireRequest
	target, _ := url.Parse(base)
	proxy := httputil.NewSingleHostReverseProxy(target)
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		if captured == nil && bytes.Contains(body, []byte(`"kind":"grant"`)) {
			captured = &wireRequest{header: r.Header.Clone(), body: body}
		}
		mu.Unlock()
		r.Body = io.NopCloser(bytes.NewReader(body))
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(front.Close)

	srv := redistest.Start(t)
	rdb := srv.Client(t)
	if _, err := lua.GrabLibrary.Ensure(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	b := store.NewBudget(rdb, uid, 1)
	tb := testBudget{t: t, rdb: rdb, b: b}
	cfg := packetsConfig(tb, front.URL+"/v1/credits", "operator-a", nil)
	cfg.SigningKey, cfg.Ed25519Key = nil, operatorKey
	cfg.Logger = testLogger(t)
	if _, err := AnnounceBudgetTotal(ctx, cfg, b, 10_000); err != nil {
		t.Fatal(err)
	}
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 10_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
	if err := b.Configure(ctx, 10_000, limits); err != nil {
		t.Fatal(err)
	}
	tenant := budgetTenant(t, srv, b)
	for _, id := range []string{"order-7", "order-8"} {
		if _, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "merchant-7", Total: 1000, Count: 2,
			Distribution: split.TypeFixed}); err != nil || outcome != store.CreateCreated {
			t.Fatalf("creating %s: %v, %v", id, outcome, err)
		}
	}
	if g, err := b.GrabPacket(ctx, "order-7", "bob"); err != nil || g.Outcome != store.PacketGranted || g.Amount != 500 {
		t.Fatalf("bob's grab: %+v, %v", g, err)
	}
	stream := b.ShardKeys(0).Stream
	forgeries := [][]string{
		{"grant", "ghost-1/0:9000:0:CNY:mallory"}, // a packet never created
		{"grant", "order-7/1:900:0:CNY:mallory"},  // a real share, another amount, never grabbed
		{"grant", "order-7/0:500:0:CNY:mallory"},  // bob's share, to mallory
		{"kind", "refund", "packet", "order-8/refund", "user", "mallory", "amount", "1000", "currency", "CNY",
			"at", "1764806400000"}, // a live packet's refund, to mallory
	}
	for _, f := range forgeries {
		if err := tenant.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: f}).Err(); err != nil {
			t.Fatalf("the budget's Redis user appends %v: %v", f, err)
		}
	}
	settleBudget(t, cfg, b, "drained")

	type row struct {
		key, user string
		amount    int64
	}
	book := func() []row {
		rows, err := pool.Query(ctx, `SELECT idempotency_key, user_id, amount FROM credits ORDER BY idempotency_key`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var out []row
		for rows.Next() {
			var r row
			if err := rows.Scan(&r.key, &r.user, &r.amount); err != nil {
				t.Fatal(err)
			}
			out = append(out, r)
		}
		return out
	}
	got := book()
	if len(got) != 1 || got[0] != (row{uid + "/order-7/0", "bob", 500}) {
		t.Fatalf("the book holds %+v; want bob's 500 alone", got)
	}
	if dead := tb.deadLetters(); len(dead) != len(forgeries) {
		t.Fatalf("dead letters %v; want the %d forgeries", dead, len(forgeries))
	}

	// Straight to the balance system.
	forged := []byte(`{"kind":"grant","activity":"shop/group-packets","activityUID":"` + uid + `","packetId":"order-8/0",` +
		`"userId":"mallory","amount":500,"currency":"CNY","at":"2026-12-04T10:00:00.000Z","source":"budget"}`)
	post := func(what string, h http.Header, body []byte) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/credits", bytes.NewReader(body))
		req.Header = h
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		answer, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("%s: answered %d %s, want 401", what, resp.StatusCode, answer)
		}
		t.Logf("%s: %d %s", what, resp.StatusCode, strings.TrimSpace(string(answer)))
	}
	signed := func(sign func(h http.Header)) http.Header {
		h := http.Header{"Content-Type": {"application/json"}, "Idempotency-Key": {uid + "/order-8/0"}}
		sign(h)
		return h
	}
	wrongKey := ed25519.NewKeyFromSeed(sha256Of("mallory's key"))
	post("signed with another Ed25519 key", signed(func(h http.Header) {
		c := cfg
		c.Ed25519Key = wrongKey
		signHeaders(h, c, forged, uid+"/order-8/0", time.Now())
	}), forged)
	post("signed with an HMAC key", signed(func(h http.Header) {
		c := cfg
		c.Ed25519Key, c.SigningKey = nil, []byte("a guessed secret")
		signHeaders(h, c, forged, uid+"/order-8/0", time.Now())
	}), forged)
	mu.Lock()
	replay := captured
	mu.Unlock()
	if replay == nil {
		t.Fatal("no grant went over the wire")
	}
	time.Sleep(tolerance + 1500*time.Millisecond)
	post("a captured delivery replayed after the tolerance", replay.header.Clone(), replay.body)
	if after := book(); len(after) != 1 {
		t.Errorf("the book holds %+v after the refusals; want bob's grant alone", after)
	}
}

func sha256Of(s string) []byte {
	sum := sha256.Sum256([]byte(s))
	return sum[:]
}
