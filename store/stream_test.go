package store_test

import (
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// The consumer-group operations on a real server: a dead consumer's entry is taken
// over once idle, delivery counts follow every read and claim, held entries are kept
// from other consumers, and the pending count follows acknowledgements.
func TestConsumerGroupOperations(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const group = "settlement"
	amounts := splitOrFail(t, split.TypeFixed, 600, 6)
	k := seedOpen(t, ctx, c, "group-ops", amounts)
	a := store.NewActivity(c, "group-ops", 1).Shard(0)

	// Reads before the group exists say so.
	if _, err := a.ReadNew(ctx, group, "w", 10, 0); !errors.Is(err, store.ErrNoGroup) {
		t.Fatalf("read without a group: %v, want ErrNoGroup", err)
	}
	for range 2 { // the second time the group exists already
		if err := a.EnsureGroup(ctx, group); err != nil {
			t.Fatalf("ensure group: %v", err)
		}
	}
	if got, err := a.ReadNew(ctx, group, "w", 10, 10*time.Millisecond); err != nil || len(got) != 0 {
		t.Fatalf("read of an empty stream: %v, %v", got, err)
	}

	grants := map[string]store.GrabResult{}
	for _, u := range []string{"u1", "u2", "u3", "u4"} {
		grants[u] = grabOne(t, c, k, u)
	}
	if n, err := a.StreamLen(ctx); err != nil || n != 4 {
		t.Fatalf("stream length %d, %v; want 4", n, err)
	}
	claims, err := a.Claims(ctx)
	if err != nil || len(claims) != 4 {
		t.Fatalf("claims %v, %v", claims, err)
	}
	for u, g := range grants {
		if c := claims[u]; c.PacketID != g.PacketID || c.Amount != g.Amount || c.EntryID == "" {
			t.Fatalf("claim of %s: %+v, granted %+v", u, claims[u], g)
		}
	}

	// The dead consumer reads three entries and never acknowledges them.
	dead, err := a.ReadNew(ctx, group, "dead", 3, time.Second)
	if err != nil || len(dead) != 3 {
		t.Fatalf("read by the dead consumer: %v, %v", dead, err)
	}
	for _, e := range dead {
		g := grants[e.UserID]
		if e.Malformed != nil || e.Kind != store.KindGrant || e.PacketID != g.PacketID || e.Amount != g.Amount ||
			e.At.IsZero() || e.Fields["grant"] != fmt.Sprintf("%s:%d:0::%s", g.PacketID, g.Amount, e.UserID) {
			t.Fatalf("entry %+v, granted %+v", e, g)
		}
	}
	// The live consumer reads the fourth.
	live, err := a.ReadNew(ctx, group, "live", 10, time.Second)
	if err != nil || len(live) != 1 {
		t.Fatalf("read by the live consumer: %v, %v", live, err)
	}
	if n, err := a.PendingCount(ctx, group); err != nil || n != 4 {
		t.Fatalf("pending %d, %v; want 4", n, err)
	}
	ids := []string{dead[2].ID, dead[0].ID, dead[1].ID} // any order
	counts, err := a.DeliveryCounts(ctx, group, "dead", ids)
	if err != nil || len(counts) != 3 || counts[dead[0].ID] != 1 || counts[dead[2].ID] != 1 {
		t.Fatalf("delivery counts %v, %v; want 1 each", counts, err)
	}
	// Only the consumer's own pending entries count.
	if counts, err := a.DeliveryCounts(ctx, group, "live", ids); err != nil || len(counts) != 0 {
		t.Fatalf("delivery counts of another consumer's entries %v, %v; want none", counts, err)
	}
	// A restarted consumer re-reads its own pending list from the start, in pages;
	// each re-read counts as a delivery.
	again, err := a.ReadOwnPending(ctx, group, "dead", "0", 2)
	if err != nil || len(again) != 2 || again[0].ID != dead[0].ID {
		t.Fatalf("own pending, first page: %v, %v", again, err)
	}
	rest, err := a.ReadOwnPending(ctx, group, "dead", again[1].ID, 2)
	if err != nil || len(rest) != 1 || rest[0].ID != dead[2].ID || rest[0].UserID != dead[2].UserID {
		t.Fatalf("own pending, second page: %v, %v", rest, err)
	}
	if end, err := a.ReadOwnPending(ctx, group, "dead", rest[0].ID, 2); err != nil || len(end) != 0 {
		t.Fatalf("own pending past the end: %v, %v", end, err)
	}
	if counts, err := a.DeliveryCounts(ctx, group, "dead", ids); err != nil || len(counts) != 3 ||
		counts[dead[0].ID] != 2 || counts[dead[1].ID] != 2 || counts[dead[2].ID] != 2 {
		t.Fatalf("delivery counts after the re-read %v, %v; want 2 each", counts, err)
	}

	// Nothing is idle long enough yet: no takeover.
	got, next, err := a.ClaimIdle(ctx, group, "live", time.Hour, "0-0", 10)
	if err != nil || len(got) != 0 || next != "0-0" {
		t.Fatalf("claim before anything is idle: %v, %q, %v", got, next, err)
	}
	time.Sleep(300 * time.Millisecond)
	// The live consumer keeps its own entry fresh: a refresh goes through for an
	// entry it holds and fails for one another consumer holds.
	owned, err := a.RefreshHeld(ctx, group, "live", []store.HeldEntry{{ID: live[0].ID}, {ID: "0-1"}})
	if err != nil || len(owned) != 2 || !owned[live[0].ID] || owned["0-1"] {
		t.Fatalf("refresh: %v, %v", owned, err)
	}
	// The dead consumer's entries are idle now: taken over in two batches, the
	// cursor going round after the last. The live consumer's fresh entry stays.
	first, next, err := a.ClaimIdle(ctx, group, "live", 200*time.Millisecond, "0-0", 2)
	if err != nil || len(first) != 2 || first[0].ID != dead[0].ID || next == "0-0" {
		t.Fatalf("takeover, first batch: %v, %q, %v", first, next, err)
	}
	second, next, err := a.ClaimIdle(ctx, group, "live", 200*time.Millisecond, next, 2)
	if err != nil || len(second) != 1 || second[0].ID != dead[2].ID || next != "0-0" {
		t.Fatalf("takeover, second batch: %v, %q, %v", second, next, err)
	}
	if second[0].Malformed != nil || second[0].UserID != dead[2].UserID {
		t.Fatalf("taken-over entry %+v", second[0])
	}
	counts, err = a.DeliveryCounts(ctx, group, "live", []string{dead[0].ID, dead[1].ID, dead[2].ID, live[0].ID})
	if err != nil || len(counts) != 4 || counts[dead[0].ID] != 3 || counts[dead[1].ID] != 3 || counts[dead[2].ID] != 3 ||
		counts[live[0].ID] != 1 {
		t.Fatalf("delivery counts after the takeover %v, %v; want 3 for taken-over entries, 1 for the own", counts, err)
	}
	if counts, err := a.DeliveryCounts(ctx, group, "dead", ids); err != nil || len(counts) != 0 {
		t.Fatalf("the dead consumer still holds %v, %v", counts, err)
	}
	// The dead consumer can no longer refresh or retry what it lost.
	owned, err = a.RefreshHeld(ctx, group, "dead", []store.HeldEntry{{ID: dead[0].ID, MinIdle: time.Hour}})
	if err != nil || owned[dead[0].ID] {
		t.Fatalf("refresh by the old owner: %v, %v", owned, err)
	}
	if mine, err := a.ClaimForRetry(ctx, group, "dead", dead[0].ID, time.Hour); err != nil || mine {
		t.Fatalf("retry claim by the old owner: %v, %v", mine, err)
	}
	// The new owner's retry claim counts one more delivery.
	if mine, err := a.ClaimForRetry(ctx, group, "live", dead[0].ID, 0); err != nil || !mine {
		t.Fatalf("retry claim by the owner: %v, %v", mine, err)
	}
	if counts, err := a.DeliveryCounts(ctx, group, "live", []string{dead[0].ID}); err != nil || counts[dead[0].ID] != 4 {
		t.Fatalf("delivery count after the retry claim %v, %v; want 4", counts, err)
	}

	// Acknowledgements bring the pending count down; the acknowledged entries are no
	// longer anyone's.
	for _, e := range append(first, second...) {
		if ok, err := a.Ack(ctx, group, e.ID, e.Kind, e.Amount); err != nil || !ok {
			t.Fatalf("ack %s: %v, %v", e.ID, ok, err)
		}
	}
	if n, err := a.PendingCount(ctx, group); err != nil || n != 1 {
		t.Fatalf("pending %d, %v; want 1", n, err)
	}
	if mine, err := a.ClaimForRetry(ctx, group, "live", dead[0].ID, 0); err != nil || mine {
		t.Fatalf("retry claim of an acknowledged entry: %v, %v", mine, err)
	}
	if n, err := a.PendingCount(ctx, "no-such-group"); !errors.Is(err, store.ErrNoGroup) || n != 0 {
		t.Fatalf("pending of a missing group: %d, %v", n, err)
	}
}

// Many pending entries of one consumer between the asked-for ones: the delivery
// counts page through them.
func TestDeliveryCountsPageThroughPendingEntries(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const group, n = "settlement", 1300
	a := store.NewActivity(c, "paging", 1).Shard(0)
	// The activity is in Redis (its group is created only then).
	if err := c.HSet(ctx, a.Keys().Meta, "state", "open").Err(); err != nil {
		t.Fatal(err)
	}
	if err := a.EnsureGroup(ctx, group); err != nil {
		t.Fatal(err)
	}
	pipe := c.Pipeline()
	for i := range n {
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: a.Keys().Stream, Values: []any{"kind", "grant", "i", i}})
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	read, err := a.ReadNew(ctx, group, "w", n, time.Second)
	if err != nil || len(read) != n {
		t.Fatalf("read %d, %v", len(read), err)
	}
	ids := []string{read[0].ID, read[n-1].ID}
	counts, err := a.DeliveryCounts(ctx, group, "w", ids)
	if err != nil || len(counts) != 2 || counts[ids[0]] != 1 || counts[ids[1]] != 1 {
		t.Fatalf("counts %v, %v; want both ends", counts, err)
	}
	for _, e := range read {
		if e.Malformed == nil {
			t.Fatalf("entry %v decoded without packet, user, amount or at", e.Fields)
		}
	}
}

