package store

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// SeedParams are the activity's facts written at commit.
type SeedParams struct {
	Count   int64
	Total   int64
	StartMs int64
	EndMs   int64
	Paused  bool
	Sponsor string
	// Currency is recorded in every settlement entry.
	Currency string

	// whole, set on shard 0's commit only, is the activity's count and total over
	// all its shards, recorded in the same atomic step as shard 0's packets.
	whole *wholeFigures
}

// wholeFigures are the activity's figures that shard 0 records for every shard.
type wholeFigures struct {
	count, total int64
	shards       int
}

// DefaultChunkSize is how many packets one staging call appends.
const DefaultChunkSize = 10000

// Seeder writes an activity's packets into Redis exactly once: it appends them to a
// staging list in chunks (each chunk lands once, at its offset, even when the seeder
// is retried or runs twice at the same time) and then commits the complete list in
// one atomic step guarded by the activity's marker.
type Seeder struct {
	// ChunkSize is how many packets one staging call appends; 0 means DefaultChunkSize.
	ChunkSize int
	// AfterChunk, when set, runs after each staged chunk with the staged length. An
	// error stops seeding there, as a crash would.
	AfterChunk func(staged int64) error
	// ScriptOnly stages every chunk through seed_stage.lua, never with the
	// optimistic transaction (stageDirect); for tests of the script.
	ScriptOnly bool
	// IDStride and IDOffset number the packets: packet i (from 0) gets the id
	// i*IDStride + IDOffset + 1. The zero values number them 1, 2, 3, ...; shard k of
	// n gets stride n and offset k, so ids stay unique across an activity's shards.
	IDStride, IDOffset int64
}

// packetID is the id of the i-th packet (from 0) this seeder stages.
func (s Seeder) packetID(i int64) int64 {
	stride := s.IDStride
	if stride <= 0 {
		stride = 1
	}
	return i*stride + s.IDOffset + 1
}

// SeedResult says what Seed did.
type SeedResult struct {
	// Committed is true when this call committed the activity, false when it had
	// been committed before (the existing data is adopted untouched).
	Committed bool
}

// Seed seeds the split amounts (packet i+1 gets amounts[i]) over the shards: packet
// j goes to shard j mod n and keeps its id j+1, so ids are unique across shards and
// every shard gets an even share of large and small packets. Each shard is seeded
// exactly once (Seeder); shard 0's commit also records the activity's count and
// total, the figures conservation is checked against, in the same atomic step, so
// that no interruption can leave a committed activity without them. Committed is
// true when any shard was committed by this call.
func (s *Activity) Seed(ctx context.Context, amounts []int64, p SeedParams) (SeedResult, error) {
	n := len(s.shards)
	if err := checkSplit(amounts, p); err != nil {
		return SeedResult{}, err
	}
	if p.Count < int64(n) {
		return SeedResult{}, fmt.Errorf("seeding: %d packets cannot fill %d shards", p.Count, n)
	}
	var res SeedResult
	for i, a := range s.shards {
		part := make([]int64, 0, (len(amounts)+n-1)/n)
		var total int64
		for j := i; j < len(amounts); j += n {
			part = append(part, amounts[j])
			total += amounts[j]
		}
		sp := p
		sp.Count, sp.Total = int64(len(part)), total
		if i == 0 {
			sp.whole = &wholeFigures{count: p.Count, total: p.Total, shards: n}
		}
		seeder := s.Seeder
		seeder.IDStride, seeder.IDOffset = int64(n), int64(i)
		r, err := seeder.seed(ctx, a.c, a.keys, part, sp)
		if err != nil {
			return SeedResult{}, fmt.Errorf("shard %d: %w", i, err)
		}
		res.Committed = res.Committed || r.Committed
	}
	return res, nil
}

