// Package controlplane starts a real kube-apiserver and etcd (controller-runtime's
// envtest) from the binaries that hack/build-controlplane.sh puts in bin/, with the
// project's CRDs installed. Tests find the binaries by themselves.
package controlplane

import (
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// ControlPlane is a running kube-apiserver and etcd with the CRDs installed.
type ControlPlane struct {
	// Config reaches the API server as an administrator.
	Config *rest.Config
	// Client is a client with the project's scheme.
	Client client.Client
	// Scheme knows the built-in kinds and RedPacketActivity.
	Scheme *runtime.Scheme
	// BinDir holds kube-apiserver, etcd and kubectl.
	BinDir string
	env    *envtest.Environment
}

// Root returns the repository's top directory, found by walking up to go.mod.
func Root() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			if _, err := os.Stat(filepath.Join(dir, "PROJECT")); err == nil {
				return dir, nil
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no repository root above the working directory")
		}
		dir = parent
	}
}

// NewScheme returns a scheme with the built-in kinds, the project's kinds and the
// Gateway API's (gateway.networking.k8s.io/v1), whose CRDs New does not install.
func NewScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := redpacketv1alpha1.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := gatewayv1.Install(s); err != nil {
		panic(err)
	}
	return s
}

// New starts a control plane. The caller stops it.
func New() (*ControlPlane, error) {
	root, err := Root()
	if err != nil {
		return nil, err
	}
	binDir := filepath.Join(root, "bin")
	for _, b := range []string{"kube-apiserver", "etcd", "kubectl"} {
		if _, err := os.Stat(filepath.Join(binDir, b)); err != nil {
			return nil, fmt.Errorf("%s is missing from %s: run hack/build-controlplane.sh (make controlplane)", b, binDir)
		}
	}
	env := &envtest.Environment{
		BinaryAssetsDirectory: binDir,
		CRDDirectoryPaths:     []string{filepath.Join(root, "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
	}
	// Service addresses for long runs: every activity's grab workload has a Service,
	// and without a kube-controller-manager nothing deletes them with their
	// namespaces. envtest's default /24 runs out after about 250 of them.
	env.ControlPlane.GetAPIServer().Configure().Set("service-cluster-ip-range", "10.0.0.0/16")
	cfg, err := env.Start()
	if err != nil {
		// Start fails after it started etcd and kube-apiserver when the CRDs are
		// refused (a CEL rule over its cost budget, say): stop what it started.
		_ = env.Stop()
		return nil, fmt.Errorf("starting envtest: %w", err)
	}
	scheme := NewScheme()
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		_ = env.Stop()
		return nil, fmt.Errorf("creating client: %w", err)
	}
	cp := &ControlPlane{Config: cfg, Client: c, Scheme: scheme, BinDir: binDir, env: env}
	if testing.Testing() {
		// Programs (the demo, the benchmark) handle their own signals and tear down
		// themselves.
		running.add(cp)
	}
	return cp, nil
}

// running are the control planes a test binary started and has not stopped yet. An
// interrupted test run (Ctrl-C, or a SIGTERM from a timeout) stops them before it exits, so that no
// kube-apiserver or etcd outlives it: envtest starts them in process groups of their
// own, which the terminal's signal does not reach.
var running = &controlPlanes{set: map[*ControlPlane]bool{}}

type controlPlanes struct {
	mu       sync.Mutex
	set      map[*ControlPlane]bool
	watching bool
}

func (r *controlPlanes) add(cp *ControlPlane) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.set[cp] = true
	if r.watching {
		return
	}
	r.watching = true
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		s := <-sig
		r.mu.Lock()
		for cp := range r.set {
			_ = cp.env.Stop()
		}
		r.mu.Unlock()
		fmt.Fprintf(os.Stderr, "control plane: stopped on %v\n", s)
		os.Exit(1)
	}()
}

func (r *controlPlanes) remove(cp *ControlPlane) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.set, cp)
}

// Start starts a control plane for the test and stops it at cleanup.
func Start(tb testing.TB) *ControlPlane {
	tb.Helper()
	cp, err := New()
	if err != nil {
		tb.Fatalf("control plane: %v", err)
	}
	tb.Cleanup(func() { _ = cp.Stop() })
	return cp
}

// Stop stops the API server and etcd.
func (cp *ControlPlane) Stop() error {
	running.remove(cp)
	return cp.env.Stop()
}

// Kubeconfig writes a kubeconfig for an administrator to path, for kubectl and for
// processes such as the grab service.
func (cp *ControlPlane) Kubeconfig(path string) error {
	user, err := cp.env.ControlPlane.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return fmt.Errorf("adding kubeconfig user: %w", err)
	}
	data, err := user.KubeConfig()
	if err != nil {
		return fmt.Errorf("rendering kubeconfig: %w", err)
	}
	return os.WriteFile(path, data, 0o600)
}

// Namespace creates a namespace with a generated name for a test.
func (cp *ControlPlane) Namespace(tb testing.TB) string {
	tb.Helper()
	ns := &corev1.Namespace{}
	ns.GenerateName = "t-"
	if err := cp.Client.Create(tb.Context(), ns); err != nil {
		tb.Fatalf("creating namespace: %v", err)
	}
	return ns.Name
}
