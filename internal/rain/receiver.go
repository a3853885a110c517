package rain

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"redpacket.io/operator/pkg/webhooksig"
)

// Delivery is the settlement webhook's body.
type Delivery struct {
	Kind        string `json:"kind"`
	Activity    string `json:"activity"`
	ActivityUID string `json:"activityUID"`
	PacketID    string `json:"packetId"`
	UserID      string `json:"userId"`
	Amount      int64  `json:"amount"`
	// Count is the budget's number of packets (kind "budget" only; a
	// RedPacketBudget's announcement has none: its packets are made at runtime).
	Count int64 `json:"count,omitempty"`
	// Source is "budget" for a RedPacketBudget's runtime packets, empty for an
	// activity.
	Source   string `json:"source,omitempty"`
	Currency string `json:"currency"`
	At       string `json:"at"`
}

// budget is what the operator announced for one activity UID, and what was
// credited against it.
type budget struct {
	amount, count     int64
	credited, granted int64
	// runtime is a RedPacketBudget's: its total bounds the credits, no count does.
	runtime bool
}

// Receiver is a small balance system: it credits each idempotency key once, keeps
// totals, and counts what a real one would alarm on. With a key (an HMAC key, or the
// operator's Ed25519 public keys in PublicKeys), it refuses with 401 a delivery
// whose Standard Webhooks signature does not verify (pkg/webhooksig): a v1 signature
// under the key, or a v1a under a public key, with a webhook-timestamp within the
// tolerance (5 minutes) of its clock; X-Signature alone only with AcceptXSignature.
// It records each activity's announced
// budget (kind "budget", Idempotency-Key "<uid>/budget") and refuses, with 409, a
// credit that would take the activity's grants and refund beyond the budget's
// amount or its grants beyond its count; with RequireBudget, also any credit of an
// activity whose budget was not announced first.
type Receiver struct {
	key []byte
	// RequireBudget refuses credits of an activity whose budget was not announced.
	RequireBudget bool
	// PublicKeys are the operator's Ed25519 public keys: a v1a signature under one
	// of them verifies a delivery. Set them before serving.
	PublicKeys []ed25519.PublicKey
	// AcceptXSignature also accepts a delivery without any Standard Webhooks header
	// whose X-Signature verifies under the key, as an operator of an earlier release
	// sends it. Set it before serving.
	AcceptXSignature bool
	// Tolerance bounds how far a delivery's webhook-timestamp may be from Now; 0 is
	// webhooksig.DefaultTolerance.
	Tolerance time.Duration
	// Now is the receiver's clock; nil is time.Now.
	Now func() time.Time

	mu          sync.Mutex
	seen        map[string]Delivery
	requests    int64
	repeats     int64 // a key delivered again (harmless, deduplicated)
	conflicts   int64 // a key delivered again with a different body (a rollback)
	badRequests int64 // bad signature, body or idempotency key
	grants      int64
	grantSum    int64
	refunds     int64
	refundSum   int64
	users       map[string]int64
	budgets     map[string]*budget
	overBudget  int64 // credits refused beyond the announced budget, or without one
}

// NewReceiver returns a receiver that verifies signatures made with key (nil: none).
func NewReceiver(key []byte) *Receiver {
	return &Receiver{key: key, seen: map[string]Delivery{}, users: map[string]int64{}, budgets: map[string]*budget{}}
}

// SetAcceptXSignature sets AcceptXSignature while the receiver may be serving: for a
// test that runs an operator of an earlier release, which sends X-Signature alone.
func (rc *Receiver) SetAcceptXSignature(accept bool) {
	rc.mu.Lock()
	rc.AcceptXSignature = accept
	rc.mu.Unlock()
}

// verifier checks deliveries against the receiver's keys; rc.mu is held.
func (rc *Receiver) verifier() webhooksig.Verifier {
	v := webhooksig.Verifier{PublicKeys: rc.PublicKeys, Tolerance: rc.Tolerance, Now: rc.Now, AcceptXSignature: rc.AcceptXSignature}
	if len(rc.key) > 0 {
		v.HMAC = [][]byte{rc.key}
	}
	return v
}

