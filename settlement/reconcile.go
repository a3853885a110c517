package settlement

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path"
	"strings"
	"time"

	"redpacket.io/operator/store"
)

// Reconciliation (对账) compares what the operator paid out of one source (an activity
// or a budget) with what the balance system booked of it, through the balance
// system's read endpoints beside its webhook (docs/operations.md, "Reconciliation"):
//
//	GET  <base>/sources/{uid}/booked    the book's counts and sums by kind, from its rows
//	GET  <base>/sources/{uid}/credits   its credits in key order, paged (?after=&limit=)
//	POST <base>/sources/{uid}/lookup    {"keys":[...]}: which of a page of keys it holds
//
// where <base> is the webhook URL without its last path segment
// (http://balance:8080/v1/credits -> http://balance:8080/v1). What the operator paid
// is what its settlement ledger let through (store.Ledger, store.BudgetLedger): the
// ledger decides before a delivery, so every key the book holds was in the ledger
// before, and a book ahead of the ledger is never a race. The other way, a ledger
// ahead of the book is what settlement still has in flight, so keys are compared
// that way only once every shard's stream is drained.
//
// The comparison starts with the totals (count and sum of the grants and of the
// refunds) and goes down to keys only when they differ, a page at a time (at most
// reconcilePage keys in memory), so a source of a million credits reconciles in
// bounded memory. A credit the ledger let through that the book lacks is delivered
// again, with the body it was delivered with and its same Idempotency-Key, so the
// balance system books it once, whatever it booked before; one parked in the dead
// letters is counted, not delivered (it waits for its replay). A credit the book
// holds that the ledger never let through, or holds with another user or amount, is
// reported, never corrected: money the operator did not pay is for a person.

// Outcomes of a reconciliation.
const (
	// ReconcileAgreed: the book holds exactly what the operator paid (after any
	// re-delivery this round made).
	ReconcileAgreed = "Agreed"
	// ReconcileDiffers: the book holds credits the operator never paid, or lacks
	// credits the operator paid that could not be booked again.
	ReconcileDiffers = "Differs"
	// ReconcileInFlight: the totals differ while settlement still has entries in
	// flight, and the book is not ahead: judged again later.
	ReconcileInFlight = "InFlight"
	// ReconcileUnsupported: the balance system has no read endpoint; nothing is
	// compared.
	ReconcileUnsupported = "Unsupported"
)

// reconcilePage is how many keys one page of either side holds (a variable so that
// a test can page through a small source).
var reconcilePage = 1000

// maxExamples is how many differing keys a Reconciliation names.
const maxExamples = 10

// Reconciliation is one comparison of a source's ledger with the balance system's
// book.
type Reconciliation struct {
	// At is when the comparison started.
	At time.Time
	// Outcome is one of the Reconcile* outcomes.
	Outcome string
	// Operator is what the ledger let through; Book what the book holds, read
	// before the ledger (and again after any re-delivery).
	Operator, Book store.PaidTotals
	// Redelivered counts the credits the book lacked that were delivered again and
	// acknowledged this round.
	Redelivered int
	// Missing counts the credits the book lacks that could not be delivered again
	// this round (an error answer, or their stream entry could not be found).
	Missing int
	// Parked counts the credits the book lacks that wait in the dead letters.
	Parked int
	// Unpaid counts the book's credits that the ledger never let through, with
	// their sum.
	Unpaid    int
	UnpaidSum int64
	// Differing counts the book's credits under a key the ledger let through for
	// another user, amount or kind.
	Differing int
	// Unverifiable counts the book's credits of budget packets whose ledger was
	// forgotten after its retention: only the totals speak for them.
	Unverifiable int
	// Examples names up to maxExamples of the keys above, each with what is wrong.
	Examples []string
	// Detail says why for ReconcileUnsupported.
	Detail string
}

// Mismatches are the counts of the metric redpacket_reconciliation_mismatch by
// kind: "missing" (paid, not booked, not booked again), "parked" (paid, waiting
// in the dead letters), "unpaid" (booked, never paid) and "differing" (booked
// with another user, amount or kind).
func (r Reconciliation) Mismatches() map[string]int {
	return map[string]int{"missing": r.Missing, "parked": r.Parked, "unpaid": r.Unpaid, "differing": r.Differing}
}

