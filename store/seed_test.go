package store_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

var errCrash = errors.New("seeder crashed")

func TestSeedInterruptedThenRetried(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const total, count = 123_456, 1000
	amounts := splitOrFail(t, split.TypeRandom, total, count)
	k := keysOf("interrupted")
	params := store.SeedParams{Count: count, Total: total, Sponsor: sponsor}

	// The first seeder dies after three chunks of 100.
	chunks := 0
	crashing := store.Seeder{ChunkSize: 100, AfterChunk: func(staged int64) error {
		chunks++
		if chunks == 3 {
			return errCrash
		}
		return nil
	}}
	if _, err := seeding(c, k, crashing).Seed(ctx, amounts, params); !errors.Is(err, errCrash) {
		t.Fatalf("interrupted seed returned %v, want the crash", err)
	}
	snap, err := handle(c, k).Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.Exists() || snap.StagedCount != 300 || snap.RemainingCount != 0 {
		t.Fatalf("after the crash: %+v, want nothing committed and 300 staged", snap)
	}
	if res, err := shardOf(c, k).Grab(ctx, "early"); err != nil || res.Outcome != store.Missing {
		t.Fatalf("grab before the commit: %+v, %v; want missing", res, err)
	}

	// A second attempt also dies, mid-way, with another chunk size: the chunks it
	// stages continue where the first left off.
	chunks = 0
	crashing.ChunkSize = 70
	if _, err := seeding(c, k, crashing).Seed(ctx, amounts, params); !errors.Is(err, errCrash) {
		t.Fatalf("second interrupted seed returned %v, want the crash", err)
	}
	if snap, _ = handle(c, k).Snapshot(ctx); snap.Exists() || snap.StagedCount != 300+3*70 {
		t.Fatalf("after the second crash: %+v, want %d staged", snap, 300+3*70)
	}

	// The retry completes.
	var progress []int64
	retry := store.Seeder{ChunkSize: 100, AfterChunk: func(staged int64) error {
		progress = append(progress, staged)
		return nil
	}}
	res, err := seeding(c, k, retry).Seed(ctx, amounts, params)
	if err != nil {
		t.Fatalf("retried seed: %v", err)
	}
	if !res.Committed {
		t.Fatal("retried seed did not commit")
	}
	if len(progress) == 0 || progress[0] != 610 || progress[len(progress)-1] != count {
		t.Fatalf("retry staged %v, want to continue from 510 up to %d", progress, count)
	}
	if _, err := handle(c, k).Configure(ctx, 0, 0, false, true); err != nil {
		t.Fatal(err)
	}
	snap = verify(t, ctx, c, k, amounts, nil)
	if snap.RemainingCount != count || snap.StagedCount != 0 || snap.State != store.StateOpen {
		t.Fatalf("after the retry: %+v, want %d packets, nothing staged, open", snap, count)
	}

	// Seeding again adopts what is there and changes nothing, even after grabs.
	answers := grabConcurrently(t, ctx, c, k, userIDs("u", 40), 10)
	_, grants := tally(t, answers)
	res, err = seeding(c, k, store.Seeder{ChunkSize: 100}).Seed(ctx, amounts, params)
	if err != nil || res.Committed {
		t.Fatalf("seeding a committed activity: %+v, %v; want adopted, not committed", res, err)
	}
	snap = verify(t, ctx, c, k, amounts, grants)
	if snap.RemainingCount != count-40 || snap.ClaimedCount != 40 {
		t.Fatalf("after re-seeding: %+v, want %d left and 40 claimed", snap, count-40)
	}
}

func TestSeedersRacing(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const total, count = 1_000_000, 5000
	amounts := splitOrFail(t, split.TypeLineCut, total, count)
	params := store.SeedParams{Count: count, Total: total, Sponsor: sponsor}

	for round := range 5 {
		k := keysOf(fmt.Sprintf("racing-%d", round))
		var wg sync.WaitGroup
		results := make([]store.SeedResult, 2)
		errs := make([]error, 2)
		for i := range 2 {
			wg.Go(func() {
				// Different chunk sizes make the two seeders interleave unevenly; some
				// rounds race a seeder that stages through seed_stage.lua against one
				// that stages in optimistic transactions, or two script seeders.
				s := store.Seeder{ChunkSize: 97 + 200*i, ScriptOnly: (round+i)%3 == 0 || round == 4}
				results[i], errs[i] = seeding(c, k, s).Seed(ctx, amounts, params)
			})
		}
		wg.Wait()
		if errs[0] != nil || errs[1] != nil {
			t.Fatalf("round %d: seeders failed: %v, %v", round, errs[0], errs[1])
		}
		if results[0].Committed == results[1].Committed {
			t.Fatalf("round %d: committed %v and %v, want exactly one commit", round, results[0].Committed, results[1].Committed)
		}
		snap := verify(t, ctx, c, k, amounts, nil)
		if snap.RemainingCount != count || snap.State != store.StateReady {
			t.Fatalf("round %d: %+v, want %d packets ready", round, snap, count)
		}
	}
}

