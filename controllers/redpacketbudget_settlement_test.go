package controllers_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"

	"redpacket.io/operator/controllers"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

// budgetBalance is a balance system on loopback that checks the operator's
// signature and records each Idempotency-Key's first body.
type budgetBalance struct {
	mu     sync.Mutex
	bodies map[string]map[string]any
	posts  map[string]int
	bad    []string
}

func (b *budgetBalance) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	key := r.Header.Get("Idempotency-Key")
	b.mu.Lock()
	defer b.mu.Unlock()
	b.posts[key]++
	if r.Header.Get("X-Signature") != settlement.Sign([]byte(testSigningKey), body) {
		b.bad = append(b.bad, key)
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	if _, ok := b.bodies[key]; !ok {
		var f map[string]any
		_ = json.Unmarshal(body, &f)
		b.bodies[key] = f
	}
}

// ensureAnnounced calls EnsureTarget until the balance system acknowledged the
// target's total: the announcement runs in the background, and EnsureTarget answers
// *AnnouncementPendingError until then.
func ensureAnnounced(t *testing.T, runner *controllers.BudgetSettlementRunner, target controllers.BudgetSettlementTarget) {
	t.Helper()
	wait.Until(t, 30*time.Second, "the total announced", func() (bool, string) {
		err := runner.EnsureTarget(context.Background(), target)
		var pending *controllers.AnnouncementPendingError
		if err != nil && !errors.As(err, &pending) {
			t.Fatalf("ensure: %v", err)
		}
		return err == nil, fmt.Sprint(err)
	})
}