// Moved from package settlement with the replay itself: replaying moves at most max
// entries, oldest first, each back as a new entry with its original fields.
func TestReplayDeadLettersMovesAtMostMax(t *testing.T) {
	ctx := redistest.Context(t)
	rdb := redistest.Start(t).Client(t)
	const group = "settlement"
	amounts := splitOrFail(t, split.TypeFixed, 1_000, 10)
	k := seedOpen(t, ctx, rdb, "uid-replay", amounts)
	a := store.NewActivity(rdb, "uid-replay", 1).Shard(0)
	for _, u := range []string{"user-0000", "user-0001", "user-0002"} {
		grabOne(t, rdb, k, u)
	}
	if err := a.EnsureGroup(ctx, group); err != nil {
		t.Fatalf("group: %v", err)
	}
	orig, err := a.ReadNew(ctx, group, "c", 10, 0)
	if err != nil || len(orig) != 3 {
		t.Fatalf("read: %v, %v", orig, err)
	}
	for _, m := range orig {
		ok, err := a.DeadLetter(ctx, group, m.ID, "HTTP 400", m.FieldValues())
		if err != nil || !ok {
			t.Fatalf("dead letter: %v, %v", ok, err)
		}
	}
	snapshot := func() store.Snapshot {
		t.Helper()
		s, err := store.NewActivity(rdb, "uid-replay", 1).Snapshot(ctx)
		if err != nil {
			t.Fatalf("snapshot: %v", err)
		}
		return s
	}
	if s := snapshot(); s.DeadCount != 3 {
		t.Fatalf("dead count %d", s.DeadCount)
	}

	n, err := a.ReplayDeadLetters(ctx, 2)
	if err != nil || n != 2 {
		t.Fatalf("replay 2: %d, %v", n, err)
	}
	if s := snapshot(); s.DeadCount != 1 {
		t.Fatalf("dead count %d after replaying 2 of 3", s.DeadCount)
	}
	all, err := a.Entries(ctx)
	if err != nil || len(all) != 5 {
		t.Fatalf("stream: %d entries, %v; want 3 + 2 replayed", len(all), err)
	}
	// A packed grant takes its time from its id, so its copy also carries the
	// original's time: it decodes to the same grant at the same instant.
	for i, got := range all[3:] {
		want := orig[i]
		if len(got.Fields) != len(want.Fields)+1 {
			t.Fatalf("replayed entry %v, original %v", got.Fields, want.Fields)
		}
		for f, v := range want.Fields {
			if got.Fields[f] != v {
				t.Fatalf("replayed entry %v, original %v", got.Fields, want.Fields)
			}
		}
		if got.Malformed != nil || want.Malformed != nil || got.At != want.At || got.PacketID != want.PacketID ||
			got.UserID != want.UserID || got.Amount != want.Amount || got.Kind != store.KindGrant {
			t.Fatalf("replayed entry decodes to %+v, original to %+v", got, want)
		}
	}
	if n, err := a.ReplayDeadLetters(ctx, 0); err != nil || n != 1 {
		t.Fatalf("replay rest: %d, %v", n, err)
	}
	if s := snapshot(); s.DeadCount != 0 || rdb.XLen(ctx, k.DeadLetters).Val() != 0 {
		t.Fatalf("dead count %d after replaying all", s.DeadCount)
	}
}

