package settlement

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// Every worker of an activity gets the same configuration from its spec, and the
// fingerprint changes exactly when what a delivery looks like changes.
func TestActivityConfig(t *testing.T) {
	a := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "quiz", UID: "uid-1"},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			Settlement: &redpacketv1alpha1.Settlement{
				Webhook:     &redpacketv1alpha1.Webhook{URL: "http://balance:8080/credit"},
				MaxAttempts: 7,
			},
		},
	}
	if !HasWebhook(a) {
		t.Fatal("HasWebhook is false with a webhook")
	}
	cfg := ActivityConfig(a, []byte("k"))
	if cfg.Source.Ref() != "ns/quiz" || cfg.Source.UID != "uid-1" ||
		cfg.Source.Currency != DefaultCurrency || cfg.WebhookURL != "http://balance:8080/credit" || cfg.MaxAttempts != 7 ||
		cfg.Group != DefaultGroup || string(cfg.SigningKey) != "k" || cfg.HTTPClient == nil || cfg.HTTPClient.Timeout != DefaultHTTPTimeout {
		t.Errorf("config %+v", cfg)
	}
	base := cfg.Fingerprint()
	if ActivityConfig(a, []byte("k")).Fingerprint() != base {
		t.Error("the same spec and key give another fingerprint")
	}
	if bytes.Contains([]byte(base), []byte("|k|")) {
		t.Errorf("the fingerprint %q holds the key", base)
	}
	if ActivityConfig(a, []byte("other")).Fingerprint() == base || ActivityConfig(a, nil).Fingerprint() == base {
		t.Error("a new signing key keeps the fingerprint")
	}
	// Every step of a rotation restarts the worker: a previous key added or dropped,
	// an Ed25519 key added, replaced or kept as the previous one.
	_, ed1, _ := ed25519.GenerateKey(rand.Reader)
	_, ed2, _ := ed25519.GenerateKey(rand.Reader)
	seen := map[string]string{base: "the HMAC key alone"}
	for name, set := range map[string]func(*Config){
		"a previous HMAC key":                  func(c *Config) { c.PreviousSigningKey = []byte("old") },
		"an Ed25519 key":                       func(c *Config) { c.Ed25519Key = ed1 },
		"another Ed25519 key":                  func(c *Config) { c.Ed25519Key = ed2 },
		"an Ed25519 key and its previous":      func(c *Config) { c.Ed25519Key, c.PreviousEd25519Key = ed2, ed1 },
		"the HMAC key as the previous key too": func(c *Config) { c.PreviousSigningKey = []byte("k") },
		"no HMAC key, only the previous one":   func(c *Config) { c.SigningKey, c.PreviousSigningKey = nil, []byte("k") },
	} {
		c := ActivityConfig(a, []byte("k"))
		set(&c)
		f := c.Fingerprint()
		if other, ok := seen[f]; ok {
			t.Errorf("%s and %s have one fingerprint", name, other)
		}
		seen[f] = name
	}
	b := a.DeepCopy()
	b.Spec.Currency = "USD"
	if c := ActivityConfig(b, []byte("k")); c.Source.Currency != "USD" || c.Fingerprint() == base {
		t.Errorf("currency %q, fingerprint unchanged: %v", c.Source.Currency, c.Fingerprint() == base)
	}
	b = a.DeepCopy()
	b.Spec.Settlement.Webhook.URL = "https://balance.example/credit"
	if ActivityConfig(b, []byte("k")).Fingerprint() == base {
		t.Error("a new webhook URL keeps the fingerprint")
	}

	b = a.DeepCopy()
	b.Spec.Settlement = nil
	if HasWebhook(b) {
		t.Error("HasWebhook is true without settlement")
	}
	if c := ActivityConfig(b, nil); c.WebhookURL != "" || c.MaxAttempts != 0 {
		t.Errorf("config without a webhook: %+v", c)
	}
}