// String says what the comparison found, for a condition's message.
func (r Reconciliation) String() string {
	tot := func(t store.PaidTotals) string {
		return fmt.Sprintf("%d grants (%d) and %d refunds (%d)", t.Grants, t.GrantSum, t.Refunds, t.RefundSum)
	}
	switch r.Outcome {
	case ReconcileUnsupported:
		return "the balance system has no reconciliation endpoint: " + r.Detail
	case ReconcileInFlight:
		return fmt.Sprintf("settlement is delivering: the operator paid %s, the balance system booked %s so far", tot(r.Operator), tot(r.Book))
	}
	var parts []string
	if r.Redelivered > 0 {
		parts = append(parts, fmt.Sprintf("%d credits the balance system lacked were delivered again", r.Redelivered))
	}
	if r.Unpaid > 0 {
		parts = append(parts, fmt.Sprintf("%d credits (%d) booked that the operator never paid", r.Unpaid, r.UnpaidSum))
	}
	if r.Differing > 0 {
		parts = append(parts, fmt.Sprintf("%d credits booked with another user, amount or kind than paid", r.Differing))
	}
	if r.Missing > 0 {
		parts = append(parts, fmt.Sprintf("%d credits paid and not booked, not delivered again yet", r.Missing))
	}
	if r.Parked > 0 {
		parts = append(parts, fmt.Sprintf("%d credits paid wait in the dead letters", r.Parked))
	}
	if r.Unverifiable > 0 {
		parts = append(parts, fmt.Sprintf("%d booked credits of packets the ledger no longer holds", r.Unverifiable))
	}
	msg := fmt.Sprintf("the operator paid %s, the balance system booked %s", tot(r.Operator), tot(r.Book))
	if len(parts) > 0 {
		msg += "; " + strings.Join(parts, "; ")
	}
	if len(r.Examples) > 0 {
		msg += ": " + strings.Join(r.Examples, ", ")
	}
	return msg
}

func (r *Reconciliation) example(format string, args ...any) {
	if len(r.Examples) < maxExamples {
		r.Examples = append(r.Examples, fmt.Sprintf(format, args...))
	}
}

// paidCredit is one credit as the ledger let it through.
type paidCredit struct {
	Key, Kind, UserID string
	Amount            int64
	// amountKnown is false when the ledger does not say the amount (an activity
	// without its split at hand).
	amountKnown bool
}

// paidVerdict is what the ledger says of a key the book holds.
type paidVerdict struct {
	paid         bool
	credit       paidCredit
	unverifiable bool
}

// ledgerSide is the operator's side of a reconciliation: an activity's ledger
// (activityPaid) or a budget's (budgetPaid).
type ledgerSide interface {
	// totals reads what the ledger let through.
	totals(ctx context.Context) (store.PaidTotals, error)
	// quiet reports whether every shard's stream is drained: nothing unread, nothing
	// read and unacknowledged.
	quiet(ctx context.Context) (bool, error)
	// check says, for each of the book's credits in order, what the ledger let
	// through under its key.
	check(ctx context.Context, book []bookCredit) ([]paidVerdict, error)
	// scan reads one page of what the ledger let through, from cursor (0 to start);
	// next is 0 after the last page.
	scan(ctx context.Context, cursor uint64) (page []paidCredit, next uint64, err error)
	// delivery rebuilds the delivery of a credit the ledger let through, with the
	// body it was delivered with.
	delivery(ctx context.Context, c paidCredit) (Delivery, error)
	// parked is the set of keys in the shards' dead letters.
	parked(ctx context.Context) (map[string]bool, error)
}

// Reconciler reconciles one source (NewActivityReconciler, NewBudgetReconciler).
type Reconciler struct {
	cfg  Config
	side ledgerSide
	book bookClient
	now  func() time.Time
}

// Reconcile compares the source's ledger with the balance system's book once (see
// above) and delivers again what the book lacks. An error means the comparison
// could not be made (Redis or the balance system unreachable); nothing is
// concluded from it.
func (rc *Reconciler) Reconcile(ctx context.Context) (Reconciliation, error) {
	r := Reconciliation{At: rc.now()}
	book, found, why, err := rc.book.totals(ctx)
	if err != nil {
		return r, err
	}
	if why != "" {
		r.Outcome, r.Detail = ReconcileUnsupported, why
		return r, nil
	}
	op, err := rc.side.totals(ctx)
	if err != nil {
		return r, err
	}
	r.Operator, r.Book = op, book
	if op == book {
		r.Outcome = ReconcileAgreed
		return r, nil
	}
	quiet, err := rc.side.quiet(ctx)
	if err != nil {
		return r, err
	}
	ahead := book.Grants > op.Grants || book.GrantSum > op.GrantSum || book.Refunds > op.Refunds || book.RefundSum > op.RefundSum
	if !quiet && !ahead {
		r.Outcome = ReconcileInFlight
		return r, nil
	}
	if found {
		if err := rc.bookAgainstLedger(ctx, &r); err != nil {
			return r, err
		}
	}
	if quiet {
		if err := rc.ledgerAgainstBook(ctx, &r); err != nil {
			return r, err
		}
		if r.Redelivered > 0 {
			if r.Book, _, _, err = rc.book.totals(ctx); err != nil {
				return r, err
			}
		}
	}
	switch {
	case r.Unpaid+r.Differing+r.Missing+r.Parked > 0, quiet && r.Book != r.Operator && r.Unverifiable == 0:
		r.Outcome = ReconcileDiffers
	case !quiet:
		r.Outcome = ReconcileInFlight
	default:
		r.Outcome = ReconcileAgreed
	}
	return r, nil
}

