package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// DefaultTransferBatch is the most packets one refill moves between shards.
const DefaultTransferBatch = 128

// ErrShardUnavailable is wrapped when packets are left only on shards that cannot
// give them now.
var ErrShardUnavailable = errors.New("the shard cannot give packets now")

// ErrUnsteady is returned when the shards' stock could not be read without packets
// moving between shards meanwhile, after several tries.
var ErrUnsteady = errors.New("packets kept moving between shards while their stock was read")

// stockReads is how many times Refill and ReadShards read every shard before they
// give up with ErrUnsteady.
const stockReads = 8

// Refill gives shard h packets from the sibling with the most, in one journalled
// transfer of up to TransferBatch. It returns true when h holds packets afterwards
// (moved now, or by someone else meanwhile), false when a steady reading found no
// packet listed or in transfer on any shard: the activity is sold out.
func (s *Activity) Refill(ctx context.Context, h int) (bool, error) {
	mu := &s.refill[h]
	mu.Lock()
	defer mu.Unlock()
	// Another caller may have refilled it while this one waited for the lock.
	if home, err := s.stockOf(ctx, h); err != nil {
		return false, err
	} else if home.listed > 0 {
		return true, nil
	}
	for range stockReads {
		stock, steady, err := s.readStock(ctx)
		if err != nil {
			return false, err
		}
		if stock[h].listed > 0 {
			return true, nil
		}
		src, journalled, held := -1, false, -1
		for i, st := range stock {
			if st.journal > 0 {
				journalled = true
			}
			if i != h && st.listed > 0 {
				held = i
			}
			// Only an open shard gives: a closed, fenced or missing one refuses, and one
			// whose window ended gives nothing (transfer_out checks the clock).
			if i != h && st.state == string(StateOpen) && st.listed > 0 && (src < 0 || st.listed > stock[src].listed) {
				src = i
			}
		}
		switch {
		case src >= 0:
			batch := int64(s.TransferBatch)
			if batch <= 0 {
				batch = DefaultTransferBatch
			}
			batch = max(1, min(batch, (stock[src].listed+1)/2))
			moved, err := s.Transfer(ctx, src, h, batch)
			if err != nil {
				return false, err
			}
			if moved > 0 {
				return true, nil
			}
		case journalled:
			if _, err := s.Resolve(ctx); err != nil {
				return false, err
			}
		case held >= 0:
			// Packets are left on a shard that cannot give them now (not open yet,
			// fenced): not sold out, and not grantable either.
			return false, fmt.Errorf("shard %d holds %d packets but is %q: %w", held, stock[held].listed, stock[held].state, ErrShardUnavailable)
		case steady:
			s.soldOutAt.Store(time.Now().UnixNano())
			return false, nil
		}
	}
	return false, ErrUnsteady
}

// shardStock is one shard's stock as stock.lua reads it.
type shardStock struct {
	seq, listed, journal, epoch int64
	state                       string
}

// readStock reads every shard's stock three times over (transfer sequences, stock,
// sequences again) and returns the middle reading. steady is true when no shard's
// sequence moved between the first and the last reading: no packet moved between
// shards while the stock was read, and grabs could only lower it, so the middle
// reading's zeroes were all true at once when it ended.
func (s *Activity) readStock(ctx context.Context) ([]shardStock, bool, error) {
	before, err := s.stockOnce(ctx)
	if err != nil {
		return nil, false, err
	}
	stock, err := s.stockOnce(ctx)
	if err != nil {
		return nil, false, err
	}
	after, err := s.stockOnce(ctx)
	if err != nil {
		return nil, false, err
	}
	for i := range before {
		if before[i].seq != after[i].seq {
			return stock, false, nil
		}
	}
	return stock, true, nil
}

// stockOnce reads every shard's stock, the shards in parallel.
func (s *Activity) stockOnce(ctx context.Context) ([]shardStock, error) {
	out := make([]shardStock, len(s.shards))
	err := s.eachShard(func(i int, _ *Shard) error {
		st, err := s.stockOf(ctx, i)
		out[i] = st
		return err
	})
	return out, err
}

// stockOf reads shard i's stock (stock.lua).
func (s *Activity) stockOf(ctx context.Context, i int) (shardStock, error) {
	a := s.shards[i]
	vals, err := a.call(ctx, lua.StockScript, []string{a.keys.Meta, a.keys.Packets, a.keys.Transfers}).Slice()
	if err != nil {
		return shardStock{}, fmt.Errorf("reading the stock of shard %d: %w", i, err)
	}
	if len(vals) != 5 {
		return shardStock{}, fmt.Errorf("reading the stock of shard %d: %d values, want 5", i, len(vals))
	}
	seq, _ := vals[0].(int64)
	listed, _ := vals[1].(int64)
	journal, _ := vals[2].(int64)
	state, _ := vals[3].(string)
	epoch, _ := vals[4].(int64)
	if state != "" {
		s.saw(i, epoch, seq)
	}
	return shardStock{seq: seq, listed: listed, journal: journal, state: state, epoch: epoch}, nil
}

