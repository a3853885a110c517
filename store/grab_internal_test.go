package store

import (
	"strings"
	"testing"
)

// The grab script's replies as store.GrabAbove reads them, and the replies it refuses.
func TestDecodeGrab(t *testing.T) {
	good := []struct {
		reply any
		want  GrabResult
	}{
		{"17:250@2:400:0:CNY", GrabResult{Outcome: Granted, PacketID: "17", Amount: 250, Seen: Watermark{ClaimedCount: 3}}},
		{"17:250@2:400:2:", GrabResult{Outcome: Granted, PacketID: "17", Amount: 250, Seen: Watermark{Epoch: 2, ClaimedCount: 3}}},
		{"17:250@0:0:0:HK:D", GrabResult{Outcome: Granted, PacketID: "17", Amount: 250, Seen: Watermark{ClaimedCount: 1}}},
		{"9:999999999999999@9999999:999999999999999:0:USD", GrabResult{Outcome: Granted, PacketID: "9", Amount: 999999999999999, Seen: Watermark{ClaimedCount: 10000000}}},
		{[]any{"already_claimed", "17:250:1796100000000-3"}, GrabResult{Outcome: AlreadyClaimed, PacketID: "17", Amount: 250}},
		{[]any{"sold_out"}, GrabResult{Outcome: SoldOut}},
		{[]any{"fenced"}, GrabResult{Outcome: Fenced}},
	}
	for _, tc := range good {
		got, err := decodeGrab(tc.reply)
		if err != nil || got != tc.want {
			t.Errorf("decodeGrab(%v) = %+v, %v; want %+v", tc.reply, got, err, tc.want)
		}
	}
	bad := []struct {
		reply any
		why   string
	}{
		{"17:250:3:0:CNY", "no '@'"},
		{"17:250@2:400:0", "too few fields"},
		{":250@2:400:0:CNY", "no packet id"},
		{"17@2:400:0:CNY", "no packet id"},
		{"17:-1@2:400:0:CNY", "not a non-negative integer"},
		{"17:250@x:400:0:CNY", "not a non-negative integer"},
		{"17:250@2:400:1.5:CNY", "not a non-negative integer"},
		{[]any{"granted", "17:250", int64(3), int64(0)}, "a grant answered as a list"},
		{[]any{"already_claimed", "17:250"}, "is not <packetId>:<amount>:<entryId>"},
		{[]any{"already_claimed"}, "want 2"},
		{[]any{"sold_out", "x"}, "want 1"},
		{[]any{}, "neither"},
		{int64(1), "neither"},
		{[]any{int64(1)}, "not a string"},
	}
	for _, tc := range bad {
		if got, err := decodeGrab(tc.reply); err == nil || !strings.Contains(err.Error(), tc.why) {
			t.Errorf("decodeGrab(%v) = %+v, %v; want an error with %q", tc.reply, got, err, tc.why)
		}
	}
}

// Reading a grant runs once per grant on the claim path: it allocates nothing.
func TestDecodeGrantAllocatesNothing(t *testing.T) {
	reply := any("17:250@2:400:0:CNY")
	if n := testing.AllocsPerRun(1000, func() {
		if _, err := decodeGrab(reply); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Errorf("decodeGrab of a grant: %v allocations, want 0", n)
	}
}
