package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"

	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/cluster"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/proc"
)

// nodeVersion tags the operator and pause images the node runs.
const nodeVersion = "demo"

// nodeDemo is the demo on a real single-node Kubernetes (test/cluster).
type nodeDemo struct {
	opts   options
	root   string
	dir    string
	kc     kubectl
	node   *cluster.Cluster
	stops  []func()
	mem    *memWatch
	passed bool
}

// runNode runs the demo on a real node and tears the node down on every path. It
// returns the exit code.
func runNode(ctx context.Context, o options) int {
	nd := &nodeDemo{opts: o}
	begin := time.Now()
	err := nd.run(ctx)
	interrupted := err != nil && ctx.Err() != nil
	if err != nil && !interrupted {
		fmt.Fprintln(os.Stderr, "\ndemo:", err)
		nd.diagnose()
	}
	clean := nd.teardown()
	fmt.Printf("    the demo took %s\n", time.Since(begin).Round(time.Second))
	switch {
	case interrupted:
		fmt.Println("\ninterrupted; everything the demo started is stopped")
		if !clean {
			return 1
		}
		return 130
	case err != nil:
		fmt.Fprintln(os.Stderr, "\ndemo:", err)
		return 1
	case !clean:
		fmt.Fprintln(os.Stderr, "\ndemo: the host is not as the demo found it")
		return 1
	case !nd.passed:
		return 1
	}
	return 0
}

// onStop registers a function that the teardown runs before it stops the node, last
// registered first.
func (nd *nodeDemo) onStop(f func()) { nd.stops = append(nd.stops, f) }

