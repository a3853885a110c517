package controllers

import (
	"bytes"
	"context"
	"crypto/ed25519"
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
	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/settlement"
)

// DefaultSettlementKeysSecret is the name of the Secret, in the operator's own
// namespace, that holds the keys signing settlement deliveries.
const DefaultSettlementKeysSecret = "redpacket-settlement-keys"

// DefaultOperatorNamespace is the operator's namespace when POD_NAMESPACE is unset.
const DefaultOperatorNamespace = "redpacket-system"

// PreviousKeySuffix marks, in the keys Secret, a key being rotated out
// ("<host>.previous", "<host>_<port>.previous", "<host>.ed25519.previous"): while it
// is there, every delivery's webhook-signature carries a signature made with it
// besides the current key's, so that the balance system verifies with whichever of
// the two it holds. It never allows a host, and X-Signature is never made with it.
const PreviousKeySuffix = ".previous"

// Ed25519KeySuffix marks, in the keys Secret, the operator's Ed25519 private key for
// a balance system ("<host>.ed25519", "<host>_<port>.ed25519"), spelt "whsk_" and the
// base64 of its 32-byte seed: every delivery to that host carries a v1a signature
// made with it, which the balance system verifies with the public key alone. It
// allows the host as a key "<host>" does, so a balance system may hold no shared key
// at all.
const Ed25519KeySuffix = ".ed25519"

// errWebhookHostNotAllowed is wrapped by signingKeys's error when the keys Secret
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

// entryKind is what an entry of the keys Secret holds for its host.
type entryKind int

const (
	entryHMAC            entryKind = iota // "<host>": the HMAC key
	entryPreviousHMAC                     // "<host>.previous"
	entryEd25519                          // "<host>.ed25519": the Ed25519 private key
	entryPreviousEd25519                  // "<host>.ed25519.previous"
	entryKinds
)

// parseEntry reads a data key of the keys Secret: the allowlist name it is for
// (normalAllowlistKey) and what it holds, by its suffixes (".ed25519", then
// ".previous"), in any case.
func parseEntry(k string) (name string, kind entryKind) {
	k = strings.ToLower(k)
	previous := strings.HasSuffix(k, PreviousKeySuffix)
	k = strings.TrimSuffix(k, PreviousKeySuffix)
	ed := strings.HasSuffix(k, Ed25519KeySuffix)
	k = strings.TrimSuffix(k, Ed25519KeySuffix)
	switch {
	case ed && previous:
		kind = entryPreviousEd25519
	case ed:
		kind = entryEd25519
	case previous:
		kind = entryPreviousHMAC
	}
	return normalAllowlistKey(k), kind
}

// allowedEntries are the entries of the keys Secret that allow a target, by kind:
// the data key and its value, "" where the Secret holds none of that kind.
type allowedEntries struct {
	names  [entryKinds]string
	values [entryKinds][]byte
}

// allowedKeys returns the entries of the keys Secret data that allow t: those of the
// first of t.keys() that a current key names, an HMAC key "<name>" or an Ed25519 key
// "<name>.ed25519" (case and a trailing dot of the host aside), with the rotation's
// previous keys of that same name. Entries of one kind for one name with different
// values are ambiguous and allow nothing; a previous key alone never allows.
func allowedKeys(data map[string][]byte, t webhookTarget) (allowedEntries, error) {
	for _, want := range t.keys() {
		var found [entryKinds][]string
		for k := range data {
			if name, kind := parseEntry(k); name == want {
				found[kind] = append(found[kind], k)
			}
		}
		if len(found[entryHMAC]) == 0 && len(found[entryEd25519]) == 0 {
			continue
		}
		var a allowedEntries
		for kind, names := range found {
			if len(names) == 0 {
				continue
			}
			sort.Strings(names)
			for _, k := range names[1:] {
				if !bytes.Equal(data[k], data[names[0]]) {
					return allowedEntries{}, fmt.Errorf("%w: keys %q and %q name %s and hold different values", errWebhookHostNotAllowed, names[0], k, want)
				}
			}
			a.names[kind], a.values[kind] = names[0], data[names[0]]
		}
		return a, nil
	}
	return allowedEntries{}, fmt.Errorf("%w: no key %s", errWebhookHostNotAllowed, strings.Join(quoteAll(t.keys()), " or "))
}

