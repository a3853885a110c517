package controllers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

// Deleting an activity closes it (refunding the rest), waits for settlement to drain,
// then removes its Redis keys and the finalizer.
func TestDeletionWaitsForSettlementThenPurges(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()

	// The balance system is down until the test says so.
	bal := newBalance(t, nil)
	e.allowWebhook(bal.URL())
	e.create(e.activity("gone", 1000, 5, withWebhook(bal.URL(), "")))
	a := e.waitPhase("gone", redpacketv1alpha1.PhaseActive, 20*time.Second)
	var granted int64
	for _, u := range []string{"u1", "u2"} {
		res := e.grab(a, u)
		if res.Outcome != store.Granted {
			t.Fatalf("grab: %+v", res)
		}
		granted += res.Amount
	}

	if err := e.c.Delete(ctx, a); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "the deleted activity closed in Redis", func() (bool, string) {
		snap := e.snapshot(a)
		return snap.State == store.StateClosed, string(snap.State)
	})
	if snap := e.snapshot(a); snap.Refunded != 1000-granted {
		t.Errorf("refund on deletion %d, want %d", snap.Refunded, 1000-granted)
	}
	// The status says what the deletion waits for, and the closed activity's refund.
	held := e.waitCondition("gone", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonDeleting, 10*time.Second)
	ready := findCondition(held, redpacketv1alpha1.ConditionReady)
	wantMsg := fmt.Sprintf("waiting for 2 of 2 claims to settle and the refund of %d before removing", 1000-granted)
	if !strings.Contains(ready.Message, wantMsg) || !strings.Contains(ready.Message, "purge at ") {
		t.Errorf("Ready message %q, want it to contain %q and the purge time", ready.Message, wantMsg)
	}
	if held.Status.Phase != redpacketv1alpha1.PhaseExpired || held.Status.RefundedAmount == nil || *held.Status.RefundedAmount != 1000-granted {
		t.Errorf("status while deleting: %s, refunded %v; want Expired with refund %d", describe(held), held.Status.RefundedAmount, 1000-granted)
	}
	// Settlement has not drained: the keys and the finalizer stay.
	consistently(t, time.Second, "the finalizer holding the activity", func() (bool, string) {
		held := e.get("gone")
		return controllerutil.ContainsFinalizer(held, controllers.Finalizer) && e.dbsize() > 0, describe(held)
	})

	// The balance system comes back: the operator's settlement worker delivers the two
	// grants and the refund, and the deletion completes.
	bal.setUp(true)
	wait.Until(t, 20*time.Second, "the activity gone", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(a), &redpacketv1alpha1.RedPacketActivity{})
		return isNotFound(err), "get: " + errString(err)
	})
	if n := e.dbsize(); n != 0 {
		keys, _ := e.rdb.Keys(ctx, "*").Result()
		t.Fatalf("%d keys left in Redis after deletion: %v", n, keys)
	}
	e.waitEvent("gone", "Normal", "Purged")
	if credited, bad := bal.credits(); len(credited) != 3 || len(bad) != 0 {
		t.Errorf("the balance system credited %d deliveries (bad: %v), want 2 grants and 1 refund", len(credited), bad)
	}
}

// When settlement does not drain within the grace period, the keys are purged anyway
// with a Warning event.
func TestDeletionPurgesAfterGracePeriod(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Options.CleanupGracePeriod = 2 * time.Second
	})
	ctx := context.Background()

	// The balance system never answers with a 2xx.
	bal := newBalance(t, nil)
	e.allowWebhook(bal.URL())
	e.create(e.activity("stuck", 1000, 5, withWebhook(bal.URL(), "")))
	a := e.waitPhase("stuck", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if res := e.grab(a, "u1"); res.Outcome != store.Granted {
		t.Fatalf("grab: %+v", res)
	}
	if err := e.c.Delete(ctx, a); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 15*time.Second, "the activity gone", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(a), &redpacketv1alpha1.RedPacketActivity{})
		return isNotFound(err), "get: " + errString(err)
	})
	// Only the settlement stream is left, with an expiry: it records the grant and the
	// refund that were never credited; and the operator's ledger of what was credited,
	// with the same expiry, so a replay of those entries cannot be credited twice.
	keys := e.keys(a)
	ledger := e.handle(a).Ledger().Key()
	if n := e.dbsize(); n != 2 {
		all, _ := e.rdb.Keys(ctx, "*").Result()
		t.Fatalf("%d keys left in Redis after the grace period (%v), want only the settlement stream and the ledger", n, all)
	}
	if ttl, err := e.rdb.TTL(ctx, ledger).Result(); err != nil || ttl <= 0 || ttl > controllers.DefaultUnsettledRetention {
		t.Fatalf("ledger TTL %s (%v), want the retention", ttl, err)
	}
	if n, err := e.rdb.XLen(ctx, keys.Stream).Result(); err != nil || n != 2 {
		t.Fatalf("settlement stream has %d entries (%v), want the grant and the refund", n, err)
	}
	if ttl, err := e.rdb.TTL(ctx, keys.Stream).Result(); err != nil || ttl <= 0 || ttl > controllers.DefaultUnsettledRetention {
		t.Fatalf("settlement stream TTL %s (%v), want the retention", ttl, err)
	}
	e.waitEvent("stuck", "Warning", "CleanupGracePeriodExpired")
	if credited, _ := bal.credits(); len(credited) != 0 {
		t.Errorf("the balance system credited %v while it was down", credited)
	}
}

