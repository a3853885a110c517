package store_test

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// forbiddenForTenants are commands an activity's Redis user must never hold: any way
// to run Lua of its own or to drop, load or kill the operator's, and the commands that
// block or stop the whole server or reach every key.
var forbiddenForTenants = []string{
	"eval", "eval_ro", "evalsha", "evalsha_ro", "script", "function", "debug", "keys", "flushall",
	"flushdb", "config", "shutdown", "monitor", "client", "acl", "save", "bgsave", "bgrewriteaof",
	"replicaof", "slaveof", "sync", "psync", "failover", "swapdb", "select", "migrate", "restore",
	"module", "blpop", "brpop", "blmove", "brpoplpush", "blmpop", "bzpopmin", "bzpopmax", "bzmpop",
	"subscribe", "psubscribe", "ssubscribe", "sort", "scan", "info",
}

// The activity's user, as EnsureUser sets it, holds no forbidden command: the
// commands ACL GETUSER lists start from -@all and add none of them, and ACL DRYRUN
// refuses each, with its usual arguments.
func TestActivityUserHoldsNoForbiddenCommand(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	_, op := protectedRedis(t)
	const uid = "act-acl-list"
	a := store.NewActivity(op, uid, 1)
	if _, err := a.EnsureUser(ctx, "list-pw-0123456789abcdef"); err != nil {
		t.Fatal(err)
	}
	v, err := op.Do(ctx, "acl", "getuser", a.UserName()).Result()
	if err != nil {
		t.Fatal(err)
	}
	var commands string
	if m, ok := v.(map[any]any); ok {
		commands, _ = m["commands"].(string)
	} else if l, ok := v.([]any); ok {
		for i := 0; i+1 < len(l); i += 2 {
			if l[i] == "commands" {
				commands, _ = l[i+1].(string)
			}
		}
	}
	rules := strings.Fields(commands)
	if len(rules) == 0 || rules[0] != "-@all" {
		t.Fatalf("the user's commands %q do not start from -@all", commands)
	}
	var granted []string
	for _, r := range rules[1:] {
		name, ok := strings.CutPrefix(r, "+")
		if !ok {
			t.Errorf("rule %q is not a single command granted", r)
			continue
		}
		granted = append(granted, name)
		base, _, _ := strings.Cut(name, "|")
		if slices.Contains(forbiddenForTenants, base) || slices.Contains(forbiddenForTenants, name) {
			t.Errorf("the activity's user holds the forbidden command %s", name)
		}
	}
	if !slices.Contains(granted, "fcall") {
		t.Errorf("the activity's user cannot FCALL: %v", granted)
	}
	t.Logf("the activity's user holds: %s", strings.Join(granted, " "))
	k := a.Shard(0).Keys()
	tries := [][]any{
		{"eval", "return 1", "0"}, {"eval_ro", "return 1", "1", k.Meta}, {"evalsha", lua.ConfigureScript.SHA(), "1", k.Meta},
		{"evalsha_ro", lua.SnapshotScript.SHA(), "1", k.Meta}, {"script", "load", "return 1"}, {"script", "flush"},
		{"script", "kill"}, {"function", "load", lua.GrabLibrary.Code()}, {"function", "flush"},
		{"function", "delete", lua.GrabLibrary.Name()}, {"function", "kill"}, {"function", "restore", "x"},
		{"debug", "sleep", "10"}, {"keys", "*"}, {"flushall"}, {"flushdb"}, {"config", "set", "busy-reply-threshold", "1"},
		{"blpop", k.Packets, "0"}, {"brpop", k.Packets, "0"}, {"blmove", k.Packets, k.Staging, "LEFT", "LEFT", "0"},
		{"bzpopmin", k.Meta, "0"}, {"client", "pause", "10000"}, {"shutdown", "nosave"}, {"monitor"},
		{"sort", k.Packets}, {"fcall_ro", lua.SnapshotScript.Function(), "1", k.Meta},
	}
	for _, cmd := range tries {
		args := append([]any{"acl", "dryrun", a.UserName()}, cmd...)
		res, err := op.Do(ctx, args...).Text()
		if err != nil {
			t.Fatalf("ACL DRYRUN %v: %v", cmd, err)
		}
		if res == "OK" {
			t.Errorf("the activity's user may run %v", cmd)
		}
	}
	if res, err := op.Do(ctx, "acl", "dryrun", a.UserName(), "fcall", lua.GrabScript.Function(), "4",
		k.Meta, k.Packets, k.Claims, k.Stream, "u1").Text(); err != nil || res != "OK" {
		t.Errorf("ACL DRYRUN of the grab's FCALL: %q, %v; want OK", res, err)
	}
}

