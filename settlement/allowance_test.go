package settlement

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// balanceSystem is a balance system as docs/operations.md describes it: it verifies
// the signature, records each activity's announced budget, refuses credits of an
// activity whose budget was not announced or that would exceed it, and credits each
// Idempotency-Key once. It keeps every request in order.
type balanceSystem struct {
	key  []byte
	addr string

	mu       sync.Mutex
	requests []balanceRequest
	budget   map[string]int64 // by activity UID: the announced amount
	count    map[string]int64
	credited map[string]int64 // by activity UID
	grants   map[string]int64
	byKey    map[string]map[string]any
}

type balanceRequest struct {
	idempotencyKey, signature string
	body                      []byte
	fields                    map[string]any
	status                    int
}

func newBalanceSystem(t *testing.T, key []byte) *balanceSystem {
	t.Helper()
	b := &balanceSystem{key: key, budget: map[string]int64{}, count: map[string]int64{}, credited: map[string]int64{},
		grants: map[string]int64{}, byKey: map[string]map[string]any{}}
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

func (b *balanceSystem) url() string { return "http://" + b.addr + "/credit" }

func (b *balanceSystem) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var f map[string]any
	_ = json.Unmarshal(body, &f)
	req := balanceRequest{idempotencyKey: r.Header.Get("Idempotency-Key"), signature: r.Header.Get("X-Signature"), body: body, fields: f}
	b.mu.Lock()
	defer b.mu.Unlock()
	req.status = b.decide(req)
	b.requests = append(b.requests, req)
	w.WriteHeader(req.status)
}

func (b *balanceSystem) decide(req balanceRequest) int {
	if req.signature != Sign(b.key, req.body) {
		return http.StatusUnauthorized
	}
	uid, _ := req.fields["activityUID"].(string)
	amount := int64(req.fields["amount"].(float64))
	if req.fields["kind"] == KindAnnouncement {
		if _, ok := b.budget[uid]; !ok {
			b.budget[uid], b.count[uid] = amount, int64(req.fields["count"].(float64))
		}
		return http.StatusOK
	}
	if _, seen := b.byKey[req.idempotencyKey]; seen {
		return http.StatusOK
	}
	total, ok := b.budget[uid]
	grants := b.grants[uid]
	if req.fields["kind"] == "grant" {
		grants++
	}
	if !ok || b.credited[uid]+amount > total || grants > b.count[uid] {
		return http.StatusConflict
	}
	b.credited[uid] += amount
	b.grants[uid] = grants
	b.byKey[req.idempotencyKey] = req.fields
	return http.StatusOK
}

func (b *balanceSystem) snapshot() ([]balanceRequest, map[string]map[string]any) {
	b.mu.Lock()
	defer b.mu.Unlock()
	keys := map[string]map[string]any{}
	for k, v := range b.byKey {
		keys[k] = v
	}
	return append([]balanceRequest(nil), b.requests...), keys
}

// tenantActivity seeds an activity of 3 packets, 600 in total (packet 1: 100,
// 2: 200, 3: 300), opens it, gives it its own Redis user as the controller does,
// and returns the operator's handle, a client logged in as that user (the tenant,
// who reads its password from its namespace) and the budget the operator
// recomputes.
func tenantActivity(t *testing.T, uid string) (store.Keys, *redis.Client, *redis.Client, *Allowance) {
	t.Helper()
	ctx := context.Background()
	srv, op := redistest.StartProtected(t, "operator-pw")
	amounts := []int64{100, 200, 300}
	h := store.NewActivity(op, uid, 1)
	if _, err := h.Seed(ctx, amounts, store.SeedParams{Count: 3, Total: 600, Sponsor: "merchant-001", Currency: "CNY"}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Configure(ctx, 0, 0, false, true); err != nil {
		t.Fatal(err)
	}
	if _, err := h.EnsureUser(ctx, "tenant-pw-0123456789"); err != nil {
		t.Fatal(err)
	}
	tenant := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: h.UserName(), Password: "tenant-pw-0123456789"})
	t.Cleanup(func() { _ = tenant.Close() })
	return h.Shard(0).Keys(), op, tenant, &Allowance{Total: 600, Count: 3, Amounts: amounts, At: time.Unix(1700000000, 0)}
}

