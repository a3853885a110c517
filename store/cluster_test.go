package store_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// TestCluster runs on one Redis Cluster of three masters.
func TestCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	t.Run("seed scenario", func(t *testing.T) { testClusterSeedScenario(t, cluster) })
	t.Run("autopipeline after flush", func(t *testing.T) { testClusterAutoPipelineAfterFlush(t, cluster) })
	t.Run("budget moves across slots", func(t *testing.T) { testClusterBudgetMoves(t, cluster) })
}

// A budget of 10,000 over 16 shards, on the slots of three masters: 200 creations of
// 100 create exactly 100 packets, the dry shards borrowing across slots (each step of
// a move on its own shard's slot), and every shard's money adds up.
func testClusterBudgetMoves(t *testing.T, cluster *redistest.Cluster) {
	ctx := redistest.Context(t)
	c := cluster.Client(t)
	if err := lua.LoadAll(ctx, c); err != nil {
		t.Fatal(err)
	}
	b := store.NewBudget(c, "cluster-moves", 16)
	if err := b.Configure(ctx, 10_000, store.BudgetLimits{Currency: "CNY", MaxTotal: 20_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	created := 0
	for n := range 200 {
		r, err := b.Create(ctx, store.NewPacket{ID: fmt.Sprintf("c-%03d", n), Sender: "m", Total: 100, Count: 1,
			Distribution: split.TypeFixed})
		if err != nil {
			t.Fatal(err)
		}
		if r.Outcome == store.CreateCreated {
			created++
		}
	}
	s, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if created != 100 || s.Available != 0 || !s.Conserved() {
		t.Fatalf("%d created, snapshot %+v; want exactly 100 and nothing left", created, s)
	}
	for i := range b.N() {
		if sh, err := b.ShardSnapshot(ctx, i); err != nil || !sh.Conserved() {
			t.Fatalf("shard %d: %+v, %v", i, sh, err)
		}
	}
}

// The seed scenario for several activities at once, each living on the one slot of
// its hash tag.
func testClusterSeedScenario(t *testing.T, cluster *redistest.Cluster) {
	ctx := redistest.Context(t)
	// The client the operator and the grab service build: one seed address.
	uc := redisconn.Conn{Addresses: cluster.Addrs[:1], Mode: redisconn.ModeCluster, Username: cluster.Username, Password: cluster.Password}.NewClient()
	t.Cleanup(func() { _ = uc.Close() })
	cc, ok := uc.(*redis.ClusterClient)
	if !ok {
		t.Fatalf("cluster connection gave a %T", uc)
	}

	if err := lua.LoadAll(ctx, uc); err != nil {
		t.Fatalf("LoadAll on the cluster: %v", err)
	}
	masters := 0
	var mu sync.Mutex
	err := cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
		mu.Lock()
		masters++
		mu.Unlock()
		if ok, err := lua.GrabLibrary.LoadedOn(ctx, node); err != nil || !ok {
			return fmt.Errorf("function library on %s: loaded %v, %v", node.Options().Addr, ok, err)
		}
		for _, s := range lua.AllScripts() {
			if s.Function() != "" {
				continue
			}
			ok, err := node.ScriptExists(ctx, s.SHA()).Result()
			if err != nil {
				return fmt.Errorf("SCRIPT EXISTS on %s: %w", node.Options().Addr, err)
			}
			if !ok[0] {
				return fmt.Errorf("script %s is not cached on %s", s.Name(), node.Options().Addr)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if masters != 3 {
		t.Fatalf("LoadAll reached %d masters, want 3", masters)
	}

	// These UIDs hash to different slots (the slot of a fixed string never changes).
	uids := []string{
		"6f1c2a7e-0d1b-4c55-9a43-1b2f3c4d5e01",
		"b2e4f6a8-1c3d-4e5f-8a9b-0c1d2e3f4a02",
		"0a9b8c7d-6e5f-4a3b-2c1d-0e9f8a7b6c03",
		"d4c3b2a1-9f8e-4d7c-6b5a-4f3e2d1c0b04",
		"7e6d5c4b-3a2f-4e1d-0c9b-8a7f6e5d4c05",
		"1f2e3d4c-5b6a-4798-8a9b-acbdcedf0106",
	}
	slots := map[int64]bool{}
	amounts := make([][]int64, len(uids))
	keys := make([]store.Keys, len(uids))
	for i, uid := range uids {
		k := keysOf(uid)
		keys[i] = k
		var slot int64 = -1
		for _, key := range k.All() {
			s, err := cc.ClusterKeySlot(ctx, key).Result()
			if err != nil {
				t.Fatalf("CLUSTER KEYSLOT %s: %v", key, err)
			}
			if slot >= 0 && s != slot {
				t.Fatalf("activity %s: key %s is on slot %d, others on %d", uid, key, s, slot)
			}
			slot = s
		}
		slots[slot] = true
		amounts[i] = splitOrFail(t, []string{split.TypeRandom, split.TypeLineCut, split.TypeFixed}[i%3], int64(1000+i*37), 5)
	}
	if len(slots) < 2 {
		t.Fatalf("all %d activities hash to one slot", len(uids))
	}

	// Seed every activity concurrently, with small chunks, then run 100 users at
	// each of them concurrently.
	var wg sync.WaitGroup
	errs := make([]error, len(uids))
	for i := range uids {
		wg.Go(func() {
			_, errs[i] = seeding(cc, keys[i], store.Seeder{ChunkSize: 2}).Seed(ctx, amounts[i], store.SeedParams{Count: 5, Total: sumOf(amounts[i]), Sponsor: sponsor})
			if errs[i] == nil {
				_, errs[i] = handle(cc, keys[i]).Configure(ctx, 0, 0, false, true)
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("seeding %s: %v", uids[i], err)
		}
	}
	answers := make([][]answer, len(uids))
	for i := range uids {
		wg.Go(func() {
			answers[i], errs[i] = grabAll(ctx, cc, keys[i], userIDs("user-", 100), 25)
		})
	}
	wg.Wait()
	for i := range uids {
		if errs[i] != nil {
			t.Fatalf("grabs on %s: %v", uids[i], errs[i])
		}
		counts, grants := tally(t, answers[i])
		if counts[store.Granted] != 5 || counts[store.SoldOut] != 95 {
			t.Fatalf("activity %s: outcomes %v, want 5 granted and 95 sold_out", uids[i], counts)
		}
		if got, want := grantsSum(grants), sumOf(amounts[i]); got != want {
			t.Fatalf("activity %s: granted %d, want %d", uids[i], got, want)
		}
		verify(t, ctx, cc, keys[i], amounts[i], grants)
		cr, err := handle(cc, keys[i]).Close(ctx, store.CloseExhausted)
		if err != nil || cr.Outcome != store.Closed || cr.Refunded != 0 {
			t.Fatalf("closing %s: %+v, %v", uids[i], cr, err)
		}
	}
}

// Grabs through an auto-pipeliner on the cluster client, after the scripts were
// flushed on every master.
func testClusterAutoPipelineAfterFlush(t *testing.T, cluster *redistest.Cluster) {
	ctx := redistest.Context(t)
	cc := cluster.Client(t)
	ap, err := cc.AutoPipelineWithOptions(redisconn.GrabPipelineOptions())
	if err != nil {
		t.Fatal(err)
	}
	amounts := splitOrFail(t, split.TypeRandom, 100_000, 1000)
	var ks []store.Keys
	for i := range 3 {
		ks = append(ks, seedOpen(t, ctx, cc, fmt.Sprintf("cluster-ap-%d", i), amounts))
	}
	if err := cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
		return node.ScriptFlush(ctx).Err()
	}); err != nil {
		t.Fatal(err)
	}
	for _, k := range ks {
		counts, grants := tally(t, grabConcurrently(t, ctx, ap, k, userIDs("z", 1500), 100))
		if counts[store.Granted] != 1000 || counts[store.SoldOut] != 500 {
			t.Fatalf("outcomes %v, want 1000 granted and 500 sold_out", counts)
		}
		verify(t, ctx, cc, k, amounts, grants)
	}
}