// markOf is the caller's mark of shard i (Marks), the zero watermark without one.
func (s *Activity) markOf(i int) Watermark {
	if s.Marks == nil {
		return Watermark{}
	}
	return s.Marks.Mark(i)
}

// saw raises the caller's mark of shard i to the transfer sequence seq it was read
// at in epoch.
func (s *Activity) saw(i int, epoch, seq int64) {
	if s.Marks != nil {
		s.Marks.Saw(i, Watermark{Epoch: epoch, TransferSeq: seq})
	}
}

// sawReply raises the caller's mark of shard i to what a transfer script answered:
// its transfer sequence and epoch as decimal strings. It returns that mark.
func (s *Activity) sawReply(i int, seq, epoch string) (Watermark, error) {
	n, err := strconv.ParseInt(seq, 10, 64)
	if err != nil {
		return Watermark{}, fmt.Errorf("transfer_seq %q of shard %d: %w", seq, i, err)
	}
	e, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil {
		return Watermark{}, fmt.Errorf("epoch %q of shard %d: %w", epoch, i, err)
	}
	s.saw(i, e, n)
	return Watermark{Epoch: e, TransferSeq: n}, nil
}

// markField is the meta field in which a shard keeps the transfer mark of shard i
// of its siblings, "<epoch>:<transfer_seq>" (transfer_in.lua).
func markField(i int) string { return "mark." + strconv.Itoa(i) }

// RecordedMark is the highest transfer mark of shard i that its siblings keep: each
// destination of a transfer out of i records, in the same step that lists the
// packets there (transfer_in.lua), the transfer_seq and epoch that i reached with the
// transfer_out. A shard that comes back from before a transfer out of it lists again
// packets a sibling holds, and only the sibling knows; so a caller that never saw
// the transfer (another grab pod) learns the mark here, from the shards that
// survived, and sends it with its next grab or transfer on i, which fences i before
// it grants or gives a packet. The record lasts as long as the packets it protects:
// a destination that comes back from before the transfer_in lost the packets with
// it. It raises Marks. With one shard it is the zero watermark, read from nowhere.
//
// It reads one meta field on every sibling, in one pipeline (one HGET for two
// shards): Grab pays it once per grab of a sharded activity, a round trip before the
// grab script (docs/architecture.md, "What it costs"). A sibling that cannot be read
// fails it: the record may be there. (Grab then goes on with the marks the caller
// learnt before; a record that is not a mark refuses the grab.)
func (s *Activity) RecordedMark(ctx context.Context, i int) (Watermark, error) {
	n := len(s.shards)
	if n == 1 {
		return Watermark{}, nil
	}
	if i < 0 || i >= n {
		return Watermark{}, fmt.Errorf("the transfer mark of shard %d of %d", i, n)
	}
	field := s.markFields[i]
	var w Watermark
	if n == 2 {
		a := s.shards[1-i]
		v, err := a.c.HGet(ctx, a.keys.Meta, field).Result()
		if w, err = a.keptMark(field, v, err); err != nil {
			return Watermark{}, fmt.Errorf("shard %d: %w", 1-i, err)
		}
	} else {
		cmds := make([]*redis.StringCmd, n)
		// Exec's error is the first command's that failed, a field that is not there
		// included: each command is judged on its own below.
		_, _ = s.shards[0].c.Pipelined(ctx, func(p redis.Pipeliner) error {
			for j, a := range s.shards {
				if j != i {
					cmds[j] = p.HGet(ctx, a.keys.Meta, field)
				}
			}
			return nil
		})
		for j, cmd := range cmds {
			if cmd == nil {
				continue
			}
			v, err := cmd.Result()
			k, err := s.shards[j].keptMark(field, v, err)
			if err != nil {
				return Watermark{}, fmt.Errorf("shard %d: %w", j, err)
			}
			w = w.Raise(k)
		}
	}
	if w != (Watermark{}) && s.Marks != nil {
		s.Marks.Saw(i, w)
	}
	return w, nil
}

