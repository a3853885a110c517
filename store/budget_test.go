package store_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// testLimits are the limits of the budgets of these tests.
func testLimits() store.BudgetLimits {
	return store.BudgetLimits{Currency: "CNY", MaxTotal: 20_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeRandom, split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
}

// configuredBudget is budget uid of n shards on c, configured with total and limits.
func configuredBudget(t testing.TB, ctx context.Context, c redis.Cmdable, uid string, n int, total int64, limits store.BudgetLimits) *store.Budget {
	t.Helper()
	b := store.NewBudget(c, uid, n)
	if err := b.Configure(ctx, total, limits); err != nil {
		t.Fatalf("configuring budget %s: %v", uid, err)
	}
	return b
}

// dumpAll is every key of a standalone server with its DUMP: what a call that must
// change nothing is compared by.
func dumpAll(t testing.TB, ctx context.Context, c *redis.Client) map[string]string {
	t.Helper()
	keys, err := c.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]string, len(keys))
	for _, k := range keys {
		v, err := c.Dump(ctx, k).Result()
		if err != nil {
			t.Fatalf("DUMP %s: %v", k, err)
		}
		out[k] = v
	}
	return out
}

// unchanged runs f and fails when it changed any key.
func unchanged(t testing.TB, ctx context.Context, c *redis.Client, what string, f func()) {
	t.Helper()
	before := dumpAll(t, ctx, c)
	f()
	if after := dumpAll(t, ctx, c); !maps.Equal(before, after) {
		t.Fatalf("%s changed Redis: %d keys before, %d after", what, len(before), len(after))
	}
}

// conserved fails unless the budget's snapshot adds up; it returns it.
func conserved(t testing.TB, ctx context.Context, b *store.Budget) store.BudgetSnapshot {
	t.Helper()
	s, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	if !s.Conserved() {
		t.Fatalf("not conserved: %+v", s)
	}
	if f := s.MoneyFaults(); f != nil {
		t.Fatalf("money faults %q in %+v", f, s)
	}
	return s
}

// idsOnShard returns n packet ids with the given prefix that hash to shard i of b.
func idsOnShard(b *store.Budget, prefix string, i, n int) []string {
	var ids []string
	for j := 0; len(ids) < n; j++ {
		id := fmt.Sprintf("%s%d", prefix, j)
		if b.ShardOf(id) == i {
			ids = append(ids, id)
		}
	}
	return ids
}

func createOrFail(t testing.TB, ctx context.Context, b *store.Budget, p store.NewPacket, want store.CreateOutcome) store.CreateResult {
	t.Helper()
	r, err := b.Create(ctx, p)
	if err != nil {
		t.Fatalf("creating %s: %v", p.ID, err)
	}
	if r.Outcome != want {
		t.Fatalf("creating %+v: %s (%s), want %s", p, r.Outcome, r.Reason, want)
	}
	return r
}

func grabOrFail(t testing.TB, ctx context.Context, b *store.Budget, id, user string, want store.PacketGrabOutcome) store.PacketGrab {
	t.Helper()
	g, err := b.GrabPacket(ctx, id, user)
	if err != nil {
		t.Fatalf("grab of %s by %s: %v", id, user, err)
	}
	if g.Outcome != want {
		t.Fatalf("grab of %s by %s: %+v, want %s", id, user, g, want)
	}
	return g
}

