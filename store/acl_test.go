package store_test

import (
	"context"
	"errors"
	"fmt"

	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// operatorPassword is the password of the Redis admin user in the ACL tests: the
// operator's own credentials.
const operatorPassword = "operator-secret-pw"

// protectedRedis starts a redis-server whose admin user (the operator's) has
// operatorPassword, and returns it with a client logged in as the operator.
func protectedRedis(t *testing.T) (*redistest.Server, redis.UniversalClient) {
	return redistest.StartProtected(t, operatorPassword)
}

// userConn is the connection an activity's grab pods get: the Redis's addresses
// with the activity's user and password.
func userConn(addrs []string, mode, uid, password string) redisconn.Conn {
	return redisconn.Conn{Addresses: addrs, Mode: mode, Username: store.NewActivity(nil, uid, 1).UserName(), Password: password}
}

// isNoPerm reports whether err is Redis refusing the command or key under the ACL,
// directly (NOPERM) or inside a script (which Redis 7 reports as ERR).
func isNoPerm(err error) bool {
	if err == nil {
		return false
	}
	msg := err.Error()
	return strings.Contains(msg, "NOPERM") || strings.Contains(msg, "can't run this command") ||
		strings.Contains(msg, "can't access at least one of the keys")
}

// The activity's user runs everything the grab pods run on its own activity, and
// nothing else: another activity's keys, and the server-wide commands, are refused.
func TestActivityUserIsConfinedToItsActivity(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	const own, other, group = "act-own", "act-other", "settlement"
	seedOpen(t, ctx, op, own, splitOrFail(t, split.TypeFixed, 600, 6))
	otherKeys := seedOpen(t, ctx, op, other, splitOrFail(t, split.TypeFixed, 600, 6))
	otherBefore, err := handle(op, otherKeys).Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}

	change, err := store.NewActivity(op, own, 1).EnsureUser(ctx, "own-pw-0123456789")
	if err != nil || change != (store.UserChange{Nodes: 1, Set: 1}) {
		t.Fatalf("first EnsureUser: %+v, %v; want the user set on the one node", change, err)
	}
	if change, err := store.NewActivity(op, own, 1).EnsureUser(ctx, "own-pw-0123456789"); err != nil || change != (store.UserChange{Nodes: 1}) {
		t.Fatalf("second EnsureUser: %+v, %v; want nothing to change", change, err)
	}

	// The grab path, as the grab service opens it: the auto-pipeliner, calling the
	// grab-side functions (FCALL); the script cache, flushed, plays no part.
	if err := op.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	conn := userConn([]string{srv.Addr}, redisconn.ModeStandalone, own, "own-pw-0123456789")
	pc, err := conn.NewPipelinedClient(redisconn.GrabClientOptions(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pc.Close() })
	grabber := store.NewActivity(pc.Pipeliner, own, 1).Shard(0)
	for _, u := range []string{"u1", "u2", "u3"} {
		if res, err := grabber.Grab(ctx, u); err != nil || res.Outcome != store.Granted {
			t.Fatalf("grab for %s with the activity's user: %+v, %v", u, res, err)
		}
	}
	if snap, err := store.NewActivity(pc.Pipeliner, own, 1).Snapshot(ctx); err != nil || snap.ClaimedCount != 3 {
		t.Fatalf("snapshot with the activity's user: %+v, %v", snap, err)
	}
	if err := store.NewActivity(pc.Client, own, 1).Ping(ctx); err != nil {
		t.Fatalf("readiness ping with the activity's user: %v", err)
	}

	// Settlement is the operator's: the activity's user may not read the consumer
	// group, acknowledge or dead-letter (issue 24: the grab pods stop settling). The
	// operator does it here, and the user replays the dead letter it parked.
	uc := conn.NewClient()
	t.Cleanup(func() { _ = uc.Close() })
	w := store.NewActivity(uc, own, 1).Shard(0)
	opShard := store.NewActivity(op, own, 1).Shard(0)
	if err := w.EnsureGroup(ctx, group); !isNoPerm(err) {
		t.Fatalf("creating the consumer group as the activity's user: %v; want NOPERM", err)
	}
	if err := opShard.EnsureGroup(ctx, group); err != nil {
		t.Fatalf("creating the consumer group as the operator: %v", err)
	}
	if _, err := w.ReadNew(ctx, group, "w1", 10, 100*time.Millisecond); !isNoPerm(err) {
		t.Fatalf("reading new entries as the activity's user: %v; want NOPERM", err)
	}
	entries, err := opShard.ReadNew(ctx, group, "operator-0", 10, 100*time.Millisecond)
	if err != nil || len(entries) != 3 {
		t.Fatalf("reading new entries as the operator: %v, %v", entries, err)
	}
	ids := []string{entries[0].ID, entries[1].ID, entries[2].ID}
	if _, err := w.DeliveryCounts(ctx, group, "operator-0", ids); !isNoPerm(err) {
		t.Errorf("delivery counts as the activity's user: %v; want NOPERM", err)
	}
	if _, err := w.ClaimForRetry(ctx, group, "w1", ids[1], 0); !isNoPerm(err) {
		t.Errorf("claiming as the activity's user: %v; want NOPERM", err)
	}
	if _, _, err := w.ClaimIdle(ctx, group, "w2", 0, "0-0", 10); !isNoPerm(err) {
		t.Errorf("taking over entries as the activity's user: %v; want NOPERM", err)
	}
	if _, err := w.Ack(ctx, group, ids[0], entries[0].Kind, 1<<40); !isNoPerm(err) {
		t.Errorf("acknowledging as the activity's user: %v; want NOPERM", err)
	}
	if _, err := w.DeadLetter(ctx, group, ids[1], "mallory", entries[1].FieldValues()); !isNoPerm(err) {
		t.Errorf("dead-lettering as the activity's user: %v; want NOPERM", err)
	}
	if ok, err := opShard.DeadLetter(ctx, group, ids[1], "webhook answered 500", entries[1].FieldValues()); err != nil || !ok {
		t.Fatalf("dead-lettering as the operator: %v, %v", ok, err)
	}
	if n, err := w.StreamLen(ctx); err != nil || n != 3 {
		t.Fatalf("stream length %d, %v; want 3", n, err)
	}
	// The dead letters are read-only to the activity's user: the operator (kubectl
	// rpa replay-dead-letters with the operator's user) replays them.
	if moved, err := w.ReplayDeadLetters(ctx, 0); !isNoPerm(err) || moved != 0 {
		t.Fatalf("replaying dead letters as the activity's user: %d, %v; want NOPERM", moved, err)
	}
	if moved, err := opShard.ReplayDeadLetters(ctx, 0); err != nil || moved != 1 {
		t.Fatalf("replaying dead letters: %d, %v; want 1", moved, err)
	}

	// Another activity's keys: through the scripts, directly, and from a script that
	// does not declare them.
	stranger := store.NewActivity(uc, other, 1).Shard(0)
	if res, err := stranger.Grab(ctx, "thief"); !isNoPerm(err) {
		t.Errorf("grab of another activity: %+v, %v; want NOPERM", res, err)
	}
	if _, err := store.NewActivity(uc, other, 1).Snapshot(ctx); !isNoPerm(err) {
		t.Errorf("snapshot of another activity: %v; want NOPERM", err)
	}
	foreign := [][]any{
		{"hgetall", otherKeys.Meta},
		{"hset", otherKeys.Meta, "paused", "1"},
		{"lpop", otherKeys.Packets},
		{"hget", otherKeys.Claims, "u1"},
		{"xadd", otherKeys.Stream, "*", "kind", "grant", "packet", "1", "user", "thief", "amount", "100", "at", "0"},
		{"xrange", otherKeys.Stream, "-", "+"},
		{"eval", "return redis.call('LPOP', KEYS[1])", "1", otherKeys.Packets},
		{"eval", "return redis.call('LPOP', '" + otherKeys.Packets + "')", "0"},
		{"get", "unrelated-key"},
	}
	for _, cmd := range foreign {
		if err := uc.Do(ctx, cmd...).Err(); !isNoPerm(err) {
			t.Errorf("%v with another activity's key: %v; want NOPERM", cmd[:2], err)
		}
	}

	// Commands no grab pod needs, on the whole server.
	serverWide := [][]any{
		{"flushall"}, {"flushdb"}, {"config", "get", "requirepass"}, {"config", "set", "maxmemory", "1"},
		{"script", "flush"}, {"script", "load", "return 1"}, {"keys", "*"}, {"scan", "0"}, {"dbsize"},
		{"acl", "list"}, {"acl", "setuser", store.NewActivity(nil, own, 1).UserName(), "+@all", "~*"}, {"client", "list"},
		{"client", "kill", "type", "normal"}, {"slowlog", "reset"}, {"info"}, {"select", "1"},
		{"swapdb", "0", "1"}, {"publish", "ch", "x"}, {"function", "flush"}, {"save"}, {"replicaof", "no", "one"},
		{"eval", "return redis.call('FLUSHALL')", "0"},
	}
	for _, cmd := range serverWide {
		if err := uc.Do(ctx, cmd...).Err(); !isNoPerm(err) {
			t.Errorf("%v with the activity's user: %v; want NOPERM", cmd, err)
		}
	}

	// The other activity is as it was, and the server still holds both.
	otherAfter, err := handle(op, otherKeys).Snapshot(ctx)
	if err != nil || otherAfter != otherBefore {
		t.Errorf("the other activity changed: %+v, was %+v (%v)", otherAfter, otherBefore, err)
	}
	if n, err := op.DBSize(ctx).Result(); err != nil || n < 6 {
		t.Errorf("DBSIZE %d, %v after the refused flushes", n, err)
	}
}

