package webhooksig

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
)

func newEd25519(t *testing.T) (ed25519.PublicKey, ed25519.PrivateKey) {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return pub, priv
}

// headers are a request's Standard Webhooks headers.
func headers(id string, ts int64, sig string) http.Header {
	h := http.Header{}
	h.Set(HeaderID, id)
	h.Set(HeaderTimestamp, strconv.FormatInt(ts, 10))
	h.Set(HeaderSignature, sig)
	return h
}

// The webhook-id is a function of the Idempotency-Key alone: the same for every
// attempt of a delivery, another for another key, and a valid Standard Webhooks id.
func TestMessageID(t *testing.T) {
	a, b := MessageID("6f1c/1731"), MessageID("6f1c/1731")
	if a != b {
		t.Fatalf("one key, two ids: %s %s", a, b)
	}
	if MessageID("6f1c/1732") == a || MessageID("6f1c/refund") == a {
		t.Fatal("two keys, one id")
	}
	if !strings.HasPrefix(a, "msg_") || len(a) != 47 || strings.ContainsAny(a, "+/=. ") {
		t.Fatalf("id %q is not msg_ and 43 base64url characters", a)
	}
}

// A v1 signature verifies with the Standard Webhooks Go library under the key, as
// "whsec_" + base64 spells it for that library, and under no other key; a v1a
// signature verifies with crypto/ed25519 under the public key, over id.timestamp.body.
func TestSignVerifiesWithTheLibraryAndEd25519(t *testing.T) {
	key := []byte("the host's hmac key")
	pub, priv := newEd25519(t)
	body := []byte(`{"kind":"grant","amount":57}`)
	id, now := MessageID("uid/7"), time.Now()
	sig := Sign(Keys{HMAC: [][]byte{key}, Ed25519: []ed25519.PrivateKey{priv}}, id, now.Unix(), body)
	parts := strings.Split(sig, " ")
	if len(parts) != 2 || !strings.HasPrefix(parts[0], "v1,") || !strings.HasPrefix(parts[1], "v1a,") {
		t.Fatalf("signature header %q, want a v1 then a v1a", sig)
	}
	h := headers(id, now.Unix(), sig)

	wh, err := standardwebhooks.NewWebhook(FormatSecret(key))
	if err != nil {
		t.Fatal(err)
	}
	if err := wh.Verify(body, h); err != nil {
		t.Fatalf("the library refuses the v1 signature: %v", err)
	}
	other, _ := standardwebhooks.NewWebhook(FormatSecret([]byte("another key")))
	if err := other.Verify(body, h); err == nil {
		t.Fatal("the library accepts the signature under another key")
	}
	if err := wh.Verify([]byte(`{"kind":"grant","amount":58}`), h); err == nil {
		t.Fatal("the library accepts the signature of another body")
	}

	raw, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(parts[1], "v1a,"))
	if err != nil {
		t.Fatal(err)
	}
	content := []byte(id + "." + strconv.FormatInt(now.Unix(), 10) + "." + string(body))
	if !ed25519.Verify(pub, content, raw) {
		t.Fatal("the v1a signature does not verify with the public key over id.timestamp.body")
	}
	otherPub, _ := newEd25519(t)
	if ed25519.Verify(otherPub, content, raw) {
		t.Fatal("the v1a signature verifies with another public key")
	}

	if Sign(Keys{}, id, now.Unix(), body) != "" {
		t.Fatal("no key, yet a signature")
	}
	both := Sign(Keys{HMAC: [][]byte{key, []byte("old")}}, id, now.Unix(), body)
	if n := len(strings.Split(both, " ")); n != 2 {
		t.Fatalf("two keys, %d signatures: %q", n, both)
	}
}

