package controllers_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/internal/rain"
)

// blackHole is a balance system that does not answer until it is released: every
// request is held open (as a host that accepts and never replies holds it), then
// handed to next once release is called.
type blackHole struct {
	next     http.Handler
	released chan struct{}
	once     sync.Once
	mu       sync.Mutex
	held     int
}

func (h *blackHole) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	select {
	case <-h.released:
	default:
		h.mu.Lock()
		h.held++
		h.mu.Unlock()
		select {
		case <-h.released:
		case <-r.Context().Done():
			return
		}
	}
	h.next.ServeHTTP(w, r)
}

func (h *blackHole) release() { h.once.Do(func() { close(h.released) }) }

func (h *blackHole) heldCount() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.held
}

// Issue 34, case 8: a balance system that does not answer holds no reconcile. Four
// budgets announce their totals to a webhook that holds every request open, more
// budgets than the controller has workers (2), so a reconcile that waited for its
// announcement would hold every worker for the POST's 10 s timeout. A fifth budget,
// created after them with a webhook that answers, is configured within 5 s all the
// same. The four show Ready False with TotalNotAnnounced, Redis allots them nothing,
// and the steps after configure still ran (their grab Deployments exist). Once the
// webhook answers, each is announced and configured. Before, every reconcile of the
// four waited out the timeout, and the fifth waited behind them.
func TestUnansweredAnnouncementHoldsNoOtherBudget(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	receiver := rain.NewReceiver([]byte(testSigningKey))
	receiver.RequireBudget = true
	good := httptest.NewServer(receiver)
	t.Cleanup(good.Close)
	hole := &blackHole{next: receiver, released: make(chan struct{})}
	held := httptest.NewServer(hole)
	t.Cleanup(held.Close)
	t.Cleanup(hole.release)
	e.allowWebhook(good.URL)
	e.allowWebhook(held.URL)

	e.startBudgetController(e.startBudgetSettlementRunner(), func(o *controllers.Options) { o.MaxConcurrentReconciles = 2 })

	newBudget := func(name, webhook string) {
		t.Helper()
		b := &redpacketv1alpha1.RedPacketBudget{
			ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
			Spec: redpacketv1alpha1.RedPacketBudgetSpec{
				Total: 10_000, BudgetShards: 2,
				Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 1_000, MaxCount: 10,
					Distributions: []redpacketv1alpha1.DistributionType{redpacketv1alpha1.DistributionRandom}},
				Settlement: &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: webhook + "/credit"}},
			},
		}
		if err := e.c.Create(ctx, b); err != nil {
			t.Fatal(err)
		}
	}
	const stuck = 4
	for i := range stuck {
		newBudget(fmt.Sprintf("unanswered-%d", i), held.URL)
	}
	deadline := time.Now().Add(30 * time.Second)
	for hole.heldCount() < stuck {
		if time.Now().After(deadline) {
			t.Fatalf("the webhook holds %d announcements, want %d", hole.heldCount(), stuck)
		}
		time.Sleep(20 * time.Millisecond)
	}

	created := time.Now()
	newBudget("answered", good.URL)
	e.waitRedPacketBudget("answered", "configured while the others' announcements hang", 5*time.Second,
		func(b *redpacketv1alpha1.RedPacketBudget) bool { return is(b.Status.Total, 10_000) })
	t.Logf("the answered budget was configured %s after its creation, beside %d hanging announcements",
		time.Since(created).Round(time.Millisecond), stuck)

	for i := range stuck {
		name := fmt.Sprintf("unanswered-%d", i)
		b := e.waitRedPacketBudget(name, "Ready False with TotalNotAnnounced", 10*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
			c := meta.FindStatusCondition(b.Status.Conditions, "Ready")
			return c != nil && c.Status == metav1.ConditionFalse && c.Reason == redpacketv1alpha1.ReasonTotalNotAnnounced
		})
		if b.Status.Total != nil && *b.Status.Total != 0 {
			t.Fatalf("%s: Redis allots %d before the balance system acknowledged the total", name, *b.Status.Total)
		}
		if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: name + "-grab"}, &appsv1.Deployment{}); err != nil {
			t.Fatalf("%s: the steps after configure did not run while the announcement hangs: %v", name, err)
		}
		if amount, _, ok := receiver.Budget(string(b.UID)); ok {
			t.Fatalf("%s: the receiver booked an announcement of %d while it was held", name, amount)
		}
	}

	hole.release()
	for i := range stuck {
		name := fmt.Sprintf("unanswered-%d", i)
		b := e.waitRedPacketBudget(name, "configured once the webhook answers", 60*time.Second,
			func(b *redpacketv1alpha1.RedPacketBudget) bool { return is(b.Status.Total, 10_000) })
		if amount, _, ok := receiver.Budget(string(b.UID)); !ok || amount != 10_000 {
			t.Fatalf("%s: announced %d (%v), want 10000", name, amount, ok)
		}
	}
}
