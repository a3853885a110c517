package history

import (
	"slices"
	"testing"

	"github.com/anishathalye/porcupine"

	"redpacket.io/operator/store"
)

// The bodies of packet "P" in the hand-made histories: body 0 of three shares,
// body 1 another sender's of two, body 2 over the budget's limits. Times are Redis
// clock milliseconds; a packet created at 100 with body 0 or 1 expires at 1100.
var testBodies = map[string][]PacketBody{"P": {
	{Sender: "s", Total: 30, Count: 3, TTLMs: 1000, Shares: []int64{10, 15, 5}},
	{Sender: "t", Total: 31, Count: 2, TTLMs: 1000, Shares: []int64{16, 15}},
	{Sender: "s", Total: 30, Count: 9, TTLMs: 1000, OverLimit: true},
}}

// bop builds an operation on packet "P" whose call ran while the Redis clock read
// between call and ret; ret < 0 is a call with no answer, returned at the end.
func bop(client int, in BudgetInput, out BudgetOutput, call, ret int64) porcupine.Operation {
	in.Packet, in.NotBeforeMs, in.NotAfterMs = "P", call, ret
	if ret < 0 {
		in.NotAfterMs, ret = 0, 1<<40
		out.Unknown = true
	}
	return porcupine.Operation{ClientId: client, Input: in, Output: out, Call: call, Return: ret}
}

func createOp(body int, outcome store.CreateOutcome, call, ret int64) porcupine.Operation {
	out := BudgetOutput{Create: outcome}
	if outcome == store.CreateCreated || outcome == store.CreateExisting {
		out.CreatedMs, out.ExpiresMs = 100, 100+testBodies["P"][body].TTLMs
	}
	return bop(8, BudgetInput{Op: OpCreate, Body: body}, out, call, ret)
}

func pgrabOp(client int, user string, outcome store.PacketGrabOutcome, share int, call, ret int64) porcupine.Operation {
	out := BudgetOutput{Grab: outcome}
	if outcome == store.PacketGranted || outcome == store.PacketAlreadyClaimed {
		out.Share, out.Amount = share, testBodies["P"][0].Shares[share]
	}
	return bop(client, BudgetInput{Op: OpPacketGrab, User: user}, out, call, ret)
}

// detailOp reads body 0's packet with grabs and the expired mark; found false is
// a 404.
// tombOp is a detail read that found packet P's tombstone.
func tombOp(call, ret int64) porcupine.Operation {
	b := testBodies["P"][0]
	return bop(9, BudgetInput{Op: OpDetail}, BudgetOutput{Found: true, Forgotten: true, Expired: true, Sender: b.Sender,
		Total: b.Total, Count: b.Count, ExpiresMs: 1100, Grabs: map[string]int{}}, call, ret)
}

func detailOp(found bool, grabs map[string]int, expired bool, call, ret int64) porcupine.Operation {
	out := BudgetOutput{Found: found}
	if found {
		b := testBodies["P"][0]
		out.Sender, out.Total, out.Count, out.ExpiresMs, out.Grabs, out.Expired = b.Sender, b.Total, b.Count, 1100, grabs, expired
	}
	return bop(9, BudgetInput{Op: OpDetail}, out, call, ret)
}

