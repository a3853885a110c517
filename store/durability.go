package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// masterOf is the plain client of the master that holds the slot of k's meta hash
// (every key of a shard shares it): c itself on a standalone server, the slot's
// master on a cluster.
func masterOf(ctx context.Context, c redis.Cmdable, k Keys) (*redis.Client, error) {
	return masterOfKey(ctx, c, k.Meta)
}

// masterOfKey is the plain client of the master that holds key's slot.
func masterOfKey(ctx context.Context, c redis.Cmdable, key string) (*redis.Client, error) {
	switch cc := c.(type) {
	case *redis.Client:
		return cc, nil
	case *redis.ClusterClient:
		m, err := cc.MasterForKey(ctx, key)
		if err != nil {
			return nil, fmt.Errorf("finding the master of the activity's slot: %w", err)
		}
		return m, nil
	}
	return nil, fmt.Errorf("a %T cannot name the activity's master", c)
}

// ErrDurabilityNotMet says that the Redis holding the activity cannot give the
// durability asked for.
var ErrDurabilityNotMet = errors.New("the activity's Redis does not give the durability asked for")

// CheckFsync checks that the master holding the activity runs with appendonly yes
// and appendfsync always, so that every grab is on disk before its answer leaves
// Redis. It wraps ErrDurabilityNotMet when it does not.
func (a *Shard) CheckFsync(ctx context.Context) error { return checkFsync(ctx, a.c, a.keys.Meta) }

// checkFsync checks the master of key's slot as CheckFsync does.
func checkFsync(ctx context.Context, c redis.Cmdable, key string) error {
	m, err := masterOfKey(ctx, c, key)
	if err != nil {
		return err
	}
	cfg, err := m.ConfigGet(ctx, "append*").Result()
	if err != nil {
		return fmt.Errorf("reading the persistence settings of %s (CONFIG GET): %w", m.Options().Addr, err)
	}
	if cfg["appendonly"] != "yes" || cfg["appendfsync"] != "always" {
		return fmt.Errorf("%w: %s runs with appendonly %q and appendfsync %q, durability Fsync needs yes and always",
			ErrDurabilityNotMet, m.Options().Addr, cfg["appendonly"], cfg["appendfsync"])
	}
	return nil
}

// CheckReplicas checks that the master holding the activity has at least n
// replicas connected. It wraps ErrDurabilityNotMet when it has fewer.
func (a *Shard) CheckReplicas(ctx context.Context, n int) error {
	return checkReplicas(ctx, a.c, a.keys.Meta, n)
}

// checkReplicas checks the master of key's slot as CheckReplicas does.
func checkReplicas(ctx context.Context, c redis.Cmdable, key string, n int) error {
	m, err := masterOfKey(ctx, c, key)
	if err != nil {
		return err
	}
	info, err := m.Info(ctx, "replication").Result()
	if err != nil {
		return fmt.Errorf("reading the replication state of %s: %w", m.Options().Addr, err)
	}
	connected := -1
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "connected_slaves:"); ok {
			connected, _ = strconv.Atoi(v)
		}
	}
	if connected < n {
		return fmt.Errorf("%w: %s has %d replicas connected, durability Replicas needs %d",
			ErrDurabilityNotMet, m.Options().Addr, max(connected, 0), n)
	}
	return nil
}

// DefaultReplicaTimeout is how long a wait for replicas may take when
// spec.durability.timeoutMilliseconds is not set.
const DefaultReplicaTimeout = 200 * time.Millisecond

// ErrNotReplicated says that a grant did not reach enough replicas in time. The
// grant stands in Redis; a retry returns it as already_claimed once it has.
var ErrNotReplicated = errors.New("the grant did not reach enough replicas in time")

// ReplicaWaiter holds grab answers until enough replicas have the grants, with one
// WAIT for many grabs, the way the auto-pipeliner batches the grabs themselves.
//
// A caller that got its grab's reply calls Wait. The waiter collects the callers
// that arrive while the previous WAIT is out, then sends, on one connection to the
// activity's master, a write to the meta hash (HINCRBY durable_seq) followed by
// WAIT replicas timeout. Redis replicates in one order, and that write comes after
// every grab whose reply its callers had already received, so a replica that
// acknowledged the write holds each of those grabs as well. WAIT answers how many
// replicas did; at least replicas releases the whole batch, fewer fails it with
// ErrNotReplicated.
type ReplicaWaiter struct {
	c        redis.Cmdable
	keys     Keys
	replicas int
	timeout  time.Duration

	mu      sync.Mutex
	pending []chan error
	running bool
	conn    *redis.Conn
	// own is a client of the waiter's own, opened when the master's client reads
	// with a deadline shorter than a WAIT may block.
	own *redis.Client
}