// With no grab pod left (as after foreground deletion, where the garbage collector
// removes the grab Deployment first), the operator settles a deleted activity: every
// claim and the refund are credited, signed with the operator's key for the
// webhook's host (the tenant's Secret named by the deprecated secretRef holds another
// key and signs nothing), then the keys are purged, the finalizer removed, and the
// operator's worker stopped.
func TestDeletionSettlesWithoutGrabWorkers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var rec *controllers.RedPacketActivityReconciler
	e.startController(func(r *controllers.RedPacketActivityReconciler) { rec = r })
	ctx := context.Background()

	// The key as kubectl create secret --from-file stores it, with the file's newline.
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "balance-hmac", Namespace: e.ns},
		Data: map[string][]byte{"key": []byte("the-tenants-own-key\n")}}
	if err := e.c.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}
	bal := newBalance(t, []byte(testSigningKey))
	const total = 1000
	e.allowWebhook(bal.URL())
	e.create(e.activity("orphaned", total, 5, withWebhook(bal.URL(), "balance-hmac")))
	a := e.waitPhase("orphaned", redpacketv1alpha1.PhaseActive, 20*time.Second)
	granted := map[string]store.GrabResult{}
	var claimed int64
	for _, u := range []string{"u1", "u2", "u3"} {
		res := e.grab(a, u)
		if res.Outcome != store.Granted {
			t.Fatalf("grab: %+v", res)
		}
		granted[u] = res
		claimed += res.Amount
	}

	// No grab pod runs here at all: only the operator can settle.
	if err := e.c.Delete(ctx, a); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "a delivery attempt from the operator", func() (bool, string) {
		n := bal.attempts()
		return n > 0, fmt.Sprintf("%d attempts", n)
	})
	if !rec.Settlers.Running(a.UID) {
		t.Errorf("no settlement worker registered for the deleted activity")
	}
	held := e.waitCondition("orphaned", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonDeleting, 10*time.Second)
	if msg := findCondition(held, redpacketv1alpha1.ConditionReady).Message; !strings.Contains(msg, "the operator is settling them") {
		t.Errorf("Ready message %q, want it to say the operator settles", msg)
	}

	bal.setUp(true)
	wait.Until(t, 30*time.Second, "the activity gone", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(a), &redpacketv1alpha1.RedPacketActivity{})
		return isNotFound(err), "get: " + errString(err)
	})
	if rec.Settlers.Running(a.UID) || rec.Settlers.Len() != 0 {
		t.Errorf("settlement workers left after the deletion: running %v, %d registered", rec.Settlers.Running(a.UID), rec.Settlers.Len())
	}
	if n := e.dbsize(); n != 0 {
		keys, _ := e.rdb.Keys(ctx, "*").Result()
		t.Fatalf("%d keys left in Redis after deletion: %v", n, keys)
	}
	e.waitEvent("orphaned", "Normal", "Purged")

	credited, bad := bal.credits()
	if len(bad) != 0 {
		t.Errorf("rejected deliveries: %v", bad)
	}
	if len(credited) != len(granted)+1 {
		t.Fatalf("%d deliveries credited, want %d grants and the refund: %v", len(credited), len(granted), credited)
	}
	var sum int64
	for user, res := range granted {
		d, ok := credited[string(a.UID)+"/"+res.PacketID]
		if !ok || d.Kind != "grant" || d.UserID != user || d.Amount != res.Amount || d.Currency != "CNY" ||
			d.Activity != e.ns+"/orphaned" || d.ActivityUID != string(a.UID) {
			t.Errorf("credit of packet %s: %+v (found %v), want a grant of %d to %s", res.PacketID, d, ok, res.Amount, user)
		}
		sum += d.Amount
	}
	refund, ok := credited[string(a.UID)+"/refund"]
	if !ok || refund.Kind != "refund" || refund.UserID != "merchant-001" || refund.Amount != total-claimed {
		t.Errorf("refund %+v (found %v), want %d to merchant-001", refund, ok, total-claimed)
	}
	if sum+refund.Amount != total {
		t.Errorf("credited %d + refund %d, want the total %d", sum, refund.Amount, total)
	}
}

