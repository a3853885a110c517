package controllers

import (
	"context"
	"slices"
	"testing"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// The settlement step starts the operator's worker only for a webhook whose host and
// port have a key in the operator's keys Secret; any other host or port, and a URL
// with userinfo, gets no worker, Settled False with WebhookHostNotAllowed and one
// Warning event. (The real API server and Redis version is
// TestOperatorSignsWithItsOwnKeyOnlyForAllowedHosts.)
func TestSettlementStepRefusesHostsWithoutAKey(t *testing.T) {
	for _, tc := range []struct {
		name, url string
		allowed   bool
	}{
		{"a host with a key", "http://balance:8080/credit", true},
		{"the same host on another port", "http://balance:9999/credit", false},
		{"the same host on Redis's port", "http://balance:6379/credit", false},
		{"userinfo before an allowed host", "http://evil@balance:8080/credit", false},
		{"a host without a key", "http://balance.elsewhere:8080/credit", false},
		{"a key's name as a suffix", "http://evil-balance:8080/credit", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPhaseTest(t, store.Snapshot{State: store.StateOpen, Count: 5, Total: 1000})
			a := testActivity(withWebhook, func(a *redpacketv1alpha1.RedPacketActivity) {
				a.Spec.Settlement.Webhook.URL = tc.url
			})
			s := p.scope(a)
			if _, err := p.r.reconcileSettlement(context.Background(), s); err != nil {
				t.Fatalf("settlement step: %v", err)
			}
			computeSettled(s)
			c := meta.FindStatusCondition(s.status.Conditions, redpacketv1alpha1.ConditionSettled)
			blocked := c != nil && c.Status == metav1.ConditionFalse && c.Reason == redpacketv1alpha1.ReasonWebhookHostNotAllowed
			if blocked == tc.allowed {
				t.Errorf("Settled %+v; allowed %v", c, tc.allowed)
			}
			if running := p.r.Settlers.Running(a.UID); running != tc.allowed {
				t.Errorf("worker registered %v, want %v", running, tc.allowed)
			}
			warned := slices.Contains(p.eventReasons(), "Warning "+redpacketv1alpha1.ReasonWebhookHostNotAllowed)
			if warned == tc.allowed {
				t.Errorf("Warning WebhookHostNotAllowed emitted %v; allowed %v", warned, tc.allowed)
			}
		})
	}
}
