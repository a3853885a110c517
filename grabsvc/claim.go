package grabsvc

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
)

// MaxUserIDLen is the longest user id, in characters.
const MaxUserIDLen = 128

// handleGrab is where a claim is decided over HTTP. Every check that can refuse a
// request (method, rate limits, body, user id, token) runs before Redis is touched,
// so an invalid request has no Redis effect; the claim itself is one atomic run of
// the grab script on the user's home shard (store.Activity.Grab, which refills a dry
// home shard from its siblings and grabs again) through the auto-pipeliner.
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
	act := s.cfg.Resource()
	if act == nil {
		s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable, "the activity has not been read from the API server yet; retry later")
		return
	}
	// Fails closed: without a key, an activity that requires tokens gets 503.
	if err := s.cfg.Tokens.Check(r.Header.Get("Authorization"), act, userID); err != nil {
		if errors.Is(err, ErrNoTokenKey) {
			s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable, err.Error())
			return
		}
		w.Header().Set("WWW-Authenticate", `Bearer realm="grab"`)
		s.refuse(w, http.StatusUnauthorized, OutcomeUnauthorized, err.Error())
		return
	}
	if ok, wait := s.cfg.UserLimiter.Allow(userID, now); !ok {
		s.rateLimited(w, wait, "too many grabs for this user; retry later")
		return
	}
	// With spec.grabService.startSpread, the user's own opening instant comes
	// first: before it the grab is refused here, by this process's clock, and
	// Redis is not asked. After it the script still decides by Redis's clock, so a
	// fast clock in one pod never opens an activity before startTime.
	if start, spread := startSpreadOf(act.Object); spread > 0 {
		if opens := OpensAt(string(act.Object.UID), userID, start, spread); now.Before(opens) {
			s.metrics.countOutcome(OutcomeNotStarted)
			w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds(opens.Sub(now))))
			writeJSON(w, http.StatusConflict, grabResponse{Outcome: OutcomeNotStarted, OpensAt: opens.UTC().Format(timeMillis)})
			return
		}
	}

	start := time.Now()
	markOf := func(i int) store.Watermark { return s.cfg.Guard.MarkShard(act, i) }
	res, shard, err := s.grab(r.Context(), s.redis.of(s.cfg.Redis, act), userID, markOf)
	if err != nil && outcomeUnknown(err) {
		// The script may have run: ask Redis what it decided rather than answer 503
		// for a grant that went through.
		s.metrics.RedisErrors.WithLabelValues("grab").Inc()
		res, shard, err = s.resolveGrab(r.Context(), act, userID, markOf)
		if err != nil {
			s.metrics.RedisErrors.WithLabelValues("grab_resolve").Inc()
		} else if res.Outcome == store.NotStarted || res.Outcome == store.Paused {
			// The first call may not have run yet (held on its way, or behind a CLIENT
			// PAUSE): once the activity opens it grants. A refusal that opening takes
			// back is the repeat's, not this grab's answer: nothing is known.
			err = errFirstCallPending
		}
	} else if err != nil {
		s.metrics.RedisErrors.WithLabelValues("grab").Inc()
	}
	s.metrics.ClaimLatency.Observe(time.Since(start).Seconds())
	if err != nil {
		msg := "the packet store could not be reached; nothing is known of this grab: retry it (a claim that went through is returned as already_claimed)"
		switch {
		case errors.Is(err, store.ErrFunctionMissing):
			// The grab service never loads the functions (its Redis user may not): the
			// operator's function keeper restores them within its interval.
			msg = "the packet store lost the grab functions and the operator is loading them again; nothing was claimed, retry shortly"
		}
		s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable, msg)
		return
	}
	if res.Outcome == store.Granted || res.Outcome == store.AlreadyClaimed {
		// With durability Replicas, a packet is announced only once enough replicas
		// hold it (a repeat too: its first answer may have been this 503).
		if waiter := s.durable.of(s.cfg.Durable, act, shard); waiter != nil {
			if err := waiter.Wait(r.Context()); err != nil {
				s.metrics.RedisErrors.WithLabelValues("replicas").Inc()
				s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable,
					"the packet is not yet on enough replicas; retry: the same packet is returned once it is")
				return
			}
		}
	}
	switch res.Outcome {
	case store.Granted:
		s.cfg.Guard.SawShard(act.Object.UID, shard, act.Object.Spec.ShardCount(), res.Seen)
		s.metrics.countOutcome(string(res.Outcome))
		writePacket(w, string(res.Outcome), res.PacketID, res.Amount)
	case store.AlreadyClaimed:
		s.metrics.countOutcome(string(res.Outcome))
		writePacket(w, string(res.Outcome), res.PacketID, res.Amount)
	case store.SoldOut, store.NotStarted, store.Ended, store.Paused:
		s.metrics.countOutcome(string(res.Outcome))
		writeJSON(w, http.StatusConflict, grabResponse{Outcome: string(res.Outcome)})
	case store.Missing:
		s.cfg.Guard.SetProblem(act.Object.UID, problemMissing)
		s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable, "the activity's packets are not in the packet store; the operator reports this on the resource")
	case store.Fenced:
		s.cfg.Guard.SetProblem(act.Object.UID, problemFenced)
		s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable, "the packet store came back older than what was already granted, so nothing is granted until an operator reconciles it; the operator reports this on the resource")
	default:
		s.log.Error("grab script returned an unknown outcome", "outcome", string(res.Outcome), "activity", act.Ref)
		s.refuse(w, http.StatusServiceUnavailable, OutcomeUnavailable, "the packet store gave an unexpected answer")
	}
}

