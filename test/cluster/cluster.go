// Package cluster runs a real single-node Kubernetes on this machine for the
// end-to-end tests and the demo: containerd, etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler, a kubelet and kube-proxy, as child
// processes with their own PKI and state under one temporary folder. Images come from
// tarballs imported into containerd, so no registry is involved.
//
// The node needs root on Linux. Start installs what is missing through the system
// package manager, records the host's state (settings, links, firewall rules,
// mounts, cgroups, paths), and Stop puts every bit of it back: it stops each process
// it started by PID, unmounts, deletes the bridge, veths, firewall chains and the
// node's address, and restores the kernel settings that the kubelet, kube-proxy or
// the CNI plugins changed. Only one node runs on a machine at a time: Start waits for
// a lock that Stop releases.
//
// Addresses: the node is NodeIP (a /32 on lo), pods get PodCIDR on a bridge, and
// Services get ServiceCIDR through kube-proxy in iptables mode. These ranges exist
// only on this machine. Pods reach host services (Redis, a test's webhook receiver)
// at NodeIP; the host reaches Services through their ClusterIP. There is no cluster
// DNS: pods find Services through environment variables or IPs.
package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/proc"
)

// The node's addresses and names. They are private to this machine.
const (
	NodeIP      = "10.250.0.1"
	PodCIDR     = "10.251.0.0/24"
	ServiceCIDR = "10.252.0.0/24"
	NodeName    = "redpacket-node"
	BridgeName  = "rpnode0"
	// APIServerPort is the API server's port on NodeIP.
	APIServerPort = 6443
	// kubernetesServiceIP is the first address of ServiceCIDR, the kubernetes Service.
	kubernetesServiceIP = "10.252.0.1"
	lockPath            = "/run/lock/redpacket-node.lock"
)

// packages are the Debian packages the node needs, with a file each that shows it
// is installed.
var packages = []struct{ name, file string }{
	{"containerd", "/usr/bin/containerd"},
	{"runc", "/usr/sbin/runc"},
	{"containernetworking-plugins", "/usr/lib/cni/bridge"},
	{"iptables", "/usr/sbin/iptables"},
	{"conntrack", "/usr/sbin/conntrack"},
	{"nftables", "/usr/sbin/nft"},
}

// components are the binaries built into bin/ by hack/build-controlplane.sh.
var components = []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "kubectl"}

// Options configure a node.
type Options struct {
	// Images are docker-archive or OCI tarballs to import into containerd before the
	// kubelet starts.
	Images []string
	// PauseImage is the pod sandbox image's reference; it must be among Images.
	PauseImage string
	// Logf receives progress lines; nil discards them.
	Logf func(format string, args ...any)
}

// Cluster is a running single-node Kubernetes.
type Cluster struct {
	// Dir holds the node's state, logs and PKI; Stop removes it.
	Dir string
	// BinDir holds the Kubernetes binaries.
	BinDir string
	// Kubeconfig is an administrator's kubeconfig file.
	Kubeconfig string
	// Config reaches the API server as an administrator.
	Config *rest.Config
	// Client is a typed client for the built-in kinds.
	Client kubernetes.Interface
	// Started is how long the start took, from nothing to a Ready node.
	Started time.Duration

	// HostBefore is the host's state read once this node held the machine's node
	// lock, before it changed anything; after Stop, ReadHostState must equal it.
	HostBefore HostState

	opts       Options
	lock       *os.File
	procs      []*proc.Proc // in start order
	containerd string       // socket
	mu         sync.Mutex
	stopped    bool
}

// Supported says why this machine cannot run a node, or "" when it can.
func Supported() string {
	if runtime.GOOS != "linux" {
		return "a real node needs Linux; this is " + runtime.GOOS
	}
	if os.Geteuid() != 0 {
		return "a real node needs root (containerd, the kubelet and kube-proxy change the host's network)"
	}
	return ""
}

func (o Options) logf(format string, args ...any) {
	if o.Logf != nil {
		o.Logf(format, args...)
	}
}

