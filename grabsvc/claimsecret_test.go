package grabsvc

import (
	"bytes"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// With claim secrets on a real redis-server: the creation answers the secret
// (the same again on a retry); a grab or a read without it, or with another
// packet's, is answered as a packet never created, before Redis is asked (no
// command is sent); with it the grab is granted and the read answers; the sender
// reads with its credential; no other answer carries the secret.
func TestClaimSecretGuardsAPacket(t *testing.T) {
	h := newPacketHarness(t, 100_000, 2, func(c *PacketConfig) { c.ClaimSecret = true })
	created := h.create(`{"id":"order-1001","sender":"m","totalAmount":500,"count":5}`)
	secret := created.str("claimSecret")
	if created.Status != http.StatusCreated || len(secret) != 22 {
		t.Fatalf("create: %d %s, want 201 with a 22-character claimSecret", created.Status, created.Raw)
	}
	if again := h.create(`{"id":"order-1001","sender":"m","totalAmount":500,"count":5}`); again.str("claimSecret") != secret {
		t.Fatalf("the creation's retry answered %q, want the same secret", again.str("claimSecret"))
	}
	other := h.create(`{"id":"order-1002","sender":"m","totalAmount":500,"count":5}`).str("claimSecret")
	if other == secret || other == "" {
		t.Fatalf("two packets' secrets: %q and %q", secret, other)
	}
	never := h.do(http.MethodPost, "/v1/packets/order-9999/grab", `{"userId":"u-1"}`, nil)
	for name, hdr := range map[string]map[string]string{
		"no secret": nil, "another packet's": {ClaimSecretHeader: other}, "one character off": {ClaimSecretHeader: secret[:21] + "A"},
		"the secret in the Authorization header": {"Authorization": "Bearer " + secret},
	} {
		if hdr != nil && hdr[ClaimSecretHeader] == secret[:21]+"A" && secret[21] == 'A' {
			hdr[ClaimSecretHeader] = secret[:21] + "B"
		}
		before := h.commands()
		overhead := h.commands() - before // the reading's own INFO
		before += overhead
		g := h.do(http.MethodPost, "/v1/packets/order-1001/grab", `{"userId":"u-1"}`, hdr)
		d := h.do(http.MethodGet, "/v1/packets/order-1001", "", hdr)
		if n := h.commands() - before - overhead; n != 0 {
			t.Errorf("%s: %d Redis commands for a refused grab and read", name, n)
		}
		if g.Status != http.StatusNotFound || strings.ReplaceAll(g.Raw, "order-1001", "order-9999") != never.Raw {
			t.Errorf("%s: grab %d %s; want the answer of a packet never created (%s)", name, g.Status, g.Raw, never.Raw)
		}
		if d.Status != http.StatusNotFound || d.str("error") != OutcomeNotFound {
			t.Errorf("%s: read %d %s, want 404 not_found", name, d.Status, d.Raw)
		}
	}
	with := map[string]string{ClaimSecretHeader: secret}
	if g := h.do(http.MethodPost, "/v1/packets/order-1001/grab", `{"userId":"u-1"}`, with); g.Status != http.StatusOK || g.str("outcome") != "granted" {
		t.Fatalf("a grab with the secret: %d %s", g.Status, g.Raw)
	}
	for name, hdr := range map[string]map[string]string{"the secret": with, "the sender credential": asSender} {
		d := h.do(http.MethodGet, "/v1/packets/order-1001", "", hdr)
		if d.Status != http.StatusOK || d.str("id") != "order-1001" || strings.Contains(d.Raw, secret) {
			t.Errorf("a read with %s: %d %s", name, d.Status, d.Raw)
		}
	}
	if l := h.do(http.MethodGet, "/v1/packets?limit=10", "", asSender); l.Status != http.StatusOK || strings.Contains(l.Raw, secret) || strings.Contains(l.Raw, other) {
		t.Errorf("the live list: %d %s, want no secret in it", l.Status, l.Raw)
	}
}

// The packet page opened from /p/{id}#<secret> in Chromium grabs with the secret,
// and no request the server receives carries the secret in its URL or Referer,
// nor does anything the server logs.
func TestPacketPageClaimSecret(t *testing.T) {
	browser := newBrowser(t)
	var logs bytes.Buffer
	var logMu sync.Mutex
	h := newPacketHarness(t, 100_000, 1, func(c *PacketConfig) {
		c.ClaimSecret = true
		c.Log = slog.New(slog.NewTextHandler(&lockedWriter{w: &logs, mu: &logMu}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	secret := h.create(`{"id":"order-cap","sender":"Lin's tea shop","totalAmount":600,"count":3}`).str("claimSecret")
	var mu sync.Mutex
	var seen []string
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, fmt.Sprintf("%s %s referer=%q", r.Method, r.URL.String(), r.Referer()))
		mu.Unlock()
		h.srv.Handler().ServeHTTP(w, r)
	}))
	t.Cleanup(front.Close)

	tb := open(t, browser, desktop, false, front.URL+"/p/order-cap?user=alice#"+secret)
	tb.until("from", "the sender", func(s string) bool { return s == "From Lin's tea shop" })
	tb.clickOpen()
	c := tb.answered(0)
	held := h.shareOf(t, "order-cap", "alice")
	if c.Outcome != OutcomeGranted || c.Amount != yuan(held.Amount) {
		t.Fatalf("after Open the card shows %+v; redis holds %s", c, yuan(held.Amount))
	}
	tb.clean()

	time.Sleep(100 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if len(seen) < 3 {
		t.Fatalf("the server saw %d requests: %v", len(seen), seen)
	}
	for _, r := range seen {
		if strings.Contains(r, secret) {
			t.Errorf("a request carried the secret in its URL or Referer: %s", r)
		}
	}
	logMu.Lock()
	defer logMu.Unlock()
	if strings.Contains(logs.String(), secret) {
		t.Errorf("the server logged the secret:\n%s", logs.String())
	}
	t.Logf("%d requests, none with the secret in a URL or Referer", len(seen))
}

// lockedWriter serializes writes of a logger shared by handlers.
type lockedWriter struct {
	w  *bytes.Buffer
	mu *sync.Mutex
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
