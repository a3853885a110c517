package balance

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// The wire values of a delivery's kind and source (docs/operations.md, "settlement
// and dead letters").
const (
	KindGrant  = "grant"
	KindRefund = "refund"
	// KindBudget is an announcement: an activity's budget (amount and count) or a
	// RedPacketBudget's whole total (amount only, source "budget").
	KindBudget = "budget"
	// SourceBudget marks a RedPacketBudget's deliveries; an activity's have no source.
	SourceBudget = "budget"
)

// The kinds of source a credit draws from, as the sources table records them.
const (
	SourceKindActivity = "activity"
	SourceKindBudget   = "budget"
)

// Delivery is the settlement webhook's body, as the operator sends it.
type Delivery struct {
	Kind string `json:"kind"`
	// Activity is "<namespace>/<name>" of the activity or budget: a label, kept on the
	// source, not part of the digest.
	Activity    string `json:"activity"`
	ActivityUID string `json:"activityUID"`
	// PacketID is an activity's packet number, "refund", or a budget's
	// "<packetId>/<share>" or "<packetId>/refund". Announcements have none.
	PacketID string `json:"packetId,omitempty"`
	UserID   string `json:"userId,omitempty"`
	// Amount is in the currency's minor unit: a credit's, or an announcement's total.
	Amount int64 `json:"amount"`
	// Count is an activity's number of packets, in its announcement only.
	Count    int64  `json:"count,omitempty"`
	Source   string `json:"source,omitempty"`
	Currency string `json:"currency"`
	At       string `json:"at"`
	// SourceRef names the source again; when present, its uid must be ActivityUID and
	// its kind must agree with Source.
	SourceRef *SourceRef `json:"sourceRef,omitempty"`
}

