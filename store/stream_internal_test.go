package store

import (
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Entries as go-redis hands them over: values that are not strings make a known
// field malformed and are kept as text; an entry deleted from the stream (no values)
// is malformed.
func TestDecodeMessages(t *testing.T) {
	good := map[string]any{"kind": "refund", "packet": "refund", "user": "alice", "amount": "123", "at": "1"}
	withValue := func(name string, v any) map[string]any {
		m := map[string]any{}
		for k, x := range good {
			m[k] = x
		}
		m[name] = v
		return m
	}
	got := decodeMessages([]redis.XMessage{
		{ID: "1-0", Values: good},
		{ID: "2-0", Values: withValue("amount", int64(123))},
		{ID: "3-0", Values: withValue("note", int64(1))},
		{ID: "4-0"},
	})
	if len(got) != 4 {
		t.Fatalf("%d entries, want 4", len(got))
	}
	if e := got[0]; e.ID != "1-0" || e.Malformed != nil || e.Amount != 123 || e.Fields["user"] != "alice" {
		t.Errorf("good entry %+v", e)
	}
	if e := got[1]; e.ID != "2-0" || e.Malformed == nil || !strings.Contains(e.Malformed.Error(), `field "amount" is int64`) ||
		e.Fields["amount"] != "123" || e.Amount != 0 {
		t.Errorf("entry with a numeric amount %+v", e)
	}
	if e := got[2]; e.Malformed != nil || e.Fields["note"] != "1" {
		t.Errorf("entry with an unknown numeric field %+v", e)
	}
	if e := got[3]; e.ID != "4-0" || e.Malformed == nil || len(e.Fields) != 0 {
		t.Errorf("deleted entry %+v", e)
	}
	if decodeMessages(nil) != nil {
		t.Error("no messages gave entries")
	}
}

func TestCompareStreamIDs(t *testing.T) {
	for _, tc := range []struct {
		x, y string
		want int
	}{
		{"1-0", "1-0", 0},
		{"1-0", "1-1", -1},
		{"2-0", "10-0", -1}, // numerically, not as strings
		{"10-5", "9-99", 1},
		{"5", "5-0", 0},
		{"5-1", "5", 1},
		{"x", "y", -1},
	} {
		if got := compareStreamIDs(tc.x, tc.y); got != tc.want {
			t.Errorf("compareStreamIDs(%q, %q) = %d, want %d", tc.x, tc.y, got, tc.want)
		}
	}
}

// A settlement stream entry decodes to its typed fields; an entry that is not a
// grant or a refund says why and keeps its id and raw fields, so it can be parked
// as it was.
func TestDecodeStreamEntry(t *testing.T) {
	good := func() map[string]string {
		return map[string]string{"kind": "refund", "packet": "refund", "user": "merchant-001", "amount": "123", "at": "1767225600123"}
	}
	with := func(name, value string) map[string]string {
		f := good()
		f[name] = value
		return f
	}
	without := func(name string) map[string]string {
		f := good()
		delete(f, name)
		return f
	}
	at := time.Date(2026, 1, 1, 0, 0, 0, 123e6, time.UTC)
	cases := []struct {
		name   string
		fields map[string]string
		want   StreamEntry // ID and Fields are checked separately
		bad    string      // part of the Malformed error; "" for a good entry
	}{
		{"refund", good(), StreamEntry{Kind: KindRefund, PacketID: RefundPacketID, UserID: "merchant-001", Amount: 123, At: at}, ""},
		{"refund at the epoch", with("at", "0"),
			StreamEntry{Kind: KindRefund, PacketID: RefundPacketID, UserID: "merchant-001", Amount: 123, At: time.UnixMilli(0).UTC()}, ""},
		{"zero amount", with("amount", "0"), StreamEntry{Kind: KindRefund, PacketID: RefundPacketID, UserID: "merchant-001", At: at}, ""},
		{"unknown fields are ignored", with("entry", "1-1"), StreamEntry{Kind: KindRefund, PacketID: RefundPacketID, UserID: "merchant-001", Amount: 123, At: at}, ""},
		{"huge amount", with("amount", "9007199254740993"),
			StreamEntry{Kind: KindRefund, PacketID: RefundPacketID, UserID: "merchant-001", Amount: 9007199254740993, At: at}, ""},

		{"no fields", nil, StreamEntry{}, `field "kind" missing`},
		{"unknown kind", with("kind", "gift"), StreamEntry{}, `unknown kind "gift"`},
		{"grant in fields, not packed", with("kind", "grant"), StreamEntry{}, "grants are packed"},
		{"no kind", without("kind"), StreamEntry{}, `field "kind" missing`},
		{"no packet", without("packet"), StreamEntry{}, `field "packet" missing`},
		{"no user", without("user"), StreamEntry{}, `field "user" missing`},
		{"no amount", without("amount"), StreamEntry{}, `field "amount" missing`},
		{"no at", without("at"), StreamEntry{}, `field "at" missing`},
		{"fractional amount", with("amount", "1.5"), StreamEntry{}, `amount "1.5" is not a non-negative integer`},
		{"negative amount", with("amount", "-1"), StreamEntry{}, `amount "-1" is not a non-negative integer`},
		{"amount beyond int64", with("amount", "9223372036854775808"), StreamEntry{}, "not a non-negative integer"},
		{"at not a number", with("at", "x"), StreamEntry{}, `at "x" is not unix milliseconds`},
		{"empty packet", with("packet", ""), StreamEntry{}, "empty packet or user"},
		{"empty user", with("user", ""), StreamEntry{}, "empty packet or user"},
		{"replayed without payload", map[string]string{"entry": "1-1"}, StreamEntry{}, `field "kind" missing`},

		// The packed grant grab.lua writes: its time is the entry id's.
		{"packed grant", map[string]string{"grant": "7:123:0:CNY:alice"},
			StreamEntry{Kind: KindGrant, PacketID: "7", UserID: "alice", Amount: 123, Currency: "CNY", At: at}, ""},
		{"packed grant, user id with colons", map[string]string{"grant": "7:123:0::a:b:"},
			StreamEntry{Kind: KindGrant, PacketID: "7", UserID: "a:b:", Amount: 123, At: at}, ""},
		{"packed grant, replayed with its time", map[string]string{"grant": "7:123:2:CNY:alice", "at": "0"},
			StreamEntry{Kind: KindGrant, PacketID: "7", UserID: "alice", Amount: 123, Currency: "CNY", At: time.UnixMilli(0).UTC()}, ""},
		{"packed grant, huge amount", map[string]string{"grant": "7:9007199254740993:0:CNY:alice"},
			StreamEntry{Kind: KindGrant, PacketID: "7", UserID: "alice", Amount: 9007199254740993, Currency: "CNY", At: at}, ""},
		{"packed grant without user", map[string]string{"grant": "7:123:0:alice"}, StreamEntry{}, "is not <packetId>:<amount>:<epoch>:<currency>:<userId>"},
		{"packed grant, bad amount", map[string]string{"grant": "7:-3:0:CNY:alice"}, StreamEntry{}, `amount "-3" is not a non-negative integer`},
		{"packed grant, empty packet", map[string]string{"grant": ":3:0:CNY:alice"}, StreamEntry{}, "empty packet or user"},
		{"packed grant, empty user", map[string]string{"grant": "7:3:0:CNY:"}, StreamEntry{}, "empty packet or user"},
		{"packed grant, bad at", map[string]string{"grant": "7:3:0:CNY:alice", "at": "soon"}, StreamEntry{}, `at "soon" is not unix milliseconds`},
		{"packed grant, bad epoch", map[string]string{"grant": "7:3:x:CNY:alice"}, StreamEntry{}, `epoch "x" is not a non-negative integer`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := decodeStreamEntry("1767225600123-0", tc.fields)
			if e.ID != "1767225600123-0" || !maps.Equal(e.Fields, tc.fields) {
				t.Fatalf("id %q fields %v, want the entry's own", e.ID, e.Fields)
			}
			if tc.bad != "" {
				if e.Malformed == nil || !strings.Contains(e.Malformed.Error(), tc.bad) {
					t.Fatalf("malformed %v, want an error with %q", e.Malformed, tc.bad)
				}
				if e.Kind != "" || e.PacketID != "" || e.UserID != "" || e.Amount != 0 || !e.At.IsZero() {
					t.Fatalf("malformed entry carries decoded fields: %+v", e)
				}
				return
			}
			if e.Malformed != nil {
				t.Fatalf("malformed: %v", e.Malformed)
			}
			w := tc.want
			if e.Kind != w.Kind || e.PacketID != w.PacketID || e.UserID != w.UserID || e.Amount != w.Amount ||
				e.Currency != w.Currency || !e.At.Equal(w.At) {
				t.Fatalf("decoded %+v, want %+v", e, w)
			}
			if fv := e.FieldValues(); len(fv) != len(tc.fields) {
				t.Fatalf("field values %v, want %v", fv, tc.fields)
			}
		})
	}
}
