package store_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// errClientDied is what a client that died answers to every call after its last.
var errClientDied = errors.New("the seeding process died before this call")

// diesAfter lets the first `calls` round trips of its client reach Redis and
// refuses every later one before it is sent: the client's process died between round
// trip `calls` and the next. A round trip is one command or one pipeline (a MULTI/EXEC
// is one), so every point at which Redis can be left by a seeder is a boundary.
type diesAfter struct {
	calls int64
	n     atomic.Int64
	// died is set once a call was refused.
	died atomic.Bool
}

func (h *diesAfter) pass() bool {
	if h.n.Add(1) > h.calls {
		h.died.Store(true)
		return false
	}
	return true
}

func (h *diesAfter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *diesAfter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !h.pass() {
			cmd.SetErr(errClientDied)
			return errClientDied
		}
		return next(ctx, cmd)
	}
}

func (h *diesAfter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if !h.pass() {
			for _, c := range cmds {
				c.SetErr(errClientDied)
			}
			return errClientDied
		}
		return next(ctx, cmds)
	}
}

// A seed interrupted at any step boundary is completed by the next reconcile with
// the exact figures: for k = 0, 1, 2, ... the seeder's client dies after its k-th
// round trip to a real redis-server (a go-redis hook refuses every later call before
// it is sent, so Redis holds exactly what the first k calls wrote), then a fresh
// client does what the controller's next reconcile does (store level:
// reconcileSeed): it reads the snapshot, seeds only when the activity is not in
// Redis as a whole, and adopts it otherwise. The activity then opens with the
// spec's count and total on shard 0 (activity_count, activity_total, shards), every
// packet listed once with its seeded amount, and conservation holding. k grows until
// the interrupted seed finishes without being cut, so every boundary is covered,
// with several staging chunks per shard, for one shard and for three, and with
// staging by transaction (the default) and by script.
func TestSeedCrashAtEveryStepBoundary(t *testing.T) {
	srv := redistest.Start(t)
	ctx := redistest.Context(t)
	const total, count = 9_001, 30
	amounts := splitOrFail(t, split.TypeRandom, total, count)
	for _, tc := range []struct {
		shards     int
		scriptOnly bool
	}{{1, false}, {3, false}, {3, true}} {
		t.Run(fmt.Sprintf("shards=%d/scriptOnly=%v", tc.shards, tc.scriptOnly), func(t *testing.T) {
			boundaries := 0
			for k := int64(0); ; k++ {
				uid := fmt.Sprintf("crash-%d-%v-%d", tc.shards, tc.scriptOnly, k)
				hook := &diesAfter{calls: k}
				dying := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: srv.Username, Password: srv.Password, MaxRetries: -1})
				dying.AddHook(hook)
				act := store.NewActivity(dying, uid, tc.shards)
				// Chunks of 4: 10 packets a shard is three chunks on each of 3 shards.
				act.Seeder = store.Seeder{ChunkSize: 4, ScriptOnly: tc.scriptOnly}
				_, err := act.Seed(ctx, amounts, seedParams(amounts))
				_ = dying.Close()
				if !hook.died.Load() {
					if err != nil {
						t.Fatalf("seed with no interruption: %v", err)
					}
					t.Logf("%d step boundaries covered", boundaries)
					if boundaries < 2*tc.shards*3 {
						t.Fatalf("only %d boundaries: the seed did not go through several chunks per shard", boundaries)
					}
					return
				}
				if err == nil {
					t.Fatalf("k=%d: the seed returned no error although its client died", k)
				}
				boundaries++
				reconcileSeedThenOpen(t, ctx, srv.Client(t), uid, tc.shards, amounts, k)
			}
		})
	}
}

func seedParams(amounts []int64) store.SeedParams {
	return store.SeedParams{Count: int64(len(amounts)), Total: sumOf(amounts), Sponsor: sponsor, Currency: "CNY"}
}

// reconcileSeedThenOpen does on a fresh client what the controller's next reconcile
// does with an activity whose seed was cut after k round trips, and checks the result.
func reconcileSeedThenOpen(t *testing.T, ctx context.Context, c *redis.Client, uid string, shards int, amounts []int64, k int64) {
	t.Helper()
	act := store.NewActivity(c, uid, shards)
	snap, err := act.Snapshot(ctx)
	if err != nil {
		t.Fatalf("k=%d: snapshot: %v", k, err)
	}
	if !snap.Exists() {
		if _, err := act.Seed(ctx, amounts, seedParams(amounts)); err != nil {
			t.Fatalf("k=%d: seeding again: %v", k, err)
		}
	}
	if snap, err = act.Snapshot(ctx); err != nil {
		t.Fatal(err)
	}
	count, total := int64(len(amounts)), sumOf(amounts)
	// The controller's check before it adopts (SpecMismatch otherwise).
	if snap.Count != count || snap.Total != total {
		t.Fatalf("k=%d: Redis holds %d packets summing to %d, the spec says %d summing to %d",
			k, snap.Count, snap.Total, count, total)
	}
	if r, err := act.ConfigureWith(ctx, store.Settings{Open: true}); err != nil || r.State != store.StateOpen {
		t.Fatalf("k=%d: opening: %+v, %v", k, r, err)
	}
	root := act.Shard(0).Keys().Meta
	meta, err := c.HMGet(ctx, root, "activity_count", "activity_total", "shards").Result()
	if err != nil {
		t.Fatal(err)
	}
	if shards > 1 && (meta[0] != strconv.FormatInt(count, 10) || meta[1] != strconv.FormatInt(total, 10) || meta[2] != strconv.Itoa(shards)) {
		t.Fatalf("k=%d: shard 0 records activity_count %v, activity_total %v, shards %v; want %d, %d, %d",
			k, meta[0], meta[1], meta[2], count, total, shards)
	}
	v, err := act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if v.Whole.State != store.StateOpen || v.Whole.RemainingCount != count || v.Whole.StagedCount != 0 || !v.Conservation().Zero() {
		t.Fatalf("k=%d: after the reconcile: state %q, %d listed, %d staged, imbalance %+v; want open with %d listed",
			k, v.Whole.State, v.Whole.RemainingCount, v.Whole.StagedCount, v.Conservation(), count)
	}
	seen := map[string]bool{}
	var listed int64
	for i := range shards {
		packets, err := act.Shard(i).Listed(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range packets {
			if seen[p.ID] {
				t.Fatalf("k=%d: packet %s listed twice", k, p.ID)
			}
			seen[p.ID] = true
			id, err := strconv.Atoi(p.ID)
			if err != nil || id < 1 || id > len(amounts) || amounts[id-1] != p.Amount {
				t.Fatalf("k=%d: packet %s of %d listed, not a seeded packet", k, p.ID, p.Amount)
			}
			listed += p.Amount
		}
	}
	if int64(len(seen)) != count || listed != total {
		t.Fatalf("k=%d: %d packets summing to %d listed, want %d summing to %d", k, len(seen), listed, count, total)
	}
}
