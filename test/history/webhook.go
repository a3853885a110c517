package history

import (
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"time"
)

// FlakyWebhook wraps the balance system's handler. While failing, it answers about
// half of the deliveries 503, half of those after the balance system has credited
// them (the reply is lost, not the credit); while slow, it holds each delivery
// longer than the settlement worker's HTTP timeout before passing it on, so the
// worker gives up on a delivery that is credited anyway. Either way the worker
// redelivers and the balance system must dedup by Idempotency-Key.
type FlakyWebhook struct {
	Next http.Handler
	// Slow is how long a slow delivery is held.
	Slow time.Duration

	failUntil atomic.Int64
	slowUntil atomic.Int64
	mu        sync.Mutex
	rnd       *rand.Rand
	// holdNext, when arrived is set, is how long the next delivery is held;
	// arrived is closed when it comes.
	holdNext time.Duration
	arrived  chan struct{}
	// Failed and Delayed count the deliveries that were failed or held.
	Failed, Delayed atomic.Int64
}

// HoldNext makes the next delivery wait d before it is passed on (the balance
// system credits it then, whether or not its sender still waits), and returns a
// channel closed when that delivery arrives. d == 0 takes back a hold asked for and
// not yet used.
func (f *FlakyWebhook) HoldNext(d time.Duration) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if d <= 0 {
		f.arrived = nil
		return nil
	}
	f.holdNext, f.arrived = d, make(chan struct{})
	return f.arrived
}

// NewFlakyWebhook wraps next; seed drives which deliveries fail.
func NewFlakyWebhook(next http.Handler, slow time.Duration, seed uint64) *FlakyWebhook {
	return &FlakyWebhook{Next: next, Slow: slow, rnd: rand.New(rand.NewPCG(seed, seed^0x5eed))}
}

// FailFor makes the webhook flaky for d from now.
func (f *FlakyWebhook) FailFor(d time.Duration) { f.failUntil.Store(time.Now().Add(d).UnixNano()) }

// SlowFor makes the webhook slow for d from now.
func (f *FlakyWebhook) SlowFor(d time.Duration) { f.slowUntil.Store(time.Now().Add(d).UnixNano()) }

func (f *FlakyWebhook) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	arrived, hold := f.arrived, f.holdNext
	f.arrived = nil
	f.mu.Unlock()
	if arrived != nil {
		f.Delayed.Add(1)
		close(arrived)
		time.Sleep(hold)
	}
	now := time.Now().UnixNano()
	if now < f.slowUntil.Load() {
		f.Delayed.Add(1)
		time.Sleep(f.Slow)
	}
	if now < f.failUntil.Load() {
		f.mu.Lock()
		x := f.rnd.IntN(4)
		f.mu.Unlock()
		switch x {
		case 0: // fail before the balance system sees it
			f.Failed.Add(1)
			http.Error(w, "balance system unavailable", http.StatusServiceUnavailable)
			return
		case 1: // credited, but the answer is lost
			f.Failed.Add(1)
			f.Next.ServeHTTP(httptest.NewRecorder(), r)
			http.Error(w, "balance system unavailable", http.StatusServiceUnavailable)
			return
		}
	}
	f.Next.ServeHTTP(w, r)
}

// CreditLog wraps the balance system's handler and counts, per Idempotency-Key,
// the deliveries that reached it and the credits they made: a delivery credits when
// its key was not credited before it and is after it (credited reports that). It
// serializes the deliveries it passes on, so that each credit is told to one.
type CreditLog struct {
	Next     http.Handler
	credited func(key string) bool

	mu         sync.Mutex
	deliveries map[string]int
	credits    map[string]int
}

// NewCreditLog wraps next, which credited asks.
func NewCreditLog(next http.Handler, credited func(key string) bool) *CreditLog {
	return &CreditLog{Next: next, credited: credited, deliveries: map[string]int{}, credits: map[string]int{}}
}

func (c *CreditLog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	c.mu.Lock()
	defer c.mu.Unlock()
	before := c.credited(key)
	c.Next.ServeHTTP(w, r)
	c.deliveries[key]++
	if !before && c.credited(key) {
		c.credits[key]++
	}
}

// Counts returns how often each key was delivered and credited.
func (c *CreditLog) Counts() (deliveries, credits map[string]int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	deliveries, credits = make(map[string]int, len(c.deliveries)), make(map[string]int, len(c.credits))
	for k, n := range c.deliveries {
		deliveries[k] = n
	}
	for k, n := range c.credits {
		credits[k] = n
	}
	return deliveries, credits
}