// VerifyEntries accepts exactly the entries the activity's scripts wrote: a grant
// that matches its user's claim, the refund that matches the close, whatever other
// fields they carry; every other entry appended to the stream is forged, with a
// reason that says what does not match.
func TestVerifyEntriesTellsForgedEntriesFromGenuine(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	amounts := splitOrFail(t, split.TypeRandom, 10_000, 20)
	k := seedOpen(t, ctx, c, "verify", amounts)
	a := store.NewActivity(c, "verify", 1).Shard(0)
	alice := grabOne(t, c, k, "alice")
	bob := grabOne(t, c, k, "bob")
	if alice.Outcome != store.Granted || bob.Outcome != store.Granted {
		t.Fatalf("grabs: %+v, %+v", alice, bob)
	}
	xadd := func(fields ...string) string {
		t.Helper()
		id, err := c.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: fields}).Result()
		if err != nil {
			t.Fatalf("xadd: %v", err)
		}
		return id
	}
	amount := func(n int64) string { return strconv.FormatInt(n, 10) }
	forgedWant := map[string]string{ // entry id -> what the reason must mention
		// Mallory claims Alice's packet: Mallory holds no packet.
		xadd("grant", alice.PacketID+":"+amount(alice.Amount)+":0::mallory"): "holds no packet",
		// Bob's entry for Alice's packet.
		xadd("grant", alice.PacketID+":"+amount(alice.Amount)+":0::bob"): "whose claim is",
		// Alice's packet for more money, or spelt otherwise.
		xadd("grant", alice.PacketID+":"+amount(alice.Amount+1)+":0::alice"): "whose claim is",
		xadd("grant", alice.PacketID+":0"+amount(alice.Amount)+":0::alice"):  "whose claim is",
		// A packet that does not exist, to Alice.
		xadd("grant", "no-such-packet:"+amount(alice.Amount)+":0::alice"): "whose claim is",
		// A refund of an open activity.
		xadd("kind", "refund", "packet", "refund", "user", sponsor, "amount", "5", "at", "1"): "not closed",
		// A verbatim copy of Bob's genuine entry: right user, packet and amount, but
		// not the entry his grant wrote (it would be credited and counted twice).
		xadd("grant", bob.PacketID+":"+amount(bob.Amount)+":0:CNY:bob"): "the one its grant wrote",
	}
	malformed := xadd("kind", "gift")

	entries, err := a.Entries(ctx)
	if err != nil {
		t.Fatalf("reading the stream: %v", err)
	}
	forged, err := a.VerifyEntries(ctx, entries)
	if err != nil {
		t.Fatalf("verify: %v", err)
	}
	for _, e := range entries {
		reason, isForged := forged[e.ID]
		want, shouldBe := forgedWant[e.ID]
		switch {
		case shouldBe && !isForged:
			t.Errorf("forged entry %s %v passed", e.ID, e.Fields)
		case shouldBe && (!errors.Is(reason, store.ErrForged) || !strings.Contains(reason.Error(), want)):
			t.Errorf("entry %s: reason %q, want ErrForged mentioning %q", e.ID, reason, want)
		case !shouldBe && isForged:
			t.Errorf("entry %s %v called forged: %v", e.ID, e.Fields, reason)
		}
	}
	if _, ok := forged[malformed]; ok {
		t.Errorf("a malformed entry got a verdict; it is dead-lettered as malformed")
	}

	// After the close, the refund close.lua wrote passes; one for another amount,
	// another payee or another packet does not.
	res, err := handle(c, k).Close(ctx, store.CloseExpired)
	if err != nil || res.Refunded <= 0 {
		t.Fatalf("close: %+v, %v", res, err)
	}
	last, err := c.XRevRangeN(ctx, k.Stream, "+", "-", 1).Result()
	if err != nil || len(last) != 1 || last[0].Values["kind"] != store.KindRefund {
		t.Fatalf("the refund entry: %v, %v", last, err)
	}
	refund := map[string]string{}
	for name, v := range last[0].Values {
		refund[name] = v.(string)
	}
	with := func(name, value string) map[string]string {
		f := maps.Clone(refund)
		f[name] = value
		return f
	}
	cases := []struct {
		fields map[string]string
		want   string // "" for genuine
	}{
		{refund, ""},
		{with("amount", amount(res.Refunded+1)), "but the close refunded"},
		{with("user", "mallory"), "but the sponsor is"},
		{with("packet", "p1"), "with packet"},
	}
	for _, tc := range cases {
		// Each refund is written to the stream and read back as a worker reads it.
		if err := c.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: tc.fields}).Err(); err != nil {
			t.Fatal(err)
		}
		written, err := a.Entries(ctx)
		if err != nil {
			t.Fatal(err)
		}
		e := written[len(written)-1]
		forged, err := a.VerifyEntries(ctx, []store.StreamEntry{e})
		if err != nil {
			t.Fatalf("verify refund: %v", err)
		}
		reason := forged[e.ID]
		if tc.want == "" && reason != nil || tc.want != "" && (reason == nil || !strings.Contains(reason.Error(), tc.want)) {
			t.Errorf("refund %v: verdict %v, want %q", tc.fields, reason, tc.want)
		}
	}

	// Without the activity's keys nothing can be verified, and nothing is called forged.
	if err := store.NewActivity(c, "verify", 1).Purge(ctx); err != nil {
		t.Fatalf("purge: %v", err)
	}
	if _, err := a.VerifyEntries(ctx, entries); !errors.Is(err, store.ErrNotInRedis) {
		t.Fatalf("verify without the activity: %v, want ErrNotInRedis", err)
	}
}

