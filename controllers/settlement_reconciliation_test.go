package controllers_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	refbalance "redpacket.io/operator/internal/balance"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/pgtest"
	"redpacket.io/operator/test/wait"
)

// referenceBalance serves the reference balance system (internal/balance) on a fresh
// database of pg over real HTTP, allowed by the test's settlement keys; it returns
// the pool on the book and the webhook URL.
func (e *env) referenceBalance(pg *pgtest.Server) (*pgxpool.Pool, string) {
	e.t.Helper()
	ctx := context.Background()
	dsn, err := pg.NewDatabase(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(pool.Close)
	if _, err := refbalance.Migrate(ctx, pool); err != nil {
		e.t.Fatal(err)
	}
	hs := httptest.NewServer(refbalance.Handler(refbalance.Config{Book: refbalance.NewBook(pool), Keys: [][]byte{[]byte(testSigningKey)},
		Log: slog.New(slog.DiscardHandler)}))
	e.t.Cleanup(hs.Close)
	e.allowWebhook(hs.URL)
	return pool, hs.URL + "/v1/credits"
}

// mismatch reads redpacket_reconciliation_mismatch{source,kind} from the
// operator's metrics registry (-1 when the series is absent).
func mismatch(t *testing.T, source, kind string) float64 {
	t.Helper()
	families, err := ctrlmetrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "redpacket_reconciliation_mismatch" {
			continue
		}
		for _, m := range f.GetMetric() {
			if label(m, "source") == source && label(m, "kind") == kind {
				return m.GetGauge().GetValue()
			}
		}
	}
	return -1
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// A budget settled by the operator's runner into the reference balance system on a
// real PostgreSQL, reconciled every 300 ms: Reconciled turns True once the book holds
// every grant and refund; a credit row deleted by hand is delivered again under its
// key and the books agree again; a row inserted by hand makes Reconciled False with
// the key named, a Warning BooksDiffer and redpacket_reconciliation_mismatch{kind=
// "unpaid"} 1; the deleted budget then keeps its keys (Ready False, NotReconciled)
// until the platform team abandons it, and is purged then.
func TestBudgetReconciledWithTheReferenceBalanceSystem(t *testing.T) {
	installPolicies(t)
	pg := pgtest.Start(t)
	e := newEnv(t)
	ctx := context.Background()
	pool, url := e.referenceBalance(pg)
	runner := controllers.NewBudgetSettlementRunner(cp.Client, nil, controllers.Options{
		SettlementKeysSecret: types.NamespacedName{Namespace: e.ns, Name: testSettlementKeys},
		SettlementConsumer:   "operator-test", SettlementRegisterer: prometheus.NewRegistry(),
		ReconcileInterval: 300 * time.Millisecond})
	rctx, stopRunner := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runner.Start(rctx) }()
	t.Cleanup(func() { stopRunner(); <-done })
	e.startBudgetController(runner)

	const name = "reconciled"
	b := e.createConfiguredBudget(name, redpacketv1alpha1.RedPacketBudgetSpec{
		Total: 100_000, BudgetShards: 2,
		Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 10_000, MaxCount: 10,
			Distributions: []redpacketv1alpha1.DistributionType{redpacketv1alpha1.DistributionRandom}},
		Settlement: &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: url}},
	})
	uid := string(b.UID)
	h := store.NewBudget(e.rdb, uid, 2)
	const packets, each, grabbed = 6, int64(1000), 2
	for p := range packets {
		id := fmt.Sprintf("order-%d", p)
		if _, outcome, err := h.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "merchant-1", Total: each, Count: 4,
			Distribution: split.TypeRandom, TTL: time.Second}); err != nil || outcome != store.CreateCreated {
			t.Fatalf("creating %s: %s, %v", id, outcome, err)
		}
		for u := range grabbed {
			if g, err := h.GrabPacket(ctx, id, fmt.Sprintf("user-%d", u)); err != nil || g.Outcome != store.PacketGranted {
				t.Fatalf("grab of %s: %+v, %v", id, g, err)
			}
		}
	}
	reconciled := func(what string, status metav1.ConditionStatus, reason, contains string) *metav1.Condition {
		t.Helper()
		var c *metav1.Condition
		e.waitRedPacketBudget(name, what, 60*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
			c = meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReconciled)
			return c != nil && c.Status == status && c.Reason == reason && strings.Contains(c.Message, contains)
		})
		t.Logf("%s: Reconciled=%s %s: %s", what, c.Status, c.Reason, c.Message)
		return c
	}
	all := fmt.Sprintf("the balance system booked %d grants", packets*grabbed)
	reconciled("every credit booked", metav1.ConditionTrue, redpacketv1alpha1.ReasonBooksAgree, all)
	e.waitRedPacketBudget(name, "every refund booked", 60*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReconciled)
		return c != nil && c.Status == metav1.ConditionTrue && strings.Contains(c.Message, fmt.Sprintf("and %d refunds", packets))
	})

	lost := uid + "/order-2/1"
	var digest string
	if err := pool.QueryRow(ctx, `DELETE FROM credits WHERE idempotency_key = $1 RETURNING encode(digest, 'hex')`, lost).Scan(&digest); err != nil {
		t.Fatalf("deleting %s: %v", lost, err)
	}
	wait.Until(t, 30*time.Second, "the deleted credit booked again", func() (bool, string) {
		var again string
		err := pool.QueryRow(ctx, `SELECT encode(digest, 'hex') FROM credits WHERE idempotency_key = $1`, lost).Scan(&again)
		return err == nil && again == digest, fmt.Sprintf("digest %q, %v", again, err)
	})
	reconciled("the books agree again", metav1.ConditionTrue, redpacketv1alpha1.ReasonBooksAgree, all)

	forged := uid + "/order-9/0"
	if _, err := pool.Exec(ctx, `INSERT INTO credits (idempotency_key, digest, kind, user_id, amount, currency, source_uid, packet_id, at)
		VALUES ($1, sha256('forged'), 'grant', 'mallory', 300, 'CNY', $2, 'order-9/0', now())`, forged, uid); err != nil {
		t.Fatal(err)
	}
	reconciled("a credit booked that the operator never paid", metav1.ConditionFalse, redpacketv1alpha1.ReasonBooksDiffer, forged)
	wait.Until(t, 10*time.Second, "the Warning BooksDiffer", func() (bool, string) {
		note := e.eventNote(name, corev1.EventTypeWarning, redpacketv1alpha1.ReasonBooksDiffer)
		return strings.Contains(note, forged), note
	})
	if v := mismatch(t, "rpb/"+e.ns+"/"+name, "unpaid"); v != 1 {
		t.Errorf("redpacket_reconciliation_mismatch{kind=unpaid} = %v, want 1", v)
	}

	if err := e.c.Delete(ctx, b); err != nil {
		t.Fatal(err)
	}
	held := e.waitRedPacketBudget(name, "the deletion held", 60*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReady)
		return c != nil && c.Reason == redpacketv1alpha1.ReasonNotReconciled && strings.Contains(c.Message, forged)
	})
	if c := meta.FindStatusCondition(held.Status.Conditions, redpacketv1alpha1.ConditionReady); !strings.Contains(c.Message, redpacketv1alpha1.AnnotationAbandon) {
		t.Errorf("the held deletion says %q: want the way out", c.Message)
	}
	t.Logf("held: %s", meta.FindStatusCondition(held.Status.Conditions, redpacketv1alpha1.ConditionReady).Message)
	time.Sleep(time.Second)
	if n, err := e.rdb.Exists(ctx, "rpl:{"+uid+"}:ledger").Result(); err != nil || n != 1 {
		t.Fatalf("the ledger of the held budget: exists %d, %v", n, err)
	}
	// The platform team abandons the held deletion: the keys go while the book
	// still holds the forged row, and the event names who.
	p := e.people()
	wait.Until(t, 30*time.Second, "the platform user's abandon admitted", func() (bool, string) {
		// The platform role's binding reaches the API server's authorizer shortly.
		err := e.annotateBudget(p.asPlatform, name, map[string]string{
			redpacketv1alpha1.AnnotationAbandon: uid, redpacketv1alpha1.AnnotationAbandonedBy: p.platform})
		return err == nil, errString(err)
	})
	wait.Until(t, 30*time.Second, "the budget purged once abandoned", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(b), &redpacketv1alpha1.RedPacketBudget{})
		return isNotFound(err), fmt.Sprintf("%v", err)
	})
	if note := e.eventNote(name, corev1.EventTypeWarning, redpacketv1alpha1.ReasonAbandoned); !strings.Contains(note, p.platform) ||
		!strings.Contains(note, "reconciliation") {
		t.Errorf("the Abandoned warning %q does not name %s and the reconciliation", note, p.platform)
	}
	if keys, err := e.rdb.Keys(ctx, "rpb:{"+uid+".*").Result(); err != nil || len(keys) != 0 {
		t.Errorf("keys left after the abandoned budget was purged: %v (%v)", keys, err)
	}
	if v := mismatch(t, "rpb/"+e.ns+"/"+name, "unpaid"); v != -1 {
		t.Errorf("redpacket_reconciliation_mismatch of the gone budget is still exported: %v", v)
	}
}

