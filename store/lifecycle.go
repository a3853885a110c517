package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// ConfigureResult says what Configure found: the state afterwards, and whether Redis
// holds the activity at all (when it does not, nothing was written). Fenced is true
// when the activity is fenced after a rollback: nothing was written either.
type ConfigureResult struct {
	State  State
	Found  bool
	Fenced bool
}

// Settings are what configure.lua writes: the schedule, the pause flag, whether to
// open a ready activity, and the payee of the refund and the currency of later
// settlement entries (both kept as they are when Sponsor is empty).
type Settings struct {
	StartMs, EndMs int64
	Paused, Open   bool
	Sponsor        string
	Currency       string
}

// Configure writes the schedule and pause flag on every shard; open moves a ready
// activity to open.
func (s *Activity) Configure(ctx context.Context, startMs, endMs int64, paused, open bool) (ConfigureResult, error) {
	return s.ConfigureWith(ctx, Settings{StartMs: startMs, EndMs: endMs, Paused: paused, Open: open})
}

// ConfigureWith writes the settings on every shard. The result is shard 0's state;
// Found is false when any shard is missing (a sharded activity that lost a shard has
// lost data), Fenced true when any shard is fenced.
func (s *Activity) ConfigureWith(ctx context.Context, st Settings) (ConfigureResult, error) {
	results, err := onEveryShard(s, func(a *Shard) (ConfigureResult, error) { return configure(ctx, a.c, a.keys, st) })
	if err != nil {
		return ConfigureResult{}, err
	}
	out := results[0]
	closed := 0
	for _, r := range results {
		if !r.Found {
			return ConfigureResult{}, nil
		}
		out.Fenced = out.Fenced || r.Fenced
		if r.State == StateClosed {
			closed++
		}
	}
	if closed > 0 {
		// The activity is closed once every shard is and its one refund is written; a
		// close that stopped half-way is still open, so that the caller's Close
		// finishes it.
		root, err := s.shards[0].snapshot(ctx)
		if err != nil {
			return ConfigureResult{}, fmt.Errorf("shard 0: %w", err)
		}
		out.State = StateOpen
		if closed == len(s.shards) && root.activityRefunded {
			out.State = StateClosed
		}
	}
	return out, nil
}

// configure writes the settings on one shard (configure.lua).
func configure(ctx context.Context, c redis.Scripter, k Keys, st Settings) (ConfigureResult, error) {
	args := []any{st.StartMs, st.EndMs, boolArg(st.Paused), boolArg(st.Open)}
	if st.Sponsor != "" {
		args = append(args, st.Sponsor, st.Currency)
	}
	state, err := lua.ConfigureScript.Run(ctx, c, []string{k.Meta}, args...).Text()
	if err != nil {
		return ConfigureResult{}, fmt.Errorf("configure script: %w", err)
	}
	switch state {
	case string(Missing):
		return ConfigureResult{}, nil
	case string(Fenced):
		return ConfigureResult{Found: true, Fenced: true}, nil
	}
	return ConfigureResult{State: State(state), Found: true}, nil
}

// Fence fences every shard and returns shard 0's fence reason.
func (s *Activity) Fence(ctx context.Context, why string) (string, error) {
	reasons, err := onEveryShard(s, func(a *Shard) (string, error) { return fence(ctx, a.c, a.keys, why) })
	return reasons[0], err
}

// fence stops one shard after a rollback (fence.lua) and returns the fence's
// reason, the first one written; "" when Redis does not hold the activity.
func fence(ctx context.Context, c redis.Scripter, k Keys, why string) (string, error) {
	got, err := lua.FenceScript.Run(ctx, c, []string{k.Meta}, why).Text()
	if err != nil {
		return "", fmt.Errorf("fence script: %w", err)
	}
	if got == string(Missing) {
		return "", nil
	}
	return got, nil
}

// ErrEpochMoved is returned by Accept when Redis is no longer at the epoch the
// caller decided on.
var ErrEpochMoved = errors.New("the activity's Redis epoch moved since it was read")

// Accept lifts the fence of every shard that is at epoch seen and returns the new
// epoch. A shard that moved on already (an accept that stopped half-way) is left as
// it is.
func (s *Activity) Accept(ctx context.Context, seen int64) (int64, error) {
	epochs, err := onEveryShard(s, func(a *Shard) (int64, error) {
		n, err := accept(ctx, a.c, a.keys, seen)
		if errors.Is(err, ErrEpochMoved) {
			snap, serr := a.snapshot(ctx)
			if serr == nil && snap.Epoch == seen+1 && snap.Fenced == "" {
				n, err = snap.Epoch, nil
			}
		}
		return n, err
	})
	if err != nil {
		return 0, err
	}
	return epochs[0], nil
}

// accept lifts one shard's fence and starts a new epoch there (accept.lua), provided
// it is still at epoch seen. It returns the new epoch.
func accept(ctx context.Context, c redis.Scripter, k Keys, seen int64) (int64, error) {
	n, err := lua.AcceptScript.Run(ctx, c, []string{k.Meta}, seen).Int64()
	if err != nil {
		return 0, fmt.Errorf("accept script: %w", err)
	}
	switch n {
	case -1:
		return 0, ErrMissing
	case -2:
		return 0, ErrEpochMoved
	}
	return n, nil
}
