package controllers

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// endlessExpirer is a budget whose due index never runs short: every call expires
// a full batch, after a little work.
type endlessExpirer struct{ calls atomic.Int64 }

func (e *endlessExpirer) N() int { return 4 }

func (e *endlessExpirer) ExpireDue(ctx context.Context, _, max int) (int, int64, error) {
	e.calls.Add(1)
	select {
	case <-ctx.Done():
		return 0, 0, ctx.Err()
	case <-time.After(time.Millisecond):
	}
	return max, 0, nil
}

// A budget whose batches never come back short ends its pass at PassLimit, and it
// holds no other budget: under Start, a due packet of another budget is expired at
// the next tick while the endless budget's pass goes on.
func TestBudgetExpiryEndlessBudgetHoldsNoOther(t *testing.T) {
	endless := &endlessExpirer{}
	e := &BudgetExpiry{Interval: 20 * time.Millisecond, PassLimit: 300 * time.Millisecond}
	e.Track("endless", endless)
	start := time.Now()
	if n, _ := e.ExpireOnce(t.Context()); n == 0 {
		t.Fatal("the endless budget's pass expired nothing")
	}
	if d := time.Since(start); d < 300*time.Millisecond || d > 2*time.Second {
		t.Errorf("the endless budget's pass took %v, want its PassLimit of 300ms", d)
	}

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- e.Start(ctx) }()
	defer func() { cancel(); <-done }()
	// Let the endless budget's pass get under way, then give another budget packets.
	time.Sleep(100 * time.Millisecond)
	calm := &fakeExpirer{due: []int{3, 0}}
	e.Track("calm", calm)
	due := time.Now()
	for {
		calm.mu.Lock()
		left := calm.due[0]
		calm.mu.Unlock()
		if left == 0 {
			break
		}
		if time.Since(due) > time.Second {
			t.Fatalf("the calm budget's packets are not expired %v after they fell due", time.Since(due))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if endless.calls.Load() == 0 {
		t.Error("the endless budget was not expired")
	}
}
