package split_test

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"redpacket.io/operator/lua/split"
)

var allTypes = []string{split.TypeRandom, split.TypeLineCut, split.TypeFixed}

// check asserts every invariant of a split: one packet per count, the exact total,
// every packet within [min, max] and positive.
func check(tb testing.TB, p split.Params, got []int64) {
	tb.Helper()
	if int64(len(got)) != p.Count {
		tb.Fatalf("%+v: %d packets, want %d", p, len(got), p.Count)
	}
	sum := new(big.Int)
	for i, a := range got {
		if a <= 0 {
			tb.Fatalf("%+v: packet %d is %d, not positive", p, i, a)
		}
		if a < p.Min {
			tb.Fatalf("%+v: packet %d is %d, below the minimum", p, i, a)
		}
		if p.Max > 0 && a > p.Max {
			tb.Fatalf("%+v: packet %d is %d, above the maximum", p, i, a)
		}
		sum.Add(sum, big.NewInt(a))
	}
	if sum.Cmp(big.NewInt(p.Total)) != 0 {
		tb.Fatalf("%+v: packets sum to %s, want %d", p, sum, p.Total)
	}
}

func mustSplit(tb testing.TB, p split.Params) []int64 {
	tb.Helper()
	got, err := split.Split(p)
	if err != nil {
		tb.Fatalf("Split(%+v): %v", p, err)
	}
	check(tb, p, got)
	return got
}

// randomParams draws valid parameters of every shape: tiny and huge totals, tight
// and loose minimums and maximums, and the edges total = count × min and
// total = count × max.
func randomParams(r *rand.Rand, typ string) split.Params {
	p := split.Params{Type: typ, Seed: r.Int64()}
	switch r.IntN(4) {
	case 0:
		p.Count = 1 + r.Int64N(3)
	case 1:
		p.Count = 1 + r.Int64N(50)
	default:
		p.Count = 1 + r.Int64N(3000)
	}
	switch r.IntN(3) {
	case 0:
		p.Min = 1
	case 1:
		p.Min = 1 + r.Int64N(100)
	default:
		p.Min = 1 + r.Int64N(1_000_000_000)
	}
	floor := p.Count * p.Min
	switch r.IntN(6) {
	case 0: // the minimum exactly
		p.Total = floor
	case 1: // a little above
		p.Total = floor + r.Int64N(p.Count+1)
	case 2: // huge, around 1e15
		p.Total = floor + 1_000_000_000_000_000 - r.Int64N(1_000_000)
	default:
		p.Total = floor + r.Int64N(100*p.Count+1)
	}
	switch r.IntN(4) {
	case 0: // no cap
	case 1: // the tightest cap: total = count × max when divisible
		p.Max = (p.Total + p.Count - 1) / p.Count
	default: // a cap somewhere between the tightest and twice the average
		least := (p.Total + p.Count - 1) / p.Count
		p.Max = least + r.Int64N(least+1)
	}
	if p.Max != 0 && p.Max < p.Min {
		p.Max = p.Min
	}
	return p
}

func TestSplitProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, typ := range allTypes {
		t.Run(typ, func(t *testing.T) {
			for range 3000 {
				p := randomParams(r, typ)
				got := mustSplit(t, p)
				again := mustSplit(t, p)
				if !slices.Equal(got, again) {
					t.Fatalf("%+v: two splits with the same seed differ", p)
				}
			}
		})
	}
}

func TestSplitEdges(t *testing.T) {
	const huge = 1_000_000_000_000_000
	cases := []split.Params{
		{Total: 1, Count: 1, Min: 1},
		{Total: 7, Count: 1, Min: 1},
		{Total: 7, Count: 1, Min: 7, Max: 7},
		{Total: 100, Count: 100, Min: 1},
		{Total: 500, Count: 100, Min: 5},
		{Total: 500, Count: 100, Min: 1, Max: 5},
		{Total: 500, Count: 100, Min: 5, Max: 5},
		{Total: 499, Count: 100, Min: 1, Max: 5},
		{Total: 501, Count: 100, Min: 5, Max: 6},
		{Total: huge, Count: 1, Min: 1},
		{Total: huge, Count: 3, Min: 1},
		{Total: huge, Count: 5000, Min: 1},
		{Total: huge, Count: 5000, Min: huge / 5000},
		{Total: huge, Count: 5000, Min: 1, Max: huge / 5000},
		{Total: huge, Count: 5000, Min: 1, Max: huge/5000 + 1},
		{Total: huge, Count: 2, Min: 1, Max: huge - 1},
		{Total: math.MaxInt64, Count: 1, Min: 1},
		{Total: math.MaxInt64, Count: 7, Min: 1},
		{Total: math.MaxInt64, Count: 7, Min: 1, Max: math.MaxInt64},
		{Total: math.MaxInt64, Count: 7, Min: math.MaxInt64 / 7, Max: math.MaxInt64/7 + 1},
		{Total: math.MaxInt64, Count: 1000, Min: 1, Max: math.MaxInt64/1000 + 1},
		{Total: 2_000_000, Count: 1_000_000, Min: 1},
	}
	for _, c := range cases {
		for _, typ := range allTypes {
			for seed := range int64(5) {
				p := c
				p.Type, p.Seed = typ, seed*7919-3
				mustSplit(t, p)
			}
		}
	}
}