// Every outcome of a creation; each but created and existing changes nothing.
func TestBudgetCreateOutcomes(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "create-outcomes", 4, 10_000, testLimits())
	conserved(t, ctx, b)

	order := store.NewPacket{ID: "order-1", Sender: "merchant-7", Total: 1000, Count: 5, Distribution: split.TypeRandom}
	r := createOrFail(t, ctx, b, order, store.CreateCreated)
	if r.Packet.RemainingAmount != 1000 || r.Packet.RemainingCount != 5 || r.Packet.Currency != "CNY" ||
		r.Packet.ExpiresAt.Sub(r.Packet.CreatedAt) != time.Hour {
		t.Fatalf("created packet %+v", r.Packet)
	}
	s := conserved(t, ctx, b)
	if s.Total != 10_000 || s.Available != 9000 || s.Live != 1000 || s.CreatedPackets != 1 || s.LivePackets != 1 {
		t.Fatalf("after one creation: %+v", s)
	}
	d, ok, err := b.Packet(ctx, order.ID)
	if err != nil || !ok {
		t.Fatalf("packet: %v, %v", ok, err)
	}
	// The shares are lua/split's, seeded by the budget's UID and the packet id.
	want, _ := split.Split(split.Params{Type: split.TypeRandom, Total: 1000, Count: 5, Min: 1, Seed: split.SeedFromUID("create-outcomes/order-1")})
	k := b.ShardKeys(b.ShardOf(order.ID))
	for i, a := range want {
		if got, _ := c.HGet(ctx, k.Packet(order.ID), fmt.Sprintf("s%d", i)).Int64(); got != a {
			t.Fatalf("share %d is %d, want %d", i, got, a)
		}
	}

	unchanged(t, ctx, c, "a repeat", func() {
		r := createOrFail(t, ctx, b, order, store.CreateExisting)
		if r.Packet.CreatedAt != d.CreatedAt || r.Packet.Total != 1000 || r.Packet.Sender != "merchant-7" {
			t.Fatalf("existing packet %+v, want %+v", r.Packet, d)
		}
	})
	other := order
	other.Total = 999
	unchanged(t, ctx, c, "a conflict", func() { createOrFail(t, ctx, b, other, store.CreateConflict) })
	other = order
	other.TTL = time.Minute
	unchanged(t, ctx, c, "a conflict of ttl", func() { createOrFail(t, ctx, b, other, store.CreateConflict) })

	for _, p := range []store.NewPacket{
		{ID: "big", Sender: "m", Total: 20_001, Count: 5, Distribution: split.TypeRandom},
		{ID: "many", Sender: "m", Total: 100, Count: 11, Distribution: split.TypeRandom},
		{ID: "huge-count", Sender: "m", Total: 100, Count: 1_000_000, Distribution: split.TypeRandom},
		{ID: "linecut", Sender: "m", Total: 100, Count: 5, Distribution: split.TypeLineCut},
		{ID: "long", Sender: "m", Total: 100, Count: 5, Distribution: split.TypeFixed, TTL: 25 * time.Hour},
		{ID: "thin", Sender: "m", Total: 3, Count: 5, Distribution: split.TypeFixed},
	} {
		unchanged(t, ctx, c, "limit "+p.ID, func() { createOrFail(t, ctx, b, p, store.CreateLimitExceeded) })
	}
	for _, p := range []store.NewPacket{
		{ID: "-dash", Sender: "m", Total: 100, Count: 5, Distribution: split.TypeRandom},
		{ID: strings.Repeat("a", 65), Sender: "m", Total: 100, Count: 5, Distribution: split.TypeRandom},
		{ID: "a:b", Sender: "m", Total: 100, Count: 5, Distribution: split.TypeRandom},
		{ID: "nosender", Total: 100, Count: 5, Distribution: split.TypeRandom},
		{ID: "zero", Sender: "m", Total: 0, Count: 5, Distribution: split.TypeRandom},
		{ID: "nocount", Sender: "m", Total: 100, Count: 0, Distribution: split.TypeRandom},
		{ID: "weird", Sender: "m", Total: 100, Count: 5, Distribution: "Weird"},
		{ID: "negttl", Sender: "m", Total: 100, Count: 5, Distribution: split.TypeRandom, TTL: -time.Second},
	} {
		unchanged(t, ctx, c, "invalid "+p.ID, func() { createOrFail(t, ctx, b, p, store.CreateInvalid) })
	}

	// The script checks the shares itself: a caller (a tenant may FCALL it) that
	// sends shares that do not sum, too few, or below the minimum is refused.
	direct := func(id string, total, count int64, shares ...any) []string {
		t.Helper()
		k := b.ShardKeys(b.ShardOf(id))
		args := append([]any{id, "fp", "m", total, count, split.TypeRandom, 0}, shares...)
		v, err := lua.PacketCreateScript.Call(ctx, c, []string{k.Meta, k.Packet(id), k.Due, k.Stream}, args...).StringSlice()
		if err != nil {
			t.Fatalf("direct create %s: %v", id, err)
		}
		return v
	}
	for _, tc := range []struct {
		total, count int64
		shares       []any
		want         string
	}{
		{10, 2, []any{5, 6}, "invalid_request"},
		{10, 2, []any{5, 4}, "invalid_request"},
		{10, 3, []any{5, 5}, "invalid_request"},
		{10, 2, []any{10, 0}, "invalid_request"},
		{10, 2, []any{"5.0", 5}, "invalid_request"},
		{10, 2, []any{-5, 15}, "invalid_request"},
		{10, 2, []any{"0x5", 5}, "invalid_request"},
	} {
		unchanged(t, ctx, c, fmt.Sprintf("direct %v", tc.shares), func() {
			if v := direct("direct", tc.total, tc.count, tc.shares...); v[0] != tc.want {
				t.Fatalf("shares %v of %d: %q, want %s", tc.shares, tc.total, v, tc.want)
			}
		})
	}
	minTwo := testLimits()
	minTwo.MinShare = 2
	b2 := configuredBudget(t, ctx, c, "create-min", 1, 1000, minTwo)
	unchanged(t, ctx, c, "a share below the minimum", func() {
		k := b2.ShardKeys(0)
		v, err := lua.PacketCreateScript.Call(ctx, c, []string{k.Meta, k.Packet("low"), k.Due, k.Stream},
			"low", "fp", "m", 10, 2, split.TypeRandom, 0, 1, 9).StringSlice()
		if err != nil || v[0] != "limit_exceeded" {
			t.Fatalf("share below the minimum: %q, %v", v, err)
		}
	})

	// Exhaust one shard: its allotment is 2500, 1000 of it may be in order-1.
	shard := b.ShardOf(order.ID)
	ss, err := b.ShardSnapshot(ctx, shard)
	if err != nil {
		t.Fatal(err)
	}
	ids := idsOnShard(b, "fill-", shard, 4)
	createOrFail(t, ctx, b, store.NewPacket{ID: ids[0], Sender: "m", Total: ss.Available - 1, Count: 5, Distribution: split.TypeFixed}, store.CreateCreated)
	// A creation the shard cannot pay borrows from its siblings (budget_moves.go).
	createOrFail(t, ctx, b, store.NewPacket{ID: ids[1], Sender: "m", Total: 2, Count: 1, Distribution: split.TypeFixed}, store.CreateCreated)
	if ss, _ = b.ShardSnapshot(ctx, shard); ss.Borrowed == 0 || !ss.Conserved() {
		t.Fatalf("shard %d after it borrowed: %+v", shard, ss)
	}
	// One the whole budget cannot pay is refused, and moves nothing.
	all := conserved(t, ctx, b)
	unchanged(t, ctx, c, "an exhausted budget", func() {
		createOrFail(t, ctx, b, store.NewPacket{ID: ids[2], Sender: "m", Total: all.Available + 1, Count: 1, Distribution: split.TypeFixed}, store.CreateBudgetExhausted)
	})
	createOrFail(t, ctx, b, store.NewPacket{ID: ids[3], Sender: "m", Total: all.Available, Count: 1, Distribution: split.TypeFixed}, store.CreateCreated)
	if all = conserved(t, ctx, b); all.Available != 0 {
		t.Fatalf("the budget after its last unit: %+v", all)
	}

	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	unchanged(t, ctx, c, "a closed budget", func() {
		createOrFail(t, ctx, b, store.NewPacket{ID: "late", Sender: "m", Total: 5, Count: 1, Distribution: split.TypeFixed}, store.CreateClosed)
		createOrFail(t, ctx, b, order, store.CreateExisting)
	})
	if s := conserved(t, ctx, b); !s.Closed {
		t.Fatalf("closed budget's snapshot: %+v", s)
	}
}