func (nd *nodeDemo) run(ctx context.Context) error {
	o := nd.opts
	root, err := controlplane.Root()
	if err != nil {
		return fmt.Errorf("finding the repository: %w", err)
	}
	nd.root = root
	if err := os.Chdir(root); err != nil {
		return fmt.Errorf("entering %s: %w", root, err)
	}
	nd.dir = filepath.Join(root, ".demo")
	if err := os.RemoveAll(nd.dir); err != nil {
		return fmt.Errorf("clearing %s: %w", nd.dir, err)
	}
	if err := os.MkdirAll(nd.dir, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", nd.dir, err)
	}
	var timings []string
	took := func(what string, d time.Duration) {
		timings = append(timings, fmt.Sprintf("%s %s", what, d.Round(100*time.Millisecond)))
	}

	if !o.skipBuild {
		step("checking the Kubernetes binaries in bin/")
		cmd := exec.CommandContext(ctx, filepath.Join(root, "hack", "build-controlplane.sh"))
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("hack/build-controlplane.sh: %w", err)
		}
	}

	step("building the images: the operator, the pod sandbox and Redis (go run ./hack/image --version %s)", nodeVersion)
	start := time.Now()
	images, err := cluster.BuildImages(ctx, filepath.Join(nd.dir, "images"), nodeVersion, "operator", "pause", "redis")
	if err != nil {
		return err
	}
	for _, name := range []string{"operator", "pause", "redis"} {
		img, ok := images[name]
		if !ok {
			return fmt.Errorf("go run ./hack/image built no %s image", name)
		}
		size := int64(0)
		if fi, err := os.Stat(img.File); err == nil {
			size = fi.Size()
		}
		fmt.Printf("    %-26s %s (%.1f MiB)\n", img.Tag, rel(root, img.File), float64(size)/(1<<20))
	}
	took("images", time.Since(start))

	step("starting a single-node Kubernetes on this machine")
	fmt.Printf("    containerd, etcd, kube-apiserver, kube-controller-manager, kube-scheduler, a kubelet and kube-proxy,\n")
	fmt.Printf("    as child processes; the node is %s, pods get %s, Services %s\n", cluster.NodeIP, cluster.PodCIDR, cluster.ServiceCIDR)
	node, err := cluster.Start(ctx, cluster.Options{
		Images:     []string{images["pause"].File, images["redis"].File, images["operator"].File},
		PauseImage: images["pause"].Tag,
		Logf:       func(format string, args ...any) { fmt.Printf("    "+format+"\n", args...) },
	})
	if err != nil {
		return fmt.Errorf("starting the node: %w", err)
	}
	nd.node = node
	nd.mem = watchMemory(node)
	took("node Ready", node.Started)
	nd.kc = kubectl{bin: filepath.Join(node.BinDir, "kubectl"), kubeconfig: node.Kubeconfig}
	fmt.Printf("    kubeconfig %s\n", node.Kubeconfig)
	if err := nd.kc.show(ctx, "get", "nodes", "-o", "wide"); err != nil {
		return err
	}

	step("installing the project as a user would: the dev Redis, then the operator (2 replicas) from its image")
	fmt.Printf("    kubectl create namespace redpacket-system; kubectl create secret generic %s -n redpacket-system --from-literal=username=%s --from-literal=password=<random>;\n", cluster.RedisSecret, cluster.RedisUser)
	fmt.Printf("    kubectl apply -k config/dev-redis; hack/render-install.sh %s; kubectl apply --server-side -f install.yaml\n", nodeVersion)
	start = time.Now()
	installed, err := node.Install(ctx, nodeVersion)
	if err != nil {
		return fmt.Errorf("installing the project: %w", err)
	}
	took("install", time.Since(start))
	fmt.Printf("    dev Redis Available at %s in %s; operator Available %s after its manifests were applied\n",
		installed.RedisAddr, installed.RedisReady.Round(100*time.Millisecond), installed.OperatorReady.Round(100*time.Millisecond))
	c, err := client.New(node.Config, client.Options{Scheme: controlplane.NewScheme()})
	if err != nil {
		return fmt.Errorf("a client for the node: %w", err)
	}

	step("starting the balance system: bin/balance (cmd/balance) on a PostgreSQL of its own, at the node's address")
	bs, err := startBalanceSystem(ctx, root, nd.dir, cluster.NodeIP)
	if err != nil {
		return err
	}
	nd.onStop(bs.stop)
	fmt.Printf("    on the host, where the operator's pods reach it at %s\n", bs.URL)

	step("applying the sample activity with kubectl")
	sample, from, err := sampleActivity(root)
	if err != nil {
		return err
	}
	const grabReplicas = 2
	manifest, total, err := demoManifest(sample, o.name, o.packets, bs.WebhookURL(), "", grabReplicas)
	if err != nil {
		return err
	}
	manifestPath := filepath.Join(nd.dir, o.name+".yaml")
	if err := os.WriteFile(manifestPath, manifest, 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", manifestPath, err)
	}
	if from != "" {
		fmt.Printf("    a demo-sized copy of %s: %d packets, open at once, %d grab pods, settlement to the balance system\n",
			from, o.packets, grabReplicas)
	}
	// The operator signs every delivery with the Ed25519 key its own namespace holds
	// for the balance system's host and port (here the node's address and the
	// balance system's port, "<ip>_<port>.ed25519"); the tenant's namespace holds none.
	if err := nd.kc.show(ctx, "create", "secret", "generic", "redpacket-settlement-keys", "--namespace", cluster.OperatorNamespace,
		"--from-file="+bs.settlementKeyName()+"="+rel(root, bs.privateKeyFile)); err != nil {
		return err
	}
	applied := time.Now()
	if err := nd.kc.show(ctx, "apply", "-f", rel(root, manifestPath)); err != nil {
		return err
	}
	if err := nd.kc.show(ctx, "wait", "--for=condition=Ready", "rpa/"+o.name, "--timeout=180s"); err != nil {
		return err
	}
	took("activity Ready", time.Since(applied))
	fmt.Printf("    Ready %s after the apply\n", time.Since(applied).Round(100*time.Millisecond))
	if err := nd.kc.show(ctx, "rollout", "status", "deployment/"+o.name+"-grab", "--timeout=120s"); err != nil {
		return err
	}
	took("both grab pods Available", time.Since(applied))

	step("the pods: the operator, the dev Redis and the activity's grab service")
	if err := nd.kc.show(ctx, "get", "pods", "-A", "-o", "wide"); err != nil {
		return err
	}

	step("before the rain")
	if err := nd.kc.show(ctx, "get", "rpa"); err != nil {
		return err
	}
	if err := nd.kc.show(ctx, "get", "rpa", "-o", "wide"); err != nil {
		return err
	}

	ip, err := nd.kc.output(ctx, "get", "service", o.name+"-grab", "-o", "jsonpath={.spec.clusterIP}")
	if err != nil {
		return err
	}
	grabURL := "http://" + strings.TrimSpace(ip) + ":8080"
	fmt.Printf("    the red-packet rain page, to play in a browser on this machine: %s/\n", grabURL)
	step("red-packet rain: %d concurrent users for %d packets, through the grab Service at %s", o.users, o.packets, grabURL)
	rr := rain.Run(ctx, rain.Spec{URL: grabURL + "/v1/grab", Users: o.users, Connections: o.connections,
		RetryEvery: o.retryEvery, Timeout: 30 * time.Second, RetryUnavailable: true, Progress: os.Stdout})
	if err := ctx.Err(); err != nil {
		return err
	}
	took("rain", rr.Elapsed)
	if rr.Unavailable+rr.TransportErrors > 0 {
		fmt.Printf("    asked again: %d answers 503, %d requests without an answer\n", rr.Unavailable, rr.TransportErrors)
	}

	step("waiting for the status reporter and settlement to catch up")
	redisConn := redisconn.Conn{Addresses: []string{installed.RedisAddr}, Mode: redisconn.ModeStandalone,
		Username: installed.RedisUsername, Password: installed.RedisPassword}
	obs, err := waitSettled(ctx, c, redisConn, o.packets, o.settleWait, o.name, rr, bs)
	if err != nil {
		return err
	}
	took("caught up after the rain", obs.waited)

	step("after the rain")
	if err := nd.kc.show(ctx, "get", "rpa"); err != nil {
		return err
	}
	if err := nd.kc.show(ctx, "get", "rpa", "-o", "wide"); err != nil {
		return err
	}
	if err := nd.kc.show(ctx, "get", "pods", "-A", "-o", "wide"); err != nil {
		return err
	}

	groupsOK, budgetRow, err := nd.groupPackets(ctx, bs, took)
	if err != nil {
		return err
	}

	step("the books: kubectl get rpa and rpb beside the ledger in PostgreSQL")
	if err := nd.kc.show(ctx, "get", "rpa"); err != nil {
		return err
	}
	if err := nd.kc.show(ctx, "get", "rpb"); err != nil {
		return err
	}
	rpaRow, err := activityLedgerRow(ctx, c, o.name)
	if err != nil {
		return err
	}
	ledgerAgrees, err := showLedger(ctx, bs, []ledgerRow{rpaRow, budgetRow})
	if err != nil {
		return err
	}

	step("summary")
	// The refusals counted here are all the balance system saw, the group packets'
	// deliveries included.
	if obs.ledger, err = readLedger(ctx, bs, obs.uid); err != nil {
		return err
	}
	nd.passed = printSummary(rr, obs, total, o.packets, o.connections)
	if !groupsOK {
		fmt.Println("  group packets    FAILED: see above")
		nd.passed = false
	} else {
		fmt.Println("  group packets    every packet exact, every share and refund booked once in PostgreSQL, kubectl get rpb exact")
	}
	if !ledgerAgrees {
		fmt.Println("  ledger           FAILED: PostgreSQL's totals differ from the status, see above")
		nd.passed = false
	} else {
		fmt.Println("  ledger           PostgreSQL's totals are the activity's and the budget's status totals to the unit")
	}
	peak, at := nd.mem.stop()
	fmt.Printf("  %-16s %s\n", "timings", strings.Join(timings, ", "))
	fmt.Printf("  %-16s peak resident memory of the node and its pods %d MiB (%s)\n", "memory", peak>>20, memBreakdown(at))
	if !nd.passed {
		nd.diagnose()
	}

	if o.keep {
		nd.printKeep(grabURL, installed.RedisAddr, obs.uid)
		<-ctx.Done()
		fmt.Println()
		return nil
	}
	fmt.Println("\n    To keep the node running and explore it with kubectl, run: make demo ARGS=--keep")
	fmt.Println("    (or go run ./hack/demo --keep); Ctrl-C stops it.")
	return nil
}