// EnsurePackages installs the node's Debian packages that are missing.
func EnsurePackages(logf func(string, ...any)) error {
	var missing []string
	for _, p := range packages {
		if _, err := os.Stat(p.file); err != nil {
			missing = append(missing, p.name)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	if logf != nil {
		logf("installing %s", strings.Join(missing, " "))
	}
	if out, err := exec.Command("apt-get", "update", "-qq").CombinedOutput(); err != nil {
		return fmt.Errorf("apt-get update: %v\n%s", err, out)
	}
	cmd := exec.Command("apt-get", append([]string{"install", "-y", "-qq", "--no-install-recommends"}, missing...)...)
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("apt-get install %s: %v\n%s", strings.Join(missing, " "), err, out)
	}
	return nil
}

// Start starts a node and waits until it is Ready. On failure everything started is
// stopped and the host is put back.
func Start(ctx context.Context, opts Options) (c *Cluster, err error) {
	if why := Supported(); why != "" {
		return nil, errors.New(why)
	}
	begin := time.Now()
	root, err := controlplane.Root()
	if err != nil {
		return nil, err
	}
	binDir := filepath.Join(root, "bin")
	for _, b := range components {
		if _, err := os.Stat(filepath.Join(binDir, b)); err != nil {
			return nil, fmt.Errorf("%s is missing from %s: run hack/build-controlplane.sh (make controlplane)", b, binDir)
		}
	}
	if err := EnsurePackages(opts.Logf); err != nil {
		return nil, err
	}
	lock, err := takeLock(ctx, opts)
	if err != nil {
		return nil, err
	}
	c = &Cluster{BinDir: binDir, opts: opts, lock: lock}
	c.HostBefore = ReadHostState()
	for _, a := range c.HostBefore.LoAddrs {
		if strings.HasPrefix(a, NodeIP+"/") {
			c.releaseLock()
			return nil, fmt.Errorf("%s is already on lo: another node runs, or one was not torn down", NodeIP)
		}
	}
	defer func() {
		if err != nil {
			if stopErr := c.Stop(); stopErr != nil {
				err = errors.Join(err, stopErr)
			}
		}
	}()
	if c.Dir, err = os.MkdirTemp("", nodeDirPrefix); err != nil {
		return c, err
	}
	if err := c.start(ctx); err != nil {
		return c, err
	}
	c.Started = time.Since(begin)
	opts.logf("node %s Ready in %s", NodeName, c.Started.Round(100*time.Millisecond))
	return c, nil
}

// takeLock waits for the machine-wide node lock.
func takeLock(ctx context.Context, opts Options) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(lockPath), 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", lockPath, err)
	}
	said := false
	for {
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err == nil {
			return f, nil
		}
		if !said {
			opts.logf("waiting for another node on this machine to stop (%s)", lockPath)
			said = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

func (c *Cluster) releaseLock() {
	if c.lock != nil {
		_ = unix.Flock(int(c.lock.Fd()), unix.LOCK_UN)
		_ = c.lock.Close()
		c.lock = nil
	}
}

func (c *Cluster) path(parts ...string) string {
	return filepath.Join(append([]string{c.Dir}, parts...)...)
}

// LogPath is the log file of a component ("kubelet", "kube-apiserver", ...).
func (c *Cluster) LogPath(component string) string { return c.path("logs", component+".log") }

func (c *Cluster) startProc(name string, args ...string) (*proc.Proc, error) {
	bin := filepath.Join(c.BinDir, name)
	if name == "containerd" {
		bin = "/usr/bin/containerd"
	}
	p, err := proc.Start(name, c.LogPath(name), nil, bin, args...)
	if err != nil {
		return nil, err
	}
	c.procs = append(c.procs, p)
	return p, nil
}

func (c *Cluster) start(ctx context.Context) error {
	for _, d := range []string{"logs", "pki", "etcd", "kubelet", "pod-logs", "cni/net.d", "cni/ipam", "containerd"} {
		if err := os.MkdirAll(c.path(d), 0o700); err != nil {
			return err
		}
	}
	if out, err := exec.Command("ip", "addr", "add", NodeIP+"/32", "dev", "lo").CombinedOutput(); err != nil {
		return fmt.Errorf("adding %s to lo: %v: %s", NodeIP, err, out)
	}
	if err := confineNetwork(); err != nil {
		return err
	}

	// PKI.
	ca, err := newAuthority(c.path("pki"))
	if err != nil {
		return err
	}
	apiserverCert, err := ca.issue("apiserver", "kube-apiserver", nil, NodeIP, kubernetesServiceIP, "127.0.0.1",
		"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local", "localhost")
	if err != nil {
		return err
	}
	kubeletClient, err := ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"})
	if err != nil {
		return err
	}
	sa, err := ca.serviceAccountKeys()
	if err != nil {
		return err
	}
	server := fmt.Sprintf("https://%s:%d", NodeIP, APIServerPort)
	users := []struct{ name, cn, org string }{
		{"admin", "redpacket-admin", "system:masters"},
		{"kube-controller-manager", "system:kube-controller-manager", ""},
		{"kube-scheduler", "system:kube-scheduler", ""},
		{"kubelet", "system:node:" + NodeName, "system:nodes"},
		{"kube-proxy", "system:kube-proxy", ""},
	}
	kubeconfigs := map[string]string{}
	for _, u := range users {
		var orgs []string
		if u.org != "" {
			orgs = []string{u.org}
		}
		f, err := ca.issue(u.name, u.cn, orgs)
		if err != nil {
			return err
		}
		kubeconfigs[u.name] = c.path("pki", u.name+".kubeconfig")
		if err := ca.kubeconfig(kubeconfigs[u.name], server, u.name, f); err != nil {
			return err
		}
	}
	kubeletServing, err := ca.issue("kubelet-serving", "system:node:"+NodeName, []string{"system:nodes"}, NodeIP, NodeName)
	if err != nil {
		return err
	}
	c.Kubeconfig = kubeconfigs["admin"]

	// etcd.
	etcdClient, err := proc.FreeAddr()
	if err != nil {
		return err
	}
	etcdPeer, err := proc.FreeAddr()
	if err != nil {
		return err
	}
	if _, err := c.startProc("etcd", "--data-dir", c.path("etcd"), "--name", "node",
		"--listen-client-urls", "http://"+etcdClient, "--advertise-client-urls", "http://"+etcdClient,
		"--listen-peer-urls", "http://"+etcdPeer, "--initial-advertise-peer-urls", "http://"+etcdPeer,
		"--initial-cluster", "node=http://"+etcdPeer, "--unsafe-no-fsync", "--log-level", "warn"); err != nil {
		return err
	}

	// kube-apiserver.
	apiserver, err := c.startProc("kube-apiserver",
		"--etcd-servers", "http://"+etcdClient,
		"--bind-address", NodeIP, "--advertise-address", NodeIP, fmt.Sprintf("--secure-port=%d", APIServerPort),
		"--service-cluster-ip-range", ServiceCIDR,
		"--client-ca-file", ca.certPath(),
		"--tls-cert-file", apiserverCert.cert, "--tls-private-key-file", apiserverCert.key,
		"--kubelet-client-certificate", kubeletClient.cert, "--kubelet-client-key", kubeletClient.key,
		"--kubelet-certificate-authority", ca.certPath(),
		"--service-account-key-file", sa.cert, "--service-account-signing-key-file", sa.key,
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
		"--kubelet-preferred-address-types", "InternalIP",
		"--allow-privileged=true", "--cert-dir", c.path("pki", "apiserver-certs"),
		"--endpoint-reconciler-type", "lease", "--v", "1")
	if err != nil {
		return err
	}
	if err := c.waitAPIServer(ctx, apiserver, ca); err != nil {
		return err
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		return fmt.Errorf("reading the admin kubeconfig: %w", err)
	}
	cfg.QPS, cfg.Burst = 50, 100
	c.Config = cfg
	if c.Client, err = kubernetes.NewForConfig(cfg); err != nil {
		return err
	}
	if err := c.grantAPIServerKubeletAccess(ctx); err != nil {
		return err
	}

	// containerd, then the images, before the kubelet asks for any.
	if err := c.startContainerd(ctx); err != nil {
		return err
	}
	for _, img := range c.opts.Images {
		if err := c.ImportImage(ctx, img); err != nil {
			return err
		}
	}

	// Controller manager and scheduler.
	kcmPort, err := freePort()
	if err != nil {
		return err
	}
	if _, err := c.startProc("kube-controller-manager",
		"--kubeconfig", kubeconfigs["kube-controller-manager"],
		"--authentication-kubeconfig", kubeconfigs["kube-controller-manager"],
		"--authorization-kubeconfig", kubeconfigs["kube-controller-manager"],
		"--bind-address", "127.0.0.1", fmt.Sprintf("--secure-port=%d", kcmPort),
		"--use-service-account-credentials", "--service-account-private-key-file", sa.key,
		"--root-ca-file", ca.certPath(),
		"--cluster-signing-cert-file", ca.certPath(), "--cluster-signing-key-file", ca.keyPath(),
		"--leader-elect=false", "--cluster-cidr", PodCIDR, "--service-cluster-ip-range", ServiceCIDR,
		"--v", "1"); err != nil {
		return err
	}
	schedPort, err := freePort()
	if err != nil {
		return err
	}
	if _, err := c.startProc("kube-scheduler",
		"--kubeconfig", kubeconfigs["kube-scheduler"],
		"--authentication-kubeconfig", kubeconfigs["kube-scheduler"],
		"--authorization-kubeconfig", kubeconfigs["kube-scheduler"],
		"--bind-address", "127.0.0.1", fmt.Sprintf("--secure-port=%d", schedPort),
		"--leader-elect=false", "--v", "1"); err != nil {
		return err
	}

	// CNI, kubelet and kube-proxy.
	if err := os.WriteFile(c.path("cni", "net.d", "10-redpacket.conflist"), []byte(c.cniConfig()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(c.path("kubelet-config.yaml"), []byte(c.kubeletConfig(ca, kubeletServing)), 0o600); err != nil {
		return err
	}
	if _, err := c.startProc("kubelet", "--config", c.path("kubelet-config.yaml"),
		"--kubeconfig", kubeconfigs["kubelet"], "--root-dir", c.path("kubelet"),
		"--hostname-override", NodeName, "--node-ip", NodeIP, "--v", "1"); err != nil {
		return err
	}
	proxyConfig, err := c.kubeProxyConfig(kubeconfigs["kube-proxy"])
	if err != nil {
		return err
	}
	if err := os.WriteFile(c.path("kube-proxy-config.yaml"), []byte(proxyConfig), 0o600); err != nil {
		return err
	}
	if _, err := c.startProc("kube-proxy", "--config", c.path("kube-proxy-config.yaml"), "--v", "1"); err != nil {
		return err
	}
	return c.waitNodeReady(ctx)
}

func freePort() (int, error) {
	addr, err := proc.FreeAddr()
	if err != nil {
		return 0, err
	}
	var port int
	_, err = fmt.Sscanf(addr[strings.LastIndexByte(addr, ':')+1:], "%d", &port)
	return port, err
}

// waitAPIServer waits until the API server answers /readyz.
func (c *Cluster) waitAPIServer(ctx context.Context, p *proc.Proc, ca *authority) error {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.certPEM)
	admin, err := tls.LoadX509KeyPair(filepath.Join(ca.dir, "admin.crt"), filepath.Join(ca.dir, "admin.key"))
	if err != nil {
		return err
	}
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{admin}},
	}}
	url := fmt.Sprintf("https://%s:%d/readyz", NodeIP, APIServerPort)
	return c.poll(ctx, 90*time.Second, "kube-apiserver to answer /readyz", func() error {
		if p.Exited() {
			return stopPolling(fmt.Errorf("kube-apiserver exited:\n%s", proc.Tail(c.LogPath("kube-apiserver"), 3000)))
		}
		resp, err := hc.Get(url)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("HTTP %d", resp.StatusCode)
		}
		return nil
	})
}

