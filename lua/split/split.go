// Package split divides a total amount of money into packets.
//
// Every amount is an int64 in the currency's minor unit. A split always sums to the
// total exactly, gives every packet at least the minimum and at most the maximum
// (when one is set), and is reproducible: the same Params always yield the same
// packets, because randomness comes from a PCG generator seeded with Params.Seed.
//
// Three algorithms are offered:
//
//   - Random: WeChat's double-average. Each packet is uniform in
//     [min, 2 × remaining average]; the last packet takes the rest.
//   - LineCut: every packet gets the minimum, and the rest is cut at count − 1
//     uniform random points; the gaps between the points are the extras.
//   - Fixed: equal shares, with the remainder spread one minor unit at a time.
package split

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math/bits"
	"math/rand/v2"
	"slices"
)

// Algorithm names, as the RedPacketActivity's spec.distribution.type spells them.
const (
	// TypeRandom is the double-average split.
	TypeRandom = "Random"
	// TypeLineCut is the random cut-points split.
	TypeLineCut = "LineCut"
	// TypeFixed is the equal-shares split.
	TypeFixed = "Fixed"
)

// MaxCount is the largest number of packets Split accepts. It guards against
// allocating an absurd amount of memory for a mistyped count.
const MaxCount = 100_000_000

// ErrInvalidParams is wrapped by every error Split and Params.Validate return for
// parameters that cannot be split.
var ErrInvalidParams = errors.New("invalid split parameters")

// Params describe one split.
type Params struct {
	// Type is TypeRandom, TypeLineCut or TypeFixed.
	Type string
	// Total is the money to split, in minor units.
	Total int64
	// Count is the number of packets, at least 1.
	Count int64
	// Min is the smallest packet, at least 1.
	Min int64
	// Max caps every packet; 0 means no cap.
	Max int64
	// Seed seeds the random generator; equal seeds give equal splits.
	Seed int64
}

// Validate reports why the parameters cannot be split, or nil when they can. Its
// errors wrap ErrInvalidParams.
func (p Params) Validate() error {
	switch p.Type {
	case TypeRandom, TypeLineCut, TypeFixed:
	default:
		return fmt.Errorf("%w: type %q is not one of %s, %s or %s",
			ErrInvalidParams, p.Type, TypeRandom, TypeLineCut, TypeFixed)
	}
	if p.Count < 1 {
		return fmt.Errorf("%w: count %d is below 1", ErrInvalidParams, p.Count)
	}
	if p.Count > MaxCount {
		return fmt.Errorf("%w: count %d is above the limit of %d", ErrInvalidParams, p.Count, MaxCount)
	}
	if p.Min < 1 {
		return fmt.Errorf("%w: minimum %d is below 1", ErrInvalidParams, p.Min)
	}
	if p.Max < 0 {
		return fmt.Errorf("%w: maximum %d is negative", ErrInvalidParams, p.Max)
	}
	if p.Max != 0 && p.Max < p.Min {
		return fmt.Errorf("%w: maximum %d is below the minimum %d", ErrInvalidParams, p.Max, p.Min)
	}
	// total >= count × min, without computing a product that may overflow.
	if p.Total < 1 || p.Count > p.Total/p.Min {
		return fmt.Errorf("%w: total %d is less than count %d × minimum %d",
			ErrInvalidParams, p.Total, p.Count, p.Min)
	}
	// total <= count × max, that is ceil(total / count) <= max.
	if p.Max != 0 && (p.Total-1)/p.Count+1 > p.Max {
		return fmt.Errorf("%w: total %d is more than count %d × maximum %d",
			ErrInvalidParams, p.Total, p.Count, p.Max)
	}
	return nil
}

// Split divides p.Total into p.Count packets by p.Type. The result sums to p.Total
// exactly and every packet lies in [p.Min, p.Max] (p.Max 0: no upper bound).
func Split(p Params) ([]int64, error) {
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("splitting %d into %d packets: %w", p.Total, p.Count, err)
	}
	switch p.Type {
	case TypeRandom:
		return splitRandom(p), nil
	case TypeLineCut:
		return splitLineCut(p), nil
	default:
		return splitFixed(p), nil
	}
}

// SeedFromUID derives a split seed from a resource's UID: the FNV-64a hash of the
// UID, as a signed integer. It is stable across processes and versions.
func SeedFromUID(uid string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(uid))
	return int64(h.Sum64())
}

// pcgStream is the PCG stream selector; the seed picks the state.
const pcgStream = 0x9e3779b97f4a7c15

func newRand(seed int64) *rand.Rand {
	return rand.New(rand.NewPCG(uint64(seed), pcgStream))
}

// uniform returns an integer uniform in [lo, hi]; it requires 1 <= lo <= hi.
func uniform(r *rand.Rand, lo, hi int64) int64 {
	return lo + int64(r.Uint64N(uint64(hi-lo)+1))
}

// mulLE reports whether a × b <= c for non-negative a, b, c without overflow.
func mulLE(a, b, c int64) bool {
	if a == 0 || b == 0 {
		return true
	}
	return a <= c/b
}