// teardown stops what the demo started, the node last, and reports whether the host
// is as the demo found it.
func (nd *nodeDemo) teardown() bool {
	if nd.mem != nil {
		nd.mem.stop()
	}
	if len(nd.stops) == 0 && nd.node == nil {
		return true
	}
	step("stopping everything the demo started")
	for i := len(nd.stops) - 1; i >= 0; i-- {
		nd.stops[i]()
	}
	nd.stops = nil
	clean := true
	if nd.node != nil {
		start := time.Now()
		if err := nd.node.Stop(); err != nil {
			fmt.Printf("    stopping the node: %v\n", err)
			clean = false
		}
		fmt.Printf("    node stopped, host settings put back and %s removed in %s\n", nd.node.Dir, time.Since(start).Round(100*time.Millisecond))
	}
	if nd.node == nil {
		return clean
	}
	// The node read the host's state once it held the machine's node lock, before it
	// changed anything.
	diff := nd.node.HostBefore.Diff(cluster.ReadHostState())
	if len(diff) > 0 {
		fmt.Println("    the host is NOT as the demo found it:")
		for _, d := range diff {
			fmt.Println("      " + d)
		}
		return false
	}
	fmt.Println("    the host is as the demo found it (processes, links, addresses, firewall rules, nftables, mounts,")
	fmt.Println("    network namespaces, cgroups, paths, kernel settings): none is left behind")
	return clean
}

