// Package proc starts child processes in their own process group for tests, the
// demo and benchmarks, so that stopping them leaves nothing behind.
package proc

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"
)

// Proc is a child process in its own process group. Stop ends the whole group; the
// kernel kills the child too if the parent dies first.
type Proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

// Start starts bin with args in its own process group, with env added to this
// process's environment and standard output and error written to logPath. name
// is used in error messages.
func Start(name, logPath string, env []string, bin string, args ...string) (*Proc, error) {
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("creating %s: %w", logPath, err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &Proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		_ = logf.Close()
		close(p.done)
	}()
	return p, nil
}

// Name is the name the process was started with.
func (p *Proc) Name() string { return p.name }

// Pid is the process id, which is also its process group id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Stop sends SIGTERM to the process group, then SIGKILL after grace, and returns
// once the process has been reaped. A nil Proc is a no-op.
func (p *Proc) Stop(grace time.Duration) {
	if p == nil {
		return
	}
	pgid := p.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-p.done
	}
}

// Exited reports whether the process has ended.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// FreeAddr returns a free 127.0.0.1:port.
func FreeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("finding a free port: %w", err)
	}
	defer l.Close()
	return "127.0.0.1:" + strconv.Itoa(l.Addr().(*net.TCPAddr).Port), nil
}

// WaitHTTP polls url every 100ms until it answers 200, p exits (p may be nil),
// within passes or ctx ends.
func WaitHTTP(ctx context.Context, p *Proc, url string, within time.Duration) error {
	deadline := time.Now().Add(within)
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return fmt.Errorf("building request for %s: %w", url, err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("HTTP %d", resp.StatusCode)
		}
		if p != nil && p.Exited() {
			return fmt.Errorf("%s exited before %s answered", p.name, url)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not answer 200 within %s (last error: %w)", url, within, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Tail returns at most the last limit bytes of the file at path (a process's log),
// or the error reading it, for error messages.
func Tail(path string, limit int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > limit {
		b = b[len(b)-limit:]
	}
	return string(b)
}
