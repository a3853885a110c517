package rain

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// A grab whose answer is lost on a dropped connection is asked again; the repeat
// answers already_claimed with the packet, which is the user's grant: counted once as
// granted and recovered, with its packet.
func TestRunCountsALostGrantAnswerAsTheUsersGrant(t *testing.T) {
	var (
		mu      sync.Mutex
		granted = map[string]string{}
		dropped = map[string]bool{}
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			UserID string `json:"userId"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		mu.Lock()
		packet, had := granted[body.UserID]
		if !had {
			packet = fmt.Sprint(len(granted) + 1)
			granted[body.UserID] = packet
		}
		// The second user's grant is decided, then its connection drops unanswered.
		drop := body.UserID == "u-00002" && !dropped[body.UserID]
		dropped[body.UserID] = dropped[body.UserID] || drop
		mu.Unlock()
		if drop {
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				_ = conn.Close()
			}
			return
		}
		outcome := "granted"
		if had {
			outcome = "already_claimed"
		}
		_ = json.NewEncoder(w).Encode(Answer{Outcome: outcome, PacketID: packet, Amount: 10})
	}))
	defer srv.Close()

	res := Run(t.Context(), Spec{URL: srv.URL, Users: 3, Connections: 1, Timeout: 5 * time.Second,
		RetryUnavailable: true, UserPrefix: "u", RetryEvery: 1})
	if res.Granted != 3 || res.Recovered != 1 || res.GrantedSum != 30 {
		t.Fatalf("granted %d (sum %d), recovered %d; want 3 (30) and 1", res.Granted, res.GrantedSum, res.Recovered)
	}
	if a := res.Grants["u-00002"]; a.PacketID != granted["u-00002"] {
		t.Errorf("u-00002 got %+v, want packet %s", a, granted["u-00002"])
	}
	if res.ByOutcome["already_claimed"] != 1 || res.ByOutcome["granted"] != 2 {
		t.Errorf("outcomes %v: the recovered user's first answer is already_claimed", res.ByOutcome)
	}
	// The transport may resend the dropped request itself (it carries an
	// Idempotency-Key); a drop it gives up on is reported with its error.
	if (res.TransportErrors == 0) != (res.FirstDropped == "") {
		t.Errorf("transport errors %d, first dropped %q", res.TransportErrors, res.FirstDropped)
	}
	if res.Retries != 3 || res.RetriesSame != 3 {
		t.Errorf("%d of %d retries consistent, want 3 of 3", res.RetriesSame, res.Retries)
	}
}