// SourceRef is a delivery's "sourceRef" object.
type SourceRef struct {
	Kind      string `json:"kind"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
}

// request is one POST, checked: its key, its body, and what the body books.
type request struct {
	key      string
	d        Delivery
	at       time.Time
	digest   []byte
	announce bool   // an announcement, not a credit
	source   string // SourceKindActivity or SourceKindBudget
}

// maxBody bounds a delivery body; the operator's are a few hundred bytes.
const maxBody = 64 << 10

// maxKey bounds an Idempotency-Key: a UID, a packet id of at most 64 bytes and a share.
const maxKey = 256

// errMalformed is a body or key that is not a delivery; its text says why.
type errMalformed struct{ msg string }

func (e *errMalformed) Error() string { return e.msg }

func malformed(format string, args ...any) error {
	return &errMalformed{msg: fmt.Sprintf(format, args...)}
}

// parse checks one POST's Idempotency-Key and body against the settlement contract
// and returns what it books. The key must be the one the body implies:
//
//   - an activity's grant "<uid>/<packet number>", its refund "<uid>/refund";
//   - a budget's grant "<uid>/<packetId>/<share>", its refund "<uid>/<packetId>/refund";
//   - an activity's announcement "<uid>/budget" (amount and count above 0);
//   - a budget's announcement "<uid>/budget:<amount>" (amount above 0).
//
// So no credit's key is an announcement's, and a body cannot be booked under
// another key than its own.
func parse(key string, body []byte) (request, error) {
	var d Delivery
	dec := json.NewDecoder(strings.NewReader(string(body)))
	if err := dec.Decode(&d); err != nil {
		return request{}, malformed("the body is not a delivery: %v", err)
	}
	if dec.More() {
		return request{}, malformed("the body holds more than one JSON value")
	}
	r := request{key: key, d: d, source: SourceKindActivity}
	switch d.Source {
	case "":
	case SourceBudget:
		r.source = SourceKindBudget
	default:
		return request{}, malformed("unknown source %q", d.Source)
	}
	if d.ActivityUID == "" || strings.ContainsAny(d.ActivityUID, "/:") {
		return request{}, malformed("activityUID %q", d.ActivityUID)
	}
	if d.SourceRef != nil {
		want := "RedPacketActivity"
		if r.source == SourceKindBudget {
			want = "RedPacketBudget"
		}
		if d.SourceRef.UID != d.ActivityUID || d.SourceRef.Kind != want {
			return request{}, malformed("sourceRef %s %s does not name the %s %s", d.SourceRef.Kind, d.SourceRef.UID, want, d.ActivityUID)
		}
	}
	if d.Amount <= 0 {
		return request{}, malformed("amount %d: it must be above 0", d.Amount)
	}
	at, err := time.Parse(time.RFC3339Nano, d.At)
	if err != nil {
		return request{}, malformed("at %q is not an RFC 3339 time", d.At)
	}
	r.at = at.UTC()

	var want string
	switch d.Kind {
	case KindBudget:
		r.announce = true
		if d.PacketID != "" || d.UserID != "" {
			return request{}, malformed("an announcement names no packet and no user")
		}
		if r.source == SourceKindBudget {
			if d.Count != 0 {
				return request{}, malformed("a budget's announcement has no count")
			}
			want = fmt.Sprintf("%s/budget:%d", d.ActivityUID, d.Amount)
		} else {
			if d.Count <= 0 {
				return request{}, malformed("an activity's announcement needs a count above 0, not %d", d.Count)
			}
			want = d.ActivityUID + "/budget"
		}
	case KindGrant, KindRefund:
		if d.Count != 0 {
			return request{}, malformed("a credit has no count")
		}
		if d.UserID == "" {
			return request{}, malformed("a credit needs a userId")
		}
		if err := checkPacketID(r.source, d.Kind, d.PacketID); err != nil {
			return request{}, err
		}
		want = d.ActivityUID + "/" + d.PacketID
	default:
		return request{}, malformed("unknown kind %q", d.Kind)
	}
	if key != want {
		return request{}, malformed("Idempotency-Key %q does not match the body, whose key is %q", key, want)
	}
	r.digest = digest(d, r.at)
	return r, nil
}

// checkPacketID checks a credit's packet id against its source and kind.
func checkPacketID(source, kind, id string) error {
	if id == "" || len(id) > maxKey || strings.Contains(id, ":") {
		return malformed("packetId %q", id)
	}
	if source == SourceKindActivity {
		if kind == KindRefund {
			if id != "refund" {
				return malformed("an activity's refund has packetId \"refund\", not %q", id)
			}
			return nil
		}
		if n, err := strconv.ParseInt(id, 10, 64); err != nil || n < 1 || strconv.FormatInt(n, 10) != id {
			return malformed("an activity's grant has a packet number as packetId, not %q", id)
		}
		return nil
	}
	packet, tail, ok := cutLast(id, "/")
	if !ok || packet == "" {
		return malformed("a budget's packetId is \"<packetId>/<share>\" or \"<packetId>/refund\", not %q", id)
	}
	if kind == KindRefund {
		if tail != "refund" {
			return malformed("a budget's refund has packetId \"<packetId>/refund\", not %q", id)
		}
		return nil
	}
	if n, err := strconv.ParseInt(tail, 10, 64); err != nil || n < 0 || strconv.FormatInt(n, 10) != tail {
		return malformed("a budget's grant has packetId \"<packetId>/<share>\", not %q", id)
	}
	return nil
}

func cutLast(s, sep string) (before, after string, ok bool) {
	i := strings.LastIndex(s, sep)
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+len(sep):], true
}

// canonical is what a delivery's digest covers, in this order: everything a booking
// depends on. The activity's name and the sourceRef (labels of the UID) are left out,
// and at is normalized to UTC with RFC 3339's nanosecond form.
type canonical struct {
	Kind        string `json:"kind"`
	Source      string `json:"source"`
	ActivityUID string `json:"activityUID"`
	PacketID    string `json:"packetId"`
	UserID      string `json:"userId"`
	Amount      int64  `json:"amount"`
	Count       int64  `json:"count"`
	Currency    string `json:"currency"`
	At          string `json:"at"`
}

// digest is the SHA-256 of the delivery's canonical JSON. Two bodies with the same
// digest book the same thing; a key reused with another digest is refused.
func digest(d Delivery, at time.Time) []byte {
	b, err := json.Marshal(canonical{Kind: d.Kind, Source: d.Source, ActivityUID: d.ActivityUID, PacketID: d.PacketID,
		UserID: d.UserID, Amount: d.Amount, Count: d.Count, Currency: d.Currency, At: at.Format(time.RFC3339Nano)})
	if err != nil {
		panic(errors.New("encoding a canonical delivery cannot fail: " + err.Error()))
	}
	sum := sha256.Sum256(b)
	return sum[:]
}
