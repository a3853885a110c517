package settlement

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// packetsBalance is a balance system for a RedPacketBudget, as docs/operations.md
// describes it: it verifies the signature, takes the highest announced total of each
// budget UID, refuses credits of a budget not announced or beyond its total, and
// credits each Idempotency-Key once. It checks every body against the contract.
type packetsBalance struct {
	t    *testing.T
	key  []byte
	addr string

	mu        sync.Mutex
	announced map[string][]byte // by Idempotency-Key: the first body
	total     map[string]int64  // by budget UID
	credited  map[string]int64  // by budget UID
	byKey     map[string]Delivery
	requests  map[string]int // by Idempotency-Key
	problems  []string
	// refuse, when set, answers a request with its status when it is not 0.
	refuse func(key string) int
}

func newPacketsBalance(t *testing.T, key []byte) *packetsBalance {
	t.Helper()
	b := &packetsBalance{t: t, key: key, announced: map[string][]byte{}, total: map[string]int64{}, credited: map[string]int64{},
		byKey: map[string]Delivery{}, requests: map[string]int{}}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b.addr = l.Addr().String()
	srv := &http.Server{Handler: b, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	return b
}

func (b *packetsBalance) url() string { return "http://" + b.addr + "/credits" }

func (b *packetsBalance) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	key := r.Header.Get("Idempotency-Key")
	b.mu.Lock()
	defer b.mu.Unlock()
	b.requests[key]++
	if r.Header.Get("X-Signature") != Sign(b.key, body) {
		b.problems = append(b.problems, "bad signature on "+key)
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	if b.refuse != nil {
		if status := b.refuse(key); status != 0 {
			w.WriteHeader(status)
			return
		}
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(body, &raw); err != nil {
		b.problems = append(b.problems, fmt.Sprintf("body %s: %v", body, err))
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	names := make([]string, 0, len(raw))
	for k := range raw {
		names = append(names, k)
	}
	sort.Strings(names)
	var kind string
	_ = json.Unmarshal(raw["kind"], &kind)
	if kind == KindAnnouncement {
		var a budgetTotalDelivery
		_ = json.Unmarshal(body, &a)
		if want := []string{"activity", "activityUID", "amount", "at", "currency", "kind", "source"}; !slices.Equal(names, want) {
			b.problems = append(b.problems, fmt.Sprintf("announcement fields %v, want %v", names, want))
		}
		if a.Source != SourceBudget || key != BudgetIdempotencyKeyOf(a.ActivityUID, a.Amount) {
			b.problems = append(b.problems, fmt.Sprintf("announcement %s with key %q", body, key))
		}
		if prev, ok := b.announced[key]; ok && string(prev) != string(body) {
			b.problems = append(b.problems, fmt.Sprintf("announcement %s sent again as %s", prev, body))
		}
		if _, ok := b.announced[key]; !ok {
			b.announced[key] = body
		}
		b.total[a.ActivityUID] = max(b.total[a.ActivityUID], a.Amount)
		w.WriteHeader(http.StatusOK)
		return
	}
	if want := []string{"activity", "activityUID", "amount", "at", "currency", "kind", "packetId", "source", "sourceRef", "userId"}; !slices.Equal(names, want) {
		b.problems = append(b.problems, fmt.Sprintf("delivery fields %v, want %v", names, want))
	}
	var d Delivery
	_ = json.Unmarshal(body, &d)
	if d.Source != SourceBudget || key != d.ActivityUID+"/"+d.PacketID {
		b.problems = append(b.problems, fmt.Sprintf("delivery %s with key %q", body, key))
	}
	if prev, ok := b.byKey[key]; ok {
		if prev != d {
			b.problems = append(b.problems, fmt.Sprintf("%s delivered as %+v, then as %+v", key, prev, d))
		}
		w.WriteHeader(http.StatusOK)
		return
	}
	total, ok := b.total[d.ActivityUID]
	if !ok || b.credited[d.ActivityUID]+d.Amount > total {
		b.problems = append(b.problems, fmt.Sprintf("credit %s beyond the announced budget %d", key, total))
		w.WriteHeader(http.StatusConflict)
		return
	}
	b.credited[d.ActivityUID] += d.Amount
	b.byKey[key] = d
	w.WriteHeader(http.StatusOK)
}

// credits returns the credited deliveries by Idempotency-Key, and the problems seen.
func (b *packetsBalance) credits() (map[string]Delivery, []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make(map[string]Delivery, len(b.byKey))
	for k, v := range b.byKey {
		out[k] = v
	}
	return out, slices.Clone(b.problems)
}

func (b *packetsBalance) requestsFor(key string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.requests[key]
}

// testBudget is a budget's keys on a real redis-server, written the way the store's
// scripts write them: each shard's meta hash holds a state, grants are packed
// entries, refunds the refund fields.
type testBudget struct {
	t   *testing.T
	rdb *redis.Client
	b   *store.Budget
}

func newTestBudget(t *testing.T, uid string, shards int) testBudget {
	t.Helper()
	rdb := newRedis(t)
	b := store.NewBudget(rdb, uid, shards)
	for i := range shards {
		if err := rdb.HSet(context.Background(), b.ShardKeys(i).Meta, "state", "open").Err(); err != nil {
			t.Fatal(err)
		}
	}
	return testBudget{t: t, rdb: rdb, b: b}
}

// grant appends the grant of share of packet to user, as the grab function does, on
// the packet's shard, and returns the entry id.
func (tb testBudget) grant(packet string, share int, user string, amount int64) string {
	tb.t.Helper()
	k := tb.b.ShardKeys(tb.b.ShardOf(packet))
	id, err := tb.rdb.XAdd(context.Background(), &redis.XAddArgs{Stream: k.Stream, Values: []string{
		"grant", fmt.Sprintf("%s/%d:%d:0:CNY:%s", packet, share, amount, user)}}).Result()
	if err != nil {
		tb.t.Fatal(err)
	}
	return id
}

// refund appends the refund of packet's remainder to sender, as expiry does.
func (tb testBudget) refund(packet, sender string, amount int64, at time.Time) string {
	tb.t.Helper()
	k := tb.b.ShardKeys(tb.b.ShardOf(packet))
	id, err := tb.rdb.XAdd(context.Background(), &redis.XAddArgs{Stream: k.Stream, Values: []string{
		"kind", "refund", "packet", packet + "/refund", "user", sender, "amount", strconv.FormatInt(amount, 10),
		"currency", "CNY", "at", strconv.FormatInt(at.UnixMilli(), 10)}}).Result()
	if err != nil {
		tb.t.Fatal(err)
	}
	return id
}

// created appends packet's creation record, as packet_create does before any grant
// of it, on the packet's shard: its sender, its shares in grab order (their sum is
// its total) and its expiry.
func (tb testBudget) created(packet, sender string, expires time.Time, shares ...int64) string {
	tb.t.Helper()
	var total int64
	list := make([]string, len(shares))
	for i, a := range shares {
		total += a
		list[i] = strconv.FormatInt(a, 10)
	}
	k := tb.b.ShardKeys(tb.b.ShardOf(packet))
	id, err := tb.rdb.XAdd(context.Background(), &redis.XAddArgs{Stream: k.Stream, Values: []string{
		"create", fmt.Sprintf("%s:%d:%d:%s:%s", packet, total, expires.UnixMilli(), strings.Join(list, ","), sender)}}).Result()
	if err != nil {
		tb.t.Fatal(err)
	}
	return id
}

// tombstone writes packet's tombstone as packet_forget leaves it once its refund
// settled (the fields it keeps and f), so the check takes the packet as forgotten.
func (tb testBudget) tombstone(packet string) {
	tb.t.Helper()
	k := tb.b.ShardKeys(tb.b.ShardOf(packet))
	if err := tb.rdb.HSet(context.Background(), k.Packet(packet), "fp", "f", "snd", "merchant-7", "tot", 700, "cnt", 1,
		"dst", split.TypeFixed, "ct", 0, "ex", 1, "g", 1, "r", 0, "x", 1, "f", 1).Err(); err != nil {
		tb.t.Fatal(err)
	}
}

// raw appends an entry with the given fields to shard i's stream.
func (tb testBudget) raw(i int, values ...string) string {
	tb.t.Helper()
	id, err := tb.rdb.XAdd(context.Background(), &redis.XAddArgs{Stream: tb.b.ShardKeys(i).Stream, Values: values}).Result()
	if err != nil {
		tb.t.Fatal(err)
	}
	return id
}

// deadLetters lists every shard's dead letters' errors by the entry id they parked.
func (tb testBudget) deadLetters() map[string]string {
	tb.t.Helper()
	out := map[string]string{}
	for i := range tb.b.N() {
		msgs, err := tb.rdb.XRange(context.Background(), tb.b.ShardKeys(i).DeadLetters, "-", "+").Result()
		if err != nil {
			tb.t.Fatal(err)
		}
		for _, m := range msgs {
			out[m.Values["entry"].(string)] = m.Values["error"].(string)
		}
	}
	return out
}

// configuredBudget makes b, on tb's Redis, the way the reconcile does: the grab
// library loaded there, a total of 1,000 announced to a new test balance system and
// the shards configured (Fixed packets of at most 10 shares and maxTotal), and
// returns the balance system and the workers' config for consumer.
func configuredBudget(t *testing.T, tb testBudget, consumer string, maxTotal int64) (*packetsBalance, Config) {
	t.Helper()
	ctx := context.Background()
	key := []byte("operator-signing-key")
	if _, err := lua.GrabLibrary.Ensure(ctx, tb.rdb); err != nil {
		t.Fatal(err)
	}
	bal := newPacketsBalance(t, key)
	cfg := packetsConfig(tb, bal.url(), consumer, key)
	if _, err := AnnounceBudgetTotal(ctx, cfg, tb.b, 1000); err != nil {
		t.Fatal(err)
	}
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: maxTotal, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
	if err := tb.b.Configure(ctx, 1000, limits); err != nil {
		t.Fatal(err)
	}
	return bal, cfg
}

// runWorkers runs ws until the test ends.
func runWorkers(t *testing.T, ws []*Worker) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- RunAll(ctx, ws) }()
	t.Cleanup(func() { cancel(); <-done })
}

// settleBudget runs b's workers with cfg until the test ends and waits until every
// shard's stream is drained (what stands for what drained).
func settleBudget(t *testing.T, cfg Config, b *store.Budget, what string) {
	t.Helper()
	ws, err := NewBudgetWorkers(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	runWorkers(t, ws)
	eventually(t, 20*time.Second, what, func() bool {
		ok, err := BudgetDrained(context.Background(), b, "")
		return err == nil && ok
	})
}

// budgetTenant makes b's own Redis user on srv, with a password, and returns a
// client logged in as it: what the tenant holds.
func budgetTenant(t *testing.T, srv *redistest.Server, b *store.Budget) *redis.Client {
	t.Helper()
	if _, err := b.EnsureUser(context.Background(), "tenant-password"); err != nil {
		t.Fatal(err)
	}
	tenant := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: b.UserName(), Password: "tenant-password"})
	t.Cleanup(func() { _ = tenant.Close() })
	return tenant
}

