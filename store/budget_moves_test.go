package store_test

import (
	"fmt"
	"sync"
	"testing"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// Issue 34, case 6: a budget of 10,000 over the default 16 shards (625 each), 200
// creations of 100 with distinct ids. Each shard's allotment is a fixed 625, so
// before moves a shard that ran dry refused while its siblings held money: 96
// created, 104 refused, 400 available. Now a dry shard borrows from its siblings:
// exactly 100 packets of 100 are created, budget_exhausted comes only once the
// budget's available money is below 100, and the money adds up after every creation.
func TestBudgetNeverRefusesMoneyItHas(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "moves", 16, 10_000, testLimits())
	created := 0
	for n := range 200 {
		before := conserved(t, ctx, b)
		r, err := b.Create(ctx, store.NewPacket{ID: fmt.Sprintf("order-%03d", n), Sender: "merchant-7", Total: 100, Count: 2,
			Distribution: split.TypeFixed})
		if err != nil {
			t.Fatal(err)
		}
		switch r.Outcome {
		case store.CreateCreated:
			created++
		case store.CreateBudgetExhausted:
			if before.Available >= 100 {
				t.Fatalf("creation %d refused budget_exhausted with %d available", n, before.Available)
			}
		default:
			t.Fatalf("creation %d: %s (%s)", n, r.Outcome, r.Reason)
		}
	}
	s := conserved(t, ctx, b)
	if created != 100 || s.Available != 0 || s.Live != 10_000 || s.CreatedPackets != 100 {
		t.Fatalf("%d created, snapshot %+v; want exactly 100 packets of 100 and nothing left", created, s)
	}
	for i := range b.N() {
		if sh, err := b.ShardSnapshot(ctx, i); err != nil || !sh.Conserved() {
			t.Fatalf("shard %d: %+v, %v; want its own money to add up", i, sh, err)
		}
	}
	t.Logf("16 shards of 625: %d packets of 100 created; available %d", created, s.Available)
}

// Creators racing on a budget spread over 16 shards, each creating from its own
// client: exactly 10,000 / 100 packets are created in all, never more, and the
// money adds up on every shard and in all.
func TestBudgetMovesUnderRacingCreators(t *testing.T) {
	ctx := redistest.Context(t)
	srv := redistest.Start(t)
	setup := srv.Client(t)
	configuredBudget(t, ctx, setup, "moves-race", 16, 10_000, testLimits())
	const creators, each = 8, 30
	var mu sync.Mutex
	created, refused := 0, 0
	var wg sync.WaitGroup
	for w := range creators {
		b := store.NewBudget(srv.Client(t), "moves-race", 16)
		wg.Go(func() {
			for n := range each {
				r, err := b.Create(ctx, store.NewPacket{ID: fmt.Sprintf("w%d-%d", w, n), Sender: "m", Total: 100, Count: 1,
					Distribution: split.TypeFixed})
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				switch r.Outcome {
				case store.CreateCreated:
					created++
				case store.CreateBudgetExhausted:
					refused++
				default:
					t.Errorf("%s: %s", r.Outcome, r.Reason)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	b := store.NewBudget(setup, "moves-race", 16)
	if _, err := b.FinishMoves(ctx); err != nil {
		t.Fatal(err)
	}
	s := conserved(t, ctx, b)
	if created != 100 || s.CreatedPackets != 100 || s.Live != 10_000 || s.Available != 0 {
		t.Fatalf("%d created, %d refused, snapshot %+v; want exactly 100 created and nothing left", created, refused, s)
	}
	for i := range b.N() {
		if sh, err := b.ShardSnapshot(ctx, i); err != nil || !sh.Conserved() {
			t.Fatalf("shard %d: %+v, %v", i, sh, err)
		}
	}
}

// A move cut after its first step (the lender took the money out and recorded the
// move; the borrower never took it, as when the process crashed): the money is in
// transit, counted as available, and the budget adds up; the next borrower of that
// lender, or FinishMoves, lands it once. Repeating either step changes nothing.
func TestBudgetMoveSurvivesACrash(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "moves-crash", 4, 4000, testLimits())
	k0, k1 := b.ShardKeys(0), b.ShardKeys(1)
	reply, err := lua.BudgetLendScript.Call(ctx, c, []string{k0.Meta}, 1, 300).StringSlice()
	if err != nil || len(reply) != 3 || reply[0] != "lent" || reply[2] != "500" {
		t.Fatalf("the first step alone: %q, %v; want 500 lent (half of 1,000)", reply, err)
	}
	s := conserved(t, ctx, b)
	if s.Available != 4000 {
		t.Fatalf("with the move in transit: available %d, want 4000", s.Available)
	}
	if v, _ := lua.BudgetLendScript.Call(ctx, c, []string{k0.Meta}, 2, 10).StringSlice(); len(v) != 2 || v[0] != "busy" {
		t.Fatalf("a second lend while one is under way: %q; want busy", v)
	}
	n, err := b.FinishMoves(ctx)
	if err != nil || n != 1 {
		t.Fatalf("finishing: %d, %v; want the one move", n, err)
	}
	unchanged(t, ctx, c, "finishing again", func() {
		if n, err := b.FinishMoves(ctx); err != nil || n != 0 {
			t.Fatalf("finishing again: %d, %v", n, err)
		}
		if v, err := lua.BudgetBorrowScript.Call(ctx, c, []string{k1.Meta}, 0, reply[1], 500).StringSlice(); err != nil || v[0] != "again" {
			t.Fatalf("the borrow again: %q, %v", v, err)
		}
	})
	s = conserved(t, ctx, b)
	sh0, _ := b.ShardSnapshot(ctx, 0)
	sh1, _ := b.ShardSnapshot(ctx, 1)
	if s.Available != 4000 || sh0.Available != 500 || sh1.Available != 1500 || !sh0.Conserved() || !sh1.Conserved() {
		t.Fatalf("after the move: budget %+v, shard 0 %+v, shard 1 %+v", s, sh0, sh1)
	}
	// Refused before any write: junk arguments.
	for name, args := range map[string][]any{"lend, no need": {1}, "lend, need 0": {1, 0}, "lend, bad shard": {"x", 5}} {
		unchanged(t, ctx, c, name, func() {
			if err := lua.BudgetLendScript.Call(ctx, c, []string{k0.Meta}, args...).Err(); err == nil {
				t.Errorf("%s: no error", name)
			}
		})
	}
	unchanged(t, ctx, c, "borrow of 0", func() {
		if err := lua.BudgetBorrowScript.Call(ctx, c, []string{k1.Meta}, 0, 9, 0).Err(); err == nil {
			t.Error("borrow of 0: no error")
		}
	})
}
