package proc

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"redpacket.io/operator/test/wait"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// running reports whether pid is a live (not zombie) process.
func running(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] != 'Z'
}

// waitFor polls f every 20ms until it is true or within passes.
func waitFor(t *testing.T, within time.Duration, what string, f func() bool) {
	t.Helper()
	wait.Until(t, within, what, func() (bool, string) { return f(), "" })
}

// grandchild starts a shell that ignores or honours SIGTERM as asked, starts a
// sleeping child of its own and prints that child's pid.
func grandchild(t *testing.T, ignoreTerm bool) (*Proc, int) {
	t.Helper()
	script := `sleep 60 & echo "$!"; echo "$FROM_ENV"; wait`
	if ignoreTerm {
		script = `trap "" TERM; ` + script
	}
	logPath := filepath.Join(t.TempDir(), "sh.log")
	p, err := Start("shell", logPath, []string{"FROM_ENV=passed"}, "sh", "-c", script)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop(time.Second) })
	var lines []string
	waitFor(t, 10*time.Second, "the shell printing its child's pid", func() bool {
		b, _ := os.ReadFile(logPath)
		lines = strings.Fields(string(b))
		return len(lines) >= 2
	})
	if lines[1] != "passed" {
		t.Fatalf("the child saw FROM_ENV=%q, want %q", lines[1], "passed")
	}
	pid, err := strconv.Atoi(lines[0])
	if err != nil {
		t.Fatalf("pid %q: %v", lines[0], err)
	}
	if !running(pid) {
		t.Fatalf("grandchild %d is not running before Stop", pid)
	}
	return p, pid
}

func TestStopEndsTheWholeGroup(t *testing.T) {
	p, pid := grandchild(t, false)
	if p.Exited() {
		t.Fatal("Exited before Stop")
	}
	if p.Name() != "shell" || p.Pid() <= 0 {
		t.Fatalf("Name %q, Pid %d", p.Name(), p.Pid())
	}
	start := time.Now()
	p.Stop(10 * time.Second)
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Stop took %s although the group honours SIGTERM", took)
	}
	if !p.Exited() {
		t.Error("not Exited after Stop")
	}
	waitFor(t, 5*time.Second, "the grandchild ending", func() bool { return !running(pid) })
}

func TestStopKillsAfterGrace(t *testing.T) {
	p, pid := grandchild(t, true)
	start := time.Now()
	p.Stop(300 * time.Millisecond)
	took := time.Since(start)
	if took < 300*time.Millisecond || took > 5*time.Second {
		t.Errorf("Stop of a group ignoring SIGTERM took %s, want about the 300ms grace", took)
	}
	if !p.Exited() {
		t.Error("not Exited after Stop")
	}
	waitFor(t, 5*time.Second, "the grandchild ending", func() bool { return !running(pid) })
}

func TestStopNil(t *testing.T) {
	var p *Proc
	p.Stop(time.Second) // must not panic
}

func TestStartMissingBinary(t *testing.T) {
	_, err := Start("nothing", filepath.Join(t.TempDir(), "log"), nil, filepath.Join(t.TempDir(), "missing"))
	if err == nil || !strings.Contains(err.Error(), "starting nothing") {
		t.Fatalf("Start of a missing binary: %v", err)
	}
}

func TestFreeAddr(t *testing.T) {
	addr, err := FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(addr, "127.0.0.1:") {
		t.Fatalf("FreeAddr = %q", addr)
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listening on the free address: %v", err)
	}
	_ = l.Close()
}

func TestWaitHTTP(t *testing.T) {
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if calls.Add(1) < 3 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	if err := WaitHTTP(t.Context(), nil, srv.URL, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if n := calls.Load(); n != 3 {
		t.Errorf("%d requests, want 3 (two 503s, then 200)", n)
	}
}

func TestWaitHTTPTimesOut(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	err := WaitHTTP(t.Context(), nil, srv.URL, 300*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "HTTP 503") {
		t.Fatalf("WaitHTTP on a server answering 503: %v", err)
	}
}

func TestWaitHTTPProcessExited(t *testing.T) {
	addr, err := FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	p, err := Start("quitter", filepath.Join(t.TempDir(), "log"), nil, "sh", "-c", "exit 3")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop(time.Second)
	start := time.Now()
	err = WaitHTTP(t.Context(), p, "http://"+addr+"/", 30*time.Second)
	if err == nil || !strings.Contains(err.Error(), "quitter exited") {
		t.Fatalf("WaitHTTP for a process that exited: %v", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("WaitHTTP noticed the exit after %s", took)
	}
}

func TestWaitHTTPContext(t *testing.T) {
	addr, err := FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if err := WaitHTTP(ctx, nil, "http://"+addr+"/", time.Minute); err == nil {
		t.Fatal("WaitHTTP returned nil after its context ended")
	}
}

func TestTail(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	if err := os.WriteFile(path, []byte("first\nlast\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := Tail(path, 5); got != "last\n" {
		t.Errorf("Tail(5) = %q", got)
	}
	if got := Tail(path, 100); got != "first\nlast\n" {
		t.Errorf("Tail(100) = %q", got)
	}
	if got := Tail(filepath.Join(t.TempDir(), "missing"), 10); !strings.Contains(got, "no such file") {
		t.Errorf("Tail of a missing file = %q", got)
	}
}
