package settlement

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"

	"redpacket.io/operator/pkg/webhooksig"
)

// capturedRequest is one request as the balance system got it.
type capturedRequest struct {
	header http.Header
	body   []byte
}

// capture records every request rcv gets.
func capture(rcv *receiver) func() []capturedRequest {
	var mu sync.Mutex
	var got []capturedRequest
	rcv.mu.Lock()
	rcv.seen = func(h http.Header, body []byte) {
		mu.Lock()
		got = append(got, capturedRequest{header: h, body: body})
		mu.Unlock()
	}
	rcv.mu.Unlock()
	return func() []capturedRequest {
		mu.Lock()
		defer mu.Unlock()
		return append([]capturedRequest(nil), got...)
	}
}

// v1aSignatures are the Ed25519 signatures of a webhook-signature header, decoded.
func v1aSignatures(t *testing.T, header string) [][]byte {
	t.Helper()
	var sigs [][]byte
	for _, s := range strings.Split(header, " ") {
		enc, ok := strings.CutPrefix(s, "v1a,")
		if !ok {
			continue
		}
		b, err := base64.StdEncoding.DecodeString(enc)
		if err != nil {
			t.Fatalf("v1a signature %q: %v", s, err)
		}
		sigs = append(sigs, b)
	}
	return sigs
}

// verifiesV1a reports whether one of the header's v1a signatures verifies with pub
// over "<webhook-id>.<webhook-timestamp>.<body>".
func verifiesV1a(t *testing.T, r capturedRequest, pub ed25519.PublicKey) bool {
	t.Helper()
	content := []byte(r.header.Get("webhook-id") + "." + r.header.Get("webhook-timestamp") + "." + string(r.body))
	for _, sig := range v1aSignatures(t, r.header.Get("webhook-signature")) {
		if ed25519.Verify(pub, content, sig) {
			return true
		}
	}
	return false
}

// Issue 35, Standard Webhooks: every delivery carries webhook-id, webhook-timestamp and
// webhook-signature besides X-Signature. The v1 signature verifies with the Standard
// Webhooks Go library under the host's HMAC key (as "whsec_" + base64), the v1a one
// with crypto/ed25519 under the operator's public key. The webhook-id is the same for
// every attempt of one delivery (a retry after a 503 carries the first attempt's id)
// and another for another key; the timestamp is each attempt's time. During a
// rotation (a previous HMAC key and a previous Ed25519 key) the header carries a
// signature with each of the four keys, and X-Signature stays with the current HMAC
// key alone.
func TestDeliveriesCarryStandardWebhooksSignatures(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-stdwebhooks", 20, 2_000, "merchant-001")
	key, oldKey := []byte("the-current-key"), []byte("the-previous-key")
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	oldPub, oldPriv, _ := ed25519.GenerateKey(rand.Reader)
	strangerPub, _, _ := ed25519.GenerateKey(rand.Reader)
	rcv := newReceiver(t, a.uid, key)
	requests := capture(rcv)
	// The first attempt of each grant is refused, so each is delivered twice.
	var mu sync.Mutex
	refused := map[string]bool{}
	rcv.setReject(func(r *http.Request, _ Delivery) int {
		mu.Lock()
		defer mu.Unlock()
		k := r.Header.Get("Idempotency-Key")
		if refused[k] {
			return 0
		}
		refused[k] = true
		return http.StatusServiceUnavailable
	})
	start := time.Now().Unix()
	grants := a.grab(t, 0, 5)
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.SigningKey, cfg.PreviousSigningKey = key, oldKey
	cfg.Ed25519Key, cfg.PreviousEd25519Key = priv, oldPriv
	startWorker(t, cfg)
	eventually(t, 15*time.Second, "every grant settled", func() bool { return a.snapshot(t).SettledCount == 5 })
	a.checkSettledExactly(t)
	rcv.checkCredits(t, grants)

	current, err := standardwebhooks.NewWebhook(webhooksig.FormatSecret(key))
	if err != nil {
		t.Fatal(err)
	}
	previous, _ := standardwebhooks.NewWebhook(webhooksig.FormatSecret(oldKey))
	stranger, _ := standardwebhooks.NewWebhook(webhooksig.FormatSecret([]byte("a-strangers-key")))
	ids := map[string]string{} // webhook-id by Idempotency-Key
	attempts := map[string]int{}
	got := requests()
	if len(got) < 10 {
		t.Fatalf("%d requests, want at least 2 for each of 5 grants", len(got))
	}
	for _, r := range got {
		k := r.header.Get("Idempotency-Key")
		id := r.header.Get("webhook-id")
		if id != WebhookID(k) || !strings.HasPrefix(id, "msg_") {
			t.Errorf("%s: webhook-id %q, want %q", k, id, WebhookID(k))
		}
		if first, ok := ids[k]; ok && first != id {
			t.Errorf("%s: the retry's webhook-id %q differs from the first attempt's %q", k, id, first)
		}
		ids[k] = id
		attempts[k]++
		ts, err := strconv.ParseInt(r.header.Get("webhook-timestamp"), 10, 64)
		if err != nil || ts < start || ts > time.Now().Unix() {
			t.Errorf("%s: webhook-timestamp %q, want the attempt's unix time", k, r.header.Get("webhook-timestamp"))
		}
		sig := r.header.Get("webhook-signature")
		var versions []string
		for _, s := range strings.Split(sig, " ") {
			v, _, _ := strings.Cut(s, ",")
			versions = append(versions, v)
		}
		if strings.Join(versions, " ") != "v1 v1 v1a v1a" {
			t.Errorf("%s: signatures %v, want v1 (current), v1 (previous), v1a (current), v1a (previous)", k, versions)
		}
		if err := current.Verify(r.body, r.header); err != nil {
			t.Errorf("%s: the library refuses the current key's v1: %v", k, err)
		}
		if err := previous.Verify(r.body, r.header); err != nil {
			t.Errorf("%s: the library refuses the previous key's v1: %v", k, err)
		}
		if stranger.Verify(r.body, r.header) == nil {
			t.Errorf("%s: a stranger's key verifies", k)
		}
		if !verifiesV1a(t, r, pub) || !verifiesV1a(t, r, oldPub) {
			t.Errorf("%s: the v1a signatures do not verify with both public keys", k)
		}
		if verifiesV1a(t, r, strangerPub) {
			t.Errorf("%s: a stranger's public key verifies", k)
		}
		if x := r.header.Get("X-Signature"); x != Sign(key, r.body) {
			t.Errorf("%s: X-Signature %q, want the current key's", k, x)
		}
	}
	if len(ids) != 5 {
		t.Errorf("%d webhook-ids for 5 keys", len(ids))
	}
	for k, n := range attempts {
		if n < 2 {
			t.Errorf("%s: %d attempts, want the refused one and a retry", k, n)
		}
	}
	seenIDs := map[string]bool{}
	for _, id := range ids {
		if seenIDs[id] {
			t.Errorf("two keys share webhook-id %s", id)
		}
		seenIDs[id] = true
	}
}

