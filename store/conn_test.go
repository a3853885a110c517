package store_test

import (
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

func TestConnReachesRealServer(t *testing.T) {
	ctx := redistest.Context(t)
	s := redistest.Start(t)
	c := s.Conn().NewClient()
	defer c.Close()
	if err := lua.LoadAll(ctx, c); err != nil {
		t.Fatalf("LoadAll through a standalone connection: %v", err)
	}
	amounts := []int64{5, 6, 7}
	k := seedOpen(t, ctx, c, "conn-standalone", amounts)
	_, grants := tally(t, grabConcurrently(t, ctx, c, k, userIDs("q", 5), 5))
	verify(t, ctx, c, k, amounts, grants)
}

// The grab path's pipelined client reaches a real server through both its plain
// client and its auto-pipeliner.
func TestPipelinedClientReachesRealServer(t *testing.T) {
	ctx := redistest.Context(t)
	s := redistest.Start(t)
	pc, err := s.Conn().NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	amounts := []int64{5, 6, 7}
	seedOpen(t, ctx, pc.Client, "pipelined", amounts)
	a := store.NewActivity(pc.Pipeliner, "pipelined", 1).Shard(0)
	if err := store.NewActivity(pc.Client, "pipelined", 1).Ping(ctx); err != nil {
		t.Fatalf("ping: %v", err)
	}
	res, err := a.Grab(ctx, "p1")
	if err != nil || res.Outcome != store.Granted {
		t.Fatalf("grab through the auto-pipeliner: %+v, %v", res, err)
	}
	if snap, err := store.NewActivity(pc.Pipeliner, "pipelined", 1).Snapshot(ctx); err != nil || snap.ClaimedCount != 1 {
		t.Fatalf("snapshot through the auto-pipeliner: %+v, %v", snap, err)
	}
	if err := pc.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if _, err := a.Grab(ctx, "p2"); err == nil {
		t.Fatal("a grab went through after the close")
	}
}

// SafeErrors changes nothing a caller decides on: the script cache fallback, the
// consumer group's BUSYGROUP and NOGROUP, and redis.Nil.
func TestSafeErrorsKeepTheDecisions(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv := redistest.Start(t)
	c := srv.Conn().NewClient(redisconn.ClientOptions{SafeErrors: true})
	t.Cleanup(func() { _ = c.Close() })
	seedOpen(t, ctx, c, "safe", splitOrFail(t, split.TypeFixed, 300, 3))
	if err := c.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	a := store.NewActivity(c, "safe", 1).Shard(0)
	if res, err := a.Grab(ctx, "u1"); err != nil || res.Outcome != store.Granted {
		t.Fatalf("grab after SCRIPT FLUSH: %+v, %v (the NOSCRIPT fallback)", res, err)
	}
	if _, err := a.ReadNew(ctx, "g", "w", 1, 0); !errors.Is(err, store.ErrNoGroup) {
		t.Fatalf("read without a group: %v, want ErrNoGroup", err)
	}
	for range 2 {
		if err := a.EnsureGroup(ctx, "g"); err != nil {
			t.Fatalf("EnsureGroup twice (BUSYGROUP): %v", err)
		}
	}
	if err := c.Get(ctx, "missing").Err(); err != redis.Nil {
		t.Fatalf("GET of a missing key: %v, want redis.Nil itself", err)
	}
	pipe := c.Pipeline()
	pipe.Ping(ctx)
	bad := pipe.Do(ctx, "no-such-command")
	if _, err := pipe.Exec(ctx); err == nil || err.Error() != "ERR Redis answered with an error" || bad.Err() == nil ||
		bad.Err().Error() != "ERR Redis answered with an error" {
		t.Fatalf("pipeline: %v, command %v", err, bad.Err())
	}
}
