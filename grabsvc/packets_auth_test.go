package grabsvc

import (
	"io"
	"maps"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestPacketDetailTokens: with user tokens on (a budget with spec.grabService.auth),
// GET and HEAD /v1/packets/{id} need a user token for the budget or for this packet,
// of any user, or the sender credential. Every other read is a 401 decided before
// Redis is touched (no command sent, every key's DUMP unchanged), and its answer for
// a packet that exists is byte for byte the answer for one that never did, so ids
// cannot be probed.
func TestPacketDetailTokens(t *testing.T) {
	key := []byte("budget-token-key")
	h, sign := newTokenPacketHarness(t, key, `"sender":"Lin's tea shop","totalAmount":300,"count":3`, "order-1001", "order-1002")
	exp := time.Now().Add(5 * time.Minute).Unix()
	ref := h.budget.Ref()
	if a := h.grab("order-1001", "alice", sign(key, TokenClaims{UserID: "alice", Budget: ref, BudgetUID: h.budget.UID, Exp: exp})); a.str("outcome") != OutcomeGranted {
		t.Fatalf("grab: %d %s", a.Status, a.Raw)
	}

	for _, tc := range []struct {
		name   string
		header map[string]string
		want   error
	}{
		{"no token", nil, ErrTokenMissing},
		{"not bearer", map[string]string{"Authorization": "Basic " + senderSecret}, ErrTokenMalformed},
		{"a wrong sender credential", map[string]string{"Authorization": "Bearer " + senderSecret + "x"}, ErrTokenMalformed},
		{"forged", sign([]byte("other"), TokenClaims{UserID: "u-1", Budget: ref, BudgetUID: h.budget.UID, Exp: exp}), ErrTokenSignature},
		{"expired", sign(key, TokenClaims{UserID: "u-1", Budget: ref, BudgetUID: h.budget.UID, Exp: time.Now().Unix() - 1}), ErrTokenExpired},
		{"too long-lived", sign(key, TokenClaims{UserID: "u-1", Budget: ref, BudgetUID: h.budget.UID, Exp: time.Now().Add(48 * time.Hour).Unix()}), ErrTokenLifetime},
		{"another budget", sign(key, TokenClaims{UserID: "u-1", Budget: "shop/other", BudgetUID: h.budget.UID, Exp: exp}), ErrTokenBudget},
		{"another budget uid", sign(key, TokenClaims{UserID: "u-1", Budget: ref, BudgetUID: "old-uid", Exp: exp}), ErrTokenBudget},
		{"an activity's token", sign(key, TokenClaims{UserID: "u-1", Activity: ref, ActivityUID: h.budget.UID, Exp: exp}), ErrTokenBudget},
		{"another packet", sign(key, TokenClaims{UserID: "u-1", Budget: ref, BudgetUID: h.budget.UID, Packet: "order-1002", Exp: exp}), ErrTokenPacket},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var first answer
			// An existing packet with grabs, and ids never created: the same answer.
			for i, id := range []string{"order-1001", "order-9999", "never.created"} {
				before, cmds := h.dump(), h.commands()
				overhead := h.commands() - cmds
				cmds += overhead
				a := h.do(http.MethodGet, "/v1/packets/"+id, "", tc.header)
				if sent := h.commands() - cmds - overhead; sent != 0 {
					t.Errorf("GET %s: the refusal sent Redis %d commands", id, sent)
				}
				if !maps.Equal(before, h.dump()) {
					t.Fatalf("GET %s: the refusal changed Redis", id)
				}
				if a.Status != http.StatusUnauthorized || a.str("error") != OutcomeUnauthorized ||
					!strings.HasPrefix(a.str("message"), ErrPacketRead.Error()) || !strings.Contains(a.str("message"), tc.want.Error()) {
					t.Fatalf("GET %s: %d %s, want 401 unauthorized for %q", id, a.Status, a.Raw, tc.want)
				}
				if a.Header.Get("WWW-Authenticate") == "" {
					t.Errorf("GET %s: a 401 without WWW-Authenticate", id)
				}
				for _, leak := range []string{"Lin", "alice", "300"} {
					if strings.Contains(a.Raw, leak) {
						t.Errorf("GET %s: the refusal shows %q: %s", id, leak, a.Raw)
					}
				}
				if i == 0 {
					first = a
					continue
				}
				if a.Raw != first.Raw || a.Header.Get("WWW-Authenticate") != first.Header.Get("WWW-Authenticate") ||
					a.Header.Get("Content-Length") != first.Header.Get("Content-Length") {
					t.Errorf("GET %s answers %q, an existing packet %q: ids can be probed", id, a.Raw, first.Raw)
				}
			}
			if a := h.do(http.MethodHead, "/v1/packets/order-1001", "", tc.header); a.Status != http.StatusUnauthorized {
				t.Errorf("HEAD: %d", a.Status)
			}
		})
	}
	if got := testutil.ToFloat64(h.metrics.Details.WithLabelValues(OutcomeUnauthorized)); got != 40 {
		t.Errorf("details refused unauthorized: %v, want 40 (10 kinds of token, 3 GETs and a HEAD each)", got)
	}

	// Who may read: a group member with a token for the budget (bob, who grabbed
	// nothing), one with a token for this packet, and the sender's backend.
	budgetWide := sign(key, TokenClaims{UserID: "bob", Budget: ref, BudgetUID: h.budget.UID, Exp: exp})
	onePacket := sign(key, TokenClaims{UserID: "carol", Budget: ref, BudgetUID: h.budget.UID, Packet: "order-1001", Exp: exp})
	for _, r := range []struct {
		name, id string
		header   map[string]string
		grabs    int
	}{
		{"a budget's token", "order-1001", budgetWide, 1},
		{"a budget's token", "order-1002", budgetWide, 0},
		{"a packet's token", "order-1001", onePacket, 1},
		{"the sender credential", "order-1001", asSender, 1},
		{"the sender credential", "order-1002", asSender, 0},
	} {
		a := h.do(http.MethodGet, "/v1/packets/"+r.id, "", r.header)
		grabs, _ := a.Body["grabs"].([]any)
		if a.Status != http.StatusOK || a.str("sender") != "Lin's tea shop" || len(grabs) != r.grabs {
			t.Errorf("%s reads %s: %d %s, want 200 with %d grabs", r.name, r.id, a.Status, a.Raw, r.grabs)
		}
	}
	// A packet's token reads no other packet, even one of the same budget.
	if a := h.do(http.MethodGet, "/v1/packets/order-1002", "", onePacket); a.Status != http.StatusUnauthorized {
		t.Errorf("order-1001's token reads order-1002: %d %s", a.Status, a.Raw)
	}
	// A reader with a good token learns what a grab would tell it: not found.
	if a := h.do(http.MethodGet, "/v1/packets/order-9999", "", budgetWide); a.Status != http.StatusNotFound || a.str("error") != OutcomeNotFound {
		t.Errorf("a missing packet with a good token: %d %s", a.Status, a.Raw)
	}
	// The sender credential is not a user token: it grabs nothing.
	before := h.dump()
	if a := h.grab("order-1001", "u-5", asSender); a.Status != http.StatusUnauthorized || a.str("outcome") != OutcomeUnauthorized {
		t.Errorf("a grab with the sender credential: %d %s", a.Status, a.Raw)
	}
	if !maps.Equal(before, h.dump()) {
		t.Fatal("a grab with the sender credential changed Redis")
	}
	// The page is static: it serves no packet's data and needs no token; its script
	// reads the token from the fragment and sends it with every read.
	resp, err := http.Get(h.http.URL + "/p/order-1001")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || strings.Contains(string(page), "Lin") || strings.Contains(string(page), "alice") {
		t.Errorf("GET /p/order-1001 without a token: %d, or the page holds the packet's data", resp.StatusCode)
	}
}

// TestPacketDetailWithoutTokens: a budget without spec.grabService.auth (no token
// key) reads as before: anyone, with or without an Authorization header.
func TestPacketDetailWithoutTokens(t *testing.T) {
	h := newPacketHarness(t, 10_000, 4)
	if a := h.create(`{"id":"order-1","sender":"m","totalAmount":300,"count":3}`); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	for _, hd := range []map[string]string{nil, {"Authorization": "Bearer whatever"}, asSender} {
		if a := h.do(http.MethodGet, "/v1/packets/order-1", "", hd); a.Status != http.StatusOK || a.str("id") != "order-1" {
			t.Errorf("read with %v: %d %s", hd, a.Status, a.Raw)
		}
	}
	if a := h.do(http.MethodGet, "/v1/packets/order-2", "", nil); a.Status != http.StatusNotFound {
		t.Errorf("a missing packet: %d %s", a.Status, a.Raw)
	}
}
