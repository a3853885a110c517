// Package pgtest starts real, throwaway PostgreSQL clusters for tests: initdb into a
// fresh directory, then postgres on a free loopback TCP port, with its unix socket in
// that directory and fsync on (the server's default). A test's cluster is stopped and
// its directory removed at the test's cleanup.
//
// PostgreSQL refuses to run as root. When the tests run as root (CI does), initdb and
// postgres run as the unprivileged "postgres" user that Debian's package creates, and
// the cluster's directory belongs to that user.
//
// The server programs are looked for in /usr/lib/postgresql/<version>/bin, where
// Debian puts them (hack/ensure-postgres.sh installs them), then on the PATH. When they
// are missing, a test skips with a message that says how to install them, except under
// CI=true, where it fails: CI never skips a database test. Under -short (make
// test-unit), a test that needs PostgreSQL skips.
package pgtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Superuser is the cluster's superuser, which trusts local connections: initdb
// --username.
const Superuser = "postgres"

// Server is one PostgreSQL cluster and its postmaster.
type Server struct {
	// Port is the postmaster's TCP port on 127.0.0.1; a restart keeps it.
	Port int
	// Dir holds the data directory (Dir/data), the unix socket and the server's log
	// (Dir/postgres.log).
	Dir string

	bin  string              // the directory of initdb and postgres
	cred *syscall.Credential // the unprivileged user the programs run as; nil: this process's
	cmd  *exec.Cmd
	// exited is closed once the postmaster has exited and been reaped.
	exited chan struct{}
	dbs    atomic.Int64 // databases made by NewDatabase
	// settings are the server settings StartProcessWith added, kept across restarts.
	settings []string
}

// DataDir is the cluster's data directory.
func (s *Server) DataDir() string { return filepath.Join(s.Dir, "data") }

// LogPath is the server's log file (its standard error), kept across restarts.
func (s *Server) LogPath() string { return filepath.Join(s.Dir, "postgres.log") }

// DSN is a connection string for database db as the superuser, over TCP.
func (s *Server) DSN(db string) string {
	return fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", Superuser, s.Port, db)
}

// Bin finds the directory that holds initdb and postgres: Debian's
// /usr/lib/postgresql/<version>/bin (the highest version first), then the PATH.
func Bin() (string, error) {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int { return versionOf(b) - versionOf(a) })
	for _, d := range dirs {
		if executable(filepath.Join(d, "initdb")) && executable(filepath.Join(d, "postgres")) {
			return d, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		d := filepath.Dir(p)
		if executable(filepath.Join(d, "postgres")) {
			return d, nil
		}
	}
	return "", errors.New("PostgreSQL's initdb and postgres are not installed (run hack/ensure-postgres.sh as root, or apt-get install postgresql)")
}

// versionOf is the major version in a /usr/lib/postgresql/<version>/bin path, 0 when
// it has none.
func versionOf(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

func executable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0
}

// Start runs a new cluster for the test and removes it at cleanup. It skips under
// -short, and when PostgreSQL is not installed unless CI=true, where that fails.
func Start(tb testing.TB) *Server {
	tb.Helper()
	Require(tb)
	s, err := StartProcess()
	if err != nil {
		tb.Fatalf("starting PostgreSQL: %v", err)
	}
	tb.Cleanup(s.Remove)
	return s
}

// Require ends a test that needs PostgreSQL's programs (for a cluster of its own,
// Start, or one a process it runs starts) where they cannot be had: it skips under
// -short, and where PostgreSQL is not installed it fails under CI=true, where
// nothing may skip, and skips elsewhere.
func Require(tb testing.TB) {
	tb.Helper()
	if testing.Short() {
		tb.Skip("needs PostgreSQL; run without -short")
	}
	if _, err := Bin(); err != nil {
		missing(tb, err)
	}
}

// missing ends a test that needs PostgreSQL where it is not installed: a failure
// under CI=true, where nothing may skip, a skip elsewhere.
func missing(tb testing.TB, err error) {
	tb.Helper()
	if os.Getenv("CI") == "true" {
		tb.Fatalf("CI=true and PostgreSQL is missing: %v", err)
		return
	}
	tb.Skipf("skipping: %v", err)
}

