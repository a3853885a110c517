package controllers_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

// annotateBudget merge-patches annotations of the named budget as c.
func (e *env) annotateBudget(c client.Client, name string, kv map[string]string, opts ...client.PatchOption) error {
	b := e.getBudget(name)
	orig := b.DeepCopy()
	if b.Annotations == nil {
		b.Annotations = map[string]string{}
	}
	for k, v := range kv {
		b.Annotations[k] = v
	}
	return c.Patch(context.Background(), b, client.MergeFrom(orig), opts...)
}

// balanceWithOutage is a real balance system, rain.Receiver behind an HTTP server at
// url, that answers 503 while down is set.
type balanceWithOutage struct {
	receiver *rain.Receiver
	down     atomic.Bool
	url      string
}

func newBalanceWithOutage(t *testing.T) *balanceWithOutage {
	bal := &balanceWithOutage{receiver: rain.NewReceiver([]byte(testSigningKey))}
	bal.receiver.RequireBudget = true
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if bal.down.Load() {
			http.Error(w, "the balance system is down", http.StatusServiceUnavailable)
			return
		}
		bal.receiver.ServeHTTP(w, r)
	}))
	t.Cleanup(hs.Close)
	bal.url = hs.URL
	return bal
}

// budgetWithPackets creates the budget name, 10,000 over 2 shards settled to
// balanceURL/credit with maxAttempts, waits until it is configured, and creates n
// packets of 500 in 5 Fixed shares living an hour; it returns the budget and its
// store handle.
func (e *env) budgetWithPackets(t *testing.T, name, balanceURL string, maxAttempts int32, n int) (*redpacketv1alpha1.RedPacketBudget, *store.Budget) {
	t.Helper()
	ctx := context.Background()
	e.allowWebhook(balanceURL)
	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{
			Total: 10_000, BudgetShards: 2,
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 1000, MaxCount: 10,
				Distributions: []redpacketv1alpha1.DistributionType{redpacketv1alpha1.DistributionFixed}},
			Settlement: &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: balanceURL + "/credit"}, MaxAttempts: maxAttempts},
		},
	}
	if err := e.c.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	b = e.waitRedPacketBudget(name, "configured", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return is(b.Status.Total, 10_000)
	})
	h := store.NewBudget(e.rdb, string(b.UID), 2)
	for p := range n {
		id := fmt.Sprintf("order-%d", p)
		if _, outcome, err := h.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "merchant-1", Total: 500, Count: 5,
			Distribution: split.TypeFixed, TTL: time.Hour}); err != nil || outcome != store.CreateCreated {
			t.Fatalf("creating %s: %s, %v", id, outcome, err)
		}
	}
	return b, h
}