// The budget runner, against the real API server (the keys Secret) and a real
// redis-server: it announces the budget's total before the shards are allotted and
// again when it is raised, delivers every grant and refund of packets made by the
// store's scripts once, signed with the operator's key, reports the budget drained
// once they are, and stops on Forget. A webhook whose host has no key starts
// nothing and says so.
func TestBudgetSettlementRunnerAnnouncesDeliversAndDrains(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	bal := &budgetBalance{bodies: map[string]map[string]any{}, posts: map[string]int{}}
	hs := httptest.NewServer(bal)
	t.Cleanup(hs.Close)
	e.allowWebhook(hs.URL)
	// The merchant's events endpoint, on a host and port of its own, also allowed.
	evs := &budgetBalance{bodies: map[string]map[string]any{}, posts: map[string]int{}}
	ehs := httptest.NewServer(evs)
	t.Cleanup(ehs.Close)
	e.allowWebhook(ehs.URL)

	runner := controllers.NewBudgetSettlementRunner(cp.Client, nil, controllers.Options{
		SettlementKeysSecret: types.NamespacedName{Namespace: e.ns, Name: testSettlementKeys},
		SettlementConsumer:   "operator-test", SettlementRegisterer: prometheus.NewRegistry()})
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- runner.Start(rctx) }()
	t.Cleanup(func() { stop(); <-done })

	const uid = types.UID("budget-uid-runner")
	target := controllers.BudgetSettlementTarget{UID: uid, Name: types.NamespacedName{Namespace: e.ns, Name: "group-packets"},
		Shards: 4, Total: 50_000, Currency: "CNY", WebhookURL: hs.URL + "/credits", MaxPacketCount: 10, MaxTTL: time.Hour,
		Conn: e.redis.Conn(), EventsURL: ehs.URL + "/events"}
	ensureAnnounced(t, runner, target)
	if !runner.Running(uid) {
		t.Fatal("no workers after EnsureTarget")
	}
	if _, err := lua.GrabLibrary.Ensure(ctx, e.rdb); err != nil {
		t.Fatal(err)
	}
	b := store.NewBudget(e.rdb, string(uid), 4)
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 10_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeRandom}, DefaultTTL: time.Hour, MaxTTL: time.Hour}
	if err := b.Configure(ctx, 50_000, limits); err != nil {
		t.Fatal(err)
	}
	for p := range 6 {
		id := fmt.Sprintf("order-%d", p)
		if _, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "merchant-1", Total: 500, Count: 5,
			Distribution: split.TypeRandom}); err != nil || outcome != store.CreateCreated {
			t.Fatalf("creating %s: %s, %v", id, outcome, err)
		}
		for u := range p % 5 {
			if _, err := b.GrabPacket(ctx, id, fmt.Sprintf("user-%d", u)); err != nil {
				t.Fatal(err)
			}
		}
	}
	// A refill: announced before the shards are allotted more.
	target.Total = 80_000
	ensureAnnounced(t, runner, target)
	if err := b.Configure(ctx, 80_000, limits); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range b.N() {
		if _, _, err := b.ExpireDue(ctx, i, 500); err != nil {
			t.Fatal(err)
		}
	}
	snap, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 30*time.Second, "the budget drained", func() (bool, string) {
		d, err := runner.DrainedTarget(ctx, target)
		return err == nil && d.Drained && d.Owed() == 0, fmt.Sprintf("%+v, %v", d, err)
	})

	bal.mu.Lock()
	var credited int64
	credits := 0
	for key, f := range bal.bodies {
		if f["kind"] == settlement.KindAnnouncement {
			continue
		}
		credits++
		credited += int64(f["amount"].(float64))
		if f["source"] != settlement.SourceBudget || f["activity"] != e.ns+"/group-packets" || f["activityUID"] != string(uid) ||
			key != string(uid)+"/"+f["packetId"].(string) {
			t.Errorf("delivery %s: %v", key, f)
		}
		if bal.posts[key] != 1 {
			t.Errorf("%s posted %d times", key, bal.posts[key])
		}
	}
	for _, total := range []int64{50_000, 80_000} {
		if f, ok := bal.bodies[settlement.BudgetIdempotencyKeyOf(string(uid), total)]; !ok || f["amount"] != float64(total) {
			t.Errorf("announcement of %d: %v, %v", total, f, ok)
		}
	}
	bad := bal.bad
	bal.mu.Unlock()
	if len(bad) > 0 {
		t.Fatalf("unsigned or badly signed deliveries: %v", bad)
	}
	if credited != snap.Claimed+snap.Refunded || int64(credits) != snap.GrabbedShares+6 {
		t.Errorf("credited %d in %d deliveries; the budget claimed %d in %d shares and refunded %d (6 packets, each with a remainder)",
			credited, credits, snap.Claimed, snap.GrabbedShares, snap.Refunded)
	}

	// Each packet's events, signed with the operator's key for the events host: it
	// was created, expired with a remainder, and refunded, in that order.
	wait.Until(t, 30*time.Second, "every packet's events", func() (bool, string) {
		evs.mu.Lock()
		defer evs.mu.Unlock()
		return len(evs.bodies) == 6*3, fmt.Sprintf("%d events, %d posts, bad %v", len(evs.bodies), len(evs.posts), evs.bad)
	})
	evs.mu.Lock()
	for p := range 6 {
		id := fmt.Sprintf("order-%d", p)
		for _, typ := range []string{settlement.EventPacketCreated, settlement.EventPacketExpired, settlement.EventPacketRefunded} {
			f, ok := evs.bodies[settlement.EventKey(string(uid), id, typ)]
			if !ok || f["type"] != typ {
				t.Errorf("event %s of %s: %v", typ, id, f)
			}
		}
	}
	if len(evs.bad) > 0 {
		t.Errorf("unsigned or badly signed events: %v", evs.bad)
	}
	evs.mu.Unlock()

	runner.Forget(uid)
	if runner.Running(uid) {
		t.Error("workers still run after Forget")
	}
	// An events webhook no key allows sends nothing, and holds settlement back in
	// nothing.
	target.EventsURL = "http://unlisted-events.example/events"
	ensureAnnounced(t, runner, target)
	if !runner.Running(uid) {
		t.Error("no settlement workers with an events webhook no key allows")
	}
	runner.Forget(uid)
	target.WebhookURL = "http://unlisted.example/credits"
	if err := runner.EnsureTarget(ctx, target); err == nil || !strings.Contains(err.Error(), "not allowed") || !strings.Contains(err.Error(), "unlisted.example") {
		t.Errorf("a webhook host without a key: %v, want the host not allowed", err)
	}
	if runner.Running(uid) {
		t.Error("workers run for a host without a key")
	}
}
