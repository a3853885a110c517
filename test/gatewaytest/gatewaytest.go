// Package gatewaytest puts a real Gateway in front of a test's servers: the Gateway
// API's standard CRDs, installed from the module the operator builds its routes with,
// and Traefik (bin/traefik, built from hack/tools/traefik) as a host process whose
// kubernetesGateway provider watches the test's API server through a kubeconfig.
//
// A Service of the API server reaches host processes through a selector-less Service
// and an EndpointSlice naming the host's own address (Backend, HostIP), which is how
// Traefik resolves backends: from EndpointSlices, never through the Service's cluster
// IP. The API server refuses loopback addresses in an EndpointSlice, so the process
// must listen on the host's address, not on 127.0.0.1.
package gatewaytest

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"

	"redpacket.io/operator/test/controlplane"
)

// ControllerName is the GatewayClass controller Traefik answers for.
const ControllerName = "traefik.io/gateway-controller"

// InstallCRDs creates the Gateway API's standard CRDs (config/crd/standard of the
// sigs.k8s.io/gateway-api module in go.mod, from the module cache) through the API
// server behind cfg, as a platform team installs them.
func InstallCRDs(tb testing.TB, cfg *rest.Config) {
	tb.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/gateway-api").Output()
	if err != nil {
		tb.Fatalf("finding the gateway-api module (go list -m): %v", err)
	}
	dir := filepath.Join(strings.TrimSpace(string(out)), "config", "crd", "standard")
	crds, err := envtest.InstallCRDs(cfg, envtest.CRDInstallOptions{Paths: []string{dir}, ErrorIfPathMissing: true})
	if err != nil {
		tb.Fatalf("installing the Gateway API CRDs from %s: %v", dir, err)
	}
	tb.Logf("installed %d Gateway API CRDs from %s", len(crds), dir)
}

// Bin is the path of bin/traefik, or why it cannot be used.
func Bin() (string, error) {
	root, err := controlplane.Root()
	if err != nil {
		return "", err
	}
	p := filepath.Join(root, "bin", "traefik")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%s is missing: run make traefik (hack/build-controlplane.sh traefik)", p)
	}
	return p, nil
}

// Require ends a test that needs bin/traefik where it is missing: a failure under
// CI=true, where nothing may skip, a skip elsewhere. Under -short (make test-unit,
// which needs no server and runs before make test builds Traefik) it skips.
func Require(tb testing.TB) string {
	tb.Helper()
	if testing.Short() {
		tb.Skip("needs Traefik, an API server and redis-server; run without -short")
	}
	p, err := Bin()
	if err == nil {
		return p
	}
	if os.Getenv("CI") == "true" {
		tb.Fatalf("CI=true and Traefik is missing: %v", err)
	}
	tb.Skipf("skipping: %v", err)
	return ""
}

// Traefik is a running Traefik process with one HTTP entry point.
type Traefik struct {
	// Port is the entry point's port on 127.0.0.1; a Gateway's listener of this
	// port is served on it.
	Port int
	cmd  *exec.Cmd
	log  *lockedBuffer
}

// URL is the entry point's base URL.
func (t *Traefik) URL() string { return fmt.Sprintf("http://127.0.0.1:%d", t.Port) }

// Log is what Traefik has printed so far.
func (t *Traefik) Log() string { return t.log.String() }

// StartTraefik runs bin/traefik with its kubernetesGateway provider watching cp (an
// administrator's kubeconfig), an HTTP entry point on a free loopback port, no
// version check and no usage report, and stops it at cleanup.
func StartTraefik(tb testing.TB, cp *controlplane.ControlPlane) *Traefik {
	tb.Helper()
	bin := Require(tb)
	dir := tb.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := cp.Kubeconfig(kubeconfig); err != nil {
		tb.Fatal(err)
	}
	port := freePort(tb)
	t := &Traefik{Port: port, log: &lockedBuffer{}}
	t.cmd = exec.Command(bin,
		"--global.checkNewVersion=false", "--global.sendAnonymousUsage=false",
		fmt.Sprintf("--entryPoints.web.address=127.0.0.1:%d", port),
		"--providers.kubernetesGateway=true",
		"--providers.kubernetesGateway.throttleDuration=0s",
		"--log.level=INFO")
	env := []string{"KUBECONFIG=" + kubeconfig}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KUBERNETES_SERVICE_") && !strings.HasPrefix(kv, "KUBECONFIG=") {
			env = append(env, kv)
		}
	}
	t.cmd.Env = env
	t.cmd.Stdout, t.cmd.Stderr = t.log, t.log
	if err := t.cmd.Start(); err != nil {
		tb.Fatalf("starting traefik: %v", err)
	}
	tb.Cleanup(func() {
		_ = t.cmd.Process.Kill()
		_ = t.cmd.Wait()
		if tb.Failed() {
			tb.Logf("traefik's log:\n%s", t.Log())
		}
	})
	return t
}

