package settlement

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
)

// eventsReceiver is a merchant's events endpoint: it checks each request's signature
// and key against its body, records each Idempotency-Key the first time it accepts it
// (a receiver deduplicates by the key), and fails a share of the requests: half of
// the failures before it records anything, half after (the answer lost on the way).
type eventsReceiver struct {
	t    *testing.T
	key  []byte
	uid  string
	addr string

	mu sync.Mutex
	// failShare of the requests are answered 500.
	failShare float64
	// stuck, while set, holds every request until the test ends.
	stuck    bool
	released chan struct{}
	// refuse answers 400 to the keys it says.
	refuse func(key string) bool

	accepted map[string]Event // by Idempotency-Key, the first body accepted
	seen     map[string]int   // by Idempotency-Key, requests
	order    map[string][]string
	failed   int
	problems []string
}

func newEventsReceiver(t *testing.T, uid string, key []byte) *eventsReceiver {
	t.Helper()
	r := &eventsReceiver{t: t, key: key, uid: uid, released: make(chan struct{}), accepted: map[string]Event{},
		seen: map[string]int{}, order: map[string][]string{}}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r.addr = l.Addr().String()
	srv := &http.Server{Handler: r, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() {
		r.release()
		_ = srv.Close()
	})
	return r
}

func (r *eventsReceiver) url() string { return "http://" + r.addr + "/events" }

func (r *eventsReceiver) release() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stuck {
		r.stuck = false
		close(r.released)
	}
}