// TestBudgetCheckerCatchesViolations feeds the packet model hand-made histories:
// each broken one must be reported non-linearizable, each sound one accepted.
func TestBudgetCheckerCatchesViolations(t *testing.T) {
	created := createOp(0, store.CreateCreated, 100, 101)
	cases := []struct {
		name string
		ops  []porcupine.Operation
		ok   bool
	}{
		{"sound: a packet created, raced, read, expired, refunded and left as its tombstone", []porcupine.Operation{
			pgrabOp(0, "u0", store.PacketMissing, 0, 90, 95),
			created,
			createOp(0, store.CreateExisting, 150, 160),
			createOp(1, store.CreateConflict, 150, 160),
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			pgrabOp(1, "u2", store.PacketGranted, 1, 205, 215),
			pgrabOp(0, "u1", store.PacketAlreadyClaimed, 0, 300, 310),
			detailOp(true, map[string]int{"u1": 0, "u2": 1}, false, 400, 410),
			pgrabOp(2, "u3", store.PacketExpired, 0, 1200, 1201),
			pgrabOp(1, "u2", store.PacketAlreadyClaimed, 1, 1200, 1201),
			detailOp(true, map[string]int{"u1": 0, "u2": 1}, true, 1300, 1310),
			pgrabOp(0, "u4", store.PacketExpired, 0, 1500, 1510),
			tombOp(1600, 1610),
			pgrabOp(1, "u2", store.PacketExpired, 0, 1700, 1710),
			createOp(0, store.CreateExisting, 1800, 1810),
			createOp(1, store.CreateConflict, 1800, 1810),
		}, true},
		{"sound: the last share, then sold_out, then sold_out for a holder of the tombstone", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			pgrabOp(1, "u2", store.PacketGranted, 1, 200, 210),
			pgrabOp(2, "u3", store.PacketGranted, 2, 200, 210),
			pgrabOp(0, "u4", store.PacketSoldOut, 0, 300, 310),
			pgrabOp(1, "u1", store.PacketSoldOut, 0, 1100, 1110),
			pgrabOp(1, "u2", store.PacketSoldOut, 0, 1200, 1210),
		}, true},
		{"sound: two bodies race for the id, each answered as the other won", []porcupine.Operation{
			createOp(0, store.CreateCreated, 100, 120),
			createOp(1, store.CreateConflict, 90, 130),
		}, true},
		{"sound: a creation with no answer took the id", []porcupine.Operation{
			bop(8, BudgetInput{Op: OpCreate, Body: 0}, BudgetOutput{}, 100, -1),
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			createOp(0, store.CreateExisting, 300, 310),
		}, true},
		{"sound: the grab path's retry answers already_claimed to the first call", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketAlreadyClaimed, 0, 200, 210),
			pgrabOp(1, "u2", store.PacketGranted, 1, 300, 310),
		}, true},
		{"sound: a holder's second grab with no answer ran once the packet was a tombstone", []porcupine.Operation{
			created,
			bop(0, BudgetInput{Op: OpPacketGrab, User: "u1"}, BudgetOutput{HasShare: true, Share: 0}, 200, -1),
			detailOp(true, map[string]int{"u1": 0}, false, 300, 310),
			tombOp(1200, 1210),
			bop(0, BudgetInput{Op: OpPacketGrab, User: "u1"}, BudgetOutput{HasShare: true, Share: 0}, 1300, -1),
		}, true},
		{"sound: the grab path's retry answers existing to the call that created", []porcupine.Operation{
			createOp(0, store.CreateExisting, 100, 101),
			pgrabOp(1, "u2", store.PacketGranted, 0, 300, 310),
		}, true},
		{"sound: quotas refuse a creation before the packet exists, a grab of a user who holds no share, and a holder once the packet is a tombstone", []porcupine.Operation{
			createOp(0, store.CreateQuotaExceeded, 50, 60),
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			pgrabOp(1, "u2", store.PacketQuotaExceeded, 0, 300, 310),
			pgrabOp(1, "u1", store.PacketQuotaExceeded, 0, 1200, 1210),
			createOp(0, store.CreateExisting, 1300, 1310),
		}, true},
		{"broken: a quota refuses a retry of a packet that exists", []porcupine.Operation{
			created,
			createOp(0, store.CreateQuotaExceeded, 200, 210),
		}, false},
		{"broken: a quota refuses a holder while the packet keeps its claims", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			pgrabOp(0, "u1", store.PacketQuotaExceeded, 0, 300, 310),
		}, false},
		{"sound: the budget's limits refuse a body; the money refuses another", []porcupine.Operation{
			createOp(2, store.CreateLimitExceeded, 50, 60),
			createOp(0, store.CreateBudgetExhausted, 70, 80),
			created,
			createOp(2, store.CreateConflict, 200, 210),
		}, true},

		{"a share granted twice", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			pgrabOp(1, "u2", store.PacketGranted, 0, 200, 210),
		}, false},
		{"a user granted twice in one packet", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			pgrabOp(1, "u1", store.PacketGranted, 1, 300, 310),
		}, false},
		{"a share out of order", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 1, 200, 210),
		}, false},
		{"a share with another amount", []porcupine.Operation{
			created,
			bop(0, BudgetInput{Op: OpPacketGrab, User: "u1"}, BudgetOutput{Grab: store.PacketGranted, Share: 0, Amount: 11}, 200, 210),
		}, false},
		{"a fourth share of a three-share packet", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			pgrabOp(0, "u2", store.PacketGranted, 1, 220, 230),
			pgrabOp(0, "u3", store.PacketGranted, 2, 240, 250),
			bop(0, BudgetInput{Op: OpPacketGrab, User: "u4"}, BudgetOutput{Grab: store.PacketGranted, Share: 3, Amount: 1}, 260, 270),
		}, false},
		{"sold_out while a share is left", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			pgrabOp(1, "u2", store.PacketSoldOut, 0, 300, 310),
		}, false},
		{"a grant after the packet's expiry on the Redis clock", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 1200, 1210),
		}, false},
		{"a grant after a grab answered expired", []porcupine.Operation{
			bop(8, BudgetInput{Op: OpCreate, Body: 0}, BudgetOutput{}, 100, -1),
			pgrabOp(0, "u1", store.PacketExpired, 0, 1150, 1160),
			pgrabOp(1, "u2", store.PacketGranted, 0, 1170, 1180),
		}, false},
		{"a grant after the detail showed the packet refunded", []porcupine.Operation{
			bop(8, BudgetInput{Op: OpCreate, Body: 0}, BudgetOutput{}, 100, -1),
			detailOp(true, map[string]int{}, true, 1150, 1160),
			pgrabOp(1, "u2", store.PacketGranted, 0, 1170, 1180),
		}, false},
		{"expired before the time to live passed", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketExpired, 0, 500, 510),
		}, false},
		{"a lost acknowledged creation: missing before expiry", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketMissing, 0, 300, 310),
		}, false},
		{"a lost acknowledged creation: not found before expiry", []porcupine.Operation{
			created,
			detailOp(false, nil, false, 300, 310),
		}, false},
		{"a lost acknowledged creation: created again", []porcupine.Operation{
			created,
			createOp(0, store.CreateCreated, 300, 310),
		}, false},
		{"a forgotten id named a second packet: created again after the tombstone", []porcupine.Operation{
			created,
			tombOp(1200, 1210),
			createOp(0, store.CreateCreated, 1300, 1310),
		}, false},
		{"a forgotten id is missing after expiry", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketMissing, 0, 1300, 1310),
		}, false},
		{"a tombstone before the time to live passed", []porcupine.Operation{
			created,
			tombOp(500, 510),
		}, false},
		{"a tombstone shows grabs", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			bop(9, BudgetInput{Op: OpDetail}, BudgetOutput{Found: true, Forgotten: true, Expired: true, Sender: testBodies["P"][0].Sender,
				Total: testBodies["P"][0].Total, Count: testBodies["P"][0].Count, ExpiresMs: 1100, Grabs: map[string]int{"u1": 0}}, 1200, 1210),
		}, false},
		{"a grant after the tombstone", []porcupine.Operation{
			bop(8, BudgetInput{Op: OpCreate, Body: 0}, BudgetOutput{}, 100, -1),
			tombOp(1200, 1210),
			pgrabOp(1, "u2", store.PacketGranted, 0, 1300, 1310),
		}, false},
		{"a lost acknowledged grant: the detail leaves it out", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			detailOp(true, map[string]int{}, false, 300, 310),
		}, false},
		{"a lost acknowledged grant: the holder answered another share", []porcupine.Operation{
			created,
			pgrabOp(0, "u1", store.PacketGranted, 0, 200, 210),
			pgrabOp(0, "u1", store.PacketAlreadyClaimed, 1, 300, 310),
		}, false},
		{"conflict with the packet's own body", []porcupine.Operation{
			created,
			createOp(0, store.CreateConflict, 200, 210),
		}, false},
		{"existing with a creation time before the call", []porcupine.Operation{
			createOp(0, store.CreateExisting, 150, 160),
		}, false},
		{"existing for another body", []porcupine.Operation{
			created,
			createOp(1, store.CreateExisting, 200, 210),
		}, false},
		{"budget_exhausted for an id that has its packet", []porcupine.Operation{
			created,
			createOp(0, store.CreateBudgetExhausted, 200, 210),
		}, false},
		{"limit_exceeded for a body within the limits", []porcupine.Operation{
			createOp(0, store.CreateLimitExceeded, 50, 60),
		}, false},
		{"created for a body over the limits", []porcupine.Operation{
			createOp(2, store.CreateCreated, 100, 101),
		}, false},
		{"created with another time to live", []porcupine.Operation{
			bop(8, BudgetInput{Op: OpCreate, Body: 0}, BudgetOutput{Create: store.CreateCreated, CreatedMs: 100, ExpiresMs: 2100}, 100, 101),
		}, false},
		{"a grant before any creation", []porcupine.Operation{
			pgrabOp(0, "u1", store.PacketGranted, 0, 50, 60),
			created,
		}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			model := BudgetModel(testBodies)
			if got := porcupine.CheckOperations(model, c.ops); got != c.ok {
				t.Errorf("linearizable = %t, want %t", got, c.ok)
			}
		})
	}
}

