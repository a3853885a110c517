package grabsvc

import (
	"hash/maphash"
	"math"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// DefaultMaxLimiterEntries bounds how many keys (users or clients) a KeyedLimiter
// tracks at once.
const DefaultMaxLimiterEntries = 100000

const limiterShards = 32

// KeyedLimiter is one token bucket per key (a user id, a client address) with
// bounded memory: a bucket that has been idle long enough to refill completely is
// indistinguishable from a new one and is dropped, and the number of buckets is
// capped.
type KeyedLimiter struct {
	limit rate.Limit
	burst int
	// idle is how long a bucket takes to refill from empty; idle buckets older than
	// that are dropped.
	idle        time.Duration
	maxPerShard int
	seed        maphash.Seed
	shards      [limiterShards]limiterShard
}

type limiterShard struct {
	mu        sync.Mutex
	m         map[string]*limiterEntry
	lastSweep time.Time
}

type limiterEntry struct {
	lim  *rate.Limiter
	last time.Time
}

// NewKeyedLimiter returns a limiter that allows perSecond requests per key with
// bursts of burst (at least 1), tracking at most maxEntries keys (0 means
// DefaultMaxLimiterEntries). It returns nil when perSecond is not positive: a nil
// limiter allows everything.
func NewKeyedLimiter(perSecond float64, burst, maxEntries int) *KeyedLimiter {
	if perSecond <= 0 || math.IsNaN(perSecond) {
		return nil
	}
	if burst < 1 {
		burst = max(1, int(math.Ceil(perSecond)))
	}
	if maxEntries <= 0 {
		maxEntries = DefaultMaxLimiterEntries
	}
	idle := time.Duration(float64(burst) / perSecond * float64(time.Second))
	l := &KeyedLimiter{
		limit:       rate.Limit(perSecond),
		burst:       burst,
		idle:        max(idle, time.Second),
		maxPerShard: max(1, maxEntries/limiterShards),
		seed:        maphash.MakeSeed(),
	}
	for i := range l.shards {
		l.shards[i].m = map[string]*limiterEntry{}
	}
	return l
}

// Allow takes one token from key's bucket at now. When the bucket is empty it
// returns false and how long until a token will be there.
func (l *KeyedLimiter) Allow(key string, now time.Time) (bool, time.Duration) {
	if l == nil {
		return true, 0
	}
	s := &l.shards[maphash.String(l.seed, key)%limiterShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.m[key]
	if e == nil {
		if len(s.m) >= l.maxPerShard {
			s.sweep(now, l.idle, l.maxPerShard)
		}
		e = &limiterEntry{lim: rate.NewLimiter(l.limit, l.burst)}
		s.m[key] = e
	} else if now.Sub(s.lastSweep) > l.idle && len(s.m) > 64 {
		s.sweep(now, l.idle, l.maxPerShard)
	}
	e.last = now
	r := e.lim.ReserveN(now, 1)
	if !r.OK() {
		return false, time.Second
	}
	if d := r.DelayFrom(now); d > 0 {
		r.CancelAt(now)
		return false, d
	}
	return true, 0
}

// Len is the number of keys tracked.
func (l *KeyedLimiter) Len() int {
	if l == nil {
		return 0
	}
	n := 0
	for i := range l.shards {
		s := &l.shards[i]
		s.mu.Lock()
		n += len(s.m)
		s.mu.Unlock()
	}
	return n
}

// sweep drops buckets idle for longer than idle; if the shard is still full it
// drops arbitrary buckets until there is room for one more. The caller holds mu.
func (s *limiterShard) sweep(now time.Time, idle time.Duration, maxEntries int) {
	s.lastSweep = now
	for k, e := range s.m {
		if now.Sub(e.last) > idle {
			delete(s.m, k)
		}
	}
	for k := range s.m {
		if len(s.m) < maxEntries {
			break
		}
		delete(s.m, k)
	}
}

// retryAfterSeconds renders a wait as a Retry-After value: whole seconds, at least 1.
func retryAfterSeconds(d time.Duration) int {
	return max(1, int(math.Ceil(d.Seconds())))
}