// keptMark reads the answer v, err of an HGET of the meta field named field, in
// which this shard keeps the transfer mark of a sibling: the zero watermark when it
// keeps none.
func (a *Shard) keptMark(field, v string, err error) (Watermark, error) {
	if errors.Is(err, redis.Nil) {
		return Watermark{}, nil
	}
	if err != nil {
		return Watermark{}, fmt.Errorf("reading %s of %s: %w", field, a.keys.Meta, err)
	}
	e, seq, ok := strings.Cut(v, ":")
	epoch, err1 := strconv.ParseInt(e, 10, 64)
	n, err2 := strconv.ParseInt(seq, 10, 64)
	if !ok || len(v) > 41 || err1 != nil || err2 != nil || epoch < 0 || n < 0 {
		return Watermark{}, fmt.Errorf("%w: %s of %s is %d bytes that are not <epoch>:<transfer_seq>", errCorruptMark, field, a.keys.Meta, len(v))
	}
	return Watermark{Epoch: epoch, TransferSeq: n}, nil
}

// errCorruptMark is wrapped by RecordedMark's error when a sibling keeps something
// that is not a transfer mark (only a write outside the scripts makes one): the mark
// cannot be known, and nothing is granted on the shard it describes.
var errCorruptMark = errors.New("a transfer mark that is not one")

// siblingMarkTimeout bounds Grab's read of the siblings' transfer marks: a sibling
// whose master does not answer by then (down, or failing over) is skipped, so one
// master's outage does not stop the grabs of the shards on the others.
const siblingMarkTimeout = 100 * time.Millisecond

// transfer is a journal entry: "<dest>|<count>|<amount>|<id>:<amount>,...".
type transfer struct {
	dest          int
	count, amount int64
	packets       []string
}

func parseTransfer(entry string) (transfer, error) {
	parts := strings.SplitN(entry, "|", 4)
	if len(parts) != 4 {
		return transfer{}, fmt.Errorf("transfer journal entry %q: want dest|count|amount|packets", entry)
	}
	var t transfer
	var err error
	if t.dest, err = strconv.Atoi(parts[0]); err != nil {
		return transfer{}, fmt.Errorf("transfer journal entry %q: destination: %w", entry, err)
	}
	if t.count, err = strconv.ParseInt(parts[1], 10, 64); err != nil {
		return transfer{}, fmt.Errorf("transfer journal entry %q: count: %w", entry, err)
	}
	if t.amount, err = strconv.ParseInt(parts[2], 10, 64); err != nil {
		return transfer{}, fmt.Errorf("transfer journal entry %q: amount: %w", entry, err)
	}
	t.packets = strings.Split(parts[3], ",")
	if int64(len(t.packets)) != t.count {
		return transfer{}, fmt.Errorf("transfer journal entry: %d packets, count says %d", len(t.packets), t.count)
	}
	return t, nil
}

// Transfer moves up to batch packets from shard src to shard dst in one journalled
// transfer and returns how many moved (0 when src had none, or is closed, ended or
// fenced). Refill uses it; so may an operator's rebalancing. With Marks, a source or
// destination below its mark is fenced by the script that finds it so, and gives
// or takes nothing.
func (s *Activity) Transfer(ctx context.Context, src, dst int, batch int64) (int64, error) {
	if src < 0 || src >= len(s.shards) || dst < 0 || dst >= len(s.shards) || src == dst {
		return 0, fmt.Errorf("transfer from shard %d to shard %d of %d", src, dst, len(s.shards))
	}
	kept, err := s.RecordedMark(ctx, src)
	if err != nil {
		return 0, fmt.Errorf("transfer out of shard %d: the siblings' transfer marks: %w", src, err)
	}
	id := s.idPrefix + strconv.FormatUint(s.nextID.Add(1), 10)
	a := s.shards[src]
	mark := s.markOf(src).Raise(kept)
	vals, err := a.call(ctx, lua.TransferOutScript, []string{a.keys.Meta, a.keys.Packets, a.keys.Transfers},
		id, dst, batch, mark.TransferSeq, mark.Epoch).StringSlice()
	if err != nil {
		return 0, fmt.Errorf("transfer %s out of shard %d: %w", id, src, err)
	}
	if len(vals) != 4 {
		return 0, fmt.Errorf("transfer %s out of shard %d: %d values, want 4", id, src, len(vals))
	}
	out, err := s.sawReply(src, vals[2], vals[3])
	if err != nil {
		return 0, fmt.Errorf("transfer %s out: %w", id, err)
	}
	if vals[0] != "moved" && vals[0] != "pending" {
		return 0, nil // empty, closed, ended, fenced or missing: nothing left the source
	}
	return s.apply(ctx, src, id, vals[1], out)
}

