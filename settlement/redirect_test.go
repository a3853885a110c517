package settlement

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestRedirectIsNotAnAcknowledgement points the worker at a webhook that redirects
// with 302 to a page answering 200 to anything. Following the redirect would turn
// the POST into a GET without the delivery, and its 200 would settle a claim that
// was never credited; a redirect must count as a failed delivery instead.
func TestRedirectIsNotAnAcknowledgement(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-redirect", 3, 300, "merchant-001")
	a.grab(t, 0, 1)
	var posts, elsewhere atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/elsewhere" {
			elsewhere.Add(1)
			w.WriteHeader(http.StatusOK)
			return
		}
		posts.Add(1)
		http.Redirect(w, r, "/elsewhere", http.StatusFound)
	}))
	t.Cleanup(srv.Close)

	cfg := baseConfig(a, srv.URL+"/credit", "w1")
	cfg.MaxAttempts = 3
	_, stop := startWorker(t, cfg)
	eventually(t, 10*time.Second, "the entry to be dead-lettered", func() bool {
		return a.snapshot(t).DeadCount == 1
	})
	stop()
	if s := a.snapshot(t); s.SettledCount != 0 || s.SettledAmount != 0 {
		t.Fatalf("settled %d/%d after redirects only, want nothing", s.SettledCount, s.SettledAmount)
	}
	if n := posts.Load(); n != int64(cfg.MaxAttempts) {
		t.Fatalf("%d deliveries, want %d", n, cfg.MaxAttempts)
	}
	if n := elsewhere.Load(); n != 0 {
		t.Fatalf("the redirect was followed %d times", n)
	}
	dead, err := rdb.XRange(context.Background(), a.keys.DeadLetters, "-", "+").Result()
	if err != nil || len(dead) != 1 {
		t.Fatalf("dead letters: %v %v", dead, err)
	}
	if e, _ := dead[0].Values["error"].(string); !strings.Contains(e, "302") {
		t.Fatalf("dead letter's error %q does not name the redirect", e)
	}
}