// TestResolveBudget checks the resolution of unknown outcomes by the final state.
func TestResolveBudget(t *testing.T) {
	final := map[string]map[string]int{"P": {"u1": 0, "u2": 1, "ghost": 2}}
	history := []porcupine.Operation{
		bop(8, BudgetInput{Op: OpCreate, Body: 0}, BudgetOutput{}, 100, -1), // took the id: no creation answered
		bop(8, BudgetInput{Op: OpCreate, Body: 1}, BudgetOutput{}, 100, -1), // another body: changed nothing
		bop(0, BudgetInput{Op: OpPacketGrab, User: "u1"}, BudgetOutput{}, 200, -1),
		bop(1, BudgetInput{Op: OpPacketGrab, User: "u2"}, BudgetOutput{}, 200, -1),
		pgrabOp(1, "u2", store.PacketAlreadyClaimed, 1, 300, 310),
		bop(2, BudgetInput{Op: OpPacketGrab, User: "u3"}, BudgetOutput{}, 200, -1), // holds nothing
		bop(9, BudgetInput{Op: OpDetail}, BudgetOutput{}, 200, -1),
	}
	ops, dropped, phantoms := ResolveBudget(history, map[string]int{"P": 0}, final, testBodies)
	if dropped != 3 || !slices.Equal(phantoms, []string{"P/ghost"}) || len(ops) != 4 {
		t.Fatalf("dropped %d, phantoms %v, %d ops", dropped, phantoms, len(ops))
	}
	if o := ops[1].Output.(BudgetOutput); !o.Resolved || o.Grab != store.PacketGranted || o.Share != 0 || o.Amount != 10 {
		t.Errorf("u1's grab resolved as %+v", o)
	}
	if o := ops[2].Output.(BudgetOutput); !o.Unknown || !o.HasShare || o.Share != 1 || ops[2].Return != 310 {
		t.Errorf("u2's grab resolved as %+v returning at %d", o, ops[2].Return)
	}
	if !porcupine.CheckOperations(BudgetModel(testBodies), ops) {
		t.Error("the resolved history is not linearizable")
	}
}

