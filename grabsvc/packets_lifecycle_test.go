package grabsvc

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
)

// The rule of the best luck, on packets as the store decodes them.
func TestBestLuckRule(t *testing.T) {
	grabs := func(amounts ...int64) []store.PacketShare {
		g := make([]store.PacketShare, len(amounts))
		for i, a := range amounts {
			g[i] = store.PacketShare{Share: i, UserID: fmt.Sprintf("u%d", i), Amount: a}
		}
		return g
	}
	for _, tc := range []struct {
		name string
		d    store.PacketDetail
		want int
	}{
		{"every share grabbed", store.PacketDetail{Count: 3, Distribution: split.TypeRandom, Grabs: grabs(10, 50, 40)}, 1},
		{"a tie goes to the earliest grab", store.PacketDetail{Count: 4, Distribution: split.TypeRandom, Grabs: grabs(30, 35, 35, 0)}, 1},
		{"a tie on the first share", store.PacketDetail{Count: 3, Distribution: split.TypeRandom, Grabs: grabs(40, 20, 40)}, 0},
		{"live: a larger share may come", store.PacketDetail{Count: 3, Distribution: split.TypeRandom, Grabs: grabs(10, 50)}, -1},
		{"expired with shares left", store.PacketDetail{Count: 5, Expired: true, Distribution: split.TypeRandom, Grabs: grabs(10, 50)}, 1},
		{"expired with one grab", store.PacketDetail{Count: 5, Expired: true, Distribution: split.TypeRandom, Grabs: grabs(10)}, -1},
		{"expired with none", store.PacketDetail{Count: 5, Expired: true, Distribution: split.TypeRandom}, -1},
		{"fixed shares are equal", store.PacketDetail{Count: 2, Distribution: split.TypeFixed, Grabs: grabs(50, 50)}, -1},
		{"line cut", store.PacketDetail{Count: 2, Distribution: split.TypeLineCut, Grabs: grabs(20, 80)}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := BestLuck(tc.d); got != tc.want {
				t.Fatalf("best luck %d, want %d", got, tc.want)
			}
			v := NewPacketDetailView(tc.d, time.Now())
			marked := -1
			for i, g := range v.Grabs {
				if g.BestLuck {
					if marked >= 0 {
						t.Fatalf("shares %d and %d both marked", marked, i)
					}
					marked = i
				}
			}
			if marked != tc.want {
				t.Fatalf("the view marks %d, want %d", marked, tc.want)
			}
		})
	}
}

// Over HTTP on a real redis-server: a random packet's detail marks no best luck
// while a share is left, marks the largest share once every share is grabbed (the
// earliest of equal ones), and a packet that expired with two grabs marks the
// larger of them.
func TestPacketDetailMarksTheBestLuck(t *testing.T) {
	h := newPacketHarness(t, 100_000, 1)
	marked := func(v PacketDetailView) (int, int64) {
		n, at, best := 0, -1, int64(-1)
		for i, g := range v.Grabs {
			best = max(best, g.Amount)
			if g.BestLuck {
				n++
				at = i
			}
		}
		if n > 1 {
			t.Fatalf("%d shares of %s marked", n, v.ID)
		}
		return at, best
	}

	if a := h.create(`{"id":"lucky-1","sender":"m","totalAmount":1000,"count":5,"distribution":"Random"}`); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	for i := range 4 {
		if a := h.grab("lucky-1", fmt.Sprintf("member-%d", i), nil); a.str("outcome") != "granted" {
			t.Fatalf("grab: %s", a.Raw)
		}
	}
	if at, _ := marked(h.detail("lucky-1")); at != -1 {
		t.Fatalf("share %d marked while one share is left", at)
	}
	if a := h.grab("lucky-1", "member-4", nil); a.str("outcome") != "granted" {
		t.Fatalf("grab: %s", a.Raw)
	}
	v := h.detail("lucky-1")
	at, best := marked(v)
	if at < 0 || v.Grabs[at].Amount != best {
		t.Fatalf("every share grabbed: share %d marked, the largest is %d: %+v", at, best, v.Grabs)
	}
	for i := range at {
		if v.Grabs[i].Amount == best {
			t.Fatalf("share %d marked, the earlier share %d is as large", at, i)
		}
	}

	if a := h.create(`{"id":"lucky-2","sender":"m","totalAmount":900,"count":4,"distribution":"Random","ttlSeconds":1}`); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	for i := range 2 {
		if a := h.grab("lucky-2", fmt.Sprintf("member-%d", i), nil); a.str("outcome") != "granted" {
			t.Fatalf("grab: %s", a.Raw)
		}
	}
	time.Sleep(1100 * time.Millisecond)
	if n, _, err := h.handle.ExpireDue(context.Background(), 0, 10); err != nil || n != 1 {
		t.Fatalf("expiry: %d, %v", n, err)
	}
	v = h.detail("lucky-2")
	if at, best = marked(v); !v.Expired || at < 0 || v.Grabs[at].Amount != best {
		t.Fatalf("expired with two grabs: share %d marked (expired %v): %+v", at, v.Expired, v.Grabs)
	}
}

