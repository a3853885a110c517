package settlement

import (
	"bytes"
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