// forge writes, as the tenant, a grant entry and the claim that matches it: what
// issue 24's item 2 did with one script call.
func forge(t *testing.T, tenant *redis.Client, k store.Keys, packet, amount, user string) string {
	t.Helper()
	ctx := context.Background()
	id, err := tenant.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []string{"grant", packet + ":" + amount + ":0:CNY:" + user}}).Result()
	if err != nil {
		t.Fatalf("the tenant's XADD: %v", err)
	}
	if err := tenant.HSet(ctx, k.Claims, user, packet+":"+amount+":"+id).Err(); err != nil {
		t.Fatalf("the tenant's HSET of the claim: %v", err)
	}
	return id
}

// A tenant holding its activity's Redis password mints no money: entries it writes
// with their matching claims, for a packet that does not exist (999 of 900000000000000
// on a 3-packet activity of 600), for a real packet with another amount, and for a
// real packet still listed with its right amount, are dead-lettered as forged, never
// delivered, each with a Warning (OnForged) and the forged metric; the real users
// who win those packets afterwards are paid; nothing beyond the total is credited,
// and the budget went out once, signed, before any grant.
func TestTenantForgedCreditsAreDeadLetteredAndRealWinnersPaid(t *testing.T) {
	ctx := context.Background()
	const uid = "uid-item2"
	k, op, tenant, budget := tenantActivity(t, uid)
	key := []byte("operator-held-key")
	bs := newBalanceSystem(t, key)

	forge(t, tenant, k, "999", "900000000000000", "mallory")
	forge(t, tenant, k, "3", "5000", "mallory-2")
	forge(t, tenant, k, "2", "200", "mallory-3")
	h := store.NewActivity(op, uid, 1)

	reg := prometheus.NewRegistry()
	var mu sync.Mutex
	var warnings []ForgedEntry
	cfg := Config{Redis: op, Source: Source{Namespace: "default", Name: "item2", UID: uid, Currency: "CNY"}, WebhookURL: bs.url(),
		SigningKey: key, Consumer: "operator-0", ClaimIdle: 2 * time.Second, BackoffBase: 10 * time.Millisecond,
		BackoffMax: 100 * time.Millisecond, Block: 100 * time.Millisecond, Allowance: budget, Registerer: reg,
		Logger: testLogger(t), OnForged: func(f ForgedEntry) {
			mu.Lock()
			warnings = append(warnings, f)
			mu.Unlock()
		}}
	for range 2 { // announced once, however often asked
		if err := AnnounceAllowance(ctx, cfg, 1); err != nil {
			t.Fatal(err)
		}
	}
	startWorker(t, cfg)
	eventually(t, 10*time.Second, "the 3 forged entries parked", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(warnings) == 3
	})
	// The real users win every packet afterwards, the forged ones included.
	winners := map[string]string{}
	for _, u := range []string{"alice", "bob", "carol"} {
		res, err := h.Shard(0).Grab(ctx, u)
		if err != nil || res.Outcome != store.Granted {
			t.Fatalf("grab by %s: %+v %v", u, res, err)
		}
		winners[res.PacketID] = u
	}
	eventually(t, 10*time.Second, "the 3 real winners credited", func() bool {
		_, credited := bs.snapshot()
		return len(credited) == 3
	})

	requests, credited := bs.snapshot()
	if requests[0].fields["kind"] != KindAnnouncement || requests[0].idempotencyKey != uid+"/budget" ||
		requests[0].fields["amount"] != float64(600) || requests[0].fields["count"] != float64(3) || requests[0].status != 200 {
		t.Fatalf("first request %s (key %q, status %d), want the budget of 600 in 3 packets", requests[0].body, requests[0].idempotencyKey, requests[0].status)
	}
	budgets := 0
	for _, r := range requests {
		if r.signature != Sign(key, r.body) {
			t.Errorf("request %s is not signed with the operator's key", r.body)
		}
		if r.fields["kind"] == KindAnnouncement {
			budgets++
		}
		if u, _ := r.fields["userId"].(string); strings.HasPrefix(u, "mallory") {
			t.Errorf("a forged credit reached the balance system: %s", r.body)
		}
	}
	if budgets != 1 {
		t.Errorf("%d budget deliveries, want 1", budgets)
	}
	for packet, user := range winners {
		d := credited[uid+"/"+packet]
		if d == nil || d["userId"] != user {
			t.Errorf("packet %s: credited %v, want its real winner %s", packet, d, user)
		}
	}
	want := map[string]string{"999": ReasonPacketOutOfRange, "3": ReasonAmountMismatch, "2": ReasonPacketListed}
	for _, w := range warnings {
		if want[w.PacketID] != w.Reason || !strings.HasPrefix(w.UserID, "mallory") || w.Amount == 0 {
			t.Errorf("warning %+v, want reason %q for packet %s", w, want[w.PacketID], w.PacketID)
		}
	}
	for reason, n := range map[string]float64{ReasonPacketOutOfRange: 1, ReasonAmountMismatch: 1, ReasonPacketListed: 1} {
		if got := testutil.ToFloat64(mustForged(t, reg, reason)); got != n {
			t.Errorf("redpacket_settlement_forged_total{reason=%q} = %v, want %v", reason, got, n)
		}
	}
	snap, err := h.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.SettledAmount != 600 || snap.SettledCount != 3 || snap.DeadCount != 3 {
		t.Errorf("settled %d in %d, dead %d; want 600 in 3 (never above the total) and 3 dead letters",
			snap.SettledAmount, snap.SettledCount, snap.DeadCount)
	}
	dead, err := h.Shard(0).DeadLetters(ctx)
	if err != nil || len(dead) != 3 {
		t.Fatalf("dead letters %d %v", len(dead), err)
	}
	for _, d := range dead {
		if !strings.Contains(d.Fields["error"], "forged settlement entry") {
			t.Errorf("dead letter %v: no forged reason", d.Fields)
		}
	}
}

