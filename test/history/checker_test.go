package history

import (
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// op builds an operation of activity "A"; ret < 0 means an unknown outcome, returned
// at the end of the history.
func op(client int, in Input, out Output, call, ret int64) porcupine.Operation {
	in.Activity = "A"
	if ret < 0 {
		out, ret = Output{Unknown: true}, 1<<40
	}
	return porcupine.Operation{ClientId: client, Input: in, Output: out, Call: call, Return: ret}
}

func grabOp(client int, user string, outcome store.Outcome, packet string, call, ret int64) porcupine.Operation {
	return op(client, Input{Op: OpGrab, User: user}, Output{Outcome: outcome, Packet: packet}, call, ret)
}

func openOp(call, ret int64) porcupine.Operation {
	return op(9, Input{Op: OpOpen}, Output{State: string(store.StateOpen)}, call, ret)
}

// The window of the time-gate cases, in Redis clock milliseconds: grabs are served
// from windowStart to just before windowEnd.
const windowStart, windowEnd = 1000, 2000

// openWindowOp opens activity "A" with the window.
func openWindowOp(call, ret int64) porcupine.Operation {
	return op(9, Input{Op: OpOpen, StartMs: windowStart, EndMs: windowEnd}, Output{State: string(store.StateOpen)}, call, ret)
}

// timedGrabOp is a grab whose script ran while the Redis clock read between lo and
// hi (hi 0: unknown outcome, no upper bound); ret < 0 means an unknown outcome.
func timedGrabOp(client int, user string, outcome store.Outcome, packet string, call, ret, lo, hi int64) porcupine.Operation {
	return op(client, Input{Op: OpGrab, User: user, NotBeforeMs: lo, NotAfterMs: hi}, Output{Outcome: outcome, Packet: packet}, call, ret)
}

// TestCheckerCatchesViolations feeds the checker hand-made histories: each broken
// one must be reported non-linearizable, each sound one accepted.
func TestCheckerCatchesViolations(t *testing.T) {
	cases := []struct {
		name  string
		count int
		ops   []porcupine.Operation
		ok    bool
	}{
		{"double grant: two users get packet 1", 3, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", store.Granted, "1", 2, 3),
			grabOp(1, "u2", store.Granted, "1", 2, 4),
		}, false},
		{"double grant of one user: two packets", 3, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", store.Granted, "1", 2, 3),
			grabOp(1, "u1", store.Granted, "2", 4, 5),
		}, false},
		{"lost grant: a later already_claimed names another packet", 3, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", store.Granted, "1", 2, 3),
			grabOp(1, "u2", store.Granted, "2", 2, 3),
			grabOp(0, "u1", store.AlreadyClaimed, "2", 4, 5),
		}, false},
		{"lost grant: sold_out while an acknowledged count leaves a packet", 2, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", store.Granted, "1", 2, 3),
			grabOp(1, "u2", store.SoldOut, "", 4, 5),
		}, false},
		{"lost grant: a granted user is answered sold_out", 1, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", store.Granted, "1", 2, 3),
			grabOp(0, "u1", store.SoldOut, "", 4, 5),
		}, false},
		{"stale read: not_started after a completed open", 3, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", store.NotStarted, "", 2, 3),
		}, false},
		{"stale read: paused after a completed resume", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpPause}, Output{State: "open"}, 2, 3),
			grabOp(0, "u1", store.Paused, "", 4, 5),
			op(9, Input{Op: OpResume}, Output{State: "open"}, 6, 7),
			grabOp(1, "u2", store.Paused, "", 8, 9),
		}, false},
		{"granted after a completed close", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpCloseExpired}, Output{State: "closed", Reason: store.CloseExpired}, 2, 3),
			grabOp(0, "u1", store.Granted, "1", 4, 5),
		}, false},
		{"a close cut half-way: grabs end while configure still answers open, until a close finishes it", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpPause}, Output{State: "open"}, 2, 3),
			op(9, Input{Op: OpCloseExpired}, Output{Unknown: true}, 4, 1000),
			grabOp(0, "u1", store.Ended, "", 5, 6),
			op(9, Input{Op: OpResume}, Output{State: "open"}, 7, 8),
			op(9, Input{Op: OpCloseExpired}, Output{State: "closed", Reason: store.CloseExpired}, 9, 10),
			grabOp(1, "u2", store.Ended, "", 11, 12),
		}, true},
		{"a completed close is never answered open", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpCloseExpired}, Output{State: "closed", Reason: store.CloseExpired}, 2, 3),
			op(9, Input{Op: OpResume}, Output{State: "open"}, 4, 5),
		}, false},
		{"a close cut half-way and finished is never answered open again", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpCloseExpired}, Output{Unknown: true}, 2, 1000),
			op(9, Input{Op: OpCloseExpired}, Output{State: "closed", Reason: store.CloseExpired}, 3, 4),
			op(9, Input{Op: OpResume}, Output{State: "open"}, 5, 6),
		}, false},
		{"an unknown outcome does not excuse a double grant", 3, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", store.Granted, "1", 2, 3),
			grabOp(1, "u3", "", "", 2, -1),
			grabOp(2, "u2", store.Granted, "1", 4, 5),
		}, false},
		{"valid: unknown grab that took effect, then its retry", 2, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", "", "", 2, -1),
			grabOp(1, "u2", store.Granted, "2", 3, 4),
			grabOp(0, "u1", store.AlreadyClaimed, "1", 5, 6),
			grabOp(2, "u3", store.SoldOut, "", 7, 8),
			op(9, Input{Op: OpCloseExpired}, Output{State: "closed", Reason: store.CloseExpired}, 9, 10),
			grabOp(2, "u3", store.Ended, "", 11, 12),
			grabOp(0, "u1", store.AlreadyClaimed, "1", 11, 12),
		}, true},
		{"valid: unknown grab that never took effect", 2, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", "", "", 2, -1),
			grabOp(1, "u2", store.Granted, "1", 3, 4),
			grabOp(2, "u3", store.Granted, "2", 5, 6),
			grabOp(2, "u4", store.SoldOut, "", 7, 8),
		}, true},
		{"valid: an unknown grab resolved to the packet its user holds at the end", 2, []porcupine.Operation{
			openOp(0, 1),
			op(0, Input{Op: OpGrab, User: "u1"}, Output{Unknown: true, Packet: "1"}, 2, 1<<40),
			grabOp(1, "u2", store.Granted, "2", 3, 4),
			grabOp(2, "u3", store.SoldOut, "", 5, 6),
		}, true},
		{"valid: of two hinted unknown grabs, one ran paused and the other took the packet", 2, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpPause}, Output{State: "open"}, 2, 3),
			op(0, Input{Op: OpGrab, User: "u1"}, Output{Unknown: true, Packet: "1"}, 4, 1<<40),
			op(9, Input{Op: OpResume}, Output{State: "open"}, 5, 6),
			op(0, Input{Op: OpGrab, User: "u1"}, Output{Unknown: true, Packet: "1"}, 7, 1<<40),
			grabOp(1, "u2", store.Granted, "2", 8, 9),
			grabOp(2, "u3", store.SoldOut, "", 10, 11),
		}, true},
		{"valid: a hinted unknown grab returning with its user's first already_claimed", 2, []porcupine.Operation{
			openOp(0, 1),
			op(0, Input{Op: OpGrab, User: "u1"}, Output{Unknown: true, Packet: "1"}, 2, 6),
			grabOp(1, "u2", store.Granted, "2", 3, 4),
			grabOp(0, "u1", store.AlreadyClaimed, "1", 5, 6),
			grabOp(2, "u3", store.SoldOut, "", 7, 8),
		}, true},
		{"a hinted unknown grab cannot take its packet after the activity sold out", 1, []porcupine.Operation{
			openOp(0, 1),
			grabOp(1, "u2", store.Granted, "1", 2, 3),
			op(0, Input{Op: OpGrab, User: "u1"}, Output{Unknown: true, Packet: "1"}, 4, 1<<40),
		}, false},
		{"a resolved unknown grab cannot share its packet", 2, []porcupine.Operation{
			openOp(0, 1),
			op(0, Input{Op: OpGrab, User: "u1"}, Output{Unknown: true, Packet: "1"}, 2, 1<<40),
			grabOp(1, "u2", store.Granted, "1", 3, 4),
			grabOp(0, "u1", store.AlreadyClaimed, "1", 5, 6),
		}, false},
		{"valid: concurrent pause and grabs, close exhausted", 2, []porcupine.Operation{
			grabOp(0, "u1", store.NotStarted, "", 0, 2),
			openOp(1, 3),
			op(9, Input{Op: OpPause}, Output{State: "open"}, 4, 10),
			grabOp(0, "u1", store.Granted, "2", 5, 6), // packet ids need not come in order
			grabOp(1, "u2", store.Paused, "", 5, 11),
			op(9, Input{Op: OpResume}, Output{State: "open"}, 12, 13),
			op(9, Input{Op: OpCloseExhausted}, Output{State: "open"}, 14, 15),
			grabOp(1, "u2", store.Granted, "1", 16, 17),
			op(9, Input{Op: OpCloseExhausted}, Output{State: "closed", Reason: store.CloseExhausted}, 18, 19),
			grabOp(1, "u3", store.SoldOut, "", 20, 21),
		}, true},
		{"a fenced activity: configure answered fenced", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpPause}, Output{State: string(store.Fenced)}, 2, 3),
		}, false},
		{"a fenced activity: close answered fenced", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpCloseExpired}, Output{State: string(store.CloseFenced)}, 2, 3),
		}, false},
		// Spec edits of the real controller (operator_test.go): an edit superseded
		// before the controller reported it is an unknown outcome bounded by the
		// later edit's report.
		{"a bounded unknown pause cannot take effect after its return", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpPause}, Output{Unknown: true, Bounded: true}, 2, 3),
			grabOp(0, "u1", store.Granted, "1", 4, 5),
		}, false},
		{"valid: an unbounded unknown pause may never take effect", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpPause}, Output{Unknown: true}, 2, 1<<40),
			grabOp(0, "u1", store.Granted, "1", 4, 5),
		}, true},
		{"valid: a superseded pause placed before the resume that superseded it", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpPause}, Output{Unknown: true, Bounded: true}, 2, 6),
			op(9, Input{Op: OpResume}, Output{State: "open"}, 3, 6),
			grabOp(0, "u1", store.Granted, "1", 7, 8),
		}, true},
		{"valid: a pause the controller reported closed, paused answers before its own close", 1, []porcupine.Operation{
			op(8, Input{Op: OpCloseExhausted}, Output{State: "closed", Reason: store.CloseExhausted}, 0, 20),
			openOp(0, 1),
			grabOp(0, "u1", store.Granted, "1", 2, 3),
			grabOp(1, "u2", store.SoldOut, "", 4, 5),
			op(9, Input{Op: OpPause}, Output{Unknown: true, Bounded: true}, 6, 20),
			grabOp(1, "u3", store.Paused, "", 8, 9),
			grabOp(1, "u3", store.SoldOut, "", 21, 22),
		}, true},
		{"the controller's close-exhausted cannot close with a packet left", 2, []porcupine.Operation{
			op(8, Input{Op: OpCloseExhausted}, Output{State: "closed", Reason: store.CloseExhausted}, 0, 20),
			openOp(0, 1),
			grabOp(0, "u1", store.Granted, "1", 2, 3),
			grabOp(1, "u2", store.Ended, "", 21, 22),
		}, false},
		// The time gates: grab.lua reads the Redis clock, which the history bounds
		// per grab by the wall clock at its call and return.
		{"time gate: not_started after the window's start", 3, []porcupine.Operation{
			openWindowOp(0, 1),
			timedGrabOp(0, "u1", store.NotStarted, "", 2, 3, 1005, 1010),
		}, false},
		{"time gate: ended before the window's end", 3, []porcupine.Operation{
			openWindowOp(0, 1),
			timedGrabOp(0, "u1", store.Ended, "", 2, 3, 1500, 1990),
		}, false},
		{"time gate: granted before the window's start", 3, []porcupine.Operation{
			openWindowOp(0, 1),
			timedGrabOp(0, "u1", store.Granted, "1", 2, 3, 900, 999),
		}, false},
		{"time gate: granted at the window's end", 3, []porcupine.Operation{
			openWindowOp(0, 1),
			timedGrabOp(0, "u1", store.Granted, "1", 2, 3, 2000, 2001),
		}, false},
		{"time gate: sold_out after the window's end (ended comes first)", 1, []porcupine.Operation{
			openWindowOp(0, 1),
			timedGrabOp(0, "u1", store.Granted, "1", 2, 3, 1100, 1101),
			timedGrabOp(1, "u2", store.SoldOut, "", 4, 5, 2100, 2101),
		}, false},
		{"time gate: an unknown grab called after the end cannot explain a claim", 3, []porcupine.Operation{
			openWindowOp(0, 1),
			timedGrabOp(0, "u1", "", "", 2, -1, 2050, 0),
			timedGrabOp(1, "u1", store.AlreadyClaimed, "1", 4, 5, 2060, 2070),
		}, false},
		{"time gate: the window a configure wrote is the one checked", 3, []porcupine.Operation{
			openWindowOp(0, 1),
			op(9, Input{Op: OpPause, StartMs: windowStart, EndMs: 3000}, Output{State: "open"}, 2, 3),
			op(9, Input{Op: OpResume, StartMs: windowStart, EndMs: 3000}, Output{State: "open"}, 4, 5),
			timedGrabOp(0, "u1", store.Ended, "", 6, 7, 2500, 2501), // the end moved to 3000
		}, false},
		{"valid: grabs around the window's gates", 3, []porcupine.Operation{
			timedGrabOp(0, "u0", store.NotStarted, "", 0, 1, 800, 801), // before the open
			openWindowOp(2, 3),
			timedGrabOp(0, "u1", store.NotStarted, "", 4, 5, 998, 1002), // straddles the start
			timedGrabOp(1, "u2", store.Granted, "1", 4, 5, 998, 1002),
			timedGrabOp(2, "u3", "", "", 6, -1, 1500, 0),               // unknown: took packet 2
			timedGrabOp(0, "u4", store.Granted, "3", 7, 8, 1990, 2003), // straddles the end
			timedGrabOp(1, "u5", store.Ended, "", 7, 8, 1990, 2003),
			timedGrabOp(2, "u3", store.AlreadyClaimed, "2", 9, 10, 2010, 2011),
			timedGrabOp(0, "u6", store.Ended, "", 9, 10, 2010, 2011),
			op(9, Input{Op: OpCloseExpired}, Output{State: "closed", Reason: store.CloseExpired}, 11, 12),
			timedGrabOp(0, "u6", store.Ended, "", 13, 14, 2100, 2101),
		}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			res, _ := porcupine.CheckOperationsVerbose(Model(map[string]int{"A": c.count}), c.ops, 10*time.Second)
			want := porcupine.Illegal
			if c.ok {
				want = porcupine.Ok
			}
			if res != want {
				t.Errorf("checker says %s, want %s", res, want)
			}
		})
	}
}

