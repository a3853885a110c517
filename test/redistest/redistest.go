// Package redistest starts real redis-server processes on free loopback ports for
// tests: a standalone server or a Redis Cluster of several masters. A missing
// redis-server fails the test; it never skips.
//
// Every server it starts, standalone or in a cluster, is set up as the docs ask of a
// real Redis and as config/dev-redis runs (ACLArgs): the default user is off, so a
// connection that does not log in (or logs in as default) can run nothing, and an
// admin user (AdminUser, with a random password per server, one per cluster) holds
// every key and command, as the operator's own user does. Tests open their clients
// with the server's Options, Conn or Client, which log in as that user.
//
// A server or cluster a test starts (Start, StartProtected, StartCluster and the
// other cluster starters) is as the operator leaves a Redis it serves: the grab-side
// function library (lua.GrabLibrary) is loaded on every master, since an activity's
// grab calls are FCALLs of it. A test of a missing library runs FUNCTION FLUSH.
package redistest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/store/redisconn"
)

// AdminUser is the name of the admin user of every server this package starts: the
// user the operator would log in as. The default user is off on every server.
const AdminUser = "redpacket-operator"

// Server is one redis-server process.
type Server struct {
	// Addr is the server's 127.0.0.1:port.
	Addr string
	// Username and Password log in as the server's admin user (Username is
	// AdminUser); Password is random, made when the server first started, and a
	// restart (RestartProcess) keeps it.
	Username, Password string
	cmd                *exec.Cmd
	dir                string
}