// A packet's lifecycle over HTTP on a real redis-server: live, exhausted (with the
// last grab's time), expired once its time is up (the refund amount known, no grab
// granted), refunding once the operator's expiry moved the remainder, refunded once
// settlement forgot it after the balance system's acknowledgement (with the time).
// The live list carries the state too.
func TestPacketLifecycleStates(t *testing.T) {
	h := newPacketHarness(t, 100_000, 1)
	ctx := context.Background()
	if a := h.create(`{"id":"short","sender":"m","totalAmount":300,"count":3,"ttlSeconds":1}`); a.Status != http.StatusCreated || a.str("state") != "live" {
		t.Fatalf("create: %d %s, want 201 with state live", a.Status, a.Raw)
	}
	if a := h.create(`{"id":"gone","sender":"m","totalAmount":200,"count":2}`); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	first := h.grab("short", "u-1", nil)
	for _, u := range []string{"u-1", "u-2"} {
		if a := h.grab("gone", u, nil); a.str("outcome") != "granted" {
			t.Fatalf("grab: %s", a.Raw)
		}
	}
	if v := h.detail("short"); v.State != "live" || v.RefundAmount != nil || v.ExhaustedAt != "" {
		t.Fatalf("short with shares and time left: %+v", v.PacketView)
	}
	v := h.detail("gone")
	if v.State != "exhausted" || v.ExhaustedAt == "" || v.ExhaustedAt != v.Grabs[1].At || v.RefundAmount != nil {
		t.Fatalf("gone with every share grabbed: %+v", v.PacketView)
	}
	list := h.do(http.MethodGet, "/v1/packets?limit=10", "", asSender)
	states := map[string]string{}
	for _, p := range list.Body["packets"].([]any) {
		m := p.(map[string]any)
		states[m["id"].(string)], _ = m["state"].(string)
	}
	if states["short"] != "live" || states["gone"] != "exhausted" {
		t.Fatalf("the live list's states: %v", states)
	}

	time.Sleep(1100 * time.Millisecond)
	left := 300 - first.num("amount")
	if v := h.detail("short"); v.State != "expired" || v.RefundAmount == nil || *v.RefundAmount != left || v.RefundedAt != "" {
		t.Fatalf("short after its time: %+v, want expired with %d to refund", v.PacketView, left)
	}
	if a := h.grab("short", "u-9", nil); a.str("outcome") != OutcomeExpired {
		t.Fatalf("a grab of an expired packet: %s", a.Raw)
	}
	if n, refunded, err := h.handle.ExpireDue(ctx, 0, 10); err != nil || n != 1 || refunded != left {
		t.Fatalf("expiry: %d packets, %d refunded, %v", n, refunded, err)
	}
	if v := h.detail("short"); v.State != "refunding" || v.RefundAmount == nil || *v.RefundAmount != left || !v.Expired {
		t.Fatalf("short after the expiry: %+v, want refunding %d", v.PacketView, left)
	}
	before := time.Now().Add(-time.Second)
	if errs := h.handle.ForgetPackets(ctx, []string{"short"}, time.Hour); errs[0] != nil {
		t.Fatal(errs[0])
	}
	v = h.detail("short")
	at, err := time.Parse(time.RFC3339, v.RefundedAt)
	if v.State != "refunded" || v.RefundAmount == nil || *v.RefundAmount != left || err != nil || at.Before(before) || !v.Forgotten {
		t.Fatalf("short after its refund settled: %+v (%v)", v.PacketView, err)
	}
	if v := h.detail("gone"); v.State != "exhausted" {
		t.Fatalf("gone after the expiry of another packet: %+v", v.PacketView)
	}
}

// detail is GET /v1/packets/{id}, which must answer 200.
func (h *packetHarness) detail(id string) PacketDetailView {
	h.t.Helper()
	a := h.do(http.MethodGet, "/v1/packets/"+id, "", nil)
	var v PacketDetailView
	if a.Status != http.StatusOK || json.Unmarshal([]byte(a.Raw), &v) != nil {
		h.t.Fatalf("detail of %s: %d %s", id, a.Status, a.Raw)
	}
	return v
}
