// Package balance is a reference balance system for the operator's settlement
// webhook: it books every credit once, in PostgreSQL, within the budget the operator
// announced, and answers each POST with the status code the settlement contract
// expects (docs/balance.md). It documents that contract in code; it is not a wallet.
package balance

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"redpacket.io/operator/pkg/webhooksig"
)

// The status codes of POST /v1/credits, and what the operator does with each
// (settlement/delivery.go and worker.go: any 2xx is an acknowledgement; any other
// answer is retried with backoff, and after the activity's maxAttempts (20 by
// default) the entry is dead-lettered, with the answer's status and the start of its
// body as the dead letter's error; an announcement that fails is sent again, under
// its same key, until it is acknowledged):
//
//   - 201 Created: a new key, booked now (StatusBooked). Acknowledged.
//   - 200 OK with "Idempotent-Replayed: true": the key was booked before with the
//     same body; nothing changed (StatusReplayed). Acknowledged.
//   - 400 Bad Request: no Idempotency-Key, a body that is not a delivery, a key that
//     is not the body's, a source of another kind or currency. Retried, then
//     dead-lettered: the operator never sends one.
//   - 401 Unauthorized: no signature made with a key this system holds (the
//     Standard Webhooks webhook-signature, or X-Signature alone where accepted), or
//     a webhook-timestamp beyond the tolerance: a captured request replayed later.
//     Retried (a key rotation in progress, or a clock set right, heals), then
//     dead-lettered.
//   - 409 Conflict: the same key is being booked by another request right now.
//     Retried: the retry is answered 200 (replay) or 201.
//   - 422 Unprocessable Content: the key was booked with another body. Retried,
//     then dead-lettered: a person must look.
//   - 424 Failed Dependency: the credit's source was never announced. Retried: the
//     operator announces before it credits, so this heals once the announcement
//     lands; dead-lettered if it never does.
//   - 403 Forbidden: the credit would take the source beyond its announced total,
//     or an activity's grants beyond its count. Retried, then dead-lettered: the
//     operator's ledger lets none through, so one is an alarm.
//   - 5xx: the database failed; nothing was booked. Retried.
const (
	StatusBooked        = http.StatusCreated
	StatusReplayed      = http.StatusOK
	StatusMalformed     = http.StatusBadRequest
	StatusBadSignature  = http.StatusUnauthorized
	StatusInFlight      = http.StatusConflict
	StatusKeyReused     = http.StatusUnprocessableEntity
	StatusUnknownSource = http.StatusFailedDependency
	StatusOverBudget    = http.StatusForbidden
)

// The "error" codes of the JSON error bodies.
const (
	CodeMissingKey     = "missing_idempotency_key"
	CodeMalformed      = "malformed"
	CodeSourceMismatch = "source_mismatch"
	CodeBadSignature   = "bad_signature"
	CodeStaleSignature = "stale_signature"
	CodeInFlight       = "in_flight"
	CodeKeyReused      = "key_reused"
	CodeUnknownSource  = "unknown_source"
	CodeOverBudget     = "over_budget"
	CodeOverCount      = "over_count"
	CodeNotFound       = "not_found"
	CodeInternal       = "internal"
)

// ReplayedHeader marks an answer to a repeat of a booked key.
const ReplayedHeader = "Idempotent-Replayed"

// Config is a Handler's.
type Config struct {
	// Book is where credits are booked.
	Book *Book
	// Keys are the HMAC keys of this balance system's host, as the operator's keys
	// Secret holds them (more than one during a rotation): they verify v1
	// signatures, and X-Signature where AcceptXSignature accepts it.
	Keys [][]byte
	// PublicKeys are the operator's Ed25519 public keys (more than one during a
	// rotation): they verify v1a signatures. With neither Keys nor PublicKeys,
	// deliveries are not authenticated, for tests and demos only.
	PublicKeys []ed25519.PublicKey
	// Tolerance is how far a webhook-timestamp may be from Now, either way, before
	// the request is refused; 0: webhooksig.DefaultTolerance (5 minutes).
	Tolerance time.Duration
	// Now is the clock the timestamps are checked against; nil: time.Now.
	Now func() time.Time
	// AcceptXSignature also accepts a request without any Standard Webhooks header
	// whose X-Signature verifies with one of Keys, as an operator of an earlier
	// release sends it. Such a request carries no time, so a captured one can be
	// replayed whenever: keep it off once the operator sends webhook-signature.
	AcceptXSignature bool
	// Log receives a line per refused or failed POST; nil: slog.Default().
	Log *slog.Logger
	// Timeout bounds each request's work in the database; 0: 10 s.
	Timeout time.Duration
}