// An activity settled by the operator into the reference balance system on a real
// PostgreSQL, reconciled every 300 ms: Reconciled turns True; a grant row deleted by
// hand is delivered again with its original digest; a row inserted by hand makes
// Reconciled False, naming its key; deleting the activity closes it, refunds the rest
// and, settlement drained, holds its keys (Ready False, NotReconciled) until the
// forged row is gone; then the books agree, refund included, and it is purged.
func TestActivityReconciledWithTheReferenceBalanceSystem(t *testing.T) {
	pg := pgtest.Start(t)
	e := newEnv(t)
	ctx := context.Background()
	pool, url := e.referenceBalance(pg)
	e.startController(func(r *controllers.RedPacketActivityReconciler) { r.Options.ReconcileInterval = 300 * time.Millisecond })

	const name = "reconciled"
	e.create(e.activity(name, 1000, 8, withWebhook(url, "")))
	a := e.waitPhase(name, redpacketv1alpha1.PhaseActive, 20*time.Second)
	uid := string(a.UID)
	var granted []store.GrabResult
	for u := range 5 {
		res := e.grab(a, fmt.Sprintf("user-%d", u))
		if res.Outcome != store.Granted {
			t.Fatalf("grab: %+v", res)
		}
		granted = append(granted, res)
	}
	reconciled := func(what string, status metav1.ConditionStatus, reason, contains string) {
		t.Helper()
		got := e.waitStatus(name, what, func(a *redpacketv1alpha1.RedPacketActivity) bool {
			c := meta.FindStatusCondition(a.Status.Conditions, redpacketv1alpha1.ConditionReconciled)
			return c != nil && c.Status == status && c.Reason == reason && strings.Contains(c.Message, contains)
		})
		c := meta.FindStatusCondition(got.Status.Conditions, redpacketv1alpha1.ConditionReconciled)
		t.Logf("%s: Reconciled=%s %s: %s", what, c.Status, c.Reason, c.Message)
	}
	reconciled("the grants booked", metav1.ConditionTrue, redpacketv1alpha1.ReasonBooksAgree, "the balance system booked 5 grants")

	lost := uid + "/" + granted[2].PacketID
	var digest string
	if err := pool.QueryRow(ctx, `DELETE FROM credits WHERE idempotency_key = $1 RETURNING encode(digest, 'hex')`, lost).Scan(&digest); err != nil {
		t.Fatalf("deleting %s: %v", lost, err)
	}
	wait.Until(t, 30*time.Second, "the deleted grant booked again", func() (bool, string) {
		var again string
		err := pool.QueryRow(ctx, `SELECT encode(digest, 'hex') FROM credits WHERE idempotency_key = $1`, lost).Scan(&again)
		return err == nil && again == digest, fmt.Sprintf("digest %q, %v", again, err)
	})

	forged := uid + "/8"
	if _, err := pool.Exec(ctx, `INSERT INTO credits (idempotency_key, digest, kind, user_id, amount, currency, source_uid, packet_id, at)
		VALUES ($1, sha256('forged'), 'grant', 'mallory', 1, 'CNY', $2, '8', now())`, forged, uid); err != nil {
		t.Fatal(err)
	}
	reconciled("a credit booked that the operator never paid", metav1.ConditionFalse, redpacketv1alpha1.ReasonBooksDiffer, forged)

	if err := e.c.Delete(ctx, a); err != nil {
		t.Fatal(err)
	}
	held := e.waitCondition(name, redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonNotReconciled, 30*time.Second)
	if c := findCondition(held, redpacketv1alpha1.ConditionReady); !strings.Contains(c.Message, forged) && !strings.Contains(c.Message, "waits for a reconciliation") {
		t.Errorf("the held deletion says %q", c.Message)
	}
	consistently(t, time.Second, "the keys held while the books differ", func() (bool, string) {
		return e.dbsize() > 0, fmt.Sprintf("%d keys", e.dbsize())
	})
	if _, err := pool.Exec(ctx, `DELETE FROM credits WHERE idempotency_key = $1`, forged); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 30*time.Second, "the activity purged once the books agree", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(a), &redpacketv1alpha1.RedPacketActivity{})
		return isNotFound(err), "get: " + errString(err)
	})
	var grants, refunds, sum int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE kind = 'grant'), count(*) FILTER (WHERE kind = 'refund'), coalesce(sum(amount), 0)
		FROM credits WHERE source_uid = $1`, uid).Scan(&grants, &refunds, &sum); err != nil {
		t.Fatal(err)
	}
	if grants != 5 || refunds != 1 || sum != 1000 {
		t.Errorf("the book holds %d grants and %d refunds summing to %d; want 5, 1 and the whole 1000", grants, refunds, sum)
	}
}
