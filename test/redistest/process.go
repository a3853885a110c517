package redistest

import (
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
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

// Kill ends the server with SIGKILL, as a crash or `kill -9` would: nothing is
// flushed or saved on the way out. It waits until the process is gone, so the
// server's files and port are free when it returns.
func (s *Server) Kill() error {
	if s.cmd == nil || s.cmd.Process == nil {
		return errors.New("redis-server is not running")
	}
	if err := s.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return fmt.Errorf("killing redis-server %s: %w", s.Addr, err)
	}
	_ = s.cmd.Wait()
	s.cmd = nil
	return nil
}

// RestartProcess starts redis-server again on the files in dir and on addr (the
// 127.0.0.1:port of a server that was killed), with extraArgs as at its first start:
// what a supervisor does after a crash. It waits until the server answers PING,
// which it does only once it has loaded its RDB or AOF. The caller stops it.
func RestartProcess(dir, addr string, extraArgs ...string) (*Server, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server is not installed (apt-get install redis-server): %w", err)
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("restarting redis-server: address %q: %w", addr, err)
	}
	args := append([]string{
		"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--daemonize", "no", "--logfile", filepath.Join(dir, "redis-"+port+".log"),
	}, extraArgs...)
	cmd := exec.Command(bin, args...)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", bin, err)
	}
	s := &Server{Addr: addr, cmd: cmd, dir: dir}
	if err := waitPing(addr, 30*time.Second); err != nil {
		s.Stop()
		return nil, fmt.Errorf("redis-server restarted on %s: %w (see %s)", addr, err, filepath.Join(dir, "redis-"+port+".log"))
	}
	return s, nil
}
