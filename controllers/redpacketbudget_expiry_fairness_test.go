package controllers_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"

	"redpacket.io/operator/controllers"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// Issue 34 case 4: one tenant must not hold back another budget's refunds. The
// tenant of budget "flood" logs in as the Redis user the operator gives its budget
// and, with the commands that user's ACL allows, forges 200,000 packets due since
// the epoch (HSET <packet> r 0, ZADD <due> 0 <id>) over its shards, then keeps
// feeding its due indexes. The operator's expiry driver runs as in production (its
// default interval, on the operator's client of the shared server). Budget "calm"
// on the same server creates a packet living 300 ms: its refund is written within
// 1 s of its expiry by the Redis clock, while the flood is still being expired; the
// driver exports the flood's overdue age (over 1 s) and calm's (under 1 s); once
// the feed stops, the flood's forged entries are all taken out of its indexes.
func TestBudgetExpiryIsFairAcrossBudgets(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	t.Cleanup(cancel)
	srv := redistest.Start(t)
	admin := srv.Client(t)
	operator := srv.Conn().NewClient()
	t.Cleanup(func() { _ = operator.Close() })
	const (
		shards  = 16
		forged  = 200_000
		ttl     = 300 * time.Millisecond
		allowed = time.Second
	)
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 10_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 2 * time.Hour}
	configure := func(uid string) *store.Budget {
		b := store.NewBudget(operator, uid, shards)
		if err := b.Configure(ctx, 1_000_000, limits); err != nil {
			t.Fatalf("configuring budget %s: %v", uid, err)
		}
		return b
	}
	flood, calm := configure("flood-uid"), configure("calm-uid")

	// The tenant's login: the budget's Redis user with the operator's rules.
	const tenantPassword = "tenant-password"
	if _, err := flood.EnsureUser(ctx, tenantPassword); err != nil {
		t.Fatal(err)
	}
	tenant := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: flood.UserName(), Password: tenantPassword})
	t.Cleanup(func() { _ = tenant.Close() })
	var fed atomic.Int64
	forge := func(n int) error {
		pipe := tenant.Pipeline()
		for range n {
			p := fed.Add(1)
			k := flood.ShardKeys(int(p % shards))
			id := "forged-" + strconv.FormatInt(p, 10)
			packet := k.Meta[:len(k.Meta)-len("meta")] + "p:" + id
			pipe.HSet(ctx, packet, "r", "0")
			pipe.ZAdd(ctx, k.Due, redis.Z{Score: 0, Member: id})
		}
		_, err := pipe.Exec(ctx)
		return err
	}
	for range forged / 1000 {
		if err := forge(1000); err != nil {
			t.Fatalf("the tenant forging due entries through its own user: %v", err)
		}
	}
	dueOf := func(b *store.Budget) int64 {
		var sum int64
		for i := range b.N() {
			n, err := admin.ZCard(ctx, b.ShardKeys(i).Due).Result()
			if err != nil {
				t.Fatal(err)
			}
			sum += n
		}
		return sum
	}
	if n := dueOf(flood); n != forged {
		t.Fatalf("the flood's due indexes hold %d entries, want %d", n, forged)
	}

	// The operator's expiry driver, as the manager runs it.
	reg := prometheus.NewRegistry()
	expiry := controllers.NewBudgetExpiry()
	expiry.Metrics = controllers.NewBudgetMetrics(reg)
	floodKey := types.NamespacedName{Namespace: "tenant-a", Name: "flood"}
	calmKey := types.NamespacedName{Namespace: "tenant-b", Name: "calm"}
	expiry.TrackNamed("flood-uid", floodKey, flood)
	expiry.TrackNamed("calm-uid", calmKey, calm)
	driverCtx, stopDriver := context.WithCancel(ctx)
	driverDone := make(chan error, 1)
	go func() { driverDone <- expiry.Start(driverCtx) }()
	t.Cleanup(func() { stopDriver(); <-driverDone })

	// The steady feed: 500 more entries every 10 ms, from the tenant's login.
	feedCtx, stopFeed := context.WithCancel(ctx)
	var feeding sync.WaitGroup
	feedErr := make(chan error, 1)
	feeding.Go(func() {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-feedCtx.Done():
				return
			case <-tick.C:
				if err := forge(500); err != nil && feedCtx.Err() == nil {
					feedErr <- err
					return
				}
			}
		}
	})
	t.Cleanup(func() { stopFeed(); feeding.Wait() })
	// Let the driver get deep into the flood before calm's packet is created.
	time.Sleep(time.Second)

	r, err := calm.Create(ctx, store.NewPacket{ID: "order-1", Sender: "merchant", Total: 1000, Count: 5,
		Distribution: split.TypeFixed, TTL: ttl})
	if err != nil || r.Outcome != store.CreateCreated {
		t.Fatalf("creating calm's packet: %+v, %v", r, err)
	}
	due := r.Packet.ExpiresAt
	stream := calm.ShardKeys(calm.ShardOf("order-1")).Stream
	var refundAt time.Time
	var floodLeft int64
	for refundAt.IsZero() {
		entries, err := admin.XRange(ctx, stream, "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if e.Values["kind"] == "refund" && e.Values["packet"] == "order-1/refund" {
				ms, err := strconv.ParseInt(fmt.Sprint(e.Values["at"]), 10, 64)
				if err != nil {
					t.Fatalf("refund entry %v: %v", e.Values, err)
				}
				refundAt = time.UnixMilli(ms)
			}
		}
		if refundAt.IsZero() {
			if time.Since(due) > 10*time.Second {
				t.Fatalf("calm's packet, due at %s, is not expired %v later; the flood still holds %d due entries",
					due.Format(time.StampMilli), time.Since(due).Round(time.Millisecond), dueOf(flood))
			}
			time.Sleep(20 * time.Millisecond)
		}
		floodLeft = dueOf(flood)
	}
	select {
	case err := <-feedErr:
		t.Fatalf("the tenant's feed: %v", err)
	default:
	}
	late := refundAt.Sub(due)
	t.Logf("calm's packet expired %v after its expiry; the flood then held %d due entries, %d forged so far",
		late, floodLeft, fed.Load())
	if late > allowed {
		t.Errorf("calm's packet expired %v after its expiry, want within %v", late, allowed)
	}
	if floodLeft == 0 {
		t.Errorf("the flood's due indexes were empty when calm's packet expired: the flood held nothing back")
	}
	floodAge, calmAge := overdueAge(t, reg, floodKey), overdueAge(t, reg, calmKey)
	if floodAge <= allowed.Seconds() || calmAge > allowed.Seconds() {
		t.Errorf("overdue age: flood %vs, calm %vs; want the flood's over 1 s and calm's at most 1 s", floodAge, calmAge)
	}

	// The feed stops: the driver takes every forged entry out of the flood's indexes.
	stopFeed()
	feeding.Wait()
	deadline := time.Now().Add(2 * time.Minute)
	for n := dueOf(flood); n > 0; n = dueOf(flood) {
		if time.Now().After(deadline) {
			t.Fatalf("the flood's due indexes still hold %d of %d forged entries", n, fed.Load())
		}
		time.Sleep(100 * time.Millisecond)
	}
	s, err := calm.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.Refunded != 1000 || s.LivePackets != 0 {
		t.Errorf("calm after the expiry: refunded %d, %d live packets; want 1000 and 0", s.Refunded, s.LivePackets)
	}
}

// overdueAge is the budget's redpacket_budget_expiry_overdue_seconds in reg.
func overdueAge(t *testing.T, reg *prometheus.Registry, key types.NamespacedName) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "redpacket_budget_expiry_overdue_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["namespace"] == key.Namespace && labels["name"] == key.Name {
				return m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("no redpacket_budget_expiry_overdue_seconds for %s", key)
	return 0
}