// whose tells, for a difference in the node's processes, whether the process is this
// node's: the components it starts name its folder in their arguments, so one that
// diagnose prints what the node saw, while it still runs: the tails of its
// components' logs, the pods, the activity and the logs of the operator and the grab
// pods. The components' logs are also copied to .demo/node-logs, since the teardown
// removes the node's folder.
func (nd *nodeDemo) diagnose() {
	if nd.node == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	step("what the node saw")
	for _, comp := range []string{"kube-apiserver", "kube-controller-manager", "kubelet", "containerd"} {
		fmt.Printf("--- %s log (tail)\n%s\n", comp, proc.Tail(nd.node.LogPath(comp), 2000))
	}
	for _, args := range [][]string{
		{"get", "pods", "-A", "-o", "wide"},
		{"describe", "rpa", "--namespace", "default", nd.opts.name},
		{"get", "events", "-A", "--sort-by=.lastTimestamp"},
	} {
		// On failure the error holds the command, its output and its errors.
		out, err := nd.node.Kubectl(ctx, "", args...)
		if err != nil {
			out = err.Error()
		}
		fmt.Printf("--- kubectl %s\n%s\n", strings.Join(args, " "), out)
	}
	// The containers' logs, read where the kubelet writes them.
	podLogs, _ := filepath.Glob(filepath.Join(nd.node.Dir, "pod-logs", "*", "*", "*.log"))
	for _, f := range podLogs {
		fmt.Printf("--- %s (tail)\n%s\n", podLogName(nd.node.Dir, f), proc.Tail(f, 2000))
	}
	dst := filepath.Join(nd.dir, "node-logs")
	err := copyDir(filepath.Join(nd.node.Dir, "logs"), dst)
	for _, f := range podLogs {
		err = errors.Join(err, copyFile(f, filepath.Join(dst, strings.ReplaceAll(podLogName(nd.node.Dir, f), "/", "_"))))
	}
	if err == nil {
		fmt.Printf("--- the node's and the pods' logs are kept in %s\n", rel(nd.root, dst))
	}
}

