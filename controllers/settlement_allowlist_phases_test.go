package controllers

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/settlement"
)

// The allowlist of balance systems, key by key: "<host>_<port>" allows that host
// on that port, "<host>" the scheme's default port only; a name is fully qualified
// (a trailing dot and case do not matter, a short name never matches a longer one);
// userinfo, ports of an allowed host that no key names, and hosts no key can name
// are refused; a rotation's previous key never allows a host; two spellings of one
// entry with different keys allow nothing.
func TestSettlementKeyAllowlist(t *testing.T) {
	data := map[string][]byte{
		"balance.payments.svc.cluster.local":           []byte("payments-default-port"),
		"balance.payments.svc.cluster.local_8443":      []byte("payments-8443"),
		"balance.shop.svc.cluster.local.previous":      []byte("shop-previous"),
		"balance.shop.svc.cluster.local_8080":          []byte("shop-8080"),
		"balance.shop.svc.cluster.local_8080.previous": []byte("shop-8080-previous"),
		"127.0.0.1_38080":                              []byte("loopback-38080"),
		"Ledger.Example.COM.":                          []byte("ledger"),
		"balance":                                      []byte("short-name"),
		"twice.example.com_9000":                       []byte("one"),
		"TWICE.example.com._9000":                      []byte("two"),
		"same.example.com_9000":                        []byte("same"),
		"Same.example.com._9000":                       []byte("same"),
	}
	ref := types.NamespacedName{Namespace: "redpacket-system", Name: DefaultSettlementKeysSecret}
	c := fake.NewClientBuilder().WithObjects(&corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ref.Namespace, Name: ref.Name}, Data: data}).Build()
	for _, tc := range []struct {
		name, url string
		want      string // the key that signs; "" when refused
	}{
		{"a host-only key allows http's default port", "http://balance.payments.svc.cluster.local/credit", "payments-default-port"},
		{"and the explicit default port", "http://balance.payments.svc.cluster.local:80/credit", "payments-default-port"},
		{"and https's default port", "https://balance.payments.svc.cluster.local/credit", "payments-default-port"},
		{"a host-only key allows no other port", "http://balance.payments.svc.cluster.local:8080/credit", ""},
		{"not Redis's port", "http://balance.payments.svc.cluster.local:6379/credit", ""},
		{"not the kubelet's port", "https://balance.payments.svc.cluster.local:10250/credit", ""},
		{"not https on http's port", "https://balance.payments.svc.cluster.local:80/credit", ""},
		{"a host_port key allows that port", "https://balance.payments.svc.cluster.local:8443/credit", "payments-8443"},
		{"a trailing dot is the same name", "https://balance.payments.svc.cluster.local.:8443/credit", "payments-8443"},
		{"case is the same name", "http://BALANCE.Payments.svc.cluster.local/credit", "payments-default-port"},
		{"a key with a trailing dot and capitals", "http://ledger.example.com/credit", "ledger"},
		{"a host_port key allows no other port", "http://balance.shop.svc.cluster.local:8081/credit", ""},
		{"nor the default port", "http://balance.shop.svc.cluster.local/credit", ""},
		{"a previous key never allows", "http://balance.shop.svc.cluster.local:8080/credit", "shop-8080"},
		{"an IP and port", "http://127.0.0.1:38080/credit", "loopback-38080"},
		{"the IP on another port", "http://127.0.0.1:6379/credit", ""},
		{"a short name matches only itself", "http://balance/credit", "short-name"},
		{"not a longer name through search domains", "http://balance.payments.svc/credit", ""},
		{"nor a longer key for a short name", "http://balance.payments/credit", ""},
		{"a key's name as a suffix", "http://evil-balance/credit", ""},
		{"userinfo", "http://evil@balance.payments.svc.cluster.local/credit", ""},
		{"user and password", "http://u:p@balance.payments.svc.cluster.local/credit", ""},
		{"an underscore in the host", "http://balance.payments.svc.cluster.local_8443/credit", ""},
		{"an IPv6 literal", "http://[::1]:38080/credit", ""},
		{"another scheme", "ftp://balance.payments.svc.cluster.local/credit", ""},
		{"two spellings, two keys", "http://twice.example.com:9000/credit", ""},
		{"two spellings, one key", "http://same.example.com:9000/credit", "same"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys, err := readSettlementKeys(context.Background(), c, ref, tc.url)
			key := keys.hmac
			switch {
			case tc.want == "" && err == nil:
				t.Errorf("%s is allowed, signed with %q", tc.url, key)
			case tc.want == "" && !errors.Is(err, errWebhookHostNotAllowed):
				t.Errorf("%s refused with %v, want errWebhookHostNotAllowed", tc.url, err)
			case tc.want != "" && (err != nil || string(key) != tc.want):
				t.Errorf("%s: key %q, %v; want %q", tc.url, key, err, tc.want)
			}
		})
	}
}

