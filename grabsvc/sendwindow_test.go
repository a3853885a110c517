package grabsvc

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"redpacket.io/operator/store"
)

func TestSendWindowsAllows(t *testing.T) {
	shanghai, err := time.LoadLocation("Asia/Shanghai")
	if err != nil {
		t.Fatal(err)
	}
	newYork, err := time.LoadLocation("America/New_York")
	if err != nil {
		t.Fatal(err)
	}
	day := func(loc *time.Location, y int, m time.Month, d, h, min, s int) time.Time {
		return time.Date(y, m, d, h, min, s, 0, loc)
	}
	for _, tc := range []struct {
		name    string
		windows []string
		zone    string
		at      time.Time
		ok      bool
		opens   time.Time
	}{
		{"inside", []string{"08:00-24:00"}, "Asia/Shanghai", day(shanghai, 2026, 12, 4, 12, 0, 0), true, time.Time{}},
		{"the start is inside", []string{"08:00-24:00"}, "Asia/Shanghai", day(shanghai, 2026, 12, 4, 8, 0, 0), true, time.Time{}},
		{"a second before the start", []string{"08:00-24:00"}, "Asia/Shanghai", day(shanghai, 2026, 12, 4, 7, 59, 59), false, day(shanghai, 2026, 12, 4, 8, 0, 0)},
		{"the last second of the day", []string{"08:00-24:00"}, "Asia/Shanghai", day(shanghai, 2026, 12, 4, 23, 59, 59), true, time.Time{}},
		{"midnight is outside, the next window is today's", []string{"08:00-24:00"}, "Asia/Shanghai", day(shanghai, 2026, 12, 5, 0, 0, 0), false, day(shanghai, 2026, 12, 5, 8, 0, 0)},
		{"after the last window of the day", []string{"09:00-12:00", "14:00-18:00"}, "Asia/Shanghai", day(shanghai, 2026, 12, 4, 19, 0, 0), false, day(shanghai, 2026, 12, 5, 9, 0, 0)},
		{"between two windows", []string{"09:00-12:00", "14:00-18:00"}, "Asia/Shanghai", day(shanghai, 2026, 12, 4, 12, 0, 0), false, day(shanghai, 2026, 12, 4, 14, 0, 0)},
		{"windows in any order", []string{"14:00-18:00", "09:00-12:00"}, "Asia/Shanghai", day(shanghai, 2026, 12, 4, 6, 0, 0), false, day(shanghai, 2026, 12, 4, 9, 0, 0)},
		{"the zone decides, not UTC", []string{"08:00-24:00"}, "Asia/Shanghai", time.Date(2026, 12, 4, 23, 30, 0, 0, time.UTC), false, day(shanghai, 2026, 12, 5, 8, 0, 0)},
		{"a start skipped by daylight saving opens at the jump", []string{"02:30-04:00"}, "America/New_York", day(newYork, 2026, 3, 8, 1, 0, 0), false, day(newYork, 2026, 3, 8, 3, 0, 0)},
		{"the jump's instant is inside", []string{"02:30-04:00"}, "America/New_York", day(newYork, 2026, 3, 8, 3, 0, 0), true, time.Time{}},
		{"no windows", nil, "", time.Date(2026, 12, 4, 3, 0, 0, 0, time.UTC), true, time.Time{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, err := ParseSendWindows(tc.windows, tc.zone)
			if err != nil {
				t.Fatal(err)
			}
			ok, opens := w.Allows(tc.at)
			if ok != tc.ok || !ok && !opens.Equal(tc.opens) {
				t.Fatalf("at %s: %v, opens %s; want %v, %s", tc.at, ok, opens, tc.ok, tc.opens)
			}
		})
	}
	for _, bad := range [][]string{{"8:00-24:00"}, {"08:00-08:00"}, {"20:00-02:00"}, {"08:00-24:01"}, {"24:00-24:00"}, {"08:00"}, {"08:60-09:00"}} {
		if _, err := ParseSendWindows(bad, "UTC"); err == nil {
			t.Errorf("windows %q accepted", bad)
		}
	}
	if _, err := ParseSendWindows([]string{"08:00-24:00"}, "Mars/Olympus"); err == nil {
		t.Error("an unknown time zone accepted")
	}
}

