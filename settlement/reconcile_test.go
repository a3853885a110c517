package settlement

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/pgtest"
)

// referenceBalance is the reference balance system (internal/balance) on a fresh
// database of a real PostgreSQL, served over real HTTP on loopback. While down is
// set it answers every POST /v1/credits 503 without booking, as a balance system
// in an outage would.
type referenceBalance struct {
	pool *pgxpool.Pool
	addr string
	down atomic.Bool
}

func newReferenceBalance(t testing.TB, pg *pgtest.Server, key []byte) *referenceBalance {
	t.Helper()
	ctx := t.Context()
	dsn, err := pg.NewDatabase(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := balance.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	b := &referenceBalance{pool: pool}
	h := balance.Handler(balance.Config{Book: balance.NewBook(pool), Keys: [][]byte{key},
		Log: slog.New(slog.DiscardHandler)})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b.addr = l.Addr().String()
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if b.down.Load() && r.URL.Path == "/v1/credits" {
			http.Error(w, `{"error":"internal","message":"down"}`, http.StatusServiceUnavailable)
			return
		}
		h.ServeHTTP(w, r)
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	return b
}

func (b *referenceBalance) url() string { return "http://" + b.addr + "/v1/credits" }

// exec runs SQL on the book, as a person with psql would.
func (b *referenceBalance) exec(t testing.TB, sql string, args ...any) int64 {
	t.Helper()
	tag, err := b.pool.Exec(t.Context(), sql, args...)
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return tag.RowsAffected()
}

// digest is the digest booked under key ("" when none).
func (b *referenceBalance) digest(t *testing.T, key string) string {
	t.Helper()
	var d string
	err := b.pool.QueryRow(t.Context(), `SELECT coalesce((SELECT encode(digest, 'hex') FROM credits WHERE idempotency_key = $1), '')`, key).Scan(&d)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// sums are the source's running sums and the user's balance, as the book keeps them.
func (b *referenceBalance) sums(t *testing.T, uid string) (grants, grantSum, refunds, refundSum int64) {
	t.Helper()
	if err := b.pool.QueryRow(t.Context(), `SELECT grants, grant_sum, refunds, refund_sum FROM sources WHERE uid = $1`, uid).
		Scan(&grants, &grantSum, &refunds, &refundSum); err != nil {
		t.Fatal(err)
	}
	return
}

func reconcileOnce(t *testing.T, rc *Reconciler) Reconciliation {
	t.Helper()
	r, err := rc.Reconcile(t.Context())
	if err != nil {
		t.Fatalf("reconciling: %v", err)
	}
	t.Logf("reconciliation: %s: %s", r.Outcome, r)
	return r
}

// An activity settled into the reference balance system on a real PostgreSQL
// reconciles clean; a credit row deleted by hand is delivered again under its key
// and booked with the same digest; a credit inserted by hand, and one whose user was
// changed by hand, are named and never corrected; while the balance system is down
// the ledger is ahead and nothing is concluded; credits parked in the dead letters
// are counted, not delivered, until they are replayed. Pages of 7 keys, so that both
// directions page.
func TestReconcileAnActivityWithThePostgresBook(t *testing.T) {
	pg := pgtest.Start(t)
	ctx := t.Context()
	defer func(p int) { reconcilePage = p }(reconcilePage)
	reconcilePage = 7

	key := []byte("operator-signing-key")
	bal := newReferenceBalance(t, pg, key)
	rdb := newRedis(t)
	const uid = "rpa-reconcile"
	a := newActivity(t, rdb, uid, 40, 10_000, "sponsor-1")
	cfg := baseConfig(a, bal.url(), "operator-a")
	cfg.SigningKey = key
	cfg.MaxAttempts = 2
	cfg.Allowance = &Allowance{Total: 10_000, Count: 40, Amounts: a.amounts, At: time.UnixMilli(1_700_000_000_000)}
	if err := AnnounceAllowance(ctx, cfg, 1); err != nil {
		t.Fatal(err)
	}
	grants := a.grab(t, 0, 30)
	_, stop := startWorker(t, cfg)
	rc, err := NewActivityReconciler(cfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	drained := func() bool { ok, err := a.handle.Stream(0).Drained(ctx, DefaultGroup); return err == nil && ok }
	eventually(t, 20*time.Second, "the stream drained", drained)

	var want store.PaidTotals
	for _, g := range grants {
		want.Grants++
		want.GrantSum += g.amount
	}
	r := reconcileOnce(t, rc)
	if r.Outcome != ReconcileAgreed || r.Operator != want || r.Book != want {
		t.Fatalf("after settlement: %+v, want agreed on %+v", r, want)
	}

	// A row lost by the balance system is delivered again with its body.
	var lost grant
	for _, g := range grants {
		lost = g
		break
	}
	lostKey := uid + "/" + lost.packet
	digest := bal.digest(t, lostKey)
	if n := bal.exec(t, `DELETE FROM credits WHERE idempotency_key = $1`, lostKey); n != 1 {
		t.Fatalf("deleted %d rows", n)
	}
	r = reconcileOnce(t, rc)
	if r.Outcome != ReconcileAgreed || r.Redelivered != 1 || r.Book != want {
		t.Fatalf("after a row was deleted: %+v, want it delivered again and agreed", r)
	}
	if got := bal.digest(t, lostKey); got != digest {
		t.Errorf("%s booked again with digest %q, want the original %q", lostKey, got, digest)
	}
	if g, gs, _, _ := bal.sums(t, uid); g != want.Grants || gs != want.GrantSum {
		t.Errorf("the source's running sums are %d grants (%d), want %+v", g, gs, want)
	}

	// Rows the operator never paid are named, and left for a person.
	bal.exec(t, `INSERT INTO credits (idempotency_key, digest, kind, user_id, amount, currency, source_uid, packet_id, at)
		VALUES ($1, sha256('forged'), 'grant', 'mallory', 77, 'CNY', $2, '39', now())`, uid+"/39", uid)
	var changed grant
	for _, g := range grants {
		if g.packet != lost.packet {
			changed = g
			break
		}
	}
	bal.exec(t, `UPDATE credits SET user_id = 'mallory' WHERE idempotency_key = $1`, uid+"/"+changed.packet)
	r = reconcileOnce(t, rc)
	if r.Outcome != ReconcileDiffers || r.Unpaid != 1 || r.UnpaidSum != 77 || r.Differing != 1 || r.Redelivered != 0 {
		t.Fatalf("after a forged and a changed row: %+v, want 1 unpaid (77) and 1 differing", r)
	}
	msg := r.String()
	for _, k := range []string{uid + "/39", uid + "/" + changed.packet} {
		if !strings.Contains(msg, k) {
			t.Errorf("the message does not name %s: %s", k, msg)
		}
	}
	if m := r.Mismatches(); m["unpaid"] != 1 || m["differing"] != 1 || m["missing"] != 0 {
		t.Errorf("mismatches %v", m)
	}
	bal.exec(t, `DELETE FROM credits WHERE idempotency_key = $1`, uid+"/39")
	bal.exec(t, `UPDATE credits SET user_id = $2 WHERE idempotency_key = $1`, uid+"/"+changed.packet, changed.user)
	if r = reconcileOnce(t, rc); r.Outcome != ReconcileAgreed {
		t.Fatalf("after the rows were put right: %+v", r)
	}

	// The balance system down: the ledger lets the new grants through and the
	// deliveries fail; the ledger ahead while entries are pending is not a finding.
	bal.down.Store(true)
	more := a.grab(t, 30, 5)
	eventually(t, 10*time.Second, "the new grants decided by the ledger", func() bool {
		tot, err := a.handle.Ledger().Totals(ctx)
		return err == nil && tot.Grants == want.Grants+5
	})
	// A round while they are pending is in flight. The deliveries fail fast and
	// are parked after two attempts, so a round may also start once they are all
	// parked: then it counts them parked, and never delivers them nor calls them
	// missing. Either way nothing is delivered behind the failing workers' backs.
	r = reconcileOnce(t, rc)
	switch {
	case r.Outcome == ReconcileInFlight && r.Redelivered == 0:
	case r.Outcome == ReconcileDiffers && r.Parked == 5 && r.Missing+r.Unpaid+r.Differing+r.Redelivered == 0:
	default:
		t.Fatalf("while deliveries fail: %+v, want in flight, or only parked credits", r)
	}
	// After maxAttempts they are parked: counted, never delivered by reconciliation.
	eventually(t, 20*time.Second, "the failed grants parked", func() bool {
		return drained() && a.snapshot(t).DeadCount == 5
	})
	bal.down.Store(false)
	r = reconcileOnce(t, rc)
	if r.Outcome != ReconcileDiffers || r.Parked != 5 || r.Redelivered != 0 {
		t.Fatalf("with 5 grants parked: %+v, want 5 parked and nothing delivered", r)
	}
	stop()
	_, _ = startWorker(t, cfg)
	if _, err := a.handle.ReplayDeadLetters(ctx, 0); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "the replayed grants settled", drained)
	for _, g := range more {
		want.Grants++
		want.GrantSum += g.amount
	}
	if r = reconcileOnce(t, rc); r.Outcome != ReconcileAgreed || r.Book != want {
		t.Fatalf("after the replay: %+v, want agreed on %+v", r, want)
	}

	// The refund, lost and delivered again like a grant.
	if _, err := a.handle.Close(ctx, store.CloseExpired); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "the refund settled", func() bool { return drained() && a.snapshot(t).RefundSettled > 0 })
	want.Refunds, want.RefundSum = 1, a.snapshot(t).Refunded
	bal.exec(t, `DELETE FROM credits WHERE idempotency_key = $1`, uid+"/refund")
	if r = reconcileOnce(t, rc); r.Outcome != ReconcileAgreed || r.Redelivered != 1 || r.Book != want {
		t.Fatalf("after the refund row was deleted: %+v, want it delivered again and agreed on %+v", r, want)
	}
}

// A budget settled into the reference balance system: a deleted grant and a deleted
// refund are delivered again from the packets' accounts alone; a forged row is
// named; a balance system without the read endpoints gets no reconciliation.
func TestReconcileABudgetWithThePostgresBook(t *testing.T) {
	pg := pgtest.Start(t)
	ctx := t.Context()
	defer func(p int) { reconcilePage = p }(reconcilePage)
	reconcilePage = 5

	key := []byte("operator-signing-key")
	bal := newReferenceBalance(t, pg, key)
	rdb := newRedis(t)
	if _, err := lua.GrabLibrary.Ensure(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	const uid = "rpb-reconcile"
	b := store.NewBudget(rdb, uid, 3)
	tb := testBudget{t: t, rdb: rdb, b: b}
	cfg := packetsConfig(tb, bal.url(), "operator-a", key)
	cfg.Logger = testLogger(t)
	if _, err := AnnounceBudgetTotal(ctx, cfg, b, 100_000); err != nil {
		t.Fatal(err)
	}
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 20_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeRandom}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
	if err := b.Configure(ctx, 100_000, limits); err != nil {
		t.Fatal(err)
	}
	for p := range 9 {
		id := fmt.Sprintf("order-%02d", p)
		if _, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "merchant-7", Total: 1000, Count: 4,
			Distribution: split.TypeRandom}); err != nil || outcome != store.CreateCreated {
			t.Fatalf("creating %s: %v, %v", id, outcome, err)
		}
		for u := range p % 5 {
			if _, err := b.GrabPacket(ctx, id, fmt.Sprintf("user-%d", u)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range b.N() {
		if _, _, err := b.ExpireDue(ctx, i, 500); err != nil {
			t.Fatal(err)
		}
	}
	settleBudget(t, cfg, b, "every shard drained")
	sums, err := b.SettlementLedger(0).Sums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := store.PaidTotals{Grants: sums.Grants, GrantSum: sums.Granted, Refunds: sums.Refunds, RefundSum: sums.Refunded}
	if want.GrantSum+want.RefundSum != 9*1000 || want.Refunds == 0 {
		t.Fatalf("the ledger paid %+v, want 9000 in grants and refunds", want)
	}
	rc, err := NewBudgetReconciler(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	if r := reconcileOnce(t, rc); r.Outcome != ReconcileAgreed || r.Book != want {
		t.Fatalf("after settlement: %+v, want agreed on %+v", r, want)
	}

	grantKey, refundKey := uid+"/order-03/1", uid+"/order-03/refund"
	digests := map[string]string{grantKey: bal.digest(t, grantKey), refundKey: bal.digest(t, refundKey)}
	for k, d := range digests {
		if d == "" {
			t.Fatalf("%s was not booked", k)
		}
	}
	bal.exec(t, `DELETE FROM credits WHERE idempotency_key = ANY($1)`, []string{grantKey, refundKey})
	r := reconcileOnce(t, rc)
	if r.Outcome != ReconcileAgreed || r.Redelivered != 2 || r.Book != want {
		t.Fatalf("after two rows were deleted: %+v, want both delivered again and agreed on %+v", r, want)
	}
	for k, d := range digests {
		if got := bal.digest(t, k); got != d {
			t.Errorf("%s booked again with digest %q, want %q", k, got, d)
		}
	}

	bal.exec(t, `INSERT INTO credits (idempotency_key, digest, kind, user_id, amount, currency, source_uid, packet_id, at)
		VALUES ($1, sha256('forged'), 'grant', 'mallory', 500, 'CNY', $2, 'order-99/0', now())`, uid+"/order-99/0", uid)
	r = reconcileOnce(t, rc)
	if r.Outcome != ReconcileDiffers || r.Unpaid != 1 || r.UnpaidSum != 500 || !strings.Contains(r.String(), uid+"/order-99/0") {
		t.Fatalf("after a forged row: %+v, want it named as unpaid", r)
	}

	// A balance system that has no read endpoints.
	plain := newPacketsBalance(t, key)
	pcfg := cfg
	pcfg.WebhookURL = plain.url()
	prc, err := NewBudgetReconciler(pcfg, b)
	if err != nil {
		t.Fatal(err)
	}
	if r := reconcileOnce(t, prc); r.Outcome != ReconcileUnsupported {
		t.Fatalf("against a balance system without the read endpoints: %+v", r)
	}
}

func TestReadBase(t *testing.T) {
	for in, want := range map[string]string{
		"http://balance:8080/v1/credits":        "http://balance:8080/v1",
		"https://b.example.com/credit?x=1#y":    "https://b.example.com",
		"http://balance.payments.svc:8080/":     "http://balance.payments.svc:8080",
		"http://h/a/b/credits":                  "http://h/a/b",
		"http://balance.payments.svc:8080/hook": "http://balance.payments.svc:8080",
	} {
		got, err := readBase(in)
		if err != nil || got != want {
			t.Errorf("readBase(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}
