package redisconn_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// operatorPassword is the password of the Redis admin user in these tests.
const operatorPassword = "operator-secret-pw"

// fakeService listens on a loopback port and greets every connection with banner,
// then reads what the client sends until it hangs up. It counts the connections.
type fakeService struct {
	addr     string
	accepted atomic.Int64
}

func startFakeService(t *testing.T, banner string) *fakeService {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	f := &fakeService{addr: l.Addr().String()}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			f.accepted.Add(1)
			go func() {
				defer c.Close()
				if banner != "" {
					_, _ = c.Write([]byte(banner))
				}
				_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
				r := bufio.NewReader(c)
				for {
					if _, err := r.ReadString('\n'); err != nil {
						return
					}
				}
			}()
		}
	}()
	return f
}

// The text of an error of a SafeErrors client is a fixed phrase, never what the
// other side sent; the same failure without SafeErrors shows what it sent, so the
// phrase is what keeps it out.
func TestSafeErrorsSayWhatFailedWithoutEchoingTheServer(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	const secret = "OpenSSH_9.6-internal-host-7f3a"
	ssh := startFakeService(t, "SSH-2.0-"+secret+"\r\n")
	web := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Server", secret)
		_, _ = w.Write([]byte(secret))
	}))
	t.Cleanup(web.Close)
	silent := startFakeService(t, "")
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := closed.Addr().String()
	_ = closed.Close()
	srv, op := redistest.StartProtected(t, operatorPassword)
	if err := op.Do(ctx, "acl", "setuser", "pinger", "on", ">pinger-pw", "~*", "-@all", "+ping").Err(); err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		name       string
		conn       redisconn.Conn
		cmd        []any
		want       string
		rawHas     string // what the error says without SafeErrors
		wantIsType error
	}{
		{name: "an SSH server", conn: redisconn.Conn{Addresses: []string{ssh.addr}}, cmd: []any{"ping"},
			want: "not a Redis server", rawHas: secret},
		{name: "an HTTP server", conn: redisconn.Conn{Addresses: []string{strings.TrimPrefix(web.URL, "http://")}}, cmd: []any{"ping"},
			want: "not a Redis server", rawHas: "HTTP/1.1"},
		{name: "nobody listens", conn: redisconn.Conn{Addresses: []string{refused}}, cmd: []any{"ping"},
			want: "connection refused", rawHas: "connection refused"},
		{name: "an unresolvable host", conn: redisconn.Conn{Addresses: []string{"redis.invalid:6379"}}, cmd: []any{"ping"},
			want: "DNS lookup failed", rawHas: "lookup redis.invalid"},
		{name: "nothing answers", conn: redisconn.Conn{Addresses: []string{silent.addr}}, cmd: []any{"ping"},
			want: "timed out", rawHas: "timeout"},
		{name: "a wrong password", conn: redisconn.Conn{Addresses: []string{srv.Addr}, Username: srv.Username, Password: "wrong"}, cmd: []any{"ping"},
			want: "WRONGPASS authentication failed", rawHas: "WRONGPASS"},
		{name: "no password", conn: redisconn.Conn{Addresses: []string{srv.Addr}}, cmd: []any{"ping"},
			want: "NOAUTH authentication failed: a password is required", rawHas: "NOAUTH"},
		{name: "a command the ACL refuses", conn: redisconn.Conn{Addresses: []string{srv.Addr}, Username: "pinger", Password: "pinger-pw"},
			cmd: []any{"get", "k"}, want: "NOPERM permission denied by the Redis ACL", rawHas: "'get'"},
		{name: "an unknown command", conn: redisconn.Conn{Addresses: []string{srv.Addr}, Username: srv.Username, Password: operatorPassword},
			cmd: []any{"no-such-command", "x"}, want: "ERR Redis answered with an error", rawHas: "no-such-command"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.conn.Mode = redisconn.ModeStandalone
			opts := redisconn.ClientOptions{Timeout: 300 * time.Millisecond, MaxRetries: -1}
			raw := tc.conn.NewClient(opts)
			t.Cleanup(func() { _ = raw.Close() })
			rawErr := raw.Do(ctx, tc.cmd...).Err()
			if rawErr == nil || !strings.Contains(rawErr.Error(), tc.rawHas) {
				t.Fatalf("without SafeErrors: %v, want it to contain %q", rawErr, tc.rawHas)
			}

			opts.SafeErrors = true
			var logged string
			opts.ErrorLog = func(_ context.Context, command string, err error) { logged = command + ": " + err.Error() }
			safe := tc.conn.NewClient(opts)
			t.Cleanup(func() { _ = safe.Close() })
			err := safe.Do(ctx, tc.cmd...).Err()
			if err == nil || err.Error() != tc.want {
				t.Fatalf("with SafeErrors: %v, want %q", err, tc.want)
			}
			var se *redisconn.SafeError
			if !errors.As(err, &se) || !errors.Is(err, errors.Unwrap(se)) {
				t.Errorf("%T is not a SafeError wrapping the original", err)
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("the error echoes the server: %v", err)
			}
			if !strings.Contains(logged, tc.rawHas) {
				t.Errorf("ErrorLog got %q, want the original error with %q", logged, tc.rawHas)
			}
		})
	}
}