// A deleted budget whose balance system is down does not hang silently: its packets
// expire, and while the refunds wait in its streams Ready is False with
// SettlementPending, the count of unsettled entries and the way out, with a Warning
// event; past the cleanup grace period Stalled is True too. It is never let go on a
// timer. A tenant who may edit budgets cannot abandon it (the admission policy); an
// abandon that does not carry the budget's UID does nothing and says so; the platform
// team's abandon purges the keys and releases the budget, with a Warning Abandoned
// that names the count and who abandoned it. The balance system is a real HTTP
// server that answers 503 while it is down; the API server, Redis and the settlement
// runner are real.
func TestDeletedBudgetWaitsVisiblyOnSettlementUntilAbandoned(t *testing.T) {
	e := newEnv(t)
	installPolicies(t)
	ctx := context.Background()
	bal := newBalanceWithOutage(t)

	const grace = 3 * time.Second
	e.startBudgetController(e.startBudgetSettlementRunner(), func(o *controllers.Options) { o.CleanupGracePeriod = grace })

	// Enough attempts that no refund is dead-lettered while the test runs.
	const packets = 3
	b, _ := e.budgetWithPackets(t, "owed", bal.url, 1000, packets)
	uid := string(b.UID)

	// The balance system goes down; the deletion expires the three packets and their
	// refunds cannot be credited.
	bal.down.Store(true)
	if err := e.c.Delete(ctx, b); err != nil {
		t.Fatal(err)
	}
	// The packets' creation records are booked without the balance system; the three
	// refunds stay owed.
	b = e.waitRedPacketBudget("owed", "Ready False SettlementPending, counting the three refunds", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReady)
		return c != nil && c.Status == metav1.ConditionFalse && c.Reason == redpacketv1alpha1.ReasonSettlementPending &&
			strings.Contains(c.Message, fmt.Sprintf(": %d entries", packets))
	})
	ready := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReady)
	for _, want := range []string{fmt.Sprintf("%d entries", packets), bal.url, "redpacket.io/abandon=" + uid, "redpacket.io/abandoned-by"} {
		if !strings.Contains(ready.Message, want) {
			t.Errorf("Ready's message %q does not say %q", ready.Message, want)
		}
	}
	// The warning is made when the wait begins, which may be before the records were
	// booked: it counts the refunds and at most the records besides.
	note := e.eventNote("owed", "Warning", redpacketv1alpha1.ReasonSettlementPending)
	if n := owedCount(note); n < packets || n > 2*packets {
		t.Errorf("the SettlementPending warning %q counts %d entries; want the %d refunds and at most their packets' records", note, n, packets)
	}
	b = e.waitRedPacketBudget("owed", "Stalled past the grace period", grace+30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled)
		return c != nil && c.Status == metav1.ConditionTrue && c.Reason == redpacketv1alpha1.ReasonSettlementPending
	})
	if !strings.Contains(meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionStalled).Message, "cleanup grace period") {
		t.Errorf("Stalled does not name the grace period: %+v", b.Status.Conditions)
	}
	// Long past the grace period the budget is still held, its keys still there.
	consistently(t, 2*time.Second, "the deleted budget and its keys stay", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(b), &redpacketv1alpha1.RedPacketBudget{})
		keys, kerr := e.rdb.Keys(ctx, "rpb:{"+uid+".*").Result()
		return err == nil && kerr == nil && len(keys) > 0, fmt.Sprintf("get: %v, %d keys (%v)", err, len(keys), kerr)
	})

	// A tenant who may edit budgets may not abandon.
	p := e.people()
	budgetEditor := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "budget-editor"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"redpacket.io"}, Resources: []string{"redpacketbudgets"},
			Verbs: []string{"get", "list", "watch", "patch", "update"}}}}
	if err := e.c.Create(ctx, budgetEditor); err != nil {
		t.Fatal(err)
	}
	if err := e.c.Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "budget-editor-tenant"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "budget-editor"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: p.tenant}}}); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 30*time.Second, "the platform policy refuses the tenant's abandon", func() (bool, string) {
		err := e.annotateBudget(p.asTenant, "owed", map[string]string{
			redpacketv1alpha1.AnnotationAbandon: uid, redpacketv1alpha1.AnnotationAbandonedBy: p.tenant})
		return apierrors.IsForbidden(err) && strings.Contains(err.Error(), "platform decision") &&
			strings.Contains(err.Error(), "redpacketbudgets/owed"), errString(err)
	})

	// An abandon of another object's UID does nothing, and says so.
	if err := e.annotateBudget(p.asPlatform, "owed", map[string]string{
		redpacketv1alpha1.AnnotationAbandon: "not-" + uid, redpacketv1alpha1.AnnotationAbandonedBy: p.platform}); err != nil {
		t.Fatalf("the platform user annotating: %v", err)
	}
	e.waitRedPacketBudget("owed", "the misdirected abandon said", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReady)
		return c != nil && strings.Contains(c.Message, "does not carry this budget's UID")
	})
	if note := e.eventNote("owed", "Warning", redpacketv1alpha1.ReasonAbandonNotAllowed); !strings.Contains(note, "UID") {
		t.Errorf("the AbandonNotAllowed warning %q does not explain the UID", note)
	}

	// The platform team abandons: the keys go, the budget goes, the event names the
	// count and who.
	if err := e.annotateBudget(p.asPlatform, "owed", map[string]string{
		redpacketv1alpha1.AnnotationAbandon: uid, redpacketv1alpha1.AnnotationAbandonedBy: p.platform}); err != nil {
		t.Fatalf("the platform user abandoning: %v", err)
	}
	wait.Until(t, 30*time.Second, "the abandoned budget gone", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(b), &redpacketv1alpha1.RedPacketBudget{})
		return isNotFound(err), errString(err)
	})
	if keys, err := e.rdb.Keys(ctx, "rpb:{"+uid+".*").Result(); err != nil || len(keys) != 0 {
		t.Errorf("keys left after the abandon: %v (%v)", keys, err)
	}
	note = e.eventNote("owed", "Warning", redpacketv1alpha1.ReasonAbandoned)
	if !strings.Contains(note, p.platform) || !strings.Contains(note, fmt.Sprintf("%d entries", packets)) {
		t.Errorf("the Abandoned warning %q does not name %s and %d entries", note, p.platform, packets)
	}
	if tot := bal.receiver.Totals(); tot.Refunds != 0 {
		t.Errorf("refunds credited while the balance system was down: %+v", tot)
	}
}

