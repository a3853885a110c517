package node

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/test/cluster"
	"redpacket.io/operator/test/e2e/kit"
	"redpacket.io/operator/test/printed"
)

// requireNode skips a test where no node could run, saying why.
func requireNode(t *testing.T) {
	t.Helper()
	if env.skip != "" {
		t.Skip(env.skip)
	}
}

// watchMemory samples the node's resident memory every second and returns a
// function that reports the peak.
func watchMemory(c *cluster.Cluster) func() int64 {
	var mu sync.Mutex
	var peak int64
	stop := make(chan struct{})
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			var sum int64
			for _, v := range c.ResidentMemory() {
				sum += v
			}
			mu.Lock()
			peak = max(peak, sum)
			mu.Unlock()
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	return func() int64 {
		close(stop)
		mu.Lock()
		defer mu.Unlock()
		return peak
	}
}

// kubectl runs the real kubectl against the node and fails the test when it fails.
func kubectl(t *testing.T, stdin string, args ...string) string {
	t.Helper()
	return env.kit.Kubectl(t, stdin, args...)
}

// eventually polls f every 250ms until it returns nil, failing the test after within.
func eventually(t *testing.T, within time.Duration, what string, f func() error) time.Duration {
	t.Helper()
	return kit.Eventually(t, within, what, f)
}

// activityManifest is a RedPacketActivity with auth and a webhook to the suite's
// balance system (the operator signs; the secretRef is deprecated and ignored, kept
// here to show that a tenant's key signs nothing).
func activityManifest(ns, name string, total, count int64, replicas int) string {
	return fmt.Sprintf(`apiVersion: redpacket.io/v1alpha1
kind: RedPacketActivity
metadata:
  name: %s
  namespace: %s
spec:
  totalAmount: %d
  count: %d
  currency: CNY
  distribution: {type: Random, minAmount: 1}
  sponsor: merchant-e2e
  grabService:
    replicas: %d
    auth:
      tokenSecretRef: {name: grab-hmac}
  settlement:
    webhook:
      url: %s
      secretRef: {name: balance-hmac}
    maxAttempts: 20
`, name, ns, total, count, replicas, env.balance.WebhookURL())
}

// tokenKey is the HMAC key of user tokens in every test namespace.
var tokenKey = []byte("e2e-user-token-key")

// namespace creates a namespace with the token Secret and a (deprecated, ignored)
// webhook key Secret.
func namespace(t *testing.T, name string) string {
	t.Helper()
	kubectl(t, "", "create", "namespace", name)
	kubectl(t, "", "-n", name, "create", "secret", "generic", "grab-hmac", "--from-literal=key="+string(tokenKey))
	// A tenant's own key, which the balance system does not accept: a delivery signed
	// with it would be refused.
	kubectl(t, "", "-n", name, "create", "secret", "generic", "balance-hmac", "--from-literal=key=tenant-key-signs-nothing")
	return name
}

// tokens signs user tokens for one activity, bound to its UID, which is read once,
// on the first token (the activity exists by then). Safe for concurrent use.
func tokens(t *testing.T, ns, name string) func(string) string {
	uid := sync.OnceValues(func() (types.UID, error) {
		a := &redpacketv1alpha1.RedPacketActivity{}
		if err := env.client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, a); err != nil {
			return "", fmt.Errorf("reading activity %s/%s for its UID: %w", ns, name, err)
		}
		return a.UID, nil
	})
	return func(user string) string {
		id, err := uid()
		if err != nil {
			t.Error(err)
		}
		tok, err := grabsvc.SignToken(tokenKey, grabsvc.TokenClaims{UserID: user, Activity: ns + "/" + name,
			ActivityUID: id, Exp: time.Now().Add(time.Hour).Unix()})
		if err != nil {
			t.Error(err)
		}
		return tok
	}
}

// activity reads an activity.
func activity(t *testing.T, ns, name string) *redpacketv1alpha1.RedPacketActivity {
	t.Helper()
	return env.kit.Activity(t, ns, name)
}

// deployment reads a Deployment.
func deployment(t *testing.T, ns, name string) *appsv1.Deployment {
	t.Helper()
	return env.kit.Deployment(t, ns, name)
}

// available waits until a Deployment has replicas available and up to date.
func available(t *testing.T, ns, name string, replicas int32, within time.Duration) time.Duration {
	t.Helper()
	return eventually(t, within, fmt.Sprintf("deployment %s/%s to have %d available replicas", ns, name, replicas), func() error {
		d := deployment(t, ns, name)
		st := d.Status
		if d.Spec.Replicas == nil || *d.Spec.Replicas != replicas || st.ObservedGeneration < d.Generation ||
			st.AvailableReplicas != replicas || st.UpdatedReplicas != replicas || st.Replicas != replicas {
			return fmt.Errorf("spec %v, status %+v", d.Spec.Replicas, st)
		}
		return nil
	})
}

// grabURL is the grab Service's ClusterIP URL of an activity, once the Service
// answers there.
func grabURL(t *testing.T, ns, name string) string {
	t.Helper()
	return env.kit.GrabURL(t, ns, name)
}

// keysOf lists the Redis keys of an activity UID.
func keysOf(t *testing.T, uid string) []string {
	t.Helper()
	keys, err := env.redis.Keys(t.Context(), "rpa:{"+uid+"}*").Result()
	if err != nil {
		t.Fatalf("listing keys: %v", err)
	}
	return keys
}

func val(p *int64) int64 { return kit.Val(p) }

// columns runs kubectl get with args and returns the first row as a map from the
// printed column headers to the cells.
func columns(t *testing.T, args ...string) map[string]string {
	t.Helper()
	out := kubectl(t, "", append([]string{"get"}, args...)...)
	cells, err := printed.FirstRow(out)
	if err != nil {
		t.Fatalf("kubectl get %s: %v", strings.Join(args, " "), err)
	}
	return cells
}

// buildPlugin builds kubectl-rpa from this tree, stamped with pluginVersion, into a
// directory of its own and returns the directory, to put first on the PATH.
func buildPlugin(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	build := exec.CommandContext(t.Context(), "go", "build",
		"-ldflags", "-X redpacket.io/operator/internal/version.version="+pluginVersion,
		"-o", filepath.Join(dir, "kubectl-rpa"), "./cmd/kubectl-rpa")
	build.Dir = env.root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building kubectl-rpa: %v\n%s", err, out)
	}
	return dir
}

// booked reads what the balance system booked in PostgreSQL for the activity or
// budget of uid: its grants by idempotency key, and the sum of its refunds.
func booked(t *testing.T, uid string) (map[string]balance.Credit, int64) {
	t.Helper()
	credits, err := env.balance.Credits(t.Context(), uid)
	if err != nil {
		t.Fatal(err)
	}
	grants := map[string]balance.Credit{}
	var refund int64
	for _, c := range credits {
		if c.Kind == "refund" {
			refund += c.Amount
			continue
		}
		grants[c.Key] = c
	}
	return grants, refund
}

// book reads the balance system's totals of the activity or budget of uid (GET
// /v1/sources/{uid}); a source not yet announced is the zero Source.
func book(t *testing.T, uid string) balance.Source {
	t.Helper()
	src, _, err := env.balance.Source(t.Context(), uid)
	if err != nil {
		t.Fatal(err)
	}
	return src
}
