package controllers

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store/redisconn"
)

// DefaultRedisIdleTimeout is how long a cached Redis client may go unused before it is
// closed.
const DefaultRedisIdleTimeout = 30 * time.Minute

// RedisClients caches one Redis client per connection target and credentials
// (redisconn.Conn.Key), so that reconciles share connection pools instead of dialling Redis
// every time. Clients unused for IdleTimeout are closed by the sweeper that Start runs;
// every client is closed when Start's context ends.
type RedisClients struct {
	// IdleTimeout is how long a client may go unused before it is closed; 0 means
	// DefaultRedisIdleTimeout.
	IdleTimeout time.Duration

	mu      sync.Mutex
	clients map[string]*cachedRedisClient
	now     func() time.Time
}

type cachedRedisClient struct {
	client   redis.UniversalClient
	lastUsed time.Time
}

// NewRedisClients returns an empty cache.
func NewRedisClients() *RedisClients {
	return &RedisClients{clients: map[string]*cachedRedisClient{}, now: time.Now}
}

// Get returns the cached client for conn, opening one with opts (at most one; none:
// go-redis's defaults) when there is none. Clients are cached by conn.Key() and by
// whether opts check addresses (DialCheck) and make errors safe (SafeErrors): a
// caller gives the same options for the same connection every time.
func (c *RedisClients) Get(conn redisconn.Conn, opts ...redisconn.ClientOptions) redis.UniversalClient {
	c.mu.Lock()
	defer c.mu.Unlock()
	var o redisconn.ClientOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	key := fmt.Sprintf("%s|checked=%t|safe=%t", conn.Key(), o.DialCheck != nil, o.SafeErrors)
	cached, ok := c.clients[key]
	if !ok {
		cached = &cachedRedisClient{client: conn.NewClient(o)}
		c.clients[key] = cached
	}
	cached.lastUsed = c.now()
	return cached.client
}

// Len is the number of cached clients.
func (c *RedisClients) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.clients)
}

// CloseIdle closes and forgets the clients unused for longer than the idle timeout.
func (c *RedisClients) CloseIdle() {
	idle := c.IdleTimeout
	if idle <= 0 {
		idle = DefaultRedisIdleTimeout
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	cutoff := c.now().Add(-idle)
	for key, cached := range c.clients {
		if cached.lastUsed.Before(cutoff) {
			_ = cached.client.Close()
			delete(c.clients, key)
		}
	}
}

// Close closes and forgets every client.
func (c *RedisClients) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for key, cached := range c.clients {
		_ = cached.client.Close()
		delete(c.clients, key)
	}
}

// Start sweeps idle clients until ctx ends, then closes every client. It makes the
// cache a manager.Runnable.
func (c *RedisClients) Start(ctx context.Context) error {
	idle := c.IdleTimeout
	if idle <= 0 {
		idle = DefaultRedisIdleTimeout
	}
	ticker := time.NewTicker(max(idle/4, time.Second))
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			c.Close()
			return nil
		case <-ticker.C:
			c.CloseIdle()
		}
	}
}

// NeedLeaderElection is false: followers keep their cache tidy too.
func (c *RedisClients) NeedLeaderElection() bool { return false }
