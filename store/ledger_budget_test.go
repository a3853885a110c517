package store_test

import (
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// A budget's ledger decides nothing before a total was announced; then it credits
// each key with one body at most (the same body again passes, another user, amount
// or time is a duplicate), never beyond the announced total, which only grows; each
// packet's record expires after the retention, the sums stay.
func TestBudgetLedgerCreditsEachKeyOnceWithinTheAnnouncedTotal(t *testing.T) {
	ctx := redistest.Context(t)
	rdb := redistest.Start(t).Client(t)
	l := store.NewBudget(rdb, "rpb-ledger", 4).SettlementLedger(time.Hour)
	at := time.UnixMilli(1_800_000_000_000)
	credit := func(packet, share, user string, amount int64, at time.Time) store.BudgetCredit {
		kind := store.KindGrant
		if share == store.RefundShare {
			kind = store.KindRefund
		}
		return store.BudgetCredit{Kind: kind, PacketID: packet, Share: share, UserID: user, Amount: amount, At: at}
	}
	if _, err := l.Decide(ctx, []store.BudgetCredit{credit("p", "0", "u", 1, at)}); !errors.Is(err, store.ErrNotAnnounced) {
		t.Fatalf("a credit before any announcement: %v, want ErrNotAnnounced", err)
	}
	st, err := l.PrepareAnnouncement(ctx, 1000, at)
	if err != nil || st.Pending != 1000 || st.Total != 0 || !st.At.Equal(at) {
		t.Fatalf("prepare: %+v, %v", st, err)
	}
	// A second prepare keeps the announcement under way, and its time.
	if st, err = l.PrepareAnnouncement(ctx, 1200, at.Add(time.Minute)); err != nil || st.Pending != 1000 || !st.At.Equal(at) {
		t.Fatalf("prepare again: %+v, %v", st, err)
	}
	if st, err = l.CommitAnnouncement(ctx, 1000); err != nil || st.Total != 1000 || st.Pending != 0 {
		t.Fatalf("commit: %+v, %v", st, err)
	}
	v, err := l.Decide(ctx, []store.BudgetCredit{
		credit("p", "0", "alice", 400, at),                       // ok
		credit("p", "0", "alice", 400, at),                       // again: the same body
		credit("p", "0", "alice", 400, at.Add(time.Millisecond)), // another time: a duplicate
		credit("p", "0", "bob", 400, at),                         // another user: a duplicate
		credit("p", store.RefundShare, "m", 500, at),             // ok: 900 of 1000
		credit("q", "0", "carol", 101, at),                       // over the budget
		credit("q", "0", "carol", 100, at),                       // ok: 1000 of 1000
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{store.LedgerCredit, store.LedgerAgain, store.LedgerDuplicatePacket, store.LedgerDuplicatePacket,
		store.LedgerCredit, store.LedgerOverBudget, store.LedgerCredit}
	for i, w := range want {
		if v[i].Verdict != w {
			t.Errorf("credit %d: %+v, want %s", i, v[i], w)
		}
	}
	if v[3].CreditedTo != "alice" {
		t.Errorf("the duplicate names %q, want alice", v[3].CreditedTo)
	}
	sums, err := l.Sums(ctx)
	if err != nil || sums != (store.BudgetLedgerSums{Total: 1000, Credited: 1000, Grants: 2, Granted: 500, Refunds: 1, Refunded: 500}) {
		t.Fatalf("sums %+v, %v", sums, err)
	}
	// A lower total is never announced; the announced one stays.
	if st, err = l.PrepareAnnouncement(ctx, 900, at); err != nil || st.Pending != 0 || st.Total != 1000 {
		t.Fatalf("prepare of a lower total: %+v, %v", st, err)
	}
	ttl, err := rdb.PTTL(ctx, l.PacketKey("p")).Result()
	if err != nil || ttl <= 59*time.Minute || ttl > time.Hour {
		t.Errorf("packet record's TTL %s (%v), want about the retention of 1h", ttl, err)
	}
	if ttl, err := rdb.PTTL(ctx, l.Key()).Result(); err != nil || ttl != -1 {
		t.Errorf("the budget ledger's TTL %s (%v), want none", ttl, err)
	}
}

// A shard's unsettled entries are those its settlement group has not acknowledged or
// dead-lettered: none without a stream, every entry before the group exists, the read
// and the unread ones after, and none once each is acknowledged; Drained agrees.
func TestBudgetShardUnsettledCountsWhatTheGroupOwes(t *testing.T) {
	ctx := t.Context()
	rdb := redistest.Start(t).Client(t)
	sh := store.NewBudget(rdb, "budget-unsettled", 1).Stream(0)
	stream := store.NewBudget(rdb, "budget-unsettled", 1).ShardKeys(0).Stream
	check := func(what string, want int64) {
		t.Helper()
		n, err := sh.Unsettled(ctx, "settlement")
		drained, derr := sh.Drained(ctx, "settlement")
		if err != nil || derr != nil || n != want || drained != (want == 0) {
			t.Errorf("%s: %d unsettled (%v), drained %v (%v); want %d", what, n, err, drained, derr, want)
		}
	}
	check("no stream", 0)
	for i := range 3 {
		if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []string{"refund", "p-" + strconv.Itoa(i) + "/refund:100:0:CNY:merchant"}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	check("three entries, no group", 3)
	if err := sh.EnsureGroup(ctx, "settlement"); err != nil {
		t.Fatal(err)
	}
	check("a group that read nothing", 3)
	entries, err := sh.ReadNew(ctx, "settlement", "op", 2, time.Millisecond)
	if err != nil || len(entries) != 2 {
		t.Fatalf("read %d entries, %v", len(entries), err)
	}
	check("two read, one not", 3)
	for _, e := range entries {
		if err := rdb.XAck(ctx, stream, "settlement", e.ID).Err(); err != nil {
			t.Fatal(err)
		}
	}
	check("two acknowledged", 1)
	rest, err := sh.ReadNew(ctx, "settlement", "op", 10, time.Millisecond)
	if err != nil || len(rest) != 1 {
		t.Fatalf("read %d entries, %v", len(rest), err)
	}
	if err := rdb.XAck(ctx, stream, "settlement", rest[0].ID).Err(); err != nil {
		t.Fatal(err)
	}
	check("every entry acknowledged", 0)
}