// forgotten records the packets a worker forgot.
type forgotten struct {
	mu  sync.Mutex
	ids map[string]int
}

func (f *forgotten) forget(_ context.Context, ids []string, _ time.Duration) []error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, id := range ids {
		f.ids[id]++
	}
	return make([]error, len(ids))
}

func (f *forgotten) count(id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ids[id]
}

// startBudgetWorkers runs the budget's workers (with forget in place of the store's
// ForgetPackets) until the returned stop is called or the test ends.
func startBudgetWorkers(t *testing.T, tb testBudget, cfg Config, f *forgotten) (stop func()) {
	t.Helper()
	cfg.Redis = tb.rdb
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	ws, err := NewBudgetWorkers(cfg, tb.b)
	if err != nil {
		t.Fatal(err)
	}
	ws[0].verifier.(*packetsCheck).forget = f.forget
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- RunAll(ctx, ws) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("budget workers: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("budget workers did not stop within 10s")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// packetsConfig is a budget's worker config with short timings for tests.
func packetsConfig(tb testBudget, url, consumer string, key []byte) Config {
	cfg := BudgetConfigFor("shop", "group-packets", tb.b.UID(), "CNY", url, 3, key, Packets{MaxCount: 10})
	cfg.Redis = tb.rdb
	cfg.Consumer = consumer
	cfg.ClaimIdle = 2 * time.Second
	cfg.BackoffBase = 10 * time.Millisecond
	cfg.BackoffMax = 100 * time.Millisecond
	cfg.Block = 100 * time.Millisecond
	return cfg
}

// A budget's grants and refunds, over its shards, are each delivered once, signed
// with the operator's key, with the Idempotency-Keys "<uid>/<packet>/<share>" and
// "<uid>/<packet>/refund" and the budget in the activity fields; the budget total
// was announced before; each refunded packet is forgotten once its refund was
// delivered; the ledger counts exactly what was credited and the streams drain.
func TestBudgetGrantsAndRefundsAreDeliveredOnceSigned(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-1"
	key := []byte("operator-signing-key")
	tb := newTestBudget(t, uid, 4)
	bal := newPacketsBalance(t, key)
	cfg := packetsConfig(tb, bal.url(), "operator-a", key)
	if got, err := AnnounceBudgetTotal(ctx, cfg, tb.b, 100000); err != nil || got != 100000 {
		t.Fatalf("announcing: %d, %v", got, err)
	}

	type credit struct {
		user   string
		amount int64
	}
	want := map[string]credit{}
	at := time.Now().Add(-time.Minute)
	for p := range 20 {
		packet := fmt.Sprintf("order-%03d", p)
		// The entries stand for packets created since the announcement and gone:
		// their tombstones say they existed (an entry of a packet with neither is
		// packet_unknown).
		tb.tombstone(packet)
		var shares []int64
		var rest int64 = 1000
		for s := range p % 4 {
			shares = append(shares, int64(100+10*s+p))
			rest -= int64(100 + 10*s + p)
		}
		tb.created(packet, "merchant-7", at, append(shares, rest)...)
		var granted int64
		for s := range p % 4 {
			amount := int64(100 + 10*s + p)
			tb.grant(packet, s, fmt.Sprintf("user-%d", s), amount)
			want[uid+"/"+packet+"/"+strconv.Itoa(s)] = credit{fmt.Sprintf("user-%d", s), amount}
			granted += amount
		}
		if p%2 == 0 {
			tb.refund(packet, "merchant-7", 1000-granted, at)
			want[uid+"/"+packet+"/refund"] = credit{"merchant-7", 1000 - granted}
		}
	}
	f := &forgotten{ids: map[string]int{}}
	startBudgetWorkers(t, tb, cfg, f)
	eventually(t, 20*time.Second, "every grant and refund credited", func() bool {
		got, _ := bal.credits()
		return len(got) == len(want)
	})
	eventually(t, 10*time.Second, "every shard drained", func() bool {
		ok, err := BudgetDrained(ctx, tb.b, "")
		return err == nil && ok
	})
	got, problems := bal.credits()
	if len(problems) > 0 {
		t.Fatalf("the balance system saw: %v", problems)
	}
	var sum int64
	for k, w := range want {
		d, ok := got[k]
		if !ok || d.UserID != w.user || d.Amount != w.amount || d.Activity != "shop/group-packets" || d.ActivityUID != uid || d.Currency != "CNY" {
			t.Errorf("%s credited as %+v (%v), want %+v", k, d, ok, w)
		}
		if n := bal.requestsFor(k); n != 1 {
			t.Errorf("%s delivered %d times, want once", k, n)
		}
		sum += w.amount
	}
	for p := range 20 {
		packet := fmt.Sprintf("order-%03d", p)
		if wantForgot := map[bool]int{true: 1, false: 0}[p%2 == 0]; f.count(packet) != wantForgot {
			t.Errorf("packet %s forgotten %d times, want %d", packet, f.count(packet), wantForgot)
		}
	}
	sums, err := tb.b.SettlementLedger(0).Sums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sums.Credited != sum || sums.Total != 100000 || sums.Grants+sums.Refunds != int64(len(want)) {
		t.Errorf("ledger %+v, want %d credited in %d entries of 100000", sums, sum, len(want))
	}
	if dead := tb.deadLetters(); len(dead) != 0 {
		t.Errorf("dead letters: %v", dead)
	}
}

// Entries no script of the budget wrote are dead-lettered as forged, never
// delivered, each raised (OnForged) and counted by reason: a credit beyond the
// announced budget, a key credited before to another user, a packet id that is not
// a packet's key, fields that are not an entry, and one older than the ledger's
// memory. The genuine entries around them are paid.
func TestBudgetForgedEntriesAreDeadLetteredNeverDelivered(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-forged"
	key := []byte("operator-signing-key")
	// One shard: entry ids name the entries (two shards' streams may use the same id).
	tb := newTestBudget(t, uid, 1)
	bal := newPacketsBalance(t, key)
	reg := prometheus.NewRegistry()
	cfg := packetsConfig(tb, bal.url(), "operator-a", key)
	cfg.Registerer = reg
	var mu sync.Mutex
	raised := map[string]string{}
	cfg.OnForged = func(e ForgedEntry) {
		mu.Lock()
		raised[e.EntryID] = e.Reason
		mu.Unlock()
	}
	if _, err := AnnounceBudgetTotal(ctx, cfg, tb.b, 1000); err != nil {
		t.Fatal(err)
	}
	// p-1 and p-2 were created and are gone (tombstones); the other ids are refused
	// before their packets are looked up. p-1's creation record draws the whole
	// 1,000, so p-2's cannot be booked and its grant has no account.
	tb.tombstone("p-1")
	tb.tombstone("p-2")
	genuine := []string{tb.created("p-1", "merchant-7", time.Now(), 300, 200, 500),
		tb.grant("p-1", 0, "alice", 300), tb.grant("p-1", 1, "bob", 200)}
	forged := map[string]string{
		tb.created("p-2", "mallory", time.Now(), 501): ReasonOverBudget,
		tb.grant("p-2", 0, "mallory", 501):            ReasonPacketUnknown,
		tb.grant("p-1", 0, "mallory", 300):            ReasonDuplicatePacket,
		tb.grant("p-1", 2, "mallory", 499):            ReasonAmountMismatch,
		tb.grant("p-1", 3, "mallory", 1):              ReasonPacketOutOfRange,
		tb.refund("p-1", "mallory", 500, time.Now()):  ReasonClaimMismatch,
		tb.grant("p-3", 10, "mallory", 1):             ReasonPacketIDMalformed,
		tb.raw(0, "grant", "p-4:1:0:CNY:mallory"):     ReasonPacketIDMalformed,
		tb.raw(0, "kind", "refund", "packet", "p-5/0", "user", "mallory", "amount", "1", "currency", "CNY", "at", "1"): ReasonPacketIDMalformed,
		tb.raw(0, "grant", "p-6/0:many:0:CNY:mallory"):                                                                 ReasonMalformed,
		tb.refund("p-7", "mallory", 1, time.Now().Add(-8*24*time.Hour)):                                                ReasonStaleEntry,
	}
	genuine = append(genuine, tb.refund("p-1", "merchant-7", 500, time.Now()))
	f := &forgotten{ids: map[string]int{}}
	startBudgetWorkers(t, tb, cfg, f)
	eventually(t, 20*time.Second, "every forged entry dead-lettered", func() bool {
		return len(tb.deadLetters()) == len(forged)
	})
	eventually(t, 10*time.Second, "every shard drained", func() bool {
		ok, err := BudgetDrained(ctx, tb.b, "")
		return err == nil && ok
	})
	got, problems := bal.credits()
	if len(problems) > 0 {
		t.Fatalf("the balance system saw: %v", problems)
	}
	if len(got) != len(genuine)-1 || got[uid+"/p-1/0"].UserID != "alice" || got[uid+"/p-1/refund"].Amount != 500 {
		t.Errorf("credited %v, want the %d genuine credits", got, len(genuine)-1)
	}
	dead := tb.deadLetters()
	counts := map[string]float64{}
	mu.Lock()
	defer mu.Unlock()
	for id, reason := range forged {
		if want := "forged settlement entry (" + reason + ")"; len(dead[id]) < len(want) || dead[id][:len(want)] != want {
			t.Errorf("entry %s dead-lettered with %q, want %s…", id, dead[id], want)
		}
		if raised[id] != reason {
			t.Errorf("entry %s raised as %q, want %q", id, raised[id], reason)
		}
		counts[reason]++
	}
	for reason, n := range counts {
		if got := testutil.ToFloat64(mustForged(t, reg, reason)); got != n {
			t.Errorf("forged_total{reason=%q} = %v, want %v", reason, got, n)
		}
	}
	if f.count("p-7") != 0 || f.count("p-1") != 1 {
		t.Errorf("forgotten p-7 %d times (a forged refund), p-1 %d times; want 0 and 1", f.count("p-7"), f.count("p-1"))
	}
	sums, err := tb.b.SettlementLedger(0).Sums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sums.Credited != 1000 || sums.Credited > sums.Total {
		t.Errorf("ledger %+v, want 1000 credited of 1000", sums)
	}
}

// A key is credited once across a worker restart: after the first worker delivered
// it and stopped, a second worker (another consumer) finds the same key again, once
// with the same body (delivered again, the balance system dedups it), once for the
// same user at another time and once for another user (both dead-lettered as
// duplicates, never delivered).
func TestBudgetKeyIsCreditedOnceAcrossAWorkerRestart(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-restart"
	key := []byte("operator-signing-key")
	tb := newTestBudget(t, uid, 2)
	bal := newPacketsBalance(t, key)
	cfg := packetsConfig(tb, bal.url(), "operator-a", key)
	if _, err := AnnounceBudgetTotal(ctx, cfg, tb.b, 5000); err != nil {
		t.Fatal(err)
	}
	tb.tombstone("p-9") // created since the announcement, and gone
	tb.created("p-9", "merchant-7", time.Now(), 700)
	first := tb.grant("p-9", 0, "alice", 700)
	f := &forgotten{ids: map[string]int{}}
	stop := startBudgetWorkers(t, tb, cfg, f)
	eventually(t, 10*time.Second, "the grant credited", func() bool {
		got, _ := bal.credits()
		return len(got) == 1
	})
	eventually(t, 10*time.Second, "drained", func() bool {
		ok, err := BudgetDrained(ctx, tb.b, "")
		return err == nil && ok
	})
	stop()
	tb.tombstone("p-9")

	// Once p-9 is forgotten (its tombstone left): a copy with the same body (as a
	// replayed dead letter keeps the grant's time), another with the same user, amount
	// and another time, and one for another user.
	ms, _, _ := strings.Cut(first, "-")
	again := tb.raw(tb.b.ShardOf("p-9"), "grant", "p-9/0:700:0:CNY:alice", "at", ms)
	later := tb.grant("p-9", 0, "alice", 700)
	dup := tb.grant("p-9", 0, "mallory", 700)
	startBudgetWorkers(t, tb, packetsConfig(tb, bal.url(), "operator-b", key), f)
	eventually(t, 10*time.Second, "the duplicates dead-lettered", func() bool { return len(tb.deadLetters()) == 2 })
	eventually(t, 10*time.Second, "drained", func() bool {
		ok, err := BudgetDrained(ctx, tb.b, "")
		return err == nil && ok
	})
	got, problems := bal.credits()
	if len(problems) > 0 {
		t.Fatalf("the balance system saw: %v", problems)
	}
	if len(got) != 1 || got[uid+"/p-9/0"].UserID != "alice" {
		t.Fatalf("credited %v, want p-9/0 to alice once", got)
	}
	if n := bal.requestsFor(uid + "/p-9/0"); n != 2 {
		t.Errorf("p-9/0 sent %d times, want twice (%s, then the copy %s for the same user)", n, first, again)
	}
	for _, id := range []string{later, dup} {
		if dead := tb.deadLetters()[id]; !strings.HasPrefix(dead, "forged settlement entry (duplicate_packet)") {
			t.Errorf("entry %s dead-lettered as %q, want a duplicate: %v", id, dead, tb.deadLetters())
		}
	}
	sums, err := tb.b.SettlementLedger(0).Sums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sums.Credited != 700 || sums.Grants != 1 {
		t.Errorf("ledger %+v, want one grant of 700", sums)
	}
}

// The budget total is announced before credits and again, as the whole new total
// under its own key, when it grows; a failed announcement is resent with the same
// body; a lower total announces nothing. Credits beyond the announced total are
// refused by the ledger until the new total is announced.
func TestBudgetTotalIsAnnouncedOnceAndAgainWhenRaised(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-total"
	key := []byte("operator-signing-key")
	tb := newTestBudget(t, uid, 1)
	bal := newPacketsBalance(t, key)
	cfg := packetsConfig(tb, bal.url(), "operator-a", key)
	ledger := tb.b.SettlementLedger(0)

	if _, err := ledger.Decide(ctx, []store.BudgetCredit{{Kind: "grant", PacketID: "p", Share: "0", UserID: "u", Amount: 1}}); err == nil {
		t.Fatal("the ledger decided a credit before any total was announced")
	}
	failOnce := true
	bal.refuse = func(k string) int {
		if k == BudgetIdempotencyKeyOf(uid, 1000) && failOnce {
			failOnce = false
			return http.StatusServiceUnavailable
		}
		return 0
	}
	if _, err := AnnounceBudgetTotal(ctx, cfg, tb.b, 1000); err == nil {
		t.Fatal("an announcement answered 503 was taken as done")
	}
	if got, err := AnnounceBudgetTotal(ctx, cfg, tb.b, 1000); err != nil || got != 1000 {
		t.Fatalf("announcing again: %d, %v", got, err)
	}
	v, err := ledger.Decide(ctx, []store.BudgetCredit{
		{Kind: "grant", PacketID: "p", Share: "0", UserID: "u", Amount: 600},
		{Kind: "grant", PacketID: "q", Share: "0", UserID: "u", Amount: 600},
	})
	if err != nil || v[0].Verdict != store.LedgerCredit || v[1].Verdict != store.LedgerOverBudget {
		t.Fatalf("verdicts %v, %v; want ok, over_budget", v, err)
	}
	if got, err := AnnounceBudgetTotal(ctx, cfg, tb.b, 1500); err != nil || got != 1500 {
		t.Fatalf("announcing the refill: %d, %v", got, err)
	}
	if got, err := AnnounceBudgetTotal(ctx, cfg, tb.b, 900); err != nil || got != 1500 {
		t.Fatalf("announcing a lower total: %d, %v; want the announced 1500 kept", got, err)
	}
	v, err = ledger.Decide(ctx, []store.BudgetCredit{{Kind: "grant", PacketID: "q", Share: "0", UserID: "u", Amount: 600}})
	if err != nil || v[0].Verdict != store.LedgerCredit {
		t.Fatalf("after the refill: %v, %v; want ok", v, err)
	}
	bal.mu.Lock()
	defer bal.mu.Unlock()
	if len(bal.problems) > 0 {
		t.Fatalf("the balance system saw: %v", bal.problems)
	}
	keys := make([]string, 0, len(bal.announced))
	for k := range bal.announced {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	if want := []string{uid + "/budget:1000", uid + "/budget:1500"}; !slices.Equal(keys, want) {
		t.Errorf("announced %v, want %v", keys, want)
	}
	if bal.requests[uid+"/budget:1000"] != 2 || bal.requests[uid+"/budget:1500"] != 1 {
		t.Errorf("announcement requests %v", bal.requests)
	}
}

// With the store's own scripts: packets created, grabbed, then expired by the
// budget's close, are settled through the budget's workers with the store's
// ForgetPacket: every grant and refund is credited once and matches the packet, each
// expired packet with a refund is gone once the refund was delivered, the ledger equals the
// budget's claimed + refunded, and entries that do not match a packet still in
// Redis (a grant the packet does not record, a refund of another amount) are
// dead-lettered as claim_mismatch.
func TestBudgetSettlesPacketsMadeByTheStoreAndForgetsThem(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-store"
	key := []byte("operator-signing-key")
	rdb := newRedis(t)
	if _, err := lua.GrabLibrary.Ensure(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	b := store.NewBudget(rdb, uid, 4)
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 20_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeRandom, split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
	tb := testBudget{t: t, rdb: rdb, b: b}
	bal := newPacketsBalance(t, key)
	cfg := packetsConfig(tb, bal.url(), "operator-a", key)
	// Announce first, then raise the shards' allotment: nothing is ever drawn beyond
	// what the balance system was told.
	if _, err := AnnounceBudgetTotal(ctx, cfg, b, 100_000); err != nil {
		t.Fatal(err)
	}
	if err := b.Configure(ctx, 100_000, limits); err != nil {
		t.Fatal(err)
	}
	const packets = 12
	for p := range packets {
		id := fmt.Sprintf("order-%02d", p)
		if _, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "merchant-7", Total: 1000, Count: 5,
			Distribution: split.TypeRandom}); err != nil || outcome != store.CreateCreated {
			t.Fatalf("creating %s: %v, %v", id, outcome, err)
		}
		for u := range p % 6 {
			if _, err := b.GrabPacket(ctx, id, fmt.Sprintf("user-%d", u)); err != nil {
				t.Fatal(err)
			}
		}
	}
	// A grant the packet does not record (mallory never grabbed order-01), and a
	// refund of another amount than order-02's remainder, written before expiry.
	forgedGrant := tb.grant("order-01", 0, "mallory", 1)
	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range b.N() {
		if _, _, err := b.ExpireDue(ctx, i, 500); err != nil {
			t.Fatal(err)
		}
	}
	forgedRefund := tb.refund("order-02", "merchant-7", 1, time.Now())
	snap, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !snap.Conserved() || snap.Live != 0 || snap.Claimed+snap.Refunded != packets*1000 {
		t.Fatalf("snapshot %+v after expiry", snap)
	}

	settleBudget(t, func() Config { c := cfg; c.Logger = testLogger(t); return c }(), b, "every shard drained")
	got, problems := bal.credits()
	if len(problems) > 0 {
		t.Fatalf("the balance system saw: %v", problems)
	}
	var credited int64
	for _, d := range got {
		credited += d.Amount
	}
	if credited != snap.Claimed+snap.Refunded {
		t.Errorf("credited %d, want claimed %d + refunded %d", credited, snap.Claimed, snap.Refunded)
	}
	// A packet grabbed to its last share has nothing to refund: expiry writes no
	// refund entry for it, so settlement has nothing to forget it after.
	const emptied = 2 // order-05 and order-11
	if n := int64(len(got)); n != snap.GrabbedShares+packets-emptied {
		t.Errorf("%d credits, want %d grants and %d refunds", n, snap.GrabbedShares, packets-emptied)
	}
	for p := range packets {
		id := fmt.Sprintf("order-%02d", p)
		if p%6 == 5 {
			continue
		}
		if _, ok := got[uid+"/"+id+"/refund"]; !ok {
			t.Errorf("packet %s: no refund credited", id)
		}
		if d, exists, err := b.Packet(ctx, id); err != nil || !exists || !d.Forgotten || len(d.Grabs) != 0 {
			t.Errorf("packet %s after its refund was delivered: %+v, found %v, %v; want its tombstone", id, d, exists, err)
		}
	}
	dead := tb.deadLetters()
	for _, id := range []string{forgedGrant, forgedRefund} {
		if !strings.HasPrefix(dead[id], "forged settlement entry (claim_mismatch)") {
			t.Errorf("entry %s dead-lettered as %q, want claim_mismatch; all: %v", id, dead[id], dead)
		}
	}
	sums, err := b.SettlementLedger(0).Sums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sums.Granted != snap.Claimed || sums.Refunded != snap.Refunded {
		t.Errorf("ledger %+v, want granted %d and refunded %d", sums, snap.Claimed, snap.Refunded)
	}
}

// A refill whose announcement is under way (prepared in the ledger, not yet
// acknowledged by the balance system): a batch with grants beyond the announced total
// waits (nothing dead-lettered) until the new total is announced, and is delivered
// then.
func TestBudgetGrantsOfARefillWaitForItsAnnouncement(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-refill"
	key := []byte("operator-signing-key")
	rdb := newRedis(t)
	if _, err := lua.GrabLibrary.Ensure(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	b := store.NewBudget(rdb, uid, 1)
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 20_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
	tb := testBudget{t: t, rdb: rdb, b: b}
	bal := newPacketsBalance(t, key)
	cfg := packetsConfig(tb, bal.url(), "operator-a", key)
	if _, err := AnnounceBudgetTotal(ctx, cfg, b, 1000); err != nil {
		t.Fatal(err)
	}
	// The refill's announcement is prepared, and its POST has not been acknowledged.
	if _, err := b.SettlementLedger(0).PrepareAnnouncement(ctx, 3000, time.Now()); err != nil {
		t.Fatal(err)
	}
	if err := b.Configure(ctx, 3000, limits); err != nil {
		t.Fatal(err)
	}
	if _, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: "big", Sender: "m", Total: 2000, Count: 4,
		Distribution: split.TypeFixed}); err != nil || outcome != store.CreateCreated {
		t.Fatalf("create: %s, %v", outcome, err)
	}
	for _, u := range []string{"a", "b", "c", "d"} {
		if _, err := b.GrabPacket(ctx, "big", u); err != nil {
			t.Fatal(err)
		}
	}
	f := &forgotten{ids: map[string]int{}}
	startBudgetWorkers(t, tb, cfg, f)
	// The batch that holds a grant beyond 1000 waits whole, and nothing is parked.
	time.Sleep(time.Second)
	if got, _ := bal.credits(); len(got) != 0 || len(tb.deadLetters()) != 0 {
		t.Fatalf("before the announcement: %d credited, dead letters %v; want none of either", len(got), tb.deadLetters())
	}
	if _, err := AnnounceBudgetTotal(ctx, cfg, b, 3000); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "every grant credited after the announcement", func() bool {
		got, _ := bal.credits()
		return len(got) == 4
	})
	if _, problems := bal.credits(); len(problems) > 0 || len(tb.deadLetters()) != 0 {
		t.Fatalf("problems %v, dead letters %v", problems, tb.deadLetters())
	}
}

