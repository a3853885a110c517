package controllers

import (
	"context"
	"errors"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
)

// The allowlist of balance systems, key by key: "<host>_<port>" allows that host
// on that port, "<host>" the scheme's default port only; a name is fully qualified
// (a trailing dot and case do not matter, a short name never matches a longer one);
// userinfo, ports of an allowed host that no key names, and hosts no key can name
// are refused; a rotation's previous key never signs; two spellings of one entry
// with different keys allow nothing.
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
			key, err := readSettlementKey(context.Background(), c, ref, tc.url)
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
