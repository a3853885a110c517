package grabsvc

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"redpacket.io/operator/grabsvc/settlement"
)

// TokenClaims is the payload of a user token: who may grab, in which activity, until when.
type TokenClaims struct {
	// UserID must equal the userId of the grab request.
	UserID string `json:"userId"`
	// Activity is "<namespace>/<name>" of the activity the token is good for.
	Activity string `json:"activity"`
	// Exp is the expiry in unix seconds; the token is refused from that second on.
	Exp int64 `json:"exp"`
}

// Errors a token check returns. Each is answered with 401 unauthorized.
var (
	ErrTokenMissing   = errors.New("an Authorization: Bearer token is required")
	ErrTokenMalformed = errors.New("the bearer token is malformed")
	ErrTokenSignature = errors.New("the bearer token's signature is not valid")
	ErrTokenExpired   = errors.New("the bearer token has expired")
	ErrTokenActivity  = errors.New("the bearer token is for another activity")
	ErrTokenUser      = errors.New("the bearer token is for another user")
)

// maxTokenLen bounds the bearer token we are willing to decode.
const maxTokenLen = 2048

// SignToken returns the bearer token for the claims:
// base64url(payload) + "." + base64url(HMAC-SHA256(key, payload)), payload being the
// claims' JSON. Issuers of user tokens (and tests) use it.
func SignToken(key []byte, c TokenClaims) (string, error) {
	payload, err := json.Marshal(c)
	if err != nil {
		return "", fmt.Errorf("encoding token claims: %w", err)
	}
	mac := hmac.New(sha256.New, key)
	mac.Write(payload)
	return base64.RawURLEncoding.EncodeToString(payload) + "." +
		base64.RawURLEncoding.EncodeToString(mac.Sum(nil)), nil
}

// TokenVerifier checks user tokens against an HMAC key. The key can be replaced
// while requests are served (a rotated Secret).
type TokenVerifier struct {
	key atomic.Pointer[[]byte]
	// Now returns the current time; nil means time.Now.
	Now func() time.Time
}

// NewTokenVerifier returns a verifier for key, which must not be empty.
func NewTokenVerifier(key []byte) (*TokenVerifier, error) {
	v := &TokenVerifier{}
	if err := v.SetKey(key); err != nil {
		return nil, err
	}
	return v, nil
}

// SetKey replaces the HMAC key.
func (v *TokenVerifier) SetKey(key []byte) error {
	if len(key) == 0 {
		return errors.New("token key is empty")
	}
	k := bytes.Clone(key)
	v.key.Store(&k)
	return nil
}

// ReadKeyFile reads an HMAC key from a file, such as a mounted Secret key. Trailing
// line breaks are removed; any other byte is part of the key.
func ReadKeyFile(path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading key file: %w", err)
	}
	key, err := settlement.ParseKey(data)
	if err != nil {
		return nil, fmt.Errorf("key file %s: %w", path, err)
	}
	return key, nil
}

// Verify checks the Authorization header value of a grab by userID in activity
// ("<namespace>/<name>"). It returns nil when the token is genuine, unexpired, for
// this activity and for this user.
func (v *TokenVerifier) Verify(authorization, activity, userID string) error {
	const prefix = "Bearer "
	if authorization == "" {
		return ErrTokenMissing
	}
	if len(authorization) <= len(prefix) || !strings.EqualFold(authorization[:len(prefix)], prefix) {
		return ErrTokenMalformed
	}
	token := strings.TrimSpace(authorization[len(prefix):])
	if len(token) > maxTokenLen {
		return ErrTokenMalformed
	}
	encPayload, encSig, ok := strings.Cut(token, ".")
	if !ok || strings.Contains(encSig, ".") {
		return ErrTokenMalformed
	}
	payload, err := decodeB64URL(encPayload)
	if err != nil || len(payload) == 0 {
		return ErrTokenMalformed
	}
	sig, err := decodeB64URL(encSig)
	if err != nil {
		return ErrTokenMalformed
	}
	mac := hmac.New(sha256.New, *v.key.Load())
	mac.Write(payload)
	if !hmac.Equal(sig, mac.Sum(nil)) {
		return ErrTokenSignature
	}
	var c TokenClaims
	dec := json.NewDecoder(bytes.NewReader(payload))
	if err := dec.Decode(&c); err != nil || dec.More() {
		return ErrTokenMalformed
	}
	now := time.Now
	if v.Now != nil {
		now = v.Now
	}
	if c.Exp <= now().Unix() {
		return ErrTokenExpired
	}
	if c.Activity != activity {
		return ErrTokenActivity
	}
	if c.UserID != userID {
		return ErrTokenUser
	}
	return nil
}

// decodeB64URL decodes base64url with or without padding.
func decodeB64URL(s string) ([]byte, error) {
	return base64.RawURLEncoding.DecodeString(strings.TrimRight(s, "="))
}
