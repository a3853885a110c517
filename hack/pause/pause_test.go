package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// buildPause builds this package as the images do and returns the binary's path.
func buildPause(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "pause")
	cmd := exec.Command("go", "build", "-trimpath", "-o", bin, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// TestPause runs pause with a child that exits while pause runs, and wants pause to
// reap it and then exit 0 on SIGTERM or SIGINT. The child is either a direct one (a
// shell forks it and execs pause) or, as PID 1 of a new PID namespace, an orphan
// reparented to pause, which is what pause meets in a pod.
func TestPause(t *testing.T) {
	bin := buildPause(t)
	for _, tc := range []struct {
		name   string
		script string // run by sh, which becomes pause
		newPID bool
		sig    syscall.Signal
	}{
		{"child/SIGTERM", `sleep 1 & exec "$0"`, false, syscall.SIGTERM},
		{"child/SIGINT", `sleep 1 & exec "$0"`, false, syscall.SIGINT},
		{"orphan as PID 1/SIGTERM", `(sleep 1 &); exec "$0"`, true, syscall.SIGTERM},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command("/bin/sh", "-c", tc.script, bin)
			if tc.newPID {
				cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
			}
			if err := cmd.Start(); err != nil {
				if tc.newPID && errors.Is(err, syscall.EPERM) {
					skipOutsideCI(t, "no new PID namespace: "+err.Error())
				}
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			pid := cmd.Process.Pid
			defer func() {
				cmd.Process.Kill()
				<-done
			}()

			// The shell execs pause once the sleep is forked (and, for the orphan,
			// reparented), so from then on pause has one child, asleep.
			waitFor(t, "sh to exec pause", func() bool { return comm(pid) == "pause" })
			children := childrenOf(pid)
			if len(children) != 1 {
				t.Fatalf("pause has children %v, want one sleep", children)
			}
			child := children[0]
			// A zombie that pause does not reap stays in /proc, in state Z.
			waitFor(t, "pause to reap its exited child", func() bool {
				ppid, state := stat(child)
				return ppid != pid || state == ""
			})

			if err := cmd.Process.Signal(tc.sig); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-done:
				done <- err
				if err != nil || cmd.ProcessState.ExitCode() != 0 {
					t.Fatalf("pause ended with %v (%v), want exit 0", err, cmd.ProcessState)
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("pause still runs 5s after %v", tc.sig)
			}
		})
	}
}

// skipOutsideCI skips the test, saying why; in CI (CI=true) it fails instead, since
// nothing may skip there.
func skipOutsideCI(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatal("CI must run this test: " + why)
	}
	t.Skip(why)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// comm returns the command name of the process pid, or "".
func comm(pid int) string {
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	return strings.TrimSpace(string(b))
}

// stat returns the parent and the state (R, S, Z...) of the process pid, or 0 and ""
// when there is no such process.
func stat(pid int) (ppid int, state string) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, ""
	}
	// pid (comm) state ppid ...; comm may hold spaces and parentheses.
	fields := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if len(fields) < 2 {
		return 0, ""
	}
	ppid, _ = strconv.Atoi(fields[1])
	return ppid, fields[0]
}

// childrenOf returns the processes whose parent is pid.
func childrenOf(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	var children []int
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, _ := stat(p); ppid == pid {
			children = append(children, p)
		}
	}
	return children
}