// splitRandom is the double-average split. With R remaining for k packets it keeps
// k × min <= R <= k × max (max when set), so every bound below is satisfiable.
func splitRandom(p Params) []int64 {
	r := newRand(p.Seed)
	out := make([]int64, p.Count)
	rem := p.Total
	for i := range out {
		k := p.Count - int64(i)
		if k == 1 {
			out[i] = rem
			break
		}
		// floor(2R / k) without overflowing 2R.
		hi := 2*(rem/k) + 2*(rem%k)/k
		hi = min(hi, rem-(k-1)*p.Min)
		lo := p.Min
		if p.Max > 0 {
			hi = min(hi, p.Max)
			// The others can take at most (k-1) × max, so this one needs the rest
			// (only a bound when (k-1) × max <= R).
			if mulLE(k-1, p.Max, rem) {
				lo = max(lo, rem-(k-1)*p.Max)
			}
		}
		a := uniform(r, lo, hi)
		out[i] = a
		rem -= a
	}
	return out
}

// splitLineCut gives every packet the minimum and cuts the extra money
// (total − count × min) at count − 1 uniform points of [0, extra]; the gaps are the
// packets' extras. A maximum clamps the extras at max − min and hands the clamped
// excess back to the packets with room (see fillExcess).
func splitLineCut(p Params) []int64 {
	r := newRand(p.Seed)
	n := p.Count
	extra := p.Total - n*p.Min
	out := make([]int64, n)
	if extra > 0 {
		// Cut points in out[0 : n-1], sorted, then turned in place into gaps.
		for i := int64(0); i < n-1; i++ {
			out[i] = int64(r.Uint64N(uint64(extra) + 1))
		}
		sortInt64(out[:n-1])
		prev := extra
		for i := n - 1; i >= 1; i-- {
			cut := out[i-1]
			out[i] = prev - cut
			prev = cut
		}
		out[0] = prev
		if p.Max > 0 {
			fillExcess(r, out, p.Max-p.Min)
		}
	}
	for i := range out {
		out[i] += p.Min
	}
	return out
}

// fillExcess clamps every extra above limit to limit and gives the clamped excess
// back to the extras below limit. The caller guarantees that the room below the
// limit, summed, is at least the excess (total <= count × max).
//
// The excess is poured like water: every extra below the limit is raised by the
// same level L (or to the limit, whichever is lower), with L the largest level the
// excess pays for in full, found by bisection in at most 64 passes. The few units
// left over are fewer than the extras still below the limit, so they go one each
// to extras picked at random. It is exact integer arithmetic, never
// overflows and runs in O(64 × count) whatever the numbers.
func fillExcess(r *rand.Rand, extras []int64, limit int64) {
	var excess int64
	for i, e := range extras {
		if e > limit {
			excess += e - limit // the excess is part of the extra money: no overflow
			extras[i] = limit
		}
	}
	if excess == 0 {
		return
	}
	// poured(level) is how much raising every extra by level (capped at its room)
	// takes; it stops counting once it passes the excess, so it cannot overflow.
	poured := func(level int64) int64 {
		var sum int64
		for _, e := range extras {
			sum += min(limit-e, level)
			if sum > excess {
				return sum
			}
		}
		return sum
	}
	lo, hi := int64(0), min(limit, excess) // poured(lo) <= excess always
	for lo < hi {
		mid := lo + (hi-lo+1)/2
		if poured(mid) <= excess {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	level := lo
	var used, open int64
	for i, e := range extras {
		add := min(limit-e, level)
		extras[i] = e + add
		used += add
		if extras[i] < limit {
			open++
		}
	}
	left := excess - used
	if left == 0 {
		return
	}
	// poured(level+1) > excess means fewer units are left than extras with room;
	// hand them out one each to distinct extras chosen uniformly by selection
	// sampling (Knuth's algorithm S): one sequential pass, no index list.
	seen := int64(0)
	for i, e := range extras {
		if left == 0 {
			break
		}
		if e >= limit {
			continue
		}
		if int64(r.Uint64N(uint64(open-seen))) < left {
			extras[i]++
			left--
		}
		seen++
	}
}

// splitFixed gives every packet total / count and spreads the remainder r evenly:
// packet i gets one more unit when floor((i+1)·r / count) > floor(i·r / count),
// which marks exactly r packets spaced count / r apart.
func splitFixed(p Params) []int64 {
	n := p.Count
	q, rem := p.Total/n, p.Total%n
	out := make([]int64, n)
	for i := range out {
		out[i] = q
		if rem > 0 {
			// i+1 <= n <= MaxCount and rem < n, so the products fit comfortably.
			if (int64(i)+1)*rem/n > int64(i)*rem/n {
				out[i]++
			}
		}
	}
	return out
}

// sortInt64 sorts non-negative values in place. Large slices use an LSD radix sort
// (11-bit digits over the bits actually in use), which is several times faster than
// a comparison sort for millions of cut points.
func sortInt64(a []int64) {
	if len(a) < 4096 {
		slices.Sort(a)
		return
	}
	var top int64
	for _, v := range a {
		top = max(top, v)
	}
	width := bits.Len64(uint64(top))
	const digit = 11
	const buckets = 1 << digit
	buf := make([]int64, len(a))
	src, dst := a, buf
	var counts [buckets]int
	for shift := 0; shift < width; shift += digit {
		clear(counts[:])
		for _, v := range src {
			counts[(v>>shift)&(buckets-1)]++
		}
		pos := 0
		for i, c := range counts {
			counts[i] = pos
			pos += c
		}
		for _, v := range src {
			d := (v >> shift) & (buckets - 1)
			dst[counts[d]] = v
			counts[d]++
		}
		src, dst = dst, src
	}
	if &src[0] != &a[0] {
		copy(a, src)
	}
}
