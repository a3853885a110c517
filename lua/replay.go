package lua

import (
	"context"
	_ "embed"
	"fmt"

	"github.com/redis/go-redis/v9"
)

//go:embed replay_dead.lua
var replayDeadSrc string

// ReplayDeadScript moves dead-lettered entries back into the settlement stream.
var ReplayDeadScript = newScript("replay_dead", replayDeadSrc)

// ReplayDead moves up to limit (>= 1) of the oldest dead-lettered entries back into the
// activity's stream as new entries, deletes them from the dead-letter stream and
// lowers dead_count by as many, in one atomic step. It returns how many it moved.
func ReplayDead(ctx context.Context, c redis.Scripter, k Keys, limit int) (int, error) {
	if limit < 1 {
		return 0, fmt.Errorf("replaying dead letters: limit %d, want at least 1", limit)
	}
	n, err := ReplayDeadScript.Run(ctx, c, []string{k.Meta, k.Stream, k.DeadLetters}, limit).Int64()
	if err != nil {
		return 0, fmt.Errorf("replay dead letters: %w", err)
	}
	return int(n), nil
}
