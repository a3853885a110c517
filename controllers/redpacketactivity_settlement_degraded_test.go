package controllers_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

// A webhook that fails every delivery is visible on the activity: SettlementDegraded
// turns True with the error class, status.settlementDelivery counts the grants being
// retried and says since when the oldest waits, and a Warning event says so, without
// the receiver's words. When the webhook recovers the condition turns False.
func TestFailingWebhookMakesSettlementDegraded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	b := newBalance(t, []byte(testSigningKey))
	b.setUp(false)
	e.startController(nil)
	e.allowWebhook(b.URL())
	a := e.create(e.activity("degraded", 1000, 10, withWebhook(b.URL(), "")))
	a = e.waitPhase(a.Name, redpacketv1alpha1.PhaseActive, 20*time.Second)
	grabbedAfter := time.Now().Add(-time.Second)
	for i := range 3 {
		if res := e.grab(a, fmt.Sprintf("user-%d", i)); res.Outcome != store.Granted {
			t.Fatalf("grab %d: %+v", i, res)
		}
	}

	got := e.waitCondition(a.Name, redpacketv1alpha1.ConditionSettlementDegraded, metav1.ConditionTrue,
		redpacketv1alpha1.ReasonDeliveriesFailing, 20*time.Second)
	wait.Until(t, 10*time.Second, "all three grants retrying", func() (bool, string) {
		got = e.get(a.Name)
		d := got.Status.SettlementDelivery
		return d != nil && d.Retrying == 3, fmt.Sprintf("%+v", d)
	})
	d := got.Status.SettlementDelivery
	c := findCondition(got, redpacketv1alpha1.ConditionSettlementDegraded)
	t.Logf("SettlementDegraded True: %s; status.settlementDelivery %+v", c.Message, *d)
	if d.LastErrorClass != settlement.ErrorClassHTTP5xx || d.LastErrorTime == nil {
		t.Errorf("last error %q at %v, want %s", d.LastErrorClass, d.LastErrorTime, settlement.ErrorClassHTTP5xx)
	}
	if d.OldestUndeliveredTime == nil || d.OldestUndeliveredTime.Time.Before(grabbedAfter.Truncate(time.Second)) ||
		d.OldestUndeliveredTime.Time.After(time.Now()) {
		t.Errorf("oldest undelivered %v, want the first grant's time (after %v)", d.OldestUndeliveredTime, grabbedAfter)
	}
	if !strings.Contains(c.Message, settlement.ErrorClassHTTP5xx) || strings.Contains(c.Message, "balance system down") {
		t.Errorf("SettlementDegraded's message %q: want the class, never the receiver's words", c.Message)
	}
	e.waitEvent(a.Name, "Warning", redpacketv1alpha1.ReasonDeliveriesFailing)
	for _, note := range e.eventNotes(a.Name) {
		if strings.Contains(note, "balance system down") {
			t.Errorf("an event echoes the receiver: %s", note)
		}
	}
	// Rate-limited: many failed deliveries, one Warning event about them.
	time.Sleep(2 * time.Second)
	warnings := 0
	for _, note := range e.eventNotes(a.Name) {
		if strings.HasPrefix(note, redpacketv1alpha1.ReasonDeliveriesFailing+":") {
			warnings++
		}
	}
	if warnings != 1 {
		t.Errorf("%d %s events while deliveries kept failing, want 1 (rate-limited): %v", warnings,
			redpacketv1alpha1.ReasonDeliveriesFailing, e.eventNotes(a.Name))
	}

	b.setUp(true)
	got = e.waitCondition(a.Name, redpacketv1alpha1.ConditionSettlementDegraded, metav1.ConditionFalse,
		redpacketv1alpha1.ReasonDeliveriesHealthy, 30*time.Second)
	if d := got.Status.SettlementDelivery; d == nil || d.Retrying != 0 || d.OldestUndeliveredTime != nil {
		t.Errorf("after recovery status.settlementDelivery %+v, want nothing retrying", d)
	}
}
