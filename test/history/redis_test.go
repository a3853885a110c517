package history

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// adminPassword is the password of the admin user (redistest.AdminUser) of every
// redis-server the history tests start, made at random once per test binary. Each
// server has the default user off, as redistest's do; one password for all of them
// lets the harness's parts, which reach a server through proxies by address, log in
// with adminConn or adminOptions of whichever address they dial.
var adminPassword = func() string {
	p, err := redistest.NewPassword()
	if err != nil {
		panic(err)
	}
	return p
}()

// adminConn is a standalone connection to addr (a server of the harness, or a proxy
// in front of one) as the admin user.
func adminConn(addr string) redisconn.Conn {
	return redisconn.Conn{Addresses: []string{addr}, Mode: redisconn.ModeStandalone, Username: redistest.AdminUser, Password: adminPassword}
}

// adminOptions are client options that reach addr as the admin user.
func adminOptions(addr string) *redis.Options {
	return &redis.Options{Addr: addr, Username: redistest.AdminUser, Password: adminPassword}
}

// redisProc is a redis-server with an append-only file fsynced on every write
// (appendfsync always) that a fault can kill and restart on the same port: what it
// acknowledged must survive.
type redisProc struct {
	Addr string
	dir  string
	port int

	mu  sync.Mutex
	cmd *exec.Cmd
}

// Options are client options that reach the server as its admin user.
func (r *redisProc) Options() *redis.Options { return adminOptions(r.Addr) }

func startRedis(t *testing.T) *redisProc {
	t.Helper()
	if testing.Short() {
		t.Skip("needs redis-server; run without -short")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	r := &redisProc{Addr: "127.0.0.1:" + strconv.Itoa(port), dir: t.TempDir(), port: port}
	if err := r.start(); err != nil {
		t.Fatalf("starting redis-server: %v", err)
	}
	t.Cleanup(r.kill)
	// Durable mode: every acknowledged write is on disk before its reply, so a
	// SIGKILL loses none, and acknowledged-grants-lost must be 0.
	c := redis.NewClient(r.Options())
	defer func() { _ = c.Close() }()
	for param, want := range map[string]string{"appendonly": "yes", "appendfsync": "always"} {
		got, err := c.ConfigGet(context.Background(), param).Result()
		if err != nil || got[param] != want {
			t.Fatalf("redis-server %s = %q (%v), want %q", param, got[param], err, want)
		}
	}
	return r
}

func (r *redisProc) start() error {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return fmt.Errorf("redis-server is not installed: %w", err)
	}
	args := append([]string{"--port", strconv.Itoa(r.port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "yes", "--appendfsync", "always", "--dir", r.dir, "--daemonize", "no",
		"--logfile", filepath.Join(r.dir, "redis.log")}, redistest.ACLArgs(redistest.AdminUser, adminPassword)...)
	cmd := exec.Command(bin, args...)
	if err := cmd.Start(); err != nil {
		return err
	}
	r.mu.Lock()
	r.cmd = cmd
	r.mu.Unlock()
	opt := r.Options()
	opt.MaxRetries = -1
	c := redis.NewClient(opt)
	defer func() { _ = c.Close() }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redis-server on %s does not answer: %w", r.Addr, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// kill ends the server with SIGKILL, as a crash would, and any child it forked
// (redistest.KillProcess).
func (r *redisProc) kill() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cmd != nil {
		_ = redistest.KillProcess(r.cmd)
		r.cmd = nil
	}
}

// restart kills the server and starts it again on the same port from its AOF.
func (r *redisProc) restart() error {
	r.kill()
	return r.start()
}
