package redistest

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Dir is the server's working directory, where its RDB file and AOF directory live.
func (s *Server) Dir() string { return s.dir }

// Port is the server's TCP port.
func (s *Server) Port() string {
	_, port, _ := net.SplitHostPort(s.Addr)
	return port
}

// Kill ends the server with SIGKILL, as a crash of its machine would: nothing is
// flushed or saved on the way out, and a child it forked (an AOF rewrite or an RDB
// save in progress) dies with it (KillProcess). It waits until they are gone, so the
// server's files and port are free when it returns.
func (s *Server) Kill() error {
	if s.cmd == nil || s.cmd.Process == nil {
		return errors.New("redis-server is not running")
	}
	err := KillProcess(s.cmd)
	s.cmd = nil
	if err != nil {
		return fmt.Errorf("killing redis-server %s: %w", s.Addr, err)
	}
	return nil
}

// KillProcess ends a redis-server with SIGKILL together with the children it forked.
// A child writing an AOF rewrite or an RDB file outlives a server killed alone and
// goes on writing into its directory, where it breaks a test's cleanup of that
// directory ("directory not empty") or a restart on the same files. The server is
// stopped first (SIGSTOP), so it forks nothing between the reading of its children and
// its end; then its children and it are killed, and KillProcess returns once the
// server is reaped and every child has exited.
func KillProcess(cmd *exec.Cmd) error {
	pid := cmd.Process.Pid
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		// It has exited already: reap it.
		_ = cmd.Wait()
		return nil
	}
	waitProcess(pid, time.Second, func(state byte) bool { return state == 'T' || state == 't' || state == 'Z' })
	children := childrenOf(pid)
	for _, c := range children {
		_ = syscall.Kill(c, syscall.SIGKILL)
	}
	err := cmd.Process.Signal(syscall.SIGKILL)
	_ = cmd.Wait()
	for _, c := range children {
		// A child killed is gone or a zombie its new parent has yet to reap; either
		// writes nothing more.
		waitProcess(c, 10*time.Second, func(state byte) bool { return state == 'Z' || state == 'X' })
	}
	return err
}

// waitProcess waits up to within until process pid is gone or done says its state
// (the third field of /proc/<pid>/stat) is reached.
func waitProcess(pid int, within time.Duration, done func(state byte) bool) {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		_, state, ok := procStat(pid)
		if !ok || done(state) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// childrenOf lists the processes whose parent is pid, from /proc.
func childrenOf(pid int) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var children []int
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, _, ok := procStat(n); ok && ppid == pid {
			children = append(children, n)
		}
	}
	return children
}

// procStat reads the parent and the state of process pid from /proc/<pid>/stat; ok
// is false when there is no such process.
func procStat(pid int) (ppid int, state byte, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	// "pid (comm) state ppid ...": comm may hold spaces and parentheses, so the
	// fields are read after its last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 || len(f[0]) != 1 {
		return 0, 0, false
	}
	ppid, err = strconv.Atoi(f[1])
	if err != nil {
		return 0, 0, false
	}
	return ppid, f[0][0], true
}

// RestartProcess starts redis-server again on the files and the address of prev (a
// server that was killed), with its admin user and password, and with extraArgs as
// at its first start: what a supervisor does after a crash. It waits until the server
// answers PING, which it does only once it has loaded its RDB or AOF. The caller
// stops it.
func RestartProcess(prev *Server, extraArgs ...string) (*Server, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server is not installed (apt-get install redis-server): %w", err)
	}
	dir, addr := prev.dir, prev.Addr
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("restarting redis-server: address %q: %w", addr, err)
	}
	args := append([]string{
		"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--daemonize", "no", "--logfile", filepath.Join(dir, "redis-"+port+".log"),
	}, ACLArgs(prev.Username, prev.Password)...)
	cmd := exec.Command(bin, append(args, extraArgs...)...)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", bin, err)
	}
	s := &Server{Addr: addr, Username: prev.Username, Password: prev.Password, cmd: cmd, dir: dir}
	if err := waitPing(s.Options(), 30*time.Second); err != nil {
		s.Stop()
		return nil, fmt.Errorf("redis-server restarted on %s: %w (see %s)", addr, err, filepath.Join(dir, "redis-"+port+".log"))
	}
	return s, nil
}
