package redisconn

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Redis modes a connection can use.
const (
	ModeStandalone = "standalone"
	ModeCluster    = "cluster"
)

// The keys of a connection Secret (the one spec.redis.secretRef names), which the
// grab service's REDIS_* environment variables mirror.
const (
	SecretAddresses = "addresses"
	SecretMode      = "mode"
	SecretUsername  = "username"
	SecretPassword  = "password"
	SecretTLS       = "tls"
)

// Conn says how to reach one Redis deployment.
type Conn struct {
	// Addresses are host:port pairs: one for standalone, any seed nodes for cluster.
	Addresses []string
	// Mode is ModeStandalone or ModeCluster.
	Mode     string
	Username string
	Password string
	TLS      bool
}

// ParseAddresses splits a comma-separated list of host:port addresses, trimming
// spaces and dropping empty items. Every reader of an address list (the connection
// Secret, the operator's flags, the grab service's) splits it here.
func ParseAddresses(s string) []string {
	var out []string
	for _, a := range strings.Split(s, ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}

// ConnFromSecret reads a connection from a Secret's data with the keys addresses
// (comma-separated host:port), mode, username, password and tls ("true"). It is the
// one parser of that format: the grab service, whose environment mirrors the
// Secret's keys, parses its flags through it too.
func ConnFromSecret(data map[string][]byte) (Conn, error) {
	c := Conn{
		Addresses: ParseAddresses(string(data[SecretAddresses])),
		Mode:      strings.TrimSpace(string(data[SecretMode])),
		Username:  string(data[SecretUsername]),
		Password:  string(data[SecretPassword]),
		TLS:       TLSEnabled(string(data[SecretTLS])),
	}
	if c.Mode == "" {
		c.Mode = ModeStandalone
	}
	return c, c.Validate()
}

// Validate reports what makes the connection unusable, if anything.
func (c Conn) Validate() error {
	if len(c.Addresses) == 0 {
		return fmt.Errorf("redis connection: no addresses")
	}
	switch c.Mode {
	case ModeStandalone:
		if len(c.Addresses) != 1 {
			return fmt.Errorf("redis connection: standalone mode takes one address, got %d", len(c.Addresses))
		}
	case ModeCluster:
	default:
		return fmt.Errorf("redis connection: mode %q is neither %s nor %s", c.Mode, ModeStandalone, ModeCluster)
	}
	return nil
}

// Key identifies the connection's target and credentials, for caching clients.
func (c Conn) Key() string {
	return fmt.Sprintf("%s|%s|%s|%s|%t", c.Mode, strings.Join(c.Addresses, ","), c.Username, c.Password, c.TLS)
}

// ClientOptions tune a client opened by Conn.NewClient. The zero value keeps
// go-redis's defaults, which is what the controller and the settlement workers use.
type ClientOptions struct {
	// Timeout, when positive, bounds every dial, read, write and connection-pool
	// wait, and makes the client honour context deadlines. 0 keeps the defaults.
	Timeout time.Duration
	// MaxRetries is how often a failed command is retried: 0 keeps go-redis's
	// default (3), -1 retries never.
	MaxRetries int
	// RESP2 speaks protocol version 2 instead of 3.
	RESP2 bool
	// PoolSize is the number of connections per node; 0 keeps the default (10 per CPU).
	PoolSize int
	// DialCheck, when set, is asked before every connection the client opens (to
	// the addresses given and, in cluster mode, to every node the cluster announces
	// or redirects to); an error refuses the connection without attempting it, and
	// the command fails with an error wrapping ErrAddressNotAllowed.
	DialCheck func(addr string) error
	// SafeErrors makes every command error a *SafeError, whose text is a fixed
	// phrase without a byte of what the server sent (see MakeSafe): for errors that
	// end up in a resource's status and events.
	SafeErrors bool
	// ErrorLog, with SafeErrors, receives every failed command's name and its error
	// as it was before it was made safe, for the operator's log.
	ErrorLog func(ctx context.Context, command string, err error)
}

// GrabClientOptions are the grab path's options: every socket wait bounded by
// timeout, context deadlines honoured, at most one retry per command, and RESP2: the
// grab path uses no push notifications, and RESP2 spares every reply the check for
// them. The grab service, its tests and the benchmark open their clients with them.
func GrabClientOptions(timeout time.Duration) ClientOptions {
	return ClientOptions{Timeout: timeout, MaxRetries: 1, RESP2: true}
}

// NewClient opens a client for the connection: a cluster client in cluster mode,
// else a plain client. It takes at most one ClientOptions; without, go-redis's
// defaults apply. The connection must be valid (Validate).
func (c Conn) NewClient(opts ...ClientOptions) redis.UniversalClient {
	var o ClientOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	var tc *tls.Config
	if c.TLS {
		tc = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	protocol := 0 // go-redis's default, RESP3
	if o.RESP2 {
		protocol = 2
	}
	timeout := max(o.Timeout, 0)
	dialer := checkedDialer(o.DialCheck, timeout, tc)
	if c.Mode == ModeCluster {
		cc := redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: c.Addresses, Username: c.Username, Password: c.Password, TLSConfig: tc,
			DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout, PoolTimeout: timeout,
			ContextTimeoutEnabled: timeout > 0, MaxRetries: o.MaxRetries, Protocol: protocol,
			PoolSize: o.PoolSize, Dialer: dialer,
			NewClient: func(opt *redis.Options) *redis.Client {
				node := redis.NewClient(opt)
				if o.SafeErrors {
					node.AddHook(safeErrorsHook{log: o.ErrorLog})
				}
				return node
			},
		})
		if o.SafeErrors {
			cc.AddHook(safeErrorsHook{log: o.ErrorLog})
		}
		return cc
	}
	rc := redis.NewClient(&redis.Options{
		Addr: c.Addresses[0], Username: c.Username, Password: c.Password, TLSConfig: tc,
		DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout, PoolTimeout: timeout,
		ContextTimeoutEnabled: timeout > 0, MaxRetries: o.MaxRetries, Protocol: protocol,
		PoolSize: o.PoolSize, Dialer: dialer,
	})
	if o.SafeErrors {
		rc.AddHook(safeErrorsHook{log: o.ErrorLog})
	}
	return rc
}

