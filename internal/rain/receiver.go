package rain

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// Delivery is the settlement webhook's body.
type Delivery struct {
	Kind        string `json:"kind"`
	Activity    string `json:"activity"`
	ActivityUID string `json:"activityUID"`
	PacketID    string `json:"packetId"`
	UserID      string `json:"userId"`
	Amount      int64  `json:"amount"`
	Currency    string `json:"currency"`
	At          string `json:"at"`
}

// Receiver is a small balance system: it credits each idempotency key once, keeps
// totals, and counts what a real one would alarm on. With a key, it refuses a
// delivery whose X-Signature does not verify.
type Receiver struct {
	key []byte

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
}

// NewReceiver returns a receiver that verifies signatures made with key (nil: none).
func NewReceiver(key []byte) *Receiver {
	return &Receiver{key: key, seen: map[string]Delivery{}, users: map[string]int64{}}
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
	if len(rc.key) > 0 {
		mac := hmac.New(sha256.New, rc.key)
		mac.Write(body)
		want := "sha256=" + hex.EncodeToString(mac.Sum(nil))
		if !hmac.Equal([]byte(r.Header.Get("X-Signature")), []byte(want)) {
			rc.badRequests++
			http.Error(w, "bad signature", http.StatusUnauthorized)
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
	if d.Kind == "refund" {
		wantKey = d.ActivityUID + "/refund"
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
	rc.seen[idem] = d
	switch d.Kind {
	case "grant":
		rc.grants++
		rc.grantSum += d.Amount
		rc.users[d.UserID]++
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
}

// Totals returns the receiver's counters.
func (rc *Receiver) Totals() Totals {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	t := Totals{Requests: rc.requests, Repeats: rc.repeats, Conflicts: rc.conflicts, BadRequests: rc.badRequests,
		Grants: rc.grants, GrantSum: rc.grantSum, Refunds: rc.refunds, RefundSum: rc.refundSum}
	for _, n := range rc.users {
		if n > 1 {
			t.UsersCreditedTwice++
		}
	}
	return t
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
