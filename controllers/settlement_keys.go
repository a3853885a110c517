package controllers

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"redpacket.io/operator/pkg/hmackey"
)

// DefaultSettlementKeysSecret is the name of the Secret, in the operator's own
// namespace, that holds the keys signing settlement deliveries.
const DefaultSettlementKeysSecret = "redpacket-settlement-keys"

// DefaultOperatorNamespace is the operator's namespace when POD_NAMESPACE is unset.
const DefaultOperatorNamespace = "redpacket-system"

// PreviousKeySuffix marks, in the keys Secret, a balance system's previous key during
// a rotation ("<host>.previous", "<host>_<port>.previous"): kept for the balance system's side of the rotation
// and never used to sign.
const PreviousKeySuffix = ".previous"

// errWebhookHostNotAllowed is wrapped by settlementKey's error when the keys Secret
// holds no key for the webhook's host and port, or the URL carries userinfo: the
// platform team has not allowed that balance system, and nothing is delivered to it.
var errWebhookHostNotAllowed = errors.New("the webhook's host is not allowed")

// operatorNamespace is the namespace the operator runs in: POD_NAMESPACE (set from
// the pod's metadata by the install manifests), else DefaultOperatorNamespace.
func operatorNamespace() string {
	if ns := os.Getenv("POD_NAMESPACE"); ns != "" {
		return ns
	}
	return DefaultOperatorNamespace
}

// settlementKeysSecret is where the signing keys are: Options.SettlementKeysSecret,
// defaulted.
func (o Options) settlementKeysSecret() types.NamespacedName {
	k := o.SettlementKeysSecret
	if k.Name == "" {
		k.Name = DefaultSettlementKeysSecret
	}
	if k.Namespace == "" {
		k.Namespace = operatorNamespace()
	}
	return k
}

// AllowlistPortSeparator separates a host from its port in a key of the keys Secret:
// "balance.payments.svc.cluster.local_8443" allows that host on port 8443. A Secret's
// data keys hold only [-._a-zA-Z0-9], so the ':' of host:port cannot be there, and no
// host name holds a '_'.
const AllowlistPortSeparator = "_"

// webhookTarget is where a webhook URL delivers to, as the allowlist reads it.
type webhookTarget struct {
	// host is the URL's host name in lower case without a trailing dot: a name is
	// read as fully qualified, so "balance.payments.svc" and "balance.payments.svc."
	// are one name, and the deliveries dial it as such (settlement's transport adds
	// the dot), never through the resolver's search domains.
	host string
	// port is the URL's port, the scheme's default (80, 443) when it names none.
	port int
	// defaultPort is set when port is the scheme's default.
	defaultPort bool
}

// keys are the Secret keys that may allow t, the most precise first: host_port,
// then, on the scheme's default port only, the host alone.
func (t webhookTarget) keys() []string {
	exact := t.host + AllowlistPortSeparator + strconv.Itoa(t.port)
	if t.defaultPort {
		return []string{exact, t.host}
	}
	return []string{exact}
}

// parseWebhookTarget reads the host and port that webhookURL delivers to. A URL the
// allowlist cannot vouch for wraps errWebhookHostNotAllowed: userinfo
// ("http://evil@balance.payments.svc/", which a reader may take for another host
// than the one dialled), an IPv6 literal or a name with '_' (no Secret key can name
// them), a scheme other than http and https, a port out of range.
func parseWebhookTarget(webhookURL string) (webhookTarget, error) {
	u, err := url.Parse(webhookURL)
	if err != nil || u.Hostname() == "" {
		return webhookTarget{}, fmt.Errorf("spec.settlement.webhook.url %q has no host", webhookURL)
	}
	if u.User != nil {
		return webhookTarget{}, fmt.Errorf("%w: spec.settlement.webhook.url %q carries userinfo (a user or password before the host): it is never delivered to",
			errWebhookHostNotAllowed, u.Redacted())
	}
	var defaultPort int
	switch strings.ToLower(u.Scheme) {
	case "http":
		defaultPort = 80
	case "https":
		defaultPort = 443
	default:
		return webhookTarget{}, fmt.Errorf("%w: spec.settlement.webhook.url %q: scheme %q is not http or https", errWebhookHostNotAllowed, webhookURL, u.Scheme)
	}
	host := strings.ToLower(strings.TrimSuffix(u.Hostname(), "."))
	if host == "" || strings.HasSuffix(host, ".") || strings.ContainsAny(host, ":"+AllowlistPortSeparator) {
		return webhookTarget{}, fmt.Errorf("%w: spec.settlement.webhook.url %q: host %q cannot be named by a key of the settlement keys Secret (an IPv6 literal, a '_' or an empty label)",
			errWebhookHostNotAllowed, webhookURL, u.Hostname())
	}
	t := webhookTarget{host: host, port: defaultPort, defaultPort: true}
	if p := u.Port(); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 || n > 65535 {
			return webhookTarget{}, fmt.Errorf("%w: spec.settlement.webhook.url %q: port %q is out of range", errWebhookHostNotAllowed, webhookURL, p)
		}
		t.port, t.defaultPort = n, n == defaultPort
	}
	return t, nil
}