// grabCall carries one claim to the goroutine that runs it and its answer back.
type grabCall struct {
	res   store.GrabResult
	shard int
	err   error
	ch    chan struct{}
}

var (
	grabCalls  = sync.Pool{New: func() any { return &grabCall{ch: make(chan struct{}, 1)} }}
	grabTimers = sync.Pool{New: func() any {
		t := time.NewTimer(time.Hour)
		t.Stop()
		return t
	}}
)

// grab decides the claim on the user's home shard through the activity's handle h
// (store.Activity.Grab: the grab script, and a refill from the other shards when the home
// shard ran dry) and waits for it at most the Redis deadline. It returns the home
// shard with the result. It is callWithDeadline for the hot path: pooled timers and
// reply slots, and no wait on the request's context (a client that went away costs
// at most the deadline).
func (s *Server) grab(ctx context.Context, h *store.Activity, userID string, markOf func(int) store.Watermark) (store.GrabResult, int, error) {
	c := grabCalls.Get().(*grabCall)
	go func() {
		c.res, c.shard, c.err = h.Grab(ctx, userID, markOf)
		c.ch <- struct{}{}
	}()
	t := grabTimers.Get().(*time.Timer)
	t.Reset(s.timeout)
	select {
	case <-c.ch:
		// Since Go 1.23 a stopped timer never delivers a stale tick, so it can be reused.
		t.Stop()
		grabTimers.Put(t)
		res, shard, err := c.res, c.shard, c.err
		*c = grabCall{ch: c.ch}
		grabCalls.Put(c)
		return res, shard, err
	case <-t.C:
		grabTimers.Put(t)
		// c belongs to the running call now and is never reused.
		return store.GrabResult{}, 0, fmt.Errorf("grab: %w", context.DeadlineExceeded)
	}
}

// outcomeUnknown reports whether a failed grab call may have run the script: it
// timed out or lost its connection, so only Redis knows. An error reply from Redis
// (a redis.Error, such as a missing function) means the script did not run.
func outcomeUnknown(err error) bool {
	var reply redis.Error
	return !errors.As(err, &reply)
}

// errFirstCallPending: the repeat of a grab whose first call ended without an answer
// was refused for a reason that can pass (not started, paused), while the first call
// may still reach Redis after it and grant (TestHeldGrabIsNotAnsweredWithARefusalThatPasses).
var errFirstCallPending = errors.New("the grab's first call may still run and grant")

// resolveGrab asks Redis again what it decided for the user's grab whose call ended
// without an answer, within ResolveTimeout (and the request's life). The grab is
// idempotent per user, so the repeat either answers already_claimed with the packet
// the first call granted, or decides for the first time (the first call never ran,
// or runs later and then finds the claim). It goes over the plain client
// (cfg.Durable), on a connection of its own: replies on the auto-pipeliner's
// connection come back in order, so the reply that is held would hold the repeat
// too. An error means Redis could not be reached in time: nothing is known.
func (s *Server) resolveGrab(ctx context.Context, act *Resource, userID string, markOf func(int) store.Watermark) (store.GrabResult, int, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ResolveTimeout)
	defer cancel()
	res, shard, err := s.resolve.of(s.cfg.Durable, act).Grab(ctx, userID, markOf)
	if err != nil {
		return store.GrabResult{}, 0, fmt.Errorf("asking Redis again what it decided: %w", err)
	}
	return res, shard, nil
}

