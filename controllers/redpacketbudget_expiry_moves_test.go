package controllers_test

import (
	"context"
	"testing"
	"time"

	"redpacket.io/operator/controllers"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// A move of money between budget shards cut after its first step (the lender took
// the money out and recorded the move, the borrower died before taking it) is
// landed by the operator's expiry driver at its next pass, with no creation to ask
// for it: the lender's record is cleared, the borrower holds the money once, and the
// snapshot has no money fault. A second pass changes nothing.
func TestBudgetExpiryFinishesAMoveCutShort(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	srv := redistest.Start(t)
	c := srv.Client(t)
	b := store.NewBudget(c, "cut-move", 4)
	if err := b.Configure(ctx, 4000, store.BudgetLimits{Currency: "CNY", MaxTotal: 1000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	k0 := b.ShardKeys(0)
	lent, err := lua.BudgetLendScript.Call(ctx, c, []string{k0.Meta}, 2, 100).StringSlice()
	if err != nil || len(lent) != 3 || lent[0] != "lent" {
		t.Fatalf("the first step: %q, %v", lent, err)
	}

	driver := &controllers.BudgetExpiry{}
	driver.Track("cut-move", b)
	driver.ExpireOnce(ctx)
	if rec, err := c.HGet(ctx, k0.Meta, "lend").Result(); err == nil {
		t.Fatalf("after a pass the lender still records the move %q", rec)
	}
	s0, err := b.ShardSnapshot(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	s2, err := b.ShardSnapshot(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	if s0.Lent != 500 || s2.Borrowed != 500 || s2.Available != 1500 || s0.Available != 500 {
		t.Fatalf("after a pass: lender %+v, borrower %+v; want 500 lent by shard 0 and borrowed by shard 2", s0, s2)
	}
	snap, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if f := snap.MoneyFaults(); f != nil || snap.Available != 4000 {
		t.Fatalf("after a pass: %+v, faults %q", snap, f)
	}
	driver.ExpireOnce(ctx)
	if again, err := b.ShardSnapshot(ctx, 2); err != nil || again != s2 {
		t.Fatalf("after a second pass the borrower holds %+v, %v; want %+v", again, err, s2)
	}
}
