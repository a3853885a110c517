package controllers_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/pkg/webhooksig"
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
	operators, _ := standardwebhooks.NewWebhook(webhooksig.FormatSecret([]byte(testSigningKey)))
	tenants, _ := standardwebhooks.NewWebhook(webhooksig.FormatSecret([]byte(tenantKey)))
	for _, r := range reqs {
		if r.signature != settlement.Sign([]byte(testSigningKey), r.body) {
			t.Errorf("request %s does not verify with the operator's key", r.body)
		}
		if r.signature == settlement.Sign([]byte(tenantKey), r.body) {
			t.Errorf("request %s verifies with the tenant's key", r.body)
		}
		// Issue 35: the announcement and the grants carry Standard Webhooks
		// signatures too, made with the operator's key alone.
		if err := operators.Verify(r.body, r.header); err != nil {
			t.Errorf("request %s: the Standard Webhooks library refuses it under the operator's key: %v", r.body, err)
		}
		if tenants.Verify(r.body, r.header) == nil {
			t.Errorf("request %s verifies with the tenant's key (Standard Webhooks)", r.body)
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

// setSettlementKeys sets entries of the test's settlement keys Secret: the operator's
// keys for balance systems, by entry name.
func (e *env) setSettlementKeys(entries map[string][]byte) {
	e.t.Helper()
	ctx := context.Background()
	keys := &corev1.Secret{}
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: testSettlementKeys}, keys); err != nil {
		e.t.Fatalf("reading the settlement keys Secret: %v", err)
	}
	if keys.Data == nil {
		keys.Data = map[string][]byte{}
	}
	for k, v := range entries {
		keys.Data[k] = v
	}
	if err := e.c.Update(ctx, keys); err != nil {
		e.t.Fatalf("setting settlement keys: %v", err)
	}
}

// recordingReceiver is rain.Receiver, a real balance system, behind an HTTP server
// that records each request's headers and body.
type recordingReceiver struct {
	*rain.Receiver
	srv *httptest.Server

	mu   sync.Mutex
	seen []signedRequest
}

func newRecordingReceiver(t *testing.T, rc *rain.Receiver) *recordingReceiver {
	r := &recordingReceiver{Receiver: rc}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		r.mu.Lock()
		r.seen = append(r.seen, signedRequest{body: body, signature: req.Header.Get("X-Signature"), header: req.Header.Clone()})
		r.mu.Unlock()
		req.Body = io.NopCloser(bytes.NewReader(body))
		rc.ServeHTTP(w, req)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

// entry is the keys Secret's entry name for the receiver's host and port.
func (r *recordingReceiver) entry() string {
	u, _ := url.Parse(r.srv.URL)
	return u.Hostname() + controllers.AllowlistPortSeparator + u.Port()
}

func (r *recordingReceiver) requests() []signedRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]signedRequest(nil), r.seen...)
}

// versions are the signature versions of a webhook-signature header, in order.
func versions(header string) string {
	var vs []string
	for _, s := range strings.Split(header, " ") {
		v, _, _ := strings.Cut(s, ",")
		vs = append(vs, v)
	}
	return strings.Join(vs, " ")
}

// Issue 35, the keys Secret's Standard Webhooks entries, on a real API server and
// Redis, each balance system a rain.Receiver verifying Standard Webhooks:
//
//   - a host with only "<host>_<port>.ed25519" (the operator's Ed25519 key, "whsk_")
//     is allowed: the announcement and the grant reach a balance system that holds
//     only the public key, each with one v1a signature and no X-Signature, and are
//     credited;
//   - during a rotation of both keys ("<host>_<port>" and ".previous", ".ed25519" and
//     ".ed25519.previous") every request carries a v1 with each HMAC key and a v1a
//     with each Ed25519 key, so a balance system that still holds only the old HMAC
//     key credits them; X-Signature is the new key's.
func TestOperatorSignsStandardWebhooksWithTheSecretsKeys(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)
	settle := func(name string, r *recordingReceiver) {
		t.Helper()
		e.create(e.activity(name, 1000, 5, withWebhook(r.srv.URL+"/credit", "")))
		a := e.waitPhase(name, redpacketv1alpha1.PhaseActive, 20*time.Second)
		res := e.grab(a, "u1")
		if res.Outcome != store.Granted {
			t.Fatalf("grab: %+v", res)
		}
		wait.Until(t, 20*time.Second, name+": the grant credited", func() (bool, string) {
			_, ok := r.Delivered(string(a.UID) + "/" + res.PacketID)
			return ok, fmt.Sprintf("totals %+v", r.Totals())
		})
		if tot := r.Totals(); tot.BadRequests != 0 || tot.Budgets != 1 || tot.Grants != 1 {
			t.Fatalf("%s: totals %+v, want the announcement and the grant, nothing refused", name, tot)
		}
	}

	// v1a only.
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	asym := rain.NewReceiver(nil)
	asym.PublicKeys = []ed25519.PublicKey{pub}
	v1a := newRecordingReceiver(t, asym)
	e.setSettlementKeys(map[string][]byte{v1a.entry() + controllers.Ed25519KeySuffix: []byte(webhooksig.FormatPrivateKey(priv) + "\n")})
	settle("asymmetric", v1a)
	for _, r := range v1a.requests() {
		if r.signature != "" || versions(r.header.Get("webhook-signature")) != "v1a" {
			t.Errorf("request %s: X-Signature %q, webhook-signature %q; want one v1a and no X-Signature",
				r.body, r.signature, r.header.Get("webhook-signature"))
		}
	}

	// A rotation of both keys, the balance system still on the old HMAC key.
	newKey, oldKey := []byte("hmac-new"), []byte("hmac-old")
	oldPub, oldPriv, _ := ed25519.GenerateKey(rand.Reader)
	rotating := newRecordingReceiver(t, rain.NewReceiver(oldKey))
	n := rotating.entry()
	e.setSettlementKeys(map[string][]byte{
		n:                                 newKey,
		n + controllers.PreviousKeySuffix: oldKey,
		n + controllers.Ed25519KeySuffix:  []byte(webhooksig.FormatPrivateKey(priv)),
		n + controllers.Ed25519KeySuffix + controllers.PreviousKeySuffix: []byte(webhooksig.FormatPrivateKey(oldPriv)),
	})
	settle("rotating", rotating)
	current, _ := standardwebhooks.NewWebhook(webhooksig.FormatSecret(newKey))
	for _, r := range rotating.requests() {
		if got := versions(r.header.Get("webhook-signature")); got != "v1 v1 v1a v1a" {
			t.Errorf("request %s: signatures %q, want a v1 and a v1a with each key", r.body, got)
		}
		if err := current.Verify(r.body, r.header); err != nil {
			t.Errorf("request %s: the new HMAC key does not verify: %v", r.body, err)
		}
		for name, k := range map[string]ed25519.PublicKey{"new": pub, "old": oldPub} {
			v := webhooksig.Verifier{PublicKeys: []ed25519.PublicKey{k}}
			if _, err := v.Verify(r.header, r.body); err != nil {
				t.Errorf("request %s: the %s Ed25519 key does not verify: %v", r.body, name, err)
			}
		}
		if r.signature != settlement.Sign(newKey, r.body) {
			t.Errorf("request %s: X-Signature is not the new key's", r.body)
		}
	}
}
