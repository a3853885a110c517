package settlement

import (
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strconv"
	"strings"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// DefaultCurrency is the currency sent in deliveries of an activity whose
// spec.currency is empty: the API's default, spelt once in api/v1alpha1.
const DefaultCurrency = redpacketv1alpha1.DefaultCurrency

// SecretKey is the data key of an HMAC key in a Secret of the activity's namespace
// (the grab tokens' Secret).
const SecretKey = "key"

// HasWebhook reports whether the activity has a settlement webhook, that is whether a
// settlement worker should run for it.
func HasWebhook(a *redpacketv1alpha1.RedPacketActivity) bool {
	st := a.Spec.Settlement
	return st != nil && st.Webhook != nil && st.Webhook.URL != ""
}

// ActivityConfig is the worker configuration of the activity's settlement worker,
// which the operator runs: "<namespace>/<name>", the UID, the
// currency (DefaultCurrency when empty), the webhook URL and maxAttempts from the
// spec, signingKey (the operator's key for the webhook's host; nil sends unsigned
// deliveries), the default consumer group and an
// HTTP client with DefaultHTTPTimeout. Because every worker uses the same group, the
// workers of one activity share its stream: each entry is delivered by one of them at
// a time. The caller sets Redis (a client of the worker's own, on which the worker
// reaches the activity through its handle, store.NewActivity), Consumer, and optionally
// Registerer and Logger. An activity without a webhook gets an empty WebhookURL, with
// which a worker idles.
func ActivityConfig(a *redpacketv1alpha1.RedPacketActivity, signingKey []byte) Config {
	currency := a.Spec.Currency
	if currency == "" {
		currency = DefaultCurrency
	}
	cfg := Config{
		Source: Source{Kind: SourceKindActivity, Namespace: a.Namespace, Name: a.Name,
			UID: string(a.UID), Currency: currency},
		SigningKey: signingKey,
		Group:      DefaultGroup,
		HTTPClient: &http.Client{Timeout: DefaultHTTPTimeout},
	}
	if HasWebhook(a) {
		cfg.WebhookURL = a.Spec.Settlement.Webhook.URL
		cfg.MaxAttempts = int(a.Spec.Settlement.MaxAttempts)
	}
	return cfg
}

// Fingerprint identifies what a worker built from cfg delivers, and where: the
// activity, its UID, the webhook URL, the currency, maxAttempts and (a hash of) the
// signing keys, the current and previous HMAC and Ed25519 keys. Two configurations
// with the same fingerprint deliver the same bodies with the same signatures, so a
// running worker is restarted only when it changes: a rotation's every step, a key
// replaced, a previous key added or removed, restarts it. It holds no secret.
func (cfg Config) Fingerprint() string {
	h := sha256.New()
	for _, k := range [][]byte{cfg.SigningKey, cfg.PreviousSigningKey, cfg.Ed25519Key, cfg.PreviousEd25519Key} {
		// Each key length-prefixed, so that no two sets of keys hash alike.
		_, _ = h.Write([]byte(strconv.Itoa(len(k)) + ":"))
		_, _ = h.Write(k)
	}
	return strings.Join([]string{cfg.Source.UID, cfg.Source.Ref(), cfg.WebhookURL, cfg.Source.Currency,
		strconv.Itoa(cfg.MaxAttempts), hex.EncodeToString(h.Sum(nil))}, "|")
}