// replicated waits for shard i's replicas when Replicated is set.
func (s *Activity) replicated(ctx context.Context, i int, what string) error {
	if s.Replicated == nil {
		return nil
	}
	if err := s.Replicated(ctx, i); err != nil {
		return fmt.Errorf("%s: shard %d's replicas: %w", what, i, err)
	}
	return nil
}

// apply finishes the journalled transfer id of shard src: once the source's replicas
// hold the entry (Replicated), the destination applies it (at most once, whoever
// calls) and keeps srcMark, the transfer mark the source reached with the entry's
// transfer_out or later (RecordedMark), and once the destination's replicas hold
// that, the source forgets it. It returns how many
// packets the destination holds from it, 0 when the destination refused (closed,
// fenced or missing): the entry then stays in the journal and the packets stay out
// of every list, counted by the refund at close.
func (s *Activity) apply(ctx context.Context, src int, id, entry string, srcMark Watermark) (int64, error) {
	t, err := parseTransfer(entry)
	if err != nil {
		return 0, fmt.Errorf("shard %d: %w", src, err)
	}
	if t.dest < 0 || t.dest >= len(s.shards) || t.dest == src {
		return 0, fmt.Errorf("transfer %s of shard %d names destination %d of %d shards", id, src, t.dest, len(s.shards))
	}
	if err := s.replicated(ctx, src, "transfer "+id+" out"); err != nil {
		return 0, err
	}
	d := s.shards[t.dest]
	kept, err := s.RecordedMark(ctx, t.dest)
	if err != nil {
		return 0, fmt.Errorf("transfer %s into shard %d: the siblings' transfer marks: %w", id, t.dest, err)
	}
	dmark := s.markOf(t.dest).Raise(kept)
	args := make([]any, 0, 8+len(t.packets))
	args = append(args, id, t.count, t.amount, dmark.TransferSeq, dmark.Epoch, src, srcMark.TransferSeq, srcMark.Epoch)
	for _, p := range t.packets {
		args = append(args, p)
	}
	res, err := d.call(ctx, lua.TransferInScript, []string{d.keys.Meta, d.keys.Packets, d.keys.Applied}, args...).StringSlice()
	if err != nil {
		return 0, fmt.Errorf("transfer %s into shard %d: %w", id, t.dest, err)
	}
	if len(res) != 3 {
		return 0, fmt.Errorf("transfer %s into shard %d: %d values, want 3", id, t.dest, len(res))
	}
	if _, err := s.sawReply(t.dest, res[1], res[2]); err != nil {
		return 0, fmt.Errorf("transfer %s in: %w", id, err)
	}
	if res[0] != "applied" {
		return 0, nil
	}
	if err := s.replicated(ctx, t.dest, "transfer "+id+" in"); err != nil {
		return 0, err
	}
	a := s.shards[src]
	smark := s.markOf(src)
	done, err := a.call(ctx, lua.TransferDoneScript, []string{a.keys.Meta, a.keys.Transfers}, id,
		smark.TransferSeq, smark.Epoch).StringSlice()
	if err != nil {
		return 0, fmt.Errorf("transfer %s done on shard %d: %w", id, src, err)
	}
	if len(done) != 3 {
		return 0, fmt.Errorf("transfer %s done on shard %d: %d values, want 3", id, src, len(done))
	}
	if _, err := s.sawReply(src, done[1], done[2]); err != nil {
		return 0, fmt.Errorf("transfer %s done: %w", id, err)
	}
	// Fenced or not, the destination holds the packets now: a source fenced here
	// (below its mark: it lost the transfer_out) grants nothing more.
	return t.count, nil
}

// Resolve finishes every transfer left in a journal (by a process that died between
// the halves, or one racing this call: applying is idempotent). It returns how many
// transfers are still journalled because their destination refused them.
func (s *Activity) Resolve(ctx context.Context) (int, error) {
	var left atomic.Int64
	err := s.eachShard(func(i int, a *Shard) error {
		entries, err := a.c.HGetAll(ctx, a.keys.Transfers).Result()
		if err != nil {
			return fmt.Errorf("reading its transfer journal: %w", err)
		}
		if len(entries) == 0 {
			return nil
		}
		// Read after the journal, the shard's transfer_seq is at least the one its
		// entries' transfer_outs reached: the mark the destinations keep of it.
		st, err := s.stockOf(ctx, i)
		if err != nil {
			return err
		}
		out := Watermark{Epoch: st.epoch, TransferSeq: st.seq}
		for id, entry := range entries {
			n, err := s.apply(ctx, i, id, entry, out)
			if err != nil {
				return err
			}
			if n == 0 {
				left.Add(1)
			}
		}
		return nil
	})
	return int(left.Load()), err
}
