package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
)

// Configure writes the schedule and pause flag on every shard; open moves a ready
// activity to open.
func (s *Activity) Configure(ctx context.Context, startMs, endMs int64, paused, open bool) (ConfigureResult, error) {
	return s.ConfigureWith(ctx, Settings{StartMs: startMs, EndMs: endMs, Paused: paused, Open: open})
}

// ConfigureWith writes the settings on every shard. The result is shard 0's state;
// Found is false when any shard is missing (a sharded activity that lost a shard has
// lost data), Fenced true when any shard is fenced.
func (s *Activity) ConfigureWith(ctx context.Context, st Settings) (ConfigureResult, error) {
	results := make([]ConfigureResult, len(s.shards))
	err := s.eachShard(func(i int, a *Shard) error {
		r, err := configure(ctx, a.c, a.keys, st)
		if err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
		results[i] = r
		return nil
	})
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

// Fence fences every shard and returns shard 0's fence reason.
func (s *Activity) Fence(ctx context.Context, why string) (string, error) {
	reasons := make([]string, len(s.shards))
	err := s.eachShard(func(i int, a *Shard) error {
		r, err := fence(ctx, a.c, a.keys, why)
		reasons[i] = r
		if err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
		return nil
	})
	return reasons[0], err
}

// Accept lifts the fence of every shard that is at epoch seen and returns the new
// epoch. A shard that moved on already (an accept that stopped half-way) is left as
// it is.
func (s *Activity) Accept(ctx context.Context, seen int64) (int64, error) {
	epochs := make([]int64, len(s.shards))
	err := s.eachShard(func(i int, a *Shard) error {
		n, err := accept(ctx, a.c, a.keys, seen)
		if errors.Is(err, ErrEpochMoved) {
			snap, serr := a.snapshot(ctx)
			if serr == nil && snap.Epoch == seen+1 && snap.Fenced == "" {
				n, err = snap.Epoch, nil
			}
		}
		if err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
		epochs[i] = n
		return nil
	})
	if err != nil {
		return 0, err
	}
	return epochs[0], nil
}

// Close ends grabbing on every shard and refunds the remainder to the sponsor, in
// the same steps for any number of shards. An exhausted close happens only when a
// steady reading finds no packet listed or in transfer anywhere. Every shard is
// closed without a refund (close.lua), and then the one refund of the activity is
// written on shard 0 (refund_activity.lua, the only script that writes a refund): the
// total minus every shard's claimed amount, read after all of them closed, so
// packets left in a transfer journal are refunded too. A close that stopped between
// the two steps leaves the activity open for the next close to finish. Closing twice
// returns the first figures.
func (s *Activity) Close(ctx context.Context, reason CloseReason) (CloseResult, error) {
	root := s.shards[0]
	snap0, err := root.snapshot(ctx)
	if err != nil {
		return CloseResult{}, fmt.Errorf("shard 0: %w", err)
	}
	if snap0.activityRefunded {
		return CloseResult{Outcome: Closed, Reason: snap0.activityReason, Refunded: snap0.activityRefund}, nil
	}
	if reason == CloseExhausted {
		// Packets still journalled are on their way to a home shard: finish the moves
		// first, so that they are counted as listed.
		if _, err := s.Resolve(ctx); err != nil {
			return CloseResult{}, err
		}
		stock, steady, err := s.readStock(ctx)
		if err != nil {
			return CloseResult{}, err
		}
		for _, st := range stock {
			if st.listed > 0 || st.journal > 0 || !steady {
				return CloseResult{Outcome: CloseStillOpen}, nil
			}
		}
	}
	results := make([]CloseResult, len(s.shards))
	err = s.eachShard(func(i int, a *Shard) error {
		r, err := closeShard(ctx, a.c, a.keys, reason)
		if err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
		results[i] = r
		return nil
	})
	if err != nil {
		return CloseResult{}, err
	}
	for _, r := range results {
		if r.Outcome != Closed {
			return CloseResult{Outcome: r.Outcome}, nil
		}
	}
	// Every shard is closed: no claim can be added, so the claimed amounts are final.
	view, err := s.ReadShards(ctx)
	if err != nil {
		return CloseResult{}, err
	}
	if !view.Whole.Exists() {
		return CloseResult{Outcome: CloseMissing}, nil
	}
	for i, sh := range view.Shards {
		switch {
		case sh.Fenced != "":
			return CloseResult{Outcome: CloseFenced}, nil
		case sh.State != StateClosed:
			return CloseResult{}, fmt.Errorf("shard %d is %s after its close; the refund is not written", i, sh.State)
		}
	}
	refund := view.Whole.Total - view.Whole.ClaimedAmount
	why := results[0].Reason
	got, err := lua.RefundActivityScript.Run(ctx, root.c, []string{root.keys.Meta, root.keys.Stream}, refund, string(why)).Int64()
	if err != nil {
		return CloseResult{}, fmt.Errorf("writing the activity's refund on shard 0: %w", err)
	}
	return CloseResult{Outcome: Closed, Reason: why, Refunded: got}, nil
}

// View is every shard's snapshot, read while no packet moved between shards,
// with the activity's figures summed from them.
type View struct {
	// Whole is the activity as one: shard 0's state, schedule, sponsor and
	// currency (any missing shard makes it missing, any fenced shard fenced), the
	// activity's count and total, and every counter summed. RemainingCount includes
	// packets in transfer; Refunded is the activity's one refund.
	Whole Snapshot
	// Shards are the shards' own snapshots.
	Shards []Snapshot
	// InTransferCount and InTransferAmount are the packets journalled by a source and
	// not yet applied by their destination.
	InTransferCount, InTransferAmount int64
	// Steady is false when packets kept moving between shards during every try; the
	// figures are then the last try's, and Conservation may be off by a transfer.
	Steady bool
}

// Imbalance says how far a view is from conservation: packets and money that are in
// none of the places they can be, or in two. Zero is the only correct value.
type Imbalance struct {
	// Count is |Σ shards' count + in transfer − the activity's count| plus, for every
	// open shard, |listed + claimed − its count|.
	Count int64
	// Amount is |Σ shards' total + in transfer − the activity's total|, plus, once the
	// activity is closed, |claimed + refunded − total|.
	Amount int64
}

// Zero reports whether nothing is out of place.
func (i Imbalance) Zero() bool { return i.Count == 0 && i.Amount == 0 }

// Conservation checks the view: every packet is listed on a shard, claimed, in
// transfer or refunded, exactly once, in count and in money.
func (v View) Conservation() Imbalance {
	var im Imbalance
	if !v.Whole.Exists() {
		return im
	}
	var count, total int64
	for _, sh := range v.Shards {
		count += sh.Count
		total += sh.Total
		if sh.State == StateOpen || sh.State == StateReady {
			im.Count += abs(sh.RemainingCount + sh.ClaimedCount - sh.Count)
		}
	}
	im.Count += abs(count + v.InTransferCount - v.Whole.Count)
	im.Amount += abs(total + v.InTransferAmount - v.Whole.Total)
	// The activity is closed only once its refund is written (sum).
	if v.Whole.State == StateClosed {
		im.Amount += abs(v.Whole.ClaimedAmount + v.Whole.Refunded - v.Whole.Total)
	}
	return im
}

// Duplicated reports whether the view holds more packets than were seeded: an open
// shard whose list and claims exceed its count, or shards whose counts and transfers
// exceed the activity's, in packets or in money. Only a master that forgot a write
// (a transfer out, after a crash or a failover) or a write outside the scripts does
// that, and the packets too many could be granted twice: the reporter and the
// controller fence the activity when a steady view says so.
func (v View) Duplicated() bool {
	if !v.Whole.Exists() || len(v.Shards) < 2 {
		return false
	}
	var count, total int64
	for _, sh := range v.Shards {
		count += sh.Count
		total += sh.Total
		if (sh.State == StateOpen || sh.State == StateReady) && sh.RemainingCount+sh.ClaimedCount > sh.Count {
			return true
		}
	}
	return count+v.InTransferCount > v.Whole.Count || total+v.InTransferAmount > v.Whole.Total
}

func abs(n int64) int64 {
	if n < 0 {
		return -n
	}
	return n
}

// Snapshot is the activity as one (ShardsView.Activity).
func (s *Activity) Snapshot(ctx context.Context) (Snapshot, error) {
	v, err := s.ReadShards(ctx)
	if err != nil {
		return Snapshot{}, err
	}
	return v.Whole, nil
}

// ReadShards reads every shard's snapshot and transfer journal between two readings
// of the transfer sequences, and again while they moved, up to a few times.
func (s *Activity) ReadShards(ctx context.Context) (View, error) {
	var v View
	for range stockReads {
		before, err := s.stockOnce(ctx)
		if err != nil {
			return View{}, err
		}
		if v, err = s.readShardsOnce(ctx); err != nil {
			return View{}, err
		}
		after, err := s.stockOnce(ctx)
		if err != nil {
			return View{}, err
		}
		v.Steady = true
		for i := range before {
			if before[i].seq != after[i].seq {
				v.Steady = false
			}
		}
		if v.Steady {
			break
		}
	}
	return v, nil
}

// readShardsOnce reads the shards' snapshots and journals, and which journalled
// transfers their destinations applied already.
func (s *Activity) readShardsOnce(ctx context.Context) (View, error) {
	v := View{Shards: make([]Snapshot, len(s.shards))}
	journals := make([]map[string]string, len(s.shards))
	err := s.eachShard(func(i int, a *Shard) error {
		snap, err := a.snapshot(ctx)
		if err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
		j, err := a.c.HGetAll(ctx, a.keys.Transfers).Result()
		if err != nil {
			return fmt.Errorf("reading the transfer journal of shard %d: %w", i, err)
		}
		v.Shards[i], journals[i] = snap, j
		return nil
	})
	if err != nil {
		return View{}, err
	}
	for i, j := range journals {
		for id, entry := range j {
			t, err := parseTransfer(entry)
			if err != nil {
				return View{}, fmt.Errorf("shard %d: %w", i, err)
			}
			if t.dest < 0 || t.dest >= len(s.shards) {
				return View{}, fmt.Errorf("transfer %s of shard %d names destination %d of %d shards", id, i, t.dest, len(s.shards))
			}
			d := s.shards[t.dest]
			applied, err := d.c.HExists(ctx, d.keys.Applied, id).Result()
			if err != nil {
				return View{}, fmt.Errorf("reading whether shard %d applied transfer %s: %w", t.dest, id, err)
			}
			if !applied {
				v.InTransferCount += t.count
				v.InTransferAmount += t.amount
			}
		}
	}
	v.Whole = s.sum(v.Shards, v.InTransferCount)
	return v, nil
}

// sum makes the activity's snapshot out of its shards'.
func (s *Activity) sum(shards []Snapshot, inTransfer int64) Snapshot {
	root := shards[0]
	a := root
	a.Count, a.Total = root.activityCount, root.activityTotal
	a.Refunded, a.CloseReason = root.activityRefund, root.activityReason
	a.ClaimedCount, a.ClaimedAmount, a.RemainingCount, a.StagedCount = 0, 0, inTransfer, 0
	a.SettledCount, a.SettledAmount, a.RefundSettled, a.DeadCount = 0, 0, 0, 0
	for _, sh := range shards {
		if !sh.Exists() {
			// Not in Redis as a whole; what is staged shows how far seeding got.
			var staged int64
			for _, sh := range shards {
				staged += sh.StagedCount
			}
			return Snapshot{StagedCount: staged}
		}
	}
	closed := 0
	for _, sh := range shards {
		if a.Fenced == "" {
			a.Fenced = sh.Fenced
		}
		if sh.Fenced == "" {
			a.partlyFenced = true
		}
		if sh.State == StateOpen {
			a.State = StateOpen
		}
		if sh.State == StateClosed {
			closed++
		}
		a.ClaimedCount += sh.ClaimedCount
		a.ClaimedAmount += sh.ClaimedAmount
		a.RemainingCount += sh.RemainingCount
		a.StagedCount += sh.StagedCount
		a.SettledCount += sh.SettledCount
		a.SettledAmount += sh.SettledAmount
		a.RefundSettled += sh.RefundSettled
		a.DeadCount += sh.DeadCount
	}
	switch {
	case closed == len(shards) && root.activityRefunded:
		a.State = StateClosed
	case closed > 0:
		// Closing is under way (or stopped half-way, to be finished by the next
		// close): no shard grants, and the refund is not written yet.
		a.State, a.CloseReason = StateOpen, ""
	}
	a.activityRefunded = root.activityRefunded
	a.partlyFenced = a.partlyFenced && a.Fenced != ""
	return a
}

// Time is the Redis clock of shard 0's master.
func (s *Activity) Time(ctx context.Context) (time.Time, error) { return s.shards[0].Time(ctx) }

// Ping checks that every shard's master answers.
func (s *Activity) Ping(ctx context.Context) error {
	return s.eachShard(func(i int, a *Shard) error {
		if err := a.Ping(ctx); err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
		return nil
	})
}

// LoadScripts loads every script on every master (see Activity.LoadScripts).
func (s *Activity) LoadScripts(ctx context.Context) error { return s.shards[0].LoadScripts(ctx) }

// Purge deletes every key of every shard.
func (s *Activity) Purge(ctx context.Context) error {
	return s.eachShard(func(i int, a *Shard) error {
		if err := purge(ctx, a.c, a.keys); err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
		return nil
	})
}

// PurgeKeepingUnsettled purges every shard but its settlement and dead-letter
// streams (Activity.PurgeKeepingUnsettled) and returns the keys kept.
func (s *Activity) PurgeKeepingUnsettled(ctx context.Context, retention time.Duration) ([]string, error) {
	kept := make([][]string, len(s.shards))
	err := s.eachShard(func(i int, a *Shard) error {
		k, err := purgeKeepingUnsettled(ctx, a.c, a.keys, retention)
		kept[i] = k
		if err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
		return nil
	})
	var all []string
	for _, k := range kept {
		all = append(all, k...)
	}
	return all, err
}

// CheckFsync checks every shard's master (Activity.CheckFsync).
func (s *Activity) CheckFsync(ctx context.Context) error {
	return s.eachShard(func(i int, a *Shard) error {
		if err := a.CheckFsync(ctx); err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
		return nil
	})
}

// CheckReplicas checks that every shard's master has at least n replicas connected.
func (s *Activity) CheckReplicas(ctx context.Context, n int) error {
	return s.eachShard(func(i int, a *Shard) error {
		if err := a.CheckReplicas(ctx, n); err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
		return nil
	})
}

// EnsureUser gives the activity's ACL user, whose key patterns cover every shard,
// the password on every node (Activity.EnsureUser).
func (s *Activity) EnsureUser(ctx context.Context, password string) (UserChange, error) {
	return s.base.EnsureUser(ctx, password)
}

// UserName is the name of the activity's Redis ACL user (EnsureUser).
func (s *Activity) UserName() string { return s.base.keys.userName() }

// DeleteUser removes the activity's ACL user from every node.
func (s *Activity) DeleteUser(ctx context.Context) (int, error) { return s.base.DeleteUser(ctx) }

// ReplayDeadLetters moves up to max dead letters of every shard back into its
// settlement stream (Activity.ReplayDeadLetters), shard by shard, and returns how
// many moved in all; max <= 0 means all of them.
func (s *Activity) ReplayDeadLetters(ctx context.Context, max int) (int, error) {
	moved := 0
	for i, a := range s.shards {
		left := 0
		if max > 0 {
			if left = max - moved; left <= 0 {
				break
			}
		}
		n, err := a.ReplayDeadLetters(ctx, left)
		moved += n
		if err != nil {
			return moved, fmt.Errorf("shard %d: %w", i, err)
		}
	}
	return moved, nil
}

// RolledBack says how this view is older than what the status st records, or ""
// when it is not: Snapshot.RolledBack of the activity as one, and for a sharded
// activity each shard against its own figure in status.shardWatermarks (when they
// were read in the view's epoch), so that a shard that came back behind is caught
// even while the others' grants hide it in the sums.
func (v View) RolledBack(st *redpacketv1alpha1.RedPacketActivityStatus) string {
	if why := v.Whole.RolledBack(st); why != "" {
		return why
	}
	if why := v.ClaimsLost(); why != "" {
		return why
	}
	return v.ShardBehind(st)
}

// ClaimsLost says which open shard holds fewer claims than were popped from its list,
// or "" when none does. Every pop from a list is one claim, so an open shard's claims
// and list add up to its count; fewer means claims vanished while the list kept its
// place (a key deleted or evicted on its own, a partial restore). The grab script
// reads the claimed count from the popped packet, not from the claims hash, and the
// users of the lost claims could claim again: the reporter and the controller fence
// such an activity.
func (v View) ClaimsLost() string {
	for i, sh := range v.Shards {
		if sh.Exists() && (sh.State == StateOpen || sh.State == StateReady) && sh.RemainingCount+sh.ClaimedCount < sh.Count {
			return fmt.Sprintf("shard %d holds %d claims and %d listed packets of %d: claims were lost",
				i, sh.ClaimedCount, sh.RemainingCount, sh.Count)
		}
	}
	return ""
}

// ShardBehind says which shard of a sharded activity holds fewer claims than its
// figure in status.shardWatermarks read in the view's epoch, or "" when none does.
func (v View) ShardBehind(st *redpacketv1alpha1.RedPacketActivityStatus) string {
	w := st.ShardWatermarks
	if w == nil || len(v.Shards) < 2 || w.Epoch != v.Whole.Epoch {
		return ""
	}
	for i, sh := range v.Shards {
		if i < len(w.ClaimedCounts) && sh.Exists() && sh.ClaimedCount < w.ClaimedCounts[i] {
			return fmt.Sprintf("shard %d holds %d claims, status records %d", i, sh.ClaimedCount, w.ClaimedCounts[i])
		}
	}
	return ""
}

// Watermarks are the view's shards' claimed counts in its epoch, raised to what st
// already records in the same epoch (a shard's figure never falls), for
// status.shardWatermarks; nil for an activity of one shard.
func (v View) Watermarks(st *redpacketv1alpha1.RedPacketActivityStatus) *redpacketv1alpha1.ShardWatermarks {
	if len(v.Shards) < 2 {
		return nil
	}
	w := &redpacketv1alpha1.ShardWatermarks{Epoch: v.Whole.Epoch, ClaimedCounts: make([]int64, len(v.Shards))}
	for i, sh := range v.Shards {
		w.ClaimedCounts[i] = sh.ClaimedCount
		if old := st.ShardWatermarks; old != nil && old.Epoch == w.Epoch && i < len(old.ClaimedCounts) {
			w.ClaimedCounts[i] = max(w.ClaimedCounts[i], old.ClaimedCounts[i])
		}
	}
	return w
}
