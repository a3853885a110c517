package store_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// A budget's user may FCALL the operator's library and reach its own keys only (the
// commands the library's functions call are granted too, since Redis checks them
// against the caller; the key pattern is what confines them):
// another budget's keys, the operator's ledger, an activity's keys, EVAL, FUNCTION
// and SCRIPT are refused. EnsureUser is idempotent and DeleteUser removes it.
func TestBudgetUserIsConfinedToItsBudget(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	if _, err := lua.GrabLibrary.Ensure(ctx, op); err != nil {
		t.Fatal(err)
	}
	const uid, password = "budget-own", "budget-pw-0123456789"
	b := store.NewBudget(op, uid, 4)
	if b.UserName() != "rpb-"+uid {
		t.Fatalf("user name %q", b.UserName())
	}
	if change, err := b.EnsureUser(ctx, password); err != nil || change != (store.UserChange{Nodes: 1, Set: 1}) {
		t.Fatalf("first EnsureUser: %+v, %v; want the user set on the one node", change, err)
	}
	if change, err := b.EnsureUser(ctx, password); err != nil || change != (store.UserChange{Nodes: 1}) {
		t.Fatalf("second EnsureUser: %+v, %v; want nothing to change", change, err)
	}

	user := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: b.UserName(), Password: password})
	t.Cleanup(func() { _ = user.Close() })
	if err := user.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING as the budget's user: %v", err)
	}
	// An FCALL of the library as the user reaches the budget's own keys: the
	// snapshot function reads a key under the budget's pattern.
	own := store.NewBudget(op, uid, 4).ShardKeys(2).Meta
	if err := lua.SnapshotScript.Call(ctx, user, []string{own}).Err(); isNoPerm(err) {
		t.Errorf("FCALL of the library on the budget's own key refused: %v", err)
	}
	// The grab fleet's calls as the user: create a packet and grab it.
	if err := b.Configure(ctx, 10_000, store.BudgetLimits{Currency: "CNY", MaxTotal: 1000, MaxCount: 10, MinShare: 1,
		Distributions: []string{"Fixed"}, DefaultTTL: time.Hour, MaxTTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	fleet := store.NewBudget(user, uid, 4)
	if _, outcome, err := fleet.CreatePacket(ctx, store.NewPacket{ID: "order-1", Sender: "s1", Total: 500, Count: 5,
		Distribution: "Fixed"}); err != nil || outcome != store.CreateCreated {
		t.Fatalf("CreatePacket as the budget's user: %s, %v", outcome, err)
	}
	if g, err := fleet.GrabPacket(ctx, "order-1", "u1"); err != nil || g.Outcome != store.PacketGranted || g.Amount != 100 {
		t.Fatalf("GrabPacket as the budget's user: %+v, %v", g, err)
	}
	refused := map[string]func() error{
		"EVAL":                         func() error { return user.Eval(ctx, "return 1", nil).Err() },
		"FUNCTION FLUSH":               func() error { return user.FunctionFlush(ctx).Err() },
		"SCRIPT FLUSH":                 func() error { return user.ScriptFlush(ctx).Err() },
		"FCALL on another budget":      func() error { return lua.SnapshotScript.Call(ctx, user, []string{"rpb:{budget-other.0}:meta"}).Err() },
		"FCALL on the operator ledger": func() error { return lua.SnapshotScript.Call(ctx, user, []string{"rpl:{" + uid + "}:ledger"}).Err() },
		"FCALL on an activity":         func() error { return lua.SnapshotScript.Call(ctx, user, []string{"rpa:{" + uid + "}:meta"}).Err() },
		"FCALL on a prefix look-alike": func() error { return lua.SnapshotScript.Call(ctx, user, []string{"rpb:{" + uid + "x.0}:meta"}).Err() },
	}
	for what, run := range refused {
		if err := run(); !isNoPerm(err) {
			t.Errorf("%s as the budget's user: %v, want NOPERM", what, err)
		}
	}

	if n, err := b.DeleteUser(ctx); err != nil || n != 1 {
		t.Fatalf("DeleteUser: %d, %v", n, err)
	}
	if n, err := b.DeleteUser(ctx); err != nil || n != 0 {
		t.Errorf("DeleteUser of a missing user: %d, %v", n, err)
	}
}