// The interleaving behind a dead-lettered refill: the ledger decides a creation
// against the announced 1,000 (over budget), and the refill to 3,000 is
// acknowledged before the check reads the announcement, which then shows nothing
// under way. The check must decide again, not dead-letter: the verdict counted the
// old total.
func TestRefillAcknowledgedDuringTheDecisionIsDecidedAgain(t *testing.T) {
	ctx := context.Background()
	rdb := newRedis(t)
	if _, err := lua.GrabLibrary.Ensure(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	b := store.NewBudget(rdb, "rpb-uid-refill-race", 1)
	ledger := b.SettlementLedger(0)
	if _, err := ledger.PrepareAnnouncement(ctx, 1000, time.Now()); err != nil {
		t.Fatal(err)
	}
	if _, err := ledger.CommitAnnouncement(ctx, 1000); err != nil {
		t.Fatal(err)
	}
	check := &packetsCheck{budget: b, ledger: ledger, now: time.Now}
	before, err := ledger.Announcement(ctx)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	verdicts, err := ledger.Decide(ctx, []store.BudgetCredit{{Kind: store.KindCreate, PacketID: "big", Share: store.OpenShare,
		UserID: "m", Amount: 2000, Shares: []int64{500, 500, 500, 500}, At: now, Appended: now, Expires: now.Add(time.Hour)}})
	if err != nil || len(verdicts) != 1 || verdicts[0].Verdict != store.LedgerOverBudget {
		t.Fatalf("decided against 1,000: %+v, %v; want one over_budget", verdicts, err)
	}
	if _, err := ledger.PrepareAnnouncement(ctx, 3000, time.Now()); err != nil {
		t.Fatal(err)
	}
	if _, err := ledger.CommitAnnouncement(ctx, 3000); err != nil {
		t.Fatal(err)
	}
	if err := check.refillUnderWay(ctx, before, verdicts); !errors.Is(err, ErrRefillNotAnnounced) {
		t.Fatalf("the check after the refill's acknowledgement: %v; want ErrRefillNotAnnounced", err)
	}
	// Decided again, against 3,000, it passes, and the check has nothing to wait for.
	before, err = ledger.Announcement(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if verdicts, err = ledger.Decide(ctx, []store.BudgetCredit{{Kind: store.KindCreate, PacketID: "big", Share: store.OpenShare,
		UserID: "m", Amount: 2000, Shares: []int64{500, 500, 500, 500}, At: now, Appended: now, Expires: now.Add(time.Hour)}}); err != nil || !verdicts[0].Deliver() {
		t.Fatalf("decided against 3,000: %+v, %v; want it let through", verdicts, err)
	}
	if err := check.refillUnderWay(ctx, before, verdicts); err != nil {
		t.Fatal(err)
	}
	// An over-budget verdict with no refill at all is still dead-lettered.
	if verdicts, err = ledger.Decide(ctx, []store.BudgetCredit{{Kind: store.KindCreate, PacketID: "huge", Share: store.OpenShare,
		UserID: "m", Amount: 2000, Shares: []int64{2000}, At: now, Appended: now, Expires: now.Add(time.Hour)}}); err != nil || verdicts[0].Verdict != store.LedgerOverBudget {
		t.Fatalf("a second packet of 2,000 against 3,000: %+v, %v; want over_budget", verdicts, err)
	}
	if err := check.refillUnderWay(ctx, before, verdicts); err != nil {
		t.Fatalf("no refill under way: %v; want nil (the entry is dead-lettered)", err)
	}
}

// Issue 34, case 2: a reused order id. order-1001 is created, alice grabs share 0,
// the packet expires, its refund is delivered and settlement forgets it; then the
// same creation body comes again (a merchant's late retry) and bob tries share 0. The
// id names one packet while its keys can be credited: the retry answers existing
// (the packet as it ended), another body conflict, bob is answered expired, nothing
// more is drawn, nothing is dead-lettered, and the balance system sees 1,000 drawn
// once (alice's share and the refund). Before tombstones the retry answered created,
// drew another 1,000, and bob's grant and the second refund were dead-lettered
// duplicate_packet: paid to nobody.
func TestReusedPacketIDDrawsOnce(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-reuse"
	key := []byte("operator-signing-key")
	rdb := newRedis(t)
	if _, err := lua.GrabLibrary.Ensure(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	b := store.NewBudget(rdb, uid, 1)
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 10_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeRandom, split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
	tb := testBudget{t: t, rdb: rdb, b: b}
	bal := newPacketsBalance(t, key)
	cfg := packetsConfig(tb, bal.url(), "operator-a", key)
	cfg.Logger = testLogger(t)
	if _, err := AnnounceBudgetTotal(ctx, cfg, b, 10_000); err != nil {
		t.Fatal(err)
	}
	if err := b.Configure(ctx, 10_000, limits); err != nil {
		t.Fatal(err)
	}
	body := store.NewPacket{ID: "order-1001", Sender: "merchant-7", Total: 1000, Count: 2, Distribution: split.TypeFixed,
		TTL: 300 * time.Millisecond}
	if _, outcome, err := b.CreatePacket(ctx, body); err != nil || outcome != store.CreateCreated {
		t.Fatalf("creating order-1001: %v, %v", outcome, err)
	}
	if g, err := b.GrabPacket(ctx, "order-1001", "alice"); err != nil || g.Outcome != store.PacketGranted || g.Share != 0 {
		t.Fatalf("alice's grab: %+v, %v", g, err)
	}
	time.Sleep(body.TTL + 50*time.Millisecond)
	if n, _, err := b.ExpireDue(ctx, 0, 10); err != nil || n != 1 {
		t.Fatalf("expiring order-1001: %d, %v", n, err)
	}

	ws, err := NewBudgetWorkers(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	runWorkers(t, ws)
	forgotten := func() bool {
		d, found, err := b.Packet(ctx, "order-1001")
		return err == nil && found && d.Forgotten
	}
	eventually(t, 20*time.Second, "order-1001 settled and forgotten", func() bool {
		ok, err := BudgetDrained(ctx, b, "")
		return err == nil && ok && forgotten()
	})

	// The merchant's late retry, the same body: the packet as it ended.
	d, outcome, err := b.CreatePacket(ctx, body)
	if err != nil || outcome != store.CreateExisting || !d.Forgotten || d.Total != 1000 || d.RemainingAmount != 500 {
		t.Fatalf("the same body again: %v, %+v, %v; want existing, the forgotten packet", outcome, d, err)
	}
	other := body
	other.Total = 2000
	if _, outcome, err := b.CreatePacket(ctx, other); err != nil || outcome != store.CreateConflict {
		t.Fatalf("another body under the id: %v, %v; want conflict", outcome, err)
	}
	if g, err := b.GrabPacket(ctx, "order-1001", "bob"); err != nil || g.Outcome != store.PacketExpired {
		t.Fatalf("bob's grab: %+v, %v; want expired", g, err)
	}
	snap, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.CreatedPackets != 1 || snap.Available != 9000 || snap.Claimed != 500 || snap.Refunded != 500 || !snap.Conserved() {
		t.Fatalf("snapshot %+v; want one packet drawn once: 9,000 available, 500 claimed, 500 refunded", snap)
	}
	// Give the workers time to deliver anything the retry could have written.
	time.Sleep(300 * time.Millisecond)
	eventually(t, 20*time.Second, "drained", func() bool {
		ok, err := BudgetDrained(ctx, b, "")
		return err == nil && ok
	})
	got, problems := bal.credits()
	if len(problems) > 0 {
		t.Fatalf("the balance system saw: %v", problems)
	}
	var credited int64
	for _, d := range got {
		credited += d.Amount
	}
	if len(got) != 2 || credited != 1000 || got[uid+"/order-1001/0"].UserID != "alice" || got[uid+"/order-1001/refund"].Amount != 500 {
		t.Fatalf("credited %v (%d); want alice's 500 and the sender's 500 refund", got, credited)
	}
	if dead := tb.deadLetters(); len(dead) != 0 {
		t.Fatalf("dead letters %v; want none", dead)
	}
}

// Issue 34, case 3: a forged entry of a packet that never existed. The budget's own
// Redis user (its ACL user, as the grab fleet holds it) appends a grant of 9,500 of
// "ghost-1", a packet never created, to its shard's stream; then bob grabs the only
// share of a genuine packet of 1,000. The forgery names a packet with neither hash nor
// tombstone, written after the ledger began to count on tombstones (at the
// announcement) and before settlement ever ran, so in its first batch: it is
// dead-lettered packet_unknown before the ledger, so it takes nothing of the 10,000,
// and bob is credited. Before, the forgery was credited (9,500 of 10,000) and bob's
// genuine grant was dead-lettered over_budget.
func TestForgedEntryOfAnUnknownPacketIsNotPaid(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-ghost"
	key := []byte("operator-signing-key")
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	if _, err := lua.GrabLibrary.Ensure(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	b := store.NewBudget(rdb, uid, 1)
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 10_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeRandom, split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
	tb := testBudget{t: t, rdb: rdb, b: b}
	bal := newPacketsBalance(t, key)
	cfg := packetsConfig(tb, bal.url(), "operator-a", key)
	cfg.Logger = testLogger(t)
	if _, err := AnnounceBudgetTotal(ctx, cfg, b, 10_000); err != nil {
		t.Fatal(err)
	}
	if err := b.Configure(ctx, 10_000, limits); err != nil {
		t.Fatal(err)
	}
	tenant := budgetTenant(t, srv, b)
	forged, err := tenant.XAdd(ctx, &redis.XAddArgs{Stream: b.ShardKeys(0).Stream,
		Values: []string{"grant", "ghost-1/0:9500:0:CNY:mallory"}}).Result()
	if err != nil {
		t.Fatalf("the budget's Redis user appends to its stream: %v", err)
	}
	if _, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: "order-7", Sender: "merchant-7", Total: 1000, Count: 1,
		Distribution: split.TypeFixed}); err != nil || outcome != store.CreateCreated {
		t.Fatalf("creating order-7: %v, %v", outcome, err)
	}
	if g, err := b.GrabPacket(ctx, "order-7", "bob"); err != nil || g.Outcome != store.PacketGranted || g.Amount != 1000 {
		t.Fatalf("bob's grab: %+v, %v", g, err)
	}
	// The workers start only now: the forgery is in the budget's first batch, which
	// the mark recorded at the announcement holds too.
	settleBudget(t, cfg, b, "drained")
	got, problems := bal.credits()
	if len(problems) > 0 {
		t.Fatalf("the balance system saw: %v", problems)
	}
	if len(got) != 1 || got[uid+"/order-7/0"].UserID != "bob" || got[uid+"/order-7/0"].Amount != 1000 {
		t.Fatalf("credited %v; want bob's 1,000 alone", got)
	}
	dead := tb.deadLetters()
	if len(dead) != 1 || !strings.HasPrefix(dead[forged], "forged settlement entry (packet_unknown)") {
		t.Fatalf("dead letters %v; want the forgery %s alone, as packet_unknown", dead, forged)
	}
	sums, err := b.SettlementLedger(0).Sums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sums.Granted != 1000 {
		t.Fatalf("the ledger counts %d granted; want bob's 1,000 only", sums.Granted)
	}
}

// Issue 34, case 3: the budget's own Redis user raises the shards' `allotted`
// (HINCRBY on the meta) and writes a packet hash that records a grant of 5,000 to
// mallory, with the matching grant entry, beyond the announced 1,000; then bob
// grabs a genuine packet of 1,000. No announcement is under way in the operator's
// ledger, so nothing waits: the forgery, whose packet no creation record announced,
// is dead-lettered packet_unknown and bob is credited. Before, the raised allotment
// read as a refill under way, and the budget's settlement waited forever with no
// dead letter, bob's grant with it; and before packets had accounts, the forged
// hash passed the check and only the announced total refused it (over_budget).
func TestRaisedAllotmentDoesNotStallSettlement(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-allotted"
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	b := store.NewBudget(rdb, uid, 1)
	tb := testBudget{t: t, rdb: rdb, b: b}
	bal, cfg := configuredBudget(t, tb, "operator-a", 1000)
	cfg.Logger = testLogger(t)
	tenant := budgetTenant(t, srv, b)
	k := b.ShardKeys(0)
	if err := tenant.HIncrBy(ctx, k.Meta, "allotted", 5000).Err(); err != nil {
		t.Fatalf("the budget's Redis user raises allotted: %v", err)
	}
	if err := tenant.HSet(ctx, k.Packet("ghost-2"), "cnt", 1, "g", 1, "r", 0, "snd", "mallory", "tot", 5000,
		"u:mallory", "0:5000:1-0").Err(); err != nil {
		t.Fatalf("the budget's Redis user writes a packet hash: %v", err)
	}
	forged, err := tenant.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []string{"grant", "ghost-2/0:5000:0:CNY:mallory"}}).Result()
	if err != nil {
		t.Fatal(err)
	}
	if _, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: "order-8", Sender: "merchant-7", Total: 1000, Count: 1,
		Distribution: split.TypeFixed}); err != nil || outcome != store.CreateCreated {
		t.Fatalf("creating order-8: %v, %v", outcome, err)
	}
	if g, err := b.GrabPacket(ctx, "order-8", "bob"); err != nil || g.Outcome != store.PacketGranted {
		t.Fatalf("bob's grab: %+v, %v", g, err)
	}
	startBudgetWorkers(t, tb, cfg, &forgotten{ids: map[string]int{}})
	eventually(t, 20*time.Second, "drained", func() bool {
		ok, err := BudgetDrained(ctx, b, "")
		return err == nil && ok
	})
	got, problems := bal.credits()
	if len(problems) > 0 {
		t.Fatalf("the balance system saw: %v", problems)
	}
	if len(got) != 1 || got[uid+"/order-8/0"].UserID != "bob" {
		t.Fatalf("credited %v; want bob's 1,000 alone", got)
	}
	dead := tb.deadLetters()
	if len(dead) != 1 || !strings.HasPrefix(dead[forged], "forged settlement entry (packet_unknown)") {
		t.Fatalf("dead letters %v; want the forgery %s alone, as packet_unknown", dead, forged)
	}
}

