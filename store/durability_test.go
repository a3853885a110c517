package store_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// primaryWithReplica starts a primary and one replica of it, and waits until the
// replica is in sync.
func primaryWithReplica(t *testing.T) (primary, replica *redis.Client) {
	t.Helper()
	p := redistest.Start(t)
	r, err := redistest.StartReplicaProcess(t.TempDir(), p, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Stop)
	primary, replica = p.Client(t), r.Client(t)
	deadline := time.Now().Add(10 * time.Second)
	for {
		info, _ := replica.Info(t.Context(), "replication").Result()
		if strings.Contains(info, "master_link_status:up") {
			return primary, replica
		}
		if time.Now().After(deadline) {
			t.Fatalf("the replica did not sync: %s", info)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Grants answered after ReplicaWaiter.Wait are on the replica, with one WAIT for
// many grabs; without a replica, Wait fails with ErrNotReplicated and the grant
// stays.
func TestReplicaWaiter(t *testing.T) {
	ctx := redistest.Context(t)
	primary, replica := primaryWithReplica(t)
	k := seedOpen(t, ctx, primary, "durable", splitOrFail(t, "Random", 100_000, 1000))
	h := store.NewActivity(primary, "durable", 1).Shard(0)
	if err := h.CheckReplicas(ctx, 1); err != nil {
		t.Fatalf("one replica connected: %v", err)
	}
	if err := h.CheckReplicas(ctx, 2); !errors.Is(err, store.ErrDurabilityNotMet) {
		t.Fatalf("two replicas asked, one connected: %v, want ErrDurabilityNotMet", err)
	}

	w := store.NewActivity(primary, "durable", 1).Shard(0).ReplicaWaiter(1, 500*time.Millisecond)
	defer w.Close()
	const grabs = 200
	var wg sync.WaitGroup
	users := make(chan string, grabs)
	for i := range grabs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			user := fmt.Sprintf("user-%d", i)
			res, err := h.Grab(ctx, user)
			if err != nil || res.Outcome != store.Granted {
				t.Errorf("grab: %+v %v", res, err)
				return
			}
			if err := w.Wait(ctx); err != nil {
				t.Errorf("wait: %v", err)
				return
			}
			// Acknowledged: the replica must hold it now.
			if got, err := replica.HGet(ctx, k.Claims, user).Result(); err != nil || got == "" {
				t.Errorf("claim of %s not on the replica after Wait: %q %v", user, got, err)
			}
			users <- user
		}()
	}
	wg.Wait()
	close(users)
	if len(users) != grabs {
		t.Fatalf("%d of %d grabs acknowledged", len(users), grabs)
	}
	seq, err := primary.HGet(ctx, k.Meta, "durable_seq").Int64()
	if err != nil || seq >= grabs {
		t.Errorf("%d WAITs for %d grabs (%v): they were not batched", seq, grabs, err)
	}
	t.Logf("%d grabs acknowledged after %d WAITs", grabs, seq)

	// The replica leaves: a grant is not acknowledged, and stays granted.
	if err := replica.ReplicaOf(ctx, "NO", "ONE").Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	res, err := h.Grab(ctx, "after-the-replica-left")
	if err != nil || res.Outcome != store.Granted {
		t.Fatalf("grab: %+v %v", res, err)
	}
	if err := w.Wait(ctx); !errors.Is(err, store.ErrNotReplicated) {
		t.Fatalf("wait without a replica: %v, want ErrNotReplicated", err)
	}
	again, err := h.Grab(ctx, "after-the-replica-left")
	if err != nil || again.Outcome != store.AlreadyClaimed || again.PacketID != res.PacketID {
		t.Fatalf("retry: %+v %v, want already_claimed of packet %s", again, err, res.PacketID)
	}
}

// CheckFsync accepts only appendonly yes with appendfsync always.
func TestCheckFsync(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	h := store.NewActivity(c, "fsync", 1).Shard(0)
	if err := h.CheckFsync(ctx); !errors.Is(err, store.ErrDurabilityNotMet) {
		t.Fatalf("a server without AOF: %v, want ErrDurabilityNotMet", err)
	}
	if err := c.ConfigSet(ctx, "appendonly", "yes").Err(); err != nil {
		t.Fatal(err)
	}
	if err := h.CheckFsync(ctx); !errors.Is(err, store.ErrDurabilityNotMet) {
		t.Fatalf("AOF everysec: %v, want ErrDurabilityNotMet", err)
	}
	if err := c.ConfigSet(ctx, "appendfsync", "always").Err(); err != nil {
		t.Fatal(err)
	}
	if err := h.CheckFsync(ctx); err != nil {
		t.Fatalf("AOF always: %v", err)
	}
}
