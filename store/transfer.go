package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

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
// its transfer sequence and epoch as decimal strings.
func (s *Activity) sawReply(i int, seq, epoch string) error {
	n, err := strconv.ParseInt(seq, 10, 64)
	if err != nil {
		return fmt.Errorf("transfer_seq %q of shard %d: %w", seq, i, err)
	}
	e, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil {
		return fmt.Errorf("epoch %q of shard %d: %w", epoch, i, err)
	}
	s.saw(i, e, n)
	return nil
}

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
	id := s.idPrefix + strconv.FormatUint(s.nextID.Add(1), 10)
	a := s.shards[src]
	mark := s.markOf(src)
	vals, err := a.call(ctx, lua.TransferOutScript, []string{a.keys.Meta, a.keys.Packets, a.keys.Transfers},
		id, dst, batch, mark.TransferSeq, mark.Epoch).StringSlice()
	if err != nil {
		return 0, fmt.Errorf("transfer %s out of shard %d: %w", id, src, err)
	}
	if len(vals) != 4 {
		return 0, fmt.Errorf("transfer %s out of shard %d: %d values, want 4", id, src, len(vals))
	}
	if err := s.sawReply(src, vals[2], vals[3]); err != nil {
		return 0, fmt.Errorf("transfer %s out: %w", id, err)
	}
	if vals[0] != "moved" && vals[0] != "pending" {
		return 0, nil // empty, closed, ended, fenced or missing: nothing left the source
	}
	return s.apply(ctx, src, id, vals[1])
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
// calls), and once the destination's replicas hold that, the source forgets it. It returns how many
// packets the destination holds from it, 0 when the destination refused (closed,
// fenced or missing): the entry then stays in the journal and the packets stay out
// of every list, counted by the refund at close.
func (s *Activity) apply(ctx context.Context, src int, id, entry string) (int64, error) {
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
	dmark := s.markOf(t.dest)
	args := make([]any, 0, 5+len(t.packets))
	args = append(args, id, t.count, t.amount, dmark.TransferSeq, dmark.Epoch)
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
	if err := s.sawReply(t.dest, res[1], res[2]); err != nil {
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
	if err := s.sawReply(src, done[1], done[2]); err != nil {
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
		for id, entry := range entries {
			n, err := s.apply(ctx, i, id, entry)
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
