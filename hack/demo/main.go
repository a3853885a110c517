// Command demo runs the whole system on this machine and makes it rain red packets.
//
// Where the machine can run a real node (Linux, as root: test/cluster), it builds
// the project's images (the operator, the pod sandbox and Redis) and starts a
// single-node Kubernetes on this machine: containerd, etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler, a kubelet and kube-proxy. It installs the
// project as a user would (the dev Redis, and the operator as a 2-replica Deployment
// of its own image), starts the reference balance system (bin/balance) on the host
// on a throwaway PostgreSQL cluster of its own, verifying the operator's Ed25519
// signatures, applies a demo-sized copy of the sample activity with 2 grab pods, and
// fires 20,000 concurrent users at its 2,000 packets through the grab Service's
// ClusterIP. It waits for the status reporter and settlement to catch up and prints
// the pods and kubectl get output before and after. Then it shows the second half of
// the product: a RedPacketBudget with its shared grab fleet, 500 group packets created
// at runtime through its Service, each raced by its group, expired and refunded,
// with kubectl get rpb before and after. Then kubectl get rpa and rpb beside the
// ledger in PostgreSQL, each source's grants and refunds read from the balance
// system, which must agree with the status totals to the unit. Last come a summary
// with its checks, how long each stage took and the node's peak resident memory. It
// then stops the balance system and removes its database cluster, tears the node
// down and checks that the host is exactly as it found it.
//
// Elsewhere, or with --host, it says why in one line and runs everything as host
// processes instead: a local control plane (kube-apiserver and etcd from bin/), a
// redis-server, the operator and one grab service process, with the same activity,
// rain, balance system, output and checks.
//
// Everything it starts is stopped at the end or on Ctrl-C; --keep leaves it all up
// until Ctrl-C so it can be explored with kubectl.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"redpacket.io/operator/test/cluster"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/proc"

	"redpacket.io/operator/internal/rain"
)

// options are the demo's knobs.
type options struct {
	keep        bool
	name        string
	packets     int64
	users       int
	connections int
	retryEvery  int
	settleWait  time.Duration
	skipBuild   bool
	host        bool
}

func main() {
	var o options
	flag.BoolVar(&o.keep, "keep", false, "keep everything running after the rain, until Ctrl-C")
	flag.StringVar(&o.name, "activity", "quiz-night", "name of the demo activity (namespace default)")
	flag.Int64Var(&o.packets, "packets", 2000, "packets in the demo activity")
	flag.IntVar(&o.users, "users", 20000, "concurrent users in the red-packet rain")
	flag.IntVar(&o.connections, "connections", 256, "keep-alive connections the users share")
	flag.IntVar(&o.retryEvery, "retry-every", 10, "every n-th user asks again after its answer (0: none)")
	flag.DurationVar(&o.settleWait, "settle-timeout", 90*time.Second, "how long to wait for the reporter and settlement to catch up")
	flag.BoolVar(&o.skipBuild, "skip-build", false, "use the binaries in bin/ as they are (a real node's images are built all the same)")
	flag.BoolVar(&o.host, "host", false, "run everything as host processes even where a real node could run")
	flag.Parse()
	ctrllog.SetLogger(logr.Discard())

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if !o.host {
		why := cluster.Supported()
		if why == "" {
			code := runNode(ctx, o)
			stop()
			os.Exit(code)
		}
		fmt.Printf("running the demo as host processes: %s\n", why)
	}
	d := &demo{opts: o}
	err := d.run(ctx)
	d.shutdown()
	if err != nil {
		if ctx.Err() != nil {
			fmt.Println("\ninterrupted; everything the demo started is stopped")
			os.Exit(130)
		}
		fmt.Fprintln(os.Stderr, "\ndemo:", err)
		if d.dir != "" {
			fmt.Fprintf(os.Stderr, "logs: %s\n", filepath.Join(d.dir, "logs"))
		}
		os.Exit(1)
	}
	if !d.passed {
		os.Exit(1)
	}
}

// demo holds what the demo started, to stop it in reverse order.
type demo struct {
	opts   options
	root   string
	dir    string
	stops  []func()
	passed bool
}

// onStop registers a function that shutdown runs, last registered first.
func (d *demo) onStop(f func()) { d.stops = append(d.stops, f) }

// step prints a heading.
func step(format string, args ...any) {
	fmt.Printf("\n==> "+format+"\n", args...)
}