// The verifier accepts v1 under any HMAC key held and v1a under any public key held,
// and refuses a signature by another key, a timestamp beyond the tolerance either
// way (by its injected clock), incomplete headers, and X-Signature alone unless told
// to accept it; a request with Standard Webhooks headers is never let through by its
// X-Signature.
func TestVerifier(t *testing.T) {
	oldKey, newKey := []byte("old"), []byte("new")
	oldPub, oldPriv := newEd25519(t)
	newPub, newPriv := newEd25519(t)
	_, strangerPriv := newEd25519(t)
	body := []byte(`{"kind":"grant"}`)
	id := MessageID("u/1")
	at := time.Date(2026, 12, 4, 10, 0, 0, 0, time.UTC)
	clock := at
	v := Verifier{HMAC: [][]byte{oldKey, newKey}, PublicKeys: []ed25519.PublicKey{oldPub, newPub}, Now: func() time.Time { return clock }}

	for name, c := range map[string]struct {
		keys   Keys
		scheme string
		err    error
	}{
		"v1, the new key":       {Keys{HMAC: [][]byte{newKey}}, SchemeHMAC, nil},
		"v1, the old key":       {Keys{HMAC: [][]byte{oldKey}}, SchemeHMAC, nil},
		"v1a, the new key":      {Keys{Ed25519: []ed25519.PrivateKey{newPriv}}, SchemeEd25519, nil},
		"v1a, the old key":      {Keys{Ed25519: []ed25519.PrivateKey{oldPriv}}, SchemeEd25519, nil},
		"v1, another key":       {Keys{HMAC: [][]byte{[]byte("stranger")}}, "", ErrNoMatchingSignature},
		"v1a, another key":      {Keys{Ed25519: []ed25519.PrivateKey{strangerPriv}}, "", ErrNoMatchingSignature},
		"both, one of them bad": {Keys{HMAC: [][]byte{[]byte("stranger")}, Ed25519: []ed25519.PrivateKey{newPriv}}, SchemeEd25519, nil},
	} {
		h := headers(id, at.Unix(), Sign(c.keys, id, at.Unix(), body))
		scheme, err := v.Verify(h, body)
		if scheme != c.scheme || !errors.Is(err, c.err) {
			t.Errorf("%s: %q, %v; want %q, %v", name, scheme, err, c.scheme, c.err)
		}
	}

	good := headers(id, at.Unix(), Sign(Keys{HMAC: [][]byte{newKey}, Ed25519: []ed25519.PrivateKey{newPriv}}, id, at.Unix(), body))
	if _, err := v.Verify(good, []byte(`{"kind":"refund"}`)); !errors.Is(err, ErrNoMatchingSignature) {
		t.Errorf("another body: %v", err)
	}
	forged := good.Clone()
	forged.Set(HeaderID, MessageID("u/2"))
	if _, err := v.Verify(forged, body); !errors.Is(err, ErrNoMatchingSignature) {
		t.Errorf("another id: %v", err)
	}

	// The tolerance, both ways, by the verifier's clock.
	for _, c := range []struct {
		now time.Time
		err error
	}{
		{at.Add(5 * time.Minute), nil},
		{at.Add(-5 * time.Minute), nil},
		{at.Add(5*time.Minute + time.Second), ErrStale},
		{at.Add(-5*time.Minute - time.Second), ErrStale},
		{at.Add(time.Hour), ErrStale},
	} {
		clock = c.now
		if _, err := v.Verify(good, body); !errors.Is(err, c.err) {
			t.Errorf("signed at %s, checked at %s: %v, want %v", at, c.now, err, c.err)
		}
	}
	clock = at
	short := v
	short.Tolerance = time.Minute
	clock = at.Add(2 * time.Minute)
	if _, err := short.Verify(good, body); !errors.Is(err, ErrStale) {
		t.Errorf("a tolerance of 1 minute, 2 minutes late: %v", err)
	}
	clock = at

	// Incomplete or malformed headers.
	for _, drop := range []string{HeaderID, HeaderTimestamp, HeaderSignature} {
		h := good.Clone()
		h.Del(drop)
		if _, err := v.Verify(h, body); !errors.Is(err, ErrMalformed) {
			t.Errorf("without %s: %v", drop, err)
		}
	}
	h := good.Clone()
	h.Set(HeaderTimestamp, "2026-12-04T10:00:00Z")
	if _, err := v.Verify(h, body); !errors.Is(err, ErrMalformed) {
		t.Errorf("an RFC 3339 timestamp: %v", err)
	}

	// X-Signature alone: refused unless accepted, and never instead of bad
	// Standard Webhooks headers.
	x := http.Header{}
	x.Set(XSignatureHeader, XSignature(newKey, body))
	if _, err := v.Verify(x, body); !errors.Is(err, ErrUnsigned) {
		t.Errorf("X-Signature alone, not accepted: %v", err)
	}
	lenient := v
	lenient.AcceptXSignature = true
	if scheme, err := lenient.Verify(x, body); err != nil || scheme != SchemeXSignature {
		t.Errorf("X-Signature alone, accepted: %q, %v", scheme, err)
	}
	stale := good.Clone()
	stale.Set(XSignatureHeader, XSignature(newKey, body))
	clock = at.Add(time.Hour)
	if _, err := lenient.Verify(stale, body); !errors.Is(err, ErrStale) {
		t.Errorf("a stale request with a good X-Signature: %v", err)
	}
	clock = at
	if _, err := lenient.Verify(http.Header{}, body); !errors.Is(err, ErrUnsigned) {
		t.Errorf("nothing at all: %v", err)
	}
}

// X-Signature is "sha256=" and the hex HMAC-SHA256 of the body under any key held.
func TestVerifyXSignature(t *testing.T) {
	body := []byte(`{"kind":"grant"}`)
	keys := [][]byte{[]byte("old"), []byte("new")}
	for _, k := range keys {
		if !VerifyXSignature(keys, body, XSignature(k, body)) {
			t.Errorf("the signature of key %q is refused", k)
		}
	}
	for _, sig := range []string{"", "sha256=", XSignature([]byte("other"), body), XSignature(keys[0], []byte("other body")),
		"sha1=" + XSignature(keys[0], body)[7:], XSignature(keys[0], body) + "00"} {
		if VerifyXSignature(keys, body, sig) {
			t.Errorf("signature %q is accepted", sig)
		}
	}
	if VerifyXSignature(nil, body, XSignature(keys[0], body)) {
		t.Error("a signature is accepted with no key held")
	}
}

