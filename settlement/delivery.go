package settlement

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/store"
)

// Delivery is the JSON body POSTed to the balance system for one stream entry.
type Delivery struct {
	// Kind is "grant" or "refund".
	Kind string `json:"kind"`
	// Activity is "<namespace>/<name>".
	Activity string `json:"activity"`
	// ActivityUID is the resource's UID.
	ActivityUID string `json:"activityUID"`
	// PacketID is the granted packet's id, or "refund" for the refund.
	PacketID string `json:"packetId"`
	// UserID is the credited account: the claiming user, or the sponsor for refunds.
	UserID string `json:"userId"`
	// Amount is in the currency's minor unit.
	Amount int64 `json:"amount"`
	// Currency is the activity's currency code.
	Currency string `json:"currency"`
	// At is when the claim (or refund) happened, RFC 3339 with milliseconds.
	At string `json:"at"`
	// Source is "budget" (SourceBudget) for a RedPacketBudget's runtime packets,
	// absent for an activity's.
	Source string `json:"source,omitempty"`
	// SourceRef names the resource the money comes from, whatever its kind; the
	// fields above stay for the balance systems that read them.
	SourceRef SourceRef `json:"sourceRef,omitzero"`
}

// SourceRef is a delivery's "sourceRef" object:
// {"kind":"RedPacketActivity" or "RedPacketBudget","namespace","name","uid"}.
type SourceRef struct {
	Kind      string `json:"kind"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
}

// IdempotencyKey is the delivery's Idempotency-Key header: "<activityUID>/<packetId>",
// which is "<activityUID>/refund" for the refund.
func (d Delivery) IdempotencyKey() string { return d.ActivityUID + "/" + d.PacketID }

// Sign returns the X-Signature header value for body: "sha256=" followed by the hex
// HMAC-SHA256 of the body under key. It is sent beside the Standard Webhooks headers
// (signHeaders) for one release, then no more.
func Sign(key, body []byte) string { return webhooksig.XSignature(key, body) }

// WebhookID is the webhook-id of the request carrying idempotencyKey: "msg_" and the
// unpadded base64url of the key's SHA-256, the same for every attempt of a delivery
// (webhooksig.MessageID).
func WebhookID(idempotencyKey string) string { return webhooksig.MessageID(idempotencyKey) }

// signHeaders sets the signature headers of one attempt of a request, sent at now:
//
//   - X-Signature, with the current HMAC key only, for balance systems of an earlier
//     release (one release more);
//   - webhook-id, derived from the Idempotency-Key, the same for every attempt;
//   - webhook-timestamp, the attempt's time in unix seconds, so a receiver refuses a
//     captured request replayed beyond its tolerance;
//   - webhook-signature: a v1 (HMAC-SHA256) signature of "<id>.<timestamp>.<body>"
//     with the current and with the previous HMAC key, and a v1a (Ed25519) one with
//     the current and the previous Ed25519 key, each that cfg holds.
//
// With no key at all, nothing is set (tests of the delivery mechanics).
func signHeaders(h http.Header, cfg Config, body []byte, idempotencyKey string, now time.Time) {
	keys := cfg.signingKeys()
	if keys.Empty() {
		return
	}
	if cfg.SigningKey != nil {
		h.Set(webhooksig.XSignatureHeader, Sign(cfg.SigningKey, body))
	}
	id, ts := WebhookID(idempotencyKey), now.Unix()
	h.Set(webhooksig.HeaderID, id)
	h.Set(webhooksig.HeaderTimestamp, strconv.FormatInt(ts, 10))
	h.Set(webhooksig.HeaderSignature, webhooksig.Sign(keys, id, ts, body))
}

// rfc3339Milli is RFC 3339 with exactly three fractional digits.
const rfc3339Milli = "2006-01-02T15:04:05.000Z07:00"

// delivery builds the webhook body of a well-formed entry.
func (w *Worker) delivery(e store.StreamEntry) Delivery { return deliveryOf(w.cfg.Source, e) }

// deliveryError is a failed delivery: a non-2xx answer (status set) or none.
type deliveryError struct {
	status int
	msg    string
	err    error // why no answer came (status 0), for ErrorClass
}

func (e *deliveryError) Error() string { return e.msg }

// Unwrap is the transport's error when no answer came.
func (e *deliveryError) Unwrap() error { return e.err }

// post sends one delivery and returns nil on a 2xx answer.
func (w *Worker) post(ctx context.Context, d Delivery) error {
	body, err := json.Marshal(d)
	if err != nil {
		return &deliveryError{msg: fmt.Sprintf("encoding delivery: %v", err)}
	}
	return postBody(ctx, w.cfg, body, d.IdempotencyKey())
}

// postBody POSTs body to cfg's webhook with the Idempotency-Key, signed with cfg's
// keys (signHeaders) at the time of this attempt, and returns nil on a 2xx answer.
func postBody(ctx context.Context, cfg Config, body []byte, idempotencyKey string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, cfg.WebhookURL, bytes.NewReader(body))
	if err != nil {
		return &deliveryError{msg: fmt.Sprintf("building request: %v", err)}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", idempotencyKey)
	signHeaders(req.Header, cfg, body, idempotencyKey, time.Now())
	resp, err := cfg.HTTPClient.Do(req)
	if err != nil {
		return &deliveryError{msg: fmt.Sprintf("posting to webhook: %v", err), err: err}
	}
	defer resp.Body.Close()
	// Read a little of the answer for the error message, and drain the rest (up to a
	// bound) so the connection can be reused.
	snippet, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return nil
	}
	msg := fmt.Sprintf("webhook answered %s", resp.Status)
	if s := strings.TrimSpace(string(snippet)); s != "" {
		msg += ": " + strings.ToValidUTF8(s, "?")
	}
	return &deliveryError{status: resp.StatusCode, msg: msg}
}