// seed stages amounts (packet i+1 gets amounts[i]) on the shard whose keys are k and
// commits them. amounts must be positive and sum to p.Total, with len(amounts) ==
// p.Count.
func (s Seeder) seed(ctx context.Context, c redis.Scripter, k Keys, amounts []int64, p SeedParams) (SeedResult, error) {
	if err := checkSplit(amounts, p); err != nil {
		return SeedResult{}, err
	}
	chunk := s.ChunkSize
	if chunk <= 0 {
		chunk = DefaultChunkSize
	}

	fp := fingerprint(amounts)
	// Ask where staging stands with an empty chunk at offset -1, which never matches.
	staged, err := s.stage(ctx, c, k, -1, fp, nil)
	if err != nil {
		return SeedResult{}, err
	}
	sums := prefixSums{amounts: amounts}
	for staged >= 0 && staged < p.Count {
		end := min(staged+int64(chunk), p.Count)
		args := make([]any, 0, end-staged+2)
		args = append(args, staged, fp)
		before := sums.upTo(staged)
		for i := staged; i < end; i++ {
			args = append(args, packetEntry(s.packetID(i), amounts[i], i, before))
			before += amounts[i]
		}
		next, err := s.stageChunk(ctx, c, k, staged, fp, args)
		if err != nil {
			return SeedResult{}, err
		}
		staged = next
		if s.AfterChunk != nil && staged >= 0 {
			if err := s.AfterChunk(staged); err != nil {
				return SeedResult{}, err
			}
		}
	}
	if staged > p.Count {
		return SeedResult{}, fmt.Errorf("seeding: staging holds %d packets, more than the %d declared", staged, p.Count)
	}
	paused := "0"
	if p.Paused {
		paused = "1"
	}
	args := []any{p.Count, p.Total, p.StartMs, p.EndMs, paused, p.Sponsor, p.Currency}
	if w := p.whole; w != nil {
		args = append(args, w.count, w.total, w.shards)
	}
	n, err := lua.SeedCommitScript.Run(ctx, c, []string{k.Meta, k.Staging, k.Packets}, args...).Int64()
	if err != nil {
		return SeedResult{}, fmt.Errorf("seed commit: %w", err)
	}
	return SeedResult{Committed: n == 1}, nil
}

// checkSplit checks that amounts are p.Count positive amounts summing to p.Total.
func checkSplit(amounts []int64, p SeedParams) error {
	if int64(len(amounts)) != p.Count {
		return fmt.Errorf("seeding: %d packets, want %d", len(amounts), p.Count)
	}
	var sum int64
	for i, a := range amounts {
		if a <= 0 {
			return fmt.Errorf("seeding: packet %d has amount %d", i+1, a)
		}
		sum += a
	}
	if sum != p.Total {
		return fmt.Errorf("seeding: packets sum to %d, want %d", sum, p.Total)
	}
	return nil
}

// packetEntry is a packet as the packets list holds it,
// "<id>:<amount>@<countBefore>:<amountBefore>": the packets and the money claimed
// from the list before it, which the seeder, numbering the list from its head, gives
// as the packets ahead of it (see grab.lua: the head's numbers are the claimed count
// and amount, so no grab reads or raises a counter).
func packetEntry(id, amount, countBefore, amountBefore int64) string {
	b := make([]byte, 0, 48)
	b = strconv.AppendInt(b, id, 10)
	b = append(b, ':')
	b = strconv.AppendInt(b, amount, 10)
	b = append(b, '@')
	b = strconv.AppendInt(b, countBefore, 10)
	b = append(b, ':')
	b = strconv.AppendInt(b, amountBefore, 10)
	return string(b)
}

// prefixSums reads sums of amounts[:n] for n that mostly grow, as staging's offset
// does, in one pass over the amounts.
type prefixSums struct {
	amounts []int64
	n, sum  int64
}

// upTo returns the sum of amounts[:n].
func (p *prefixSums) upTo(n int64) int64 {
	if n < p.n {
		p.n, p.sum = 0, 0
	}
	for ; p.n < n; p.n++ {
		p.sum += p.amounts[p.n]
	}
	return p.sum
}

// stageChunk appends one chunk (args: the offset and fingerprint, then the packets)
// with a plain RPUSH in an optimistic transaction when the client can run one
// (stageDirect), and through seed_stage.lua otherwise, or when staging holds another
// split.
func (s Seeder) stageChunk(ctx context.Context, c redis.Scripter, k Keys, offset int64, fp string, args []any) (int64, error) {
	if w, ok := c.(watcher); ok && !s.ScriptOnly {
		n, err := stageDirect(ctx, w, k, offset, fp, args[2:])
		if !errors.Is(err, errStageByScript) {
			return n, err
		}
	}
	return s.stage(ctx, c, k, offset, fp, args)
}

// stage runs one staging call; args is the offset and fingerprint followed by the
// chunk's entries.
func (s Seeder) stage(ctx context.Context, c redis.Scripter, k Keys, offset int64, fp string, args []any) (int64, error) {
	if args == nil {
		args = []any{offset, fp}
	}
	n, err := lua.SeedStageScript.Run(ctx, c, []string{k.Meta, k.Staging}, args...).Int64()
	if err != nil {
		return 0, fmt.Errorf("seed stage at %d: %w", offset, err)
	}
	return n, nil
}

// fingerprint identifies a split by its amounts, so staging never mixes two splits.
func fingerprint(amounts []int64) string {
	h := sha256.New()
	buf := make([]byte, 8)
	for _, a := range amounts {
		binary.LittleEndian.PutUint64(buf, uint64(a))
		h.Write(buf)
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}
