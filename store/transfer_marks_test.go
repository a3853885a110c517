package store_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
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
// again: before the check that precedes transfer_in, the check fences it and the
// destination takes nothing; after it, while the destination applies them,
// transfer_done, which carries the mark the transfer_out answered with, fences the
// source at once, and a grab there is refused. A destination that comes back from before a transfer_in it applied is
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
		failedOver, seen := false, 0
		marks.onSaw = func(i int, w store.Watermark) {
			// Right after the check of shard 1 that comes before transfer_in (the
			// second answer of shard 1 after its transfer_out's): the failover.
			if i == 1 && !failedOver && w.TransferSeq > 0 {
				if seen++; seen == 2 {
					failedOver = true
					restoreShard(t, ctx, c, replica)
				}
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

	t.Run("source before the check", func(t *testing.T) {
		// The failover right after transfer_out answered, before the check that
		// precedes transfer_in: the destination never lists the packets, the source
		// that lists them again is fenced, and no packet is in two places.
		act := store.NewActivity(c, "tm-source-early", 2)
		seedOpenShards(t, ctx, act, []int64{10, 20, 30, 40, 50, 60, 70, 80})
		replica := dumpShard(t, ctx, c, act.Shard(1).Keys())
		marks := &marksKept{}
		failedOver := false
		marks.onSaw = func(i int, w store.Watermark) {
			if i == 1 && !failedOver && w.TransferSeq > 0 {
				failedOver = true
				restoreShard(t, ctx, c, replica)
			}
		}
		act.Marks = marks
		moved, err := act.Transfer(ctx, 1, 0, 2)
		if err != nil || moved != 0 || !failedOver {
			t.Fatalf("Transfer(1→0, 2): %d moved, %v, failed over %v; want none moved", moved, err, failedOver)
		}
		v, err := act.ReadShards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v.Shards[1].Fenced == "" || v.Shards[0].RemainingCount != 4 || v.Duplicated() {
			t.Fatalf("source fenced %q, destination lists %d, duplicated %v; want the source fenced and nothing duplicated",
				v.Shards[1].Fenced, v.Shards[0].RemainingCount, v.Duplicated())
		}
	})

	t.Run("two pods, a failover during the hold", func(t *testing.T) {
		// The window of the proof (apply's comment): pod B read the notes before pod
		// A's transfer noted its mark, and grants on the source after the source came
		// back from before the transfer_out and before pod A's check. Pod B grants a
		// packet the transfer had taken; pod A's check then fences the source, so the
		// destination never lists it: each packet is granted once, by one shard.
		podA := store.NewActivity(c, "tm-hold", 2)
		seedOpenShards(t, ctx, podA, []int64{10, 20, 30, 40, 50, 60, 70, 80})
		podB := store.NewActivity(c, "tm-hold", 2)
		marksA, marksB := &marksKept{}, &marksKept{}
		podA.Marks, podB.Marks = marksA, marksB
		u1, u0 := usersOn("o", 1, 2, 4), usersOn("z", 0, 2, 5)
		granted := map[string]string{}
		var claimed int64
		grab := func(u string) store.GrabResult {
			r, _, err := podB.Grab(ctx, u, marksB.Mark)
			if err != nil {
				t.Fatalf("pod B's grab of %s: %v", u, err)
			}
			if r.Outcome == store.Granted {
				if prev, dup := granted[r.PacketID]; dup {
					t.Errorf("packet %s granted to %s and again to %s", r.PacketID, prev, u)
				}
				granted[r.PacketID] = u
				claimed += r.Amount
			}
			return r
		}
		if r := grab(u1[0]); r.Outcome != store.Granted {
			t.Fatalf("pod B's first grab on shard 1: %+v", r)
		}
		replica := dumpShard(t, ctx, c, podA.Shard(1).Keys())
		var during []string
		failedOver := false
		marksA.onSaw = func(i int, w store.Watermark) {
			if i == 1 && !failedOver && w.TransferSeq > 0 {
				failedOver = true
				restoreShard(t, ctx, c, replica)
				for _, u := range u1[1:] {
					during = append(during, grab(u).PacketID)
				}
			}
		}
		moved, err := podA.Transfer(ctx, 1, 0, 2)
		if err != nil || moved != 0 || !failedOver {
			t.Fatalf("pod A's Transfer(1→0, 2): %d moved, %v, failed over %v; want none moved", moved, err, failedOver)
		}
		if !slices.Equal(during, []string{"4", "6", "8"}) {
			t.Fatalf("pod B's grabs on the source during the hold granted %v; want 4, 6 and 8, two of them packets the transfer took", during)
		}
		for _, u := range u0 {
			grab(u)
		}
		v, err := podA.ReadShards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v.Shards[1].Fenced == "" || v.Duplicated() || claimed > 360 {
			t.Fatalf("source fenced %q, duplicated %v, claimed %d of 360; want the source fenced and nothing granted twice",
				v.Shards[1].Fenced, v.Duplicated(), claimed)
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

// BenchmarkGrabSourceNotes measures what reading the shards' notes of their sources'
// transfer marks adds to a grab (Activity.Grab's freshMarks: a clock check per grab,
// and one HMGET per shard at most every DefaultMarkRefresh): rounds of 1,000 grants
// on one shard of a 2-shard activity through a handle with Marks (the grab
// service's case) and 1,000 through a handle without (no notes read), alternating on
// the same server (each going first in every other round), both sending the same
// watermark. It reports the client's wall
// time per grab, the median over the rounds of each, their ratio, and the note
// readings per 1,000 grabs.
func BenchmarkGrabSourceNotes(b *testing.B) {
	ctx := context.Background()
	c := redistest.Start(b).Client(b)
	if err := lua.LoadAll(ctx, c); err != nil {
		b.Fatal(err)
	}
	const rounds, perRound = 20, 1000
	var without, with, readings []float64
	run := 0
	for b.Loop() {
		b.StopTimer()
		run++
		uid := fmt.Sprintf("bench-notes-%d", run)
		withNotes := store.NewActivity(c, uid, 2)
		amounts := slices.Repeat([]int64{100}, 2*(2*rounds*perRound+2))
		p := store.SeedParams{Count: int64(len(amounts)), Total: sum(amounts), Sponsor: sponsor, Currency: "CNY"}
		if _, err := withNotes.Seed(ctx, amounts, p); err != nil {
			b.Fatal(err)
		}
		if _, err := withNotes.ConfigureWith(ctx, store.Settings{Open: true}); err != nil {
			b.Fatal(err)
		}
		marks := &marksKept{}
		withNotes.Marks = marks
		if moved, err := withNotes.Transfer(ctx, 1, 0, 1); err != nil || moved != 1 {
			b.Fatalf("transfer: %d, %v", moved, err)
		}
		plain := store.NewActivity(c, uid, 2)
		mark := marks.Mark(0)
		markOf := func(int) store.Watermark { return mark }
		users := usersOn("bench", 0, 2, 2*rounds*perRound)
		b.StartTimer()
		u := 0
		for round := range rounds {
			order := []*store.Activity{plain, withNotes}
			if round%2 == 1 {
				order[0], order[1] = withNotes, plain
			}
			for _, h := range order {
				hmget0 := commandCalls(b, ctx, c, "hmget")
				start := time.Now()
				for range perRound {
					r, _, err := h.Grab(ctx, users[u], markOf)
					u++
					if err != nil || r.Outcome != store.Granted {
						b.Fatalf("grab %d: %+v, %v", u, r, err)
					}
				}
				per := float64(time.Since(start).Microseconds()) / perRound
				if h == plain {
					without = append(without, per)
				} else {
					with = append(with, per)
					readings = append(readings, float64(commandCalls(b, ctx, c, "hmget")-hmget0)/2)
				}
			}
		}
	}
	median := func(v []float64) float64 {
		v = slices.Clone(v)
		slices.Sort(v)
		return v[len(v)/2]
	}
	b.ReportMetric(median(without), "no-notes-µs/grab")
	b.ReportMetric(median(with), "notes-µs/grab")
	b.ReportMetric(median(with)/median(without), "ratio")
	b.ReportMetric(median(readings), "readings/1000-grabs")
}

// commandCalls is how many times the server ran command name (INFO commandstats).
func commandCalls(tb testing.TB, ctx context.Context, c *redis.Client, name string) int64 {
	tb.Helper()
	info, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		tb.Fatalf("INFO commandstats: %v", err)
	}
	for line := range strings.Lines(info) {
		if rest, ok := strings.CutPrefix(line, "cmdstat_"+name+":calls="); ok {
			n, err := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
			if err != nil {
				tb.Fatalf("INFO commandstats %q: %v", line, err)
			}
			return n
		}
	}
	return 0
}