func TestSplitMillion(t *testing.T) {
	for _, typ := range allTypes {
		for _, p := range []split.Params{
			{Type: typ, Total: 200_000_000, Count: 1_000_000, Min: 1, Seed: 42},
			{Type: typ, Total: 200_000_000, Count: 1_000_000, Min: 50, Max: 400, Seed: 42},
			{Type: typ, Total: 1_000_000_000_000_000, Count: 1_000_000, Min: 1, Seed: -9},
		} {
			mustSplit(t, p)
		}
	}
}

func TestSplitTightCapHasNoRoom(t *testing.T) {
	// total = count × max: the only split is every packet at the maximum.
	for _, typ := range allTypes {
		p := split.Params{Type: typ, Total: 300_000, Count: 1000, Min: 1, Max: 300, Seed: 5}
		for i, a := range mustSplit(t, p) {
			if a != 300 {
				t.Fatalf("%s: packet %d is %d, want 300", typ, i, a)
			}
		}
		// total = count × min: every packet at the minimum.
		p = split.Params{Type: typ, Total: 3000, Count: 1000, Min: 3, Seed: 5}
		for i, a := range mustSplit(t, p) {
			if a != 3 {
				t.Fatalf("%s: packet %d is %d, want 3", typ, i, a)
			}
		}
	}
}

func TestSplitSeedMatters(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, typ := range []string{split.TypeRandom, split.TypeLineCut} {
		same, tried := 0, 0
		for range 500 {
			p := randomParams(r, typ)
			// Only parameters with real freedom: several packets and room to vary.
			if p.Count < 10 || p.Total-p.Count*p.Min < 1000 ||
				(p.Max != 0 && p.Count*p.Max-p.Total < 1000) {
				continue
			}
			tried++
			a := mustSplit(t, p)
			p.Seed++
			b := mustSplit(t, p)
			if slices.Equal(a, b) {
				same++
			}
		}
		if tried < 100 {
			t.Fatalf("%s: only %d parameter sets with freedom were drawn", typ, tried)
		}
		if same != 0 {
			t.Fatalf("%s: %d of %d splits did not change with the seed", typ, same, tried)
		}
	}
	// Fixed ignores the seed.
	p := split.Params{Type: split.TypeFixed, Total: 1001, Count: 10, Min: 1, Seed: 1}
	a := mustSplit(t, p)
	p.Seed = 2
	if b := mustSplit(t, p); !slices.Equal(a, b) {
		t.Fatalf("fixed split changed with the seed: %v vs %v", a, b)
	}
}

func TestSplitKnownValuesAreStable(t *testing.T) {
	// The split of a given activity must never change between releases: a
	// controller that re-splits after an upgrade must get the very same packets.
	// These fingerprints pin the generator and the algorithms.
	for _, c := range []struct {
		p    split.Params
		want string
	}{
		{split.Params{Type: split.TypeFixed, Total: 23, Count: 5, Min: 1}, "[4 5 4 5 5]"},
		{split.Params{Type: split.TypeFixed, Total: 10, Count: 4, Min: 1}, "[2 3 2 3]"},
	} {
		if got := fmt.Sprint(mustSplit(t, c.p)); got != c.want {
			t.Errorf("%+v: got %s, want %s", c.p, got, c.want)
		}
	}
	for typ, want := range map[string]string{
		split.TypeRandom:  "[896 471 344 424 117 79 443 14 484 996 188 195 196 499 703 899 775 653 938 686]",
		split.TypeLineCut: "[224 731 485 771 157 92 1000 840 173 489 164 155 301 1000 680 814 684 114 1000 126]",
	} {
		p := split.Params{Type: typ, Total: 10_000, Count: 20, Min: 1, Max: 1000, Seed: 20261231}
		if got := fmt.Sprint(mustSplit(t, p)); got != want {
			t.Errorf("%s: got %s, want %s", typ, got, want)
		}
	}
}

