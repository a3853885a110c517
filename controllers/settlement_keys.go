package controllers

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"redpacket.io/operator/internal/hmackey"
)

// DefaultSettlementKeysSecret is the name of the Secret, in the operator's own
// namespace, that holds the keys signing settlement deliveries.
const DefaultSettlementKeysSecret = "redpacket-settlement-keys"

// DefaultOperatorNamespace is the operator's namespace when POD_NAMESPACE is unset.
const DefaultOperatorNamespace = "redpacket-system"

// PreviousKeySuffix marks, in the keys Secret, a balance system's previous key during
// a rotation ("<host>.previous"): kept for the balance system's side of the rotation
// and never used to sign.
const PreviousKeySuffix = ".previous"

// errWebhookHostNotAllowed is wrapped by settlementKey's error when the keys Secret
// holds no key for the webhook's host: the platform team has not allowed that
// balance system, and nothing is delivered to it.
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

// settlementKey returns the key that signs deliveries to webhookURL: the value of
// the keys Secret's data under the URL's host name (without port), read from the
// API server at every call, so a rotated key is used from the next reconcile of
// each activity on. The Secret lives in the operator's namespace, which tenants
// cannot read: the Secret is both the key store and the allowlist of balance
// systems. A host with no key wraps errWebhookHostNotAllowed.
func (r *RedPacketActivityReconciler) settlementKey(ctx context.Context, webhookURL string) ([]byte, error) {
	return readSettlementKey(ctx, r.APIReader, r.Options.settlementKeysSecret(), webhookURL)
}

// readSettlementKey is the key that signs deliveries to webhookURL, read through
// reader from the keys Secret ref (see settlementKey): the activities' and the
// budgets' settlement share it.
func readSettlementKey(ctx context.Context, reader client.Reader, ref types.NamespacedName, webhookURL string) ([]byte, error) {
	u, err := url.Parse(webhookURL)
	if err != nil || u.Hostname() == "" {
		return nil, fmt.Errorf("spec.settlement.webhook.url %q has no host", webhookURL)
	}
	host := u.Hostname()
	secret := &corev1.Secret{}
	if err := reader.Get(ctx, ref, secret); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("%w: host %q: the operator's settlement keys Secret %s does not exist", errWebhookHostNotAllowed, host, ref)
		}
		return nil, fmt.Errorf("reading the operator's settlement keys Secret %s: %w", ref, err)
	}
	raw, ok := secret.Data[host]
	if !ok {
		return nil, fmt.Errorf("%w: the operator's settlement keys Secret %s holds no key for host %q", errWebhookHostNotAllowed, ref, host)
	}
	key, err := hmackey.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("the operator's settlement keys Secret %s, key %q: %w", ref, host, err)
	}
	return key, nil
}