// A new password is a rotation: the old password stops working, also for the
// connections already logged in with it. A user someone widened is narrowed again.
// DeleteUser removes the user and its connections.
func TestActivityUserRotationRepairAndDeletion(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	const uid = "act-rotate"
	h := store.NewActivity(op, uid, 1).Shard(0)
	if _, err := h.EnsureUser(ctx, "first-password-0123"); err != nil {
		t.Fatal(err)
	}
	first := userConn([]string{srv.Addr}, redisconn.ModeStandalone, uid, "first-password-0123").
		NewClient(redisconn.ClientOptions{PoolSize: 1, MaxRetries: -1})
	t.Cleanup(func() { _ = first.Close() })
	if err := first.Ping(ctx).Err(); err != nil {
		t.Fatalf("ping with the first password: %v", err)
	}

	change, err := h.EnsureUser(ctx, "second-password-456")
	if err != nil || change != (store.UserChange{Nodes: 1, Set: 1, Rotated: 1}) {
		t.Fatalf("rotation: %+v, %v", change, err)
	}
	if err := first.Ping(ctx).Err(); err == nil {
		t.Error("a connection logged in with the old password still works after the rotation")
	}
	if err := first.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "WRONGPASS") {
		t.Errorf("reconnecting with the old password: %v, want WRONGPASS", err)
	}
	second := userConn([]string{srv.Addr}, redisconn.ModeStandalone, uid, "second-password-456").NewClient()
	t.Cleanup(func() { _ = second.Close() })
	if err := second.Ping(ctx).Err(); err != nil {
		t.Fatalf("ping with the new password: %v", err)
	}

	// Someone widens the user; the next EnsureUser narrows it again, keeping the
	// password (and the connections logged in with it).
	if err := op.Do(ctx, "acl", "setuser", store.NewActivity(nil, uid, 1).UserName(), "~*", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	if err := second.Set(ctx, "anything", "x", 0).Err(); err != nil {
		t.Fatalf("the widened user: %v", err)
	}
	if change, err := h.EnsureUser(ctx, "second-password-456"); err != nil || change != (store.UserChange{Nodes: 1, Set: 1}) {
		t.Fatalf("repair: %+v, %v", change, err)
	}
	if err := second.Set(ctx, "anything", "y", 0).Err(); !isNoPerm(err) {
		t.Errorf("SET after the repair: %v, want NOPERM", err)
	}
	if err := second.Ping(ctx).Err(); err != nil {
		t.Errorf("the repair closed a connection with the current password: %v", err)
	}

	if n, err := h.DeleteUser(ctx); err != nil || n != 1 {
		t.Fatalf("DeleteUser: %d, %v", n, err)
	}
	if err := second.Ping(ctx).Err(); err == nil {
		t.Error("a connection of the deleted user still works")
	}
	if err := op.Do(ctx, "acl", "getuser", store.NewActivity(nil, uid, 1).UserName()).Err(); !errors.Is(err, redis.Nil) {
		t.Errorf("ACL GETUSER after DeleteUser: %v, want no such user", err)
	}
	if n, err := h.DeleteUser(ctx); err != nil || n != 0 {
		t.Errorf("DeleteUser of a missing user: %d, %v", n, err)
	}
}

