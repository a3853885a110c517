package history

import (
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"redpacket.io/operator/lua"
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

func grabOp(client int, user string, outcome lua.Outcome, packet string, call, ret int64) porcupine.Operation {
	return op(client, Input{Op: OpGrab, User: user}, Output{Outcome: outcome, Packet: packet}, call, ret)
}

func openOp(call, ret int64) porcupine.Operation {
	return op(9, Input{Op: OpOpen}, Output{State: string(lua.StateOpen)}, call, ret)
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
			grabOp(0, "u1", lua.Granted, "1", 2, 3),
			grabOp(1, "u2", lua.Granted, "1", 2, 4),
		}, false},
		{"double grant of one user: two packets", 3, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", lua.Granted, "1", 2, 3),
			grabOp(1, "u1", lua.Granted, "2", 4, 5),
		}, false},
		{"lost grant: a later already_claimed names another packet", 3, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", lua.Granted, "1", 2, 3),
			grabOp(1, "u2", lua.Granted, "2", 2, 3),
			grabOp(0, "u1", lua.AlreadyClaimed, "2", 4, 5),
		}, false},
		{"lost grant: sold_out while an acknowledged count leaves a packet", 2, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", lua.Granted, "1", 2, 3),
			grabOp(1, "u2", lua.SoldOut, "", 4, 5),
		}, false},
		{"lost grant: a granted user is answered sold_out", 1, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", lua.Granted, "1", 2, 3),
			grabOp(0, "u1", lua.SoldOut, "", 4, 5),
		}, false},
		{"stale read: not_started after a completed open", 3, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", lua.NotStarted, "", 2, 3),
		}, false},
		{"stale read: paused after a completed resume", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpPause}, Output{State: "open"}, 2, 3),
			grabOp(0, "u1", lua.Paused, "", 4, 5),
			op(9, Input{Op: OpResume}, Output{State: "open"}, 6, 7),
			grabOp(1, "u2", lua.Paused, "", 8, 9),
		}, false},
		{"granted after a completed close", 3, []porcupine.Operation{
			openOp(0, 1),
			op(9, Input{Op: OpCloseExpired}, Output{State: "closed", Reason: lua.CloseExpired}, 2, 3),
			grabOp(0, "u1", lua.Granted, "1", 4, 5),
		}, false},
		{"an unknown outcome does not excuse a double grant", 3, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", lua.Granted, "1", 2, 3),
			grabOp(1, "u3", "", "", 2, -1),
			grabOp(2, "u2", lua.Granted, "1", 4, 5),
		}, false},
		{"valid: unknown grab that took effect, then its retry", 2, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", "", "", 2, -1),
			grabOp(1, "u2", lua.Granted, "2", 3, 4),
			grabOp(0, "u1", lua.AlreadyClaimed, "1", 5, 6),
			grabOp(2, "u3", lua.SoldOut, "", 7, 8),
			op(9, Input{Op: OpCloseExpired}, Output{State: "closed", Reason: lua.CloseExpired}, 9, 10),
			grabOp(2, "u3", lua.Ended, "", 11, 12),
			grabOp(0, "u1", lua.AlreadyClaimed, "1", 11, 12),
		}, true},
		{"valid: unknown grab that never took effect", 2, []porcupine.Operation{
			openOp(0, 1),
			grabOp(0, "u1", "", "", 2, -1),
			grabOp(1, "u2", lua.Granted, "1", 3, 4),
			grabOp(2, "u3", lua.Granted, "2", 5, 6),
			grabOp(2, "u4", lua.SoldOut, "", 7, 8),
		}, true},
		{"valid: an unknown grab resolved to the packet its user holds at the end", 2, []porcupine.Operation{
			openOp(0, 1),
			op(0, Input{Op: OpGrab, User: "u1"}, Output{Unknown: true, Packet: "1"}, 2, 1<<40),
			grabOp(1, "u2", lua.Granted, "2", 3, 4),
			grabOp(2, "u3", lua.SoldOut, "", 5, 6),
		}, true},
		{"a resolved unknown grab cannot share its packet", 2, []porcupine.Operation{
			openOp(0, 1),
			op(0, Input{Op: OpGrab, User: "u1"}, Output{Unknown: true, Packet: "1"}, 2, 1<<40),
			grabOp(1, "u2", lua.Granted, "1", 3, 4),
			grabOp(0, "u1", lua.AlreadyClaimed, "1", 5, 6),
		}, false},
		{"valid: concurrent pause and grabs, close exhausted", 2, []porcupine.Operation{
			grabOp(0, "u1", lua.NotStarted, "", 0, 2),
			openOp(1, 3),
			op(9, Input{Op: OpPause}, Output{State: "open"}, 4, 10),
			grabOp(0, "u1", lua.Granted, "2", 5, 6), // packet ids need not come in order
			grabOp(1, "u2", lua.Paused, "", 5, 11),
			op(9, Input{Op: OpResume}, Output{State: "open"}, 12, 13),
			op(9, Input{Op: OpCloseExhausted}, Output{State: "open"}, 14, 15),
			grabOp(1, "u2", lua.Granted, "1", 16, 17),
			op(9, Input{Op: OpCloseExhausted}, Output{State: "closed", Reason: lua.CloseExhausted}, 18, 19),
			grabOp(1, "u3", lua.SoldOut, "", 20, 21),
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
// grab of a user into the grant the final read shows, hints the others, and finds
// phantom claims.
func TestResolve(t *testing.T) {
	h := []porcupine.Operation{
		op(0, Input{Op: OpGrab, User: "u1"}, Output{}, 0, -1), // holds nothing: dropped
		op(1, Input{Op: OpGrab, User: "u2"}, Output{}, 0, -1), // the one grab of u2: granted 7
		op(2, Input{Op: OpGrab, User: "u3"}, Output{}, 0, -1), // two of u3: hinted 8
		op(2, Input{Op: OpGrab, User: "u3"}, Output{}, 2, -1),
		grabOp(3, "u4", lua.Granted, "9", 0, 1),
		op(3, Input{Op: OpGrab, User: "u4"}, Output{}, 2, -1), // u4 was answered granted: dropped
		grabOp(4, "u5", lua.Paused, "", 0, 1),                 // u5 holds 6, never given: phantom
	}
	got, dropped, phantoms := Resolve(h, map[string]map[string]string{"A": {"u2": "7", "u3": "8", "u4": "9", "u5": "6"}})
	if dropped != 2 || len(got) != 5 || len(phantoms) != 1 || phantoms[0] != "A/u5" {
		t.Fatalf("Resolve: dropped %d, phantoms %v, got %+v", dropped, phantoms, got)
	}
	if o := got[0].Output.(Output); o.Unknown || !o.Resolved || o.Outcome != lua.Granted || o.Packet != "7" {
		t.Errorf("u2's grab resolved to %+v", o)
	}
	if o := got[1].Output.(Output); !o.Unknown || o.Packet != "8" {
		t.Errorf("u3's grab resolved to %+v", o)
	}
}
