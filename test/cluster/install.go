package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"redpacket.io/operator/test/controlplane"
)

// The names the install manifests give the operator.
const (
	OperatorNamespace  = "redpacket-system"
	OperatorDeployment = "redpacket-controller-manager"
	// OperatorLease is the Lease the operator's replicas compete for.
	OperatorLease = "redpacket-operator.redpacket.io"
	// defaultRedisAddress is the operator's default Redis in the install manifests:
	// the dev Redis Service, by its cluster DNS name.
	defaultRedisAddress = "redis.redpacket-system.svc:6379"
	// RedisSecret is the Secret in OperatorNamespace with the operator's Redis user
	// (keys username and password): config/dev-redis creates that user from it, with
	// the default user off, and the install manifests and the chart give it to the
	// operator (REDIS_USERNAME, REDIS_PASSWORD).
	RedisSecret = "redpacket-redis"
	// RedisUser is the user name the install puts into RedisSecret, as the docs' line
	// that creates it does.
	RedisUser = "redpacket-operator"
)

// Installed is the project as installed on a node.
type Installed struct {
	// RedisAddr is the dev Redis Service's ClusterIP and port, which the host and the
	// pods reach.
	RedisAddr string
	// RedisUsername and RedisPassword log in to the dev Redis as the operator's user
	// (RedisSecret's): the dev Redis refuses the default user. The password is random,
	// made by this install.
	RedisUsername, RedisPassword string
	// RedisReady and OperatorReady are how long each took to be Available.
	RedisReady, OperatorReady time.Duration
}

// Install installs the project as a user would: the namespace, the Secret
// RedisSecret with a random password and config/dev-redis, then the install
// manifests rendered by hack/render-install.sh for the operator image of version,
// applied with server-side apply, and waits until both are Available. The node has
// no cluster DNS, so the operator's default Redis address is the dev Redis Service's
// ClusterIP rather than its DNS name (docs/operations.md says when to do the same).
func (c *Cluster) Install(ctx context.Context, version string) (Installed, error) {
	var in Installed
	root, err := controlplane.Root()
	if err != nil {
		return in, err
	}
	if err := c.installDevRedis(ctx, root, &in); err != nil {
		return in, err
	}

	rendered := filepath.Join(c.Dir, "install.yaml")
	cmd := exec.CommandContext(ctx, filepath.Join(root, "hack", "render-install.sh"), version, rendered)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.Kubeconfig)
	if out, err := cmd.CombinedOutput(); err != nil {
		return in, fmt.Errorf("hack/render-install.sh: %v\n%s", err, out)
	}
	b, err := os.ReadFile(rendered)
	if err != nil {
		return in, err
	}
	if !strings.Contains(string(b), defaultRedisAddress) {
		return in, fmt.Errorf("the install manifests no longer name %s as the default Redis", defaultRedisAddress)
	}
	manifests := strings.ReplaceAll(string(b), defaultRedisAddress, in.RedisAddr)
	start := time.Now()
	if _, err := c.Kubectl(ctx, manifests, "apply", "--server-side", "-f", "-"); err != nil {
		return in, err
	}
	if err := c.operatorRolledOut(ctx); err != nil {
		return in, err
	}
	in.OperatorReady = time.Since(start)
	return in, nil
}

// installDevRedis creates the operator's namespace (as kubectl create namespace, the
// way a user who runs the Redis before the operator does; config/dev-redis does not
// declare it) and the Secret RedisSecret with the user RedisUser and a random
// password, as the docs' kubectl create secret line does, applies config/dev-redis,
// waits until the Redis is Available, and records its Service's ClusterIP address
// (the node has no cluster DNS), the credentials and how long it took in in.
func (c *Cluster) installDevRedis(ctx context.Context, root string, in *Installed) error {
	start := time.Now()
	if _, err := c.Kubectl(ctx, "", "get", "namespace", OperatorNamespace); err != nil {
		if _, err := c.Kubectl(ctx, "", "create", "namespace", OperatorNamespace); err != nil {
			return err
		}
	}
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return fmt.Errorf("making the dev Redis password: %w", err)
	}
	in.RedisUsername, in.RedisPassword = RedisUser, hex.EncodeToString(b)
	// Through the API rather than kubectl, so that the password is in no process's
	// arguments.
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: RedisSecret, Namespace: OperatorNamespace},
		StringData: map[string]string{"username": in.RedisUsername, "password": in.RedisPassword},
	}
	if _, err := c.Client.CoreV1().Secrets(OperatorNamespace).Create(ctx, secret, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("creating the Secret %s/%s: %w", OperatorNamespace, RedisSecret, err)
	}
	if _, err := c.Kubectl(ctx, "", "apply", "-k", filepath.Join(root, "config", "dev-redis")); err != nil {
		return err
	}
	if _, err := c.Kubectl(ctx, "", "-n", OperatorNamespace, "rollout", "status", "deployment/redis", "--timeout=180s"); err != nil {
		return err
	}
	ip, err := c.Kubectl(ctx, "", "-n", OperatorNamespace, "get", "service", "redis", "-o", "jsonpath={.spec.clusterIP}")
	if err != nil {
		return err
	}
	in.RedisAddr = ip + ":6379"
	in.RedisReady = time.Since(start)
	return nil
}
