package controllers_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
)

// A controller stopped in the middle of seeding, ten forced reconciles, and two
// controllers resuming at once still leave exactly count packets, the split's, in Redis.
func TestSeedingSurvivesRestartAndRepeatedReconciles(t *testing.T) {
	t.Parallel()
	e := newEnv(t)

	const total, count = 5_000_000, 100_000
	const stopAfter = 20_000
	reached := make(chan struct{})
	release := make(chan struct{})
	var reachedOnce sync.Once
	first := e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Seeder = store.Seeder{ChunkSize: 5000, AfterChunk: func(staged int64) error {
			if staged < stopAfter {
				return nil
			}
			reachedOnce.Do(func() { close(reached) })
			<-release
			return errors.New("the controller stopped")
		}}
	})

	a := e.create(e.activity("rain", total, count))
	select {
	case <-reached:
	case <-time.After(30 * time.Second):
		t.Fatalf("seeding never reached %d staged packets; %s", stopAfter, describe(e.get("rain")))
	}

	// Mid-way: staged but not committed, and status says Seeding.
	snap := e.snapshot(a)
	if snap.Exists() || snap.StagedCount < stopAfter || snap.StagedCount >= count {
		t.Fatalf("mid-seeding snapshot %+v, want no marker and %d..%d staged", snap, stopAfter, count)
	}
	mid := e.get("rain")
	if mid.Status.Phase != redpacketv1alpha1.PhaseSeeding {
		t.Errorf("phase %s while seeding, want Seeding", mid.Status.Phase)
	}
	if c := findCondition(mid, redpacketv1alpha1.ConditionSeeded); c == nil || c.Status != metav1.ConditionFalse || c.Reason != redpacketv1alpha1.ReasonSeeding {
		t.Errorf("Seeded %+v while seeding, want False/Seeding", c)
	}
	for i := range 10 {
		e.bump("rain", i)
	}

	// Stop the controller in the middle of its seeding run.
	first.Cancel()
	close(release)
	first.Stop()
	if snap := e.snapshot(a); snap.Exists() {
		t.Fatalf("activity committed by a stopped controller: %+v", snap)
	}

	// Two controllers resume at once (as after a restart with a stale leader), with a
	// chunk size that does not line up with the first one's, while the activity is
	// poked ten more times.
	e.startController(func(r *controllers.RedPacketActivityReconciler) { r.Seeder = store.Seeder{ChunkSize: 3000} })
	e.startController(func(r *controllers.RedPacketActivityReconciler) { r.Seeder = store.Seeder{ChunkSize: 7000} })
	for i := range 10 {
		e.bump("rain", 100+i)
		time.Sleep(30 * time.Millisecond)
	}
	a = e.waitPhase("rain", redpacketv1alpha1.PhaseActive, 60*time.Second)

	ctx := context.Background()
	k := e.keys(a)
	packets, err := e.rdb.LLen(ctx, k.Packets).Result()
	if err != nil {
		t.Fatal(err)
	}
	staging, _ := e.rdb.LLen(ctx, k.Staging).Result()
	claims, _ := e.rdb.HLen(ctx, k.Claims).Result()
	if packets+staging+claims != count || staging != 0 {
		t.Fatalf("Redis holds %d packets + %d staged + %d claims, want exactly %d packets", packets, staging, claims, count)
	}

	// Exactly the split: ids 1..count in order, the split's amounts, summing to total.
	want, err := split.Split(split.Params{Type: split.TypeRandom, Total: total, Count: count, Min: 1, Seed: split.SeedFromUID(string(a.UID))})
	if err != nil {
		t.Fatal(err)
	}
	all, err := e.handle(a).Shard(0).Listed(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var sum int64
	for i, packet := range all {
		if packet.ID != strconv.Itoa(i+1) || packet.Amount != want[i] ||
			packet.CountBefore != int64(i) || packet.AmountBefore != sum {
			t.Fatalf("packet %d is %+v, want %d:%d@%d:%d", i, packet, i+1, want[i], i, sum)
		}
		sum += packet.Amount
	}
	if sum != total {
		t.Fatalf("packets sum to %d, want %d", sum, total)
	}
	if snap := e.snapshot(a); snap.Count != count || snap.Total != total || snap.State != store.StateOpen {
		t.Fatalf("snapshot %+v after seeding", snap)
	}
}