func TestFixedSpreadsTheRemainder(t *testing.T) {
	for _, c := range []struct{ total, count int64 }{{1003, 10}, {10_007, 1000}, {1999, 1000}, {5, 3}, {1_000_000, 7}} {
		p := split.Params{Type: split.TypeFixed, Total: c.total, Count: c.count, Min: 1}
		got := mustSplit(t, p)
		q, rem := c.total/c.count, c.total%c.count
		var larger []int
		for i, a := range got {
			switch a {
			case q:
			case q + 1:
				larger = append(larger, i)
			default:
				t.Fatalf("%+v: packet %d is %d, want %d or %d", p, i, a, q, q+1)
			}
		}
		if int64(len(larger)) != rem {
			t.Fatalf("%+v: %d packets got one more unit, want %d", p, len(larger), rem)
		}
		if rem == 0 {
			continue
		}
		// Spread: never more than ceil(count / rem) apart, not bunched at the front.
		gap := int((c.count + rem - 1) / rem)
		if larger[0] >= gap {
			t.Fatalf("%+v: first larger packet at %d, want below %d", p, larger[0], gap)
		}
		for i := 1; i < len(larger); i++ {
			if larger[i]-larger[i-1] > gap {
				t.Fatalf("%+v: larger packets %d and %d are more than %d apart", p, larger[i-1], larger[i], gap)
			}
		}
	}
}

func TestRandomIsDoubleAverage(t *testing.T) {
	// The first packet is uniform in [min, 2 × average]: over many seeds its mean is
	// the midpoint and it never leaves the range; the last packets take the rest.
	const total, count = 100_000, 100
	var sum, first, hi int64
	lo := int64(math.MaxInt64)
	const runs = 4000
	for seed := range int64(runs) {
		got := mustSplit(t, split.Params{Type: split.TypeRandom, Total: total, Count: count, Min: 1, Seed: seed})
		first = got[0]
		sum += first
		lo, hi = min(lo, first), max(hi, first)
	}
	avg := float64(sum) / runs
	want := float64(1+2*total/count) / 2
	if math.Abs(avg-want) > want*0.05 {
		t.Fatalf("mean first packet %.1f, want about %.1f", avg, want)
	}
	if lo < 1 || hi > 2*total/count {
		t.Fatalf("first packet ranged over [%d, %d], want within [1, %d]", lo, hi, 2*total/count)
	}
	if hi < 2*total/count*9/10 || lo > total/count/10 {
		t.Fatalf("first packet ranged over [%d, %d]: the range is not covered", lo, hi)
	}
}

func TestLineCutSpread(t *testing.T) {
	// Cut points make the extras roughly exponential: about 1/e of the packets get
	// more than the average extra. A constant or front-loaded split would not.
	p := split.Params{Type: split.TypeLineCut, Total: 1_000_000 + 100_000, Count: 100_000, Min: 1, Seed: 77}
	got := mustSplit(t, p)
	above := 0
	for _, a := range got {
		if a-1 > 10 {
			above++
		}
	}
	frac := float64(above) / float64(len(got))
	if frac < 0.30 || frac > 0.40 {
		t.Fatalf("%.3f of the packets exceed the average extra, want about 0.37", frac)
	}
	// With a cap, the clamped excess is handed back: still exact and varied.
	p.Max = 15
	capped := mustSplit(t, p)
	atCap, distinct := 0, map[int64]bool{}
	for _, a := range capped {
		if a == 15 {
			atCap++
		}
		distinct[a] = true
	}
	if len(distinct) < 10 {
		t.Fatalf("capped split has only %d distinct amounts", len(distinct))
	}
	if atCap == len(capped) {
		t.Fatalf("capped split put every packet at the cap")
	}
}