// Every outcome of a grab, the detail in grab order, and the grants in the
// settlement stream as store.StreamEntry decodes them.
func TestBudgetGrabOutcomes(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "grab-outcomes", 4, 100_000, testLimits())
	createOrFail(t, ctx, b, store.NewPacket{ID: "p1", Sender: "sender-1", Total: 1234, Count: 5, Distribution: split.TypeRandom}, store.CreateCreated)

	users := []string{"u-c", "u-a", "u:with:colons", "u-e", "u-b"}
	var sum int64
	for i, u := range users {
		g := grabOrFail(t, ctx, b, "p1", u, store.PacketGranted)
		if g.Share != i || g.Amount < 1 {
			t.Fatalf("grant %d: %+v", i, g)
		}
		sum += g.Amount
		again := grabOrFail(t, ctx, b, "p1", u, store.PacketAlreadyClaimed)
		if again.Share != g.Share || again.Amount != g.Amount {
			t.Fatalf("repeat of %s: %+v, want %+v", u, again, g)
		}
		conserved(t, ctx, b)
	}
	if sum != 1234 {
		t.Fatalf("grants sum to %d, want 1234", sum)
	}
	unchanged(t, ctx, c, "a grab of a sold-out packet", func() { grabOrFail(t, ctx, b, "p1", "late", store.PacketSoldOut) })
	unchanged(t, ctx, c, "a grab of no packet", func() {
		grabOrFail(t, ctx, b, "nope", "u", store.PacketMissing)
		grabOrFail(t, ctx, b, "bad id!", "u", store.PacketMissing)
	})
	if _, err := b.GrabPacket(ctx, "p1", strings.Repeat("x", 1025)); !errors.Is(err, store.ErrInvalidUserID) {
		t.Fatalf("a user id of 1025 bytes: %v", err)
	}

	d, ok, err := b.Packet(ctx, "p1")
	if err != nil || !ok {
		t.Fatalf("detail: %v %v", ok, err)
	}
	if d.RemainingAmount != 0 || d.RemainingCount != 0 || len(d.Grabs) != 5 || d.Expired {
		t.Fatalf("detail %+v", d)
	}
	for i, g := range d.Grabs {
		if g.Share != i || g.UserID != users[i] || g.At.IsZero() {
			t.Fatalf("detail grab %d: %+v, want %s", i, g, users[i])
		}
	}
	entries, err := b.Stream(b.ShardOf("p1")).Entries(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 6 {
		t.Fatalf("%d stream entries, want the creation record and 5 grants", len(entries))
	}
	rec := entries[0]
	var shares []int64
	for _, g := range d.Grabs {
		shares = append(shares, g.Amount)
	}
	if rec.Malformed != nil || rec.Kind != store.KindCreate || rec.PacketID != "p1" || rec.UserID != d.Sender ||
		rec.Amount != d.Total || fmt.Sprint(rec.Shares) != fmt.Sprint(shares) || !rec.Expires.Equal(d.ExpiresAt) {
		t.Fatalf("creation record %+v, want packet p1 of %d by %q with shares %v, expiring %s", rec, d.Total, d.Sender, shares, d.ExpiresAt)
	}
	for i, e := range entries[1:] {
		if e.Malformed != nil || e.Kind != store.KindGrant || e.PacketID != fmt.Sprintf("p1/%d", i) ||
			e.UserID != users[i] || e.Amount != d.Grabs[i].Amount || e.Currency != "CNY" || !e.At.Equal(d.Grabs[i].At) {
			t.Fatalf("entry %d: %+v, want the grant %+v", i, e, d.Grabs[i])
		}
	}
	if _, ok, err := b.Packet(ctx, "nope"); ok || err != nil {
		t.Fatalf("detail of no packet: %v %v", ok, err)
	}

	// A packet whose time is up answers expired before the operator expired it.
	createOrFail(t, ctx, b, store.NewPacket{ID: "short", Sender: "s", Total: 50, Count: 5, Distribution: split.TypeFixed, TTL: 200 * time.Millisecond}, store.CreateCreated)
	grabOrFail(t, ctx, b, "short", "first", store.PacketGranted)
	time.Sleep(250 * time.Millisecond)
	unchanged(t, ctx, c, "a grab past the time", func() { grabOrFail(t, ctx, b, "short", "second", store.PacketExpired) })
	grabOrFail(t, ctx, b, "short", "first", store.PacketAlreadyClaimed)

	live, err := b.LivePackets(ctx, b.ShardOf("short"), 10)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range live {
		if p.ID == "short" {
			found = p.RemainingCount == 4 && p.RemainingAmount == 40 && p.Sender == "s"
		}
	}
	if !found {
		t.Fatalf("live packets %+v lack short with 4 shares and 40 left", live)
	}
}