// podLogName names a container's log file under the kubelet's pod log folder
// (NAMESPACE_POD_UID/CONTAINER/N.log) as NAMESPACE/POD/CONTAINER.log.
func podLogName(nodeDir, file string) string {
	r, err := filepath.Rel(filepath.Join(nodeDir, "pod-logs"), file)
	if err != nil {
		return file
	}
	parts := strings.Split(r, string(filepath.Separator))
	if len(parts) != 3 {
		return r
	}
	pod := parts[0]
	if i := strings.LastIndexByte(pod, '_'); i > 0 {
		pod = pod[:i] // the pod's UID
	}
	return strings.Replace(pod, "_", "/", 1) + "/" + parts[1] + ".log"
}

// copyDir copies the files of one folder into another.
func copyDir(src, dst string) error {
	entries, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		if e.Type().IsRegular() {
			errs = append(errs, copyFile(filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())))
		}
	}
	return errors.Join(errs...)
}

// copyFile copies one file.
func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	return errors.Join(err, out.Close())
}

// printKeep tells how to explore the running node.
func (nd *nodeDemo) printKeep(grabURL, redisAddr, uid string) {
	name := nd.opts.name
	step("the node keeps running until Ctrl-C")
	fmt.Printf(`    export KUBECONFIG=%s
    alias kubectl=%s
    kubectl get pods -A -o wide
    kubectl get rpa -o wide
    kubectl describe rpa %s
    kubectl patch rpa %s --type=merge -p '{"spec":{"paused":true}}'
    curl -s -X POST %s/v1/grab -d '{"userId":"user-00001"}'
    curl -s %s/v1/activity
    REDISCLI_AUTH="$(kubectl -n %s get secret %s -o jsonpath='{.data.password}' | base64 -d)" redis-cli --user %s -h %s -p %s HLEN 'rpa:{%s}:claims'
    ls %s   # the node's components' logs
    ls %s   # the containers' logs, NAMESPACE_POD_UID/CONTAINER/0.log
    open %s/ in a browser on this machine: the red-packet rain page (the grab Service's ClusterIP)
`, nd.node.Kubeconfig, filepath.Join(nd.node.BinDir, "kubectl"), name, name, grabURL, grabURL,
		cluster.OperatorNamespace, cluster.RedisSecret, cluster.RedisUser, hostOf(redisAddr), portOf(redisAddr), uid, filepath.Join(nd.node.Dir, "logs"), filepath.Join(nd.node.Dir, "pod-logs"), grabURL)
}

// memWatch samples the resident memory of the node and its pods every second.
type memWatch struct {
	mu   sync.Mutex
	peak int64
	at   map[string]int64 // by component, at the peak
	done chan struct{}
	once sync.Once
}

func watchMemory(c *cluster.Cluster) *memWatch {
	w := &memWatch{done: make(chan struct{})}
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			m := c.ResidentMemory()
			var sum int64
			for _, v := range m {
				sum += v
			}
			w.mu.Lock()
			if sum > w.peak {
				w.peak, w.at = sum, m
			}
			w.mu.Unlock()
			select {
			case <-w.done:
				return
			case <-t.C:
			}
		}
	}()
	return w
}

// stop ends the sampling and returns the peak and its parts.
func (w *memWatch) stop() (int64, map[string]int64) {
	w.once.Do(func() { close(w.done) })
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.peak, w.at
}

// memBreakdown lists the parts of a memory sample, largest first, in MiB.
func memBreakdown(m map[string]int64) string {
	names := make([]string, 0, len(m))
	for n := range m {
		names = append(names, n)
	}
	sort.Slice(names, func(i, j int) bool { return m[names[i]] > m[names[j]] })
	parts := make([]string, 0, len(names))
	for _, n := range names {
		parts = append(parts, fmt.Sprintf("%s %d", n, m[n]>>20))
	}
	return strings.Join(parts, ", ")
}