func (d *demo) run(ctx context.Context) error {
	o := d.opts
	root, err := controlplane.Root()
	if err != nil {
		return fmt.Errorf("finding the repository: %w", err)
	}
	d.root = root
	if err := os.Chdir(root); err != nil {
		return fmt.Errorf("entering %s: %w", root, err)
	}
	d.dir = filepath.Join(root, ".demo")
	if err := os.RemoveAll(d.dir); err != nil {
		return fmt.Errorf("clearing %s: %w", d.dir, err)
	}
	if err := os.MkdirAll(filepath.Join(d.dir, "logs"), 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", d.dir, err)
	}

	if !o.skipBuild {
		step("building the control plane, the operator, the grab service and the balance system")
		if err := d.build(ctx); err != nil {
			return err
		}
	}
	if err := d.ensureRedis(ctx); err != nil {
		return err
	}
	if err := ensurePostgres(ctx, root); err != nil {
		return err
	}

	step("starting a local control plane (kube-apiserver + etcd)")
	cp, err := controlplane.New()
	if err != nil {
		return err
	}
	d.onStop(func() { _ = cp.Stop() })
	kubeconfig := filepath.Join(d.dir, "kubeconfig")
	if err := cp.Kubeconfig(kubeconfig); err != nil {
		return err
	}
	kc := kubectl{bin: filepath.Join(root, "bin", "kubectl"), kubeconfig: kubeconfig}
	fmt.Printf("    API server %s, kubeconfig %s\n", cp.Config.Host, rel(root, kubeconfig))

	step("starting redis-server")
	redisDir := filepath.Join(d.dir, "redis")
	if err := os.MkdirAll(redisDir, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", redisDir, err)
	}
	rs, err := startRedis(redisDir)
	if err != nil {
		return err
	}
	d.onStop(rs.Stop)
	// The admin user's password, for the redis-cli line printed with --keep; it is
	// given to the operator in its environment, never in its arguments.
	passwordFile := filepath.Join(d.dir, "redis.password")
	if err := os.WriteFile(passwordFile, []byte(rs.Password), 0o600); err != nil {
		return fmt.Errorf("writing %s: %w", passwordFile, err)
	}
	fmt.Printf("    redis-server on %s: the default user off, the operator's user %s (password in %s)\n",
		rs.Addr, rs.Username, rel(root, passwordFile))

	step("starting the balance system: bin/balance (cmd/balance) on a PostgreSQL of its own")
	bs, err := startBalanceSystem(ctx, root, d.dir, "127.0.0.1")
	if err != nil {
		return err
	}
	d.onStop(bs.stop)

	step("starting the operator (bin/manager)")
	probeAddr, err := proc.FreeAddr()
	if err != nil {
		return err
	}
	mgr, err := proc.Start("operator", filepath.Join(d.dir, "logs", "manager.log"), append([]string{"KUBECONFIG=" + kubeconfig}, rs.AuthEnv()...),
		filepath.Join(root, "bin", "manager"), "--kubeconfig", kubeconfig, "--redis-addresses", rs.Addr,
		"--metrics-bind-address", "0", "--health-probe-bind-address", probeAddr, "--leader-elect=false")
	if err != nil {
		return err
	}
	d.onStop(func() { mgr.Stop(15 * time.Second) })
	if err := proc.WaitHTTP(ctx, mgr, "http://"+probeAddr+"/readyz", 60*time.Second); err != nil {
		return fmt.Errorf("operator: %w (log: %s)", err, proc.Tail(filepath.Join(d.dir, "logs", "manager.log"), 3000))
	}
	fmt.Printf("    pid %d, probes on %s, log %s\n", mgr.Pid(), probeAddr, rel(root, filepath.Join(d.dir, "logs", "manager.log")))

	step("applying the sample activity with kubectl")
	sample, from, err := sampleActivity(root)
	if err != nil {
		return err
	}
	manifest, total, err := demoManifest(sample, o.name, o.packets, bs.WebhookURL(), "", 0)
	if err != nil {
		return err
	}
	manifestPath := filepath.Join(d.dir, o.name+".yaml")
	if err := os.WriteFile(manifestPath, manifest, 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", manifestPath, err)
	}
	if from != "" {
		fmt.Printf("    a demo-sized copy of %s: %d packets, open at once, settlement to the balance system\n", from, o.packets)
	}
	// The operator signs every delivery with the Ed25519 key its own namespace holds
	// for the balance system's host and port ("127.0.0.1_<port>.ed25519"); the
	// tenant's namespace holds none.
	if err := kc.show(ctx, "create", "namespace", "redpacket-system"); err != nil {
		return err
	}
	if err := kc.show(ctx, "create", "secret", "generic", "redpacket-settlement-keys", "--namespace", "redpacket-system",
		"--from-file="+bs.settlementKeyName()+"="+rel(root, bs.privateKeyFile)); err != nil {
		return err
	}
	if err := kc.show(ctx, "apply", "-f", rel(root, manifestPath)); err != nil {
		return err
	}

	step("starting the grab service (bin/grabsvc)")
	// As its pods would, it logs in to Redis as the activity's own user, from the
	// Secret the operator writes for them, which reaches the activity's keys only.
	grabEnv, grabUser, err := grabRedisEnv(ctx, cp.Client, o.name, 60*time.Second)
	if err != nil {
		return fmt.Errorf("%w (operator log: %s)", err, proc.Tail(filepath.Join(d.dir, "logs", "manager.log"), 3000))
	}
	grabAddr, err := proc.FreeAddr()
	if err != nil {
		return err
	}
	grabLog := filepath.Join(d.dir, "logs", "grabsvc.log")
	gs, err := proc.Start("grab service", grabLog, append([]string{"KUBECONFIG=" + kubeconfig}, grabEnv...),
		filepath.Join(root, "bin", "grabsvc"), "--namespace", "default", "--activity", o.name,
		"--listen", grabAddr, "--kubeconfig", kubeconfig, "--redis-addresses", rs.Addr,
		"--report-interval", "1s", "--shutdown-delay", "1s")
	if err != nil {
		return err
	}
	d.onStop(func() { gs.Stop(15 * time.Second) })
	if err := proc.WaitHTTP(ctx, gs, "http://"+grabAddr+"/readyz", 60*time.Second); err != nil {
		return fmt.Errorf("grab service: %w (log: %s)", err, proc.Tail(grabLog, 3000))
	}
	fmt.Printf("    http://%s (POST /v1/grab), pid %d, log %s\n", grabAddr, gs.Pid(), rel(root, grabLog))
	fmt.Printf("    Redis user %s, from the Secret %s-grab-redis\n", grabUser, o.name)
	fmt.Printf("    the red-packet rain page, to play in a browser: http://%s/\n", grabAddr)

	// Ready needs a grab replica that answers users, so the grab service starts first.
	if err := kc.show(ctx, "wait", "--for=condition=Ready", "rpa/"+o.name, "--timeout=120s"); err != nil {
		return fmt.Errorf("%w (operator log: %s)", err, proc.Tail(filepath.Join(d.dir, "logs", "manager.log"), 3000))
	}

	step("before the rain")
	if err := kc.show(ctx, "get", "rpa"); err != nil {
		return err
	}
	if err := kc.show(ctx, "get", "rpa", "-o", "wide"); err != nil {
		return err
	}

	step("red-packet rain: %d concurrent users for %d packets", o.users, o.packets)
	rr := rain.Run(ctx, rain.Spec{URL: "http://" + grabAddr + "/v1/grab", Users: o.users,
		Connections: o.connections, RetryEvery: o.retryEvery, Timeout: 30 * time.Second, Progress: os.Stdout})
	if err := ctx.Err(); err != nil {
		return err
	}

	step("waiting for the status reporter and settlement to catch up")
	obs, err := waitSettled(ctx, cp.Client, rs.Conn(), o.packets, o.settleWait, o.name, rr, bs)
	if err != nil {
		return err
	}

	step("after the rain")
	if err := kc.show(ctx, "get", "rpa"); err != nil {
		return err
	}
	if err := kc.show(ctx, "get", "rpa", "-o", "wide"); err != nil {
		return err
	}

	step("the books: kubectl get rpa beside the ledger in PostgreSQL")
	if err := kc.show(ctx, "get", "rpa"); err != nil {
		return err
	}
	rpaRow, err := activityLedgerRow(ctx, cp.Client, o.name)
	if err != nil {
		return err
	}
	ledgerAgrees, err := showLedger(ctx, bs, []ledgerRow{rpaRow})
	if err != nil {
		return err
	}

	step("summary")
	d.passed = printSummary(rr, obs, total, o.packets, o.connections)
	fmt.Println("  group packets    not run on host processes: a budget's shared grab fleet is a Deployment the operator runs on a real node")
	if !ledgerAgrees {
		fmt.Println("  ledger           FAILED: PostgreSQL's totals differ from the status, see above")
		d.passed = false
	} else {
		fmt.Println("  ledger           PostgreSQL's totals are the activity's status totals to the unit")
	}

	if o.keep {
		d.printKeep(kubeconfig, grabAddr, rs.Addr, rs.Username, rel(root, passwordFile), obs.uid)
		<-ctx.Done()
		fmt.Println()
		return nil
	}
	fmt.Println("\n    To keep everything running and explore it with kubectl, run: make demo ARGS=--keep")
	fmt.Println("    (or go run ./hack/demo --keep); Ctrl-C stops it.")
	return nil
}

