package grabsvc

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
)

// GET /v1/packets lists the live packets, soonest expiry first, for the sender
// credential only: without it 401, a bad limit 400, and a packet grabbed to its end
// is still listed until it expires (its money is claimed, not yet refunded).
func TestListLivePackets(t *testing.T) {
	h := newPacketHarness(t, 1_000_000, 4)
	for i, ttl := range []int{600, 60, 300} {
		a := h.create(fmt.Sprintf(`{"id":"order-%d","sender":"m","totalAmount":500,"count":5,"distribution":"Fixed","ttlSeconds":%d}`, i, ttl))
		if a.Status != http.StatusCreated {
			t.Fatalf("create order-%d: %d %s", i, a.Status, a.Raw)
		}
	}
	if a := h.grab("order-1", "alice", nil); a.Status != http.StatusOK {
		t.Fatalf("grab: %d %s", a.Status, a.Raw)
	}
	if a := h.do(http.MethodGet, "/v1/packets", "", nil); a.Status != http.StatusUnauthorized {
		t.Fatalf("a listing without the sender credential: %d %s", a.Status, a.Raw)
	}
	for _, limit := range []string{"0", "101", "x"} {
		if a := h.do(http.MethodGet, "/v1/packets?limit="+limit, "", asSender); a.Status != http.StatusBadRequest {
			t.Errorf("limit=%s: %d %s", limit, a.Status, a.Raw)
		}
	}
	a := h.do(http.MethodGet, "/v1/packets?limit=2", "", asSender)
	if a.Status != http.StatusOK {
		t.Fatalf("list: %d %s", a.Status, a.Raw)
	}
	var list struct {
		Packets []PacketView `json:"packets"`
	}
	if err := json.Unmarshal([]byte(a.Raw), &list); err != nil {
		t.Fatal(err)
	}
	if len(list.Packets) != 2 || list.Packets[0].ID != "order-1" || list.Packets[1].ID != "order-2" {
		t.Fatalf("the two soonest live packets: %s", a.Raw)
	}
	if p := list.Packets[0]; p.RemainingCount != 4 || p.RemainingAmount != 400 || p.TotalAmount != 500 {
		t.Errorf("order-1 as listed: %+v", p)
	}
}