// A forged entry with the right amount for a packet that a real user wins before
// settlement reads it passes every check on its own, and the ledger credits the
// packet to whoever comes first in the stream. The real winner's entry is then not
// delivered as a balance-system duplicate of the same Idempotency-Key: it is
// dead-lettered with reason duplicate_packet, keeping the winner's user and amount,
// with a Warning naming both users, so a person can pay the winner.
func TestSecondClaimForOnePacketKeepsTheRealWinnerInDeadLetters(t *testing.T) {
	ctx := context.Background()
	const uid = "uid-dup"
	k, op, tenant, budget := tenantActivity(t, uid)
	key := []byte("operator-held-key")
	bs := newBalanceSystem(t, key)
	forge(t, tenant, k, "1", "100", "mallory")
	h := store.NewActivity(op, uid, 1)
	res, err := h.Shard(0).Grab(ctx, "alice")
	if err != nil || res.PacketID != "1" {
		t.Fatalf("alice's grab: %+v %v", res, err)
	}
	reg := prometheus.NewRegistry()
	var mu sync.Mutex
	var warnings []ForgedEntry
	cfg := Config{Redis: op, Source: Source{Namespace: "default", Name: "dup", UID: uid, Currency: "CNY"}, WebhookURL: bs.url(),
		SigningKey: key, Consumer: "operator-0", ClaimIdle: 2 * time.Second, BackoffBase: 10 * time.Millisecond,
		BackoffMax: 100 * time.Millisecond, Block: 100 * time.Millisecond, Allowance: budget, Registerer: reg,
		Logger: testLogger(t), OnForged: func(f ForgedEntry) {
			mu.Lock()
			warnings = append(warnings, f)
			mu.Unlock()
		}}
	if err := AnnounceAllowance(ctx, cfg, 1); err != nil {
		t.Fatal(err)
	}
	startWorker(t, cfg)
	eventually(t, 10*time.Second, "the second claim of packet 1 parked", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(warnings) == 1
	})
	w := warnings[0]
	if w.Reason != ReasonDuplicatePacket || w.UserID != "alice" || w.PacketID != "1" || w.Amount != 100 ||
		!strings.Contains(w.Detail, `"mallory"`) {
		t.Fatalf("warning %+v, want alice's claim of packet 1 parked as a duplicate of mallory's", w)
	}
	dead, err := h.Shard(0).DeadLetters(ctx)
	if err != nil || len(dead) != 1 || dead[0].UserID != "alice" || dead[0].Amount != 100 {
		t.Fatalf("dead letters %+v %v, want alice's grant of 100", dead, err)
	}
	if got := testutil.ToFloat64(mustForged(t, reg, ReasonDuplicatePacket)); got != 1 {
		t.Errorf("duplicate_packet metric %v", got)
	}
	sums, err := h.Ledger().Sums(ctx)
	if err != nil || sums.Credited != 100 || sums.Grants != 1 {
		t.Fatalf("ledger %+v %v: packet 1 credited once", sums, err)
	}
}

// mustForged is the forged counter of reason in reg.
func mustForged(t *testing.T, reg *prometheus.Registry, reason string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "redpacket_settlement_forged_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == reason {
					c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
					c.Add(m.GetCounter().GetValue())
					return c
				}
			}
		}
	}
	t.Fatalf("no redpacket_settlement_forged_total{reason=%q}", reason)
	return nil
}