// The classifier names the cause of each kind of failure with one fixed phrase,
// whatever the error says and however it is wrapped. A lookup that times out is a
// DNS failure, not a Redis timeout.
func TestMakeSafeNamesTheCause(t *testing.T) {
	t.Parallel()
	const echoed = "banner-from-the-remote-end"
	dial := func(err error) error {
		return fmt.Errorf("reading the Redis clock: %w", &net.OpError{Op: "dial", Net: "tcp", Err: err})
	}
	cases := []struct {
		name string
		err  error
		want string
	}{
		{"name does not resolve", dial(&net.DNSError{Err: "no such host " + echoed, Name: "redis.invalid", IsNotFound: true}), "DNS lookup failed"},
		{"lookup timed out", dial(&net.DNSError{Err: "i/o timeout", Name: "redis.svc", Server: "10.0.0.10:53", IsTimeout: true}), "DNS lookup failed"},
		{"lookup temporary failure", dial(&net.DNSError{Err: "server misbehaving", Name: "redis.svc", IsTemporary: true}), "DNS lookup failed"},
		{"refused", dial(os.NewSyscallError("connect", syscall.ECONNREFUSED)), "connection refused"},
		{"deadline", fmt.Errorf("reading the Redis clock: %w", context.DeadlineExceeded), "timed out"},
		{"read timeout", &net.OpError{Op: "read", Net: "tcp", Err: timeoutError{}}, "timed out"},
		{"TLS record", dial(tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake " + echoed}), "TLS handshake failed"},
		{"TLS unknown authority", dial(x509.UnknownAuthorityError{}), "TLS handshake failed"},
		{"wrong password", redisReply("WRONGPASS invalid username-password pair or user is disabled " + echoed), "WRONGPASS authentication failed"},
		{"old server password", redisReply("ERR invalid password " + echoed), "authentication failed"},
		{"ACL", redisReply("NOPERM User app has no permissions to run the 'get' command " + echoed), "NOPERM permission denied by the Redis ACL"},
		{"unreachable", dial(os.NewSyscallError("connect", syscall.EHOSTUNREACH)), "host unreachable"},
	}
	for _, tc := range cases {
		got := redisconn.MakeSafe(tc.err)
		if got.Error() != tc.want {
			t.Errorf("%s: %q, want %q (from %v)", tc.name, got.Error(), tc.want, tc.err)
		}
		if strings.Contains(got.Error(), echoed) {
			t.Errorf("%s: the phrase echoes the remote end: %q", tc.name, got.Error())
		}
		if !errors.Is(got, tc.err) {
			t.Errorf("%s: the original error is not reachable", tc.name)
		}
	}
}

// timeoutError is a net.Error that timed out.
type timeoutError struct{}

func (timeoutError) Error() string   { return "i/o timeout" }
func (timeoutError) Timeout() bool   { return true }
func (timeoutError) Temporary() bool { return true }

// redisReply is an error reply as go-redis reports it (redis.Error).
type redisReply string

func (e redisReply) Error() string { return string(e) }
func (redisReply) RedisError()     {}

// A cluster client with SafeErrors still follows MOVED: the redirect is read from
// the original error.
func TestSafeErrorsFollowClusterRedirects(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	cluster := redistest.StartCluster(t, 3)
	c := redisconn.Conn{Addresses: cluster.Addrs[:1], Mode: redisconn.ModeCluster, Username: cluster.Username, Password: cluster.Password}.NewClient(redisconn.ClientOptions{SafeErrors: true})
	t.Cleanup(func() { _ = c.Close() })
	cc := c.(*redis.ClusterClient)
	if err := cc.Set(ctx, "warm-up", "1", 0).Err(); err != nil { // loads the slot map
		t.Fatal(err)
	}
	const key = "moved-key"
	slot, err := cc.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	source, err := cc.MasterForKey(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	sourceID := source.Do(ctx, "cluster", "myid").Val()
	var target *redis.Client
	var targetID string
	for _, addr := range cluster.Addrs {
		n := redis.NewClient(cluster.NodeOptions(addr))
		t.Cleanup(func() { _ = n.Close() })
		if id := n.Do(ctx, "cluster", "myid").Val(); id != sourceID && target == nil {
			target, targetID = n, id.(string)
		}
	}
	// Move the (empty) slot behind the client's back.
	for _, n := range []*redis.Client{target, source} {
		if err := n.Do(ctx, "cluster", "setslot", slot, "node", targetID).Err(); err != nil {
			t.Fatalf("CLUSTER SETSLOT on %s: %v", n.Options().Addr, err)
		}
	}
	if err := cc.Set(ctx, key, "here", 0).Err(); err != nil {
		t.Fatalf("SET after the slot moved: %v", err)
	}
	if got := target.Get(ctx, key).Val(); got != "here" {
		t.Fatalf("the key on the slot's new owner: %q", got)
	}
}

// A DialCheck refuses an address before any connection is made, also for the nodes
// a cluster announces.
func TestDialCheckRefusesBeforeConnecting(t *testing.T) {
	t.Parallel()
	ctx := redistest.Context(t)
	svc := startFakeService(t, "+PONG\r\n")
	refuse := func(string) error { return errors.New("not on the list") }
	c := redisconn.Conn{Addresses: []string{svc.addr}, Mode: redisconn.ModeStandalone}.
		NewClient(redisconn.ClientOptions{DialCheck: refuse, SafeErrors: true, MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	err := c.Ping(ctx).Err()
	if !errors.Is(err, redisconn.ErrAddressNotAllowed) || err.Error() != "the address is not allowed by the operator" {
		t.Fatalf("ping through a refusing DialCheck: %v", err)
	}
	if n := svc.accepted.Load(); n != 0 {
		t.Fatalf("%d connections reached the refused address", n)
	}

	cluster := redistest.StartCluster(t, 3)
	seed := cluster.Addrs[0]
	var asked atomic.Int64
	onlySeed := func(addr string) error {
		asked.Add(1)
		if addr != seed {
			return errors.New("only the seed node is allowed")
		}
		return nil
	}
	cc := redisconn.Conn{Addresses: []string{seed}, Mode: redisconn.ModeCluster, Username: cluster.Username, Password: cluster.Password}.NewClient(redisconn.ClientOptions{DialCheck: onlySeed, MaxRetries: -1})
	t.Cleanup(func() { _ = cc.Close() })
	var refusedNodes int
	for i := range 30 {
		key := "k" + strings.Repeat("x", i)
		if err := cc.Set(ctx, key, "v", 0).Err(); errors.Is(err, redisconn.ErrAddressNotAllowed) {
			refusedNodes++
		} else if err != nil {
			t.Fatalf("SET %s: %v", key, err)
		}
	}
	if refusedNodes == 0 || asked.Load() == 0 {
		t.Fatalf("no command reached a node other than the seed through the check (%d refused, %d asked)", refusedNodes, asked.Load())
	}
}