// grantAPIServerKubeletAccess lets the API server's kubelet client use the kubelet
// API (logs, exec).
func (c *Cluster) grantAPIServerKubeletAccess(ctx context.Context) error {
	crb := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "redpacket-node:apiserver-kubelet"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "system:kubelet-api-admin"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: "kube-apiserver-kubelet-client"}},
	}
	return c.poll(ctx, 30*time.Second, "the API server's kubelet access to be granted", func() error {
		_, err := c.Client.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return nil
		}
		return err
	})
}

func (c *Cluster) startContainerd(ctx context.Context) error {
	c.containerd = c.path("containerd", "containerd.sock")
	if err := os.WriteFile(c.path("containerd", "config.toml"), []byte(c.containerdConfig()), 0o600); err != nil {
		return err
	}
	p, err := c.startProc("containerd", "--config", c.path("containerd", "config.toml"))
	if err != nil {
		return err
	}
	return c.poll(ctx, 30*time.Second, "containerd to answer", func() error {
		if p.Exited() {
			return stopPolling(fmt.Errorf("containerd exited:\n%s", proc.Tail(c.LogPath("containerd"), 3000)))
		}
		_, err := c.ctr(ctx, "version")
		return err
	})
}

// ctr runs containerd's ctr against the node's containerd in the k8s.io namespace.
func (c *Cluster) ctr(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "ctr", append([]string{"--address", c.containerd, "--namespace", "k8s.io"}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// ImportImage imports an image tarball into the node's containerd, where the kubelet
// finds it without pulling.
func (c *Cluster) ImportImage(ctx context.Context, tarball string) error {
	start := time.Now()
	if _, err := c.ctr(ctx, "images", "import", "--no-unpack=false", tarball); err != nil {
		return fmt.Errorf("importing %s: %w", tarball, err)
	}
	c.opts.logf("imported %s in %s", filepath.Base(tarball), time.Since(start).Round(10*time.Millisecond))
	return nil
}

// waitNodeReady waits until the node is registered and Ready.
func (c *Cluster) waitNodeReady(ctx context.Context) error {
	return c.poll(ctx, 3*time.Minute, "node "+NodeName+" to be Ready", func() error {
		for _, p := range c.procs {
			if p.Exited() {
				return stopPolling(fmt.Errorf("%s exited:\n%s", p.Name(), proc.Tail(c.LogPath(p.Name()), 3000)))
			}
		}
		node, err := c.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				if cond.Status == corev1.ConditionTrue {
					return nil
				}
				return fmt.Errorf("condition Ready is %s: %s", cond.Status, cond.Message)
			}
		}
		return errors.New("no Ready condition yet")
	})
}