// An operator's Redis user that may not manage ACL users gets ErrACLUnavailable, and
// no user is created.
func TestEnsureUserWithoutACLPermission(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	if err := op.Do(ctx, "acl", "setuser", "ops", "on", ">ops-pw", "~*", "&*", "+@all", "-acl").Err(); err != nil {
		t.Fatal(err)
	}
	limited := redisconn.Conn{Addresses: []string{srv.Addr}, Mode: redisconn.ModeStandalone, Username: "ops", Password: "ops-pw"}.NewClient()
	t.Cleanup(func() { _ = limited.Close() })
	h := store.NewActivity(limited, "act-noacl", 1).Shard(0)
	if _, err := h.EnsureUser(ctx, "some-password-1234"); !errors.Is(err, store.ErrACLUnavailable) {
		t.Fatalf("EnsureUser without ACL permission: %v, want ErrACLUnavailable", err)
	}
	if _, err := h.DeleteUser(ctx); !errors.Is(err, store.ErrACLUnavailable) {
		t.Fatalf("DeleteUser without ACL permission: %v, want ErrACLUnavailable", err)
	}
	if err := op.Do(ctx, "acl", "getuser", store.NewActivity(nil, "act-noacl", 1).UserName()).Err(); !errors.Is(err, redis.Nil) {
		t.Errorf("ACL GETUSER: %v, want no such user", err)
	}
}

