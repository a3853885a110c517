package balance

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
)

// The read endpoints of the operator's reconciliation (docs/operations.md,
// "Reconciliation"): what the book holds of a source, counted from its credit rows
// rather than from the running sums, and which of a page of keys it holds. With the
// paged GET /v1/sources/{uid}/credits they let the operator compare its ledger with
// this book in bounded memory, whatever the source's size.

// BookedRows is what the book holds of a source, counted from its credit rows.
type BookedRows struct {
	UID     string `json:"uid"`
	Grants  Tally  `json:"grants"`
	Refunds Tally  `json:"refunds"`
}

// Rows counts and sums a source's credit rows by kind; ok is false when no
// announcement made the source.
func (b *Book) Rows(ctx context.Context, uid string) (out BookedRows, ok bool, err error) {
	if _, ok, err = b.Source(ctx, uid); err != nil || !ok {
		return BookedRows{}, ok, err
	}
	rows, err := b.pool.Query(ctx, `SELECT kind, count(*), coalesce(sum(amount), 0)::bigint FROM credits
		WHERE source_uid = $1 GROUP BY kind`, uid)
	if err != nil {
		return BookedRows{}, false, fmt.Errorf("counting the credits of %s: %w", uid, err)
	}
	defer rows.Close()
	out.UID = uid
	for rows.Next() {
		var kind string
		var t Tally
		if err := rows.Scan(&kind, &t.Count, &t.Sum); err != nil {
			return BookedRows{}, false, fmt.Errorf("counting the credits of %s: %w", uid, err)
		}
		if kind == "refund" {
			out.Refunds = t
		} else {
			out.Grants = t
		}
	}
	if err := rows.Err(); err != nil {
		return BookedRows{}, false, fmt.Errorf("counting the credits of %s: %w", uid, err)
	}
	return out, true, nil
}

// Lookup reads the credits of a source booked under any of keys, in key order.
func (b *Book) Lookup(ctx context.Context, uid string, keys []string) ([]Credit, error) {
	rows, err := b.pool.Query(ctx, `SELECT `+creditColumns+`
		FROM credits WHERE source_uid = $1 AND idempotency_key = ANY($2)
		ORDER BY idempotency_key COLLATE "C"`, uid, keys)
	if err != nil {
		return nil, fmt.Errorf("looking up %d keys of %s: %w", len(keys), uid, err)
	}
	credits, err := collectCredits(rows)
	if err != nil {
		return nil, fmt.Errorf("looking up %d keys of %s: %w", len(keys), uid, err)
	}
	return credits, nil
}

// routeReconciliation adds the reconciliation's read endpoints to mux:
//
//	GET  /v1/sources/{uid}/booked   the credit rows' counts and sums, by kind
//	POST /v1/sources/{uid}/lookup   {"keys":[...]} -> {"credits":[...]}, those booked
func (h *handler) routeReconciliation(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/sources/{uid}/booked", h.booked)
	mux.HandleFunc("POST /v1/sources/{uid}/lookup", h.lookup)
}

func (h *handler) booked(w http.ResponseWriter, r *http.Request) {
	h.serveSource(w, r, func(ctx context.Context, uid string) (any, bool, error) { return h.cfg.Book.Rows(ctx, uid) })
}

// lookupRequest is POST /v1/sources/{uid}/lookup's body: at most MaxPage keys.
type lookupRequest struct {
	Keys []string `json:"keys"`
}

func (h *handler) lookup(w http.ResponseWriter, r *http.Request) {
	uid := r.PathValue("uid")
	var req lookupRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 4<<20)).Decode(&req); err != nil {
		h.fail(w, r, http.StatusBadRequest, CodeMalformed, "the body is not {\"keys\":[...]}: "+err.Error())
		return
	}
	if len(req.Keys) > MaxPage {
		h.fail(w, r, http.StatusBadRequest, CodeMalformed, "at most "+strconv.Itoa(MaxPage)+" keys a lookup")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.cfg.Timeout)
	defer cancel()
	cs, err := h.cfg.Book.Lookup(ctx, uid, req.Keys)
	if err != nil {
		h.fail(w, r, http.StatusServiceUnavailable, CodeInternal, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, creditsAnswer{Credits: cs})
}