type stopPollingError struct{ err error }

func (e stopPollingError) Error() string { return e.err.Error() }

// stopPolling makes poll give up at once with err.
func stopPolling(err error) error { return stopPollingError{err} }

// poll calls f every 250ms until it returns nil, within passes, or f says to stop.
func (c *Cluster) poll(ctx context.Context, within time.Duration, what string, f func() error) error {
	deadline := time.Now().Add(within)
	for {
		err := f()
		if err == nil {
			return nil
		}
		var stop stopPollingError
		if errors.As(err, &stop) {
			return fmt.Errorf("waiting for %s: %w", what, stop.err)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("waiting for %s: not within %s: %w", what, within, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// Stop tears the node down: pods first (so the kubelet unmounts their volumes and
// the CNI plugin releases their addresses), then the node components, containerd
// and its shims, the control plane, and then everything left on the host is put
// back as it was before Start. It is safe to call twice.
func (c *Cluster) Stop() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return nil
	}
	c.stopped = true
	defer c.releaseLock()
	var errs []error
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	byName := map[string]*proc.Proc{}
	for _, p := range c.procs {
		byName[p.Name()] = p
	}
	stop := func(name string, grace time.Duration) {
		if p := byName[name]; p != nil {
			p.Stop(grace)
		}
	}
	// Nothing may recreate pods while they are removed.
	stop("kube-controller-manager", 10*time.Second)
	stop("kube-scheduler", 10*time.Second)
	if c.Client != nil && byName["kubelet"] != nil && !byName["kubelet"].Exited() {
		if err := c.removePods(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	stop("kube-proxy", 10*time.Second)
	stop("kubelet", 15*time.Second)
	if c.containerd != "" && byName["containerd"] != nil && !byName["containerd"].Exited() {
		c.killContainers(ctx)
	}
	stop("containerd", 10*time.Second)
	// Shims outlive containerd; their containers die with them.
	if c.Dir != "" {
		for _, pid := range processesMatching("containerd-shim", c.Dir) {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	}
	stop("kube-apiserver", 15*time.Second)
	stop("etcd", 10*time.Second)
	for _, p := range c.procs {
		p.Stop(5 * time.Second)
	}
	if c.Dir != "" {
		c.removeContainerLogLinks()
	}
	forgetConnections()
	errs = append(errs, retryRestore(c.HostBefore)...)
	if c.Dir != "" {
		if err := os.RemoveAll(c.Dir); err != nil {
			errs = append(errs, fmt.Errorf("removing %s: %w", c.Dir, err))
		}
	}
	return errors.Join(errs...)
}

// retryRestore puts the host back, trying again briefly while processes that were
// just killed still hold cgroups or mounts.
func retryRestore(before HostState) []error {
	var errs []error
	for i := 0; i < 10; i++ {
		errs = restoreHost(before)
		if len(errs) == 0 {
			return nil
		}
		time.Sleep(500 * time.Millisecond)
	}
	return errs
}

// removePods deletes every pod at once and waits until the kubelet has stopped them
// all, so their volumes are unmounted and their addresses released.
func (c *Cluster) removePods(ctx context.Context) error {
	zero := int64(0)
	pods, err := c.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("listing pods: %w", err)
	}
	for _, p := range pods.Items {
		_ = c.Client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	}
	err = c.poll(ctx, 60*time.Second, "the kubelet to remove every pod", func() error {
		out, err := c.ctr(ctx, "tasks", "list", "-q")
		if err != nil {
			return err
		}
		if n := len(strings.Fields(out)); n > 0 {
			return fmt.Errorf("%d containers still run", n)
		}
		left, err := c.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(left.Items) > 0 {
			return fmt.Errorf("%d pods remain", len(left.Items))
		}
		return nil
	})
	if err != nil {
		c.opts.logf("%v; killing what is left", err)
	}
	return nil
}

// killContainers kills and removes every task and container left in containerd.
func (c *Cluster) killContainers(ctx context.Context) {
	out, err := c.ctr(ctx, "tasks", "list", "-q")
	if err != nil {
		return
	}
	for _, id := range strings.Fields(out) {
		_, _ = c.ctr(ctx, "tasks", "kill", "--signal", "SIGKILL", id)
	}
	for _, id := range strings.Fields(out) {
		_, _ = c.ctr(ctx, "tasks", "delete", "--force", id)
	}
}

// removeContainerLogLinks removes the links the kubelet keeps in /var/log/containers
// that point into the node's folder.
func (c *Cluster) removeContainerLogLinks() {
	entries, err := os.ReadDir("/var/log/containers")
	if err != nil {
		return
	}
	for _, e := range entries {
		p := filepath.Join("/var/log/containers", e.Name())
		if target, err := os.Readlink(p); err == nil && strings.HasPrefix(target, c.Dir) {
			_ = os.Remove(p)
		}
	}
}

// Kubectl runs bin/kubectl against the node as an administrator.
func (c *Cluster) Kubectl(ctx context.Context, stdin string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(c.BinDir, "kubectl"), args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.Kubeconfig)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("kubectl %s: %v\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.String(), nil
}

// ResidentMemory is the resident memory of the node's processes and its pods, in
// bytes, by component ("pods" for the containers).
func (c *Cluster) ResidentMemory() map[string]int64 {
	out := map[string]int64{}
	for _, p := range c.procs {
		if !p.Exited() {
			out[p.Name()] += rss(p.Pid())
		}
	}
	for _, pid := range processesMatching("containerd-shim", c.Dir) {
		out["containerd-shim"] += rss(pid)
	}
	if b, err := os.ReadFile("/sys/fs/cgroup/memory/kubepods/memory.usage_in_bytes"); err == nil {
		var v int64
		if _, err := fmt.Sscanf(strings.TrimSpace(string(b)), "%d", &v); err == nil {
			out["pods"] = v
		}
	}
	return out
}

func rss(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimSpace(strings.TrimPrefix(line, "VmRSS:")), "%d", &kb); err == nil {
				return kb * 1024
			}
		}
	}
	return 0
}