// Issue 34, case 1 and 8: a budget on a Redis of its own (spec.redis) keeps its
// settlement ledger on the operator's Redis (store.Budget.WithLedger). The tenant
// holds its Redis's credentials: it raises the announced total in a ledger hash of
// its own making, forges 5,000 into its shard's available money and spends it on a
// packet that mallory grabs. The ledger on the operator's Redis still holds the
// announced 1,000: alice's genuine 500 is credited; the forged packet's creation
// record would draw beyond it and is dead-lettered over_budget, so mallory's 5,000
// has no account (packet_unknown) and is never delivered. With the ledger in the
// tenant's Redis, its raised total let mallory's grant through to the balance system.
func TestBudgetLedgerLivesOnTheOperatorsRedis(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-own-redis"
	tenant := newRedis(t)
	operator := newRedis(t)
	b := store.NewBudget(tenant, uid, 1).WithLedger(operator)
	tb := testBudget{t: t, rdb: tenant, b: b}
	bal, cfg := configuredBudget(t, tb, "operator-a", 10_000)
	if _, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: "order-1", Sender: "merchant-7", Total: 1000, Count: 2,
		Distribution: split.TypeFixed}); err != nil || outcome != store.CreateCreated {
		t.Fatalf("creating order-1: %v, %v", outcome, err)
	}
	if g, err := b.GrabPacket(ctx, "order-1", "alice"); err != nil || g.Amount != 500 {
		t.Fatalf("alice's grab: %+v, %v", g, err)
	}

	// The tenant, with its Redis's credentials.
	ledger := b.SettlementLedger(0)
	if err := tenant.HSet(ctx, ledger.Key(), "total", 1_000_000).Err(); err != nil {
		t.Fatal(err)
	}
	if err := tenant.HIncrBy(ctx, b.ShardKeys(0).Meta, "available", 5000).Err(); err != nil {
		t.Fatal(err)
	}
	if _, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: "forged-1", Sender: "mallory", Total: 5000, Count: 1,
		Distribution: split.TypeFixed}); err != nil || outcome != store.CreateCreated {
		t.Fatalf("the tenant's packet of forged money: %v, %v", outcome, err)
	}
	if g, err := b.GrabPacket(ctx, "forged-1", "mallory"); err != nil || g.Amount != 5000 {
		t.Fatalf("mallory's grab: %+v, %v", g, err)
	}

	startBudgetWorkers(t, tb, cfg, &forgotten{ids: map[string]int{}})
	eventually(t, 20*time.Second, "alice credited and mallory dead-lettered", func() bool {
		got, _ := bal.credits()
		return len(got) == 1 && len(tb.deadLetters()) == 2
	})
	got, _ := bal.credits()
	if d, ok := got[uid+"/order-1/0"]; !ok || d.UserID != "alice" || d.Amount != 500 {
		t.Fatalf("credited %v; want alice's 500 alone", got)
	}
	if n := bal.requestsFor(uid + "/forged-1/0"); n != 0 {
		t.Fatalf("mallory's grant was sent %d times; want never", n)
	}
	reasons := map[string]int{}
	for _, why := range tb.deadLetters() {
		reason, _, _ := strings.Cut(strings.TrimPrefix(why, "forged settlement entry ("), ")")
		reasons[reason]++
	}
	if reasons[ReasonOverBudget] != 1 || reasons[ReasonPacketUnknown] != 1 {
		t.Fatalf("dead letters %v; want the forged packet's creation over_budget and mallory's grant packet_unknown", tb.deadLetters())
	}
	sums, err := ledger.Sums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sums.Total != 1000 || sums.Credited != 500 {
		t.Fatalf("the operator's ledger: %+v; want 500 credited of the announced 1000", sums)
	}
	if n, err := operator.Exists(ctx, ledger.Key()).Result(); err != nil || n != 1 {
		t.Fatalf("the ledger is not on the operator's Redis: %d, %v", n, err)
	}
}

