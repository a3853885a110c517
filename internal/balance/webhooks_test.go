package balance

import (
	"crypto/ed25519"
	"crypto/rand"
	"net/http"
	"testing"
	"time"

	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/test/pgtest"
)

// captured is a signer that sets the headers of a request captured earlier, as is.
func captured(h http.Header) signer {
	return func(dst http.Header, _ string) {
		for k, v := range h {
			dst[k] = append([]string(nil), v...)
		}
	}
}

// headersOf are the headers s sets on a request with the Idempotency-Key key.
func headersOf(s signer, key string) http.Header {
	h := http.Header{}
	s(h, key)
	return h
}

// Issue 35, Standard Webhooks, on a real PostgreSQL: a delivery signed v1 (HMAC) or
// v1a (Ed25519, the balance system holding only the public key) is booked; one signed
// by a wrong key is refused 401; a captured request replayed after the tolerance
// (the handler's clock moved 5 minutes and 1 second on, no sleep) is refused 401
// stale_signature, the delivered one and one never delivered alike, and the latter is
// booked once the clock is back; a rotation's keys all verify; X-Signature alone is
// refused unless AcceptXSignature, and never rescues a stale request. No refused
// request changes the book.
func TestStandardWebhooksSignatures(t *testing.T) {
	pg := pgtest.Start(t)
	e := newEnv(t, pg)
	v1 := webhooksig.Keys{HMAC: [][]byte{testKey}}
	v1a := webhooksig.Keys{Ed25519: []ed25519.PrivateKey{testEd25519}}
	_, stranger, _ := ed25519.GenerateKey(rand.Reader)
	postWith := func(e *env, d Delivery, s func(body []byte) signer) answer {
		t.Helper()
		body := mustJSON(t, d)
		a, err := e.postRaw(keyOf(d), body, s(body))
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	now := func() time.Time { return time.Now() }
	with := func(keys webhooksig.Keys) func([]byte) signer {
		return func(body []byte) signer { return signAt(keys, nil, body, now()) }
	}

	expectBooked(t, postWith(e, announceActivity("act-sw", 1000, 10), with(v1)))
	expectBooked(t, postWith(e, grant("act-sw", 1, "alice", 100), with(v1)))
	expectBooked(t, postWith(e, grant("act-sw", 2, "bob", 200), with(v1a)))
	expectReplayed(t, postWith(e, grant("act-sw", 2, "bob", 200), with(v1)))
	if s := e.source("act-sw"); s.Grants != (Tally{Count: 2, Sum: 300}) {
		t.Fatalf("source %+v, want the v1 and the v1a grant", s)
	}

	before := e.snapshot()
	for name, keys := range map[string]webhooksig.Keys{
		"v1 by a wrong key":  {HMAC: [][]byte{[]byte("a wrong key")}},
		"v1a by a wrong key": {Ed25519: []ed25519.PrivateKey{stranger}},
	} {
		expectError(t, postWith(e, grant("act-sw", 3, "mallory", 500), with(keys)), StatusBadSignature, CodeBadSignature)
		t.Logf("%s: refused", name)
	}

	// Captured requests, replayed after the tolerance.
	delivered := grant("act-sw", 1, "alice", 100)
	deliveredHeaders := headersOf(signAt(v1, testKey, mustJSON(t, delivered), now()), keyOf(delivered))
	never := grant("act-sw", 4, "carol", 50)
	neverHeaders := headersOf(signAt(v1a, nil, mustJSON(t, never), now()), keyOf(never))
	late := webhooksig.DefaultTolerance + time.Second
	e.clock.advance(late)
	for name, c := range map[string]struct {
		d Delivery
		h http.Header
	}{"the delivered one": {delivered, deliveredHeaders}, "one never delivered": {never, neverHeaders}} {
		a, err := e.postRaw(keyOf(c.d), mustJSON(t, c.d), captured(c.h))
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s replayed %s later: %s", name, late, a)
		expectError(t, a, StatusBadSignature, CodeStaleSignature)
	}
	if after := e.snapshot(); after != before {
		t.Fatalf("a refused request changed the book:\n%s\nthen\n%s", before, after)
	}
	e.clock.advance(-late)
	a, err := e.postRaw(keyOf(never), mustJSON(t, never), captured(neverHeaders))
	if err != nil {
		t.Fatal(err)
	}
	expectBooked(t, a)

	t.Run("a rotation's keys all verify", func(t *testing.T) {
		oldKey, newKey := []byte("old hmac"), []byte("new hmac")
		oldPub, oldPriv, _ := ed25519.GenerateKey(rand.Reader)
		newPub, newPriv, _ := ed25519.GenerateKey(rand.Reader)
		r := newEnvWith(t, pg, Config{Keys: [][]byte{oldKey, newKey}, PublicKeys: []ed25519.PublicKey{oldPub, newPub}})
		expectBooked(t, postWith(r, announceActivity("act-rot", 1000, 10), with(webhooksig.Keys{
			HMAC: [][]byte{newKey, oldKey}, Ed25519: []ed25519.PrivateKey{newPriv, oldPriv}})))
		for i, keys := range []webhooksig.Keys{
			{HMAC: [][]byte{oldKey}}, {HMAC: [][]byte{newKey}},
			{Ed25519: []ed25519.PrivateKey{oldPriv}}, {Ed25519: []ed25519.PrivateKey{newPriv}},
		} {
			expectBooked(t, postWith(r, grant("act-rot", i+1, "u", 10), with(keys)))
		}
	})

	t.Run("a balance system holding only the public key", func(t *testing.T) {
		pub := testEd25519.Public().(ed25519.PublicKey)
		r := newEnvWith(t, pg, Config{PublicKeys: []ed25519.PublicKey{pub}, AcceptXSignature: true})
		expectBooked(t, postWith(r, announceActivity("act-pub", 1000, 10), with(v1a)))
		before := r.snapshot()
		// No HMAC key verifies here, not even with X-Signature accepted.
		expectError(t, postWith(r, grant("act-pub", 1, "u", 10), with(v1)), StatusBadSignature, CodeBadSignature)
		expectError(t, postWith(r, grant("act-pub", 1, "u", 10), func(body []byte) signer {
			return xSignature(webhooksig.XSignature(testKey, body))
		}), StatusBadSignature, CodeBadSignature)
		if after := r.snapshot(); after != before {
			t.Fatalf("a refused request changed the book:\n%s\nthen\n%s", before, after)
		}
		expectBooked(t, postWith(r, grant("act-pub", 1, "u", 10), with(v1a)))
	})

	t.Run("X-Signature alone, where accepted", func(t *testing.T) {
		r := newEnvWith(t, pg, Config{Keys: [][]byte{testKey}, AcceptXSignature: true})
		expectBooked(t, postWith(r, announceActivity("act-x", 1000, 10), func(body []byte) signer {
			return xSignature(webhooksig.XSignature(testKey, body))
		}))
		before := r.snapshot()
		expectError(t, postWith(r, grant("act-x", 1, "u", 10), func(body []byte) signer {
			return xSignature(webhooksig.XSignature([]byte("a wrong key"), body))
		}), StatusBadSignature, CodeBadSignature)
		// A stale Standard Webhooks request is refused, however good its X-Signature.
		expectError(t, postWith(r, grant("act-x", 1, "u", 10), func(body []byte) signer {
			return signAt(v1, testKey, body, now().Add(-time.Hour))
		}), StatusBadSignature, CodeStaleSignature)
		if after := r.snapshot(); after != before {
			t.Fatalf("a refused request changed the book:\n%s\nthen\n%s", before, after)
		}
	})
}
