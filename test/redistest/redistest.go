// Package redistest starts real redis-server processes on free loopback ports for
// tests: a standalone server or a Redis Cluster of several masters. A missing
// redis-server fails the test; it never skips.
//
// A server or cluster a test starts (Start, StartProtected, StartCluster and the
// other cluster starters) is as the operator leaves a Redis it serves: the grab-side
// function library (lua.GrabLibrary) is loaded on every master, since an activity's
// grab calls are FCALLs of it. A test of a missing library runs FUNCTION FLUSH.
package redistest

import (
	"context"
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
)

// Server is one redis-server process.
type Server struct {
	// Addr is the server's 127.0.0.1:port.
	Addr string
	cmd  *exec.Cmd
	dir  string
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
	s, err := startServer(tb.TempDir())
	if err != nil {
		tb.Fatalf("starting redis-server: %v", err)
	}
	tb.Cleanup(s.Stop)
	if err := loadFunctions([]string{s.Addr}); err != nil {
		tb.Fatal(err)
	}
	return s
}

// Client opens a client to the server, closed at the test's cleanup.
func (s *Server) Client(tb testing.TB) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
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
// benchmarks and the demo). The caller stops it.
func StartProcess(dir string, extraArgs ...string) (*Server, error) {
	return startServer(dir, extraArgs...)
}

func startServer(dir string, extraArgs ...string) (*Server, error) {
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
		}, extraArgs...)
		cmd := exec.Command(bin, args...)
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("starting %s: %w", bin, err)
		}
		s := &Server{Addr: "127.0.0.1:" + strconv.Itoa(port), cmd: cmd, dir: dir}
		if err := waitPing(s.Addr, 10*time.Second); err != nil {
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
	Addrs   []string
	servers []*Server
	args    []string // every node's redis-server arguments beyond the defaults
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
	ns, err := RestartProcess(s.dir, s.Addr, c.args...)
	if err != nil {
		return err
	}
	c.servers[i] = ns
	return c.waitOK(time.Now().Add(30 * time.Second))
}

func startCluster(dir string, masters, replicas int, extraArgs ...string) (*Cluster, error) {
	n := masters * (1 + replicas)
	c := &Cluster{args: append([]string{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
		"--cluster-node-timeout", "5000"}, extraArgs...)}
	for i := 0; i < n; i++ {
		sub := filepath.Join(dir, fmt.Sprintf("node-%d", i))
		if err := os.MkdirAll(sub, 0o755); err != nil {
			c.Stop()
			return nil, err
		}
		s, err := startServer(sub, c.args...)
		if err != nil {
			c.Stop()
			return nil, err
		}
		c.servers = append(c.servers, s)
		c.Addrs = append(c.Addrs, s.Addr)
	}
	args := append([]string{"--cluster", "create"}, c.Addrs...)
	args = append(args, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	out, err := exec.Command("redis-cli", args...).CombinedOutput()
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
	if err := loadFunctions(c.Addrs); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

// loadFunctions loads the grab-side function library on every master among addrs
// (replicas get it by replication).
func loadFunctions(addrs []string) error {
	for _, a := range addrs {
		role, err := redisCLI(a, "role")
		if err != nil {
			return fmt.Errorf("ROLE of %s: %v: %s", a, err, role)
		}
		if !strings.HasPrefix(role, "master") {
			continue
		}
		c := redis.NewClient(&redis.Options{Addr: a})
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
			info, err := redisCLI(a, "cluster", "info")
			repl, rerr := redisCLI(a, "info", "replication")
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
		role, err := redisCLI(a, "role")
		if err != nil {
			return fmt.Errorf("ROLE of %s: %v: %s", a, err, role)
		}
		if strings.HasPrefix(role, "master") {
			if out, err := redisCLI(a, "flushall"); err != nil {
				return fmt.Errorf("FLUSHALL on %s: %v: %s", a, err, out)
			}
		}
	}
	// Each node learns the others' replication offsets through the cluster bus, so
	// each node's own slot map is waited for.
	for _, from := range c.Addrs {
		for {
			slots, err := redisCLI(from, "cluster", "slots")
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

// Client opens a cluster client, closed at the test's cleanup.
func (c *Cluster) Client(tb testing.TB) *redis.ClusterClient {
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs})
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// Stop ends every node.
func (c *Cluster) Stop() {
	for _, s := range c.servers {
		s.Stop()
	}
}

func redisCLI(addr string, args ...string) (string, error) {
	host, port, _ := net.SplitHostPort(addr)
	out, err := exec.Command("redis-cli", append([]string{"-h", host, "-p", port}, args...)...).CombinedOutput()
	return string(out), err
}

func waitPing(addr string, within time.Duration) error {
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
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

// StartProtected starts a redis-server whose default user needs password, and
// returns it with a client logged in as that user.
func StartProtected(tb testing.TB, password string) (*Server, *redis.Client) {
	tb.Helper()
	srv := Start(tb)
	if err := srv.Client(tb).ConfigSet(context.Background(), "requirepass", password).Err(); err != nil {
		tb.Fatalf("setting the default user's password: %v", err)
	}
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, Password: password})
	tb.Cleanup(func() { _ = c.Close() })
	return srv, c
}