// The cost of verifying one batch of the settlement worker (DefaultBatchSize = 64
// grants) in one pipeline, against a real redis-server on loopback.
func BenchmarkVerifyEntries(b *testing.B) {
	ctx := redistest.Context(b)
	c := redistest.Start(b).Client(b)
	k := seedOpen(b, ctx, c, "verify-bench", splitOrFail(b, split.TypeFixed, 6_400, 64))
	for i := range 64 {
		if res, err := shardOf(c, k).Grab(ctx, "u"+strconv.Itoa(i)); err != nil || res.Outcome != store.Granted {
			b.Fatalf("grab: %+v, %v", res, err)
		}
	}
	a := store.NewActivity(c, "verify-bench", 1).Shard(0)
	if err := a.EnsureGroup(ctx, "g"); err != nil {
		b.Fatal(err)
	}
	entries, err := a.ReadNew(ctx, "g", "w", 64, 0)
	if err != nil || len(entries) != 64 {
		b.Fatalf("read: %d entries, %v", len(entries), err)
	}
	b.ResetTimer()
	for b.Loop() {
		forged, err := a.VerifyEntries(ctx, entries)
		if err != nil || len(forged) != 0 {
			b.Fatalf("verify: %v, %v", forged, err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/64, "ns/entry")
}

// A worker that runs late, after the activity was purged with its unsettled streams
// kept for retention, brings back no key without a TTL: creating its group, acking
// and dead-lettering leave the meta hash gone and every remaining key expiring.
func TestLateWorkerAfterPurgeRecreatesNoKeyWithoutTTL(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	k := seedOpen(t, ctx, c, "purged", []int64{10, 20, 30})
	a := store.NewActivity(c, "purged", 1).Shard(0)
	for _, u := range []string{"u1", "u2"} {
		if res, err := a.Grab(ctx, u); err != nil || res.Outcome != store.Granted {
			t.Fatalf("grab: %+v %v", res, err)
		}
	}
	const group = "settlement"
	if err := a.EnsureGroup(ctx, group); err != nil {
		t.Fatal(err)
	}
	entries, err := a.ReadNew(ctx, group, "w1", 10, 0)
	if err != nil || len(entries) != 2 {
		t.Fatalf("read: %d entries, %v", len(entries), err)
	}
	if _, err := store.NewActivity(c, "purged", 1).PurgeKeepingUnsettled(ctx, time.Hour); err != nil {
		t.Fatal(err)
	}
	if ok, err := a.Ack(ctx, group, entries[0].ID, store.KindGrant, 10); err != nil || !ok {
		t.Fatalf("late ack: %v %v", ok, err)
	}
	if ok, err := a.DeadLetter(ctx, group, entries[1].ID, "late", map[string]any{"kind": "grant"}); err != nil || ok {
		t.Fatalf("late dead letter: %v %v; want nothing written", ok, err)
	}
	keys, err := c.Keys(ctx, "rpa:{purged}:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range keys {
		if key == k.Meta {
			t.Errorf("the purged meta hash came back")
		}
		if ttl, err := c.PTTL(ctx, key).Result(); err != nil || ttl <= 0 {
			t.Errorf("key %s has no TTL (%v, %v)", key, ttl, err)
		}
	}
	// With everything gone, creating the group creates nothing.
	if err := c.Del(ctx, keys...).Err(); err != nil {
		t.Fatal(err)
	}
	if err := a.EnsureGroup(ctx, group); !errors.Is(err, store.ErrMissing) {
		t.Fatalf("creating the group of a purged activity: %v, want ErrMissing", err)
	}
	if n, err := c.Exists(ctx, k.Stream).Result(); err != nil || n != 0 {
		t.Fatalf("the stream of a purged activity was created (%d, %v)", n, err)
	}
}