// Gateway creates the GatewayClass for Traefik (once per API server) and a Gateway
// name in ns with one HTTP listener on t's entry point, admitting routes of its own
// namespace.
func (t *Traefik) Gateway(tb testing.TB, c client.Client, ns, name string) {
	tb.Helper()
	ctx := tb.Context()
	class := &gatewayv1.GatewayClass{ObjectMeta: metav1.ObjectMeta{Name: "traefik"},
		Spec: gatewayv1.GatewayClassSpec{ControllerName: ControllerName}}
	if err := c.Create(ctx, class); err != nil && !strings.Contains(err.Error(), "already exists") {
		tb.Fatalf("creating the GatewayClass: %v", err)
	}
	gw := &gatewayv1.Gateway{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: gatewayv1.GatewaySpec{GatewayClassName: "traefik", Listeners: []gatewayv1.Listener{{
			Name: "web", Protocol: gatewayv1.HTTPProtocolType, Port: gatewayv1.PortNumber(t.Port),
		}}}}
	if err := c.Create(ctx, gw); err != nil {
		tb.Fatalf("creating the Gateway: %v", err)
	}
}

// HostIP is the first IPv4 address of an interface that is up and not loopback: the
// address a Backend's process listens on.
func HostIP(tb testing.TB) string {
	tb.Helper()
	ifaces, err := net.Interfaces()
	if err != nil {
		tb.Fatal(err)
	}
	for _, i := range ifaces {
		if i.Flags&net.FlagUp == 0 || i.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := i.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
				return n.IP.String()
			}
		}
	}
	tb.Fatal("the host has no IPv4 address outside loopback for an EndpointSlice")
	return ""
}

// Serve serves h on HostIP at a free port until the test ends, and returns the port.
func Serve(tb testing.TB, h http.Handler) int32 {
	tb.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(HostIP(tb), "0"))
	if err != nil {
		tb.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	tb.Cleanup(func() { _ = srv.Close() })
	return int32(l.Addr().(*net.TCPAddr).Port)
}

// Backend makes the Service name in ns (port servicePort, named "http") lead to the
// host process listening on HostIP:hostPort (Serve): a Service without a selector
// and an EndpointSlice of one ready endpoint.
func Backend(tb testing.TB, c client.Client, ns, name string, servicePort int32, hostPort int32) {
	tb.Helper()
	ctx := tb.Context()
	portName := "http"
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: portName, Port: servicePort,
			TargetPort: intstr.FromInt32(hostPort), Protocol: corev1.ProtocolTCP}}}}
	if err := c.Create(ctx, svc); err != nil {
		tb.Fatalf("creating Service %s: %v", name, err)
	}
	ready, proto := true, corev1.ProtocolTCP
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + "-host",
			Labels: map[string]string{discoveryv1.LabelServiceName: name}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{HostIP(tb)}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}}},
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Port: &hostPort, Protocol: &proto}},
	}
	if err := c.Create(ctx, slice); err != nil {
		tb.Fatalf("creating EndpointSlice of %s: %v", name, err)
	}
}

// WaitRouted polls url through Traefik until an answer comes from behind it
// (accept says which), or fails the test after timeout: Traefik answers 404 until it
// has read the route, the Service and its EndpointSlice.
func WaitRouted(tb testing.TB, t *Traefik, url string, timeout time.Duration, accept func(*http.Response) bool) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(tb.Context(), timeout)
	defer cancel()
	last := "no answer"
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			ok := accept(resp)
			last = resp.Status
			_ = resp.Body.Close()
			if ok {
				return
			}
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			tb.Fatalf("%s not routed through Traefik after %v (last: %s); traefik's log:\n%s", url, timeout, last, t.Log())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func freePort(tb testing.TB) int {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// lockedBuffer is a process's output, written by its pipes and read by the test.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