// TestResolve drops the unknown grabs that changed nothing, turns the one unknown
// grab of a user into the grant the final read shows, hints the others (returning
// with the user's first already_claimed when there is one), and finds phantom claims.
func TestResolve(t *testing.T) {
	h := []porcupine.Operation{
		op(0, Input{Op: OpGrab, User: "u1"}, Output{}, 0, -1), // holds nothing: dropped
		op(1, Input{Op: OpGrab, User: "u2"}, Output{}, 0, -1), // the one grab of u2: granted 7
		op(2, Input{Op: OpGrab, User: "u3"}, Output{}, 0, -1), // two of u3: hinted 8
		op(2, Input{Op: OpGrab, User: "u3"}, Output{}, 2, -1),
		grabOp(3, "u4", store.Granted, "9", 0, 1),
		op(3, Input{Op: OpGrab, User: "u4"}, Output{}, 2, -1), // u4 was answered granted: dropped
		grabOp(4, "u5", store.Paused, "", 0, 1),               // u5 holds 6, never given: phantom
		op(5, Input{Op: OpGrab, User: "u6"}, Output{}, 3, -1), // hinted 5, returns at 6
		grabOp(6, "u6", store.AlreadyClaimed, "5", 5, 6),
		grabOp(6, "u6", store.AlreadyClaimed, "5", 8, 9),
		op(5, Input{Op: OpGrab, User: "u6"}, Output{}, 7, -1), // called after u6 held 5: dropped
	}
	got, dropped, phantoms := Resolve(h, map[string]map[string]string{"A": {"u2": "7", "u3": "8", "u4": "9", "u5": "6", "u6": "5"}})
	if dropped != 3 || len(got) != 8 || len(phantoms) != 1 || phantoms[0] != "A/u5" {
		t.Fatalf("Resolve: dropped %d, phantoms %v, got %+v", dropped, phantoms, got)
	}
	if o := got[0].Output.(Output); o.Unknown || !o.Resolved || o.Outcome != store.Granted || o.Packet != "7" {
		t.Errorf("u2's grab resolved to %+v", o)
	}
	if o := got[1].Output.(Output); !o.Unknown || o.Packet != "8" || got[1].Return != 1<<40 {
		t.Errorf("u3's grab resolved to %+v returning at %d", o, got[1].Return)
	}
	if o := got[5].Output.(Output); !o.Unknown || o.Packet != "5" || got[5].Return != 6 {
		t.Errorf("u6's first grab resolved to %+v returning at %d, want hinted 5 returning at 6", o, got[5].Return)
	}
}

