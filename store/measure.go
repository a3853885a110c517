package store

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The measurement helpers below serve the benchmark (make bench) and the demo's
// checks. They read whole keys or server-wide figures, so nothing on the grab path or
// in the controller calls them.

// KeyMemory is MEMORY USAGE of each key of an activity, with every element counted,
// in bytes; a key that does not exist counts 0.
type KeyMemory struct {
	Meta, Staging, Packets, Claims, Stream, DeadLetters int64
}

// KeyMemory measures the memory each of the activity's keys takes. It walks every
// element of every key, so it takes time proportional to the activity's size: a
// measurement helper, never to be called on a busy activity.
func (a *Shard) KeyMemory(ctx context.Context) (KeyMemory, error) {
	var m KeyMemory
	for _, k := range []struct {
		key string
		n   *int64
	}{
		{a.keys.Meta, &m.Meta}, {a.keys.Staging, &m.Staging}, {a.keys.Packets, &m.Packets},
		{a.keys.Claims, &m.Claims}, {a.keys.Stream, &m.Stream}, {a.keys.DeadLetters, &m.DeadLetters},
	} {
		n, err := a.c.MemoryUsage(ctx, k.key, 0).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return m, fmt.Errorf("MEMORY USAGE %s: %w", k.key, err)
		}
		*k.n = n
	}
	return m, nil
}

// UsedMemory is the server's used_memory (INFO memory), in bytes: a measurement
// helper. It first waits until no object is waiting to be freed in the background
// (lazyfree_pending_objects 0): keys deleted with UNLINK are freed by another thread,
// and memory they still hold would be counted against what is measured next.
func UsedMemory(ctx context.Context, c redis.Cmdable) (int64, error) {
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

// ServerVersion is the server's redis_version (INFO server): a measurement helper.
func ServerVersion(ctx context.Context, c redis.Cmdable) (string, error) {
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