func TestValidate(t *testing.T) {
	cases := []struct {
		p    split.Params
		want string
	}{
		{split.Params{Type: "Even", Total: 10, Count: 1, Min: 1}, `type "Even"`},
		{split.Params{Type: "", Total: 10, Count: 1, Min: 1}, `type ""`},
		{split.Params{Type: split.TypeRandom, Total: 10, Count: 0, Min: 1}, "count 0 is below 1"},
		{split.Params{Type: split.TypeRandom, Total: 10, Count: -3, Min: 1}, "count -3 is below 1"},
		{split.Params{Type: split.TypeRandom, Total: math.MaxInt64, Count: split.MaxCount + 1, Min: 1}, "above the limit"},
		{split.Params{Type: split.TypeRandom, Total: 10, Count: 1, Min: 0}, "minimum 0 is below 1"},
		{split.Params{Type: split.TypeRandom, Total: 10, Count: 2, Min: 1, Max: -1}, "maximum -1 is negative"},
		{split.Params{Type: split.TypeRandom, Total: 10, Count: 2, Min: 3, Max: 2}, "maximum 2 is below the minimum 3"},
		{split.Params{Type: split.TypeRandom, Total: 9, Count: 10, Min: 1}, "total 9 is less than count 10 × minimum 1"},
		{split.Params{Type: split.TypeRandom, Total: 0, Count: 1, Min: 1}, "total 0 is less than"},
		{split.Params{Type: split.TypeRandom, Total: -5, Count: 1, Min: 1}, "total -5 is less than"},
		{split.Params{Type: split.TypeRandom, Total: 29, Count: 10, Min: 3}, "less than count 10 × minimum 3"},
		// count × min overflows int64: must still be refused, not wrap around.
		{split.Params{Type: split.TypeRandom, Total: math.MaxInt64, Count: 4, Min: math.MaxInt64/4 + 1}, "less than count 4"},
		{split.Params{Type: split.TypeRandom, Total: 101, Count: 10, Min: 1, Max: 10}, "total 101 is more than count 10 × maximum 10"},
		{split.Params{Type: split.TypeLineCut, Total: math.MaxInt64, Count: 2, Min: 1, Max: math.MaxInt64 / 2}, "more than count 2"},
	}
	for _, c := range cases {
		err := c.p.Validate()
		if err == nil {
			t.Errorf("%+v: no error, want %q", c.p, c.want)
			continue
		}
		if !errors.Is(err, split.ErrInvalidParams) {
			t.Errorf("%+v: error %v does not wrap ErrInvalidParams", c.p, err)
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: error %q does not mention %q", c.p, err, c.want)
		}
		got, err := split.Split(c.p)
		if err == nil || got != nil || !errors.Is(err, split.ErrInvalidParams) {
			t.Errorf("Split(%+v) = %v, %v; want nil and an invalid-params error", c.p, got, err)
		}
	}
	// The exact boundaries are accepted.
	for _, p := range []split.Params{
		{Type: split.TypeRandom, Total: 30, Count: 10, Min: 3},
		{Type: split.TypeRandom, Total: 100, Count: 10, Min: 1, Max: 10},
		{Type: split.TypeRandom, Total: math.MaxInt64, Count: 1, Min: math.MaxInt64},
		{Type: split.TypeRandom, Total: math.MaxInt64, Count: 2, Min: 1, Max: math.MaxInt64/2 + 1},
	} {
		if err := p.Validate(); err != nil {
			t.Errorf("%+v: %v", p, err)
		}
	}
}

func TestSeedFromUID(t *testing.T) {
	const uid = "0b5c1f3e-6a8d-4b7e-9c2a-1d3e5f7a9b0c"
	if first, again := split.SeedFromUID(uid), split.SeedFromUID(uid); first != again {
		t.Fatalf("seed of the same UID differs: %d, then %d", first, again)
	}
	// FNV-64a of the empty string is its offset basis; of "a" a published value.
	if got := uint64(split.SeedFromUID("")); got != 0xcbf29ce484222325 {
		t.Fatalf("SeedFromUID(\"\") = %#x, want the FNV-64a offset basis", got)
	}
	if got := uint64(split.SeedFromUID("a")); got != 0xaf63dc4c8601ec8c {
		t.Fatalf("SeedFromUID(\"a\") = %#x, want 0xaf63dc4c8601ec8c", got)
	}
	seen := map[int64]string{}
	for i := range 10_000 {
		u := fmt.Sprintf("%s-%d", uid, i)
		s := split.SeedFromUID(u)
		if prev, ok := seen[s]; ok {
			t.Fatalf("UIDs %q and %q share seed %d", prev, u, s)
		}
		seen[s] = u
	}
}