// build compiles what the demo runs.
func (d *demo) build(ctx context.Context) error {
	cmds := [][]string{
		{filepath.Join(d.root, "hack", "build-controlplane.sh")},
		{"go", "build", "-o", "bin/manager", "./cmd/manager"},
		{"go", "build", "-o", "bin/grabsvc", "./cmd/grabsvc"},
		{"go", "build", "-o", "bin/balance", "./cmd/balance"},
	}
	for _, c := range cmds {
		fmt.Printf("$ %s\n", rel(d.root, c[0])+" "+joinArgs(c[1:]))
		cmd := exec.CommandContext(ctx, c[0], c[1:]...)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s: %w", joinArgs(c), err)
		}
	}
	return nil
}

// ensureRedis makes sure redis-server is installed: through hack/ensure-redis.sh
// (the system's packages, as root), or with a clear message.
func (d *demo) ensureRedis(ctx context.Context) error {
	if _, err := exec.LookPath("redis-server"); err == nil {
		return nil
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("redis-server is not installed; install it with: sudo apt-get install -y redis-server redis-tools (or run hack/ensure-redis.sh as root)")
	}
	step("installing redis-server through the system's package manager")
	cmd := exec.CommandContext(ctx, filepath.Join(d.root, "hack", "ensure-redis.sh"))
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("installing redis-server: %w", err)
	}
	if _, err := exec.LookPath("redis-server"); err != nil {
		return fmt.Errorf("redis-server is still missing after hack/ensure-redis.sh: %w", err)
	}
	return nil
}

