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

	"k8s.io/apimachinery/pkg/types"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/pkg/hmackey"
)

// DefaultTokenMaxLifetime is how far in the future a token's exp may lie unless
// configured otherwise (--token-max-lifetime).
const DefaultTokenMaxLifetime = 24 * time.Hour

// TokenClaims is the payload of a user token: who may grab, in which activity, until when.
type TokenClaims struct {
	// UserID must equal the userId of the grab request.
	UserID string `json:"userId"`
	// Activity is "<namespace>/<name>" of the activity the token is good for.
	Activity string `json:"activity"`
	// ActivityUID is the metadata.uid of that activity. It binds the token to this
	// one activity: an activity deleted and created again under the same name has
	// another UID, and the first one's tokens are refused by the second.
	ActivityUID types.UID `json:"activityUID"`
	// Exp is the expiry in unix seconds; the token is refused from that second on,
	// and also when it lies further ahead than the verifier's maximum lifetime.
	Exp int64 `json:"exp"`
	// Budget is "<namespace>/<name>" of the RedPacketBudget a token for runtime
	// packets is good for; such a token names no activity, and an activity's token
	// names no budget, so neither is good for the other.
	Budget string `json:"budget,omitempty"`
	// BudgetUID is the metadata.uid of that budget, binding the token to it as
	// ActivityUID binds an activity's.
	BudgetUID types.UID `json:"budgetUID,omitempty"`
	// Packet, when set, narrows a budget's token to the one packet with this id;
	// empty, the token is good for every packet of the budget.
	Packet string `json:"packet,omitempty"`
}

// TokenAudience is what a token must name to be good for a grab: the activity's
// "<namespace>/<name>" and its UID.
type TokenAudience struct {
	Activity string
	UID      types.UID
}

// AudienceOf is the audience of the activity's tokens.
func AudienceOf(a *Resource) TokenAudience {
	return TokenAudience{Activity: a.Ref, UID: a.Object.UID}
}

// RequiresTokens reports whether the activity's spec asks for user tokens
// (spec.grabService.auth). A grab service without a verification key must then
// refuse every grab (TokenVerifier.Check).
func RequiresTokens(o *redpacketv1alpha1.RedPacketActivity) bool {
	return o.Spec.GrabService.Auth != nil
}

// Errors a token check returns. Each is answered with 401 unauthorized.
var (
	ErrTokenMissing   = errors.New("an Authorization: Bearer token is required")
	ErrTokenMalformed = errors.New("the bearer token is malformed")
	ErrTokenSignature = errors.New("the bearer token's signature is not valid")
	ErrTokenExpired   = errors.New("the bearer token has expired")
	ErrTokenActivity  = errors.New("the bearer token is for another activity")
	ErrTokenUser      = errors.New("the bearer token is for another user")
	// ErrTokenActivityUID also answers tokens minted without activityUID.
	ErrTokenActivityUID = errors.New("the bearer token's activityUID is not this activity's metadata.uid " +
		"(an activity created again under the same name has a new UID)")
	// ErrTokenLifetime is answered like the others, with the limit in the message.
	ErrTokenLifetime = errors.New("the bearer token's exp lies further ahead than this service's maximum token lifetime")
	// ErrTokenBudget answers a token for another budget (name or UID), or one that
	// names no budget (an activity's token).
	ErrTokenBudget = errors.New("the bearer token is not for this budget (its budget and budgetUID must be this budget's " +
		"<namespace>/<name> and metadata.uid)")
	// ErrTokenPacket answers a token bound to another packet.
	ErrTokenPacket = errors.New("the bearer token is for another packet")
)

// ErrNoTokenKey is returned by a nil TokenVerifier's Check for an activity that
// requires tokens: the service was started without a verification key, so it can
// check no token and must grant nothing. It is answered with 503 unavailable.
var ErrNoTokenKey = errors.New("this activity requires user tokens (spec.grabService.auth) but this grab service " +
	"has no token verification key (--token-key-file); it grants nothing until it is restarted with the key")

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
// while requests are served (a rotated Secret). A nil *TokenVerifier stands for a
// service started without a key: its Check refuses the grabs of an activity that
// requires tokens and lets the others through.
type TokenVerifier struct {
	key atomic.Pointer[[]byte]
	// MaxLifetime, when positive, refuses a token whose exp lies more than that far
	// after now (ErrTokenLifetime): a leaked token is good for at most that long.
	// NewTokenVerifier sets DefaultTokenMaxLifetime.
	MaxLifetime time.Duration
	// Now returns the current time; nil means time.Now.
	Now func() time.Time
}

// NewTokenVerifier returns a verifier for key, which must not be empty, with the
// default maximum lifetime.
func NewTokenVerifier(key []byte) (*TokenVerifier, error) {
	v := &TokenVerifier{MaxLifetime: DefaultTokenMaxLifetime}
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
	key, err := hmackey.Parse(data)
	if err != nil {
		return nil, fmt.Errorf("key file %s: %w", path, err)
	}
	return key, nil
}