func (r *eventsReceiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	key := req.Header.Get("Idempotency-Key")
	r.mu.Lock()
	if r.stuck {
		released := r.released
		r.mu.Unlock()
		select {
		case <-released:
		case <-req.Context().Done():
			return
		}
		r.mu.Lock()
	}
	defer r.mu.Unlock()
	r.seen[key]++
	if req.Header.Get("X-Signature") != Sign(r.key, body) || req.Header.Get("webhook-id") != WebhookID(key) {
		r.problems = append(r.problems, "bad signature or webhook-id on "+key)
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	var e Event
	if err := json.Unmarshal(body, &e); err != nil {
		r.problems = append(r.problems, fmt.Sprintf("body %s: %v", body, err))
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	if key != EventKey(r.uid, e.Data.PacketID, e.Type) || e.Data.BudgetUID != r.uid {
		r.problems = append(r.problems, fmt.Sprintf("event %s with key %q", body, key))
	}
	if r.refuse != nil && r.refuse(key) {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	fail := rand.Float64() < r.failShare
	if fail && rand.IntN(2) == 0 {
		r.failed++
		w.WriteHeader(http.StatusInternalServerError)
		return
	}
	if prev, ok := r.accepted[key]; ok {
		if b, _ := json.Marshal(prev); string(b) != string(body) {
			r.problems = append(r.problems, fmt.Sprintf("%s sent as %s, then as %s", key, b, body))
		}
	} else {
		r.accepted[key] = e
		r.order[e.Data.PacketID] = append(r.order[e.Data.PacketID], e.Type)
	}
	if fail {
		r.failed++
		w.WriteHeader(http.StatusInternalServerError)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// snapshot copies what the receiver recorded.
func (r *eventsReceiver) snapshot() (accepted map[string]Event, order map[string][]string, failed int, problems []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	accepted = make(map[string]Event, len(r.accepted))
	for k, v := range r.accepted {
		accepted[k] = v
	}
	order = make(map[string][]string, len(r.order))
	for k, v := range r.order {
		order[k] = slices.Clone(v)
	}
	return accepted, order, r.failed, slices.Clone(r.problems)
}

// eventsBudget is a configured budget on a real Redis with its settlement workers
// delivering to a balance system and its events workers to r.
type eventsBudget struct {
	tb   testBudget
	bal  *packetsBalance
	cfg  Config
	ecfg Config
}

// startEventsBudget configures a budget of shards on a new Redis, runs its settlement
// workers, creates its events groups and, when run, its events workers (as
// operator-a), delivering to r with maxAttempts.
func startEventsBudget(t *testing.T, uid string, shards int, r *eventsReceiver, maxAttempts int, run bool) eventsBudget {
	t.Helper()
	ctx := context.Background()
	key := []byte("operator-signing-key")
	rdb := newRedis(t)
	if _, err := lua.GrabLibrary.Ensure(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	b := store.NewBudget(rdb, uid, shards)
	tb := testBudget{t: t, rdb: rdb, b: b}
	bal := newPacketsBalance(t, key)
	cfg := packetsConfig(tb, bal.url(), "operator-a", key)
	cfg.Logger = testLogger(t)
	if _, err := AnnounceBudgetTotal(ctx, cfg, b, 10_000_000); err != nil {
		t.Fatal(err)
	}
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 20_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeRandom, split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
	if err := b.Configure(ctx, 10_000_000, limits); err != nil {
		t.Fatal(err)
	}
	ws, err := NewBudgetWorkers(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	runWorkers(t, ws)
	ecfg := cfg
	ecfg.WebhookURL = r.url()
	ecfg.MaxAttempts = maxAttempts
	ecfg.HealthyBackoffBase = 5 * time.Millisecond
	ecfg.BackoffMax = 50 * time.Millisecond
	ecfg.HTTPClient = &http.Client{Timeout: 2 * time.Second}
	eb := eventsBudget{tb: tb, bal: bal, cfg: cfg, ecfg: ecfg}
	if err := EnsureEventsGroups(ctx, b); err != nil {
		t.Fatal(err)
	}
	if run {
		eb.runEvents(t, "operator-a")
	}
	// The events groups exist before the first packet, as they do for a budget
	// created with its events webhook.
	for i := range shards {
		groups, err := rdb.XInfoGroups(ctx, b.ShardKeys(i).Stream).Result()
		if err != nil || !slices.ContainsFunc(groups, func(g redis.XInfoGroup) bool { return g.Name == store.EventsGroup }) {
			t.Fatalf("shard %d's groups: %v, %v", i, groups, err)
		}
	}
	return eb
}

// create creates packet id through the store's create function, as a grab pod does.
func (eb eventsBudget) create(id, sender string, total, count int64, distribution string) {
	eb.tb.t.Helper()
	if _, outcome, err := eb.tb.b.CreatePacket(context.Background(), store.NewPacket{ID: id, Sender: sender, Total: total,
		Count: count, Distribution: distribution}); err != nil || outcome != store.CreateCreated {
		eb.tb.t.Fatalf("creating %s: %v, %v", id, outcome, err)
	}
}

// expireAll closes the budget and expires every packet, as the operator's expiry does
// for a closed budget, and returns the snapshot after.
func (eb eventsBudget) expireAll() store.BudgetSnapshot {
	eb.tb.t.Helper()
	ctx, b := context.Background(), eb.tb.b
	if err := b.Close(ctx); err != nil {
		eb.tb.t.Fatal(err)
	}
	for i := range b.N() {
		if _, _, err := b.ExpireDue(ctx, i, 500); err != nil {
			eb.tb.t.Fatal(err)
		}
	}
	snap, err := b.Snapshot(ctx)
	if err != nil {
		eb.tb.t.Fatal(err)
	}
	return snap
}

// runEvents runs the budget's events workers as consumer until the returned stop
// is called or the test ends.
func (eb eventsBudget) runEvents(t *testing.T, consumer string) (stop func()) {
	t.Helper()
	cfg := eb.ecfg
	cfg.Consumer = consumer
	ws, err := NewBudgetEventsWorkers(cfg, eb.tb.b)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { RunEvents(ctx, ws); close(done) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

// A merchant's 240 packets over 4 budget shards, a third grabbed to their last share,
// the rest partly and then expired and refunded, raced by grabs while the events
// receiver fails 30 % of its requests (half of them after recording the event):
// every packet's events arrive in lifecycle order (created, then exhausted, or
// expired then refunded), each key is accepted exactly once with one body whatever the
// retries, the figures are the ledger's, and a forged entry of a packet never created
// announces nothing.
func TestBudgetEventsArriveInOrderOnceEachThroughAFailingReceiver(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-events"
	r := newEventsReceiver(t, uid, []byte("operator-signing-key"))
	r.failShare = 0.3
	eb := startEventsBudget(t, uid, 4, r, 40, true)
	b := eb.tb.b
	const packets = 240
	var wg sync.WaitGroup
	for p := range packets {
		id := fmt.Sprintf("order-%03d", p)
		eb.create(id, fmt.Sprintf("merchant-%d", p%3), 1000, 5, split.TypeRandom)
		grabs := p % 5
		if p%3 == 0 {
			grabs = 5
		}
		for u := range grabs {
			wg.Go(func() {
				if _, err := b.GrabPacket(ctx, id, fmt.Sprintf("user-%d", u)); err != nil {
					t.Error(err)
				}
			})
		}
	}
	wg.Wait()
	forged := eb.tb.grant("never-created", 0, "mallory", 7)
	snap := eb.expireAll()
	want := map[string][]string{}
	for p := range packets {
		id := fmt.Sprintf("order-%03d", p)
		if p%3 == 0 {
			want[id] = []string{EventPacketCreated, EventPacketExhausted}
		} else {
			want[id] = []string{EventPacketCreated, EventPacketExpired, EventPacketRefunded}
		}
	}
	eventually(t, 90*time.Second, "every packet's events", func() bool {
		accepted, _, _, _ := r.snapshot()
		return len(accepted) >= countEvents(want)
	})
	// Room for a stray event to arrive before the counts are taken.
	time.Sleep(500 * time.Millisecond)
	accepted, order, failed, problems := r.snapshot()
	if len(problems) > 0 {
		t.Fatalf("the receiver saw: %v", problems[:min(len(problems), 10)])
	}
	if failed == 0 {
		t.Fatal("the receiver failed no request: nothing was retried")
	}
	var refunded int64
	for id, types := range want {
		if !slices.Equal(order[id], types) {
			t.Errorf("packet %s: events %v, want %v in that order", id, order[id], types)
		}
		created := accepted[EventKey(uid, id, EventPacketCreated)]
		if created.Data.TotalAmount != 1000 || created.Data.Count != 5 || created.Data.Currency != "CNY" ||
			created.Data.Budget != "shop/group-packets" || !strings.HasPrefix(created.Data.Sender, "merchant-") {
			t.Errorf("packet %s created as %+v", id, created.Data)
		}
		if e, ok := accepted[EventKey(uid, id, EventPacketRefunded)]; ok {
			if e.Data.RefundAmount == nil || e.Data.RefundedAt == "" || e.Data.ExpiredAt == "" {
				t.Errorf("packet %s refunded as %+v", id, e.Data)
			} else {
				refunded += *e.Data.RefundAmount
			}
		}
		if e, ok := accepted[EventKey(uid, id, EventPacketExhausted)]; ok && e.Data.ExhaustedAt == "" {
			t.Errorf("packet %s exhausted as %+v", id, e.Data)
		}
	}
	if len(accepted) != countEvents(want) {
		t.Errorf("%d events accepted, want %d", len(accepted), countEvents(want))
	}
	if refunded != snap.Refunded {
		t.Errorf("the refunded events carry %d, the budget refunded %d", refunded, snap.Refunded)
	}
	if _, ok := order["never-created"]; ok {
		t.Errorf("the forged entry %s of a packet never created was announced: %v", forged, order["never-created"])
	}
	dead, err := b.SettlementLedger(0).EventDeadLetters(ctx)
	if err != nil || len(dead) != 0 {
		t.Errorf("events dead letters %v, %v; want none", dead, err)
	}
	t.Logf("%d events accepted once each; the receiver failed %d requests", len(accepted), failed)
}

func countEvents(want map[string][]string) int {
	n := 0
	for _, types := range want {
		n += len(types)
	}
	return n
}

// An events receiver that holds every request holds back neither settlement nor
// creation nor grabs: the packets are created, grabbed and expired, and settlement
// drains every shard, while not one event is answered; once the receiver answers
// again, every event arrives.
func TestStuckEventsReceiverHoldsNothingBack(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-stuck"
	r := newEventsReceiver(t, uid, []byte("operator-signing-key"))
	r.stuck = true
	eb := startEventsBudget(t, uid, 2, r, 40, true)
	b := eb.tb.b
	const packets = 50
	for p := range packets {
		id := fmt.Sprintf("order-%03d", p)
		eb.create(id, "merchant-1", 500, 2, split.TypeFixed)
		if _, err := b.GrabPacket(ctx, id, "user-1"); err != nil {
			t.Fatal(err)
		}
	}
	eb.expireAll()
	eventually(t, 20*time.Second, "settlement drained while the events receiver is stuck", func() bool {
		ok, err := BudgetDrained(ctx, b, "")
		return err == nil && ok
	})
	if accepted, _, _, _ := r.snapshot(); len(accepted) != 0 {
		t.Fatalf("%d events accepted by a receiver that answers nothing", len(accepted))
	}
	got, problems := eb.bal.credits()
	if len(problems) > 0 || len(got) != 2*packets {
		t.Fatalf("the balance system has %d credits (%v), want %d grants and refunds", len(got), problems, 2*packets)
	}
	r.release()
	eventually(t, 60*time.Second, "every event once the receiver answers", func() bool {
		accepted, _, _, _ := r.snapshot()
		return len(accepted) == 3*packets
	})
	_, order, _, _ := r.snapshot()
	for id, types := range order {
		if !slices.Equal(types, []string{EventPacketCreated, EventPacketExpired, EventPacketRefunded}) {
			t.Errorf("packet %s: events %v", id, types)
		}
	}
}

// An event the receiver refuses every time is parked in the budget's events dead
// letters after maxAttempts, and so is every later event of its packet, never
// delivered after it; the other packets' events arrive.
func TestRefusedEventIsDeadLetteredWithTheRestOfItsPacket(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-refused"
	r := newEventsReceiver(t, uid, []byte("operator-signing-key"))
	r.refuse = func(key string) bool { return key == EventKey(uid, "order-1", EventPacketCreated) }
	eb := startEventsBudget(t, uid, 1, r, 3, true)
	b := eb.tb.b
	for _, id := range []string{"order-1", "order-2"} {
		eb.create(id, "merchant-1", 300, 1, split.TypeFixed)
		if _, err := b.GrabPacket(ctx, id, "user-1"); err != nil {
			t.Fatal(err)
		}
	}
	ledger := b.SettlementLedger(0)
	eventually(t, 30*time.Second, "order-1's events dead-lettered and order-2's delivered", func() bool {
		dead, err := ledger.EventDeadLetters(ctx)
		accepted, _, _, _ := r.snapshot()
		return err == nil && len(dead) == 2 && len(accepted) == 2
	})
	dead, _ := ledger.EventDeadLetters(ctx)
	if dead[0].Key != EventKey(uid, "order-1", EventPacketCreated) || dead[1].Key != EventKey(uid, "order-1", EventPacketExhausted) ||
		!strings.Contains(dead[0].Error, "400") || !strings.Contains(dead[1].Error, "earlier event") {
		t.Errorf("dead letters %+v", dead)
	}
	_, order, _, _ := r.snapshot()
	if len(order["order-1"]) != 0 || !slices.Equal(order["order-2"], []string{EventPacketCreated, EventPacketExhausted}) {
		t.Errorf("events delivered %v", order)
	}
}

// The operator that delivered events dies with a read half done (its context ends
// while the receiver holds its requests); another operator, under another consumer
// name, takes the read over after the claim idle time: every packet's events
// arrive, in order, each key accepted once with one body.
func TestEventsReadOfADeadOperatorIsTakenOver(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-failover"
	r := newEventsReceiver(t, uid, []byte("operator-signing-key"))
	r.failShare = 0.3
	eb := startEventsBudget(t, uid, 1, r, 40, false)
	b := eb.tb.b
	const packets = 60
	for p := range packets {
		id := fmt.Sprintf("order-%03d", p)
		eb.create(id, "merchant-1", 600, 3, split.TypeFixed)
		for u := range 3 {
			if _, err := b.GrabPacket(ctx, id, fmt.Sprintf("user-%d", u)); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The first operator reads everything, delivers a part, and dies while the
	// receiver holds the rest.
	stopDead := eb.runEvents(t, "operator-dead")
	eventually(t, 20*time.Second, "a part of the events", func() bool {
		accepted, _, _, _ := r.snapshot()
		return len(accepted) >= packets/2
	})
	r.mu.Lock()
	r.stuck, r.released = true, make(chan struct{})
	r.mu.Unlock()
	time.Sleep(200 * time.Millisecond)
	stopDead()
	pending, err := eb.tb.rdb.XPending(ctx, b.ShardKeys(0).Stream, store.EventsGroup).Result()
	if err != nil || pending.Count == 0 {
		t.Fatalf("the dead operator left %+v, %v pending; the test needs a read half done", pending, err)
	}
	accepted, _, _, _ := r.snapshot()
	if len(accepted) == 2*packets {
		t.Fatal("every event was delivered before the operator died")
	}
	r.release()
	eb.runEvents(t, "operator-b")
	eventually(t, 60*time.Second, "every packet's events", func() bool {
		accepted, _, _, _ := r.snapshot()
		return len(accepted) == 2*packets
	})
	_, order, _, problems := r.snapshot()
	if len(problems) > 0 {
		t.Fatalf("the receiver saw: %v", problems)
	}
	for p := range packets {
		id := fmt.Sprintf("order-%03d", p)
		if !slices.Equal(order[id], []string{EventPacketCreated, EventPacketExhausted}) {
			t.Errorf("packet %s: events %v", id, order[id])
		}
	}
	eventually(t, 10*time.Second, "the events group acknowledged everything", func() bool {
		n, err := eb.tb.rdb.XPending(ctx, b.ShardKeys(0).Stream, store.EventsGroup).Result()
		return err == nil && n.Count == 0
	})
}