// bookAgainstLedger pages through the book and checks each credit against the ledger.
func (rc *Reconciler) bookAgainstLedger(ctx context.Context, r *Reconciliation) error {
	after := ""
	for {
		page, next, err := rc.book.page(ctx, after)
		if err != nil {
			return err
		}
		verdicts, err := rc.side.check(ctx, page)
		if err != nil {
			return err
		}
		for i, c := range page {
			v := verdicts[i]
			switch {
			case v.unverifiable:
				r.Unverifiable++
			case !v.paid:
				r.Unpaid++
				r.UnpaidSum += c.Amount
				r.example("%s booked, never paid (%s of %d to %q)", c.Key, c.Kind, c.Amount, c.UserID)
			case v.credit.UserID != c.UserID || v.credit.Kind != c.Kind || v.credit.amountKnown && v.credit.Amount != c.Amount:
				r.Differing++
				r.example("%s booked as %s of %d to %q, paid as %s of %d to %q", c.Key, c.Kind, c.Amount, c.UserID,
					v.credit.Kind, v.credit.Amount, v.credit.UserID)
			}
		}
		if next == "" {
			return nil
		}
		after = next
	}
}

// ledgerAgainstBook pages through the ledger, looks each page up in the book and
// delivers again what the book lacks, unless it waits in the dead letters.
func (rc *Reconciler) ledgerAgainstBook(ctx context.Context, r *Reconciliation) error {
	parked, err := rc.side.parked(ctx)
	if err != nil {
		return err
	}
	var cursor uint64
	for {
		page, next, err := rc.side.scan(ctx, cursor)
		if err != nil {
			return err
		}
		for len(page) > 0 {
			n := min(len(page), reconcilePage)
			chunk := page[:n]
			page = page[n:]
			keys := make([]string, len(chunk))
			for i, c := range chunk {
				keys[i] = c.Key
			}
			held, err := rc.book.lookup(ctx, keys)
			if err != nil {
				return err
			}
			for _, c := range chunk {
				if held[c.Key] {
					continue
				}
				if parked[c.Key] {
					r.Parked++
					r.example("%s paid, waits in the dead letters", c.Key)
					continue
				}
				if err := rc.redeliver(ctx, c); err != nil {
					if ctx.Err() != nil {
						return ctx.Err()
					}
					r.Missing++
					r.example("%s paid, not booked: %v", c.Key, err)
					continue
				}
				r.Redelivered++
			}
		}
		if next == 0 {
			return nil
		}
		cursor = next
	}
}

// redeliver delivers a paid credit again with its original body and key.
func (rc *Reconciler) redeliver(ctx context.Context, c paidCredit) error {
	d, err := rc.side.delivery(ctx, c)
	if err != nil {
		return err
	}
	if d.IdempotencyKey() != c.Key {
		return fmt.Errorf("the rebuilt delivery's key is %s", d.IdempotencyKey())
	}
	body, err := json.Marshal(d)
	if err != nil {
		return fmt.Errorf("encoding the delivery: %w", err)
	}
	return postBody(ctx, rc.cfg, body, c.Key)
}

// bookCredit is one credit as the balance system's read API shows it.
type bookCredit struct {
	Key    string `json:"key"`
	Kind   string `json:"kind"`
	UserID string `json:"userId"`
	Amount int64  `json:"amount"`
	At     string `json:"at"`
}

// errNotReadAPI is a 2xx answer whose body is not the read API's.
var errNotReadAPI = errors.New("not the read API's body")

// bookClient reads a source's book from the balance system's read endpoints.
type bookClient struct {
	base, uid string
	http      *http.Client
}

// readBase is the base of the read endpoints of a webhook URL: the URL without its
// last path segment, its query or its fragment.
func readBase(webhookURL string) (string, error) {
	u, err := url.Parse(webhookURL)
	if err != nil {
		return "", fmt.Errorf("the webhook URL: %w", err)
	}
	dir := path.Dir(u.Path)
	if dir == "." || dir == "/" {
		dir = ""
	}
	u.Path, u.RawPath, u.RawQuery, u.Fragment = dir, "", "", ""
	return u.String(), nil
}

func (b bookClient) sourceURL(suffix string) string {
	return b.base + "/sources/" + url.PathEscape(b.uid) + suffix
}