// TestEditOutput maps the phase the controller reports for a spec edit to the
// model's output, and finds the phases that contradict the edit.
func TestEditOutput(t *testing.T) {
	cases := []struct {
		op    Op
		phase redpacketv1alpha1.Phase
		out   Output
		ok    bool
	}{
		{OpOpen, redpacketv1alpha1.PhaseActive, Output{State: "open"}, true},
		{OpOpen, redpacketv1alpha1.PhaseScheduled, Output{State: "open"}, true},
		{OpOpen, redpacketv1alpha1.PhasePaused, Output{State: "open"}, false},
		{OpPause, redpacketv1alpha1.PhasePaused, Output{State: "open"}, true},
		{OpPause, redpacketv1alpha1.PhaseActive, Output{State: "open"}, false},
		{OpResume, redpacketv1alpha1.PhaseActive, Output{State: "open"}, true},
		{OpResume, redpacketv1alpha1.PhasePaused, Output{State: "open"}, false},
		{OpPause, redpacketv1alpha1.PhaseExhausted, Output{Unknown: true, Bounded: true}, true},
		{OpResume, redpacketv1alpha1.PhaseExpired, Output{Unknown: true, Bounded: true}, true},
		{OpCloseExpired, redpacketv1alpha1.PhaseExpired, Output{State: "closed", Reason: store.CloseExpired}, true},
		{OpCloseExpired, redpacketv1alpha1.PhaseExhausted, Output{State: "closed", Reason: store.CloseExhausted}, true},
		{OpCloseExpired, redpacketv1alpha1.PhaseActive, Output{State: "open"}, false},
		{OpResume, redpacketv1alpha1.PhaseFailed, Output{State: "phase Failed"}, false},
		{OpOpen, redpacketv1alpha1.PhaseSeeding, Output{State: "phase Seeding"}, false},
	}
	for _, c := range cases {
		out, ok := editOutput(c.op, c.phase)
		if out != c.out || ok != c.ok {
			t.Errorf("editOutput(%s, %s) = %+v, %t; want %+v, %t", c.op, c.phase, out, ok, c.out, c.ok)
		}
	}
}