// Issue 34, case 3: a packet's grants are held to the account its creation record
// opens in the operator's ledger, even when the group hands out a grant before the
// record. A worker of an earlier leader read the record and died before checking
// it, so the record stays pending under that consumer until it is taken over; the
// new leader's worker reads bob's grant first. It finds the record in the stream at
// the creation time the packet's hash records, books it, and pays bob: no dead
// letter. The record, taken over later, is booked again as the same account and
// acknowledged, with nothing delivered for it. Without that lookup, bob's genuine
// grant is dead-lettered packet_unknown.
func TestGrantReadBeforeItsCreationRecordIsPaid(t *testing.T) {
	ctx := context.Background()
	const uid = "rpb-uid-late-record"
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	b := store.NewBudget(rdb, uid, 1)
	tb := testBudget{t: t, rdb: rdb, b: b}
	bal, cfg := configuredBudget(t, tb, "operator-new", 1000)
	if _, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: "order-1", Sender: "merchant-7", Total: 1000, Count: 2,
		Distribution: split.TypeFixed}); err != nil || outcome != store.CreateCreated {
		t.Fatalf("creating order-1: %v, %v", outcome, err)
	}
	// The script reads Redis's clock (its ct) before it appends the record, whose id
	// may fall a millisecond or a few later, as it does under load: here 3.
	if err := rdb.HIncrBy(ctx, b.ShardKeys(0).Packet("order-1"), "ct", -3).Err(); err != nil {
		t.Fatal(err)
	}
	stream := b.Stream(0)
	if err := stream.EnsureGroup(ctx, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	// The earlier leader's read: the creation record, pending under it, never checked.
	read, err := stream.ReadNew(ctx, DefaultGroup, "operator-old", 1, time.Millisecond)
	if err != nil || len(read) != 1 || read[0].Kind != store.KindCreate {
		t.Fatalf("the earlier leader's read: %+v, %v; want the creation record", read, err)
	}
	if g, err := b.GrabPacket(ctx, "order-1", "bob"); err != nil || g.Outcome != store.PacketGranted {
		t.Fatalf("bob's grab: %+v, %v", g, err)
	}

	startBudgetWorkers(t, tb, cfg, &forgotten{ids: map[string]int{}})
	eventually(t, 10*time.Second, "bob credited", func() bool {
		got, _ := bal.credits()
		return len(got) == 1
	})
	eventually(t, 20*time.Second, "drained, the record taken over and acknowledged", func() bool {
		ok, err := BudgetDrained(ctx, b, "")
		return err == nil && ok
	})
	got, problems := bal.credits()
	if len(problems) > 0 {
		t.Fatalf("the balance system saw: %v", problems)
	}
	if d, ok := got[uid+"/order-1/0"]; !ok || d.UserID != "bob" || d.Amount != 500 {
		t.Fatalf("credited %v; want bob's 500", got)
	}
	if dead := tb.deadLetters(); len(dead) != 0 {
		t.Fatalf("dead letters %v; want none", dead)
	}
	sums, err := b.SettlementLedger(0).Sums(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sums.Packets != 1 || sums.Drawn != 1000 || sums.Granted != 500 {
		t.Fatalf("ledger %+v; want order-1 booked once, drawing 1000, and bob's 500 granted", sums)
	}
	snap, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.SettledCount != 1 || snap.SettledAmount != 500 {
		t.Fatalf("settled %d grants of %d; want bob's alone (a creation record is no credit)", snap.SettledCount, snap.SettledAmount)
	}
}
