// Package node is the end-to-end suite on a real single-node Kubernetes
// (test/cluster): the operator installed with its Helm chart (through the Helm
// library) and its own image as a 2-replica Deployment with leader election, the dev Redis as a pod, and
// every activity's grab Deployment as pods, all driven through the real kubectl. The
// host reaches the grab service and Redis through their Services' ClusterIPs; the
// pods reach this test's balance system at the node's address: cmd/balance, built
// from this tree, booking into a real PostgreSQL the suite starts (test/balancetest)
// and removes at the end.
//
// It needs root on Linux and PostgreSQL (hack/ensure-postgres.sh). Elsewhere each
// test skips saying why, except in CI (CI=true), where nothing may skip and the
// suite fails instead.
package node

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

	"redpacket.io/operator/test/balancetest"
	"redpacket.io/operator/test/cluster"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/e2e/kit"
	"redpacket.io/operator/test/pgtest"
	"redpacket.io/operator/test/proc"
)

// Versions of the operator image: the installed one, and a rebuilt tag that an
// activity's grab Deployment is rolled to mid-rain.
const (
	version        = "e2e-1"
	rebuiltVersion = "e2e-2"
)

// env is what TestMain started for every test.
var env struct {
	skip   string
	root   string
	node   *cluster.Cluster
	kit    kit.Kit
	client client.Client
	redis  *redis.Client
	// balance is cmd/balance on its own PostgreSQL, at the node's address; the
	// operator signs its deliveries v1 with webhookKey.
	balance    *balancetest.System
	webhookKey []byte
	images     map[string]cluster.Image
	rebuilt    cluster.Image
}

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	ctrllog.SetLogger(logr.Discard())
	if why := cluster.Supported(); why != "" {
		if os.Getenv("CI") == "true" {
			fmt.Fprintln(os.Stderr, "e2e on the real node cannot run in CI:", why)
			return 1
		}
		env.skip = why
		return m.Run()
	}
	if _, err := pgtest.Bin(); err != nil {
		why := "e2e on the real node needs PostgreSQL for its balance system: " + err.Error()
		if os.Getenv("CI") == "true" {
			fmt.Fprintln(os.Stderr, why)
			return 1
		}
		env.skip = why
		return m.Run()
	}
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	logf := func(format string, args ...any) { fmt.Printf("e2e: "+format+"\n", args...) }
	root, err := controlplane.Root()
	if err != nil {
		return fail(err)
	}
	env.root = root
	work, err := os.MkdirTemp("", "redpacket-node-e2e-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(work)

	start := time.Now()
	env.images, err = cluster.BuildImages(ctx, filepath.Join(work, "images"), version, "operator", "pause", "redis", "traefik")
	if err != nil {
		return fail(err)
	}
	rebuilt, err := cluster.BuildImages(ctx, filepath.Join(work, "images-rebuilt"), rebuiltVersion, "operator")
	if err != nil {
		return fail(err)
	}
	env.rebuilt = rebuilt["operator"]
	logf("images built in %s", time.Since(start).Round(100*time.Millisecond))

	node, err := cluster.Start(ctx, cluster.Options{
		Images: []string{env.images["pause"].File, env.images["redis"].File, env.images["operator"].File, env.rebuilt.File,
			env.images["traefik"].File},
		PauseImage: env.images["pause"].Tag,
		Logf:       logf,
	})
	if err != nil {
		return fail(err)
	}
	env.node = node
	defer func() {
		if err := node.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: stopping the node:", err)
		}
	}()
	env.client, err = client.New(node.Config, client.Options{Scheme: controlplane.NewScheme()})
	if err != nil {
		return fail(err)
	}
	env.kit = kit.Kit{Node: node, Client: env.client}

	// The rain test rolls an activity's grab Deployment to a rebuilt image through
	// spec.grabService.image, which the operator refuses unless allowed.
	// Reconciliation with the balance system every 2 s, so the budget test sees a
	// row deleted or inserted by hand in PostgreSQL found within seconds.
	installed, err := node.InstallChart(ctx, version, map[string]any{"grab": map[string]any{"allowImageOverride": true},
		"extraArgs": []any{"--reconcile-interval=2s"}})
	if err != nil {
		return fail(err)
	}
	logf("dev Redis Available at %s in %s; operator Available (2 replicas) %s after helm install",
		installed.RedisAddr, installed.RedisReady.Round(100*time.Millisecond), installed.OperatorReady.Round(100*time.Millisecond))
	env.redis = redis.NewClient(&redis.Options{Addr: installed.RedisAddr, Username: installed.RedisUsername, Password: installed.RedisPassword})
	defer env.redis.Close()

	// The operator signs deliveries with the key its own namespace holds for the
	// balance system's host and port; the tenants' namespaces hold none that signs.
	balanceBin := filepath.Join(work, "balance")
	if err := balancetest.Build(ctx, root, balanceBin); err != nil {
		return fail(err)
	}
	env.webhookKey = []byte("e2e-balance-signing-key")
	env.balance, err = kit.StartBalanceSystem(ctx, node, balanceBin, work, env.webhookKey)
	if err != nil {
		return fail(err)
	}
	defer func() {
		if err := env.balance.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: stopping the balance system:", err)
		}
	}()
	logf("balance system %s (cmd/balance) on PostgreSQL at 127.0.0.1:%d, a throwaway cluster in %s", env.balance.URL, env.balance.DB.Port, env.balance.DB.Dir)

	peak := watchMemory(node)
	code := m.Run()
	logf("peak resident memory of the node and its pods: %d MiB", peak()>>20)
	if code != 0 {
		for _, c := range []string{"kubelet", "kube-controller-manager"} {
			fmt.Fprintf(os.Stderr, "--- %s log (tail)\n%s\n", c, proc.Tail(node.LogPath(c), 3000))
		}
		fmt.Fprintf(os.Stderr, "--- balance system log (tail)\n%s\n", proc.Tail(env.balance.LogPath, 3000))
		out, _ := node.Kubectl(context.Background(), "", "get", "pods", "-A", "-o", "wide")
		fmt.Fprintf(os.Stderr, "--- pods\n%s\n", out)
		for _, ns := range []string{cluster.OperatorNamespace, "e2e-rain", "e2e-delete", "e2e-plugin", "e2e-budget", gatewayNS, "e2e-gated", "e2e-ingress"} {
			logs, _ := node.Kubectl(context.Background(), "", "-n", ns, "logs", "-l", "app.kubernetes.io/name",
				"--all-containers", "--tail=40", "--prefix", "--max-log-requests=10")
			fmt.Fprintf(os.Stderr, "--- logs in %s\n%s\n", ns, logs)
		}
	}
	return code
}
