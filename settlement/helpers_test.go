package settlement

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// receiver is a balance system for tests: a real HTTP server on loopback that
// checks each delivery, credits each Idempotency-Key once and keeps totals.
type receiver struct {
	t   *testing.T
	uid string
	key []byte

	mu         sync.Mutex
	credited   map[string]Delivery // by Idempotency-Key
	requests   map[string]int      // by Idempotency-Key, every request
	byPath     map[string]int      // every request, by URL path
	balances   map[string]int64    // by user
	total      int64
	duplicates int
	problems   []string
	// reject, when set, answers a request before crediting; a status other than 0
	// is sent as is and nothing is credited.
	reject func(r *http.Request, d Delivery) int
	// after, when set, runs after crediting and before answering; a status other
	// than 0 is sent instead of 200 (the credit stays: the answer got lost).
	after func(r *http.Request, d Delivery) int
	// seen, when set, gets every request's headers and raw body first.
	seen func(h http.Header, body []byte)

	addr string
	srv  *http.Server
	done chan struct{}
}

// newReceiver starts a receiver for the activity with the given UID; key is the
// signing key deliveries must carry (nil: none).
func newReceiver(t *testing.T, uid string, key []byte) *receiver {
	t.Helper()
	r := &receiver{t: t, uid: uid, key: key, credited: map[string]Delivery{}, requests: map[string]int{},
		byPath: map[string]int{}, balances: map[string]int64{}}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listening: %v", err)
	}
	r.addr = l.Addr().String()
	r.serve(l)
	t.Cleanup(r.down)
	return r
}

// url is the webhook URL for path.
func (r *receiver) url(path string) string { return "http://" + r.addr + path }

func (r *receiver) serve(l net.Listener) {
	r.srv = &http.Server{Handler: http.HandlerFunc(r.handle), ReadHeaderTimeout: 5 * time.Second}
	r.done = make(chan struct{})
	srv, done := r.srv, r.done
	go func() {
		defer close(done)
		_ = srv.Serve(l)
	}()
}

// down closes the listener and every connection: deliveries get no answer.
func (r *receiver) down() {
	if r.srv == nil {
		return
	}
	_ = r.srv.Close()
	<-r.done
	r.srv = nil
}

