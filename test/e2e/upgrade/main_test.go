// Package upgrade is the upgrade test on a real single-node Kubernetes
// (test/cluster): the previous release (hack/release/previous), its images built from
// its own commit and installed with its own Helm chart, serves a rain; mid-rain the
// release is upgraded to this tree with helm upgrade, the operator rolls out, and the
// new operator rolls every grab Deployment to its own image while the rain goes on.
//
// It needs root on Linux, like test/e2e/node, and takes the same node lock, so the two
// suites run one after the other. Elsewhere the test skips saying why, except in CI
// (CI=true), where nothing may skip and the suite fails instead.
package upgrade

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/redis/go-redis/v9"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/test/cluster"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/e2e/kit"
	"redpacket.io/operator/test/proc"
)

// version is the operator image tag of this tree.
const version = "upgrade-next"

// values are the chart values of the install and of the upgrade, as a user keeps
// them in one file: the operator's Redis user from the Secret the dev Redis reads,
// in the values both releases' charts know.
var values = map[string]any{"redis": map[string]any{
	"username":       cluster.RedisUser,
	"passwordSecret": map[string]any{"name": cluster.RedisSecret, "key": "password"},
}}

// env is what TestMain started.
var env struct {
	skip      string
	root      string
	node      *cluster.Cluster
	kit       kit.Kit
	client    client.Client
	redis     *redis.Client
	installed cluster.Installed
	// previous is the release installed first, and previousChart its chart.
	previous      cluster.Release
	previousChart string
	// images are this tree's images; previousImage is the previous release's operator.
	images        map[string]cluster.Image
	previousImage cluster.Image
	receiver      *rain.Receiver
	receiverURL   string
}

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	ctrllog.SetLogger(logr.Discard())
	if why := cluster.Supported(); why != "" {
		if os.Getenv("CI") == "true" {
			fmt.Fprintln(os.Stderr, "the upgrade test on the real node cannot run in CI:", why)
			return 1
		}
		env.skip = why
		return m.Run()
	}
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "upgrade:", err)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	logf := func(format string, args ...any) { fmt.Printf("upgrade: "+format+"\n", args...) }
	root, err := controlplane.Root()
	if err != nil {
		return fail(err)
	}
	env.root = root
	work, err := os.MkdirTemp("", "redpacket-upgrade-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(work)

	// The previous release, from its own commit: its chart and its operator image.
	start := time.Now()
	env.previous, err = cluster.PreviousRelease(root)
	if err != nil {
		return fail(err)
	}
	src := filepath.Join(work, "previous")
	if err := env.previous.CheckOut(ctx, root, src); err != nil {
		return fail(err)
	}
	env.previousChart = filepath.Join(src, "charts", "redpacket-operator")
	previous, err := cluster.BuildImagesFrom(ctx, src, filepath.Join(work, "images-previous"), env.previous.Version, "operator")
	if err != nil {
		return fail(fmt.Errorf("building release %s: %w", env.previous.Version, err))
	}
	env.previousImage = previous["operator"]
	env.images, err = cluster.BuildImages(ctx, filepath.Join(work, "images"), version, "operator", "pause", "redis")
	if err != nil {
		return fail(err)
	}
	logf("release %s (commit %.12s) and this tree built in %s", env.previous.Version, env.previous.Commit,
		time.Since(start).Round(100*time.Millisecond))

	node, err := cluster.Start(ctx, cluster.Options{
		Images:     []string{env.images["pause"].File, env.images["redis"].File, env.previousImage.File, env.images["operator"].File},
		PauseImage: env.images["pause"].Tag,
		Logf:       logf,
	})
	if err != nil {
		return fail(err)
	}
	env.node = node
	defer func() {
		if err := node.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "upgrade: stopping the node:", err)
		}
	}()
	env.client, err = client.New(node.Config, client.Options{Scheme: controlplane.NewScheme()})
	if err != nil {
		return fail(err)
	}
	env.kit = kit.Kit{Node: node, Client: env.client}

	env.installed, err = node.InstallChartFrom(ctx, env.previousChart, env.previous.Version, values)
	if err != nil {
		return fail(fmt.Errorf("installing release %s: %w", env.previous.Version, err))
	}
	logf("release %s installed: operator Available %s after helm install", env.previous.Version,
		env.installed.OperatorReady.Round(100*time.Millisecond))
	env.redis = redis.NewClient(&redis.Options{Addr: env.installed.RedisAddr,
		Username: env.installed.RedisUsername, Password: env.installed.RedisPassword})
	defer env.redis.Close()

	receiver, url, stopReceiver, err := kit.ServeReceiver(ctx, node, []byte("upgrade-balance-signing-key"))
	if err != nil {
		return fail(err)
	}
	defer stopReceiver()
	// The previous release signs with X-Signature alone; this one adds the Standard
	// Webhooks headers, which the receiver then verifies.
	receiver.SetAcceptXSignature(true)
	env.receiver, env.receiverURL = receiver, url

	code := m.Run()
	if code != 0 {
		out, _ := node.Kubectl(context.Background(), "", "get", "pods", "-A", "-o", "wide")
		fmt.Fprintf(os.Stderr, "--- pods\n%s\n", out)
		for _, ns := range []string{cluster.OperatorNamespace, "e2e-upgrade"} {
			logs, _ := node.Kubectl(context.Background(), "", "-n", ns, "logs", "-l", "app.kubernetes.io/name",
				"--all-containers", "--tail=60", "--prefix", "--max-log-requests=10")
			fmt.Fprintf(os.Stderr, "--- logs in %s\n%s\n", ns, logs)
		}
		fmt.Fprintf(os.Stderr, "--- kube-controller-manager log (tail)\n%s\n", proc.Tail(node.LogPath("kube-controller-manager"), 2000))
	}
	return code
}