// Expiry refunds each remainder exactly once, through the stream; a fully grabbed
// packet writes no refund; a closed budget expires every live packet at once;
// ForgetPacket keeps a live packet and shrinks an expired one to its tombstone,
// whose id a creation cannot take again.
func TestBudgetExpiry(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "expiry", 1, 100_000, testLimits())
	ttl := 300 * time.Millisecond
	createOrFail(t, ctx, b, store.NewPacket{ID: "half", Sender: "alice", Total: 1000, Count: 5, Distribution: split.TypeRandom, TTL: ttl}, store.CreateCreated)
	createOrFail(t, ctx, b, store.NewPacket{ID: "full", Sender: "bob", Total: 10, Count: 2, Distribution: split.TypeFixed, TTL: ttl}, store.CreateCreated)
	createOrFail(t, ctx, b, store.NewPacket{ID: "later", Sender: "carol", Total: 77, Count: 3, Distribution: split.TypeFixed}, store.CreateCreated)
	var grabbed int64
	for _, u := range []string{"x", "y"} {
		grabbed += grabOrFail(t, ctx, b, "half", u, store.PacketGranted).Amount
		grabOrFail(t, ctx, b, "full", u, store.PacketGranted)
	}
	if n, _, err := b.ExpireDue(ctx, 0, 100); err != nil || n != 0 {
		t.Fatalf("expiry before the time: %d, %v", n, err)
	}
	time.Sleep(ttl + 50*time.Millisecond)
	if s := conserved(t, ctx, b); s.OverduePackets != 2 || s.LivePackets != 3 {
		t.Fatalf("before the expiry driver ran: %d overdue of %d live, want 2 of 3", s.OverduePackets, s.LivePackets)
	}
	expired, err := b.ExpireDuePackets(ctx, 0, 100)
	if err != nil {
		t.Fatal(err)
	}
	wantRefund := 1000 - grabbed
	if len(expired) != 2 || expired[0] != (store.ExpiredPacket{ID: "half", Refunded: wantRefund}) && expired[1] != (store.ExpiredPacket{ID: "half", Refunded: wantRefund}) {
		t.Fatalf("expired %+v, want half refunding %d and full", expired, wantRefund)
	}
	s := conserved(t, ctx, b)
	if s.Refunded != wantRefund || s.ExpiredPackets != 2 || s.LivePackets != 1 || s.Live != 77 || s.OverduePackets != 0 {
		t.Fatalf("after expiry: %+v", s)
	}
	unchanged(t, ctx, c, "a second expiry", func() {
		if n, r, err := b.ExpireDue(ctx, 0, 100); err != nil || n != 0 || r != 0 {
			t.Fatalf("second expiry: %d, %d, %v", n, r, err)
		}
	})
	entries, err := b.Stream(0).Entries(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var refunds []store.StreamEntry
	for _, e := range entries {
		if e.Malformed != nil {
			t.Fatalf("malformed entry %+v", e)
		}
		if e.Kind == store.KindRefund {
			refunds = append(refunds, e)
		}
	}
	if len(refunds) != 1 || refunds[0].PacketID != "half/refund" || refunds[0].UserID != "alice" ||
		refunds[0].Amount != wantRefund || refunds[0].Currency != "CNY" || refunds[0].At.IsZero() {
		t.Fatalf("refund entries %+v, want one of %d to alice", refunds, wantRefund)
	}
	d, _, err := b.Packet(ctx, "half")
	if err != nil || !d.Expired || d.RemainingCount != 0 || len(d.Grabs) != 2 {
		t.Fatalf("expired packet %+v, %v", d, err)
	}
	// A packet grabbed to its last share becomes its tombstone at its expiry: nothing
	// to refund, so no settlement would ever forget it.
	if d, found, err := b.Packet(ctx, "full"); err != nil || !found || !d.Forgotten || !d.Expired || len(d.Grabs) != 0 ||
		d.Total != 10 || d.RemainingAmount != 0 {
		t.Fatalf("the fully grabbed packet after its expiry: %+v, found %v, %v; want its tombstone", d, found, err)
	}
	if ttl, err := c.PTTL(ctx, b.ShardKeys(0).Packet("full")).Result(); err != nil || ttl <= store.GrabbedTombstoneRetention-time.Minute {
		t.Fatalf("the fully grabbed packet's tombstone lives %v, %v; want %v", ttl, err, store.GrabbedTombstoneRetention)
	}
	grabOrFail(t, ctx, b, "full", "z", store.PacketSoldOut)
	grabOrFail(t, ctx, b, "half", "z", store.PacketExpired)
	grabOrFail(t, ctx, b, "half", "x", store.PacketAlreadyClaimed)

	keep := 90 * time.Minute
	if err := b.ForgetPacket(ctx, "later", keep); !errors.Is(err, store.ErrPacketLive) {
		t.Fatalf("forgetting a live packet: %v", err)
	}
	// In a batch: the live packet is kept, the expired one becomes its tombstone, one
	// never made is no error, and an id no creation accepts is refused alone.
	errs := b.ForgetPackets(ctx, []string{"later", "half", "never-made", "bad id"}, keep)
	if len(errs) != 4 || !errors.Is(errs[0], store.ErrPacketLive) || errs[1] != nil || errs[2] != nil || errs[3] == nil {
		t.Fatalf("forgetting a batch: %v", errs)
	}
	if _, ok, _ := b.Packet(ctx, "later"); !ok {
		t.Fatal("a live packet was forgotten in a batch")
	}
	d, found, err := b.Packet(ctx, "half")
	if err != nil || !found || !d.Forgotten || !d.Expired || len(d.Grabs) != 0 || d.Sender != "alice" ||
		d.Total != 1000 || d.Count != 5 || d.RemainingAmount != wantRefund {
		t.Fatalf("the forgotten packet: %+v, found %v, %v; want its tombstone", d, found, err)
	}
	if ttl, err := c.PTTL(ctx, b.ShardKeys(0).Packet("half")).Result(); err != nil || ttl <= keep-time.Minute || ttl > keep {
		t.Fatalf("the forgotten packet's tombstone lives %v, %v; want %v", ttl, err, keep)
	}
	if n, err := c.HLen(ctx, b.ShardKeys(0).Packet("half")).Result(); err != nil || n != 11 {
		t.Fatalf("the tombstone holds %d fields, %v; want the 11 it keeps", n, err)
	}
	grabOrFail(t, ctx, b, "half", "z", store.PacketExpired)
	// Forgetting again changes nothing.
	unchanged(t, ctx, c, "a second forget", func() {
		if errs := b.ForgetPackets(ctx, []string{"half"}, keep); errs[0] != nil {
			t.Fatalf("forgetting a tombstone: %v", errs[0])
		}
	})
	// The id stays taken: the same body is the packet as it ended, another body a
	// conflict, and neither draws money.
	unchanged(t, ctx, c, "creations of a forgotten id", func() {
		createOrFail(t, ctx, b, store.NewPacket{ID: "half", Sender: "alice", Total: 1000, Count: 5, Distribution: split.TypeRandom, TTL: ttl}, store.CreateExisting)
		createOrFail(t, ctx, b, store.NewPacket{ID: "half", Sender: "alice", Total: 999, Count: 5, Distribution: split.TypeRandom, TTL: ttl}, store.CreateConflict)
		createOrFail(t, ctx, b, store.NewPacket{ID: "full", Sender: "bob", Total: 10, Count: 2, Distribution: split.TypeFixed, TTL: ttl}, store.CreateExisting)
	})

	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if n, r, err := b.ExpireDue(ctx, 0, 100); err != nil || n != 1 || r != 77 {
		t.Fatalf("expiry of a closed budget: %d, %d, %v; want later's 77", n, r, err)
	}
	s = conserved(t, ctx, b)
	if s.Live != 0 || s.LivePackets != 0 || s.Refunded != wantRefund+77 || s.Available+s.Claimed+s.Refunded != 100_000 {
		t.Fatalf("after closing: %+v", s)
	}

	if err := b.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := c.DBSize(ctx).Result(); err != nil || n != 0 {
		keys, _ := c.Keys(ctx, "*").Result()
		t.Fatalf("after Purge %d keys are left: %v (%v)", n, keys, err)
	}
}

