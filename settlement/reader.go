package settlement

import (
	"context"
	"errors"
	"time"

	"redpacket.io/operator/store"
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
		at := time.Now()
		var (
			entries []store.StreamEntry
			err     error
		)
		if own {
			// History reads never block.
			entries, err = w.stream.ReadOwnPending(ctx, w.cfg.Group, w.cfg.Consumer, ownCursor, n)
		} else {
			block := max(time.Millisecond, min(w.cfg.Block, time.Until(nextClaim)))
			entries, err = w.stream.ReadNew(ctx, w.cfg.Group, w.cfg.Consumer, n, block)
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if errors.Is(err, store.ErrNoGroup) {
				w.log.Error("the settlement consumer group is gone; restart the worker to recreate it", "err", err)
			} else {
				w.log.Warn("reading settlement entries", "err", err)
			}
			sleep(ctx, retryPause(failures))
			failures++
			continue
		}
		failures = 0
		if own {
			if len(entries) == 0 {
				own = false
				continue
			}
			ownCursor = entries[len(entries)-1].ID
			w.log.Info("resuming own pending settlement entries", "count", len(entries))
			w.send(ctx, out, entries, w.deliveryCounts(ctx, entries), at)
			continue
		}
		w.send(ctx, out, entries, nil, at)
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
		entries, next, err := w.stream.ClaimIdle(ctx, w.cfg.Group, w.cfg.Consumer, w.cfg.ClaimIdle, cursor,
			min(int64(w.cfg.BatchSize), free))
		if err != nil {
			if ctx.Err() == nil {
				w.log.Warn("taking over idle settlement entries", "err", err)
			}
			return cursor
		}
		if len(entries) > 0 {
			w.log.Info("took over idle settlement entries", "count", len(entries))
			w.send(ctx, out, entries, w.deliveryCounts(ctx, entries), at)
		}
		cursor = next
		if next == "0-0" {
			return next
		}
	}
	return cursor
}

// deliveryCounts reads how many times Redis has handed out each of entries (all in
// this consumer's pending list). An entry whose count cannot be read counts as
// delivered once.
func (w *Worker) deliveryCounts(ctx context.Context, entries []store.StreamEntry) map[string]int64 {
	ids := make([]string, len(entries))
	for i, e := range entries {
		ids[i] = e.ID
	}
	counts, err := w.stream.DeliveryCounts(ctx, w.cfg.Group, w.cfg.Consumer, ids)
	if err != nil && ctx.Err() == nil {
		w.log.Warn("reading delivery counts of settlement entries", "err", err)
	}
	return counts
}

// send verifies entries (see verify) and hands them to the scheduler, reserving room
// for them first.
func (w *Worker) send(ctx context.Context, out chan<- []acquired, entries []store.StreamEntry, counts map[string]int64, at time.Time) {
	if len(entries) == 0 {
		return
	}
	forged, ok := w.verify(ctx, entries)
	if !ok {
		return // shutting down; the entries stay pending for the next owner
	}
	batch := make([]acquired, len(entries))
	for i, e := range entries {
		n := counts[e.ID]
		if n < 1 {
			n = 1
		}
		batch[i] = acquired{entry: e, forged: forged[e.ID], attempts: n, at: at}
	}
	w.held.Add(int64(len(batch)))
	select {
	case out <- batch:
	case <-ctx.Done():
	}
}

// updatePending sets the pending gauge from the group's pending summary.
func (w *Worker) updatePending(ctx context.Context) {
	n, err := w.stream.PendingCount(ctx, w.cfg.Group)
	if err != nil {
		return
	}
	w.m.pending.Set(float64(n))
}

// verify checks entries with the source's Verifier and returns why each forged one
// is, by id. It retries until Redis answers: an entry is
// never delivered unverified. It returns false when ctx ended first.
func (w *Worker) verify(ctx context.Context, entries []store.StreamEntry) (map[string]error, bool) {
	for failures := 0; ; failures++ {
		forged, err := w.verifier.Verify(ctx, entries)
		if err == nil {
			return forged, true
		}
		if ctx.Err() != nil {
			return nil, false
		}
		if errors.Is(err, store.ErrNotInRedis) {
			w.log.Error("settlement entries cannot be verified: the activity's keys are gone; not delivering them", "err", err)
		} else {
			w.log.Warn("verifying settlement entries", "err", err)
		}
		if !sleep(ctx, retryPause(failures)) {
			return nil, false
		}
	}
}