// ReplicaWaiter returns a waiter for the shard's master on the shard's client, which
// must be a plain or cluster client, never the auto-pipeliner: WAIT must follow the
// marker on the same connection.
func (a *Shard) ReplicaWaiter(replicas int, timeout time.Duration) *ReplicaWaiter {
	return &ReplicaWaiter{c: a.c, keys: a.keys, replicas: replicas, timeout: timeout}
}

// Wait returns nil once at least the waiter's number of replicas hold every grant
// whose reply the caller received before calling, ErrNotReplicated when they did
// not within the timeout, or another error when Redis failed.
func (w *ReplicaWaiter) Wait(ctx context.Context) error {
	done := make(chan error, 1)
	w.mu.Lock()
	w.pending = append(w.pending, done)
	if !w.running {
		w.running = true
		go w.loop()
	}
	w.mu.Unlock()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// loop sends one marker and WAIT per batch while callers keep arriving.
func (w *ReplicaWaiter) loop() {
	for {
		w.mu.Lock()
		batch := w.pending
		w.pending = nil
		if len(batch) == 0 {
			w.running = false
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
		err := w.waitOnce()
		for _, ch := range batch {
			ch <- err
		}
	}
}

// waitOnce writes the marker and waits for the replicas on the master's connection.
func (w *ReplicaWaiter) waitOnce() error {
	ctx, cancel := context.WithTimeout(context.Background(), w.timeout+5*time.Second)
	defer cancel()
	if w.conn == nil {
		m, err := masterOf(ctx, w.c, w.keys)
		if err != nil {
			return err
		}
		rt := m.Options().ReadTimeout
		if rt == 0 {
			rt = 3 * time.Second // go-redis's default
		}
		if rt > 0 && rt < w.timeout+time.Second {
			// The grab path's clients give up on a reply far sooner than a WAIT may
			// take: read the WAIT on a connection that waits long enough.
			opts := *m.Options()
			opts.ReadTimeout = w.timeout + 2*time.Second
			opts.PoolSize = 1
			if w.own != nil {
				_ = w.own.Close()
			}
			w.own = redis.NewClient(&opts)
			m = w.own
		}
		w.conn = m.Conn()
	}
	var acked *redis.Cmd
	_, err := w.conn.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.HIncrBy(ctx, w.keys.Meta, "durable_seq", 1)
		acked = p.Do(ctx, "WAIT", w.replicas, w.timeout.Milliseconds())
		return nil
	})
	if err != nil {
		// The connection may be gone (a restart, a failover): take a new one next time.
		_ = w.conn.Close()
		w.conn = nil
		return fmt.Errorf("waiting for %d replicas: %w", w.replicas, err)
	}
	n, err := acked.Int64()
	if err != nil {
		return fmt.Errorf("waiting for %d replicas: %w", w.replicas, err)
	}
	if n < int64(w.replicas) {
		return fmt.Errorf("%w: %d of %d replicas within %s", ErrNotReplicated, n, w.replicas, w.timeout)
	}
	return nil
}

// Close releases the waiter's connection once no WAIT is out.
func (w *ReplicaWaiter) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	var errs []error
	if !w.running && w.conn != nil {
		errs = append(errs, w.conn.Close())
		w.conn = nil
	}
	if !w.running && w.own != nil {
		errs = append(errs, w.own.Close())
		w.own = nil
	}
	return errors.Join(errs...)
}

// CheckFsync checks the master of every budget shard's slot as an activity's
// (Shard.CheckFsync); it wraps ErrDurabilityNotMet when one does not fsync every
// write.
func (b *Budget) CheckFsync(ctx context.Context) error {
	for i, k := range b.keys {
		if err := checkFsync(ctx, b.c, k.Meta); err != nil {
			return fmt.Errorf("budget shard %d: %w", i, err)
		}
	}
	return nil
}

// CheckReplicas checks that the master of every budget shard's slot has at least n
// replicas connected (Shard.CheckReplicas).
func (b *Budget) CheckReplicas(ctx context.Context, n int) error {
	for i, k := range b.keys {
		if err := checkReplicas(ctx, b.c, k.Meta, n); err != nil {
			return fmt.Errorf("budget shard %d: %w", i, err)
		}
	}
	return nil
}
