package grabsvc

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// The limiter's contract at the bucket level: a burst passes, the next request waits
// exactly one interval, tokens come back at the rate, and a fractional rate rounds
// nothing away.
func TestKeyedLimiterBucket(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	l := NewKeyedLimiter(4, 3, 0)
	for i := range 3 {
		if ok, _ := l.Allow("u", now); !ok {
			t.Fatalf("request %d of the burst of 3 refused", i+1)
		}
	}
	ok, wait := l.Allow("u", now)
	if ok || wait != 250*time.Millisecond {
		t.Fatalf("fourth request: allowed %v, wait %s; want refused with 250ms", ok, wait)
	}
	// A refused request takes nothing: the wait shrinks with time only.
	if ok, wait := l.Allow("u", now.Add(100*time.Millisecond)); ok || wait != 150*time.Millisecond {
		t.Fatalf("at +100ms: allowed %v, wait %s; want refused with 150ms", ok, wait)
	}
	if ok, _ := l.Allow("u", now.Add(250*time.Millisecond)); !ok {
		t.Fatal("a token after one interval was refused")
	}
	// After a long pause the bucket holds the burst again, not more.
	later := now.Add(time.Hour)
	for i := range 3 {
		if ok, _ := l.Allow("u", later); !ok {
			t.Fatalf("request %d after a pause refused", i+1)
		}
	}
	if ok, _ := l.Allow("u", later); ok {
		t.Fatal("a pause filled the bucket beyond its burst")
	}
	// A clock step backwards never grants extra tokens.
	if ok, _ := l.Allow("u", later.Add(-time.Minute)); ok {
		t.Fatal("a request stamped in the past was allowed from an empty bucket")
	}
	// 0.5/s: one token every 2s exactly.
	slow := NewKeyedLimiter(0.5, 1, 0)
	slow.Allow("v", now)
	if ok, wait := slow.Allow("v", now); ok || wait != 2*time.Second {
		t.Fatalf("0.5/s: allowed %v, wait %s; want refused with 2s", ok, wait)
	}
	if ok, _ := slow.Allow("v", now.Add(2*time.Second)); !ok {
		t.Fatal("0.5/s: refused after 2s")
	}
	// Keys are independent.
	if ok, _ := slow.Allow("w", now); !ok {
		t.Fatal("another key was limited")
	}
}

// At capacity a new key takes the bucket that will be full soonest, so a key that
// is being limited keeps its empty bucket through a spray of thousands of new keys
// (each of which spent one token), and memory never grows.
func TestKeyedLimiterKeepsLimitedKeysUnderASpray(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	l := NewKeyedLimiter(1, 3, 64) // eight sets of eight
	if got := l.Capacity(); got != 64 {
		t.Fatalf("capacity %d, want 64", got)
	}
	for i := range 3 {
		if ok, _ := l.Allow("hot", now); !ok {
			t.Fatalf("request %d of hot's burst refused", i+1)
		}
	}
	// Thousands of distinct keys pass by while hot keeps asking within the same
	// second and is refused. If hot's bucket were ever evicted, it would be
	// allowed again.
	for i := range 5000 {
		at := now.Add(time.Duration(i) * 100 * time.Microsecond)
		l.Allow(fmt.Sprintf("spray-%d", i), at)
		if ok, _ := l.Allow("hot", at); ok {
			t.Fatalf("hot was allowed after %d other keys: its empty bucket was given away", i+1)
		}
	}
	if n := l.Len(); n > 64 {
		t.Fatalf("limiter tracks %d keys, capacity 64", n)
	}
	// Once every bucket is full again, the limiter holds no state that matters.
	if n := func() int { l.Allow("late", now.Add(time.Minute)); return l.Len() }(); n != 1 {
		t.Fatalf("a minute later the limiter holds state for %d keys, want 1 (the last one)", n)
	}
}

// Small and odd capacities: never more buckets than asked for, never none.
func TestKeyedLimiterCapacity(t *testing.T) {
	for _, c := range []struct{ ask, want int }{
		{1, 8}, {8, 8}, {16, 16}, {100, 96}, {1024, 1024}, {0, DefaultMaxLimiterEntries}, {100001, 100000},
	} {
		if got := NewKeyedLimiter(1, 1, c.ask).Capacity(); got != c.want {
			t.Errorf("maxEntries %d: capacity %d, want %d", c.ask, got, c.want)
		}
	}
	if NewKeyedLimiter(1, 1, 1<<20).Capacity() > 1<<20 {
		t.Error("capacity above the maximum asked for")
	}
}

