package store_test

import (
	"sync"
	"testing"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// marksKept keeps the highest watermark seen per shard, as the grab service's guard
// does (store.ShardMarks); onSaw, when set, runs after each Saw.
type marksKept struct {
	mu    sync.Mutex
	marks map[int]store.Watermark
	onSaw func(i int, w store.Watermark)
}

func (m *marksKept) Mark(i int) store.Watermark {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.marks[i]
}

func (m *marksKept) Saw(i int, w store.Watermark) {
	m.mu.Lock()
	if m.marks == nil {
		m.marks = map[int]store.Watermark{}
	}
	m.marks[i] = m.marks[i].Raise(w)
	m.mu.Unlock()
	if m.onSaw != nil {
		m.onSaw(i, w)
	}
}

// The transfer scripts fence a shard below the caller's transfer mark before they
// give or take a packet. A source whose master fails over between the halves of a
// transfer, to a replica from before its transfer_out, lists the moved packets
// again while the destination applies them: transfer_done, which carries the mark
// the transfer_out answered with, fences the source at once, and a grab there is
// refused. A destination that comes back from before a transfer_in it applied is
// fenced by the next transfer into it, which leaves its packets in the source's
// journal. The status's transfer sequences catch both for a reader with no mark of
// its own (View.RolledBack).
func TestTransferMarksFenceAShardThatCameBack(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)

	t.Run("source between the halves", func(t *testing.T) {
		act := store.NewActivity(c, "tm-source", 2)
		seedOpenShards(t, ctx, act, []int64{10, 20, 30, 40, 50, 60, 70, 80})
		replica := dumpShard(t, ctx, c, act.Shard(1).Keys())
		marks := &marksKept{}
		failedOver := false
		marks.onSaw = func(i int, w store.Watermark) {
			// Right after shard 1's transfer_out answered: the failover.
			if i == 1 && !failedOver && w.TransferSeq > 0 {
				failedOver = true
				restoreShard(t, ctx, c, replica)
			}
		}
		act.Marks = marks
		moved, err := act.Transfer(ctx, 1, 0, 2)
		if err != nil || moved != 2 || !failedOver {
			t.Fatalf("Transfer(1→0, 2): %d moved, %v, failed over %v", moved, err, failedOver)
		}
		v, err := act.ReadShards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v.Shards[1].Fenced == "" {
			t.Fatalf("shard 1 lost its transfer_out and lists %d packets again, but is not fenced", v.Shards[1].RemainingCount)
		}
		if !v.Duplicated() {
			t.Fatalf("the test does not test a duplication: %+v", v.Conservation())
		}
		u := usersOn("o", 1, 2, 1)[0]
		if r, _, err := act.Grab(ctx, u, marks.Mark); err != nil || r.Outcome != store.Fenced {
			t.Fatalf("grab on the source that came back: %+v, %v; want fenced", r, err)
		}
	})

	t.Run("destination after a transfer in", func(t *testing.T) {
		act := store.NewActivity(c, "tm-destination", 2)
		seedOpenShards(t, ctx, act, []int64{10, 20, 30, 40, 50, 60, 70, 80})
		marks := &marksKept{}
		act.Marks = marks
		replica := dumpShard(t, ctx, c, act.Shard(0).Keys())
		if moved, err := act.Transfer(ctx, 1, 0, 1); err != nil || moved != 1 {
			t.Fatalf("first transfer: %d, %v", moved, err)
		}
		// The status records what the reporter read: shard 0 took one transfer step.
		v, err := act.ReadShards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var st redpacketv1alpha1.RedPacketActivityStatus
		st.Phase = redpacketv1alpha1.PhaseActive
		redpacketv1alpha1.SetCounters(&st, v.Whole.Counters())
		st.ShardWatermarks = v.Watermarks(&st)
		if got := st.ShardWatermarks.TransferSeqs; len(got) != 2 || got[0] != 1 || got[1] != 2 {
			t.Fatalf("status.shardWatermarks.transferSeqs %v, want [1 2]", got)
		}
		restoreShard(t, ctx, c, replica)
		if v, err = act.ReadShards(ctx); err != nil {
			t.Fatal(err)
		}
		if why := v.ShardBehind(&st); why == "" {
			t.Fatalf("shard 0 came back from before its transfer_in and the view against the status does not say so")
		}
		if moved, err := act.Transfer(ctx, 1, 0, 1); err != nil || moved != 0 {
			t.Fatalf("transfer into the destination that came back: %d moved, %v; want none", moved, err)
		}
		if v, err = act.ReadShards(ctx); err != nil {
			t.Fatal(err)
		}
		if v.Shards[0].Fenced == "" || v.InTransferCount != 1 {
			t.Fatalf("destination fenced %q, %d packets in transfer; want fenced and the refused packet journalled",
				v.Shards[0].Fenced, v.InTransferCount)
		}
	})
	t.Run("a pod that knows only the status", func(t *testing.T) {
		// Another pod moved the packets; this one has no mark of its own, only the
		// status the reporter wrote after the transfer.
		act := store.NewActivity(c, "tm-status", 2)
		seedOpenShards(t, ctx, act, []int64{10, 20, 30, 40, 50, 60, 70, 80})
		u := usersOn("o", 1, 2, 2)
		if r, _, err := act.Grab(ctx, u[0], nil); err != nil || r.Outcome != store.Granted {
			t.Fatalf("grab on shard 1: %+v, %v", r, err)
		}
		replica := dumpShard(t, ctx, c, act.Shard(1).Keys())
		if moved, err := act.Transfer(ctx, 1, 0, 2); err != nil || moved != 2 {
			t.Fatalf("Transfer(1→0, 2): %d, %v", moved, err)
		}
		v, err := act.ReadShards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var st redpacketv1alpha1.RedPacketActivityStatus
		st.Phase = redpacketv1alpha1.PhaseActive
		redpacketv1alpha1.SetCounters(&st, v.Whole.Counters())
		st.ShardWatermarks = v.Watermarks(&st)
		restoreShard(t, ctx, c, replica)
		if v, err = act.ReadShards(ctx); err != nil {
			t.Fatal(err)
		}
		if why := v.ShardBehind(&st); why == "" {
			t.Fatalf("shard 1 came back from before its transfer out and the view against the status does not say so")
		}
		fresh := store.NewActivity(c, "tm-status", 2)
		r, _, err := fresh.Grab(ctx, u[1], func(i int) store.Watermark { return statusMark(&st, i) })
		if err != nil || r.Outcome != store.Fenced {
			t.Fatalf("grab with the status's marks on the shard that came back: %+v, %v; want fenced", r, err)
		}
	})
}