// Redis loses the activity after packets were claimed: the controller says DataLost,
// emits a Warning event, keeps grabbing closed and never seeds again.
func TestDataLostIsNeverReseeded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)

	a := e.create(e.activity("fragile", 1000, 10))
	e.waitPhase("fragile", redpacketv1alpha1.PhaseActive, 20*time.Second)
	for _, u := range []string{"a", "b", "c"} {
		if res := e.grab(a, u); res.Outcome != store.Granted {
			t.Fatalf("grab for %s: %+v", u, res)
		}
	}
	e.applyGrabServiceStatus("fragile", map[string]any{"claimedCount": int64(3), "remainingCount": int64(7)})

	if err := e.rdb.FlushAll(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	e.bump("fragile", 1)

	a = e.waitCondition("fragile", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonDataLost, 10*time.Second)
	if a.Status.Phase != redpacketv1alpha1.PhaseFailed {
		t.Errorf("phase %s after data loss, want Failed", a.Status.Phase)
	}
	if c := findCondition(a, redpacketv1alpha1.ConditionSeeded); c == nil || c.Status != metav1.ConditionFalse || c.Reason != redpacketv1alpha1.ReasonDataLost {
		t.Errorf("Seeded %+v, want False/DataLost", c)
	}
	if a.Status.SeededTime == nil {
		t.Errorf("seededTime was dropped")
	}
	if c := findCondition(a, redpacketv1alpha1.ConditionStalled); c == nil || c.Status != metav1.ConditionTrue || c.Reason != redpacketv1alpha1.ReasonDataLost {
		t.Errorf("Stalled %+v, want True/DataLost", c)
	}
	if got := kstatusOf(t, a); got != status.FailedStatus {
		t.Errorf("kstatus %s after data loss, want Failed (observedGeneration %d of %d)", got, a.Status.ObservedGeneration, a.Generation)
	}
	e.waitEvent("fragile", "Warning", redpacketv1alpha1.ReasonDataLost)

	// More reconciles, forced and periodic: nothing reappears in Redis.
	for i := range 5 {
		e.bump("fragile", 10+i)
	}
	consistently(t, 3*time.Second, "an empty Redis", func() (bool, string) {
		n := e.dbsize()
		return n == 0, strconv.FormatInt(n, 10) + " keys"
	})
	if res := e.grab(a, "d"); res.Outcome != store.Missing {
		t.Errorf("grab after data loss: %+v, want missing", res)
	}
	if e.dbsize() != 0 {
		t.Errorf("a grab recreated keys")
	}
	a = e.get("fragile")
	if c := findCondition(a, redpacketv1alpha1.ConditionReady); c == nil || c.Reason != redpacketv1alpha1.ReasonDataLost {
		t.Errorf("Ready %+v, want still DataLost", c)
	}
}

// With no claims reported and no Seeded in status, Redis losing the staged packets
// before the commit is harmless: the activity is seeded from scratch.
func TestSeedingRestartsWhenStagingVanishesBeforeCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reached := make(chan struct{})
	release := make(chan struct{})
	var once sync.Once
	first := e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Seeder = store.Seeder{ChunkSize: 100, AfterChunk: func(int64) error {
			once.Do(func() { close(reached) })
			<-release
			return errors.New("the controller stopped")
		}}
	})
	e.create(e.activity("early", 1000, 500))
	select {
	case <-reached:
	case <-time.After(30 * time.Second):
		t.Fatal("seeding never started")
	}
	first.Cancel()
	close(release)
	first.Stop()
	if err := e.rdb.FlushAll(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	e.startController(nil)
	a := e.waitPhase("early", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if snap := e.snapshot(a); snap.Count != 500 || snap.RemainingCount != 500 {
		t.Fatalf("snapshot %+v, want 500 packets", snap)
	}
}
