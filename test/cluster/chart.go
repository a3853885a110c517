package cluster

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
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
	root, err := controlplane.Root()
	if err != nil {
		return Installed{}, err
	}
	return c.InstallChartFrom(ctx, filepath.Join(root, "charts", "redpacket-operator"), version, values)
}

// InstallChartFrom is InstallChart with the chart in chartDir: another version's
// chart, such as the previous release's. The dev Redis is this tree's.
func (c *Cluster) InstallChartFrom(ctx context.Context, chartDir, version string, values map[string]any) (Installed, error) {
	var in Installed
	root, err := controlplane.Root()
	if err != nil {
		return in, err
	}
	if err := c.installDevRedis(ctx, root, &in); err != nil {
		return in, err
	}
	ch, vals, err := loadChart(chartDir, version, in.RedisAddr, values)
	if err != nil {
		return in, err
	}
	cfg, err := c.helm()
	if err != nil {
		return in, err
	}
	install := action.NewInstall(cfg)
	install.ReleaseName = ReleaseName
	install.Namespace = OperatorNamespace
	install.Timeout = 3 * time.Minute
	start := time.Now()
	rel, err := install.RunWithContext(ctx, ch, vals)
	if err != nil {
		return in, fmt.Errorf("helm install %s: %w", ReleaseName, err)
	}
	if rel.Info == nil || rel.Info.Status != release.StatusDeployed {
		return in, fmt.Errorf("helm install %s: release is %v", ReleaseName, rel.Info)
	}
	if err := c.operatorRolledOut(ctx); err != nil {
		return in, err
	}
	in.OperatorReady = time.Since(start)
	return in, nil
}

// UpgradeChart upgrades release ReleaseName to the chart in chartDir with the
// operator image of version, as helm upgrade does (the chart's CRDs are templates,
// so they are upgraded with it), with the same default Redis as the install (in)
// and values merged over it, and waits until the operator's Deployment has rolled
// out. It returns how long that took.
func (c *Cluster) UpgradeChart(ctx context.Context, chartDir, version string, in Installed, values map[string]any) (time.Duration, error) {
	ch, vals, err := loadChart(chartDir, version, in.RedisAddr, values)
	if err != nil {
		return 0, err
	}
	cfg, err := c.helm()
	if err != nil {
		return 0, err
	}
	upgrade := action.NewUpgrade(cfg)
	upgrade.Namespace = OperatorNamespace
	upgrade.Timeout = 3 * time.Minute
	start := time.Now()
	rel, err := upgrade.RunWithContext(ctx, ReleaseName, ch, vals)
	if err != nil {
		return 0, fmt.Errorf("helm upgrade %s: %w", ReleaseName, err)
	}
	if rel.Info == nil || rel.Info.Status != release.StatusDeployed {
		return 0, fmt.Errorf("helm upgrade %s: release is %v", ReleaseName, rel.Info)
	}
	if err := c.operatorRolledOut(ctx); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

// loadChart loads the chart in chartDir with values merged over the operator image
// of version and the default Redis at redisAddr.
func loadChart(chartDir, version, redisAddr string, values map[string]any) (*chart.Chart, map[string]any, error) {
	ch, err := loader.Load(chartDir)
	if err != nil {
		return nil, nil, fmt.Errorf("loading the chart in %s: %w", chartDir, err)
	}
	vals := chartutil.CoalesceTables(map[string]any{}, values)
	vals = chartutil.CoalesceTables(vals, map[string]any{
		"image": map[string]any{"tag": version},
		"redis": map[string]any{"addresses": redisAddr},
	})
	return ch, vals, nil
}

// helm is a Helm action configuration for the operator's namespace through the
// node's kubeconfig, keeping releases in Secrets as helm does.
func (c *Cluster) helm() (*action.Configuration, error) {
	kubeconfig, namespace := c.Kubeconfig, OperatorNamespace
	getter := genericclioptions.NewConfigFlags(false)
	getter.KubeConfig = &kubeconfig
	getter.Namespace = &namespace
	cfg := new(action.Configuration)
	if err := cfg.Init(getter, namespace, "secret", func(string, ...any) {}); err != nil {
		return nil, fmt.Errorf("helm: %w", err)
	}
	return cfg, nil
}

// operatorRolledOut waits until the operator's Deployment has rolled out.
func (c *Cluster) operatorRolledOut(ctx context.Context) error {
	_, err := c.Kubectl(ctx, "", "-n", OperatorNamespace, "rollout", "status", "deployment/"+OperatorDeployment, "--timeout=180s")
	return err
}
