package store_test

import (
	"math/rand/v2"
	"sync"
	"testing"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// The seed scenario: 5 packets, 100 users at once.
func TestFivePacketsHundredUsers(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeRandom, 2000, 5)
	k := seedOpen(t, ctx, c, "five-of-hundred", amounts)

	answers := grabConcurrently(t, ctx, c, k, userIDs("user-", 100), 100)
	counts, grants := tally(t, answers)
	if counts[store.Granted] != 5 || counts[store.SoldOut] != 95 || len(counts) != 2 {
		t.Fatalf("outcomes %v, want 5 granted and 95 sold_out", counts)
	}
	if got := grantsSum(grants); got != 2000 {
		t.Fatalf("granted amounts sum to %d, want 2000", got)
	}
	snap := verify(t, ctx, c, k, amounts, grants)
	if snap.RemainingCount != 0 || snap.ClaimedAmount != 2000 || snap.State != store.StateOpen {
		t.Fatalf("snapshot %+v: want nothing remaining, 2000 claimed, still open", snap)
	}
}

// One user racing itself: every answer names the same packet.
func TestUserRacesItself(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeLineCut, 10_000, 20)
	k := seedOpen(t, ctx, c, "self-race", amounts)

	users := make([]string, 50)
	for i := range users {
		users[i] = "the-same-user"
	}
	answers := grabConcurrently(t, ctx, c, k, users, 50)
	counts, grants := tally(t, answers)
	if counts[store.Granted] != 1 || counts[store.AlreadyClaimed] != 49 {
		t.Fatalf("outcomes %v, want 1 granted and 49 already_claimed", counts)
	}
	first := grants["the-same-user"]
	for _, a := range answers {
		if a.res.PacketID != first.PacketID || a.res.Amount != first.Amount {
			t.Fatalf("answer %+v differs from the grant %+v", a.res, first)
		}
	}
	snap := verify(t, ctx, c, k, amounts, grants)
	if snap.ClaimedCount != 1 || snap.RemainingCount != 19 {
		t.Fatalf("snapshot %+v: want 1 claimed and 19 remaining", snap)
	}
	// A retry long after still gets the same packet.
	again, err := shardOf(c, k).Grab(ctx, "the-same-user")
	if err != nil {
		t.Fatal(err)
	}
	if again != (store.GrabResult{Outcome: store.AlreadyClaimed, PacketID: first.PacketID, Amount: first.Amount}) {
		t.Fatalf("retry got %+v, want already_claimed with %+v", again, first)
	}
}

// 10,000 packets and 20,000 users from 200 workers, on a plain client and on an
// auto-pipelining client.
func TestTenThousandPacketsTwentyThousandUsers(t *testing.T) {
	for _, variant := range []string{"plain", "autopipeline"} {
		t.Run(variant, func(t *testing.T) {
			ctx := redistest.Context(t)
			c := redistest.Start(t).Client(t)
			via := clientOf(t, c, variant)
			const total = 5_000_000
			amounts := splitOrFail(t, split.TypeRandom, total, 10_000)
			k := seedOpen(t, ctx, c, "burst-"+variant, amounts)

			users := userIDs("u", 20_000)
			answers := grabConcurrently(t, ctx, via, k, users, 200)
			counts, grants := tally(t, answers)
			if counts[store.Granted] != 10_000 || counts[store.SoldOut] != 10_000 || len(counts) != 2 {
				t.Fatalf("outcomes %v, want 10000 granted and 10000 sold_out", counts)
			}
			if got := grantsSum(grants); got != total {
				t.Fatalf("granted amounts sum to %d, want %d", got, total)
			}
			verify(t, ctx, c, k, amounts, grants)

			// Retries of a sample of users, again concurrently: grants come back
			// unchanged, sold-out users stay sold out, nothing new is written.
			r := rand.New(rand.NewPCG(7, 7))
			sample := make([]string, 1000)
			for i := range sample {
				sample[i] = users[r.IntN(len(users))]
			}
			for _, a := range grabConcurrently(t, ctx, via, k, sample, 50) {
				g, granted := grants[a.user]
				switch {
				case granted && (a.res.Outcome != store.AlreadyClaimed || a.res.PacketID != g.PacketID || a.res.Amount != g.Amount):
					t.Fatalf("retry of %s got %+v, want already_claimed %+v", a.user, a.res, g)
				case !granted && a.res.Outcome != store.SoldOut:
					t.Fatalf("retry of %s got %+v, want sold_out", a.user, a.res)
				}
			}
			verify(t, ctx, c, k, amounts, grants)
		})
	}
}

// Several activities on one server do not disturb each other, and grabs on one
// keep working while another is hammered.
func TestActivitiesAreIndependent(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	a1 := splitOrFail(t, split.TypeFixed, 1000, 10)
	a2 := splitOrFail(t, split.TypeLineCut, 777, 7)
	k1 := seedOpen(t, ctx, c, "independent-1", a1)
	k2 := seedOpen(t, ctx, c, "independent-2", a2)
	users := userIDs("v", 30)
	var wg sync.WaitGroup
	var ans1, ans2 []answer
	var err1, err2 error
	wg.Go(func() { ans1, err1 = grabAll(ctx, c, k1, users, 15) })
	wg.Go(func() { ans2, err2 = grabAll(ctx, c, k2, users, 15) })
	wg.Wait()
	if err1 != nil || err2 != nil {
		t.Fatalf("grabs: %v, %v", err1, err2)
	}
	counts1, g1 := tally(t, ans1)
	counts2, g2 := tally(t, ans2)
	if counts1[store.Granted] != 10 || counts2[store.Granted] != 7 {
		t.Fatalf("granted %d and %d, want 10 and 7", counts1[store.Granted], counts2[store.Granted])
	}
	verify(t, ctx, c, k1, a1, g1)
	verify(t, ctx, c, k2, a2, g2)
}