// quoteAll quotes each string.
func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = strconv.Quote(s)
	}
	return out
}

// settlementKeys are the keys that sign deliveries to one balance system.
type settlementKeys struct {
	// hmac is the current HMAC key: X-Signature and a v1 signature; nil for a
	// balance system that is sent v1a only.
	hmac []byte
	// previousHMAC is the HMAC key being rotated out: a second v1 signature.
	previousHMAC []byte
	// ed25519 is the operator's current Ed25519 key for the host: a v1a signature.
	ed25519 ed25519.PrivateKey
	// previousEd25519 is the Ed25519 key being rotated out: a second v1a signature.
	previousEd25519 ed25519.PrivateKey
}

// apply sets the keys of a settlement worker's configuration.
func (k settlementKeys) apply(cfg *settlement.Config) {
	cfg.SigningKey, cfg.PreviousSigningKey = k.hmac, k.previousHMAC
	cfg.Ed25519Key, cfg.PreviousEd25519Key = k.ed25519, k.previousEd25519
}

// signingKeys returns the keys that sign deliveries to webhookURL: those of the
// keys Secret's data that allow the URL's host and port (allowedKeys), read from
// the API server at every call, so a rotated key is used from the next reconcile of
// each activity on. The Secret lives in the operator's namespace, which tenants
// cannot read: the Secret is both the key store and the allowlist of balance
// systems. Its key "<host>_<port>" (an HMAC key) or "<host>_<port>.ed25519" (an
// Ed25519 key) allows that host on that port; "<host>" or "<host>.ed25519" allows it
// on the scheme's default port only (80 for http, 443 for https). A URL no key
// allows, or with userinfo, wraps errWebhookHostNotAllowed.
func (r *RedPacketActivityReconciler) signingKeys(ctx context.Context, webhookURL string) (settlementKeys, error) {
	return readSettlementKeys(ctx, r.APIReader, r.Options.settlementKeysSecret(), webhookURL)
}

// readSettlementKeys are the keys that sign deliveries to webhookURL, read through
// reader from the keys Secret ref (see signingKeys): the activities' and the
// budgets' settlement share it. A value that is not a key (an empty HMAC key, an
// Ed25519 key not spelt "whsk_" and base64 of 32 or 64 bytes) is an error naming the
// entry, never showing the value.
func readSettlementKeys(ctx context.Context, reader client.Reader, ref types.NamespacedName, webhookURL string) (settlementKeys, error) {
	t, err := parseWebhookTarget(webhookURL)
	if err != nil {
		return settlementKeys{}, err
	}
	secret := &corev1.Secret{}
	if err := reader.Get(ctx, ref, secret); err != nil {
		if apierrors.IsNotFound(err) {
			return settlementKeys{}, fmt.Errorf("%w: %s:%d: the operator's settlement keys Secret %s does not exist", errWebhookHostNotAllowed, t.host, t.port, ref)
		}
		return settlementKeys{}, fmt.Errorf("reading the operator's settlement keys Secret %s: %w", ref, err)
	}
	a, err := allowedKeys(secret.Data, t)
	if err != nil {
		return settlementKeys{}, fmt.Errorf("the operator's settlement keys Secret %s does not allow %s:%d: %w", ref, t.host, t.port, err)
	}
	var k settlementKeys
	for kind, dst := range map[entryKind]*[]byte{entryHMAC: &k.hmac, entryPreviousHMAC: &k.previousHMAC} {
		if a.names[kind] == "" {
			continue
		}
		key, err := hmackey.Parse(a.values[kind])
		if err != nil {
			return settlementKeys{}, fmt.Errorf("the operator's settlement keys Secret %s, key %q: %w", ref, a.names[kind], err)
		}
		*dst = key
	}
	for kind, dst := range map[entryKind]*ed25519.PrivateKey{entryEd25519: &k.ed25519, entryPreviousEd25519: &k.previousEd25519} {
		if a.names[kind] == "" {
			continue
		}
		key, err := webhooksig.ParsePrivateKey(a.values[kind])
		if err != nil {
			return settlementKeys{}, fmt.Errorf("the operator's settlement keys Secret %s, key %q: %w", ref, a.names[kind], err)
		}
		*dst = key
	}
	return k, nil
}
