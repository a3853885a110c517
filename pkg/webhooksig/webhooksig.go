// Package webhooksig signs and verifies the settlement webhook's requests by the
// Standard Webhooks scheme: the headers webhook-id, webhook-timestamp (unix seconds)
// and webhook-signature, a space-separated list of "<version>,<base64 signature>" of
// "<id>.<timestamp>.<body>", where version v1 is HMAC-SHA256 under a shared key and
// v1a is Ed25519 under the sender's private key, which the receiver verifies with
// the public key alone.
//
// The operator signs with it (settlement); the reference receivers (internal/rain,
// internal/balance) verify with it, v1 through the Standard Webhooks Go library, so
// that what the operator sends is what any language's library accepts. It also reads
// and writes the keys as Standard Webhooks spells them: "whsec_" + base64 for an
// HMAC key, "whsk_" + base64 for an Ed25519 private key, "whpk_" + base64 for its
// public key.
package webhooksig

import (
	"bytes"
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// The Standard Webhooks headers.
const (
	HeaderID        = "webhook-id"
	HeaderTimestamp = "webhook-timestamp"
	HeaderSignature = "webhook-signature"
)

// The signature versions: v1 is HMAC-SHA256, v1a Ed25519.
const (
	VersionHMAC    = "v1"
	VersionEd25519 = "v1a"
)

// The prefixes of the keys' Standard Webhooks spelling.
const (
	SecretPrefix     = "whsec_"
	PrivateKeyPrefix = "whsk_"
	PublicKeyPrefix  = "whpk_"
)

// MessageIDPrefix starts every webhook-id the operator sends.
const MessageIDPrefix = "msg_"

// MessageID is the webhook-id of the request carrying idempotencyKey: "msg_" and the
// unpadded base64url of the SHA-256 of the key (47 characters). It is the same for
// every attempt of one delivery, hedges and retries included, as the Idempotency-Key
// is, so a receiver that deduplicates on webhook-id books what it would book by the
// Idempotency-Key; anyone can compute it from the key, and no two keys share it.
func MessageID(idempotencyKey string) string {
	sum := sha256.Sum256([]byte(idempotencyKey))
	return MessageIDPrefix + base64.RawURLEncoding.EncodeToString(sum[:])
}

// signedContent is what every signature covers: "<id>.<timestamp>.<body>".
func signedContent(id string, timestamp int64, body []byte) []byte {
	var b bytes.Buffer
	b.Grow(len(id) + 22 + len(body))
	b.WriteString(id)
	b.WriteByte('.')
	b.WriteString(strconv.FormatInt(timestamp, 10))
	b.WriteByte('.')
	b.Write(body)
	return b.Bytes()
}

// Keys are what a sender signs one request with. Every key yields one signature in
// the webhook-signature header, so that during a rotation the receiver verifies the
// request with whichever of the old and the new key it holds.
type Keys struct {
	// HMAC are the v1 keys, the current one first.
	HMAC [][]byte
	// Ed25519 are the v1a private keys, the current one first.
	Ed25519 []ed25519.PrivateKey
}

// Empty reports whether k signs nothing.
func (k Keys) Empty() bool { return len(k.HMAC) == 0 && len(k.Ed25519) == 0 }

// Sign returns the webhook-signature header of body sent as message id at timestamp
// (unix seconds): "v1,<base64>" for every HMAC key, then "v1a,<base64>" for every
// Ed25519 key, separated by spaces; "" when k holds no key.
func Sign(k Keys, id string, timestamp int64, body []byte) string {
	if k.Empty() {
		return ""
	}
	content := signedContent(id, timestamp, body)
	sigs := make([]string, 0, len(k.HMAC)+len(k.Ed25519))
	for _, key := range k.HMAC {
		mac := hmac.New(sha256.New, key)
		mac.Write(content)
		sigs = append(sigs, VersionHMAC+","+base64.StdEncoding.EncodeToString(mac.Sum(nil)))
	}
	for _, key := range k.Ed25519 {
		sigs = append(sigs, VersionEd25519+","+base64.StdEncoding.EncodeToString(ed25519.Sign(key, content)))
	}
	return strings.Join(sigs, " ")
}

// FormatSecret is an HMAC key as a Standard Webhooks library takes it: "whsec_" and
// the standard base64 of the key's bytes.
func FormatSecret(key []byte) string {
	return SecretPrefix + base64.StdEncoding.EncodeToString(key)
}

// FormatPrivateKey is an Ed25519 private key as the operator's keys Secret holds it:
// "whsk_" and the standard base64 of its 32-byte seed.
func FormatPrivateKey(key ed25519.PrivateKey) string {
	return PrivateKeyPrefix + base64.StdEncoding.EncodeToString(key.Seed())
}

// FormatPublicKey is an Ed25519 public key as a receiver holds it: "whpk_" and the
// standard base64 of its 32 bytes.
func FormatPublicKey(key ed25519.PublicKey) string {
	return PublicKeyPrefix + base64.StdEncoding.EncodeToString(key)
}

// ParsePrivateKey reads an Ed25519 private key spelt "whsk_<base64>", the base64 of
// the 32-byte seed or of the 64-byte key (seed and public key, as Go and libsodium
// keep it); surrounding white space (a file's last newline) is ignored. A 64-byte key
// whose public half is not its seed's is refused.
func ParsePrivateKey(data []byte) (ed25519.PrivateKey, error) {
	s := strings.TrimSpace(string(data))
	enc, ok := strings.CutPrefix(s, PrivateKeyPrefix)
	if !ok {
		return nil, fmt.Errorf("an Ed25519 private key is spelt %q and base64; this value does not start with %[1]q", PrivateKeyPrefix)
	}
	raw, err := decodeBase64(enc)
	if err != nil {
		return nil, fmt.Errorf("an Ed25519 private key: %w", err)
	}
	switch len(raw) {
	case ed25519.SeedSize:
		return ed25519.NewKeyFromSeed(raw), nil
	case ed25519.PrivateKeySize:
		k := ed25519.NewKeyFromSeed(raw[:ed25519.SeedSize])
		if !bytes.Equal(k, raw) {
			return nil, errors.New("an Ed25519 private key of 64 bytes whose public half is not its seed's")
		}
		return k, nil
	default:
		return nil, fmt.Errorf("an Ed25519 private key is a 32-byte seed or a 64-byte key, not %d bytes", len(raw))
	}
}

// ParsePublicKey reads an Ed25519 public key spelt "whpk_<base64 of 32 bytes>";
// surrounding white space is ignored.
func ParsePublicKey(data []byte) (ed25519.PublicKey, error) {
	s := strings.TrimSpace(string(data))
	enc, ok := strings.CutPrefix(s, PublicKeyPrefix)
	if !ok {
		return nil, fmt.Errorf("an Ed25519 public key is spelt %q and base64; this value does not start with %[1]q", PublicKeyPrefix)
	}
	raw, err := decodeBase64(enc)
	if err != nil {
		return nil, fmt.Errorf("an Ed25519 public key: %w", err)
	}
	if len(raw) != ed25519.PublicKeySize {
		return nil, fmt.Errorf("an Ed25519 public key is 32 bytes, not %d", len(raw))
	}
	return ed25519.PublicKey(raw), nil
}

// decodeBase64 reads standard base64, padded or not.
func decodeBase64(s string) ([]byte, error) {
	if b, err := base64.StdEncoding.DecodeString(s); err == nil {
		return b, nil
	}
	b, err := base64.RawStdEncoding.DecodeString(s)
	if err != nil {
		return nil, errors.New("not base64")
	}
	return b, nil
}
