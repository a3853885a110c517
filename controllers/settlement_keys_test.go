package controllers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

// Issue 24 item 3: the key that signs credits is the operator's, from the Secret in
// its own namespace, per balance-system host; the tenant's Secret named by the
// deprecated spec.settlement.webhook.secretRef signs nothing. The operator announces
// the budget first, signed, then delivers the grants; every request verifies with
// the operator's key and none with the tenant's. A webhook whose host has no key
// gets nothing at all: Settled turns False with WebhookHostNotAllowed and a Warning
// event says why; so does the allowed host on a port no key names, and a URL with
// userinfo.
func TestOperatorSignsWithItsOwnKeyOnlyForAllowedHosts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()
	const tenantKey = "the-tenants-own-key"
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "balance-hmac", Namespace: e.ns},
		Data: map[string][]byte{"key": []byte(tenantKey)}}
	if err := e.c.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}

	// An allowed host (127.0.0.1 has a key in the operator's Secret).
	bal := newBalance(t, []byte(testSigningKey))
	bal.setUp(true)
	e.allowWebhook(bal.URL())
	e.create(e.activity("signed", 1000, 5, withWebhook(bal.URL(), "balance-hmac")))
	a := e.waitPhase("signed", redpacketv1alpha1.PhaseActive, 20*time.Second)
	res := e.grab(a, "u1")
	if res.Outcome != store.Granted {
		t.Fatalf("grab: %+v", res)
	}
	wait.Until(t, 20*time.Second, "the grant credited", func() (bool, string) {
		credited, bad := bal.credits()
		_, ok := credited[string(a.UID)+"/"+res.PacketID]
		return ok, fmt.Sprintf("credited %v, refused %v", credited, bad)
	})
	if _, bad := bal.credits(); len(bad) > 0 {
		t.Fatalf("refused deliveries: %v", bad)
	}
	reqs := bal.requests()
	var first struct {
		Kind   string `json:"kind"`
		Amount int64  `json:"amount"`
		Count  int64  `json:"count"`
	}
	if err := json.Unmarshal(reqs[0].body, &first); err != nil || first.Kind != settlement.KindAnnouncement || first.Amount != 1000 || first.Count != 5 {
		t.Fatalf("first request %s, want the budget of 1000 in 5 packets", reqs[0].body)
	}
	for _, r := range reqs {
		if r.signature != settlement.Sign([]byte(testSigningKey), r.body) {
			t.Errorf("request %s does not verify with the operator's key", r.body)
		}
		if r.signature == settlement.Sign([]byte(tenantKey), r.body) {
			t.Errorf("request %s verifies with the tenant's key", r.body)
		}
	}

	// A host with no key: nothing is delivered.
	elsewhere := newBalance(t, nil)
	elsewhere.setUp(true)
	url := strings.Replace(elsewhere.URL(), "127.0.0.1", "localhost", 1)
	e.create(e.activity("unlisted", 1000, 5, withWebhook(url, "balance-hmac")))
	b := e.waitPhase("unlisted", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if res := e.grab(b, "u2"); res.Outcome != store.Granted {
		t.Fatalf("grab: %+v", res)
	}
	e.waitCondition("unlisted", redpacketv1alpha1.ConditionSettled, metav1.ConditionFalse, redpacketv1alpha1.ReasonWebhookHostNotAllowed, 20*time.Second)
	e.waitEvent("unlisted", corev1.EventTypeWarning, redpacketv1alpha1.ReasonWebhookHostNotAllowed)
	consistently(t, 2*time.Second, "no request to the unlisted host", func() (bool, string) {
		n := elsewhere.attempts()
		return n == 0, fmt.Sprintf("%d requests", n)
	})

	// Issue 34 case 8: the allowed host on a port no key names, and an allowed host
	// and port behind userinfo, get nothing either.
	otherPort := newBalance(t, nil)
	otherPort.setUp(true)
	behindUser := newBalance(t, nil)
	behindUser.setUp(true)
	e.allowWebhook(behindUser.URL())
	for name, url := range map[string]string{
		"other-port":  otherPort.URL(),
		"behind-user": strings.Replace(behindUser.URL(), "http://", "http://evil@", 1),
	} {
		e.create(e.activity(name, 1000, 5, withWebhook(url, "")))
		a := e.waitPhase(name, redpacketv1alpha1.PhaseActive, 20*time.Second)
		if res := e.grab(a, "u3"); res.Outcome != store.Granted {
			t.Fatalf("grab: %+v", res)
		}
		e.waitCondition(name, redpacketv1alpha1.ConditionSettled, metav1.ConditionFalse, redpacketv1alpha1.ReasonWebhookHostNotAllowed, 20*time.Second)
	}
	consistently(t, 2*time.Second, "no request to another port or behind userinfo", func() (bool, string) {
		n, m := otherPort.attempts(), behindUser.attempts()
		return n == 0 && m == 0, fmt.Sprintf("%d requests to the other port, %d behind userinfo", n, m)
	})
}