// writePacket answers 200 with the packet, {"outcome":..,"packetId":..,"amount":..}.
// It is the hot path, so it skips the reflection encoder when the packet id needs no
// escaping (the seeder's ids are decimal numbers).
func writePacket(w http.ResponseWriter, outcome, packetID string, amount int64) {
	if !plainJSONString(packetID) {
		writeJSON(w, http.StatusOK, grabResponse{Outcome: outcome, PacketID: packetID, Amount: &amount})
		return
	}
	bp := answerPool.Get().(*[]byte)
	defer answerPool.Put(bp)
	buf := (*bp)[:0]
	buf = append(buf, `{"outcome":"`...)
	buf = append(buf, outcome...)
	buf = append(buf, `","packetId":"`...)
	buf = append(buf, packetID...)
	buf = append(buf, `","amount":`...)
	buf = strconv.AppendInt(buf, amount, 10)
	buf = append(buf, "}\n"...)
	h := w.Header()
	h["Content-Type"] = headerJSON
	h["Cache-Control"] = headerNoStore
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(buf)
	*bp = buf
}

// answerPool recycles answer buffers; the ResponseWriter copies what it is given.
var answerPool = sync.Pool{New: func() any {
	b := make([]byte, 0, 128)
	return &b
}}

// Shared header values; net/http only reads them.
var (
	headerJSON    = []string{"application/json"}
	headerNoStore = []string{"no-store"}
)

// plainJSONString reports whether s can be written between quotes as it is.
func plainJSONString(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c == '"' || c == '\\' || c >= 0x7f || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	return true
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
	bp := bodyPool.Get().(*[]byte)
	defer bodyPool.Put(bp)
	body, err := readBody(http.MaxBytesReader(w, r.Body, MaxBodyBytes), (*bp)[:0])
	*bp = body[:0]
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return "", http.StatusRequestEntityTooLarge, "the request body is larger than " + strconv.Itoa(MaxBodyBytes) + " bytes"
		}
		return "", http.StatusBadRequest, "the request body could not be read"
	}
	// ParseGrabRequest returns a fresh string, never a view of the pooled buffer.
	id, msg := ParseGrabRequest(body)
	if msg != "" {
		return "", http.StatusBadRequest, msg
	}
	return id, 0, ""
}

// bodyPool recycles request body buffers.
var bodyPool = sync.Pool{New: func() any {
	b := make([]byte, 0, 512)
	return &b
}}

// readBody appends everything r yields to buf.
func readBody(r io.Reader, buf []byte) ([]byte, error) {
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			return buf, nil
		}
		if err != nil {
			return buf, err
		}
	}
}

// ParseGrabRequest checks a grab request body: exactly one JSON object with exactly
// the string field "userId" (matched case-sensitively, once), nothing after it, and
// a valid user id. It returns the user id, or a sentence saying what is wrong.
func ParseGrabRequest(body []byte) (string, string) {
	if id, ok := parseCanonical(body); ok {
		if msg := CheckUserID(id); msg != "" {
			return "", msg
		}
		return id, ""
	}
	return parseStrict(body)
}

// parseStrict is ParseGrabRequest with the general JSON decoder.
func parseStrict(body []byte) (string, string) {
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

// parseCanonical reads the common form of the body, {"userId":"<id>"} with optional
// JSON whitespace and an id without escapes, quotes or control bytes, without the
// general decoder. Anything else returns false and goes to the strict decoder, which
// accepts the same bodies with the same result, so this is only a shortcut.
func parseCanonical(b []byte) (string, bool) {
	i := skipWS(b, 0)
	if i >= len(b) || b[i] != '{' {
		return "", false
	}
	i = skipWS(b, i+1)
	const key = `"userId"`
	if !bytes.HasPrefix(b[i:], []byte(key)) {
		return "", false
	}
	i = skipWS(b, i+len(key))
	if i >= len(b) || b[i] != ':' {
		return "", false
	}
	i = skipWS(b, i+1)
	if i >= len(b) || b[i] != '"' {
		return "", false
	}
	start := i + 1
	end := start
	for ; end < len(b); end++ {
		c := b[end]
		if c == '"' {
			break
		}
		if c == '\\' || c < 0x20 {
			return "", false
		}
	}
	if end >= len(b) {
		return "", false
	}
	i = skipWS(b, end+1)
	if i >= len(b) || b[i] != '}' {
		return "", false
	}
	if skipWS(b, i+1) != len(b) {
		return "", false
	}
	return string(b[start:end]), true
}

// skipWS returns the index of the first non-whitespace byte at or after i.
func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
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