// defaultDialTimeout is go-redis's dial timeout, which checkedDialer uses when the
// options set none.
const defaultDialTimeout = 5 * time.Second

// checkedDialer is a dialer that asks check before every connection, or nil (the
// go-redis default dialer) when check is nil. It dials as go-redis's own does: TCP
// with keep-alive, and TLS with tc when tc is set.
func checkedDialer(check func(addr string) error, timeout time.Duration, tc *tls.Config) func(ctx context.Context, network, addr string) (net.Conn, error) {
	if check == nil {
		return nil
	}
	if timeout <= 0 {
		timeout = defaultDialTimeout
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		if err := check(addr); err != nil {
			return nil, fmt.Errorf("dialing %s: %w: %w", addr, ErrAddressNotAllowed, err)
		}
		nd := &net.Dialer{Timeout: timeout, KeepAlive: 30 * time.Second}
		if tc == nil {
			return nd.DialContext(ctx, network, addr)
		}
		return (&tls.Dialer{NetDialer: nd, Config: tc}).DialContext(ctx, network, addr)
	}
}

// The auto-pipeliner runs scripts and plain commands alike: an activity's handle
// can be built on it.
var _ redis.Cmdable = (*redis.AutoPipeliner)(nil)

// PipelinedClient is a client and its automatic pipeliner, which batches concurrent
// callers' commands into pipelines: the grab path's connection.
type PipelinedClient struct {
	// Client is the plain client (standalone or cluster).
	Client redis.UniversalClient
	// Pipeliner batches concurrent callers' commands; the grab script and snapshots
	// run through it.
	Pipeliner *redis.AutoPipeliner
}

