package webhooksig

import (
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
)

// DefaultTolerance is how far a request's webhook-timestamp may be from the
// receiver's clock, either way, before the request is refused: the Standard Webhooks
// libraries' 5 minutes.
const DefaultTolerance = 5 * time.Minute

// XSignatureHeader is the operator's former signature header, "sha256=<hex
// HMAC-SHA256 of the body>": sent beside the Standard Webhooks headers for one
// release, then no more. It has no timestamp, so a request it alone vouches for can
// be replayed at any time.
const XSignatureHeader = "X-Signature"

// The reasons Verify refuses a request. Each one is a 401 for the receivers.
var (
	// ErrUnsigned: no Standard Webhooks headers, and no X-Signature accepted instead.
	ErrUnsigned = errors.New("the request carries no webhook-id, webhook-timestamp and webhook-signature")
	// ErrMalformed: some of the three headers are missing, or the timestamp is not
	// an integer.
	ErrMalformed = errors.New("the Standard Webhooks headers are incomplete or malformed")
	// ErrStale: the webhook-timestamp is further from the receiver's clock than the
	// tolerance, so the request may be a captured one replayed.
	ErrStale = errors.New("the webhook-timestamp is outside the tolerance")
	// ErrNoMatchingSignature: no signature verifies with a key the receiver holds.
	ErrNoMatchingSignature = errors.New("no signature verifies with a key this receiver holds")
)

// The schemes a request verified by.
const (
	SchemeHMAC       = VersionHMAC    // a v1 signature
	SchemeEd25519    = VersionEd25519 // a v1a signature
	SchemeXSignature = "x-signature"  // the former header, with AcceptXSignature
)

// Verifier checks a request against the keys a receiver holds.
type Verifier struct {
	// HMAC are the shared keys (every key of a rotation), as the operator's keys
	// Secret holds them: they verify v1 signatures, and X-Signature when accepted.
	HMAC [][]byte
	// PublicKeys are the operator's Ed25519 public keys (every key of a rotation):
	// they verify v1a signatures.
	PublicKeys []ed25519.PublicKey
	// Tolerance is how far the webhook-timestamp may be from Now, either way;
	// 0 means DefaultTolerance.
	Tolerance time.Duration
	// Now is the receiver's clock; nil means time.Now.
	Now func() time.Time
	// AcceptXSignature accepts, from a sender of an earlier release, a request
	// without any of the Standard Webhooks headers whose X-Signature verifies with
	// an HMAC key. A request with any of them is judged by them alone. Accepting it
	// lets a captured request be replayed without its webhook-* headers at any time:
	// turn it off once every sender sends them.
	AcceptXSignature bool
}

// Enabled reports whether v holds any key; a receiver without one authenticates
// nothing.
func (v Verifier) Enabled() bool { return len(v.HMAC) > 0 || len(v.PublicKeys) > 0 }

// Verify checks the request's headers and raw body and returns the scheme of the
// signature that verified, or why none did (ErrUnsigned, ErrMalformed, ErrStale,
// ErrNoMatchingSignature).
//
// A request carrying any of the Standard Webhooks headers must carry all three; its
// webhook-timestamp must be within the tolerance of Now; one of the signatures of
// webhook-signature must verify: a v1 with one of the HMAC keys (checked by the
// Standard Webhooks Go library), or a v1a with one of the public keys. Otherwise,
// with AcceptXSignature, its X-Signature must verify with one of the HMAC keys.
func (v Verifier) Verify(h http.Header, body []byte) (string, error) {
	id, ts, sig := h.Get(HeaderID), h.Get(HeaderTimestamp), h.Get(HeaderSignature)
	if id == "" && ts == "" && sig == "" {
		if v.AcceptXSignature && VerifyXSignature(v.HMAC, body, h.Get(XSignatureHeader)) {
			return SchemeXSignature, nil
		}
		return "", ErrUnsigned
	}
	if id == "" || ts == "" || sig == "" {
		return "", ErrMalformed
	}
	secs, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return "", ErrMalformed
	}
	now := time.Now
	if v.Now != nil {
		now = v.Now
	}
	tolerance := v.Tolerance
	if tolerance <= 0 {
		tolerance = DefaultTolerance
	}
	at, n := time.Unix(secs, 0), now()
	if n.Sub(at) > tolerance || at.Sub(n) > tolerance {
		return "", ErrStale
	}
	for _, k := range v.HMAC {
		wh, err := standardwebhooks.NewWebhookRaw(k)
		if err != nil {
			continue
		}
		// The timestamp was checked above against Now, which the library cannot be
		// given.
		if wh.VerifyIgnoringTimestamp(body, h) == nil {
			return SchemeHMAC, nil
		}
	}
	if len(v.PublicKeys) > 0 {
		content := signedContent(id, secs, body)
		for _, versioned := range strings.Split(sig, " ") {
			version, enc, ok := strings.Cut(versioned, ",")
			if !ok || version != VersionEd25519 {
				continue
			}
			s, err := base64.StdEncoding.DecodeString(enc)
			if err != nil || len(s) != ed25519.SignatureSize {
				continue
			}
			for _, pub := range v.PublicKeys {
				if len(pub) == ed25519.PublicKeySize && ed25519.Verify(pub, content, s) {
					return SchemeEd25519, nil
				}
			}
		}
	}
	return "", ErrNoMatchingSignature
}

// XSignature is the X-Signature header of body under key: "sha256=" and the hex
// HMAC-SHA256 of the body.
func XSignature(key, body []byte) string {
	mac := hmac.New(sha256.New, key)
	mac.Write(body)
	return "sha256=" + hex.EncodeToString(mac.Sum(nil))
}

// VerifyXSignature reports whether header is body's X-Signature under one of keys.
// Every key is tried, so that both the old and the new key pass during a rotation.
func VerifyXSignature(keys [][]byte, body []byte, header string) bool {
	got, ok := strings.CutPrefix(header, "sha256=")
	if !ok {
		return false
	}
	sig, err := hex.DecodeString(got)
	if err != nil || len(sig) != sha256.Size {
		return false
	}
	ok = false
	for _, k := range keys {
		mac := hmac.New(sha256.New, k)
		mac.Write(body)
		if hmac.Equal(sig, mac.Sum(nil)) {
			ok = true
		}
	}
	return ok
}