// On a cluster with replicas, the user is set on every node, so a failover to a
// replica keeps the activity's grab pods working; the activity's user reaches its
// slot through any seed node and nothing else.
func TestActivityUserOnClusterFailover(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	cluster := redistest.StartReplicatedCluster(t, 3, 1)
	// The operator's client as the controller opens it, with safe errors, which must
	// not keep it from following the cluster's redirects.
	op := redisconn.Conn{Addresses: cluster.Addrs[:1], Mode: redisconn.ModeCluster, Username: cluster.Username, Password: cluster.Password}.NewClient(redisconn.ClientOptions{SafeErrors: true})
	t.Cleanup(func() { _ = op.Close() })
	cc := op.(*redis.ClusterClient)
	const uid = "act-cluster"
	k := seedOpen(t, ctx, op, uid, splitOrFail(t, split.TypeFixed, 1000, 10))

	change, err := store.NewActivity(op, uid, 1).EnsureUser(ctx, "cluster-password-42")
	if err != nil || change != (store.UserChange{Nodes: 6, Set: 6}) {
		t.Fatalf("EnsureUser on the cluster: %+v, %v; want the user on all 6 nodes", change, err)
	}
	for _, addr := range cluster.Addrs {
		node := redis.NewClient(cluster.NodeOptions(addr))
		err := node.Do(ctx, "acl", "getuser", store.NewActivity(nil, uid, 1).UserName()).Err()
		_ = node.Close()
		if err != nil {
			t.Errorf("node %s does not hold the user: %v", addr, err)
		}
	}

	uc := userConn(cluster.Addrs[:1], redisconn.ModeCluster, uid, "cluster-password-42").NewClient()
	t.Cleanup(func() { _ = uc.Close() })
	h := store.NewActivity(uc, uid, 1).Shard(0)
	if res, err := h.Grab(ctx, "before-failover"); err != nil || res.Outcome != store.Granted {
		t.Fatalf("grab with the activity's user on the cluster: %+v, %v", res, err)
	}
	if _, err := store.NewActivity(uc, "act-elsewhere", 1).Snapshot(ctx); !isNoPerm(err) {
		t.Errorf("snapshot of another activity on the cluster: %v; want NOPERM", err)
	}

	// Fail the activity's master over to its replica.
	master, err := cc.MasterForKey(ctx, k.Meta)
	if err != nil {
		t.Fatal(err)
	}
	if err := master.Do(ctx, "wait", 1, 5000).Err(); err != nil {
		t.Fatalf("WAIT for the replica: %v", err)
	}
	masterID, err := master.Do(ctx, "cluster", "myid").Text()
	if err != nil {
		t.Fatal(err)
	}
	var replica *redis.Client
	for _, addr := range cluster.Addrs {
		node := redis.NewClient(cluster.NodeOptions(addr))
		t.Cleanup(func() { _ = node.Close() })
		info, err := node.Info(ctx, "replication").Result()
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(info, "role:slave") && masterOf(ctx, node) == masterID {
			replica = node
		}
	}
	if replica == nil {
		t.Fatalf("no replica of master %s", masterID)
	}
	if err := replica.Do(ctx, "cluster", "failover").Err(); err != nil {
		t.Fatalf("CLUSTER FAILOVER: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		info, _ := replica.Info(ctx, "replication").Result()
		if strings.Contains(info, "role:master") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the replica did not take over: %s", info)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The operator's client, whose slot map predates the failover, finds the new
	// master (while the nodes agree on the new map, redirects may bounce for a moment).
	deadline = time.Now().Add(30 * time.Second)
	for {
		snap, err := handle(op, k).Snapshot(ctx)
		if err == nil && snap.ClaimedCount == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("snapshot through the operator's client after the failover: %+v, %v", snap, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// The promoted replica knows the user: the grab pods' client follows the new
	// master and keeps granting.
	deadline = time.Now().Add(30 * time.Second)
	for {
		res, err := h.Grab(ctx, "after-failover")
		if err == nil && res.Outcome == store.Granted {
			break
		}
		if time.Now().After(deadline) || isNoPerm(err) || (err != nil && strings.Contains(err.Error(), "WRONGPASS")) {
			t.Fatalf("grab after the failover: %+v, %v", res, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err := replica.Do(ctx, "acl", "dryrun", store.NewActivity(nil, uid, 1).UserName(), "lpop", k.Packets).Err(); err != nil {
		t.Errorf("the new master does not let the user pop its packets: %v", err)
	}

	// DeleteUser reaches every node, the old master too, which may still be
	// resyncing as a replica and missing from the slot map.
	if n, err := store.NewActivity(op, uid, 1).DeleteUser(ctx); err != nil || n != 6 {
		t.Fatalf("DeleteUser on the cluster: %d, %v; want 6", n, err)
	}
}

// masterOf is the node ID of the master the replica node follows, "" if none.
func masterOf(ctx context.Context, node *redis.Client) string {
	nodes, err := node.ClusterNodes(ctx).Result()
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(nodes, "\n") {
		f := strings.Fields(line)
		if len(f) > 3 && strings.Contains(f[2], "myself") && strings.Contains(f[2], "slave") {
			return f[3]
		}
	}
	return ""
}

// The user of a sharded activity reaches every shard of it: the grab on a home shard,
// the refill that moves packets from another shard, the reading of every shard and
// their journals. A key of another activity stays out of reach, including one whose
// name starts like a shard's.
func TestActivityUserReachesEveryShard(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	const own, shards = "act-sharded", 3
	amounts := splitOrFail(t, split.TypeFixed, 300, 6)
	admin := store.NewActivity(op, own, shards)
	if _, err := admin.Seed(ctx, amounts, store.SeedParams{Count: 6, Total: 300, Sponsor: sponsor}); err != nil {
		t.Fatal(err)
	}
	if r, err := admin.ConfigureWith(ctx, store.Settings{Open: true}); err != nil || r.State != store.StateOpen {
		t.Fatalf("opening: %+v %v", r, err)
	}
	other := seedOpen(t, ctx, op, "act-sharded.9x", splitOrFail(t, split.TypeFixed, 600, 6))
	if _, err := admin.EnsureUser(ctx, "sharded-pw-0123456789"); err != nil {
		t.Fatal(err)
	}
	c := userConn([]string{srv.Addr}, redisconn.ModeStandalone, own, "sharded-pw-0123456789").NewClient()
	t.Cleanup(func() { _ = c.Close() })
	h := store.NewActivity(c, own, shards)
	// Three users at home on shard 0, which holds two packets: the third refills.
	var users []string
	for k := 0; len(users) < 3; k++ {
		if u := fmt.Sprintf("u%d", k); h.Home(u) == 0 {
			users = append(users, u)
		}
	}
	for _, u := range users {
		if r, _, err := h.Grab(ctx, u, nil); err != nil || r.Outcome != store.Granted {
			t.Fatalf("grab of %s as the activity's user: %+v, %v", u, r, err)
		}
	}
	v, err := h.ReadShards(ctx)
	if err != nil || !v.Conservation().Zero() || v.Whole.ClaimedCount != 3 {
		t.Fatalf("reading the shards as the activity's user: %+v, %v", v.Whole, err)
	}
	if _, err := h.Resolve(ctx); err != nil {
		t.Fatalf("resolving transfers as the activity's user: %v", err)
	}
	if err := c.HGet(ctx, other.Meta, "state").Err(); !isNoPerm(err) {
		t.Fatalf("reading another activity's meta (%s): %v, want NOPERM", other.Meta, err)
	}
}
