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

// A settlement stream entry decodes to its typed fields; an entry that is not a
// grant or a refund says why and keeps its id and raw fields, so it can be parked
// as it was.
func TestDecodeStreamEntry(t *testing.T) {
	good := func() map[string]string {
		return map[string]string{"kind": "grant", "packet": "7", "user": "alice", "amount": "123", "at": "1767225600123"}
	}
	with := func(name, value string) map[string]string {
		f := good()
		f[name] = value
		return f
	}
	without := func(name string) map[string]string {
		f := good()
		delete(f, name)
		return f
	}
	at := time.Date(2026, 1, 1, 0, 0, 0, 123e6, time.UTC)
	cases := []struct {
		name   string
		fields map[string]string
		want   store.StreamEntry // ID and Fields are checked separately
		bad    string            // part of the Malformed error; "" for a good entry
	}{
		{"grant", good(), store.StreamEntry{Kind: store.KindGrant, PacketID: "7", UserID: "alice", Amount: 123, At: at}, ""},
		{"refund", map[string]string{"kind": "refund", "packet": "refund", "user": "merchant-001", "amount": "9000", "at": "0"},
			store.StreamEntry{Kind: store.KindRefund, PacketID: store.RefundPacketID, UserID: "merchant-001", Amount: 9000, At: time.UnixMilli(0).UTC()}, ""},
		{"zero amount", with("amount", "0"), store.StreamEntry{Kind: store.KindGrant, PacketID: "7", UserID: "alice", At: at}, ""},
		{"unknown fields are ignored", with("entry", "1-1"), store.StreamEntry{Kind: store.KindGrant, PacketID: "7", UserID: "alice", Amount: 123, At: at}, ""},
		{"huge amount", with("amount", "9007199254740993"),
			store.StreamEntry{Kind: store.KindGrant, PacketID: "7", UserID: "alice", Amount: 9007199254740993, At: at}, ""},

		{"no fields", nil, store.StreamEntry{}, `field "kind" missing`},
		{"unknown kind", with("kind", "gift"), store.StreamEntry{}, `unknown kind "gift"`},
		{"no kind", without("kind"), store.StreamEntry{}, `field "kind" missing`},
		{"no packet", without("packet"), store.StreamEntry{}, `field "packet" missing`},
		{"no user", without("user"), store.StreamEntry{}, `field "user" missing`},
		{"no amount", without("amount"), store.StreamEntry{}, `field "amount" missing`},
		{"no at", without("at"), store.StreamEntry{}, `field "at" missing`},
		{"fractional amount", with("amount", "1.5"), store.StreamEntry{}, `amount "1.5" is not a non-negative integer`},
		{"negative amount", with("amount", "-1"), store.StreamEntry{}, `amount "-1" is not a non-negative integer`},
		{"amount beyond int64", with("amount", "9223372036854775808"), store.StreamEntry{}, "not a non-negative integer"},
		{"at not a number", with("at", "x"), store.StreamEntry{}, `at "x" is not unix milliseconds`},
		{"empty packet", with("packet", ""), store.StreamEntry{}, "empty packet or user"},
		{"empty user", with("user", ""), store.StreamEntry{}, "empty packet or user"},
		{"replayed without payload", map[string]string{"entry": "1-1"}, store.StreamEntry{}, `field "kind" missing`},

		// The packed grant grab.lua writes: its time is the entry id's.
		{"packed grant", map[string]string{"grant": "7:123:0:CNY:alice"},
			store.StreamEntry{Kind: store.KindGrant, PacketID: "7", UserID: "alice", Amount: 123, Currency: "CNY", At: at}, ""},
		{"packed grant, user id with colons", map[string]string{"grant": "7:123:0::a:b:"},
			store.StreamEntry{Kind: store.KindGrant, PacketID: "7", UserID: "a:b:", Amount: 123, At: at}, ""},
		{"packed grant, replayed with its time", map[string]string{"grant": "7:123:2:CNY:alice", "at": "0"},
			store.StreamEntry{Kind: store.KindGrant, PacketID: "7", UserID: "alice", Amount: 123, Currency: "CNY", At: time.UnixMilli(0).UTC()}, ""},
		{"packed grant, huge amount", map[string]string{"grant": "7:9007199254740993:0:CNY:alice"},
			store.StreamEntry{Kind: store.KindGrant, PacketID: "7", UserID: "alice", Amount: 9007199254740993, Currency: "CNY", At: at}, ""},
		{"packed grant without user", map[string]string{"grant": "7:123:0:alice"}, store.StreamEntry{}, "is not <packetId>:<amount>:<epoch>:<currency>:<userId>"},
		{"packed grant, bad amount", map[string]string{"grant": "7:-3:0:CNY:alice"}, store.StreamEntry{}, `amount "-3" is not a non-negative integer`},
		{"packed grant, empty packet", map[string]string{"grant": ":3:0:CNY:alice"}, store.StreamEntry{}, "empty packet or user"},
		{"packed grant, empty user", map[string]string{"grant": "7:3:0:CNY:"}, store.StreamEntry{}, "empty packet or user"},
		{"packed grant, bad at", map[string]string{"grant": "7:3:0:CNY:alice", "at": "soon"}, store.StreamEntry{}, `at "soon" is not unix milliseconds`},
		{"packed grant, bad epoch", map[string]string{"grant": "7:3:x:CNY:alice"}, store.StreamEntry{}, `epoch "x" is not a non-negative integer`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := store.DecodeStreamEntry("1767225600123-0", tc.fields)
			if e.ID != "1767225600123-0" || !maps.Equal(e.Fields, tc.fields) {
				t.Fatalf("id %q fields %v, want the entry's own", e.ID, e.Fields)
			}
			if tc.bad != "" {
				if e.Malformed == nil || !strings.Contains(e.Malformed.Error(), tc.bad) {
					t.Fatalf("malformed %v, want an error with %q", e.Malformed, tc.bad)
				}
				if e.Kind != "" || e.PacketID != "" || e.UserID != "" || e.Amount != 0 || !e.At.IsZero() {
					t.Fatalf("malformed entry carries decoded fields: %+v", e)
				}
				return
			}
			if e.Malformed != nil {
				t.Fatalf("malformed: %v", e.Malformed)
			}
			w := tc.want
			if e.Kind != w.Kind || e.PacketID != w.PacketID || e.UserID != w.UserID || e.Amount != w.Amount ||
				e.Currency != w.Currency || !e.At.Equal(w.At) {
				t.Fatalf("decoded %+v, want %+v", e, w)
			}
			if fv := e.FieldValues(); len(fv) != len(tc.fields) {
				t.Fatalf("field values %v, want %v", fv, tc.fields)
			}
		})
	}
}

