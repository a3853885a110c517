package settlement

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
)

// Entries that someone with the activity's Redis credentials appended to its stream
// (XADD), rather than grab.lua or close.lua, are dead-lettered with the reason and
// never reach the balance system; the genuine entries around them are delivered.
func TestForgedEntriesAreDeadLetteredNeverDelivered(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-forged", 60, 12_000, "merchant-001")
	key := []byte("balance-signing-key")
	rcv := newReceiver(t, a.uid, key)
	type seen struct {
		kind, packet, user string
		amount             int64
	}
	var mu sync.Mutex
	var requests []seen
	rcv.setReject(func(_ *http.Request, d Delivery) int {
		mu.Lock()
		requests = append(requests, seen{d.Kind, d.PacketID, d.UserID, d.Amount})
		mu.Unlock()
		return 0
	})

	grants := a.grab(t, 0, 10)
	var alice, bob grant
	for _, g := range grants {
		switch {
		case alice.user == "":
			alice = g
		case bob.user == "":
			bob = g
		}
	}
	ctx := context.Background()
	xadd := func(fields ...string) string {
		t.Helper()
		id, err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: a.keys.Stream, Values: fields}).Result()
		if err != nil {
			t.Fatalf("xadd: %v", err)
		}
		return id
	}
	amount := func(n int64) string { return strconv.FormatInt(n, 10) }
	forged := map[string]string{ // entry id -> the user it would have credited
		// Grants in the packed form grab.lua writes: Alice's packet to Mallory, Bob's
		// packet to Alice, Alice's packet for more money, a packet that does not exist,
		// and a verbatim copy of Bob's genuine entry (not the one his grant wrote).
		xadd("grant", alice.packet+":"+amount(alice.amount)+":0:CNY:mallory"):      "mallory",
		xadd("grant", bob.packet+":"+amount(bob.amount)+":0:CNY:"+alice.user):      alice.user,
		xadd("grant", alice.packet+":"+amount(alice.amount*100)+":0::"+alice.user): alice.user,
		xadd("grant", "p-999999:5000:0:CNY:mallory"):                               "mallory",
		xadd("grant", bob.packet+":"+amount(bob.amount)+":0::"+bob.user):           bob.user,
		// Refunds of an open activity.
		xadd("kind", "refund", "packet", store.RefundPacketID, "user", "mallory", "amount", "5000", "at", "1"):                    "mallory",
		xadd("kind", "refund", "packet", store.RefundPacketID, "user", "merchant-001", "amount", "5000", "at", "1", "extra", "x"): "merchant-001",
	}
	for id, g := range a.grab(t, 10, 10) {
		grants[id] = g
	}

	cfg := baseConfig(a, rcv.url("/credit"), "w1")
	cfg.SigningKey = key
	startWorker(t, cfg)
	// One more forgery while the worker runs, between genuine grants.
	forged[xadd("grant", "p-777:1:0::mallory")] = "mallory"
	for id, g := range a.grab(t, 20, 5) {
		grants[id] = g
	}
	eventually(t, 15*time.Second, "genuine entries settled, forged ones dead-lettered", func() bool {
		s := a.snapshot(t)
		return s.SettledCount == 25 && s.DeadCount == int64(len(forged))
	})

	// The balance system saw exactly the genuine grants, each once.
	rcv.checkCredits(t, grants)
	mu.Lock()
	got := append([]seen(nil), requests...)
	mu.Unlock()
	if len(got) != len(grants) {
		t.Errorf("the balance system got %d requests, want one per genuine grant (%d)", len(got), len(grants))
	}
	for _, r := range got {
		g, ok := grants[r.packet]
		if !ok || r.kind != store.KindGrant || r.user != g.user || r.amount != g.amount {
			t.Errorf("a request the activity never granted reached the balance system: %+v", r)
		}
	}

	// Each forged entry is parked with its fields and the reason.
	dead, err := a.handle.Shard(0).DeadLetters(ctx)
	if err != nil || len(dead) != len(forged) {
		t.Fatalf("dead letters %v, %v; want %d", dead, err, len(forged))
	}
	for _, d := range dead {
		id := d.Fields["entry"]
		user, ok := forged[id]
		if !ok {
			t.Errorf("dead letter of entry %q, which is not a forged one", id)
			continue
		}
		if e := d.Fields["error"]; !strings.Contains(e, store.ErrForged.Error()) {
			t.Errorf("dead letter of %s: error %q, want it to say the entry is forged", id, e)
		}
		if d.Malformed != nil || d.UserID != user {
			t.Errorf("dead letter of %s lost its fields: %v", id, d.Fields)
		}
	}
	if p := a.pending(t, DefaultGroup); p != 0 {
		t.Errorf("%d entries still pending", p)
	}

	// The genuine refund at close is delivered; the forged refunds were not.
	res, err := a.handle.Close(ctx, store.CloseExpired)
	if err != nil || res.Refunded <= 0 {
		t.Fatalf("close: %+v, %v", res, err)
	}
	eventually(t, 15*time.Second, "the refund settled", func() bool {
		return a.snapshot(t).RefundSettled == res.Refunded
	})
	d, ok := rcv.creditedFor(a.uid + "/refund")
	if !ok || d.UserID != "merchant-001" || d.Amount != res.Refunded {
		t.Fatalf("refund credited as %+v (%v), want %d to merchant-001", d, ok, res.Refunded)
	}
	if s := a.snapshot(t); s.DeadCount != int64(len(forged)) || s.SettledCount != 25 {
		t.Fatalf("after the refund: %d dead, %d settled", s.DeadCount, s.SettledCount)
	}
}

// A replayed forged entry is verified again and dead-lettered again.
func TestReplayedForgedEntryIsDeadLetteredAgain(t *testing.T) {
	rdb := newRedis(t)
	a := newActivity(t, rdb, "uid-forged-replay", 10, 1_000, "merchant-001")
	rcv := newReceiver(t, a.uid, nil)
	grants := a.grab(t, 0, 3)
	ctx := context.Background()
	if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: a.keys.Stream,
		Values: []string{"grant", "p-1:100:0::mallory"}}).Err(); err != nil {
		t.Fatalf("xadd: %v", err)
	}
	startWorker(t, baseConfig(a, rcv.url("/credit"), "w1"))
	eventually(t, 10*time.Second, "three settled, one dead-lettered", func() bool {
		s := a.snapshot(t)
		return s.SettledCount == 3 && s.DeadCount == 1
	})
	if n, err := a.handle.ReplayDeadLetters(ctx, 0); err != nil || n != 1 {
		t.Fatalf("replay: %d, %v", n, err)
	}
	eventually(t, 10*time.Second, "the replayed forgery dead-lettered again", func() bool {
		s := a.snapshot(t)
		return s.DeadCount == 1 && rdb.XLen(ctx, a.keys.DeadLetters).Val() == 1 && a.pending(t, DefaultGroup) == 0
	})
	rcv.checkCredits(t, grants)
	if st := rcv.stats(); st.requests != 3 {
		t.Fatalf("%d requests, want the 3 genuine grants only", st.requests)
	}
}
