package settlement

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// A webhook that fails every delivery shows in the health: every grant retrying,
// the class of the failure, since when the oldest grant waits; the log says it once
// at Warn (not once per delivery); when the webhook recovers nothing is retrying.
func TestDeliveryHealthOfAFailingWebhook(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	recv := newReceiver(t, "act-health", nil)
	recv.setReject(func(*http.Request, Delivery) int { return http.StatusInternalServerError })
	act := newActivity(t, rdb, "act-health", 20, 1000, "sponsor")
	before := time.Now().Add(-time.Second)
	grants := act.grab(t, 0, 5)

	var logged syncBuffer
	health := NewDeliveryHealth()
	cfg := baseConfig(act, recv.url("/credit"), "w1")
	cfg.Health = health
	cfg.MaxAttempts = 1000
	cfg.Logger = slog.New(slog.NewTextHandler(&logged, &slog.HandlerOptions{Level: slog.LevelWarn}))
	startWorker(t, cfg)

	eventually(t, 10*time.Second, "every grant retrying after failures", func() bool {
		return health.Snapshot().Retrying == len(grants) && recv.stats().requests > 4*len(grants)
	})
	snap := health.Snapshot()
	if !snap.Degraded() || snap.LastErrorClass != ErrorClassHTTP5xx {
		t.Errorf("health %+v, want degraded with %s", snap, ErrorClassHTTP5xx)
	}
	if snap.OldestUndelivered.Before(before) || snap.OldestUndelivered.After(time.Now()) {
		t.Errorf("oldest undelivered %v, want the first grant's time (after %v)", snap.OldestUndelivered, before)
	}
	warnings := strings.Count(logged.String(), "settlement deliveries are failing")
	t.Logf("%d failed deliveries, %d Warn lines: %s", recv.stats().requests, warnings, snap)
	if warnings != 1 {
		t.Errorf("%d Warn lines for the failures of the first minute, want 1:\n%s", warnings, logged.String())
	}

	recv.setReject(nil)
	eventually(t, 10*time.Second, "nothing retrying once the webhook answers", func() bool {
		return health.Snapshot().Retrying == 0
	})
	act.checkSettledExactly(t)
	if s := health.Snapshot(); s.Degraded() || s.LastErrorClass != ErrorClassHTTP5xx {
		t.Errorf("after recovery: %+v, want not degraded and the last error kept", s)
	}
}

// ErrorClass names what went wrong with a real delivery in a fixed word.
func TestErrorClassOfRealDeliveries(t *testing.T) {
	t.Parallel()
	answer := func(status int) string {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "the receiver's own words", status)
		}))
		t.Cleanup(srv.Close)
		return srv.URL
	}
	held := make(chan struct{})
	holding := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-held:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(holding.Close)
	t.Cleanup(func() { close(held) })
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := "http://" + closed.Addr().String()
	_ = closed.Close()
	tlsSrv := httptest.NewTLSServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	t.Cleanup(tlsSrv.Close)

	for _, tc := range []struct {
		name, url, want string
	}{
		{"503", answer(http.StatusServiceUnavailable), ErrorClassHTTP5xx},
		{"409", answer(http.StatusConflict), ErrorClassHTTP4xx},
		{"held past the timeout", holding.URL, ErrorClassTimeout},
		{"closed port", refused, ErrorClassConnectionRefused},
		{"unresolvable host", "http://balance.invalid:8080", ErrorClassDNS},
		{"untrusted certificate", tlsSrv.URL, ErrorClassTLS},
	} {
		cfg := Config{WebhookURL: tc.url + "/credit", HTTPClient: &http.Client{Timeout: 300 * time.Millisecond}}
		err := postBody(context.Background(), cfg, []byte(`{}`), "uid/p1")
		if got := ErrorClass(err); got != tc.want {
			t.Errorf("%s: class %q, want %q (%v)", tc.name, got, tc.want, err)
		}
	}
}

// syncBuffer is a bytes.Buffer safe for the worker's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
