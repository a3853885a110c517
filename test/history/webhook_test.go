package history

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"redpacket.io/operator/internal/rain"
)

// TestCreditLogCountsDeliveriesAndCredits delivers one grant three times and another
// once to the balance receiver through a CreditLog: the log must count every
// delivery and exactly one credit per key, and a handler that credits nothing must
// show deliveries without credits.
func TestCreditLogCountsDeliveriesAndCredits(t *testing.T) {
	receiver := rain.NewReceiver(nil)
	log := NewCreditLog(receiver, func(key string) bool { _, ok := receiver.Delivered(key); return ok })
	refusing := NewCreditLog(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "down", http.StatusServiceUnavailable)
	}), func(string) bool { return false })

	deliver := func(h http.Handler, packet, user string, amount int64) int {
		body, _ := json.Marshal(rain.Delivery{Kind: "grant", Source: "budget", Activity: "default/b", ActivityUID: "uid",
			PacketID: packet, UserID: user, Amount: amount, Currency: "CNY", At: "2026-01-01T00:00:00.000Z"})
		req := httptest.NewRequest(http.MethodPost, "/credit", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", "uid/"+packet)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code
	}
	for range 3 {
		if code := deliver(log, "p1/0", "alice", 7); code != http.StatusOK {
			t.Fatalf("delivery of p1/0 answered %d", code)
		}
	}
	if code := deliver(log, "p1/1", "bob", 5); code != http.StatusOK {
		t.Fatalf("delivery of p1/1 answered %d", code)
	}
	deliveries, credits := log.Counts()
	if deliveries["uid/p1/0"] != 3 || deliveries["uid/p1/1"] != 1 || len(deliveries) != 2 {
		t.Errorf("deliveries %v, want uid/p1/0 three times and uid/p1/1 once", deliveries)
	}
	if credits["uid/p1/0"] != 1 || credits["uid/p1/1"] != 1 || len(credits) != 2 {
		t.Errorf("credits %v, want each key once", credits)
	}

	deliver(refusing, "p2/0", "carol", 3)
	deliveries, credits = refusing.Counts()
	if deliveries["uid/p2/0"] != 1 || len(credits) != 0 {
		t.Errorf("a refused delivery: deliveries %v, credits %v; want one delivery, no credit", deliveries, credits)
	}
}
