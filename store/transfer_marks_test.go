package store_test

import (
	"strings"
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

// A handle that never saw a transfer still fences the shard that came back from
// before it, because the transfer's destination keeps the source's mark
// (transfer_in.lua, Activity.RecordedMark). Three shards, two handles with marks of
// their own (two grab pods): A moves packets out of shard 1, to shard 0 and then to
// shard 2; shard 1 comes back from before both. B's transfer out of shard 1 (a
// refill that picks it as the fullest sibling) takes nothing and fences it, and so
// does B's first grab there; the record is the highest of the siblings'.
func TestRecordedMarkReachesAHandleThatNeverSawTheTransfer(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := make([]int64, 30)
	for i := range amounts {
		amounts[i] = int64(10 * (i + 1))
	}

	for _, tc := range []struct {
		name string
		b    func(t *testing.T, b *store.Activity, marks *marksKept)
	}{
		{"transfer out of it", func(t *testing.T, b *store.Activity, _ *marksKept) {
			if moved, err := b.Transfer(ctx, 1, 0, 2); err != nil || moved != 0 {
				t.Fatalf("pod B's transfer out of the shard that came back: %d moved, %v; want none", moved, err)
			}
		}},
		{"grab on it", func(t *testing.T, b *store.Activity, marks *marksKept) {
			u := usersOn("o", 1, 3, 1)[0]
			if r, _, err := b.Grab(ctx, u, marks.Mark); err != nil || r.Outcome != store.Fenced {
				t.Fatalf("pod B's grab on the shard that came back: %+v, %v; want fenced", r, err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			uid := "tm-recorded-" + strings.ReplaceAll(tc.name, " ", "-")
			a := store.NewActivity(c, uid, 3)
			seedOpenShards(t, ctx, a, amounts)
			aMarks, bMarks := &marksKept{}, &marksKept{}
			a.Marks = aMarks
			b := store.NewActivity(c, uid, 3)
			b.Marks = bMarks
			// Pod B has used the activity before the transfer: its own mark of shard 1 is
			// from then.
			if _, err := b.ReadShards(ctx); err != nil {
				t.Fatal(err)
			}
			if w, err := b.RecordedMark(ctx, 1); err != nil || w != (store.Watermark{}) {
				t.Fatalf("recorded mark of shard 1 before any transfer: %+v, %v", w, err)
			}
			replica := dumpShard(t, ctx, c, a.Shard(1).Keys())
			if moved, err := a.Transfer(ctx, 1, 0, 2); err != nil || moved != 2 {
				t.Fatalf("Transfer(1→0): %d, %v", moved, err)
			}
			if moved, err := a.Transfer(ctx, 1, 2, 2); err != nil || moved != 2 {
				t.Fatalf("Transfer(1→2): %d, %v", moved, err)
			}
			// Each transfer took two steps on shard 1 (out, done): the second transfer_out
			// left it at 3, which shard 2 keeps; shard 0 keeps the first's, 1.
			if w, err := b.RecordedMark(ctx, 1); err != nil || w.TransferSeq != 3 {
				t.Fatalf("recorded mark of shard 1: %+v, %v; want transfer_seq 3 (shard 2's record)", w, err)
			}
			restoreShard(t, ctx, c, replica)
			tc.b(t, b, bMarks)
			v, err := b.ReadShards(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if v.Shards[1].Fenced == "" {
				t.Fatalf("shard 1 came back from before two transfers out of it and is not fenced")
			}
			if m := bMarks.Mark(1); m.TransferSeq < 3 {
				t.Errorf("pod B's mark of shard 1 is %+v; want the recorded transfer_seq 3", m)
			}
		})
	}

	t.Run("a record that is not a mark", func(t *testing.T) {
		a := store.NewActivity(c, "tm-recorded-bad", 2)
		seedOpenShards(t, ctx, a, amounts[:4])
		if err := c.HSet(ctx, a.Shard(0).Keys().Meta, "mark.1", "not a mark").Err(); err != nil {
			t.Fatal(err)
		}
		u := usersOn("o", 1, 2, 1)[0]
		if r, _, err := a.Grab(ctx, u, nil); err == nil {
			t.Fatalf("grab on shard 1 with shard 0's record of it unreadable: %+v; want an error, nothing granted", r)
		}
		if moved, err := a.Transfer(ctx, 0, 1, 1); err == nil || moved != 0 {
			t.Fatalf("transfer into shard 1: %d moved, %v; want refused", moved, err)
		}
	})
}
