package grabsvc

import (
	"hash/maphash"
	"math"
	"sync"
	"time"
)

// DefaultMaxLimiterEntries bounds how many keys (users or clients) a KeyedLimiter
// tracks at once.
const DefaultMaxLimiterEntries = 100000

// maxLimiterShards is the most lock shards a KeyedLimiter has.
const maxLimiterShards = 32

// limiterWays is how many buckets share one set: a key can live only in the set its
// hash names, so a lookup or an eviction looks at this many buckets and no more.
const limiterWays = 8

// maxLimiterSpan caps the interval and the tolerance, so that sums of them and of a
// unix time in nanoseconds never overflow (about 73 years each).
const maxLimiterSpan = math.MaxInt64 / 4

// KeyedLimiter is one token bucket per key (a user id, a client address) in fixed
// memory, at a constant cost per request whatever the mix of keys: below its
// capacity or at it, known keys or a spray of new ones.
//
// Each bucket is kept as its theoretical arrival time (the generic cell rate
// algorithm): the instant from which the bucket is full again. A request at t is
// allowed when that instant is at most tolerance after t, and then pushes it one
// interval further; a refused request changes nothing. Integer nanoseconds
// throughout, so no rounding accumulates.
//
// The buckets form a set-associative table: a seeded 64-bit hash of the key picks a
// lock shard and, in it, a set of limiterWays buckets; the hash itself is the tag
// that identifies the key's bucket in its set. A request compares limiterWays tags
// and, for a key not in its set, takes the bucket of the set that will be full
// soonest: an empty or already full one when there is one (a full bucket is the
// same as no bucket, so reusing it changes no decision), else the one whose key
// loses the least: a key whose bucket is evicted before it is full gets a full one
// when it comes back, that is at most (time until full) / interval tokens early,
// and the rule picks the smallest such gift in the set. Two keys share a bucket
// only when their 64-bit hashes are equal, which a client cannot aim for without
// the per-process seed.
type KeyedLimiter struct {
	// interval is the time one token takes to come back; tolerance is how far
	// ahead of now a bucket's full-again instant may be for a request to pass:
	// burst-1 intervals. Both in nanoseconds.
	interval, tolerance int64
	seed                maphash.Seed
	shards              []limiterShard
}

// limiterShard is one lock's share of the table.
type limiterShard struct {
	mu   sync.Mutex
	sets []limiterSet
	// latest is the latest request time seen by the shard (unix nanoseconds).
	latest int64
}

// limiterSet is limiterWays buckets. A way with tag 0 is empty and its fullAt is 0.
type limiterSet struct {
	// tags are the hashes of the keys (0: empty; a hash of 0 is stored as 1).
	tags [limiterWays]uint64
	// fullAt is, per way, the unix nanosecond from which the bucket is full again.
	fullAt [limiterWays]int64
}

// NewKeyedLimiter returns a limiter that allows perSecond requests per key with
// bursts of burst (at least 1), tracking at most maxEntries keys (0 means
// DefaultMaxLimiterEntries), rounded down to whole sets of limiterWays but never
// fewer than one set. Its memory, 16 bytes per entry, is allocated up front. It
// returns nil when perSecond is not positive: a nil limiter allows everything.
func NewKeyedLimiter(perSecond float64, burst, maxEntries int) *KeyedLimiter {
	if perSecond <= 0 || math.IsNaN(perSecond) {
		return nil
	}
	if burst < 1 {
		burst = max(1, int(min(math.Ceil(perSecond), math.MaxInt32)))
	}
	if maxEntries <= 0 {
		maxEntries = DefaultMaxLimiterEntries
	}
	interval := int64(max(1, min(math.Ceil(float64(time.Second)/perSecond), maxLimiterSpan)))
	tolerance := int64(min(float64(interval)*float64(burst-1), maxLimiterSpan))
	sets := max(1, maxEntries/limiterWays)
	nShards := min(maxLimiterShards, sets)
	l := &KeyedLimiter{
		interval:  interval,
		tolerance: tolerance,
		seed:      maphash.MakeSeed(),
		shards:    make([]limiterShard, nShards),
	}
	for i := range l.shards {
		// Spread the sets over the shards; the first ones take the remainder.
		n := sets / nShards
		if i < sets%nShards {
			n++
		}
		l.shards[i].sets = make([]limiterSet, n)
	}
	return l
}

// Allow takes one token from key's bucket at now. When the bucket is empty it
// returns false and how long until a token will be there.
func (l *KeyedLimiter) Allow(key string, now time.Time) (bool, time.Duration) {
	if l == nil {
		return true, 0
	}
	at := now.UnixNano()
	tag := maphash.String(l.seed, key)
	if tag == 0 {
		tag = 1
	}
	n := uint64(len(l.shards))
	s := &l.shards[tag%n]
	s.mu.Lock()
	defer s.mu.Unlock()
	set := &s.sets[(tag/n)%uint64(len(s.sets))]
	s.latest = max(s.latest, at)
	way := -1
	for w := range limiterWays {
		if set.tags[w] == tag {
			way = w
			break
		}
	}
	if way < 0 {
		way = 0
		for w := 1; w < limiterWays; w++ {
			if set.fullAt[w] < set.fullAt[way] {
				way = w
			}
		}
		set.tags[way], set.fullAt[way] = tag, at
	}
	fullAt := max(set.fullAt[way], at)
	if ahead := fullAt - at; ahead > l.tolerance {
		return false, time.Duration(ahead - l.tolerance)
	}
	set.fullAt[way] = fullAt + l.interval
	return true, 0
}

// Len is the number of keys whose buckets are not full at the latest request time
// the limiter saw: the keys it holds any state for, since a full bucket is the
// same as none. It walks the whole table: for tests and diagnostics, not for the
// request path.
func (l *KeyedLimiter) Len() int {
	if l == nil {
		return 0
	}
	var latest int64
	for i := range l.shards {
		s := &l.shards[i]
		s.mu.Lock()
		latest = max(latest, s.latest)
		s.mu.Unlock()
	}
	n := 0
	for i := range l.shards {
		s := &l.shards[i]
		s.mu.Lock()
		for j := range s.sets {
			for w := range limiterWays {
				if s.sets[j].tags[w] != 0 && s.sets[j].fullAt[w] > latest {
					n++
				}
			}
		}
		s.mu.Unlock()
	}
	return n
}

// Capacity is how many keys the limiter can track at once.
func (l *KeyedLimiter) Capacity() int {
	if l == nil {
		return 0
	}
	n := 0
	for i := range l.shards {
		n += len(l.shards[i].sets) * limiterWays
	}
	return n
}

// retryAfterSeconds renders a wait as a Retry-After value: whole seconds, at least 1.
func retryAfterSeconds(d time.Duration) int {
	return max(1, int(math.Ceil(d.Seconds())))
}