// validByArithmetic decides validity with unbounded integers, independently of
// Validate's overflow-avoiding formulas.
func validByArithmetic(p split.Params) bool {
	switch p.Type {
	case split.TypeRandom, split.TypeLineCut, split.TypeFixed:
	default:
		return false
	}
	if p.Count < 1 || p.Count > split.MaxCount || p.Min < 1 || p.Max < 0 || (p.Max != 0 && p.Max < p.Min) {
		return false
	}
	total, count := big.NewInt(p.Total), big.NewInt(p.Count)
	if new(big.Int).Mul(count, big.NewInt(p.Min)).Cmp(total) > 0 {
		return false
	}
	if p.Max != 0 && new(big.Int).Mul(count, big.NewInt(p.Max)).Cmp(total) < 0 {
		return false
	}
	return true
}

func FuzzSplit(f *testing.F) {
	f.Add(uint8(0), int64(100), int64(5), int64(1), int64(0), int64(1))
	f.Add(uint8(1), int64(100), int64(5), int64(1), int64(0), int64(1))
	f.Add(uint8(2), int64(100), int64(5), int64(1), int64(0), int64(1))
	f.Add(uint8(0), int64(500), int64(100), int64(1), int64(5), int64(9))
	f.Add(uint8(1), int64(500), int64(100), int64(1), int64(5), int64(9))
	f.Add(uint8(1), int64(1_000_000), int64(1000), int64(1), int64(1001), int64(-4))
	f.Add(uint8(1), int64(1_000_000), int64(1000), int64(900), int64(1100), int64(4))
	f.Add(uint8(0), int64(math.MaxInt64), int64(7), int64(1), int64(0), int64(3))
	f.Add(uint8(1), int64(math.MaxInt64), int64(7), int64(1), int64(math.MaxInt64/7+1), int64(3))
	f.Add(uint8(2), int64(math.MaxInt64), int64(3), int64(math.MaxInt64/4), int64(math.MaxInt64), int64(0))
	f.Add(uint8(0), int64(9), int64(10), int64(1), int64(0), int64(0))
	f.Add(uint8(0), int64(10), int64(0), int64(1), int64(0), int64(0))
	f.Add(uint8(1), int64(10), int64(2), int64(3), int64(2), int64(0))
	f.Add(uint8(2), int64(101), int64(10), int64(1), int64(10), int64(0))
	f.Add(uint8(3), int64(10), int64(1), int64(1), int64(0), int64(0))
	f.Add(uint8(0), int64(math.MaxInt64), int64(4), int64(math.MaxInt64/4+1), int64(0), int64(0))
	f.Fuzz(func(t *testing.T, typ uint8, total, count, minimum, maximum, seed int64) {
		names := []string{split.TypeRandom, split.TypeLineCut, split.TypeFixed, "Other"}
		// Keep the work per input small; counts outside (0, 20000] stay as they are
		// so validation of silly counts is still exercised.
		if count > 20_000 && count <= split.MaxCount {
			count = 1 + count%20_000
		}
		p := split.Params{Type: names[int(typ)%len(names)], Total: total, Count: count,
			Min: minimum, Max: maximum, Seed: seed}
		err := p.Validate()
		if want := validByArithmetic(p); (err == nil) != want {
			t.Fatalf("%+v: Validate() = %v, but valid = %v", p, err, want)
		}
		got, err2 := split.Split(p)
		if (err == nil) != (err2 == nil) {
			t.Fatalf("%+v: Validate() = %v but Split error = %v", p, err, err2)
		}
		if err != nil {
			return
		}
		check(t, p, got)
		again, _ := split.Split(p)
		if !slices.Equal(got, again) {
			t.Fatalf("%+v: not reproducible", p)
		}
	})
}

func BenchmarkSplit(b *testing.B) {
	for _, n := range []int64{1_000_000, 10_000_000} {
		for _, typ := range allTypes {
			for _, capped := range []bool{false, true} {
				p := split.Params{Type: typ, Total: 200 * n, Count: n, Min: 1, Seed: 1}
				if capped {
					p.Max = 400
				}
				b.Run(fmt.Sprintf("%s/n=%d/capped=%t", typ, n, capped), func(b *testing.B) {
					for b.Loop() {
						if _, err := split.Split(p); err != nil {
							b.Fatal(err)
						}
					}
				})
			}
		}
	}
}
