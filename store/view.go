package store

import (
	"context"
	"fmt"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

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
// that: on an activity of one shard too, a claim written by hand for a packet that is
// still listed (the activity's own Redis user can write its claims hash) is one claim
// more than the list gave out. The packets too many could be granted twice: the
// reporter and the controller fence the activity when a steady view says so.
func (v View) Duplicated() bool {
	if !v.Whole.Exists() {
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
			return err
		}
		j, err := a.c.HGetAll(ctx, a.keys.Transfers).Result()
		if err != nil {
			return fmt.Errorf("reading its transfer journal: %w", err)
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
	a.TransferSeq = 0
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

// ShardBehind says which shard of a sharded activity holds fewer claims, or has
// taken fewer transfer steps, than its figures in status.shardWatermarks read in the
// view's epoch, or "" when none does. A shard below its transfer sequence came back
// from before a transfer: after a transfer out it lists again packets that its
// sibling holds too, while every claim it held is there.
func (v View) ShardBehind(st *redpacketv1alpha1.RedPacketActivityStatus) string {
	w := st.ShardWatermarks
	if w == nil || len(v.Shards) < 2 || w.Epoch != v.Whole.Epoch {
		return ""
	}
	for i, sh := range v.Shards {
		if !sh.Exists() {
			continue
		}
		if i < len(w.ClaimedCounts) && sh.ClaimedCount < w.ClaimedCounts[i] {
			return fmt.Sprintf("shard %d holds %d claims, status records %d", i, sh.ClaimedCount, w.ClaimedCounts[i])
		}
		if i < len(w.TransferSeqs) && sh.TransferSeq < w.TransferSeqs[i] {
			return fmt.Sprintf("shard %d is at transfer %d, status records %d: it came back from before a transfer between shards",
				i, sh.TransferSeq, w.TransferSeqs[i])
		}
	}
	return ""
}

// Watermarks are the view's shards' claimed counts and transfer sequences in its
// epoch, each raised to what st already records in the same epoch (a shard's figure
// never falls), for status.shardWatermarks; nil for an activity of one shard.
func (v View) Watermarks(st *redpacketv1alpha1.RedPacketActivityStatus) *redpacketv1alpha1.ShardWatermarks {
	if len(v.Shards) < 2 {
		return nil
	}
	w := &redpacketv1alpha1.ShardWatermarks{Epoch: v.Whole.Epoch,
		ClaimedCounts: make([]int64, len(v.Shards)), TransferSeqs: make([]int64, len(v.Shards))}
	old := st.ShardWatermarks
	if old != nil && old.Epoch != w.Epoch {
		old = nil
	}
	for i, sh := range v.Shards {
		w.ClaimedCounts[i], w.TransferSeqs[i] = sh.ClaimedCount, sh.TransferSeq
		if old != nil && i < len(old.ClaimedCounts) {
			w.ClaimedCounts[i] = max(w.ClaimedCounts[i], old.ClaimedCounts[i])
		}
		if old != nil && i < len(old.TransferSeqs) {
			w.TransferSeqs[i] = max(w.TransferSeqs[i], old.TransferSeqs[i])
		}
	}
	return w
}