// Issue 24, item 1: with its activity's Redis credentials a tenant tries to run Lua
// of its own (the busy loop that would block the server for everyone), to run the
// operator's cached scripts, and to drop or replace the functions; all is refused
// with NOPERM. While it keeps trying, grabs of another activity, as that activity's
// user, each answer within one second, and the tenant's own grab path works end to
// end through FCALL.
func TestTenantCannotRunItsOwnLua(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	const own, other, ownPW, otherPW = "act-tenant", "act-bystander", "tenant-pw-0123456789", "bystander-pw-0123456789"
	ownKeys := seedOpen(t, ctx, op, own, splitOrFail(t, split.TypeFixed, 10_000, 100))
	seedOpen(t, ctx, op, other, splitOrFail(t, split.TypeFixed, 100_000, 5_000))
	for uid, pw := range map[string]string{own: ownPW, other: otherPW} {
		if _, err := store.NewActivity(op, uid, 1).EnsureUser(ctx, pw); err != nil {
			t.Fatal(err)
		}
	}
	attacker := userConn([]string{srv.Addr}, redisconn.ModeStandalone, own, ownPW).NewClient()
	t.Cleanup(func() { _ = attacker.Close() })

	busyLoop := "redis.call('HSET',KEYS[1],'x',1) while true do end"
	attempts := [][]any{
		{"eval", busyLoop, "1", ownKeys.Meta},
		{"eval_ro", "while true do end", "1", ownKeys.Meta},
		{"evalsha", lua.ConfigureScript.SHA(), "1", ownKeys.Meta, "0", "0", "0", "1"},
		{"evalsha", lua.GrabScript.SHA(), "4", ownKeys.Meta, ownKeys.Packets, ownKeys.Claims, ownKeys.Stream, "u"},
		{"evalsha_ro", lua.SnapshotScript.SHA(), "1", ownKeys.Meta},
		{"function", "load", "#!lua name=mine\nredis.register_function('spin', function(k) while true do end end)"},
		{"function", "load", "replace", lua.GrabLibrary.Code()},
		{"function", "flush"}, {"function", "delete", lua.GrabLibrary.Name()}, {"function", "kill"},
		{"script", "load", busyLoop}, {"script", "flush"}, {"script", "kill"},
	}
	// The operator's scripts are in the cache: EVALSHA of them is what is refused,
	// not a cache miss.
	if err := store.NewActivity(op, own, 1).LoadScripts(ctx); err != nil {
		t.Fatal(err)
	}
	for _, cmd := range attempts {
		if err := attacker.Do(ctx, cmd...).Err(); err == nil || !strings.HasPrefix(err.Error(), "NOPERM") {
			t.Errorf("%v as the activity's user: %v; want NOPERM", cmd[:2], err)
		}
	}

	// The attacker keeps trying while a bystander's grabs run.
	bystander, err := userConn([]string{srv.Addr}, redisconn.ModeStandalone, other, otherPW).
		NewPipelinedClient(redisconn.GrabClientOptions(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = bystander.Close() })
	stop := make(chan struct{})
	var refused, allowed atomic.Int64
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if err := attacker.Do(ctx, attempts[i%len(attempts)]...).Err(); err != nil && strings.HasPrefix(err.Error(), "NOPERM") {
					refused.Add(1)
				} else {
					allowed.Add(1)
				}
			}
		})
	}
	grabber := store.NewActivity(bystander.Pipeliner, other, 1)
	var slowest time.Duration
	deadline := time.Now().Add(2 * time.Second)
	grants := 0
	for i := 0; time.Now().Before(deadline); i++ {
		start := time.Now()
		res, _, err := grabber.Grab(ctx, "bystander-"+strconv.Itoa(i), nil)
		took := time.Since(start)
		slowest = max(slowest, took)
		if err != nil || res.Outcome != store.Granted || took > time.Second {
			t.Fatalf("grab %d of the other activity while the tenant attacks: %+v, %v, in %v", i, res, err, took)
		}
		grants++
		time.Sleep(5 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	t.Logf("%d attempts refused, %d not; %d grabs of the other activity, the slowest in %v", refused.Load(), allowed.Load(), grants, slowest)
	if allowed.Load() != 0 || refused.Load() < 100 {
		t.Fatalf("%d attempts were not refused with NOPERM, %d were", allowed.Load(), refused.Load())
	}

	// The tenant's own grab path, FCALL as its user, works end to end.
	pc, err := userConn([]string{srv.Addr}, redisconn.ModeStandalone, own, ownPW).
		NewPipelinedClient(redisconn.GrabClientOptions(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pc.Close() })
	mine := store.NewActivity(pc.Pipeliner, own, 1)
	first, _, err := mine.Grab(ctx, "tenant-user", nil)
	if err != nil || first.Outcome != store.Granted {
		t.Fatalf("the tenant's own grab by FCALL: %+v, %v", first, err)
	}
	if again, _, err := mine.Grab(ctx, "tenant-user", nil); err != nil || again.Outcome != store.AlreadyClaimed || again.PacketID != first.PacketID {
		t.Fatalf("the repeat grab: %+v, %v", again, err)
	}
	if snap, err := store.NewActivity(pc.Client, own, 1).Snapshot(ctx); err != nil || snap.ClaimedCount != 1 {
		t.Fatalf("the reporter's snapshot by FCALL: %+v, %v", snap, err)
	}
	if n, err := op.HGet(ctx, ownKeys.Meta, "x").Result(); err != redis.Nil {
		t.Fatalf("the busy loop's HSET ran: %q, %v", n, err)
	}
}

// Issue 24, item 1, bounded work: the activity's user FCALLs each grab-side function
// whose work a caller picks with a huge argument, on a big activity, while another
// client PINGs: every call is capped or refused, and Redis answers every PING within
// one second (the slowest is logged).
func TestCappedFunctionsKeepRedisAnswering(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	const uid, pw, packets = "act-big", "big-pw-0123456789abcdef", 200_000
	k := seedOpen(t, ctx, op, uid, splitOrFail(t, split.TypeFixed, 2*packets, packets))
	if _, err := store.NewActivity(op, uid, 1).EnsureUser(ctx, pw); err != nil {
		t.Fatal(err)
	}
	tenant := userConn([]string{srv.Addr}, redisconn.ModeStandalone, uid, pw).NewClient()
	t.Cleanup(func() { _ = tenant.Close() })
	// The tenant fills what its ACL lets it fill: a meta hash of 100,000 extra
	// fields; the 20,000 dead letters are the operator's (the dead-letter stream is
	// read-only to the tenant, TestTenantCannotHoldTheSharedRedis).
	pipe := op.Pipeline()
	for i := range 20_000 {
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: k.DeadLetters, Values: []any{"entry", "0-" + strconv.Itoa(i+1), "error", "x", "kind", "grant"}})
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	huge := make([]any, 0, 200_000)
	for i := range 100_000 {
		huge = append(huge, "f"+strconv.Itoa(i), "v")
	}
	if err := tenant.HSet(ctx, k.Meta, huge...).Err(); err != nil {
		t.Fatal(err)
	}
	ping := op.(*redis.Client)
	var slowest atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			start := time.Now()
			if err := ping.Ping(ctx).Err(); err != nil {
				t.Errorf("PING: %v", err)
				return
			}
			if d := int64(time.Since(start)); d > slowest.Load() {
				slowest.Store(d)
			}
			time.Sleep(2 * time.Millisecond)
		}
	})
	fcall := func(s *lua.Script, keys []string, args ...any) (any, time.Duration, error) {
		start := time.Now()
		v, err := tenant.FCall(ctx, s.Function(), keys, args...).Result()
		return v, time.Since(start), err
	}
	manyPackets := make([]any, 0, 8+packets)
	manyPackets = append(manyPackets, "x-1", packets, 2*packets, 0, 0, 1, 1, 0)
	for i := range packets {
		manyPackets = append(manyPackets, fmt.Sprintf("%d:2", 900_000+i))
	}
	cases := []struct {
		name  string
		call  func() (any, time.Duration, error)
		check func(v any, err error) string
	}{
		{"transfer_out of a billion packets", func() (any, time.Duration, error) {
			return fcall(lua.TransferOutScript, []string{k.Meta, k.Packets, k.Transfers}, "t-1", 1, 1_000_000_000)
		}, func(v any, err error) string {
			l, _ := v.([]any)
			if err != nil || len(l) != 4 || l[0] != "moved" || !strings.HasPrefix(l[1].(string), "1|1000|") {
				return fmt.Sprintf("%v, %v; want 1000 packets moved", v, err)
			}
			return ""
		}},
		{"transfer_in of 200,000 packets", func() (any, time.Duration, error) {
			return fcall(lua.TransferInScript, []string{k.Meta, k.Packets, k.Applied}, manyPackets...)
		}, refused},
		{"replay_dead of a billion entries", func() (any, time.Duration, error) {
			return fcall(lua.ReplayDeadScript, []string{k.Meta, k.Stream, k.DeadLetters, k.Claims}, 1_000_000_000)
		}, func(v any, err error) string {
			if !isNoPerm(err) {
				return fmt.Sprintf("%v, %v; want NOPERM: the dead letters are the operator's", v, err)
			}
			return ""
		}},
		{"replay_dead of a billion entries by the operator", func() (any, time.Duration, error) {
			start := time.Now()
			v, err := op.FCall(ctx, lua.ReplayDeadScript.Function(), []string{k.Meta, k.Stream, k.DeadLetters, k.Claims}, 1_000_000_000).Result()
			return v, time.Since(start), err
		}, func(v any, err error) string {
			if n, _ := v.(int64); err != nil || n != 500 {
				return fmt.Sprintf("%v, %v; want 500 moved", v, err)
			}
			return ""
		}},
		{"grab with a user id of 10 MB", func() (any, time.Duration, error) {
			return fcall(lua.GrabScript, []string{k.Meta, k.Packets, k.Claims, k.Stream}, strings.Repeat("u", 10<<20))
		}, refused},
		{"snapshot of a meta hash of 100,000 fields", func() (any, time.Duration, error) {
			return fcall(lua.SnapshotScript, []string{k.Meta, k.Packets, k.Staging, k.Claims})
		}, refused},
	}
	for _, c := range cases {
		v, took, err := c.call()
		if msg := c.check(v, err); msg != "" {
			t.Errorf("%s: %s", c.name, msg)
		}
		t.Logf("%s: %v in %v", c.name, errOrOK(err), took)
	}
	close(stop)
	wg.Wait()
	t.Logf("slowest PING of another client: %v", time.Duration(slowest.Load()))
	if time.Duration(slowest.Load()) > time.Second {
		t.Fatalf("Redis took %v to answer a PING", time.Duration(slowest.Load()))
	}
}

