// Package e2e drives the whole system the way its users do: the real kubectl binary
// against a local control plane (kube-apiserver and etcd), the operator binary
// reconciling, a real redis-server, and a grab service process answering HTTP.
package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/redis/go-redis/v9"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"redpacket.io/operator/test/controlplane"
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
	redis      *redis.Client
	managerLog string
}

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
	for _, b := range [][]string{{manager, "."}, {env.grabsvc, "./grabsvc/cmd/grabsvc"}} {
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
	env.redis = redis.NewClient(&redis.Options{Addr: rs.Addr})
	defer env.redis.Close()

	probe, err := freeAddr()
	if err != nil {
		return fail(err)
	}
	env.managerLog = filepath.Join(work, "manager.log")
	mp, err := startProcess(env.managerLog, manager, "--kubeconfig", env.kubeconfig,
		"--redis-addresses", rs.Addr, "--metrics-bind-address", "0", "--health-probe-bind-address", probe,
		"--cleanup-grace-period", "2m")
	if err != nil {
		return fail(err)
	}
	defer mp.stop()
	if err := waitOK(mp, "http://"+probe+"/readyz", 60*time.Second); err != nil {
		return fail(fmt.Errorf("operator: %w\n%s", err, readTail(env.managerLog)))
	}

	code := m.Run()
	if code != 0 {
		fmt.Fprintf(os.Stderr, "--- operator log (tail)\n%s\n", readTail(env.managerLog))
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

// process is a child in its own process group.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// startProcess starts bin with args, output to logPath.
func startProcess(logPath, bin string, args ...string) (*process, error) {
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("creating %s: %w", logPath, err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return nil, fmt.Errorf("starting %s: %w", bin, err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		_ = logf.Close()
		close(p.done)
	}()
	return p, nil
}

// stop terminates the process group, killing it if it lingers.
func (p *process) stop() {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// waitOK polls url until it answers 200.
func waitOK(p *process, url string, within time.Duration) error {
	deadline := time.Now().Add(within)
	for {
		resp, err := http.Get(url)
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("HTTP %d", resp.StatusCode)
		}
		if p.exited() {
			return fmt.Errorf("the process exited before %s answered", url)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: %w", url, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("finding a free port: %w", err)
	}
	defer l.Close()
	return "127.0.0.1:" + strconv.Itoa(l.Addr().(*net.TCPAddr).Port), nil
}

func readTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > 6000 {
		b = b[len(b)-6000:]
	}
	return string(b)
}
