package controllers_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
)

// diesAfterCommits lets its client's calls through until `commits` seed_commit
// scripts have run, and refuses every later call before it is sent: the seeding
// process died right after that shard's commit.
type diesAfterCommits struct {
	commits int64
	seen    atomic.Int64
}

var errSeederDied = errors.New("the seeding process died")

func (h *diesAfterCommits) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *diesAfterCommits) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.seen.Load() >= h.commits {
			cmd.SetErr(errSeederDied)
			return errSeederDied
		}
		err := next(ctx, cmd)
		if args := cmd.Args(); err == nil && len(args) > 1 && (args[0] == "evalsha" || args[0] == "eval") {
			if s, _ := args[1].(string); s == lua.SeedCommitScript.SHA() || s == lua.SeedCommitScript.Source() {
				h.seen.Add(1)
			}
		}
		return err
	}
}

func (h *diesAfterCommits) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.seen.Load() >= h.commits {
			for _, c := range cmds {
				c.SetErr(errSeederDied)
			}
			return errSeederDied
		}
		return next(ctx, cmds)
	}
}

// A sharded seed cut right after a shard's commit, as when the controller stops or
// loses its lease there, is completed by the next controller: after shard 0's commit
// (the others are not committed: the activity is not in Redis as a whole, and the
// controller seeds on), and after the last shard's commit (every shard is committed:
// the controller adopts it, which needs the activity's count and total that shard 0's
// commit recorded). Either way the activity becomes Active with the spec's count and
// total, exactly its split's packets listed.
func TestShardedSeedCutAfterACommitIsCompletedByTheController(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// Sharding needs durability; this Redis fsyncs every write.
	for k, v := range map[string]string{"appendonly": "yes", "appendfsync": "always"} {
		if err := e.rdb.ConfigSet(context.Background(), k, v).Err(); err != nil {
			t.Fatal(err)
		}
	}
	const shards, total, count = 3, 90_001, 300
	for _, cut := range []int64{1, shards} {
		name := fmt.Sprintf("cut-after-commit-%d", cut)
		a := e.create(e.activity(name, total, count, func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Spec.Shards = shards
			a.Spec.Durability = &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityFsync}
		}))
		amounts, err := split.Split(split.Params{Type: split.TypeRandom, Total: total, Count: count, Min: 1,
			Seed: split.SeedFromUID(string(a.UID))})
		if err != nil {
			t.Fatal(err)
		}
		// The seeding process that dies, on its own client.
		dying := redis.NewClient(&redis.Options{Addr: e.redis.Addr, Username: e.redis.Username, Password: e.redis.Password, MaxRetries: -1})
		dying.AddHook(&diesAfterCommits{commits: cut})
		h := store.NewActivity(dying, string(a.UID), shards)
		h.Seeder = store.Seeder{ChunkSize: 40}
		_, err = h.Seed(context.Background(), amounts, store.SeedParams{Count: count, Total: total, Sponsor: "merchant-001", Currency: "CNY"})
		_ = dying.Close()
		if cut < shards && !errors.Is(err, errSeederDied) {
			t.Fatalf("cut after commit %d: seed returned %v, want the cut", cut, err)
		}
		committed := 0
		for i := range shards {
			if ok, _ := e.rdb.HExists(context.Background(), e.handle(a).Shard(i).Keys().Meta, "state").Result(); ok {
				committed++
			}
		}
		if int64(committed) != cut {
			t.Fatalf("cut after commit %d: %d shards committed", cut, committed)
		}
	}

	e.startController(nil)
	for _, cut := range []int64{1, shards} {
		name := fmt.Sprintf("cut-after-commit-%d", cut)
		a := e.waitPhase(name, redpacketv1alpha1.PhaseActive, 60*time.Second)
		v, err := e.handle(a).ReadShards(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if v.Whole.Count != count || v.Whole.Total != total || v.Whole.RemainingCount != count || !v.Conservation().Zero() {
			t.Fatalf("%s: Redis holds %d packets summing to %d, %d listed, imbalance %+v; want %d summing to %d",
				name, v.Whole.Count, v.Whole.Total, v.Whole.RemainingCount, v.Conservation(), count, total)
		}
		seen := map[string]bool{}
		var sum int64
		for i := range shards {
			packets, err := e.handle(a).Shard(i).Listed(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range packets {
				if seen[p.ID] {
					t.Fatalf("%s: packet %s listed twice", name, p.ID)
				}
				seen[p.ID] = true
				sum += p.Amount
			}
		}
		if len(seen) != count || sum != total {
			t.Fatalf("%s: %d packets summing to %d listed, want %d summing to %d", name, len(seen), sum, count, total)
		}
	}
}
