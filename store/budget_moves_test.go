package store_test

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

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

// Moves between shards never look like money from nowhere to a reader: four movers
// shuttle money between random shards with the three scripts of a move, one step
// at a time as the store makes them, while a reader snapshots the budget as the
// operator's reconcile does. Each shard is read at its own instant, so a pass often
// counts a move on the borrower and not yet on the lender; the re-read of what was
// lent (BudgetSnapshot.LentAfter) keeps every snapshot free of money faults.
func TestSnapshotsDuringMovesSeeNoMoneyFault(t *testing.T) {
	ctx := redistest.Context(t)
	srv := redistest.Start(t)
	const shards = 16
	configuredBudget(t, ctx, srv.Client(t), "moves-read", shards, 160_000, testLimits())
	stop := make(chan struct{})
	var movers sync.WaitGroup
	var moved atomic.Int64
	for w := range 4 {
		c := srv.Client(t)
		b := store.NewBudget(c, "moves-read", shards)
		movers.Go(func() {
			rnd := rand.New(rand.NewPCG(uint64(w), 34))
			for {
				select {
				case <-stop:
					return
				default:
				}
				from, to := rnd.IntN(shards), rnd.IntN(shards)
				if from == to {
					continue
				}
				lend, err := lua.BudgetLendScript.Call(ctx, c, []string{b.ShardKeys(from).Meta}, to, 1).StringSlice()
				if err != nil {
					t.Error(err)
					return
				}
				if lend[0] != "lent" {
					continue // busy (another mover's move of this lender) or dry
				}
				if _, err := lua.BudgetBorrowScript.Call(ctx, c, []string{b.ShardKeys(to).Meta}, from, lend[1], lend[2]).Result(); err != nil {
					t.Error(err)
					return
				}
				if _, err := lua.BudgetLendDoneScript.Call(ctx, c, []string{b.ShardKeys(from).Meta}, lend[1]).Result(); err != nil {
					t.Error(err)
					return
				}
				moved.Add(1)
			}
		})
	}
	reader := store.NewBudget(srv.Client(t), "moves-read", shards)
	snapshots := 0
	for ; snapshots < 300 && !t.Failed(); snapshots++ {
		s, err := reader.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if f := s.MoneyFaults(); f != nil {
			t.Errorf("snapshot %d, %d moves made: money faults %q in %+v", snapshots, moved.Load(), f, s)
		}
	}
	close(stop)
	movers.Wait()
	t.Logf("%d snapshots during %d moves, none with a money fault", snapshots, moved.Load())
	if moved.Load() < 1000 {
		t.Errorf("only %d moves during the snapshots", moved.Load())
	}
	if s := conserved(t, ctx, reader); s.Available != 160_000 {
		t.Errorf("after the moves: %+v", s)
	}
}

