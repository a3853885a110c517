package settlement

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// read brings entries in, as long as the worker has room for them: first its own
// pending entries (left by an earlier run under the same consumer name), then new
// entries, and every ClaimInterval the entries idle past ClaimIdle in any
// consumer's pending list (those of dead workers).
func (w *Worker) read(ctx context.Context, out chan<- []acquired) {
	own := true
	ownCursor := "0"
	claimCursor := "0-0"
	nextClaim := time.Now()
	failures := 0
	for ctx.Err() == nil {
		if !time.Now().Before(nextClaim) {
			claimCursor = w.autoclaim(ctx, out, claimCursor)
			w.updatePending(ctx)
			nextClaim = time.Now().Add(w.cfg.ClaimInterval)
		}
		free := int64(w.cfg.MaxHeld) - w.held.Load()
		if free <= 0 {
			select {
			case <-ctx.Done():
			case <-w.space:
			case <-time.After(time.Until(nextClaim)):
			}
			continue
		}
		n := min(int64(w.cfg.BatchSize), free)
		args := &redis.XReadGroupArgs{
			Group: w.cfg.Group, Consumer: w.cfg.Consumer, Count: n,
			Streams: []string{w.cfg.Keys.Stream, ">"},
			Block:   max(time.Millisecond, min(w.cfg.Block, time.Until(nextClaim))),
		}
		if own {
			args.Streams[1] = ownCursor
			args.Block = -1 // history reads never block
		}
		at := time.Now()
		streams, err := w.cfg.Redis.XReadGroup(ctx, args).Result()
		if errors.Is(err, redis.Nil) {
			failures = 0
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if strings.HasPrefix(err.Error(), "NOGROUP") {
				w.log.Error("the settlement consumer group is gone; restart the worker to recreate it", "err", err)
			} else {
				w.log.Warn("reading settlement entries", "err", err)
			}
			sleep(ctx, retryPause(failures))
			failures++
			continue
		}
		failures = 0
		var msgs []redis.XMessage
		for _, s := range streams {
			msgs = append(msgs, s.Messages...)
		}
		if own {
			if len(msgs) == 0 {
				own = false
				continue
			}
			ownCursor = msgs[len(msgs)-1].ID
			w.log.Info("resuming own pending settlement entries", "count", len(msgs))
			w.send(ctx, out, msgs, w.deliveryCounts(ctx, msgs), at)
			continue
		}
		w.send(ctx, out, msgs, nil, at)
	}
}

// autoclaim takes over entries idle past ClaimIdle, from cursor on, while there is
// room, and returns the cursor to continue from next time.
func (w *Worker) autoclaim(ctx context.Context, out chan<- []acquired, cursor string) string {
	for ctx.Err() == nil {
		free := int64(w.cfg.MaxHeld) - w.held.Load()
		if free <= 0 {
			return cursor
		}
		at := time.Now()
		msgs, next, err := w.cfg.Redis.XAutoClaim(ctx, &redis.XAutoClaimArgs{
			Stream: w.cfg.Keys.Stream, Group: w.cfg.Group, Consumer: w.cfg.Consumer,
			MinIdle: w.cfg.ClaimIdle, Start: cursor, Count: min(int64(w.cfg.BatchSize), free),
		}).Result()
		if err != nil {
			if ctx.Err() == nil {
				w.log.Warn("taking over idle settlement entries", "err", err)
			}
			return cursor
		}
		if len(msgs) > 0 {
			w.log.Info("took over idle settlement entries", "count", len(msgs))
			w.send(ctx, out, msgs, w.deliveryCounts(ctx, msgs), at)
		}
		cursor = next
		if next == "0-0" || next == "" {
			return "0-0"
		}
	}
	return cursor
}

// deliveryCounts reads how many times Redis has handed out each of msgs (all in
// this consumer's pending list). An entry whose count cannot be read counts as
// delivered once.
func (w *Worker) deliveryCounts(ctx context.Context, msgs []redis.XMessage) map[string]int64 {
	counts := make(map[string]int64, len(msgs))
	pend, err := w.cfg.Redis.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: w.cfg.Keys.Stream, Group: w.cfg.Group, Consumer: w.cfg.Consumer,
		Start: msgs[0].ID, End: msgs[len(msgs)-1].ID, Count: int64(len(msgs) + w.cfg.MaxHeld),
	}).Result()
	if err != nil {
		if ctx.Err() == nil {
			w.log.Warn("reading delivery counts of settlement entries", "err", err)
		}
		return counts
	}
	for _, p := range pend {
		counts[p.ID] = p.RetryCount
	}
	return counts
}

// send hands entries to the scheduler, reserving room for them first.
func (w *Worker) send(ctx context.Context, out chan<- []acquired, msgs []redis.XMessage, counts map[string]int64, at time.Time) {
	if len(msgs) == 0 {
		return
	}
	batch := make([]acquired, len(msgs))
	for i, m := range msgs {
		n := counts[m.ID]
		if n < 1 {
			n = 1
		}
		batch[i] = acquired{msg: m, attempts: n, at: at}
	}
	w.held.Add(int64(len(batch)))
	select {
	case out <- batch:
	case <-ctx.Done():
	}
}

// updatePending sets the pending gauge from the group's pending summary.
func (w *Worker) updatePending(ctx context.Context) {
	p, err := w.cfg.Redis.XPending(ctx, w.cfg.Keys.Stream, w.cfg.Group).Result()
	if err != nil {
		return
	}
	w.m.pending.Set(float64(p.Count))
}
