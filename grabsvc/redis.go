package grabsvc

import (
	"crypto/tls"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// The auto-pipeliner runs the grab script; lua.Script.Run needs a redis.Scripter.
var _ redis.Scripter = (*redis.AutoPipeliner)(nil)

// DefaultRedisTimeout bounds every Redis call of the grab path.
const DefaultRedisTimeout = 500 * time.Millisecond

// RedisClients are the grab service's connections to the activity's Redis.
type RedisClients struct {
	// Client is the plain client (standalone or cluster) with every socket timeout
	// set to the Redis deadline.
	Client redis.UniversalClient
	// Pipeliner batches concurrent callers' commands into pipelines; the grab script
	// and snapshots run through it.
	Pipeliner *redis.AutoPipeliner
}

// NewRedisClients opens the connection described by conn (the same addresses,
// mode, credentials and TLS as lua.Conn.NewClient) with dial, read, write and pool
// timeouts of timeout, at most one retry per command, and the client's automatic
// pipeliner. The auto-pipeliner does not honor per-command contexts once a command
// is queued, so the socket timeouts are what bound a call inside a batch; the
// Server adds its own deadline on top.
func NewRedisClients(conn lua.Conn, timeout time.Duration) (*RedisClients, error) {
	c, err := NewRedisClient(conn, timeout)
	if err != nil {
		return nil, err
	}
	ap, err := autoPipeline(c)
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	return &RedisClients{Client: c, Pipeliner: ap}, nil
}

// NewRedisClient opens a plain client for conn (as lua.Conn.NewClient does) whose
// every socket wait is bounded by timeout (0 means DefaultRedisTimeout) and which
// retries a failed command at most once. It speaks RESP2: the grab path uses no
// push notifications, and RESP2 spares every reply the check for them.
func NewRedisClient(conn lua.Conn, timeout time.Duration) (redis.UniversalClient, error) {
	if err := conn.Validate(); err != nil {
		return nil, err
	}
	if timeout <= 0 {
		timeout = DefaultRedisTimeout
	}
	var tc *tls.Config
	if conn.TLS {
		tc = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	if conn.Mode == lua.ModeCluster {
		return redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: conn.Addresses, Username: conn.Username, Password: conn.Password, TLSConfig: tc,
			DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout, PoolTimeout: timeout,
			MaxRetries: 1, ContextTimeoutEnabled: true, Protocol: 2,
		}), nil
	}
	return redis.NewClient(&redis.Options{
		Addr: conn.Addresses[0], Username: conn.Username, Password: conn.Password, TLSConfig: tc,
		DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout, PoolTimeout: timeout,
		MaxRetries: 1, ContextTimeoutEnabled: true, Protocol: 2,
	}), nil
}

// autoPipeline returns the client's blocking auto-pipeliner.
func autoPipeline(c redis.UniversalClient) (*redis.AutoPipeliner, error) {
	var (
		ap  *redis.AutoPipeliner
		err error
	)
	switch cc := c.(type) {
	case *redis.Client:
		ap, err = cc.AutoPipeline()
	case *redis.ClusterClient:
		ap, err = cc.AutoPipeline()
	default:
		return nil, fmt.Errorf("no auto-pipeliner for redis client of type %T", c)
	}
	if err != nil {
		return nil, fmt.Errorf("starting the redis auto-pipeliner: %w", err)
	}
	return ap, nil
}

// Close stops the pipeliner (flushing what it accepted) and closes the client.
func (r *RedisClients) Close() error {
	apErr := r.Pipeliner.Close()
	if err := r.Client.Close(); err != nil {
		return fmt.Errorf("closing redis client: %w", err)
	}
	if apErr != nil {
		return fmt.Errorf("closing redis auto-pipeliner: %w", apErr)
	}
	return nil
}
