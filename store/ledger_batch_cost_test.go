package store_test

import (
	"strconv"
	"testing"
	"time"

	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// Issue 34, case 5: no operator script holds Redis over 5 ms. The settlement ledger
// of a budget decides a batch of entries (BudgetLedger.Decide) in steps of
// store.LedgerDecideStep entries, each one atomic ledger_packets_credit.lua call.
// This runs 40 batches of 64 grants of distinct packets (the worst case: every entry
// writes its packet's ledger, its expiry and the sums) and reads every call's
// execution time on the server from SLOWLOG; every call but at most one (a call
// descheduled on a shared machine) stays under 5 ms, and the slowest is logged
// (docs/operations.md states the figure).
func TestLedgerDecideStepStaysUnder5ms(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	for _, kv := range [][2]string{{"slowlog-log-slower-than", "0"}, {"slowlog-max-len", "100000"}} {
		if err := rdb.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
			t.Fatal(err)
		}
	}
	l := store.NewBudget(rdb, "rpb-ledger-cost", 4).SettlementLedger(time.Hour)
	at := time.UnixMilli(1_767_000_000_000)
	if _, err := l.PrepareAnnouncement(ctx, 1<<40, at); err != nil {
		t.Fatal(err)
	}
	if _, err := l.CommitAnnouncement(ctx, 1<<40); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Do(ctx, "slowlog", "reset").Err(); err != nil {
		t.Fatal(err)
	}
	const batches, batch = 40, 64
	for b := range batches {
		credits := make([]store.BudgetCredit, batch)
		for i := range credits {
			credits[i] = store.BudgetCredit{Kind: "grant", PacketID: "p-" + strconv.Itoa(b*batch+i), Share: "0",
				UserID: "user-" + strconv.Itoa(i), Amount: 100, At: at}
		}
		verdicts, err := l.Decide(ctx, credits)
		if err != nil || len(verdicts) != batch {
			t.Fatalf("batch %d: %d verdicts, %v", b, len(verdicts), err)
		}
		for i, v := range verdicts {
			if v.Verdict != store.LedgerCredit {
				t.Fatalf("batch %d entry %d: %+v", b, i, v)
			}
		}
	}
	logs, err := rdb.SlowLogGet(ctx, 100000).Result()
	if err != nil {
		t.Fatal(err)
	}
	var slowest, sum time.Duration
	calls, over := 0, 0
	for _, e := range logs {
		if len(e.Args) > 0 && (e.Args[0] == "evalsha" || e.Args[0] == "eval") {
			calls++
			sum += e.Duration
			slowest = max(slowest, e.Duration)
			if e.Duration >= 5*time.Millisecond {
				over++
			}
		}
	}
	if calls == 0 {
		t.Fatal("no ledger call in the SLOWLOG")
	}
	t.Logf("%d ledger calls of %d entries: mean %v, slowest %v on the server", calls, store.LedgerDecideStep,
		sum/time.Duration(calls), slowest)
	// SLOWLOG times a call by the wall clock, and the test machine's cores are
	// shared: one call in 160 may be descheduled past 5 ms, never more.
	if over > 1 {
		t.Errorf("%d ledger calls held Redis 5 ms or more, the slowest %v; want under 5 ms", over, slowest)
	}
}