// NewPipelinedClient validates the connection and opens a client with options o and
// its blocking auto-pipeliner. The auto-pipeliner does not honour per-command
// contexts once a command is queued, so o.Timeout (the socket timeouts) is what
// bounds a call inside a batch; callers add their own deadline on top.
func (c Conn) NewPipelinedClient(o ClientOptions) (*PipelinedClient, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	rc := c.NewClient(o)
	var (
		ap  *redis.AutoPipeliner
		err error
	)
	switch cc := rc.(type) {
	case *redis.Client:
		ap, err = cc.AutoPipelineWithOptions(GrabPipelineOptions())
	case *redis.ClusterClient:
		ap, err = cc.AutoPipelineWithOptions(GrabPipelineOptions())
	default:
		err = fmt.Errorf("no auto-pipeliner for redis client of type %T", rc)
	}
	if err != nil {
		_ = rc.Close()
		return nil, fmt.Errorf("starting the redis auto-pipeliner: %w", err)
	}
	return &PipelinedClient{Client: rc, Pipeliner: ap}, nil
}

// grabPipelineFlushDelay is how long the auto-pipeliner's writer may wait for a
// batch to grow once enough commands are in flight: go-redis arms the wait only above
// a depth of 1/512 of the window (grabPipelineWindow), and never below 64, so a lightly
// loaded service never waits.
const grabPipelineFlushDelay = 100 * time.Microsecond

// grabPipelineWindow is the most grabs one connection has in flight (more wait to be
// written). It is go-redis's default of 65,536 divided by 8, which lowers the depth at
// which the writer waits for larger batches from 128 to 64 in flight.
const grabPipelineWindow = 8192

// GrabPipelineOptions are the auto-pipeliner's options on the grab path: go-redis's
// blocking defaults (one ordered stream, batches of up to 300 commands), full duplex
// (one held connection per Redis node, its writer and reader streaming, so a batch
// is written while the replies of the one before are read) and a short wait for
// larger batches under load. On two shared cores they raised the claim path's
// throughput over the half-duplex defaults by 10-23 % in make bench runs (the two
// "(b) ... auto-pipelining" rows of docs/benchmarks.md) and by 30-40 % in
// BenchmarkClaimPath with 256 callers. On
// the HTTP path (BenchmarkHTTPClaim with 64 and 256 clients) the smaller window did
// as well as a half-duplex pipeliner with the same wait, which had been 5-12 %
// ahead of full duplex with go-redis's default window.
// As on the half-duplex path, a command that a broken connection left unanswered
// may be run again (MaxRetries): the grab script answers a repeat with the user's
// packet, and a transfer is journalled under its ID, so a second run changes nothing.
func GrabPipelineOptions() *redis.AutoPipelineOptions {
	o := redis.DefaultBlockingAutoPipelineOptions()
	o.FullDuplex = true
	o.MaxFlushDelay = grabPipelineFlushDelay
	o.FullDuplexWindow = grabPipelineWindow
	return o
}

// Close stops the pipeliner (flushing what it accepted) and closes the client.
func (p *PipelinedClient) Close() error {
	apErr := p.Pipeliner.Close()
	if err := p.Client.Close(); err != nil {
		return fmt.Errorf("closing redis client: %w", err)
	}
	if apErr != nil {
		return fmt.Errorf("closing redis auto-pipeliner: %w", apErr)
	}
	return nil
}

// TLSEnabled reads a connection's tls value ("true", surrounding white space
// ignored: a Secret written with echo carries a newline). Everything that reads it,
// the controller from a Secret and the grab service from its environment, reads it
// here, so one value never means TLS to one of them and plaintext to the other.
func TLSEnabled(v string) bool { return strings.TrimSpace(v) == "true" }