// Dead letters are money owed, not a settled debt: a deleted budget whose refunds
// were dead-lettered while the balance system was down keeps its keys and says how
// many dead letters wait and how to replay them, and once they are replayed and
// credited it goes. Settlement makes one attempt per entry here, so every refund is
// dead-lettered at its first failure. The API server, Redis, the settlement runner
// and the balance system's HTTP server are real.
func TestDeletedBudgetWaitsForItsDeadLettersToBeReplayed(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	bal := newBalanceWithOutage(t)
	e.startBudgetController(e.startBudgetSettlementRunner())

	// One attempt: every refund is dead-lettered at its first failure.
	const packets = 3
	b, h := e.budgetWithPackets(t, "dead", bal.url, 1, packets)

	bal.down.Store(true)
	if err := e.c.Delete(ctx, b); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 60*time.Second, "every refund dead-lettered", func() (bool, string) {
		n, err := h.DeadLetterCount(ctx)
		if err == nil && n == packets {
			return true, ""
		}
		// What a failure needs to be understood: the budget's status, and each
		// shard's stream and what the operator's group has not settled of it.
		var streams []string
		for i := range h.N() {
			l, lerr := e.rdb.XLen(ctx, h.ShardKeys(i).Stream).Result()
			u, uerr := h.Stream(i).Unsettled(ctx, settlement.DefaultGroup)
			streams = append(streams, fmt.Sprintf("shard %d: %d entries, %d unsettled (%v, %v)", i, l, u, lerr, uerr))
		}
		got := &redpacketv1alpha1.RedPacketBudget{}
		gerr := e.c.Get(ctx, client.ObjectKeyFromObject(b), got)
		return false, fmt.Sprintf("%d dead letters, %v; %s; status %s (%v)", n, err, strings.Join(streams, "; "), describeBudget(got), gerr)
	})
	b = e.waitRedPacketBudget("dead", "Ready False SettlementPending naming the dead letters", 30*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReady)
		return c != nil && c.Reason == redpacketv1alpha1.ReasonSettlementPending && strings.Contains(c.Message, fmt.Sprintf("%d of them dead letters", packets))
	})
	msg := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReady).Message
	for _, want := range []string{fmt.Sprintf("%d entries", packets), fmt.Sprintf("%d of them dead letters", packets), "replay-dead-letters rpb/dead"} {
		if !strings.Contains(msg, want) {
			t.Errorf("Ready's message %q does not say %q", msg, want)
		}
	}
	consistently(t, 2*time.Second, "the deleted budget and its dead letters stay", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(b), &redpacketv1alpha1.RedPacketBudget{})
		n, derr := h.DeadLetterCount(ctx)
		return err == nil && derr == nil && n == packets, fmt.Sprintf("get: %v, %d dead letters (%v)", err, n, derr)
	})

	// The balance system is back; the dead letters are replayed, credited, and the
	// budget goes.
	bal.down.Store(false)
	moved := 0
	for i := range h.N() {
		n, err := h.Stream(i).ReplayDeadLetters(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		moved += n
	}
	if moved != packets {
		t.Fatalf("replayed %d dead letters, want %d", moved, packets)
	}
	wait.Until(t, 60*time.Second, "the budget gone once its refunds are credited", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(b), &redpacketv1alpha1.RedPacketBudget{})
		return isNotFound(err), errString(err)
	})
	if tot := bal.receiver.Totals(); tot.Refunds != packets || tot.RefundSum != packets*500 {
		t.Errorf("refunds credited: %+v, want %d of 500", tot, packets)
	}
}

// owedCount is the count of a SettlementPending warning, "deletion waits for
// settlement: <n> entries ...", or -1.
func owedCount(note string) int {
	var n int
	if _, err := fmt.Sscanf(note, "deletion waits for settlement: %d entries", &n); err != nil {
		return -1
	}
	return n
}