// StartProcess runs a new cluster in a new directory under the system's temporary
// directory, outside of any test. The caller ends it with Remove.
func StartProcess() (*Server, error) { return StartProcessWith() }

// StartProcessWith is StartProcess with more server settings ("name=value", each
// passed as -c after the harness's own, so they override them: for example
// "shared_buffers=128MB", PostgreSQL's own default, where the harness keeps 32MB).
func StartProcessWith(settings ...string) (*Server, error) {
	bin, err := Bin()
	if err != nil {
		return nil, err
	}
	cred, err := unprivileged()
	if err != nil {
		return nil, err
	}
	// Not t.TempDir: its parent is private to root, and the postgres user could not
	// reach a directory inside it; nor a $TMPDIR it cannot reach.
	base := os.TempDir()
	if cred != nil && !traversable(base) {
		base = "/tmp"
	}
	dir, err := os.MkdirTemp(base, "pgtest-")
	if err != nil {
		return nil, fmt.Errorf("making the cluster's directory: %w", err)
	}
	s := &Server{Dir: dir, bin: bin, cred: cred, settings: settings}
	if err := s.init(); err != nil {
		s.Remove()
		return nil, err
	}
	var lastErr error
	for range 5 {
		port, err := freePort()
		if err != nil {
			s.Remove()
			return nil, err
		}
		s.Port = port
		if lastErr = s.start(30 * time.Second); lastErr == nil {
			return s, nil
		}
	}
	s.Remove()
	return nil, lastErr
}

// traversable says whether every user may reach into dir: it and each of its
// parents are searchable by others.
func traversable(dir string) bool {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return false
	}
	for {
		fi, err := os.Stat(dir)
		if err != nil || fi.Mode().Perm()&0o001 == 0 {
			return false
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return true
		}
		dir = parent
	}
}

// unprivileged is the user PostgreSQL's programs run as: none of our own (nil) unless
// this process is root, then the postgres user.
func unprivileged() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup(Superuser)
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL refuses to run as root, and there is no %q user to run it as (Debian's postgresql package creates it): %w", Superuser, err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("uid of %s: %w", Superuser, err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("gid of %s: %w", Superuser, err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}, nil
}

// command is one of PostgreSQL's programs, run as the unprivileged user in s.Dir, in
// a process group of its own (so that Kill reaches every process the postmaster
// forked).
func (s *Server) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(s.bin, name), args...)
	cmd.Dir = s.Dir
	cmd.Env = append(os.Environ(), "LC_ALL=C", "TZ=UTC")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.cred}
	return cmd
}

// init makes the cluster: initdb into Dir/data, owned by the unprivileged user.
func (s *Server) init() error {
	if s.cred != nil {
		if err := os.Chown(s.Dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fmt.Errorf("giving %s to %s: %w", s.Dir, Superuser, err)
		}
	}
	// --no-sync: initdb's own final flush of the new files only; the server runs with
	// fsync on, and a test's kill -9 is a process crash, not a power cut.
	cmd := s.command("initdb", "--pgdata", s.DataDir(), "--username", Superuser, "--auth", "trust",
		"--encoding", "UTF8", "--locale", "C", "--no-sync")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("initdb: %w: %s", err, bytes.TrimSpace(out))
	}
	return nil
}