// Configure creates the shards, raises only, splits exactly, and is idempotent.
func TestBudgetConfigure(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "configure", 4, 10, testLimits())
	for i, want := range []int64{3, 3, 2, 2} {
		ss, err := b.ShardSnapshot(ctx, i)
		if err != nil || ss.Allotted != want || ss.Available != want || ss.State != "open" {
			t.Fatalf("shard %d: %+v, %v; want %d allotted", i, ss, err, want)
		}
	}
	unchanged(t, ctx, c, "the same configuration", func() {
		if err := b.Configure(ctx, 10, testLimits()); err != nil {
			t.Fatal(err)
		}
	})
	unchanged(t, ctx, c, "a lowered total", func() {
		if err := b.Configure(ctx, 9, testLimits()); !errors.Is(err, store.ErrBudgetLowered) {
			t.Fatalf("lowering: %v", err)
		}
	})
	bad := testLimits()
	bad.MaxCount = store.MaxPacketShares + 1
	unchanged(t, ctx, c, "invalid limits", func() {
		if err := b.Configure(ctx, 100, bad); !errors.Is(err, store.ErrInvalidLimits) {
			t.Fatalf("invalid limits: %v", err)
		}
	})
	other := testLimits()
	other.Currency = "USD"
	if err := b.Configure(ctx, 10, other); err == nil || !strings.Contains(err.Error(), "CNY") {
		t.Fatalf("another currency: %v", err)
	}
	createOrFail(t, ctx, b, store.NewPacket{ID: idsOnShard(b, "c", 0, 1)[0], Sender: "m", Total: 3, Count: 3, Distribution: split.TypeFixed}, store.CreateCreated)
	// A raise reaches the shards while packets hold money.
	raised := testLimits()
	raised.MaxCount = 3
	if err := b.Configure(ctx, 1_000_000_007, raised); err != nil {
		t.Fatal(err)
	}
	s := conserved(t, ctx, b)
	if s.Total != 1_000_000_007 || s.Available != 1_000_000_004 || s.Live != 3 {
		t.Fatalf("after the raise: %+v", s)
	}
	// The new limits hold at once for a handle that configured them.
	createOrFail(t, ctx, b, store.NewPacket{ID: "four", Sender: "m", Total: 4, Count: 4, Distribution: split.TypeFixed}, store.CreateLimitExceeded)
	// A grab pod's handle reads them from Redis.
	pod := store.NewBudget(c, "configure", 4)
	createOrFail(t, ctx, pod, store.NewPacket{ID: "four", Sender: "m", Total: 4, Count: 4, Distribution: split.TypeFixed}, store.CreateLimitExceeded)
	createOrFail(t, ctx, pod, store.NewPacket{ID: "three", Sender: "m", Total: 4, Count: 3, Distribution: split.TypeFixed}, store.CreateCreated)
}

