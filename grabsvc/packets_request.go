package grabsvc

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"time"
	"unicode"
	"unicode/utf8"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
)

// MaxPacketTTL bounds ttlSeconds before Redis sees it; the budget's spec.packets.maxTTL
// (checked in Redis) is the real limit.
const MaxPacketTTL = 30 * 24 * time.Hour

// MaxSenderLen is the longest sender account, in characters.
const MaxSenderLen = MaxUserIDLen

// CreatePacketRequest is the body of POST /v1/packets.
type CreatePacketRequest struct {
	// ID is the caller's order id; it makes the call idempotent.
	ID *string `json:"id"`
	// Sender is the account refunded what is not grabbed before expiry.
	Sender *string `json:"sender"`
	// TotalAmount in minor units, split into Count shares.
	TotalAmount *int64 `json:"totalAmount"`
	Count       *int64 `json:"count"`
	// Distribution is Random (the default), LineCut or Fixed, as the budget allows.
	Distribution string `json:"distribution"`
	// TTLSeconds is how long the packet may be grabbed; absent or 0: the budget's default.
	TTLSeconds int64 `json:"ttlSeconds"`
}

// ParseCreatePacket checks a creation body: one JSON object with the fields of
// CreatePacketRequest and no others, nothing after it, integers where amounts and
// counts go, and values that can make a packet. It returns the packet to create, or
// a sentence saying what is wrong. The budget's own limits (spec.packets) are checked
// by the create function in Redis.
func ParseCreatePacket(body []byte) (store.NewPacket, string) {
	if len(bytes.TrimSpace(body)) == 0 {
		return store.NewPacket{}, `the request body is empty; send {"id", "sender", "totalAmount", "count", "distribution", "ttlSeconds"}`
	}
	if !utf8.Valid(body) {
		return store.NewPacket{}, "the request body is not valid UTF-8"
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	var req CreatePacketRequest
	if err := dec.Decode(&req); err != nil {
		return store.NewPacket{}, decodeMessage(err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return store.NewPacket{}, "the request body has data after the JSON object"
	}
	switch {
	case req.ID == nil:
		return store.NewPacket{}, `the field "id" is required`
	case req.Sender == nil:
		return store.NewPacket{}, `the field "sender" is required`
	case req.TotalAmount == nil:
		return store.NewPacket{}, `the field "totalAmount" is required`
	case req.Count == nil:
		return store.NewPacket{}, `the field "count" is required`
	}
	p := store.NewPacket{ID: *req.ID, Sender: *req.Sender, Total: *req.TotalAmount, Count: *req.Count,
		Distribution: req.Distribution, TTL: time.Duration(req.TTLSeconds) * time.Second}
	if msg := CheckPacketID(p.ID); msg != "" {
		return store.NewPacket{}, `"id" ` + msg
	}
	if msg := checkAccount("sender", p.Sender, MaxSenderLen); msg != "" {
		return store.NewPacket{}, msg
	}
	switch {
	case p.Total < 1:
		return store.NewPacket{}, `"totalAmount" must be at least 1 (minor units)`
	case p.Count < 1:
		return store.NewPacket{}, `"count" must be at least 1`
	case p.Total > store.MaxPacketTotal:
		return store.NewPacket{}, `"totalAmount" is above ` + strconv.FormatInt(store.MaxPacketTotal, 10) + ", the most one packet may hold"
	case p.Count > store.MaxPacketShares:
		return store.NewPacket{}, `"count" is ` + strconv.FormatInt(p.Count, 10) + "; a packet has at most " +
			strconv.Itoa(store.MaxPacketShares) + " shares"
	case p.Count > p.Total:
		return store.NewPacket{}, `"count" is larger than "totalAmount": every share is at least 1 minor unit`
	}
	switch p.Distribution {
	case "":
		p.Distribution = split.TypeRandom
	case split.TypeRandom, split.TypeLineCut, split.TypeFixed:
	default:
		return store.NewPacket{}, `"distribution" must be ` + split.TypeRandom + ", " + split.TypeLineCut + " or " + split.TypeFixed
	}
	if req.TTLSeconds < 0 || req.TTLSeconds > int64(MaxPacketTTL/time.Second) {
		return store.NewPacket{}, `"ttlSeconds" must be between 0 (the budget's default) and ` +
			strconv.FormatInt(int64(MaxPacketTTL/time.Second), 10)
	}
	return p, ""
}

// decodeMessage says what is wrong with a body the JSON decoder refused.
func decodeMessage(err error) string {
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	switch {
	case errors.As(err, &typeErr) && typeErr.Field != "":
		switch typeErr.Field {
		case "id", "sender", "distribution":
			return strconv.Quote(typeErr.Field) + " must be a string"
		default:
			return strconv.Quote(typeErr.Field) + " must be an integer"
		}
	case errors.As(err, &typeErr):
		return "the request body must be a JSON object"
	case errors.As(err, &syntaxErr), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return "the request body is not valid JSON"
	}
	// The decoder's words for an unknown field: json: unknown field "x".
	if msg := err.Error(); len(msg) > 6 && msg[:6] == "json: " {
		return msg[6:] + `; the fields are "id", "sender", "totalAmount", "count", "distribution" and "ttlSeconds"`
	}
	return "the request body is not valid JSON"
}

// CheckPacketID returns a sentence saying why id is not a packet id, or "" when it
// is: 1 to store.MaxPacketIDLength characters of [A-Za-z0-9._-], the first a letter
// or digit.
func CheckPacketID(id string) string {
	if id == "" {
		return "must not be empty"
	}
	if len(id) > store.MaxPacketIDLength {
		return "is " + strconv.Itoa(len(id)) + " characters long; the limit is " + strconv.Itoa(store.MaxPacketIDLength)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '.' && c != '_' && c != '-') {
			return "may only contain letters, digits, '.', '_' and '-', and must start with a letter or digit"
		}
	}
	return ""
}

// checkAccount says why v is not a valid account for the field: 1 to limit
// printable characters.
func checkAccount(field, v string, limit int) string {
	q := strconv.Quote(field)
	if v == "" {
		return q + " must not be empty"
	}
	if n := utf8.RuneCountInString(v); n > limit {
		return q + " is " + strconv.Itoa(n) + " characters long; the limit is " + strconv.Itoa(limit)
	}
	for _, c := range v {
		if c == utf8.RuneError || !unicode.IsPrint(c) {
			return q + " may only contain printable characters"
		}
	}
	return ""
}

// readLimitedBody reads a request body of at most MaxBodyBytes. On failure it
// returns the HTTP status and a sentence saying what is wrong.
func readLimitedBody(w http.ResponseWriter, r *http.Request) ([]byte, int, string) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, http.StatusRequestEntityTooLarge, "the request body is larger than " + strconv.Itoa(MaxBodyBytes) + " bytes"
		}
		return nil, http.StatusBadRequest, "the request body could not be read"
	}
	return body, 0, ""
}