// The keys Secret's Standard Webhooks entries, read for a host: "<name>.previous"
// is the HMAC key being rotated out, "<name>.ed25519" the operator's Ed25519 key
// ("whsk_" and base64), "<name>.ed25519.previous" the one being rotated out. An
// Ed25519 key alone allows its host (v1a only, no HMAC key, so no X-Signature); the
// previous keys come from the same name as the current ones and never allow alone;
// a value that is not a key is an error that names the entry and not the value.
func TestSettlementKeysForStandardWebhooks(t *testing.T) {
	_, ed1, _ := ed25519.GenerateKey(rand.Reader)
	_, ed2, _ := ed25519.GenerateKey(rand.Reader)
	_, ed3, _ := ed25519.GenerateKey(rand.Reader)
	data := map[string][]byte{
		// Everything for one host and port.
		"rotating.example.com_8080":                   []byte("hmac-new"),
		"rotating.example.com_8080.previous":          []byte("hmac-old"),
		"rotating.example.com_8080.ed25519":           []byte(webhooksig.FormatPrivateKey(ed1) + "\n"),
		"Rotating.Example.com._8080.ED25519.previous": []byte(webhooksig.FormatPrivateKey(ed2)),
		// v1a only, on the default port.
		"asymmetric.example.com.ed25519": []byte(webhooksig.FormatPrivateKey(ed3)),
		// A previous key alone allows nothing, at either name.
		"retired.example.com.previous":         []byte("hmac-old"),
		"retired.example.com.ed25519.previous": []byte(webhooksig.FormatPrivateKey(ed2)),
		// The most precise name decides, previous keys included: host_port's HMAC
		// key, not the bare host's Ed25519 key and previous key.
		"mixed.example.com_80":               []byte("hmac-port"),
		"mixed.example.com.ed25519":          []byte(webhooksig.FormatPrivateKey(ed1)),
		"mixed.example.com.previous":         []byte("hmac-bare-old"),
		"broken.example.com.ed25519":         []byte("c2VlZA=="),
		"short.example.com.ed25519":          []byte("whsk_c2VlZA=="),
		"ambiguous.example.com.ed25519":      []byte(webhooksig.FormatPrivateKey(ed1)),
		"AMBIGUOUS.example.com..ed25519":     []byte(webhooksig.FormatPrivateKey(ed2)),
		"emptyprevious.example.com":          []byte("hmac"),
		"emptyprevious.example.com.previous": []byte("\n"),
	}
	ref := types.NamespacedName{Namespace: "redpacket-system", Name: DefaultSettlementKeysSecret}
	c := fake.NewClientBuilder().WithObjects(&corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ref.Namespace, Name: ref.Name}, Data: data}).Build()
	read := func(url string) (settlementKeys, error) {
		return readSettlementKeys(context.Background(), c, ref, url)
	}

	k, err := read("http://rotating.example.com:8080/credit")
	if err != nil || string(k.hmac) != "hmac-new" || string(k.previousHMAC) != "hmac-old" ||
		!k.ed25519.Equal(ed1) || !k.previousEd25519.Equal(ed2) {
		t.Errorf("a rotation of both keys: %+v, %v", k, err)
	}
	var cfg settlement.Config
	k.apply(&cfg)
	if string(cfg.SigningKey) != "hmac-new" || string(cfg.PreviousSigningKey) != "hmac-old" ||
		!cfg.Ed25519Key.Equal(ed1) || !cfg.PreviousEd25519Key.Equal(ed2) {
		t.Errorf("the worker's keys: %+v", cfg)
	}

	k, err = read("https://asymmetric.example.com/credit")
	if err != nil || k.hmac != nil || k.previousHMAC != nil || !k.ed25519.Equal(ed3) || k.previousEd25519 != nil {
		t.Errorf("an Ed25519 key alone: %+v, %v", k, err)
	}
	if _, err := read("https://asymmetric.example.com:8443/credit"); !errors.Is(err, errWebhookHostNotAllowed) {
		t.Errorf("the Ed25519 key of a bare host allows another port: %v", err)
	}
	if _, err := read("http://retired.example.com/credit"); !errors.Is(err, errWebhookHostNotAllowed) {
		t.Errorf("previous keys alone allow the host: %v", err)
	}
	k, err = read("http://mixed.example.com/credit")
	if err != nil || string(k.hmac) != "hmac-port" || k.ed25519 != nil || k.previousHMAC != nil {
		t.Errorf("the most precise name: %+v, %v", k, err)
	}
	if _, err := read("http://ambiguous.example.com/credit"); !errors.Is(err, errWebhookHostNotAllowed) {
		t.Errorf("two spellings of one Ed25519 entry with two keys: %v", err)
	}
	for _, url := range []string{"http://broken.example.com/credit", "http://short.example.com/credit", "http://emptyprevious.example.com/credit"} {
		_, err := read(url)
		if err == nil || errors.Is(err, errWebhookHostNotAllowed) {
			t.Errorf("%s: %v, want an error about the value", url, err)
			continue
		}
		if strings.Contains(err.Error(), "c2VlZA") {
			t.Errorf("%s: the error shows the value: %v", url, err)
		}
	}
}
