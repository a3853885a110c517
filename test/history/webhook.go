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
	// Failed and Delayed count the deliveries that were failed or held.
	Failed, Delayed atomic.Int64
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