func errString(err error) string {
	if err == nil {
		return "found"
	}
	return err.Error()
}

// withWebhook sets a settlement webhook, signed with the key of the named Secret
// unless secret is empty.
func withWebhook(url, secret string) func(*redpacketv1alpha1.RedPacketActivity) {
	return func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Settlement = &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: url}, MaxAttempts: 10}
		if secret != "" {
			a.Spec.Settlement.Webhook.SecretRef = &redpacketv1alpha1.SecretReference{Name: secret}
		}
	}
}

// balance is a balance system's webhook: it checks each delivery's signature (when
// it has a key) and Idempotency-Key, answers 503 while down, and credits each
// Idempotency-Key once, however often it is delivered.
type balance struct {
	key []byte
	srv *httptest.Server

	mu       sync.Mutex
	up       bool
	tries    int
	credited map[string]settlement.Delivery
	bad      []string
	budgets  int // budget announcements received
	// signed are the raw bodies and headers of every request, in order.
	signed []signedRequest
}

func newBalance(t *testing.T, key []byte) *balance {
	b := &balance{key: key, credited: map[string]settlement.Delivery{}}
	b.srv = httptest.NewServer(http.HandlerFunc(b.serve))
	t.Cleanup(b.srv.Close)
	return b
}

func (b *balance) URL() string { return b.srv.URL + "/credit" }

func (b *balance) setUp(up bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.up = up
}

func (b *balance) serve(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/credit" {
		// No read endpoints: the operator's reconciliation finds none.
		http.NotFound(w, r)
		return
	}
	body, _ := io.ReadAll(r.Body)
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tries++
	b.signed = append(b.signed, signedRequest{body: body, signature: r.Header.Get("X-Signature"), header: r.Header.Clone()})
	var d settlement.Delivery
	var kind struct {
		Kind string `json:"kind"`
	}
	_ = json.Unmarshal(body, &kind)
	switch {
	case kind.Kind == settlement.KindAnnouncement:
		// The budget announcement, before any grant; recorded even while down, so the
		// grants' deliveries are what the tests time.
		if b.key != nil && r.Header.Get("X-Signature") != settlement.Sign(b.key, body) {
			b.bad = append(b.bad, "bad signature on the budget")
			break
		}
		b.budgets++
		w.WriteHeader(http.StatusOK)
		return
	case json.Unmarshal(body, &d) != nil:
		b.bad = append(b.bad, "undecodable body "+string(body))
	case r.Header.Get("Idempotency-Key") != d.IdempotencyKey():
		b.bad = append(b.bad, "Idempotency-Key "+r.Header.Get("Idempotency-Key")+" for "+d.IdempotencyKey())
	case b.key != nil && r.Header.Get("X-Signature") != settlement.Sign(b.key, body):
		b.bad = append(b.bad, "bad signature "+r.Header.Get("X-Signature")+" on "+d.IdempotencyKey())
	case !b.up:
		http.Error(w, "balance system down", http.StatusServiceUnavailable)
		return
	default:
		if _, dup := b.credited[d.IdempotencyKey()]; !dup {
			b.credited[d.IdempotencyKey()] = d
		}
		w.WriteHeader(http.StatusOK)
		return
	}
	http.Error(w, "rejected", http.StatusBadRequest)
}

// credits returns what was credited, by Idempotency-Key, and the deliveries refused
// as malformed or unsigned.
func (b *balance) credits() (map[string]settlement.Delivery, []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make(map[string]settlement.Delivery, len(b.credited))
	for k, v := range b.credited {
		out[k] = v
	}
	return out, append([]string(nil), b.bad...)
}

// signedRequest is one request's body, X-Signature and headers as the balance system
// got them.
type signedRequest struct {
	body      []byte
	signature string
	header    http.Header
}

// requests returns every request received so far.
func (b *balance) requests() []signedRequest {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]signedRequest(nil), b.signed...)
}

func (b *balance) attempts() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.tries
}