// Two seeders forced to take turns chunk by chunk: each keeps finding the staging
// list moved on by the other, and still exactly count packets get committed.
func TestSeedersInLockstep(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const total, count = 99_999, 2000
	amounts := splitOrFail(t, split.TypeRandom, total, count)
	params := store.SeedParams{Count: count, Total: total, Sponsor: sponsor}
	k := keysOf("lockstep")

	turn := [2]chan struct{}{make(chan struct{}, 1), make(chan struct{}, 1)}
	done := [2]chan struct{}{make(chan struct{}), make(chan struct{})}
	var staged [2][]int64
	var results [2]store.SeedResult
	var errs [2]error
	var wg sync.WaitGroup
	for i := range 2 {
		s := store.Seeder{ChunkSize: 50 + 30*i, AfterChunk: func(n int64) error {
			staged[i] = append(staged[i], n)
			select {
			case turn[1-i] <- struct{}{}:
			default:
			}
			select {
			case <-turn[i]:
			case <-done[1-i]:
			}
			return nil
		}}
		wg.Go(func() {
			defer close(done[i])
			results[i], errs[i] = seeding(c, k, s).Seed(ctx, amounts, params)
		})
	}
	wg.Wait()
	if errs[0] != nil || errs[1] != nil {
		t.Fatalf("seeders failed: %v, %v", errs[0], errs[1])
	}
	if results[0].Committed == results[1].Committed {
		t.Fatalf("committed %v and %v, want exactly one commit", results[0].Committed, results[1].Committed)
	}
	if len(staged[0]) < 5 || len(staged[1]) < 5 {
		t.Fatalf("seeders staged %d and %d times, want both to take part", len(staged[0]), len(staged[1]))
	}
	snap := verify(t, ctx, c, k, amounts, nil)
	if snap.RemainingCount != count || snap.StagedCount != 0 {
		t.Fatalf("%+v, want %d packets and nothing staged", snap, count)
	}
}

func TestSeedRefusesBadInput(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	k := keysOf("bad-input")
	for _, tc := range []struct {
		amounts []int64
		p       store.SeedParams
		want    string
	}{
		{[]int64{1, 2}, store.SeedParams{Count: 3, Total: 3}, "2 packets, want 3"},
		{[]int64{1, 0, 2}, store.SeedParams{Count: 3, Total: 3}, "packet 2 has amount 0"},
		{[]int64{1, -1, 3}, store.SeedParams{Count: 3, Total: 3}, "packet 2 has amount -1"},
		{[]int64{1, 1, 2}, store.SeedParams{Count: 3, Total: 5}, "sum to 4, want 5"},
	} {
		_, err := seeding(c, k, store.Seeder{}).Seed(ctx, tc.amounts, tc.p)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Seed(%v, %+v) = %v, want an error with %q", tc.amounts, tc.p, err, tc.want)
		}
	}
	if n, err := c.Exists(ctx, k.All()...).Result(); err != nil || n != 0 {
		t.Fatalf("refused seeds left %d keys (%v)", n, err)
	}
}

// TestSeedDiscardsStagingOfAnotherSplit: chunks staged from one split are never
// committed together with chunks of another; a seeder with a different split starts
// staging afresh.
func TestSeedDiscardsStagingOfAnotherSplit(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const total, count = 50_000, 500
	first := splitOrFail(t, split.TypeRandom, total, count)
	second := splitOrFail(t, split.TypeFixed, total, count)
	k := keysOf("two-splits")
	params := store.SeedParams{Count: count, Total: total, Sponsor: sponsor}

	chunks := 0
	crashing := store.Seeder{ChunkSize: 100, AfterChunk: func(int64) error {
		if chunks++; chunks == 2 {
			return errCrash
		}
		return nil
	}}
	if _, err := seeding(c, k, crashing).Seed(ctx, first, params); !errors.Is(err, errCrash) {
		t.Fatalf("interrupted seed returned %v, want the crash", err)
	}
	if res, err := seeding(c, k, store.Seeder{ChunkSize: 100}).Seed(ctx, second, params); err != nil || !res.Committed {
		t.Fatalf("seed of the second split: %+v, %v", res, err)
	}
	if _, err := handle(c, k).Configure(ctx, 0, 0, false, true); err != nil {
		t.Fatal(err)
	}
	verify(t, ctx, c, k, second, nil)
}