// TestFinalBody checks which body the credits show an id's packet was made with.
func TestFinalBody(t *testing.T) {
	bodies := testBodies["P"]
	cases := []struct {
		name string
		ev   PacketEvidence
		body int
		ok   bool
	}{
		{"nothing credited: no packet", PacketEvidence{}, -1, true},
		{"the refund names the sender", PacketEvidence{Grants: map[int]CreditedShare{0: {"u1", 10}}, RefundUser: "s", Refund: 20}, 0, true},
		{"every share granted, no refund", PacketEvidence{Grants: map[int]CreditedShare{0: {"u1", 16}, 1: {"u2", 15}}}, 1, true},
		{"a refund of the wrong remainder", PacketEvidence{Grants: map[int]CreditedShare{0: {"u1", 10}}, RefundUser: "s", Refund: 30}, -1, false},
		{"money left and no refund", PacketEvidence{Grants: map[int]CreditedShare{0: {"u1", 10}}}, -1, false},
		{"a share no body has", PacketEvidence{Grants: map[int]CreditedShare{0: {"u1", 99}}, RefundUser: "s", Refund: 1}, -1, false},
	}
	for _, c := range cases {
		if body, ok := FinalBody(bodies, c.ev); body != c.body || ok != c.ok {
			t.Errorf("%s: body %d (%t), want %d (%t)", c.name, body, ok, c.body, c.ok)
		}
	}
}

// TestCheckExhaustion checks budget_exhausted answers against the money drawn.
func TestCheckExhaustion(t *testing.T) {
	bodies := map[string][]PacketBody{"A": testBodies["P"], "B": testBodies["P"]}
	op := func(id string, body int, outcome store.CreateOutcome, call, ret int64) porcupine.Operation {
		return porcupine.Operation{Input: BudgetInput{Packet: id, Op: OpCreate, Body: body},
			Output: BudgetOutput{Create: outcome}, Call: call, Return: ret}
	}
	shard := func(string) int { return 0 }
	final := map[string]int{"A": 0, "B": -1}
	// A drew 30 of 40 before B's answer: 10 left, B asks 30.
	sound := []porcupine.Operation{op("A", 0, store.CreateCreated, 0, 10), op("B", 0, store.CreateBudgetExhausted, 20, 30)}
	if v := CheckExhaustion(sound, bodies, final, shard, []int64{40}); len(v) != 0 {
		t.Errorf("sound history: %v", v)
	}
	// Nothing drawn before B's answer: 40 left for 30.
	early := []porcupine.Operation{op("B", 0, store.CreateBudgetExhausted, 0, 5), op("A", 0, store.CreateCreated, 10, 20)}
	if v := CheckExhaustion(early, bodies, final, shard, []int64{40}); len(v) != 1 {
		t.Errorf("budget_exhausted with the money there: %v", v)
	}
	// Two shards of 20: A on shard 0 drew 30 before B's answer on shard 1, 10 left in
	// all: sound. Nothing drawn: 40 in all, though 20 on B's shard: a violation (a
	// dry shard borrows from its sibling).
	split := func(id string) int {
		if id == "A" {
			return 0
		}
		return 1
	}
	if v := CheckExhaustion(sound, bodies, final, split, []int64{20, 20}); len(v) != 0 {
		t.Errorf("sound history over two shards: %v", v)
	}
	if v := CheckExhaustion(early, bodies, final, split, []int64{20, 20}); len(v) != 1 {
		t.Errorf("budget_exhausted with the money on the sibling: %v", v)
	}
}