// Across a day boundary in the window's time zone, on a real redis-server and a real
// packet server whose clock the test sets: 08:00-24:00 Asia/Shanghai. At 23:59:59
// a packet is created; at midnight a new one is refused 403 outside_send_window
// with Retry-After to 08:00 and nothing changes in Redis, while the merchant's
// retry of the packet created a second before answers 200 existing and another
// body under its id 409 conflict; at 07:59:59 still refused, at 08:00 created.
func TestSendWindowsAcrossMidnight(t *testing.T) {
	shanghai, err := time.LoadLocation("Asia/Shanghai")
	if err != nil {
		t.Fatal(err)
	}
	windows, err := ParseSendWindows([]string{"08:00-24:00"}, "Asia/Shanghai")
	if err != nil {
		t.Fatal(err)
	}
	var clock atomic.Int64
	set := func(h, m, s int, d int) { clock.Store(time.Date(2026, 12, 4+d, h, m, s, 0, shanghai).UnixNano()) }
	h := newPacketHarness(t, 100_000, 2, func(c *PacketConfig) {
		c.SendWindows = windows
		c.Now = func() time.Time { return time.Unix(0, clock.Load()) }
	})
	body := func(id string, total int) string {
		return fmt.Sprintf(`{"id":%q,"sender":"merchant-7","totalAmount":%d,"count":2}`, id, total)
	}
	set(23, 59, 59, 0)
	if a := h.create(body("order-late", 200)); a.Status != http.StatusCreated {
		t.Fatalf("23:59:59: %d %s, want 201", a.Status, a.Raw)
	}
	set(0, 0, 0, 1)
	before := h.dump()
	a := h.create(body("order-night", 200))
	if a.Status != http.StatusForbidden || a.str("error") != OutcomeOutsideSendWindow || a.Header.Get("Retry-After") != "28800" {
		t.Fatalf("00:00:00: %d %s, Retry-After %q; want 403 outside_send_window, Retry-After 28800", a.Status, a.Raw, a.Header.Get("Retry-After"))
	}
	if after := h.dump(); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Fatalf("a refused creation changed Redis")
	}
	if a := h.create(body("order-late", 200)); a.Status != http.StatusOK || a.str("outcome") != "existing" {
		t.Fatalf("the retry of the packet created at 23:59:59: %d %s, want 200 existing", a.Status, a.Raw)
	}
	if a := h.create(body("order-late", 300)); a.Status != http.StatusConflict {
		t.Fatalf("another body under that id at night: %d %s, want 409", a.Status, a.Raw)
	}
	set(7, 59, 59, 1)
	if a := h.create(body("order-night", 200)); a.Status != http.StatusForbidden || a.Header.Get("Retry-After") != "1" {
		t.Fatalf("07:59:59: %d %s, Retry-After %q", a.Status, a.Raw, a.Header.Get("Retry-After"))
	}
	set(8, 0, 0, 1)
	if a := h.create(body("order-night", 200)); a.Status != http.StatusCreated {
		t.Fatalf("08:00:00: %d %s, want 201", a.Status, a.Raw)
	}
	if snap := h.conserved(); snap.CreatedPackets != 2 {
		t.Fatalf("%d packets created, want 2", snap.CreatedPackets)
	}
}

// Windows the service could not read stop creations with 503 saying why, and
// leave grabs alone.
func TestUnreadableSendWindowsStopCreationsOnly(t *testing.T) {
	_, err := ParseSendWindows([]string{"08:00-24:00"}, "Mars/Olympus")
	if err == nil {
		t.Fatal("an unknown time zone accepted")
	}
	h := newPacketHarness(t, 100_000, 1, func(c *PacketConfig) { c.SendWindows = ClosedSendWindows(err) })
	// A packet sent before the windows became unreadable.
	if _, outcome, err := h.handle.CreatePacket(context.Background(), store.NewPacket{ID: "before", Sender: "m", Total: 200, Count: 2,
		Distribution: "Fixed"}); err != nil || outcome != store.CreateCreated {
		t.Fatalf("create: %s, %v", outcome, err)
	}
	a := h.create(`{"id":"order-1","sender":"m","totalAmount":200,"count":2}`)
	if a.Status != http.StatusServiceUnavailable || !strings.Contains(a.str("message"), "Mars/Olympus") {
		t.Fatalf("a creation with unreadable windows: %d %s, want 503 naming the zone", a.Status, a.Raw)
	}
	if snap := h.conserved(); snap.CreatedPackets != 1 {
		t.Fatalf("%d packets created, want the one sent before", snap.CreatedPackets)
	}
	if a := h.grab("before", "u-1", nil); a.str("outcome") != "granted" {
		t.Fatalf("a grab with unreadable windows: %d %s, want granted", a.Status, a.Raw)
	}
}