// A server that lost the function library fails the grab fleet's calls with an
// error lua.IsFunctionMissing recognises (the grab service's 503), writing
// nothing; the operator's handle loads it again and the call succeeds.
func TestBudgetFunctionMissing(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "functions", 2, 10_000, testLimits())
	createOrFail(t, ctx, b, store.NewPacket{ID: "before", Sender: "m", Total: 100, Count: 5, Distribution: split.TypeFixed}, store.CreateCreated)
	if err := c.FunctionFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	unchanged(t, ctx, c, "calls without the library", func() {
		_, err := b.Create(ctx, store.NewPacket{ID: "after", Sender: "m", Total: 100, Count: 5, Distribution: split.TypeFixed})
		if !lua.IsFunctionMissing(err) {
			t.Fatalf("create without the library: %v", err)
		}
		if _, err := b.GrabPacket(ctx, "before", "u"); !lua.IsFunctionMissing(err) {
			t.Fatalf("grab without the library: %v", err)
		}
		if _, _, err := b.Packet(ctx, "before"); !lua.IsFunctionMissing(err) {
			t.Fatalf("detail without the library: %v", err)
		}
		if _, err := b.LivePackets(ctx, 0, 10); !lua.IsFunctionMissing(err) {
			t.Fatalf("listing without the library: %v", err)
		}
	})
	op := store.NewBudget(c, "functions", 2).RestoreFunctions()
	grabOrFail(t, ctx, op, "before", "u", store.PacketGranted)
	grabOrFail(t, ctx, b, "before", "v", store.PacketGranted)
}