// The consumer-group operations on a real server: a dead consumer's entry is taken
// over once idle, delivery counts follow every read and claim, held entries are kept
// from other consumers, and the pending count follows acknowledgements.
func TestConsumerGroupOperations(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	const group = "settlement"
	amounts := splitOrFail(t, split.TypeFixed, 600, 6)
	k := seedOpen(t, ctx, c, "group-ops", amounts)
	a := store.NewShard(c, "group-ops")

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
	a := store.NewShard(c, "paging")
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
	a := store.NewShard(rdb, "uid-replay")
	for _, u := range []string{"user-0000", "user-0001", "user-0002"} {
		grabOne(t, rdb, k, u)
	}
	if err := rdb.XGroupCreateMkStream(ctx, k.Stream, group, "0").Err(); err != nil {
		t.Fatalf("group: %v", err)
	}
	streams, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: group, Consumer: "c",
		Streams: []string{k.Stream, ">"}, Block: -1}).Result()
	if err != nil || len(streams[0].Messages) != 3 {
		t.Fatalf("read: %v, %v", streams, err)
	}
	orig := streams[0].Messages
	for _, m := range orig {
		ok, err := store.DeadLetter(ctx, rdb, k, group, m.ID, "HTTP 400", m.Values)
		if err != nil || !ok {
			t.Fatalf("dead letter: %v, %v", ok, err)
		}
	}
	snapshot := func() store.Snapshot {
		t.Helper()
		s, err := a.Snapshot(ctx)
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
	all, err := rdb.XRange(ctx, k.Stream, "-", "+").Result()
	if err != nil || len(all) != 5 {
		t.Fatalf("stream: %d entries, %v; want 3 + 2 replayed", len(all), err)
	}
	// A packed grant takes its time from its id, so its copy also carries the
	// original's time: it decodes to the same grant at the same instant.
	for i, m := range all[3:] {
		if len(m.Values) != len(orig[i].Values)+1 {
			t.Fatalf("replayed entry %v, original %v", m.Values, orig[i].Values)
		}
		for f, v := range orig[i].Values {
			if m.Values[f] != v {
				t.Fatalf("replayed entry %v, original %v", m.Values, orig[i].Values)
			}
		}
		got, want := store.DecodeMessages([]redis.XMessage{m})[0], store.DecodeMessages(orig[i : i+1])[0]
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

// The measurement helpers read what the benchmark reports.
func TestMeasurementHelpers(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	v, err := store.ServerVersion(ctx, c)
	if err != nil || !strings.Contains(v, ".") {
		t.Fatalf("server version %q, %v", v, err)
	}
	before, err := store.UsedMemory(ctx, c)
	if err != nil || before <= 0 {
		t.Fatalf("used memory %d, %v", before, err)
	}
	amounts := splitOrFail(t, split.TypeFixed, 100_000, 1_000)
	k := seedOpen(t, ctx, c, "measure", amounts)
	a := store.NewShard(c, "measure")
	grabOne(t, c, k, "m1")
	m, err := a.KeyMemory(ctx)
	if err != nil || m.Meta <= 0 || m.Packets <= 0 || m.Claims <= 0 || m.Stream <= 0 || m.Staging != 0 || m.DeadLetters != 0 {
		t.Fatalf("key memory %+v, %v", m, err)
	}
	if after, err := store.UsedMemory(ctx, c); err != nil || after <= before {
		t.Fatalf("used memory %d after seeding, %d before, %v", after, before, err)
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
	a := store.NewShard(c, "verify")
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
		xadd("kind", "grant", "packet", alice.PacketID, "user", "mallory", "amount", amount(alice.Amount), "at", "1"): "holds no packet",
		// Bob's entry for Alice's packet.
		xadd("kind", "grant", "packet", alice.PacketID, "user", "bob", "amount", amount(alice.Amount), "at", "1"): "whose claim is",
		// Alice's packet for more money.
		xadd("kind", "grant", "packet", alice.PacketID, "user", "alice", "amount", amount(alice.Amount+1), "at", "1"): "whose claim is",
		// A packet that does not exist, to Alice.
		xadd("kind", "grant", "packet", "no-such-packet", "user", "alice", "amount", amount(alice.Amount), "at", "1"): "whose claim is",
		// A refund of an open activity.
		xadd("kind", "refund", "packet", "refund", "user", sponsor, "amount", "5", "at", "1"): "not closed",
		// A verbatim copy of Bob's genuine entry: right user, packet and amount, but
		// not the entry his grant wrote (it would be credited and counted twice).
		xadd("kind", "grant", "packet", bob.PacketID, "user", "bob", "amount", amount(bob.Amount), "at", "1",
			"currency", "CNY"): "the one its grant wrote",
		// The same in the packed form grab.lua writes.
		xadd("grant", alice.PacketID+":"+amount(alice.Amount)+":0::mallory"): "holds no packet",
		xadd("grant", alice.PacketID+":"+amount(alice.Amount+1)+":0::alice"): "whose claim is",
		xadd("grant", alice.PacketID+":0"+amount(alice.Amount)+":0::alice"):  "whose claim is",
		xadd("grant", bob.PacketID+":"+amount(bob.Amount)+":0::bob"):         "the one its grant wrote",
	}
	malformed := xadd("kind", "gift")

	msgs, err := c.XRange(ctx, k.Stream, "-", "+").Result()
	if err != nil {
		t.Fatalf("xrange: %v", err)
	}
	var entries []store.StreamEntry
	for _, m := range msgs {
		f := map[string]string{}
		for name, v := range m.Values {
			f[name] = v.(string)
		}
		entries = append(entries, store.DecodeStreamEntry(m.ID, f))
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
	res, err := store.Close(ctx, c, k, store.CloseExpired)
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
	for i, tc := range cases {
		e := store.DecodeStreamEntry(fmt.Sprintf("%d-1", i+1), tc.fields)
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
	if err := a.Purge(ctx); err != nil {
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
		if res, err := store.Grab(ctx, c, k, "u"+strconv.Itoa(i)); err != nil || res.Outcome != store.Granted {
			b.Fatalf("grab: %+v, %v", res, err)
		}
	}
	a := store.NewShard(c, "verify-bench")
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
	a := store.NewShard(c, "purged")
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
	if _, err := a.PurgeKeepingUnsettled(ctx, time.Hour); err != nil {
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
