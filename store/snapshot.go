package store

import (
	"context"
	"fmt"
	"strconv"
	"time"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
)

// Snapshot is every counter of an activity read at one instant.
type Snapshot struct {
	// State is StateReady, StateOpen, StateClosed, or "" when Redis lacks the activity.
	State          State
	Paused         bool
	Total          int64
	Count          int64
	ClaimedCount   int64
	ClaimedAmount  int64
	Refunded       int64
	SettledCount   int64
	SettledAmount  int64
	RefundSettled  int64
	DeadCount      int64
	RemainingCount int64
	StagedCount    int64
	CloseReason    CloseReason
	StartMs        int64
	EndMs          int64
	SeededMs       int64
	Sponsor        string
	Currency       string
	// Fenced is the fence's reason when the activity is fenced after a rollback.
	Fenced string
	// Epoch counts the rollbacks accepted by an operator (0 before any).
	Epoch int64
	// TransferSeq is the shard's transfer sequence: how many transfer steps it took
	// (transfer_out.lua); for an activity as a whole, 0.
	TransferSeq int64

	// Shard 0 of a sharded activity also holds the activity's own count and total,
	// and once every shard closed, its one refund (close.go).
	activityCount, activityTotal, activityRefund int64
	activityReason                               CloseReason
	activityRefunded                             bool
	// partlyFenced is true when some shards of a sharded activity are fenced and
	// others not yet.
	partlyFenced bool
}

// FullyFenced reports whether the activity is fenced everywhere: Fenced is set and,
// for a sharded activity, every shard is fenced. A fence found on one shard must be
// spread to the others (Fence), so that no shard grants while one rolled back.
func (s Snapshot) FullyFenced() bool { return s.Fenced != "" && !s.partlyFenced }

// Watermark is the snapshot's claimed count and transfer sequence within its epoch.
func (s Snapshot) Watermark() Watermark {
	return Watermark{Epoch: s.Epoch, ClaimedCount: s.ClaimedCount, TransferSeq: s.TransferSeq}
}

// Exists reports whether Redis holds the committed activity.
func (s Snapshot) Exists() bool { return s.State != "" }

// RemainingAmount is the money neither claimed nor refunded.
func (s Snapshot) RemainingAmount() int64 { return s.Total - s.ClaimedAmount - s.Refunded }

// Phase is the activity's phase as Redis and the server clock now say, and false
// when Redis cannot say: the activity is not in Redis, or is committed but not yet
// open (the resource's status knows better then). Both the controller and the grab
// service decide the phase here.
func (s Snapshot) Phase(now time.Time) (redpacketv1alpha1.Phase, bool) {
	switch s.State {
	case StateClosed:
		if s.CloseReason == CloseExhausted {
			return redpacketv1alpha1.PhaseExhausted, true
		}
		return redpacketv1alpha1.PhaseExpired, true
	case StateOpen:
		ms := now.UnixMilli()
		switch {
		case s.EndMs > 0 && ms >= s.EndMs:
			return redpacketv1alpha1.PhaseExpired, true
		case s.RemainingCount == 0:
			return redpacketv1alpha1.PhaseExhausted, true
		case s.Paused:
			return redpacketv1alpha1.PhasePaused, true
		case ms < s.StartMs:
			return redpacketv1alpha1.PhaseScheduled, true
		default:
			return redpacketv1alpha1.PhaseActive, true
		}
	}
	return "", false
}

// Counters are the snapshot's money counters, the status fields they are reported as.
func (s Snapshot) Counters() redpacketv1alpha1.Counters {
	return redpacketv1alpha1.Counters{
		RemainingCount:  s.RemainingCount,
		RemainingAmount: s.RemainingAmount(),
		ClaimedCount:    s.ClaimedCount,
		ClaimedAmount:   s.ClaimedAmount,
		RefundedAmount:  s.Refunded,
		SettledCount:    s.SettledCount,
		SettledAmount:   s.SettledAmount,
		DeadLetterCount: s.DeadCount,
	}
}

