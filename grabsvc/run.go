package grabsvc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"
)

// Drainer is a server whose readiness can be made to fail before it shuts down: a
// Server (an activity's) or a PacketServer (a budget's).
type Drainer interface{ SetDraining() }

// Serve serves hs on ln until ctx is done, then shuts down gracefully: readiness
// fails first (s.SetDraining), after delay the listener closes and in-flight
// requests get up to timeout to finish. It returns when the server has stopped.
func Serve(ctx context.Context, hs *http.Server, ln net.Listener, s Drainer, delay, timeout time.Duration) error {
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serving http: %w", err)
	case <-ctx.Done():
	}
	s.SetDraining()
	if delay > 0 {
		time.Sleep(delay)
	}
	sctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		return fmt.Errorf("shutting down http: %w", err)
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serving http: %w", err)
	}
	return nil
}

// Restarter keeps at most one background task running for the current
// configuration and restarts it when the configuration changes. The settlement
// worker runs under one, keyed by its webhook settings.
type Restarter struct {
	mu     sync.Mutex
	key    string
	cancel context.CancelFunc
	done   chan struct{}
}

// Set runs run under ctx for the configuration key. The same key as the running
// task's leaves it alone; a different key stops the running task (and waits for
// it) before starting the new one; the empty key only stops.
func (r *Restarter) Set(ctx context.Context, key string, run func(context.Context)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done != nil && key == r.key {
		select {
		case <-r.done:
			// The task ended by itself; start it again.
		default:
			return
		}
	}
	r.stopLocked()
	r.key = key
	if key == "" {
		return
	}
	tctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	r.cancel, r.done = cancel, done
	go func() {
		defer close(done)
		run(tctx)
	}()
}

// Key is the configuration of the running task, "" when none runs (also when the
// last task ended by itself).
func (r *Restarter) Key() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done == nil {
		return ""
	}
	select {
	case <-r.done:
		return ""
	default:
		return r.key
	}
}

// Stop stops the running task and waits for it.
func (r *Restarter) Stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stopLocked()
	r.key = ""
}

func (r *Restarter) stopLocked() {
	if r.cancel != nil {
		r.cancel()
		<-r.done
	}
	r.cancel, r.done = nil, nil
}