// NewPassword is a random password for an admin user: 16 random bytes in hex.
func NewPassword() (string, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("making a Redis password: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// ACLArgs are the redis-server arguments that turn the default user off and create
// the admin user username with password, allowed every key, channel and command:
// what every server here, and config/dev-redis, runs with. redis-server reads each
// --user as one "user" line of its configuration, in order, and a "user default"
// line starts from a reset default user (no password, no permissions).
//
// The default user is off, so nobody can log in as it and a connection that has not
// logged in gets NOAUTH for every command; but it keeps every permission (~* &*
// +@all), which no client can use. Redis 7.0 replays an append-only file's
// transactions (MULTI/EXEC, the form in which it writes every script's and
// function's effects) as the default user and checks that user's permissions at
// EXEC: a default user without them makes a restart drop those writes, the grants
// among them, without an error (redis/redis#14541).
func ACLArgs(username, password string) []string {
	return []string{"--user", "default", "off", "~*", "&*", "+@all",
		"--user", username, "on", ">" + password, "~*", "&*", "+@all"}
}

// replicaAuthArgs make a replica log in to its master as the admin user, which the
// master requires like any client (its default user is off).
func replicaAuthArgs(username, password string) []string {
	return []string{"--masteruser", username, "--masterauth", password}
}

// skipInShortMode keeps `go test -short` (make test-unit) free of servers: a test
// that needs redis-server does not run there. The full suite runs without -short.
func skipInShortMode(tb testing.TB) {
	tb.Helper()
	if testing.Short() {
		tb.Skip("needs redis-server; run without -short")
	}
}

// Start runs a standalone redis-server for the test and stops it at cleanup.
func Start(tb testing.TB) *Server {
	tb.Helper()
	skipInShortMode(tb)
	return startLoaded(tb, "")
}

// startLoaded is Start with the admin user's password, or a random one when empty.
func startLoaded(tb testing.TB, password string) *Server {
	tb.Helper()
	if password == "" {
		var err error
		if password, err = NewPassword(); err != nil {
			tb.Fatal(err)
		}
	}
	s, err := startServer(tb.TempDir(), AdminUser, password)
	if err != nil {
		tb.Fatalf("starting redis-server: %v", err)
	}
	tb.Cleanup(s.Stop)
	if err := loadFunctions([]string{s.Addr}, s.Username, s.Password); err != nil {
		tb.Fatal(err)
	}
	return s
}

// Options are client options that reach the server as its admin user: the base of
// every client a test opens on it (set more fields on the copy it returns).
func (s *Server) Options() *redis.Options {
	return &redis.Options{Addr: s.Addr, Username: s.Username, Password: s.Password}
}

// Conn is the server as a standalone connection logged in as its admin user: what
// the operator's --redis-* flags would give for it.
func (s *Server) Conn() redisconn.Conn {
	return redisconn.Conn{Addresses: []string{s.Addr}, Mode: redisconn.ModeStandalone, Username: s.Username, Password: s.Password}
}

// AuthArgs are the command-line flags of the operator and the grab service that log
// them in as the server's admin user (--redis-username, --redis-password).
func (s *Server) AuthArgs() []string {
	return []string{"--redis-username", s.Username, "--redis-password", s.Password}
}

// AuthEnv is the environment that logs the operator, the grab service and kubectl-rpa
// in as the server's admin user (REDIS_USERNAME, REDIS_PASSWORD), as the install
// gives them from a Secret: for processes, whose arguments anyone on the machine
// can read.
func (s *Server) AuthEnv() []string {
	return []string{"REDIS_USERNAME=" + s.Username, "REDIS_PASSWORD=" + s.Password}
}

// Client opens a client to the server as its admin user, closed at the test's cleanup.
func (s *Server) Client(tb testing.TB) *redis.Client {
	c := redis.NewClient(s.Options())
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// Stop ends the server process and any child it forked (KillProcess).
func (s *Server) Stop() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = KillProcess(s.cmd)
		s.cmd = nil
	}
}

// StartProcess runs a standalone redis-server outside of any test (for TestMain,
// benchmarks and the demo), with the default user off and an admin user of its own
// (a random password). The caller stops it.
func StartProcess(dir string, extraArgs ...string) (*Server, error) {
	password, err := NewPassword()
	if err != nil {
		return nil, err
	}
	return startServer(dir, AdminUser, password, extraArgs...)
}

// StartProcessAs is StartProcess with the admin user's name and password given, for
// servers that must share them: the nodes of a cluster the caller forms itself, which
// one cluster client logs in to with one credential. The caller stops it.
func StartProcessAs(dir, username, password string, extraArgs ...string) (*Server, error) {
	if username == "" || password == "" {
		return nil, fmt.Errorf("starting redis-server: the admin user needs a name and a password")
	}
	return startServer(dir, username, password, extraArgs...)
}

// StartReplicaProcess runs a redis-server that replicates primary, reached at
// primaryAddr (primary's own address when empty, or a proxy in front of it), outside
// of any test. It has primary's admin user and password, as the nodes of one
// deployment do, so that a client keeps its credentials when a failover promotes the
// replica, and it logs in to its master as that user. The caller stops it.
func StartReplicaProcess(dir string, primary *Server, primaryAddr string, extraArgs ...string) (*Server, error) {
	if primaryAddr == "" {
		primaryAddr = primary.Addr
	}
	host, port, err := net.SplitHostPort(primaryAddr)
	if err != nil {
		return nil, fmt.Errorf("starting a replica: primary address %q: %w", primaryAddr, err)
	}
	args := append([]string{"--replicaof", host, port}, replicaAuthArgs(primary.Username, primary.Password)...)
	return startServer(dir, primary.Username, primary.Password, append(args, extraArgs...)...)
}

// startServer starts redis-server in dir on a free port, with the default user off
// and the admin user username with password, and waits until it answers that user.
func startServer(dir, username, password string, extraArgs ...string) (*Server, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server is not installed (apt-get install redis-server): %w", err)
	}
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		port, err := freePort(isCluster(extraArgs))
		if err != nil {
			return nil, err
		}
		args := append([]string{
			"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", dir, "--daemonize", "no", "--logfile", filepath.Join(dir, fmt.Sprintf("redis-%d.log", port)),
		}, ACLArgs(username, password)...)
		cmd := exec.Command(bin, append(args, extraArgs...)...)
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("starting %s: %w", bin, err)
		}
		s := &Server{Addr: "127.0.0.1:" + strconv.Itoa(port), Username: username, Password: password, cmd: cmd, dir: dir}
		if err := waitPing(s.Options(), 10*time.Second); err != nil {
			s.Stop()
			lastErr = err
			continue
		}
		return s, nil
	}
	return nil, fmt.Errorf("redis-server did not come up: %w", lastErr)
}

// Cluster is a Redis Cluster, each node a real redis-server in cluster mode: masters
// only (StartCluster), or masters with replicas (StartReplicatedCluster).
type Cluster struct {
	// Addrs are the nodes' addresses: the masters' in a cluster of masters only, every
	// node's (masters and replicas, as redis-cli assigned the roles) otherwise.
	Addrs []string
	// Username and Password log in as the admin user, the same on every node (one
	// random password per cluster), so that one client reaches every node and a
	// replica logs in to its master, before and after a failover, as that user.
	Username, Password string
	servers            []*Server
	args               []string // every node's redis-server arguments beyond the defaults
}

// StartCluster runs a cluster of n masters (n >= 3) for the test, with every slot
// assigned, and stops it at cleanup.
func StartCluster(tb testing.TB, n int) *Cluster {
	tb.Helper()
	skipInShortMode(tb)
	c, err := StartClusterProcess(tb.TempDir(), n)
	if err != nil {
		tb.Fatalf("starting redis cluster: %v", err)
	}
	tb.Cleanup(c.Stop)
	return c
}