// The functions are bounded whatever a caller sends them.
func TestBudgetFunctionsRefuseUnboundedArguments(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "bounds", 1, 10_000, testLimits())
	createOrFail(t, ctx, b, store.NewPacket{ID: "p", Sender: "m", Total: 100, Count: 5, Distribution: split.TypeFixed}, store.CreateCreated)
	k := b.ShardKeys(0)
	long := strings.Repeat("a", 65)
	for name, cmd := range map[string]*redis.Cmd{
		"grab with a long user":    lua.PacketGrabScript.Call(ctx, c, []string{k.Meta, k.Packet("p"), k.Stream}, "p", strings.Repeat("u", 1025)),
		"grab with a long id":      lua.PacketGrabScript.Call(ctx, c, []string{k.Meta, k.Packet(long), k.Stream}, long, "u"),
		"grab with a bad id":       lua.PacketGrabScript.Call(ctx, c, []string{k.Meta, k.Packet("p*"), k.Stream}, "p*", "u"),
		"grab with another key":    lua.PacketGrabScript.Call(ctx, c, []string{k.Meta, k.Packet("q"), k.Stream}, "p", "u"),
		"grab with another meta":   lua.PacketGrabScript.Call(ctx, c, []string{k.Due, k.Packet("p"), k.Stream}, "p", "u"),
		"create with a long id":    lua.PacketCreateScript.Call(ctx, c, []string{k.Meta, k.Packet(long), k.Due, k.Stream}, long, "f", "m", 5, 1, "Fixed", 0, 5),
		"create with a long fp":    lua.PacketCreateScript.Call(ctx, c, []string{k.Meta, k.Packet("n"), k.Due, k.Stream}, "n", long, "m", 5, 1, "Fixed", 0, 5),
		"detail with a long id":    lua.PacketDetailScript.Call(ctx, c, []string{k.Meta, k.Packet(long)}, long),
		"live of 101":              lua.PacketLiveScript.Call(ctx, c, []string{k.Meta, k.Due}, 101),
		"expire of 501":            lua.PacketExpireScript.Run(ctx, c, []string{k.Meta, k.Due, k.Stream}, 501, 1000),
		"expire, no tombstone age": lua.PacketExpireScript.Run(ctx, c, []string{k.Meta, k.Due, k.Stream}, 50),
		"expire, tombstone 2^41":   lua.PacketExpireScript.Run(ctx, c, []string{k.Meta, k.Due, k.Stream}, 50, int64(1)<<41),
		"forget, no tombstone age": lua.PacketForgetScript.Run(ctx, c, []string{k.Packet("p")}),
		"forget, tombstone of 0":   lua.PacketForgetScript.Run(ctx, c, []string{k.Packet("p")}, 0),
		"create with few args":     lua.PacketCreateScript.Call(ctx, c, []string{k.Meta, k.Packet("n"), k.Due, k.Stream}, "n"),
		"create, another due key":  lua.PacketCreateScript.Call(ctx, c, []string{k.Meta, k.Packet("n"), k.Stream, k.Due}, "n", "f", "m", 5, 1, "Fixed", 0, 5),
	} {
		unchanged(t, ctx, c, name, func() {
			if err := cmd.Err(); err == nil {
				t.Errorf("%s: no error, reply %v", name, cmd.Val())
			}
		})
	}
	// A creation with many more shares than the count is refused before they are read.
	args := []any{"n", "f", "m", 5, 5, "Fixed", 0}
	for range 100_000 {
		args = append(args, 1)
	}
	unchanged(t, ctx, c, "a creation of 100000 shares", func() {
		v, err := lua.PacketCreateScript.Call(ctx, c, []string{k.Meta, k.Packet("n"), k.Due, k.Stream}, args...).StringSlice()
		if err != nil || v[0] != "invalid_request" {
			t.Fatalf("100000 shares: %q, %v", v, err)
		}
	})
}

