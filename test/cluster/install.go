package cluster

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

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
)

// Installed is the project as installed on a node.
type Installed struct {
	// RedisAddr is the dev Redis Service's ClusterIP and port, which the host and the
	// pods reach.
	RedisAddr string
	// RedisReady and OperatorReady are how long each took to be Available.
	RedisReady, OperatorReady time.Duration
}

// Install installs the project as a user would: the namespace and config/dev-redis,
// then the install manifests rendered by hack/render-install.sh for the operator
// image of version, applied with server-side apply, and waits until both are
// Available. The node has no cluster DNS, so the operator's default Redis address is
// the dev Redis Service's ClusterIP rather than its DNS name (docs/operations.md says
// when to do the same).
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
// declare it), applies config/dev-redis, waits until the Redis is Available, and
// records its Service's ClusterIP address (the node has no cluster DNS) and how long
// it took in in.
func (c *Cluster) installDevRedis(ctx context.Context, root string, in *Installed) error {
	start := time.Now()
	if _, err := c.Kubectl(ctx, "", "get", "namespace", OperatorNamespace); err != nil {
		if _, err := c.Kubectl(ctx, "", "create", "namespace", OperatorNamespace); err != nil {
			return err
		}
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