// A balance system configured for v1a only (no HMAC key for its host, the operator's
// Ed25519 key) gets a webhook-signature with one v1a signature and no X-Signature:
// nothing a party holding only the public key could produce. With no key at all, no
// signature header is sent.
func TestDeliveriesSignedWithEd25519Only(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-v1a-only", 10, 1_000, "merchant-001")
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	rcv := newReceiver(t, a.uid, nil) // refuses nothing, and flags any X-Signature
	requests := capture(rcv)
	grants := a.grab(t, 0, 3)
	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.Ed25519Key = priv
	startWorker(t, cfg)
	eventually(t, 15*time.Second, "every grant settled", func() bool { return a.snapshot(t).SettledCount == 3 })
	rcv.checkCredits(t, grants)
	got := requests()
	if len(got) != 3 {
		t.Fatalf("%d requests, want 3", len(got))
	}
	v := webhooksig.Verifier{PublicKeys: []ed25519.PublicKey{pub}}
	for _, r := range got {
		sig := r.header.Get("webhook-signature")
		if !strings.HasPrefix(sig, "v1a,") || strings.Contains(sig, " ") {
			t.Errorf("webhook-signature %q, want one v1a", sig)
		}
		if scheme, err := v.Verify(r.header, r.body); err != nil || scheme != webhooksig.SchemeEd25519 {
			t.Errorf("the receivers' verifier: %q, %v", scheme, err)
		}
		if !verifiesV1a(t, r, pub) {
			t.Error("the v1a signature does not verify with the public key")
		}
	}
	rcv.mu.Lock()
	problems := rcv.problems
	rcv.mu.Unlock()
	if len(problems) > 0 {
		t.Fatalf("the receiver saw: %v", problems)
	}

	// No key: none of the signature headers.
	b := newActivity(t, rdb, "uid-unsigned", 10, 1_000, "merchant-001")
	rcvB := newReceiver(t, b.uid, nil)
	requestsB := capture(rcvB)
	b.grab(t, 0, 1)
	startWorker(t, baseConfig(b, rcvB.url("/credit"), "w1"))
	eventually(t, 15*time.Second, "the grant settled", func() bool { return b.snapshot(t).SettledCount == 1 })
	for _, r := range requestsB() {
		for _, h := range []string{"X-Signature", "webhook-id", "webhook-timestamp", "webhook-signature"} {
			if r.header.Get(h) != "" {
				t.Errorf("an unsigned worker sent %s", h)
			}
		}
	}
}