// normalAllowlistKey is a Secret key as the allowlist compares it: in lower case,
// with the host's trailing dot removed ("Balance.Payments.SVC._8080" is
// "balance.payments.svc_8080"), so two spellings of one name are one entry.
func normalAllowlistKey(k string) string {
	k = strings.ToLower(k)
	host, port, found := strings.Cut(k, AllowlistPortSeparator)
	host = strings.TrimSuffix(host, ".")
	if !found {
		return host
	}
	return host + AllowlistPortSeparator + port
}

// allowedKey is the value of the keys Secret data that allows t: the entries of the
// first of t.keys() that any entry spells (case and a trailing dot of the host
// aside). Entries for the same key with different values are ambiguous and allow
// nothing; a rotation's previous key (PreviousKeySuffix) never allows.
func allowedKey(data map[string][]byte, t webhookTarget) (key string, value []byte, err error) {
	for _, want := range t.keys() {
		var found []string
		for k := range data {
			if !strings.HasSuffix(k, PreviousKeySuffix) && normalAllowlistKey(k) == want {
				found = append(found, k)
			}
		}
		if len(found) == 0 {
			continue
		}
		sort.Strings(found)
		for _, k := range found[1:] {
			if !bytes.Equal(data[k], data[found[0]]) {
				return "", nil, fmt.Errorf("%w: keys %q and %q name %s and hold different values", errWebhookHostNotAllowed, found[0], k, want)
			}
		}
		return found[0], data[found[0]], nil
	}
	return "", nil, fmt.Errorf("%w: no key %s", errWebhookHostNotAllowed, strings.Join(quoteAll(t.keys()), " or "))
}

// quoteAll quotes each string.
func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = strconv.Quote(s)
	}
	return out
}

// settlementKey returns the key that signs deliveries to webhookURL: the value of
// the keys Secret's data that allows the URL's host and port (allowedKey), read from
// the API server at every call, so a rotated key is used from the next reconcile of
// each activity on. The Secret lives in the operator's namespace, which tenants
// cannot read: the Secret is both the key store and the allowlist of balance
// systems. Its key "<host>_<port>" allows that host on that port; a key "<host>"
// allows it on the scheme's default port only (80 for http, 443 for https). A URL no
// key allows, or with userinfo, wraps errWebhookHostNotAllowed.
func (r *RedPacketActivityReconciler) settlementKey(ctx context.Context, webhookURL string) ([]byte, error) {
	return readSettlementKey(ctx, r.APIReader, r.Options.settlementKeysSecret(), webhookURL)
}

// readSettlementKey is the key that signs deliveries to webhookURL, read through
// reader from the keys Secret ref (see settlementKey): the activities' and the
// budgets' settlement share it.
func readSettlementKey(ctx context.Context, reader client.Reader, ref types.NamespacedName, webhookURL string) ([]byte, error) {
	t, err := parseWebhookTarget(webhookURL)
	if err != nil {
		return nil, err
	}
	secret := &corev1.Secret{}
	if err := reader.Get(ctx, ref, secret); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("%w: %s:%d: the operator's settlement keys Secret %s does not exist", errWebhookHostNotAllowed, t.host, t.port, ref)
		}
		return nil, fmt.Errorf("reading the operator's settlement keys Secret %s: %w", ref, err)
	}
	name, raw, err := allowedKey(secret.Data, t)
	if err != nil {
		return nil, fmt.Errorf("the operator's settlement keys Secret %s does not allow %s:%d: %w", ref, t.host, t.port, err)
	}
	key, err := hmackey.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("the operator's settlement keys Secret %s, key %q: %w", ref, name, err)
	}
	return key, nil
}