// StartReplicatedCluster runs a cluster of masters (>= 3) with replicas replicas each
// for the test, with every slot assigned and every replica in sync with its master,
// and stops it at cleanup.
func StartReplicatedCluster(tb testing.TB, masters, replicas int) *Cluster {
	tb.Helper()
	skipInShortMode(tb)
	c, err := startCluster(tb.TempDir(), masters, replicas)
	if err != nil {
		tb.Fatalf("starting redis cluster: %v", err)
	}
	tb.Cleanup(c.Stop)
	return c
}

// StartClusterWith runs a cluster of n masters (n >= 3) whose nodes also get
// extraArgs (persistence settings, for one), and stops it at cleanup.
func StartClusterWith(tb testing.TB, n int, extraArgs ...string) *Cluster {
	tb.Helper()
	skipInShortMode(tb)
	c, err := startCluster(tb.TempDir(), n, 0, extraArgs...)
	if err != nil {
		tb.Fatalf("starting redis cluster: %v", err)
	}
	tb.Cleanup(c.Stop)
	return c
}

// StartClusterProcess runs a cluster of n masters outside of any test. The caller stops it.
func StartClusterProcess(dir string, n int) (*Cluster, error) {
	return startCluster(dir, n, 0)
}

// Kill ends node i with SIGKILL (Server.Kill); its files and port stay for Restart.
func (c *Cluster) Kill(i int) error { return c.servers[i].Kill() }

// Restart starts node i again on its files and port with the arguments it first had
// (its nodes.conf brings it back into the cluster as the master of its slots), and
// waits until the cluster answers on every node.
func (c *Cluster) Restart(i int) error {
	s := c.servers[i]
	ns, err := RestartProcess(s, c.args...)
	if err != nil {
		return err
	}
	c.servers[i] = ns
	return c.waitOK(time.Now().Add(30 * time.Second))
}