// get GETs u into out; it returns the status and the error code of a JSON error
// answer.
func (b bookClient) do(ctx context.Context, method, u string, body, out any) (status int, code string, err error) {
	var rd io.Reader
	if body != nil {
		raw, err := json.Marshal(body)
		if err != nil {
			return 0, "", fmt.Errorf("encoding the request to %s: %w", u, err)
		}
		rd = bytes.NewReader(raw)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return 0, "", fmt.Errorf("building the request to %s: %w", u, err)
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := b.http.Do(req)
	if err != nil {
		return 0, "", fmt.Errorf("reading the balance system's book: %w", err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 32<<20))
	if err != nil {
		return resp.StatusCode, "", fmt.Errorf("reading the answer of %s %s: %w", method, u, err)
	}
	if resp.StatusCode/100 != 2 {
		var e struct {
			Error string `json:"error"`
		}
		_ = json.Unmarshal(raw, &e)
		return resp.StatusCode, e.Error, nil
	}
	if err := json.Unmarshal(raw, out); err != nil {
		return resp.StatusCode, "", fmt.Errorf("the answer of %s %s: %w (%v)", method, u, errNotReadAPI, err)
	}
	return resp.StatusCode, "", nil
}

// totals reads the book's counts and sums. found is false when the balance system
// knows no such source (404 with the error not_found: nothing booked); why is set
// when it has no such endpoint or does not let the operator read it (any other 4xx,
// or 501).
func (b bookClient) totals(ctx context.Context) (t store.PaidTotals, found bool, why string, err error) {
	var out struct {
		UID     string                     `json:"uid"`
		Grants  struct{ Count, Sum int64 } `json:"grants"`
		Refunds struct{ Count, Sum int64 } `json:"refunds"`
	}
	u := b.sourceURL("/booked")
	status, code, err := b.do(ctx, http.MethodGet, u, nil, &out)
	switch {
	case errors.Is(err, errNotReadAPI) || err == nil && status/100 == 2 && out.UID != b.uid:
		// A webhook that answers anything with a 2xx is not a read endpoint.
		return t, false, fmt.Sprintf("GET %s answered %d without the read API's body", u, status), nil
	case err != nil:
		return t, false, "", err
	case status == http.StatusNotFound && code == "not_found":
		return t, false, "", nil
	case status/100 == 4 || status == http.StatusNotImplemented:
		return t, false, fmt.Sprintf("GET %s answered %d", u, status), nil
	case status/100 != 2:
		return t, false, "", fmt.Errorf("GET %s answered %d %s", u, status, code)
	}
	return store.PaidTotals{Grants: out.Grants.Count, GrantSum: out.Grants.Sum, Refunds: out.Refunds.Count, RefundSum: out.Refunds.Sum},
		true, "", nil
}

// page reads the book's credits after the key after; next is "" after the last page.
func (b bookClient) page(ctx context.Context, after string) ([]bookCredit, string, error) {
	var out struct {
		Credits []bookCredit `json:"credits"`
		Next    string       `json:"next"`
	}
	u := b.sourceURL("/credits") + fmt.Sprintf("?limit=%d&after=%s", reconcilePage, url.QueryEscape(after))
	status, code, err := b.do(ctx, http.MethodGet, u, nil, &out)
	if err != nil {
		return nil, "", err
	}
	if status/100 != 2 {
		return nil, "", fmt.Errorf("GET %s answered %d %s", u, status, code)
	}
	if len(out.Credits) < reconcilePage {
		out.Next = ""
	}
	return out.Credits, out.Next, nil
}

// lookup reports which of keys the book holds.
func (b bookClient) lookup(ctx context.Context, keys []string) (map[string]bool, error) {
	var out struct {
		Credits []bookCredit `json:"credits"`
	}
	u := b.sourceURL("/lookup")
	status, code, err := b.do(ctx, http.MethodPost, u, map[string][]string{"keys": keys}, &out)
	if err != nil {
		return nil, err
	}
	if status == http.StatusNotFound && code == "not_found" {
		return map[string]bool{}, nil
	}
	if status/100 != 2 {
		return nil, fmt.Errorf("POST %s answered %d %s", u, status, code)
	}
	held := make(map[string]bool, len(out.Credits))
	for _, c := range out.Credits {
		held[c.Key] = true
	}
	return held, nil
}

// newReconciler checks cfg, fills in its defaults and makes the book's client.
func newReconciler(cfg Config, side func(Config) (ledgerSide, error)) (*Reconciler, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if cfg.WebhookURL == "" {
		return nil, errors.New("reconciliation: no webhook URL")
	}
	base, err := readBase(cfg.WebhookURL)
	if err != nil {
		return nil, fmt.Errorf("reconciliation: %w", err)
	}
	s, err := side(cfg)
	if err != nil {
		return nil, err
	}
	return &Reconciler{cfg: cfg, side: s, book: bookClient{base: base, uid: cfg.Source.UID, http: cfg.HTTPClient}, now: time.Now}, nil
}