// ServeHTTP credits one delivery.
func (rc *Receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "POST only", http.StatusMethodNotAllowed)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<10))
	if err != nil {
		http.Error(w, "reading body", http.StatusBadRequest)
		return
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.requests++
	if v := rc.verifier(); v.Enabled() {
		if _, err := v.Verify(r.Header, body); err != nil {
			rc.badRequests++
			http.Error(w, "bad signature: "+err.Error(), http.StatusUnauthorized)
			return
		}
	}
	var d Delivery
	if err := json.Unmarshal(body, &d); err != nil {
		rc.badRequests++
		http.Error(w, "bad body", http.StatusBadRequest)
		return
	}
	idem := r.Header.Get("Idempotency-Key")
	wantKey := d.ActivityUID + "/" + d.PacketID
	switch {
	case d.Source == "budget" && d.Kind == "budget":
		// A RedPacketBudget announces its whole total, again at every refill, under
		// "<uid>/budget:<total>"; its credits never go beyond the last one.
		wantKey = fmt.Sprintf("%s/budget:%d", d.ActivityUID, d.Amount)
		if idem != wantKey || d.Amount <= 0 {
			rc.badRequests++
			http.Error(w, fmt.Sprintf("budget total with idempotency key %q (want %q), amount %d", idem, wantKey, d.Amount), http.StatusBadRequest)
			return
		}
		b := rc.budgets[d.ActivityUID]
		if b == nil {
			b = &budget{runtime: true}
			rc.budgets[d.ActivityUID] = b
		}
		b.amount = max(b.amount, d.Amount)
		w.WriteHeader(http.StatusOK)
		return
	case d.Source == "budget":
		// A runtime packet's share or refund: "<uid>/<packetId>/<share>" and
		// "<uid>/<packetId>/refund", the packet id carrying both.
	case d.Kind == "refund":
		wantKey = d.ActivityUID + "/refund"
	case d.Kind == "budget":
		wantKey = d.ActivityUID + "/budget"
		if idem != wantKey || d.Amount <= 0 || d.Count <= 0 {
			rc.badRequests++
			http.Error(w, fmt.Sprintf("budget with idempotency key %q (want %q), amount %d, count %d", idem, wantKey, d.Amount, d.Count), http.StatusBadRequest)
			return
		}
		if _, ok := rc.budgets[d.ActivityUID]; !ok {
			rc.budgets[d.ActivityUID] = &budget{amount: d.Amount, count: d.Count}
		}
		w.WriteHeader(http.StatusOK)
		return
	}
	if idem == "" || idem != wantKey || d.Amount <= 0 {
		rc.badRequests++
		http.Error(w, fmt.Sprintf("idempotency key %q, want %q", idem, wantKey), http.StatusBadRequest)
		return
	}
	if first, ok := rc.seen[idem]; ok {
		rc.repeats++
		if first.UserID != d.UserID || first.Amount != d.Amount || first.Kind != d.Kind {
			rc.conflicts++
		}
		w.WriteHeader(http.StatusOK)
		return
	}
	b := rc.budgets[d.ActivityUID]
	if b == nil && rc.RequireBudget {
		rc.overBudget++
		http.Error(w, "no budget was announced for activity "+d.ActivityUID, http.StatusConflict)
		return
	}
	if b != nil {
		granted := b.granted
		if d.Kind == "grant" {
			granted++
		}
		if b.credited+d.Amount > b.amount || (!b.runtime && granted > b.count) {
			rc.overBudget++
			http.Error(w, fmt.Sprintf("over the budget of %d in %d packets", b.amount, b.count), http.StatusConflict)
			return
		}
		b.credited += d.Amount
		b.granted = granted
	}
	rc.seen[idem] = d
	switch d.Kind {
	case "grant":
		rc.grants++
		rc.grantSum += d.Amount
		if d.Source == "" {
			// A user may win one packet of an activity, and a share of many
			// runtime packets.
			rc.users[d.UserID]++
		}
	case "refund":
		rc.refunds++
		rc.refundSum += d.Amount
	default:
		rc.badRequests++
		delete(rc.seen, idem)
		http.Error(w, "unknown kind", http.StatusBadRequest)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// Totals is a consistent copy of the receiver's counters.
type Totals struct {
	Requests, Repeats, Conflicts, BadRequests int64
	Grants, GrantSum, Refunds, RefundSum      int64
	UsersCreditedTwice                        int64
	// Budgets is how many activities announced a budget; OverBudget how many
	// credits were refused beyond one (or without one, with RequireBudget).
	Budgets, OverBudget int64
}

// Totals returns the receiver's counters.
func (rc *Receiver) Totals() Totals {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	t := Totals{Requests: rc.requests, Repeats: rc.repeats, Conflicts: rc.conflicts, BadRequests: rc.badRequests,
		Grants: rc.grants, GrantSum: rc.grantSum, Refunds: rc.refunds, RefundSum: rc.refundSum,
		Budgets: int64(len(rc.budgets)), OverBudget: rc.overBudget}
	for _, n := range rc.users {
		if n > 1 {
			t.UsersCreditedTwice++
		}
	}
	return t
}

// Budget returns the budget announced for an activity UID, and false when none was.
func (rc *Receiver) Budget(activityUID string) (amount, count int64, ok bool) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	b := rc.budgets[activityUID]
	if b == nil {
		return 0, 0, false
	}
	return b.amount, b.count, true
}

// Delivered returns the delivery credited under an idempotency key.
func (rc *Receiver) Delivered(key string) (Delivery, bool) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	d, ok := rc.seen[key]
	return d, ok
}

// Credited returns what was credited for one activity UID: the grants by packet id
// and the refund (0 when none).
func (rc *Receiver) Credited(activityUID string) (map[string]Delivery, int64) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	grants := map[string]Delivery{}
	var refund int64
	for _, d := range rc.seen {
		if d.ActivityUID != activityUID {
			continue
		}
		if d.Kind == "refund" {
			refund += d.Amount
			continue
		}
		grants[d.PacketID] = d
	}
	return grants, refund
}

// Serve runs the receiver on host (a free port of it) and returns its base URL and
// a function that stops it.
func (rc *Receiver) Serve(ctx context.Context, host string) (string, func(), error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return "", nil, fmt.Errorf("listening for the balance receiver: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/credit", rc)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Println("balance receiver:", err)
		}
	}()
	stop := func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 3*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}
	return "http://" + l.Addr().String(), stop, nil
}