// Handler serves the balance system's HTTP API:
//
//	POST /v1/credits                   a delivery (credit or announcement)
//	GET  /v1/users/{user}/balance      a user's balances, per currency
//	GET  /v1/sources/{uid}             a source's announced total and sums
//	GET  /v1/sources/{uid}/credits     its credits, paged in key order (?after=&limit=)
//	GET  /v1/sources/{uid}/booked      its credit rows counted and summed (reconcile.go)
//	POST /v1/sources/{uid}/lookup      which of a page of keys it holds (reconcile.go)
//	GET  /healthz                      200 once the database answers
func Handler(cfg Config) http.Handler {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	h := &handler{cfg: cfg, verifier: webhooksig.Verifier{HMAC: cfg.Keys, PublicKeys: cfg.PublicKeys, Tolerance: cfg.Tolerance,
		Now: cfg.Now, AcceptXSignature: cfg.AcceptXSignature}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/credits", h.post)
	mux.HandleFunc("GET /v1/users/{user}/balance", h.balance)
	mux.HandleFunc("GET /v1/sources/{uid}", h.source)
	mux.HandleFunc("GET /v1/sources/{uid}/credits", h.credits)
	mux.HandleFunc("GET /healthz", h.healthz)
	h.routeReconciliation(mux)
	return mux
}

type handler struct {
	cfg      Config
	verifier webhooksig.Verifier
}

// apiError is every error answer's body.
type apiError struct {
	Error   string `json:"error"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func (h *handler) fail(w http.ResponseWriter, r *http.Request, status int, code, msg string) {
	level := slog.LevelInfo
	if status >= 500 {
		level = slog.LevelError
	}
	h.cfg.Log.Log(r.Context(), level, "refused", "method", r.Method, "path", r.URL.Path,
		"idempotencyKey", r.Header.Get("Idempotency-Key"), "status", status, "error", code, "message", msg)
	writeJSON(w, status, apiError{Error: code, Message: msg})
}

// booked is the body of a 2xx answer to a POST.
type booked struct {
	Key      string `json:"key"`
	Replayed bool   `json:"replayed"`
}

// post books one delivery. The signature is checked on the raw body before anything
// else is read from it (webhooksig.Verifier: a Standard Webhooks v1 or v1a signature
// within the tolerance, or X-Signature alone where accepted).
func (h *handler) post(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		h.fail(w, r, StatusMalformed, CodeMalformed, "reading the body: "+err.Error())
		return
	}
	if len(body) > maxBody {
		h.fail(w, r, StatusMalformed, CodeMalformed, "the body is larger than 64 KiB")
		return
	}
	if h.verifier.Enabled() {
		if _, err := h.verifier.Verify(r.Header, body); err != nil {
			code := CodeBadSignature
			if errors.Is(err, webhooksig.ErrStale) {
				code = CodeStaleSignature
			}
			h.fail(w, r, StatusBadSignature, code, err.Error())
			return
		}
	}
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		h.fail(w, r, StatusMalformed, CodeMissingKey, "the Idempotency-Key header is required")
		return
	}
	if len(key) > maxKey {
		h.fail(w, r, StatusMalformed, CodeMalformed, "the Idempotency-Key is longer than "+strconv.Itoa(maxKey)+" bytes")
		return
	}
	req, err := parse(key, body)
	if err != nil {
		h.fail(w, r, StatusMalformed, CodeMalformed, err.Error())
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.cfg.Timeout)
	defer cancel()
	out, err := h.cfg.Book.Post(ctx, req)
	switch {
	case err == nil && out == Replayed:
		w.Header().Set(ReplayedHeader, "true")
		writeJSON(w, StatusReplayed, booked{Key: key, Replayed: true})
	case err == nil:
		writeJSON(w, StatusBooked, booked{Key: key})
	case errors.Is(err, ErrInFlight):
		w.Header().Set("Retry-After", "1")
		h.fail(w, r, StatusInFlight, CodeInFlight, err.Error())
	case errors.Is(err, ErrKeyReused):
		h.fail(w, r, StatusKeyReused, CodeKeyReused, err.Error())
	case errors.Is(err, ErrUnknownSource):
		h.fail(w, r, StatusUnknownSource, CodeUnknownSource, err.Error())
	case errors.Is(err, ErrOverBudget):
		h.fail(w, r, StatusOverBudget, CodeOverBudget, err.Error())
	case errors.Is(err, ErrOverCount):
		h.fail(w, r, StatusOverBudget, CodeOverCount, err.Error())
	case errors.Is(err, ErrSourceMismatch):
		h.fail(w, r, StatusMalformed, CodeSourceMismatch, err.Error())
	default:
		h.fail(w, r, http.StatusServiceUnavailable, CodeInternal, "booking failed, nothing was booked: "+err.Error())
	}
}

// balanceAnswer is GET /v1/users/{user}/balance's body.
type balanceAnswer struct {
	User     string        `json:"user"`
	Balances []UserBalance `json:"balances"`
}

func (h *handler) balance(w http.ResponseWriter, r *http.Request) {
	user := r.PathValue("user")
	ctx, cancel := context.WithTimeout(r.Context(), h.cfg.Timeout)
	defer cancel()
	bs, err := h.cfg.Book.Balances(ctx, user)
	if err != nil {
		h.fail(w, r, http.StatusServiceUnavailable, CodeInternal, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, balanceAnswer{User: user, Balances: bs})
}

func (h *handler) source(w http.ResponseWriter, r *http.Request) {
	h.serveSource(w, r, func(ctx context.Context, uid string) (any, bool, error) { return h.cfg.Book.Source(ctx, uid) })
}

// serveSource answers a GET of one source's read: read's answer as JSON, 404
// not_found when no announcement made the source, 503 when the database failed.
func (h *handler) serveSource(w http.ResponseWriter, r *http.Request, read func(ctx context.Context, uid string) (any, bool, error)) {
	uid := r.PathValue("uid")
	ctx, cancel := context.WithTimeout(r.Context(), h.cfg.Timeout)
	defer cancel()
	v, ok, err := read(ctx, uid)
	switch {
	case err != nil:
		h.fail(w, r, http.StatusServiceUnavailable, CodeInternal, err.Error())
	case !ok:
		h.fail(w, r, http.StatusNotFound, CodeNotFound, "no source "+uid+" was announced")
	default:
		writeJSON(w, http.StatusOK, v)
	}
}

// The page sizes of GET /v1/sources/{uid}/credits.
const (
	DefaultPage = 1000
	MaxPage     = 10000
)

// creditsAnswer is GET /v1/sources/{uid}/credits's body. Next is the last key of the
// page when the page is full (ask again with ?after=<next>), empty at the end.
type creditsAnswer struct {
	Credits []Credit `json:"credits"`
	Next    string   `json:"next,omitempty"`
}

func (h *handler) credits(w http.ResponseWriter, r *http.Request) {
	uid := r.PathValue("uid")
	limit := DefaultPage
	if v := r.URL.Query().Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > MaxPage {
			h.fail(w, r, http.StatusBadRequest, CodeMalformed, "limit must be 1 to "+strconv.Itoa(MaxPage))
			return
		}
		limit = n
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.cfg.Timeout)
	defer cancel()
	_, ok, err := h.cfg.Book.Source(ctx, uid)
	if err != nil {
		h.fail(w, r, http.StatusServiceUnavailable, CodeInternal, err.Error())
		return
	}
	if !ok {
		h.fail(w, r, http.StatusNotFound, CodeNotFound, "no source "+uid+" was announced")
		return
	}
	cs, err := h.cfg.Book.Credits(ctx, uid, r.URL.Query().Get("after"), limit)
	if err != nil {
		h.fail(w, r, http.StatusServiceUnavailable, CodeInternal, err.Error())
		return
	}
	a := creditsAnswer{Credits: cs}
	if len(cs) == limit {
		a.Next = cs[len(cs)-1].Key
	}
	writeJSON(w, http.StatusOK, a)
}

func (h *handler) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := h.cfg.Book.Ping(ctx); err != nil {
		h.fail(w, r, http.StatusServiceUnavailable, CodeInternal, "the database does not answer: "+err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}