func startCluster(dir string, masters, replicas int, extraArgs ...string) (*Cluster, error) {
	n := masters * (1 + replicas)
	password, err := NewPassword()
	if err != nil {
		return nil, err
	}
	c := &Cluster{Username: AdminUser, Password: password}
	// Every node may become a replica (a failover demotes a master), so every node
	// knows how to log in to its master.
	c.args = append([]string{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
		"--cluster-node-timeout", "5000"}, replicaAuthArgs(c.Username, c.Password)...)
	c.args = append(c.args, extraArgs...)
	for i := 0; i < n; i++ {
		sub := filepath.Join(dir, fmt.Sprintf("node-%d", i))
		if err := os.MkdirAll(sub, 0o755); err != nil {
			c.Stop()
			return nil, err
		}
		s, err := startServer(sub, c.Username, c.Password, c.args...)
		if err != nil {
			c.Stop()
			return nil, err
		}
		c.servers = append(c.servers, s)
		c.Addrs = append(c.Addrs, s.Addr)
	}
	args := append([]string{"--cluster", "create"}, c.Addrs...)
	args = append(args, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	out, err := cliCommand(c.Username, c.Password, args...).CombinedOutput()
	if err != nil {
		c.Stop()
		return nil, fmt.Errorf("redis-cli --cluster create: %v: %s", err, out)
	}
	deadline := time.Now().Add(30 * time.Second)
	if err := c.waitOK(deadline); err != nil {
		c.Stop()
		return nil, err
	}
	if replicas > 0 {
		if err := c.listReplicas(deadline); err != nil {
			c.Stop()
			return nil, err
		}
	}
	if err := loadFunctions(c.Addrs, c.Username, c.Password); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

// loadFunctions loads the grab-side function library, as the admin user username
// with password, on every master among addrs (replicas get it by replication).
func loadFunctions(addrs []string, username, password string) error {
	for _, a := range addrs {
		role, err := redisCLI(a, username, password, "role")
		if err != nil {
			return fmt.Errorf("ROLE of %s: %v: %s", a, err, role)
		}
		if !strings.HasPrefix(role, "master") {
			continue
		}
		c := redis.NewClient(&redis.Options{Addr: a, Username: username, Password: password})
		_, err = lua.GrabLibrary.Load(context.Background(), c)
		_ = c.Close()
		if err != nil {
			return fmt.Errorf("loading the function library on %s: %w", a, err)
		}
	}
	return nil
}

// waitOK waits until every node says cluster_state:ok and every replica is in sync.
func (c *Cluster) waitOK(deadline time.Time) error {
	for _, a := range c.Addrs {
		for {
			info, err := c.cli(a, "cluster", "info")
			repl, rerr := c.cli(a, "info", "replication")
			synced := rerr == nil && (strings.Contains(repl, "role:master") || strings.Contains(repl, "master_link_status:up"))
			if err == nil && strings.Contains(info, "cluster_state:ok") && synced {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("cluster node %s not ok: %v %s", a, err, info)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return nil
}

// listReplicas makes every replica show in every node's slot map (CLUSTER SLOTS),
// which lists a replica only once it has received something from its master: each
// master replicates a FLUSHALL of its (empty) data set.
func (c *Cluster) listReplicas(deadline time.Time) error {
	for _, a := range c.Addrs {
		role, err := c.cli(a, "role")
		if err != nil {
			return fmt.Errorf("ROLE of %s: %v: %s", a, err, role)
		}
		if strings.HasPrefix(role, "master") {
			if out, err := c.cli(a, "flushall"); err != nil {
				return fmt.Errorf("FLUSHALL on %s: %v: %s", a, err, out)
			}
		}
	}
	// Each node learns the others' replication offsets through the cluster bus, so
	// each node's own slot map is waited for.
	for _, from := range c.Addrs {
		for {
			slots, err := c.cli(from, "cluster", "slots")
			listed := err == nil
			for _, a := range c.Addrs {
				_, port, _ := net.SplitHostPort(a)
				listed = listed && strings.Contains(slots, "\n"+port+"\n")
			}
			if listed {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("not every node shows in CLUSTER SLOTS of %s: %v %s", from, err, slots)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return nil
}

// Options are cluster client options that reach every node as the admin user: the
// base of every cluster client a test opens (set more fields on the copy it returns).
func (c *Cluster) Options() *redis.ClusterOptions {
	return &redis.ClusterOptions{Addrs: append([]string(nil), c.Addrs...), Username: c.Username, Password: c.Password}
}

// NodeOptions are client options that reach the one node at addr as the admin user.
func (c *Cluster) NodeOptions(addr string) *redis.Options {
	return &redis.Options{Addr: addr, Username: c.Username, Password: c.Password}
}

// Conn is the cluster as a connection in cluster mode logged in as the admin user,
// with every node's address as a seed: what the operator's --redis-* flags would give.
func (c *Cluster) Conn() redisconn.Conn {
	return redisconn.Conn{Addresses: append([]string(nil), c.Addrs...), Mode: redisconn.ModeCluster, Username: c.Username, Password: c.Password}
}

// Client opens a cluster client as the admin user, closed at the test's cleanup.
func (c *Cluster) Client(tb testing.TB) *redis.ClusterClient {
	cc := redis.NewClusterClient(c.Options())
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// Stop ends every node.
func (c *Cluster) Stop() {
	for _, s := range c.servers {
		s.Stop()
	}
}

// cliCommand is redis-cli with args, logged in as username with password: the
// password goes in REDISCLI_AUTH, not in its arguments, which anyone on the machine
// can read.
func cliCommand(username, password string, args ...string) *exec.Cmd {
	cmd := exec.Command("redis-cli", append([]string{"--user", username}, args...)...)
	cmd.Env = append(os.Environ(), "REDISCLI_AUTH="+password)
	return cmd
}

// redisCLI runs redis-cli against addr, logged in as username with password, and
// returns what it printed.
func redisCLI(addr, username, password string, args ...string) (string, error) {
	host, port, _ := net.SplitHostPort(addr)
	out, err := cliCommand(username, password, append([]string{"-h", host, "-p", port}, args...)...).CombinedOutput()
	return string(out), err
}

// cli is redisCLI as the cluster's admin user.
func (c *Cluster) cli(addr string, args ...string) (string, error) {
	return redisCLI(addr, c.Username, c.Password, args...)
}

// waitPing waits until the server of opt answers PING as opt's user.
func waitPing(opt *redis.Options, within time.Duration) error {
	o := *opt
	o.MaxRetries = -1
	addr := o.Addr
	c := redis.NewClient(&o)
	defer c.Close()
	deadline := time.Now().Add(within)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no PONG from %s: %w", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// freePort finds a free loopback port; for cluster nodes, one whose cluster bus port
// (port + 10000) is free as well.
func freePort(cluster bool) (int, error) {
	for i := 0; i < 100; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("finding a free port: %w", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		if !cluster {
			return port, nil
		}
		if port+10000 > 65535 {
			continue
		}
		bus, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+10000))
		if err != nil {
			continue
		}
		_ = bus.Close()
		return port, nil
	}
	return 0, fmt.Errorf("no free port pair for a cluster node")
}

func isCluster(args []string) bool {
	for _, a := range args {
		if a == "--cluster-enabled" {
			return true
		}
	}
	return false
}

// Context is the test's context with a deadline of two minutes, so that a wedged
// server fails the test instead of hanging it.
func Context(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// StartProtected is Start with the admin user's password chosen by the test rather
// than random (the default user is off, as on every server here): for tests that look
// for the operator's password where it must not be. It returns the server with a
// client logged in as the admin user.
func StartProtected(tb testing.TB, password string) (*Server, *redis.Client) {
	tb.Helper()
	skipInShortMode(tb)
	srv := startLoaded(tb, password)
	return srv, srv.Client(tb)
}