// The budget's Redis user may send the commands its functions call, so it can write
// money into its own shards outside them. Three such writes, each invisible to the
// budget's sums: a forged budget_borrow (a shard's available and borrowed raised
// together, lent nowhere), packets created with that money, and money moved by hand
// from one shard to another. Each is a money fault of the snapshot, which the
// operator raises (Stalled ConservationBroken, a Warning and a metric).
func TestForgedMoneyInABudgetShardIsAFault(t *testing.T) {
	ctx := redistest.Context(t)
	srv := redistest.Start(t)
	op := srv.Client(t)
	b := configuredBudget(t, ctx, op, "forged-money", 4, 4000, testLimits())
	const pw = "forged-money-pw-0123456789"
	if _, err := b.EnsureUser(ctx, pw); err != nil {
		t.Fatal(err)
	}
	tenant := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: b.UserName(), Password: pw})
	t.Cleanup(func() { _ = tenant.Close() })
	conserved(t, ctx, b)

	// A borrow of 5,000 from shard 1, which never lent.
	k0 := b.ShardKeys(0)
	if v, err := lua.BudgetBorrowScript.Call(ctx, tenant, []string{k0.Meta}, 1, 1, 5000).StringSlice(); err != nil || v[0] != "borrowed" {
		t.Fatalf("the forged borrow as the budget's user: %q, %v", v, err)
	}
	s, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !s.Conserved() || s.Available != 4000 {
		t.Fatalf("after the forged borrow: %+v; want the budget's sums unchanged (the fault is only in the moves)", s)
	}
	if f := s.MoneyFaults(); len(f) != 1 || !strings.Contains(f[0], "borrowed 5000, more than the 0") {
		t.Fatalf("after the forged borrow: money faults %q; want the borrow named", f)
	}
	// Creations spend the forged money: the budget's sums still agree, its
	// available goes below zero.
	for _, id := range idsOnShard(b, "spent-", 0, 5) {
		if r, err := b.Create(ctx, store.NewPacket{ID: id, Sender: "m", Total: 1000, Count: 1, Distribution: split.TypeFixed}); err != nil || r.Outcome != store.CreateCreated {
			t.Fatalf("creating %s: %+v, %v", id, r, err)
		}
	}
	if s, err = b.Snapshot(ctx); err != nil {
		t.Fatal(err)
	}
	if !s.Conserved() || s.Available != -1000 || len(s.MoneyFaults()) != 2 {
		t.Fatalf("after spending it: %+v, faults %q; want conserved sums, available -1000, and the borrow and the negative money named", s, s.MoneyFaults())
	}

	// Money moved by hand between two shards: the budget's sums agree, the two
	// shards' do not.
	k2, k3 := b.ShardKeys(2), b.ShardKeys(3)
	if err := tenant.HIncrBy(ctx, k2.Meta, "available", -300).Err(); err != nil {
		t.Fatal(err)
	}
	if err := tenant.HIncrBy(ctx, k3.Meta, "available", 300).Err(); err != nil {
		t.Fatal(err)
	}
	if s, err = b.Snapshot(ctx); err != nil {
		t.Fatal(err)
	}
	f := s.MoneyFaults()
	if !s.Conserved() || len(f) != 3 || !strings.Contains(f[0], "shards [2 3]") {
		t.Fatalf("after moving 300 by hand: %+v, faults %q; want shards 2 and 3 named", s, f)
	}
}

// A client's retries of one creation race on a dry shard: 16 identical creations of
// one packet of 400, on a budget of 500 over 4 shards (125 each), each from its own
// client. The first to borrow creates the packet; the others, which read
// budget_exhausted before it existed and then found too little money left to
// borrow, must answer existing, as the script does for a packet that is there.
// Before, a creation whose refill came up short answered the budget_exhausted it
// had read before the packet was made (TestBudgetHistories, seed
// 1796372057098635934). Several rounds, each on a fresh budget.
func TestRacingRetriesOfACreationAnswerExisting(t *testing.T) {
	ctx := redistest.Context(t)
	srv := redistest.Start(t)
	admin := srv.Client(t)
	for round := range 10 {
		uid := fmt.Sprintf("retries-%d", round)
		configuredBudget(t, ctx, admin, uid, 4, 500, testLimits())
		var wg sync.WaitGroup
		outcomes := make([]store.CreateOutcome, 16)
		errs := make([]error, 16)
		start := make(chan struct{})
		for k := range outcomes {
			c := srv.Client(t)
			b := store.NewBudget(c, uid, 4)
			wg.Go(func() {
				<-start
				r, err := b.Create(ctx, store.NewPacket{ID: "order-1", Sender: "merchant-7", Total: 400, Count: 2,
					Distribution: split.TypeFixed})
				outcomes[k], errs[k] = r.Outcome, err
			})
		}
		close(start)
		wg.Wait()
		created := 0
		for k, o := range outcomes {
			if errs[k] != nil {
				t.Fatalf("round %d, creation %d: %v", round, k, errs[k])
			}
			switch o {
			case store.CreateCreated:
				created++
			case store.CreateExisting:
			default:
				t.Fatalf("round %d: answers %v; want one created and the rest existing", round, outcomes)
			}
		}
		if created != 1 {
			t.Fatalf("round %d: answers %v; want one created", round, outcomes)
		}
	}
}
