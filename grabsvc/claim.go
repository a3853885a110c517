package grabsvc

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"time"
	"unicode"
	"unicode/utf8"

	"redpacket.io/operator/lua"
)

// MaxUserIDLen is the longest user id, in characters.
const MaxUserIDLen = 128

// handleGrab is where a claim is decided over HTTP. Every check that can refuse a
// request (method, rate limits, body, user id, token) runs before Redis is touched,
// so an invalid request has no Redis effect; the claim itself is one atomic run of
// the grab script (lua.Grab) through the auto-pipeliner.
func (s *Server) handleGrab(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		s.refuse(w, http.StatusMethodNotAllowed, OutcomeInvalidRequest, "use POST on /v1/grab")
		return
	}
	now := s.now()
	if ok, wait := s.cfg.ClientLimiter.Allow(clientAddr(r), now); !ok {
		s.rateLimited(w, wait, "too many requests from this client; retry later")
		return
	}
	userID, status, msg := readGrabRequest(w, r)
	if msg != "" {
		s.refuse(w, status, OutcomeInvalidRequest, msg)
		return
	}
	act := s.cfg.Activity()
	if act == nil {
		s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable, "the activity has not been read from the API server yet; retry later")
		return
	}
	if s.cfg.Tokens != nil {
		if err := s.cfg.Tokens.Verify(r.Header.Get("Authorization"), act.Ref, userID); err != nil {
			w.Header().Set("WWW-Authenticate", `Bearer realm="grab"`)
			s.refuse(w, http.StatusUnauthorized, OutcomeUnauthorized, err.Error())
			return
		}
	}
	if ok, wait := s.cfg.UserLimiter.Allow(userID, now); !ok {
		s.rateLimited(w, wait, "too many grabs for this user; retry later")
		return
	}

	start := time.Now()
	res, err := callWithDeadline(r.Context(), s.timeout, func(ctx context.Context) (lua.GrabResult, error) {
		return lua.Grab(ctx, s.cfg.Redis, act.Keys, userID)
	})
	s.metrics.ClaimLatency.Observe(time.Since(start).Seconds())
	if err != nil {
		s.metrics.RedisErrors.WithLabelValues("grab").Inc()
		msg := "the packet store is unavailable; nothing was claimed unless a retry says already_claimed"
		if errors.Is(err, context.DeadlineExceeded) {
			msg = "the packet store did not answer in time; retrying is safe: a claim that went through is returned as already_claimed"
		}
		s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable, msg)
		return
	}
	switch res.Outcome {
	case lua.Granted, lua.AlreadyClaimed:
		amount := res.Amount
		s.metrics.countOutcome(string(res.Outcome))
		writeJSON(w, http.StatusOK, grabResponse{Outcome: string(res.Outcome), PacketID: res.PacketID, Amount: &amount})
	case lua.SoldOut, lua.NotStarted, lua.Ended, lua.Paused:
		s.metrics.countOutcome(string(res.Outcome))
		writeJSON(w, http.StatusConflict, grabResponse{Outcome: string(res.Outcome)})
	case lua.Missing:
		s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable, "the activity's packets are not in the packet store; the operator reports this on the resource")
	default:
		s.log.Error("grab script returned an unknown outcome", "outcome", string(res.Outcome), "activity", act.Ref)
		s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable, "the packet store gave an unexpected answer")
	}
}

func (s *Server) refuse(w http.ResponseWriter, status int, outcome, msg string) {
	s.metrics.countOutcome(outcome)
	writeJSON(w, status, grabResponse{Outcome: outcome, Error: msg})
}

func (s *Server) rateLimited(w http.ResponseWriter, wait time.Duration, msg string) {
	w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds(wait)))
	s.refuse(w, http.StatusTooManyRequests, OutcomeRateLimited, msg)
}

// readGrabRequest reads and checks the body {"userId": "..."}. On failure it
// returns the HTTP status and a sentence saying what is wrong.
func readGrabRequest(w http.ResponseWriter, r *http.Request) (userID string, status int, msg string) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return "", http.StatusRequestEntityTooLarge, "the request body is larger than " + strconv.Itoa(MaxBodyBytes) + " bytes"
		}
		return "", http.StatusBadRequest, "the request body could not be read"
	}
	id, msg := ParseGrabRequest(body)
	if msg != "" {
		return "", http.StatusBadRequest, msg
	}
	return id, 0, ""
}

// ParseGrabRequest checks a grab request body: exactly one JSON object with exactly
// the string field "userId" (matched case-sensitively, once), nothing after it, and
// a valid user id. It returns the user id, or a sentence saying what is wrong.
func ParseGrabRequest(body []byte) (string, string) {
	if len(bytes.TrimSpace(body)) == 0 {
		return "", `the request body is empty; send {"userId": "..."}`
	}
	if !utf8.Valid(body) {
		return "", "the request body is not valid UTF-8"
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	tok, err := dec.Token()
	if err != nil {
		return "", "the request body is not valid JSON"
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return "", `the request body must be a JSON object like {"userId": "..."}`
	}
	var (
		userID string
		seen   bool
	)
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return "", "the request body is not valid JSON"
		}
		key, _ := tok.(string)
		if key != "userId" {
			return "", "unknown field " + strconv.Quote(key) + `; the only field is "userId"`
		}
		if seen {
			return "", `the field "userId" appears twice`
		}
		seen = true
		tok, err = dec.Token()
		if err != nil {
			return "", "the request body is not valid JSON"
		}
		v, ok := tok.(string)
		if !ok {
			return "", `"userId" must be a string`
		}
		userID = v
	}
	if _, err := dec.Token(); err != nil {
		return "", "the request body is not valid JSON"
	}
	if _, err := dec.Token(); err != io.EOF {
		return "", "the request body has data after the JSON object"
	}
	if !seen {
		return "", `the field "userId" is required`
	}
	if msg := CheckUserID(userID); msg != "" {
		return "", msg
	}
	return userID, ""
}

// CheckUserID returns a sentence saying why id is not a valid user id, or "" when it
// is: 1 to MaxUserIDLen printable characters.
func CheckUserID(id string) string {
	if id == "" {
		return `"userId" must not be empty`
	}
	if !utf8.ValidString(id) {
		return `"userId" is not valid UTF-8`
	}
	if n := utf8.RuneCountInString(id); n > MaxUserIDLen {
		return `"userId" is ` + strconv.Itoa(n) + " characters long; the limit is " + strconv.Itoa(MaxUserIDLen)
	}
	for _, c := range id {
		if c == utf8.RuneError || !unicode.IsPrint(c) {
			return `"userId" may only contain printable characters`
		}
	}
	return ""
}