// Check decides whether a grab by userID in act may go on as far as tokens are
// concerned. A verifier checks the Authorization header value (Verify). A nil
// verifier, a service without a key, fails closed: ErrNoTokenKey for an activity
// that requires tokens, nil for one that does not.
func (v *TokenVerifier) Check(authorization string, act *Resource, userID string) error {
	if v == nil {
		if RequiresTokens(act.Object) {
			return ErrNoTokenKey
		}
		return nil
	}
	return v.Verify(authorization, AudienceOf(act), userID)
}

// Verify checks the Authorization header value of a grab by userID for aud. It
// returns nil when the token is genuine, unexpired, not longer-lived than
// MaxLifetime allows, for this activity (name and UID) and for this user.
func (v *TokenVerifier) Verify(authorization string, aud TokenAudience, userID string) error {
	c, err := v.claims(authorization)
	if err != nil {
		return err
	}
	if c.Activity != aud.Activity {
		return ErrTokenActivity
	}
	if c.ActivityUID != aud.UID {
		return ErrTokenActivityUID
	}
	if c.UserID != userID {
		return ErrTokenUser
	}
	return nil
}

// BudgetAudience is what a token must name to be good for a grab of a runtime
// packet: the budget's "<namespace>/<name>" and its UID.
type BudgetAudience struct {
	Budget string
	UID    types.UID
}

// VerifyPacket checks the Authorization header value of a grab by userID of the
// budget's packet packetID. It returns nil when the token is genuine, unexpired, not
// longer-lived than MaxLifetime allows, for this budget (name and UID), for this
// packet when it names one, and for this user.
func (v *TokenVerifier) VerifyPacket(authorization string, aud BudgetAudience, packetID, userID string) error {
	c, err := v.packetClaims(authorization, aud, packetID)
	if err != nil {
		return err
	}
	if c.UserID != userID {
		return ErrTokenUser
	}
	return nil
}

// VerifyPacketRead checks the Authorization header value of a read of the budget's
// packet packetID (GET /v1/packets/{id}): the checks of VerifyPacket except the user.
// A token that would let its user grab this packet lets them read it, whoever they
// are: a member of the group reads who got what. A token bound to another packet
// reads nothing of this one.
func (v *TokenVerifier) VerifyPacketRead(authorization string, aud BudgetAudience, packetID string) error {
	_, err := v.packetClaims(authorization, aud, packetID)
	return err
}

// packetClaims returns the claims of a genuine, unexpired token for this budget (name
// and UID) and, when it names a packet, for packetID.
func (v *TokenVerifier) packetClaims(authorization string, aud BudgetAudience, packetID string) (TokenClaims, error) {
	c, err := v.claims(authorization)
	if err != nil {
		return TokenClaims{}, err
	}
	if c.Budget == "" || c.Budget != aud.Budget || c.BudgetUID != aud.UID {
		return TokenClaims{}, ErrTokenBudget
	}
	if c.Packet != "" && c.Packet != packetID {
		return TokenClaims{}, ErrTokenPacket
	}
	return c, nil
}

// claims returns the claims of a genuine, unexpired token that is not longer-lived
// than MaxLifetime allows, from an Authorization header value.
func (v *TokenVerifier) claims(authorization string) (TokenClaims, error) {
	const prefix = "Bearer "
	if authorization == "" {
		return TokenClaims{}, ErrTokenMissing
	}
	if len(authorization) <= len(prefix) || !strings.EqualFold(authorization[:len(prefix)], prefix) {
		return TokenClaims{}, ErrTokenMalformed
	}
	token := strings.TrimSpace(authorization[len(prefix):])
	if len(token) > maxTokenLen {
		return TokenClaims{}, ErrTokenMalformed
	}
	encPayload, encSig, ok := strings.Cut(token, ".")
	if !ok || strings.Contains(encSig, ".") {
		return TokenClaims{}, ErrTokenMalformed
	}
	payload, err := decodeB64URL(encPayload)
	if err != nil || len(payload) == 0 {
		return TokenClaims{}, ErrTokenMalformed
	}
	sig, err := decodeB64URL(encSig)
	if err != nil {
		return TokenClaims{}, ErrTokenMalformed
	}
	mac := hmac.New(sha256.New, *v.key.Load())
	mac.Write(payload)
	if !hmac.Equal(sig, mac.Sum(nil)) {
		return TokenClaims{}, ErrTokenSignature
	}
	var c TokenClaims
	dec := json.NewDecoder(bytes.NewReader(payload))
	if err := dec.Decode(&c); err != nil || dec.More() {
		return TokenClaims{}, ErrTokenMalformed
	}
	now := time.Now
	if v.Now != nil {
		now = v.Now
	}
	nowSec := now().Unix()
	if c.Exp <= nowSec {
		return TokenClaims{}, ErrTokenExpired
	}
	if v.MaxLifetime > 0 && c.Exp-nowSec > int64(v.MaxLifetime/time.Second) {
		return TokenClaims{}, fmt.Errorf("%w (%s)", ErrTokenLifetime, v.MaxLifetime)
	}
	return c, nil
}

// decodeB64URL decodes base64url with or without padding.
func decodeB64URL(s string) ([]byte, error) {
	return base64.RawURLEncoding.DecodeString(strings.TrimRight(s, "="))
}
