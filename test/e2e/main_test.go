// Package e2e drives the whole system the way its users do: the real kubectl binary
// against a local control plane (kube-apiserver and etcd), the operator binary
// reconciling, a real redis-server, and a grab service process answering HTTP.
package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/proc"
	"redpacket.io/operator/test/redistest"
)

// env is what TestMain started for every test.
var env struct {
	root       string
	work       string
	kubectl    string
	kubeconfig string
	grabsvc    string
	redisAddr  string
	// redisEnv logs a process in to the Redis as its admin user (REDIS_USERNAME,
	// REDIS_PASSWORD): it refuses the default user, as the dev Redis does.
	redisEnv   []string
	redis      *redis.Client
	managerLog string
}

// stopGrace is how long a stopped process may take to end after SIGTERM before it
// is killed; tailBytes is how much of a log a failure shows.
const (
	stopGrace = 20 * time.Second
	tailBytes = 6000
)

// TestMain runs the tests inside the environment runMain starts.
// operatorNamespace is the namespace the operator runs for (POD_NAMESPACE), where its
// settlement keys are.
const operatorNamespace = "redpacket-system"

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

// runMain starts the control plane, Redis and the operator, runs the tests and stops
// everything, whatever the tests did.
func runMain(m *testing.M) int {
	ctrllog.SetLogger(logr.Discard())
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	root, err := controlplane.Root()
	if err != nil {
		return fail(err)
	}
	env.root = root
	work, err := os.MkdirTemp("", "redpacket-e2e-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(work)
	env.work = work

	// The binaries under test, built from this tree.
	manager := filepath.Join(work, "manager")
	env.grabsvc = filepath.Join(work, "grabsvc")
	for _, b := range [][]string{{manager, "./cmd/manager"}, {env.grabsvc, "./cmd/grabsvc"}} {
		cmd := exec.Command("go", "build", "-o", b[0], b[1])
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return fail(fmt.Errorf("go build %s: %w\n%s", b[1], err, out))
		}
	}

	cp, err := controlplane.New()
	if err != nil {
		return fail(err)
	}
	defer func() { _ = cp.Stop() }()
	env.kubectl = filepath.Join(cp.BinDir, "kubectl")
	env.kubeconfig = filepath.Join(work, "kubeconfig")
	if err := cp.Kubeconfig(env.kubeconfig); err != nil {
		return fail(err)
	}

	rs, err := redistest.StartProcess(work)
	if err != nil {
		return fail(err)
	}
	defer rs.Stop()
	env.redisAddr = rs.Addr
	env.redisEnv = rs.AuthEnv()
	env.redis = redis.NewClient(rs.Options())
	defer env.redis.Close()

	// The operator settles, signing with the key its own namespace holds for the
	// balance system's host and port: the tests' receivers listen on 127.0.0.1 (and do
	// not check signatures), each at a port newBalance adds to the Secret.
	ctx := context.Background()
	if err := cp.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: operatorNamespace}}); err != nil {
		return fail(err)
	}
	if err := cp.Client.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "redpacket-settlement-keys", Namespace: operatorNamespace},
		Data: map[string][]byte{"127.0.0.1": []byte("e2e-operator-signing-key")}}); err != nil {
		return fail(err)
	}

	probe, err := proc.FreeAddr()
	if err != nil {
		return fail(err)
	}
	env.managerLog = filepath.Join(work, "manager.log")
	mp, err := proc.Start("operator", env.managerLog, append([]string{"POD_NAMESPACE=" + operatorNamespace}, env.redisEnv...), manager, "--kubeconfig", env.kubeconfig,
		"--redis-addresses", rs.Addr, "--metrics-bind-address", "0", "--health-probe-bind-address", probe,
		"--cleanup-grace-period", "2m")
	if err != nil {
		return fail(err)
	}
	defer mp.Stop(stopGrace)
	if err := proc.WaitHTTP(context.Background(), mp, "http://"+probe+"/readyz", 60*time.Second); err != nil {
		return fail(fmt.Errorf("operator: %w\n%s", err, proc.Tail(env.managerLog, tailBytes)))
	}

	code := m.Run()
	if code != 0 {
		fmt.Fprintf(os.Stderr, "--- operator log (tail)\n%s\n", proc.Tail(env.managerLog, tailBytes))
	}
	return code
}

// kubectl runs bin/kubectl against the control plane with stdin, returning its
// standard output and error.
func kubectl(t *testing.T, stdin string, args ...string) (string, string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, env.kubectl, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+env.kubeconfig)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	return stdout.String(), stderr.String(), err
}

// mustKubectl runs kubectl and fails the test when it fails.
func mustKubectl(t *testing.T, stdin string, args ...string) string {
	t.Helper()
	out, errOut, err := kubectl(t, stdin, args...)
	if err != nil {
		t.Fatalf("kubectl %s: %v\nstdout: %s\nstderr: %s", strings.Join(args, " "), err, out, errOut)
	}
	return out
}

// eventually polls f every 200ms until it returns nil or within passes.
func eventually(t *testing.T, within time.Duration, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s: %v", what, within, err)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("%s: %v", what, t.Context().Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}
