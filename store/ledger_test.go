package store_test

import (
	"strconv"
	"testing"
	"time"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// The ledger lets each packet be credited to one user at most, never more grants
// than packets, and never more money than the total, grants and refund together;
// a refused entry changes nothing, and a redelivery of what was let through passes
// again.
func TestLedgerCreditsEachPacketOnceWithinTheTotal(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	rdb := redistest.Start(t).Client(t)
	l := store.NewActivity(rdb, "uid-ledger", 1).Ledger()
	grant := func(packet, user string, amount int64) store.StreamEntry {
		return store.StreamEntry{ID: "0-1", Kind: store.KindGrant, PacketID: packet, UserID: user, Amount: amount}
	}
	refund := func(user string, amount int64) store.StreamEntry {
		return store.StreamEntry{ID: "0-2", Kind: store.KindRefund, PacketID: store.RefundPacketID, UserID: user, Amount: amount}
	}
	// An activity of 3 packets, 600 in total.
	got, err := l.Decide(ctx, 600, 3, []store.StreamEntry{
		grant("1", "alice", 200), grant("1", "alice", 200), grant("1", "mallory", 200),
		grant("2", "bob", 350), grant("3", "carol", 100), grant("3", "carol", 100),
		refund("sponsor", 100), refund("sponsor", 50), grant("4", "dave", 1),
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []store.LedgerVerdict{
		{Verdict: store.LedgerCredit}, {Verdict: store.LedgerAgain}, {Verdict: store.LedgerDuplicatePacket, CreditedTo: "alice"},
		{Verdict: store.LedgerCredit},
		{Verdict: store.LedgerOverBudget}, // 200 + 350 + 100 > 600
		{Verdict: store.LedgerOverBudget},
		{Verdict: store.LedgerOverBudget}, // 550 + 100 > 600
		{Verdict: store.LedgerCredit},     // 550 + 50
		{Verdict: store.LedgerOverBudget},
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("entry %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	sums, err := l.Sums(ctx)
	if err != nil || sums.Credited != 550 || sums.Grants != 2 || sums.Refund != 50 {
		t.Fatalf("sums %+v %v, want 550 in 2 grants and a refund of 50", sums, err)
	}
	// A second refund to someone else is a duplicate, the same one passes again.
	got, err = l.Decide(ctx, 600, 3, []store.StreamEntry{refund("mallory", 50), refund("sponsor", 50)})
	if err != nil || got[0].Verdict != store.LedgerDuplicatePacket || got[0].CreditedTo != "sponsor" || got[1].Verdict != store.LedgerAgain {
		t.Fatalf("refunds again: %+v %v", got, err)
	}
	// More grants than packets are refused even within the total.
	l2 := store.NewActivity(rdb, "uid-ledger-count", 1).Ledger()
	got, err = l2.Decide(ctx, 1000, 2, []store.StreamEntry{grant("1", "a", 1), grant("2", "b", 1), grant("3", "c", 1)})
	if err != nil || got[2].Verdict != store.LedgerOverCount {
		t.Fatalf("over count: %+v %v", got, err)
	}
	// The budget is recorded once; the first record stays.
	if b, err := l.AllowanceAnnounced(ctx); err != nil || b != "" {
		t.Fatalf("budget before: %q %v", b, err)
	}
	if b, err := l.RecordAllowance(ctx, 600, 3); err != nil || b != "600:3" {
		t.Fatalf("record budget: %q %v", b, err)
	}
	if b, err := l.RecordAllowance(ctx, 900, 3); err != nil || b != "600:3" {
		t.Fatalf("record budget again: %q %v, want the first record", b, err)
	}
}

// The ledger is out of the tenant's reach: the activity's Redis user (whose password
// sits in the tenant's namespace) gets NOPERM reading, writing or deleting it, and
// cannot run the ledger scripts on it; the operator purges it with the activity.
func TestActivityUserCannotTouchTheLedger(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	const uid = "act-ledger"
	seedOpen(t, ctx, op, uid, splitOrFail(t, split.TypeFixed, 600, 3))
	act := store.NewActivity(op, uid, 1)
	if _, err := act.EnsureUser(ctx, "ledger-pw-0123456789"); err != nil {
		t.Fatal(err)
	}
	ledger := act.Ledger()
	if _, err := ledger.Decide(ctx, 600, 3, []store.StreamEntry{{ID: "1-1", Kind: store.KindGrant, PacketID: "1", UserID: "alice", Amount: 200}}); err != nil {
		t.Fatal(err)
	}
	conn := userConn([]string{srv.Addr}, redisconn.ModeStandalone, uid, "ledger-pw-0123456789")
	tenant := conn.NewClient(redisconn.ClientOptions{Timeout: 5 * time.Second})
	t.Cleanup(func() { _ = tenant.Close() })
	key := ledger.Key()
	if key != "rpl:{"+uid+"}:ledger" {
		t.Fatalf("ledger key %q", key)
	}
	for name, err := range map[string]error{
		"HGETALL": tenant.HGetAll(ctx, key).Err(),
		"HSET":    tenant.HSet(ctx, key, "p:2", "mallory").Err(),
		"HDEL":    tenant.HDel(ctx, key, "p:1").Err(),
		"DEL":     tenant.Del(ctx, key).Err(),
		"UNLINK":  tenant.Unlink(ctx, key).Err(),
	} {
		if !isNoPerm(err) {
			t.Errorf("%s of the ledger as the activity's user: %v, want NOPERM", name, err)
		}
	}
	tenantLedger := store.NewActivity(tenant, uid, 1).Ledger()
	if _, err := tenantLedger.Decide(ctx, 1<<40, 1<<20, []store.StreamEntry{{ID: "1-2", Kind: store.KindGrant, PacketID: "2", UserID: "mallory", Amount: 1 << 30}}); !isNoPerm(err) {
		t.Errorf("the ledger script as the activity's user: %v, want NOPERM", err)
	}
	if _, err := tenantLedger.RecordAllowance(ctx, 1<<40, 1); !isNoPerm(err) {
		t.Errorf("recording a budget as the activity's user: %v, want NOPERM", err)
	}
	sums, err := ledger.Sums(ctx)
	if err != nil || sums.Credited != 200 || sums.Grants != 1 || sums.Allowance != "" {
		t.Fatalf("ledger after the tenant's attempts: %+v %v", sums, err)
	}
	if err := act.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := op.Exists(ctx, key).Result(); err != nil || n != 0 {
		t.Fatalf("ledger after the purge: exists=%d %v", n, err)
	}
}

// BenchmarkLedgerDecide is the ledger's cost per entry, decided in batches of 64 as
// a settlement worker reads them.
func BenchmarkLedgerDecide(b *testing.B) {
	ctx := redistest.Context(b)
	rdb := redistest.Start(b).Client(b)
	l := store.NewActivity(rdb, "uid-ledger-bench", 1).Ledger()
	const batch = 64
	entries := make([]store.StreamEntry, batch)
	next := 0
	b.ResetTimer()
	for i := 0; i < b.N; i += batch {
		for j := range entries {
			next++
			entries[j] = store.StreamEntry{ID: "1-1", Kind: store.KindGrant, PacketID: strconv.Itoa(next), UserID: "u" + strconv.Itoa(next), Amount: 1}
		}
		if _, err := l.Decide(ctx, 1<<50, 1<<40, entries); err != nil {
			b.Fatal(err)
		}
	}
}
