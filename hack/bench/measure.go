package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"redpacket.io/operator/store"
)

// The measurement helpers below read whole keys or server-wide figures with raw
// Redis commands (MEMORY USAGE, INFO): they serve the benchmark only, never the
// store.

// keyMemory is MEMORY USAGE of each key of an activity, with every element counted,
// in bytes; a key that does not exist counts 0.
type keyMemory struct {
	Meta, Staging, Packets, Claims, Stream, DeadLetters int64
}

// measureKeys measures the memory each key of shard s of an activity takes, on c. It
// walks every element of every key, so it takes time proportional to the activity's
// size: never to be called on a busy activity.
func measureKeys(ctx context.Context, c redis.Cmdable, s *store.Shard) (keyMemory, error) {
	k := s.Keys()
	var m keyMemory
	for _, key := range []struct {
		key string
		n   *int64
	}{
		{k.Meta, &m.Meta}, {k.Staging, &m.Staging}, {k.Packets, &m.Packets},
		{k.Claims, &m.Claims}, {k.Stream, &m.Stream}, {k.DeadLetters, &m.DeadLetters},
	} {
		n, err := c.MemoryUsage(ctx, key.key, 0).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return m, fmt.Errorf("MEMORY USAGE %s: %w", key.key, err)
		}
		*key.n = n
	}
	return m, nil
}

// usedMemory is the server's used_memory (INFO memory), in bytes. It first waits until no object is waiting to be freed in the background
// (lazyfree_pending_objects 0): keys deleted with UNLINK are freed by another thread,
// and memory they still hold would be counted against what is measured next.
func usedMemory(ctx context.Context, c redis.Cmdable) (int64, error) {
	for {
		pending, err := infoField(ctx, c, "memory", "lazyfree_pending_objects")
		if err != nil || pending == "0" {
			break
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	v, err := infoField(ctx, c, "memory", "used_memory")
	if err != nil {
		return 0, err
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parsing used_memory %q: %w", v, err)
	}
	return n, nil
}

// serverVersion is the server's redis_version (INFO server).
func serverVersion(ctx context.Context, c redis.Cmdable) (string, error) {
	return infoField(ctx, c, "server", "redis_version")
}

// infoField reads one field of an INFO section.
func infoField(ctx context.Context, c redis.Cmdable, section, field string) (string, error) {
	info, err := c.Info(ctx, section).Result()
	if err != nil {
		return "", fmt.Errorf("INFO %s: %w", section, err)
	}
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), field+":"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("INFO %s has no %s", section, field)
}