// start runs the postmaster on s.Port and waits until it accepts connections.
func (s *Server) start(within time.Duration) error {
	logf, err := os.OpenFile(s.LogPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("opening the server's log: %w", err)
	}
	defer logf.Close()
	cmd := s.command("postgres", "-D", s.DataDir(), "-p", strconv.Itoa(s.Port), "-k", s.Dir,
		"-c", "listen_addresses=127.0.0.1", "-c", "fsync=on", "-c", "synchronous_commit=on",
		"-c", "max_connections=200", "-c", "shared_buffers=32MB", "-c", "logging_collector=off")
	for _, setting := range s.settings {
		cmd.Args = append(cmd.Args, "-c", setting)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting postgres: %w", err)
	}
	s.cmd = cmd
	exited := make(chan struct{})
	go func() {
		// Reaped here: Kill and Stop wait on exited.
		_ = cmd.Wait()
		close(exited)
	}()
	s.exited = exited
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	for {
		conn, err := pgx.Connect(ctx, s.DSN("postgres"))
		if err == nil {
			_ = conn.Close(ctx)
			return nil
		}
		select {
		case <-exited:
			s.cmd = nil
			return fmt.Errorf("postgres exited on port %d: %s", s.Port, s.logTail())
		case <-ctx.Done():
			s.kill()
			return fmt.Errorf("postgres on port %d accepts no connection after %s: %w; %s", s.Port, within, err, s.logTail())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// logTail is the end of the server's log, for error messages.
func (s *Server) logTail() string {
	b, _ := os.ReadFile(s.LogPath())
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return "log: " + string(bytes.TrimSpace(b))
}

// Kill ends the postmaster and every process it forked with SIGKILL, as a crash of
// the machine's database would: nothing is flushed or checkpointed on the way out. It
// returns once they are all gone, so the data directory and the port are free for
// Restart.
func (s *Server) Kill() error {
	if s.cmd == nil {
		return errors.New("postgres is not running")
	}
	s.kill()
	return nil
}

// kill sends SIGKILL to the postmaster's process group and waits for every member.
func (s *Server) kill() {
	if s.cmd == nil {
		return
	}
	pgid := s.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	<-s.exited
	s.cmd = nil
	// The backends were in the group too; once none runs, none holds the shared
	// memory a new postmaster checks for.
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) && groupAlive(pgid) {
		time.Sleep(10 * time.Millisecond)
	}
	// A process that has left /proc may still hold its address space a moment
	// longer (the kernel, or a monitor that holds a reference to it, releases it
	// later), and with it the shared memory segment; a new postmaster refuses to
	// start while the segment is attached.
	for time.Now().Before(deadline) && shmAttached(s.DataDir()) {
		time.Sleep(10 * time.Millisecond)
	}
}

// shmAttached says whether the System V shared memory segment that postmaster.pid
// in dataDir names (its seventh line: key and id) is still attached by a process.
func shmAttached(dataDir string) bool {
	pid, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return false
	}
	lines := strings.Split(string(pid), "\n")
	if len(lines) < 7 {
		return false
	}
	f := strings.Fields(lines[6])
	if len(f) != 2 {
		return false
	}
	table, err := os.ReadFile("/proc/sysvipc/shm")
	if err != nil {
		return false
	}
	// "key shmid perms size cpid lpid nattch ..."
	for _, row := range strings.Split(string(table), "\n")[1:] {
		c := strings.Fields(row)
		if len(c) >= 7 && c[1] == f[1] {
			return c[6] != "0"
		}
	}
	return false
}

// Restart starts the postmaster again on the same data directory and port, after Kill
// or Stop, and waits until it accepts connections: it has replayed its write-ahead log
// by then.
func (s *Server) Restart() error {
	if s.cmd != nil {
		return errors.New("postgres is still running")
	}
	return s.start(60 * time.Second)
}

// Stop shuts the postmaster down fast (SIGINT: connections are ended, a checkpoint is
// written), or kills it when it takes more than 10 s.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-s.exited:
		// The postmaster waits for its children before it exits.
		s.cmd = nil
	case <-time.After(10 * time.Second):
		s.kill()
	}
}

// Remove stops the server and removes its directory.
func (s *Server) Remove() {
	s.Stop()
	_ = os.RemoveAll(s.Dir)
}

// NewDatabase creates an empty database on the server and returns its connection
// string.
func (s *Server) NewDatabase(ctx context.Context) (string, error) {
	name := fmt.Sprintf("db%d", s.dbs.Add(1))
	conn, err := pgx.Connect(ctx, s.DSN("postgres"))
	if err != nil {
		return "", fmt.Errorf("connecting to make a database: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("creating database %s: %w", name, err)
	}
	return s.DSN(name), nil
}

// freePort finds a free loopback port.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("finding a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// groupAlive says whether a process of group pgid still runs (a zombie does not).
func groupAlive(pgid int) bool {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return false
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 3 {
			continue
		}
		if g, _ := strconv.Atoi(f[2]); g == pgid && pid != 0 && f[0] != "Z" && f[0] != "X" {
			return true
		}
	}
	return false
}