// up listens again on the same address.
func (r *receiver) up() {
	r.t.Helper()
	var l net.Listener
	var err error
	for range 50 {
		if l, err = net.Listen("tcp", r.addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		r.t.Fatalf("listening again on %s: %v", r.addr, err)
	}
	r.serve(l)
}

func (r *receiver) problem(format string, args ...any) {
	r.mu.Lock()
	r.problems = append(r.problems, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

func (r *receiver) handle(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(req.Body)
	if err != nil {
		http.Error(w, "reading body", http.StatusBadRequest)
		return
	}
	r.mu.Lock()
	seen := r.seen
	r.mu.Unlock()
	if seen != nil {
		seen(req.Header.Clone(), body)
	}
	if req.Method != http.MethodPost {
		r.problem("method %s", req.Method)
	}
	if ct := req.Header.Get("Content-Type"); ct != "application/json" {
		r.problem("content type %q", ct)
	}
	sig := req.Header.Get("X-Signature")
	if r.key != nil && sig != Sign(r.key, body) {
		r.problem("bad signature %q", sig)
		http.Error(w, "bad signature", http.StatusUnauthorized)
		return
	}
	if r.key == nil && sig != "" {
		r.problem("unexpected signature %q", sig)
	}
	// The body has exactly the contract's fields, the amount an integer.
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(body, &raw); err != nil {
		r.problem("body %s: %v", body, err)
		http.Error(w, "bad body", http.StatusBadRequest)
		return
	}
	var names []string
	for k := range raw {
		names = append(names, k)
	}
	sort.Strings(names)
	if want := []string{"activity", "activityUID", "amount", "at", "currency", "kind", "packetId", "sourceRef", "userId"}; !slices.Equal(names, want) {
		r.problem("body fields %v, want %v", names, want)
	}
	if a := string(raw["amount"]); strings.ContainsAny(a, ".eE\"") {
		r.problem("amount %s is not a JSON integer", a)
	}
	var d Delivery
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&d); err != nil {
		r.problem("decoding %s: %v", body, err)
		http.Error(w, "bad body", http.StatusBadRequest)
		return
	}
	if _, err := time.Parse(time.RFC3339, d.At); err != nil {
		r.problem("at %q: %v", d.At, err)
	}
	key := req.Header.Get("Idempotency-Key")
	if want := r.uid + "/" + d.PacketID; key != want || d.ActivityUID != r.uid {
		r.problem("idempotency key %q, activity uid %q, want %q", key, d.ActivityUID, want)
	}
	r.mu.Lock()
	r.requests[key]++
	r.byPath[req.URL.Path]++
	reject := r.reject
	after := r.after
	r.mu.Unlock()
	if reject != nil {
		if status := reject(req, d); status != 0 {
			http.Error(w, "rejected by the test receiver", status)
			return
		}
	}
	r.mu.Lock()
	if prev, ok := r.credited[key]; ok {
		r.duplicates++
		if prev != d {
			r.problems = append(r.problems, fmt.Sprintf("%s delivered as %+v, then as %+v", key, prev, d))
		}
	} else {
		r.credited[key] = d
		r.balances[d.UserID] += d.Amount
		r.total += d.Amount
	}
	r.mu.Unlock()
	if after != nil {
		if status := after(req, d); status != 0 {
			http.Error(w, "answer lost", status)
			return
		}
	}
	w.WriteHeader(http.StatusOK)
}

func (r *receiver) setReject(f func(*http.Request, Delivery) int) {
	r.mu.Lock()
	r.reject = f
	r.mu.Unlock()
}

func (r *receiver) setAfter(f func(*http.Request, Delivery) int) {
	r.mu.Lock()
	r.after = f
	r.mu.Unlock()
}

type receiverStats struct {
	credited   int
	total      int64
	duplicates int
	requests   int
	problems   []string
}

func (r *receiver) stats() receiverStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := receiverStats{credited: len(r.credited), total: r.total, duplicates: r.duplicates,
		problems: slices.Clone(r.problems)}
	for _, n := range r.requests {
		s.requests += n
	}
	return s
}

func (r *receiver) requestsFor(key string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.requests[key]
}

func (r *receiver) requestsOn(path string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.byPath[path]
}

func (r *receiver) creditedFor(key string) (Delivery, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	d, ok := r.credited[key]
	return d, ok
}

// checkCredits asserts the receiver saw no malformed delivery and credited every
// grant exactly as granted, and nothing else.
func (r *receiver) checkCredits(t *testing.T, grants map[string]grant) {
	t.Helper()
	s := r.stats()
	if len(s.problems) > 0 {
		t.Fatalf("receiver saw bad deliveries: %v", s.problems)
	}
	var want int64
	for _, g := range grants {
		want += g.amount
		d, ok := r.creditedFor(r.uid + "/" + g.packet)
		if !ok {
			t.Errorf("packet %s of %s never credited", g.packet, g.user)
			continue
		}
		if d.Kind != store.KindGrant || d.UserID != g.user || d.Amount != g.amount {
			t.Errorf("packet %s credited as %+v, want %s to %s", g.packet, d, fmtAmount(g.amount), g.user)
		}
	}
	if s.credited != len(grants) || s.total != want {
		t.Errorf("receiver credited %d deliveries totalling %d, want %d totalling %d", s.credited, s.total, len(grants), want)
	}
}

func fmtAmount(a int64) string { return fmt.Sprintf("%d", a) }

// grant is one granted packet.
type grant struct {
	user   string
	packet string
	amount int64
}

// activity is a seeded, open activity in a real Redis.
type activity struct {
	uid    string
	handle *store.Activity
	// keys are the activity's keys, for the raw reads a consumer group's state needs.
	keys store.Keys
	rdb  *redis.Client
	// amounts are the seeded packets' amounts: packet i+1 holds amounts[i].
	amounts []int64
}

// newActivity seeds count packets summing to total (uneven amounts) and opens it.
func newActivity(t *testing.T, rdb *redis.Client, uid string, count int, total int64, sponsor string) activity {
	t.Helper()
	ctx := context.Background()
	amounts := unevenSplit(t, count, total)
	h := store.NewActivity(rdb, uid, 1)
	if _, err := h.Seed(ctx, amounts, store.SeedParams{Count: int64(count), Total: total, Sponsor: sponsor}); err != nil {
		t.Fatalf("seeding: %v", err)
	}
	state, err := h.Configure(ctx, 0, 0, false, true)
	if err != nil || state.State != store.StateOpen {
		t.Fatalf("opening: state %q, err %v", state.State, err)
	}
	return activity{uid: uid, handle: h, keys: h.Shard(0).Keys(), rdb: rdb, amounts: amounts}
}

// unevenSplit is count uneven amounts summing to total: packet i+1 gets the i-th.
func unevenSplit(t *testing.T, count int, total int64) []int64 {
	t.Helper()
	amounts := make([]int64, count)
	var sum int64
	for i := range amounts {
		amounts[i] = 1 + int64(i%7)*3
		sum += amounts[i]
	}
	amounts[count-1] += total - sum
	if amounts[count-1] <= 0 {
		t.Fatalf("total %d too small for %d packets", total, count)
	}
	return amounts
}

// grab has n users grab a packet each and returns the grants by packet id.
func (a activity) grab(t *testing.T, first, n int) map[string]grant {
	t.Helper()
	grants := map[string]grant{}
	for i := first; i < first+n; i++ {
		user := fmt.Sprintf("user-%04d", i)
		res, err := a.handle.Shard(0).Grab(context.Background(), user)
		if err != nil || res.Outcome != store.Granted {
			t.Fatalf("grab by %s: %+v, %v", user, res, err)
		}
		grants[res.PacketID] = grant{user: user, packet: res.PacketID, amount: res.Amount}
	}
	return grants
}

func (a activity) snapshot(t *testing.T) store.Snapshot {
	t.Helper()
	s, err := a.handle.Snapshot(context.Background())
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	return s
}

// pending is the number of entries the group has read and not acknowledged.
func (a activity) pending(t *testing.T, group string) int64 {
	t.Helper()
	p, err := a.rdb.XPending(context.Background(), a.keys.Stream, group).Result()
	if err != nil {
		t.Fatalf("xpending: %v", err)
	}
	return p.Count
}

// pendingOf is the number of entries in one consumer's pending list.
func (a activity) pendingOf(t *testing.T, group, consumer string) int64 {
	t.Helper()
	p, err := a.rdb.XPending(context.Background(), a.keys.Stream, group).Result()
	if err != nil {
		t.Fatalf("xpending: %v", err)
	}
	return p.Consumers[consumer]
}

// checkSettledExactly asserts the settled counters equal the claimed ones.
func (a activity) checkSettledExactly(t *testing.T) store.Snapshot {
	t.Helper()
	s := a.snapshot(t)
	if s.SettledCount != s.ClaimedCount || s.SettledAmount != s.ClaimedAmount {
		t.Errorf("settled %d/%d, claimed %d/%d", s.SettledCount, s.SettledAmount, s.ClaimedCount, s.ClaimedAmount)
	}
	if s.RefundSettled != s.Refunded {
		t.Errorf("refund settled %d, refunded %d", s.RefundSettled, s.Refunded)
	}
	if s.DeadCount != 0 {
		t.Errorf("dead count %d", s.DeadCount)
	}
	if p := a.pending(t, DefaultGroup); p != 0 {
		t.Errorf("%d entries still pending", p)
	}
	return s
}

// startWorker runs a worker until the returned stop is called (or the test ends).
func startWorker(t *testing.T, cfg Config) (w *Worker, stop func()) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	w, err := NewWorker(cfg)
	if err != nil {
		t.Fatalf("new worker: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("worker %s: Run returned %v", cfg.Consumer, err)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("worker %s did not stop within 10s of cancellation", cfg.Consumer)
			}
		})
	}
	t.Cleanup(stop)
	return w, stop
}

// baseConfig is a worker config with short timings for tests.
func baseConfig(a activity, url, consumer string) Config {
	return Config{
		Redis:       a.rdb,
		Source:      Source{Namespace: "default", Name: a.uid, UID: a.uid, Currency: "CNY"},
		WebhookURL:  url,
		Consumer:    consumer,
		ClaimIdle:   2 * time.Second,
		BackoffBase: 10 * time.Millisecond,
		BackoffMax:  100 * time.Millisecond,
		Block:       100 * time.Millisecond,
		HTTPClient:  &http.Client{Timeout: 5 * time.Second},
	}
}

// eventually polls cond until it holds or the timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	wait.Until(t, timeout, what, func() (bool, string) { return cond(), "" })
}

// newRedis starts a real redis-server for the test.
func newRedis(t testing.TB) *redis.Client {
	t.Helper()
	return redistest.Start(t).Client(t)
}

// testLogger logs through t, at warning level and above.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