// RolledBack says how this snapshot of a Redis is older than what the status st
// already records, or "" when it is not. A Redis is older when it is fenced, when
// its epoch is below status.redisEpoch, when in the same epoch a cumulative counter
// is below the recorded one, or when it holds open an activity that the status
// records as closed. A snapshot of a later epoch than the status is not compared:
// the status has not caught up with an accept yet.
func (s Snapshot) RolledBack(st *redpacketv1alpha1.RedPacketActivityStatus) string {
	if !s.Exists() {
		return ""
	}
	if s.Fenced != "" {
		return "the activity is fenced in Redis (" + s.Fenced + ")"
	}
	var epoch int64
	if st.RedisEpoch != nil {
		epoch = *st.RedisEpoch
	}
	switch {
	case s.Epoch < epoch:
		return fmt.Sprintf("Redis is at epoch %d, status records epoch %d: it was restored from before an accepted rollback", s.Epoch, epoch)
	case s.Epoch > epoch:
		return ""
	}
	if recorded, ok := redpacketv1alpha1.RecordedCounters(st); ok {
		if why := s.Counters().Behind(recorded); why != "" {
			return why
		}
	}
	closed := st.Phase == redpacketv1alpha1.PhaseExhausted || st.Phase == redpacketv1alpha1.PhaseExpired
	if closed && s.State != StateClosed {
		return fmt.Sprintf("Redis holds the activity in state %q, status records it %s", s.State, st.Phase)
	}
	return ""
}

// snapshot reads every counter of the shard at one instant.
func (a *Shard) snapshot(ctx context.Context) (Snapshot, error) {
	return a.readSnapshot(ctx)
}

// readSnapshot reads every counter of one shard at one instant. The script
// returns the meta hash's fields by name; each is decoded by its name (fields the
// snapshot does not know, such as the staging fingerprint, are skipped), so the
// order of fields in Redis or in the script means nothing.
func (a *Shard) readSnapshot(ctx context.Context) (Snapshot, error) {
	k := a.keys
	vals, err := a.call(ctx, lua.SnapshotScript, []string{k.Meta, k.Packets, k.Staging, k.Claims}).StringSlice()
	if err != nil {
		return Snapshot{}, fmt.Errorf("snapshot script: %w", err)
	}
	return decodeSnapshot(vals)
}

// snapshotInts are the snapshot's integer fields by meta field name.
var snapshotInts = map[string]func(*Snapshot) *int64{
	fieldTotal:          func(s *Snapshot) *int64 { return &s.Total },
	fieldCount:          func(s *Snapshot) *int64 { return &s.Count },
	fieldClaimedCount:   func(s *Snapshot) *int64 { return &s.ClaimedCount },
	fieldClaimedAmount:  func(s *Snapshot) *int64 { return &s.ClaimedAmount },
	fieldRefunded:       func(s *Snapshot) *int64 { return &s.Refunded },
	fieldSettledCount:   func(s *Snapshot) *int64 { return &s.SettledCount },
	fieldSettledAmount:  func(s *Snapshot) *int64 { return &s.SettledAmount },
	fieldRefundSettled:  func(s *Snapshot) *int64 { return &s.RefundSettled },
	fieldDeadCount:      func(s *Snapshot) *int64 { return &s.DeadCount },
	fieldStartMs:        func(s *Snapshot) *int64 { return &s.StartMs },
	fieldEndMs:          func(s *Snapshot) *int64 { return &s.EndMs },
	fieldSeededMs:       func(s *Snapshot) *int64 { return &s.SeededMs },
	fieldEpoch:          func(s *Snapshot) *int64 { return &s.Epoch },
	fieldTransferSeq:    func(s *Snapshot) *int64 { return &s.TransferSeq },
	fieldRemainingCount: func(s *Snapshot) *int64 { return &s.RemainingCount },
	fieldStagedCount:    func(s *Snapshot) *int64 { return &s.StagedCount },
	fieldActivityCount:  func(s *Snapshot) *int64 { return &s.activityCount },
	fieldActivityTotal:  func(s *Snapshot) *int64 { return &s.activityTotal },
	fieldActivityRefund: func(s *Snapshot) *int64 {
		s.activityRefunded = true
		return &s.activityRefund
	},
}

// decodeSnapshot decodes the snapshot script's flat list of names and values.
func decodeSnapshot(vals []string) (Snapshot, error) {
	if len(vals)%2 != 0 {
		return Snapshot{}, fmt.Errorf("snapshot script: %d values in reply, want name/value pairs", len(vals))
	}
	var snap Snapshot
	for i := 0; i < len(vals); i += 2 {
		name, v := vals[i], vals[i+1]
		switch name {
		case fieldState:
			snap.State = State(v)
		case fieldCloseReason:
			snap.CloseReason = CloseReason(v)
		case fieldSponsor:
			snap.Sponsor = v
		case fieldCurrency:
			snap.Currency = v
		case fieldFenced:
			snap.Fenced = v
		case fieldActivityReason:
			snap.activityReason = CloseReason(v)
		case fieldPaused:
			snap.Paused = v == "1"
		default:
			field, ok := snapshotInts[name]
			if !ok {
				continue
			}
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return Snapshot{}, fmt.Errorf("snapshot script: field %s = %q: %w", name, v, err)
			}
			*field(&snap) = n
		}
	}
	return snap, nil
}