// Concurrent callers on shared keys never get more than the rate allows: over one
// simulated second, each key passes its burst plus the tokens that came back.
func TestKeyedLimiterConcurrentCallersShareBuckets(t *testing.T) {
	l := NewKeyedLimiter(100, 10, 0)
	start := time.Unix(1_700_000_000, 0)
	const keys, goroutines, calls = 50, 8, 2000
	var mu sync.Mutex
	allowed := map[string]int{}
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 7))
			mine := map[string]int{}
			for i := range calls {
				key := fmt.Sprintf("k-%d", r.IntN(keys))
				// Times within [0, 1s): at most 10 + 100 tokens per key.
				if ok, _ := l.Allow(key, start.Add(time.Duration(i)*time.Second/calls)); ok {
					mine[key]++
				}
			}
			mu.Lock()
			for k, n := range mine {
				allowed[k] += n
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	for k, n := range allowed {
		if n > 110 {
			t.Errorf("key %s was allowed %d times in one second, limit 10 + 100", k, n)
		}
	}
	if len(allowed) != keys {
		t.Errorf("%d keys were allowed at all, want %d", len(allowed), keys)
	}
}

// randomKeys returns n distinct random user ids of the shape clients send.
func randomKeys(n int) []string {
	r := rand.New(rand.NewPCG(1, 2))
	keys := make([]string, n)
	var b [12]byte
	for i := range keys {
		binary.LittleEndian.PutUint64(b[:8], r.Uint64())
		binary.LittleEndian.PutUint32(b[8:], r.Uint32())
		keys[i] = "user-" + hex.EncodeToString(b[:])
	}
	return keys
}

// occupied counts the limiter's non-empty buckets.
func occupied(l *KeyedLimiter) int {
	n := 0
	for i := range l.shards {
		for j := range l.shards[i].sets {
			for w := range limiterWays {
				if l.shards[i].sets[j].tags[w] != 0 {
					n++
				}
			}
		}
	}
	return n
}

// emptyLimiter empties every bucket of the limiter, keeping its memory.
func emptyLimiter(l *KeyedLimiter) {
	for i := range l.shards {
		s := &l.shards[i]
		for j := range s.sets {
			s.sets[j] = limiterSet{}
		}
		s.latest = 0
	}
}

// BenchmarkKeyedLimiterRandomKeys measures the cost of one Allow call under a
// spray of random user ids never seen before (every call is a new key), with a
// limiter of the default capacity below it and at it. The limit is 1/s with a burst
// of 5, so a bucket is full again 1s after its key's one request. Both cases start
// from a table whose every bucket is taken, and differ only in the clock:
//
//   - below-capacity: the clock moves 1ms per call, so at most about 1000 keys hold
//     state at any time, far below the capacity; every new key reuses a bucket that
//     is full again (no state is lost);
//   - at-capacity: the clock moves 1µs per call, a million new keys a second against
//     a capacity of 100000, so every bucket holds live state and every new key evicts
//     one.
//
// The two figures must stay within a factor of 2 of each other:
//
//	go test ./grabsvc -run '^$' -bench KeyedLimiterRandomKeys -benchtime 2000000x -count 5
//
// The hot-keys case, a small working set that always hits, is the cost of a known
// key, for reference.
func BenchmarkKeyedLimiterRandomKeys(b *testing.B) {
	keys := randomKeys(1 << 21)
	start := time.Unix(1_700_000_000, 0)
	l := NewKeyedLimiter(1, 5, DefaultMaxLimiterEntries)
	capacity := l.Capacity()
	// fill takes every bucket with keys the benchmark never sends, last used at t.
	fill := func(t time.Time) {
		emptyLimiter(l)
		for i := 0; occupied(l) < capacity; i++ {
			for j := range 10000 {
				l.Allow(fmt.Sprintf("fill-%d-%d", i, j), t)
			}
		}
	}
	spray := func(b *testing.B, step time.Duration) {
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			l.Allow(keys[i%len(keys)], start.Add(time.Duration(i+1)*step))
		}
		b.StopTimer()
		if n := occupied(l); n != capacity {
			b.Fatalf("%d buckets taken, want all %d", n, capacity)
		}
	}

	b.Run("below-capacity", func(b *testing.B) {
		fill(start.Add(-time.Hour))
		spray(b, time.Millisecond)
		if n := l.Len(); n > 1100 {
			b.Fatalf("%d keys hold state, want about 1000: not below capacity", n)
		}
	})
	b.Run("at-capacity", func(b *testing.B) {
		fill(start)
		spray(b, time.Microsecond)
		if n := l.Len(); n != capacity {
			b.Fatalf("%d keys hold state, want the whole capacity %d", n, capacity)
		}
	})
	b.Run("hot-keys", func(b *testing.B) {
		emptyLimiter(l)
		hot := keys[:1024]
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			l.Allow(hot[i%len(hot)], start.Add(time.Duration(i)*time.Microsecond))
		}
	})
}
