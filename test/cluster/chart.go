package cluster

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/release"
	"k8s.io/cli-runtime/pkg/genericclioptions"

	"redpacket.io/operator/test/controlplane"
)

// ReleaseName is the Helm release InstallChart installs.
const ReleaseName = "redpacket"

// InstallChart installs the project with its Helm chart, as a user would with helm
// install: the namespace and kubectl apply -k config/dev-redis (a Redis), then the
// chart in charts/redpacket-operator as release ReleaseName in OperatorNamespace,
// through the Helm library with the node's kubeconfig, and waits until the dev
// Redis and the operator are Available. The chart gets the operator image of
// version and, as the default Redis, the dev Redis Service's ClusterIP (the node has
// no cluster DNS); values are merged over those.
func (c *Cluster) InstallChart(ctx context.Context, version string, values map[string]any) (Installed, error) {
	var in Installed
	root, err := controlplane.Root()
	if err != nil {
		return in, err
	}
	if err := c.installDevRedis(ctx, root, &in); err != nil {
		return in, err
	}

	ch, err := loader.Load(filepath.Join(root, "charts", "redpacket-operator"))
	if err != nil {
		return in, fmt.Errorf("loading the chart: %w", err)
	}
	vals := chartutil.CoalesceTables(map[string]any{}, values)
	vals = chartutil.CoalesceTables(vals, map[string]any{
		"image": map[string]any{"tag": version},
		"redis": map[string]any{"addresses": in.RedisAddr},
	})

	kubeconfig, namespace := c.Kubeconfig, OperatorNamespace
	getter := genericclioptions.NewConfigFlags(false)
	getter.KubeConfig = &kubeconfig
	getter.Namespace = &namespace
	cfg := new(action.Configuration)
	if err := cfg.Init(getter, namespace, "secret", func(string, ...any) {}); err != nil {
		return in, fmt.Errorf("helm: %w", err)
	}
	install := action.NewInstall(cfg)
	install.ReleaseName = ReleaseName
	install.Namespace = namespace
	install.Timeout = 3 * time.Minute
	start := time.Now()
	rel, err := install.RunWithContext(ctx, ch, vals)
	if err != nil {
		return in, fmt.Errorf("helm install %s: %w", ReleaseName, err)
	}
	if rel.Info == nil || rel.Info.Status != release.StatusDeployed {
		return in, fmt.Errorf("helm install %s: release is %v", ReleaseName, rel.Info)
	}
	if _, err := c.Kubectl(ctx, "", "-n", OperatorNamespace, "rollout", "status", "deployment/"+OperatorDeployment, "--timeout=180s"); err != nil {
		return in, err
	}
	in.OperatorReady = time.Since(start)
	return in, nil
}