// A fenced shard (Budget.Fence) expires nothing, even a packet long due, so no
// refund is computed from data that came back older than what was acknowledged;
// creations and grabs answer ErrBudgetFenced with the reason, and none of the three
// changes a key. The first reason stays.
func TestFencedBudgetExpiresCreatesAndGrantsNothing(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "fenced", 2, 100_000, testLimits())
	ttl := 100 * time.Millisecond
	createOrFail(t, ctx, b, store.NewPacket{ID: "due", Sender: "alice", Total: 1000, Count: 5, Distribution: split.TypeFixed, TTL: ttl}, store.CreateCreated)
	grabOrFail(t, ctx, b, "due", "x", store.PacketGranted)
	if err := b.Fence(ctx, "RedisRolledBack"); err != nil {
		t.Fatal(err)
	}
	if err := b.Fence(ctx, "DataLost"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(ttl + 50*time.Millisecond)
	unchanged(t, ctx, c, "calls on a fenced budget", func() {
		for i := range b.N() {
			if n, r, err := b.ExpireDue(ctx, i, 100); err != nil || n != 0 || r != 0 {
				t.Fatalf("shard %d expired %d packets refunding %d (%v); want none", i, n, r, err)
			}
		}
		_, _, err := b.CreatePacket(ctx, store.NewPacket{ID: "new", Sender: "bob", Total: 10, Count: 1, Distribution: split.TypeFixed})
		if !errors.Is(err, store.ErrBudgetFenced) || !strings.Contains(err.Error(), "RedisRolledBack") {
			t.Fatalf("a creation: %v; want ErrBudgetFenced with the first reason", err)
		}
		if _, err := b.GrabPacket(ctx, "due", "y"); !errors.Is(err, store.ErrBudgetFenced) {
			t.Fatalf("a grab: %v; want ErrBudgetFenced", err)
		}
	})
}

// The money checks of a snapshot and of the ledger read before it, as a table: what
// no run of the scripts leaves is named, and what they leave is not.
func TestBudgetMoneyAndLedgerFaults(t *testing.T) {
	ok := store.BudgetSnapshot{Total: 1000, Available: 600, Live: 200, Claimed: 150, Refunded: 50}
	for _, tc := range []struct {
		name   string
		snap   store.BudgetSnapshot
		ledger store.BudgetLedgerSums
		want   []string
	}{
		{"all agree, the ledger behind", ok, store.BudgetLedgerSums{Granted: 100, Refunded: 50}, nil},
		{"the ledger at the shards' figures", ok, store.BudgetLedgerSums{Granted: 150, Refunded: 50}, nil},
		{"grants credited beyond the shards'", ok, store.BudgetLedgerSums{Granted: 151}, []string{"credited 151 in grants, more than the 150"}},
		{"refunds credited beyond the shards'", ok, store.BudgetLedgerSums{Refunded: 70}, []string{"credited 70 in refunds, more than the 50"}},
		{"negative money in packets", store.BudgetSnapshot{Total: 1000, Available: 900, Live: -100, Claimed: 200}, store.BudgetLedgerSums{},
			[]string{"negative money: available 900, in packets -100"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := append(tc.snap.MoneyFaults(), tc.snap.LedgerFaults(tc.ledger)...)
			if len(got) != len(tc.want) {
				t.Fatalf("faults %q, want %d", got, len(tc.want))
			}
			for i, w := range tc.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("fault %q does not say %q", got[i], w)
				}
			}
		})
	}
}