// shutdown stops everything in reverse order and checks that no process is left.
func (d *demo) shutdown() {
	if len(d.stops) == 0 {
		return
	}
	before := descendants(os.Getpid())
	step("stopping everything the demo started")
	for i := len(d.stops) - 1; i >= 0; i-- {
		d.stops[i]()
	}
	d.stops = nil
	left := stillRunning(before)
	if len(left) == 0 {
		fmt.Printf("    stopped %d processes; none is left behind\n", len(before))
		return
	}
	for _, p := range left {
		fmt.Printf("    still running: pid %d %s; killing it\n", p.pid, p.cmdline)
		_ = syscall.Kill(p.pid, syscall.SIGKILL)
	}
}

// printKeep tells how to explore the running system. redis-cli logs in as redisUser
// with the password in passwordFile: the demo's Redis refuses the default user.
func (d *demo) printKeep(kubeconfig, grabAddr, redisAddr, redisUser, passwordFile, uid string) {
	step("everything keeps running until Ctrl-C")
	fmt.Printf(`    export KUBECONFIG=%s
    alias kubectl=%s
    kubectl get rpa -o wide
    kubectl describe rpa %s
    kubectl get rpa %s -o yaml
    kubectl patch rpa %s --type=merge -p '{"spec":{"paused":true}}'
    curl -s -X POST http://%s/v1/grab -d '{"userId":"user-00001"}'
    curl -s http://%s/v1/activity
    REDISCLI_AUTH="$(cat %s)" redis-cli --user %s -h %s -p %s HLEN 'rpa:{%s}:claims'
    open http://%s/ in a browser: the red-packet rain page
`, kubeconfig, filepath.Join(d.root, "bin", "kubectl"), d.opts.name, d.opts.name, d.opts.name,
		grabAddr, grabAddr, passwordFile, redisUser, hostOf(redisAddr), portOf(redisAddr), uid, grabAddr)
}

// allowlistKey is the key of the operator's settlement keys Secret that allows the
// receiver at baseURL ("http://<ip>:<port>"): "<ip>_<port>", since a Secret's keys
// cannot hold a ':'.
func allowlistKey(baseURL string) string {
	return strings.Replace(strings.TrimPrefix(baseURL, "http://"), ":", "_", 1)
}