// Keys read back as they are written: a private key from its seed or its 64 bytes,
// a public key from its 32; anything else is refused.
func TestKeySpelling(t *testing.T) {
	pub, priv := newEd25519(t)
	for _, s := range []string{FormatPrivateKey(priv), FormatPrivateKey(priv) + "\n",
		PrivateKeyPrefix + base64.StdEncoding.EncodeToString(priv), PrivateKeyPrefix + base64.RawStdEncoding.EncodeToString(priv.Seed())} {
		k, err := ParsePrivateKey([]byte(s))
		if err != nil || !bytes.Equal(k, priv) {
			t.Errorf("private key %q…: %v", s[:8], err)
		}
	}
	p, err := ParsePublicKey([]byte(FormatPublicKey(pub) + "\n"))
	if err != nil || !p.Equal(pub) {
		t.Errorf("public key: %v", err)
	}
	bad := append(ed25519.PrivateKey{}, priv...)
	bad[40] ^= 1
	for _, s := range []string{"", base64.StdEncoding.EncodeToString(priv.Seed()), PublicKeyPrefix + base64.StdEncoding.EncodeToString(priv.Seed()),
		PrivateKeyPrefix + "not base64!", PrivateKeyPrefix + base64.StdEncoding.EncodeToString(priv.Seed()[:31]),
		PrivateKeyPrefix + base64.StdEncoding.EncodeToString(bad)} {
		if _, err := ParsePrivateKey([]byte(s)); err == nil {
			t.Errorf("private key %q accepted", s)
		} else if seed := base64.StdEncoding.EncodeToString(priv.Seed()); strings.Contains(err.Error(), seed[:8]) {
			t.Errorf("the error shows the key: %v", err)
		}
	}
	for _, s := range []string{"", FormatPrivateKey(priv), PublicKeyPrefix + base64.StdEncoding.EncodeToString(pub[:31])} {
		if _, err := ParsePublicKey([]byte(s)); err == nil {
			t.Errorf("public key %q accepted", s)
		}
	}
}

// The openssl commands of docs/operations.md ("Rotating a key", the Ed25519 key)
// make a whsk_ and a whpk_ that belong together: the last 32 bytes of the private
// key's PKCS #8 DER are its seed, those of the public key's DER the public key.
func TestOpenSSLKeysOfTheDocs(t *testing.T) {
	needOpenSSL(t)
	dir := t.TempDir()
	pem := filepath.Join(dir, "operator-ed25519.pem")
	script := `set -e
openssl genpkey -algorithm ed25519 -out "$1" 2>/dev/null
echo "whsk_$(openssl pkey -in "$1" -outform DER | tail -c 32 | base64)"
echo "whpk_$(openssl pkey -in "$1" -pubout -outform DER | tail -c 32 | base64)"`
	out, err := exec.Command("sh", "-c", script, "sh", pem).Output()
	if err != nil {
		t.Fatalf("openssl: %v", err)
	}
	lines := strings.Fields(string(out))
	if len(lines) != 2 {
		t.Fatalf("openssl printed %q", out)
	}
	priv, err := ParsePrivateKey([]byte(lines[0]))
	if err != nil {
		t.Fatal(err)
	}
	pub, err := ParsePublicKey([]byte(lines[1]))
	if err != nil {
		t.Fatal(err)
	}
	if !pub.Equal(priv.Public()) {
		t.Fatal("the whpk_ is not the whsk_'s public key")
	}
	_ = os.Remove(pem)
}

// The shell check of a v1 signature in docs/grab-api.md ("Settlement deliveries")
// prints what Sign puts after "v1,".
func TestShellV1OfTheDocs(t *testing.T) {
	needOpenSSL(t)
	key, id, ts, body := "the-host-key", MessageID("uid/7"), int64(1767225600), `{"kind":"grant","amount":57}`
	script := `printf '%s.%s.%s' "$id" "$timestamp" "$body" | openssl dgst -sha256 -hmac "$key" -binary | base64`
	cmd := exec.Command("sh", "-c", script)
	cmd.Env = append(os.Environ(), "key="+key, "id="+id, "timestamp="+strconv.FormatInt(ts, 10), "body="+body)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("openssl: %v", err)
	}
	want := strings.TrimPrefix(Sign(Keys{HMAC: [][]byte{[]byte(key)}}, id, ts, []byte(body)), "v1,")
	if got := strings.TrimSpace(string(out)); got != want {
		t.Fatalf("the shell prints %q, Sign %q", got, want)
	}
}

// needOpenSSL skips a test that runs the docs' openssl commands on a host without
// openssl, and fails it under CI=true, where hack/ensure-node-packages.sh installs it.
func needOpenSSL(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("openssl"); err == nil {
		return
	}
	why := "no openssl on this host (hack/ensure-node-packages.sh installs it as root)"
	if os.Getenv("CI") == "true" {
		t.Fatal("CI must run this test: " + why)
	}
	t.Skip(why)
}
