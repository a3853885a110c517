package store

import (
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// Entries as go-redis hands them over: values that are not strings make a known
// field malformed and are kept as text; an entry deleted from the stream (no values)
// is malformed.
func TestDecodeMessages(t *testing.T) {
	good := map[string]any{"kind": "grant", "packet": "7", "user": "alice", "amount": "123", "at": "1"}
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