func refused(v any, err error) string {
	if err == nil || !strings.Contains(err.Error(), "at most") {
		return fmt.Sprintf("%.80v, %v; want it refused", v, err)
	}
	return ""
}

func errOrOK(err error) string {
	if err != nil {
		return "refused: " + err.Error()
	}
	return "ok"
}

// A tenant's Redis user can write its own activity's claims hash. A claim it writes by
// hand for a packet that is still listed makes the activity hold one claim more than
// its list gave out, which the steady view reports as duplicated on an activity of
// one shard too, so the reporter and the controller fence it before the packet is
// granted again.
func TestForgedClaimOfAListedPacketIsSeenOnOneShard(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	const uid, pw = "act-forged-claim", "forger-pw-0123456789"
	k := seedOpen(t, ctx, op, uid, []int64{100, 200, 300})
	act := store.NewActivity(op, uid, 1)
	if _, err := act.EnsureUser(ctx, pw); err != nil {
		t.Fatal(err)
	}
	if r, _, err := act.Grab(ctx, "alice", nil); err != nil || r.Outcome != store.Granted {
		t.Fatalf("grab: %+v, %v", r, err)
	}
	v, err := act.ReadShards(ctx)
	if err != nil || !v.Steady || v.Duplicated() {
		t.Fatalf("before the forgery: steady %v, duplicated %v, %v", v.Steady, v.Duplicated(), err)
	}

	tenant := userConn([]string{srv.Addr}, redisconn.ModeStandalone, uid, pw).NewClient()
	t.Cleanup(func() { _ = tenant.Close() })
	// Packet 3 is still listed: the claim names it with its seeded amount and an entry
	// the tenant wrote too.
	entry, err := tenant.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []any{"grant", "3:300:0:CNY:mallory"}}).Result()
	if err != nil {
		t.Fatalf("the tenant's XADD: %v", err)
	}
	if err := tenant.HSet(ctx, k.Claims, "mallory", "3:300:"+entry).Err(); err != nil {
		t.Fatalf("the tenant's HSET: %v", err)
	}

	v, err = act.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !v.Steady || !v.Duplicated() {
		t.Fatalf("after a forged claim of a listed packet: steady %v, duplicated %v, imbalance %+v; want it seen",
			v.Steady, v.Duplicated(), v.Conservation())
	}
}
