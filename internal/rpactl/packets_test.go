package rpactl

import (
	"bytes"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"k8s.io/apimachinery/pkg/types"

	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// A budget is named rpb/NAME (or by its kind's names) for replay-dead-letters; an
// activity's name, with or without a slash of another kind, is not a budget.
func TestBudgetArg(t *testing.T) {
	for arg, want := range map[string]string{"rpb/group": "group", "redpacketbudget/g": "g", "RedPacketBudgets/x": "x",
		"redpacketbudget.redpacket.io/y": "y", "quiz-night": "", "rpa/quiz": "", "rpb/": ""} {
		got, ok := budgetArg(arg)
		if got != want || ok != (want != "") {
			t.Errorf("budgetArg(%q) = %q, %v; want %q", arg, got, ok, want)
		}
	}
}

// The plugin reads what it needs of a budget without its Go type, with the
// defaults: currency CNY, one shard, the sender Secret "<budget>-sender".
func TestBudgetViewOf(t *testing.T) {
	u := &unstructured.Unstructured{Object: map[string]any{
		"metadata": map[string]any{"name": "group", "namespace": "shop", "uid": "u-1"},
		"spec":     map[string]any{"budgetShards": int64(16), "redis": map[string]any{"secretRef": map[string]any{"name": "redis"}}},
		"status": map[string]any{"total": int64(1000), "available": int64(400), "inPackets": int64(300), "claimed": int64(200),
			"refunded": int64(100), "livePackets": int64(3)},
	}}
	b := budgetViewOf(u)
	if b.UID != "u-1" || b.Shards != 16 || b.Currency != "CNY" || b.RedisSecret != "redis" || b.SenderSecret != "group-sender" ||
		b.Total != 1000 || b.InPackets != 300 || b.LivePackets != 3 {
		t.Fatalf("view %+v", b)
	}
	var out bytes.Buffer
	if err := PrintBudgetMoney(&out, b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "Invariant:   OK: available + in packets + claimed + refunded = 400 + 300 + 200 + 100 = 1000, total 1000") {
		t.Errorf("money table:\n%s", out.String())
	}
	b.Refunded++
	out.Reset()
	_ = PrintBudgetMoney(&out, b)
	if !strings.Contains(out.String(), "VIOLATED") {
		t.Errorf("a budget that does not add up printed:\n%s", out.String())
	}
}

// grabServer is the real grab service's packet API (grabsvc.PacketServer) on budget
// uid over a real redis-server (conn), with the sender credential token.
func grabServer(t *testing.T, conn redisconn.Conn, uid string, shards int, token string) *httptest.Server {
	t.Helper()
	return grabServerWithTokens(t, conn, uid, shards, token, nil)
}

// grabServerWithTokens is grabServer for a budget with user tokens (tokens nil: none).
func grabServerWithTokens(t *testing.T, conn redisconn.Conn, uid string, shards int, token string, tokens *grabsvc.TokenVerifier) *httptest.Server {
	t.Helper()
	rc, err := conn.NewPipelinedClient(redisconn.GrabClientOptions(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	sender, err := grabsvc.NewSenderCredential([]byte(token))
	if err != nil {
		t.Fatal(err)
	}
	srv, err := grabsvc.NewPacketServer(grabsvc.PacketConfig{
		Budget: grabsvc.Budget{Namespace: "shop", Name: "group-packets", UID: types.UID(uid), Shards: shards},
		Redis:  rc.Pipeliner, Ping: rc.Client, Sender: sender, Tokens: tokens, RedisTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(hs.Close)
	return hs
}

// The plugin's packet client against the packet API served from a real budget:
// send creates a packet with the sender credential and is idempotent by id, another
// body under the id is refused with the service's code, packet shows who got what
// in grab order with granted + left = total, packets lists the live ones with the
// sender credential, and a server that does not list says so. The server is the
// real grab service's packet API.
func TestPacketsClientAgainstARealBudget(t *testing.T) {
	ctx := t.Context()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	if _, err := lua.GrabLibrary.Ensure(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	b := store.NewBudget(rdb, "budget-plugin", 4)
	if err := b.Configure(ctx, 100_000, store.BudgetLimits{Currency: "CNY", MaxTotal: 10_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeRandom, split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	hs := grabServer(t, srv.Conn(), "budget-plugin", 4, "sender-secret-token")
	c := PacketsClient{BaseURL: hs.URL, HTTP: hs.Client()}

	req := SendRequest{ID: "order-1", Sender: "merchant-7", TotalAmount: 1000, Count: 5, Distribution: split.TypeFixed, TTLSeconds: 600}
	if _, err := c.Send(ctx, "wrong-token", req); err == nil || !strings.Contains(err.Error(), "unauthorized") {
		t.Fatalf("a send with a wrong credential: %v", err)
	}
	p, err := c.Send(ctx, "sender-secret-token", req)
	if err != nil || p.Outcome != "created" || p.TotalAmount != 1000 || p.RemainingCount != 5 {
		t.Fatalf("send: %+v, %v", p, err)
	}
	if p, err := c.Send(ctx, "sender-secret-token", req); err != nil || p.Outcome != "existing" {
		t.Fatalf("the same send again: %+v, %v", p, err)
	}
	other := req
	other.TotalAmount = 900
	if _, err := c.Send(ctx, "sender-secret-token", other); err == nil || !strings.Contains(err.Error(), "409") || !strings.Contains(err.Error(), "conflict") {
		t.Fatalf("another body under the same id: %v", err)
	}
	for _, u := range []string{"alice", "bob"} {
		if _, err := b.GrabPacket(ctx, "order-1", u); err != nil {
			t.Fatal(err)
		}
	}
	p, err = c.Packet(ctx, "order-1", "")
	if err != nil || len(p.Grabs) != 2 || p.Grabs[0].UserID != "alice" || p.Grabs[1].UserID != "bob" || p.RemainingCount != 3 {
		t.Fatalf("packet: %+v, %v", p, err)
	}
	var out bytes.Buffer
	if err := PrintPacket(&out, p, time.Now()); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"0       alice   200", "1       bob     200", "Granted:        400 in 2 shares; granted + left = 1000, total 1000"} {
		if !strings.Contains(strings.Join(strings.Fields(out.String()), " "), strings.Join(strings.Fields(want), " ")) {
			t.Errorf("packet detail lacks %q:\n%s", want, out.String())
		}
	}
	if _, err := c.Packet(ctx, "order-404", ""); err == nil || !strings.Contains(err.Error(), "not_found") {
		t.Errorf("a missing packet: %v", err)
	}

	// The same budget served with user tokens shows the packet only to the sender
	// credential (as kubectl rpa packet sends it then), never to a bare read.
	verifier, err := grabsvc.NewTokenVerifier([]byte("user-token-key"))
	if err != nil {
		t.Fatal(err)
	}
	authed := PacketsClient{BaseURL: grabServerWithTokens(t, srv.Conn(), "budget-plugin", 4, "sender-secret-token", verifier).URL, HTTP: hs.Client()}
	if _, err := authed.Packet(ctx, "order-1", ""); err == nil || !strings.Contains(err.Error(), "unauthorized") {
		t.Errorf("a bare read of a budget with user tokens: %v, want unauthorized", err)
	}
	if p, err := authed.Packet(ctx, "order-1", "sender-secret-token"); err != nil || len(p.Grabs) != 2 {
		t.Errorf("a read with the sender credential: %+v, %v", p, err)
	}

	if _, err := c.Send(ctx, "sender-secret-token", SendRequest{ID: "order-2", Sender: "merchant-7", TotalAmount: 300, Count: 3}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Live(ctx, "wrong-token", 100); err == nil || !strings.Contains(err.Error(), "unauthorized") {
		t.Fatalf("a listing with a wrong credential: %v", err)
	}
	live, err := c.Live(ctx, "sender-secret-token", 100)
	if err != nil || len(live) != 2 {
		t.Fatalf("live packets: %+v, %v", live, err)
	}
	out.Reset()
	if err := PrintPackets(&out, live, "CNY", time.Now()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "2 live packets listed, 900 (9.00 CNY) left in them") {
		t.Errorf("packets table:\n%s", out.String())
	}

	// Exhaust order-2: the list says so, and --state keeps one state or the other.
	for _, u := range []string{"carol", "dan", "erin"} {
		if _, err := b.GrabPacket(ctx, "order-2", u); err != nil {
			t.Fatal(err)
		}
	}
	if live, err = c.Live(ctx, "sender-secret-token", 100); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		states []string
		want   string
	}{{[]string{"exhausted"}, "order-2"}, {[]string{"live"}, "order-1"}, {nil, "order-1,order-2"}, {[]string{"live", "exhausted"}, "order-1,order-2"}} {
		wanted, err := checkStates(tc.states)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, p := range FilterPackets(live, wanted) {
			ids = append(ids, p.ID)
		}
		if got := strings.Join(ids, ","); got != tc.want {
			t.Errorf("--state %v: %s, want %s", tc.states, got, tc.want)
		}
	}
	if _, err := checkStates([]string{"refunded"}); err == nil || !strings.Contains(err.Error(), "kubectl rpa packet") {
		t.Errorf("--state refunded: %v, want a refusal that says where refunded packets are read", err)
	}
	out.Reset()
	if err := PrintPackets(&out, FilterPackets(live, map[string]bool{"exhausted": true}), "CNY", time.Now()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(strings.Fields(out.String()), " "), "order-2 merchant-7 exhausted 300 0 0/3") {
		t.Errorf("packets table with the state:\n%s", out.String())
	}
	p, err = c.Packet(ctx, "order-2", "")
	if err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := PrintPacket(&out, p, time.Now()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "exhausted at "+p.Grabs[2].At+": every share grabbed") {
		t.Errorf("packet detail of an exhausted packet:\n%s", out.String())
	}

	notGrab := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(notGrab.Close)
	noList := PacketsClient{BaseURL: notGrab.URL, HTTP: hs.Client()}
	if _, err := noList.Live(ctx, "sender-secret-token", 10); !errors.Is(err, ErrNoListing) {
		t.Errorf("a server that does not list: %v, want ErrNoListing", err)
	}
}

// A budget's dead letters, parked by the settlement workers' own script in two
// shards, go back into their shards' streams with their fields, the dead-letter
// streams empty and each shard's dead count back to zero; --max bounds how many.
func TestReplayBudgetDeadLetters(t *testing.T) {
	ctx := t.Context()
	rdb := redistest.Start(t).Client(t)
	b := store.NewBudget(rdb, "budget-replay", 2)
	if err := b.Configure(ctx, 10_000, store.BudgetLimits{Currency: "CNY", MaxTotal: 1000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeRandom}, DefaultTTL: time.Hour, MaxTTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	parked := 0
	for i := range b.N() {
		sh := b.Stream(i)
		if err := sh.EnsureGroup(ctx, "settlement"); err != nil {
			t.Fatal(err)
		}
		for n := range 3 {
			grant := "p-" + strconv.Itoa(i) + "/" + strconv.Itoa(n) + ":100:0:CNY:user-" + strconv.Itoa(n)
			if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: b.ShardKeys(i).Stream, Values: []string{"grant", grant}}).Err(); err != nil {
				t.Fatal(err)
			}
		}
		entries, err := sh.ReadNew(ctx, "settlement", "op", 10, time.Millisecond)
		if err != nil || len(entries) != 3 {
			t.Fatalf("shard %d: read %d entries, %v", i, len(entries), err)
		}
		for _, e := range entries {
			ok, err := sh.DeadLetter(ctx, "settlement", e.ID, "webhook answered 500", e.FieldValues())
			if err != nil || !ok {
				t.Fatalf("parking %s: %v, %v", e.ID, ok, err)
			}
			parked++
		}
	}
	if n, err := ReplayBudgetDeadLetters(ctx, b, 2); err != nil || n != 2 {
		t.Fatalf("replaying at most 2: %d, %v", n, err)
	}
	if n, err := ReplayBudgetDeadLetters(ctx, b, 0); err != nil || n != parked-2 {
		t.Fatalf("replaying the rest: %d, %v; want %d", n, err, parked-2)
	}
	snap, err := b.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if snap.DeadLetters != 0 {
		t.Errorf("%d dead letters counted after the replay", snap.DeadLetters)
	}
	for i := range b.N() {
		dead, err := b.Stream(i).DeadLetters(ctx)
		if err != nil || len(dead) != 0 {
			t.Errorf("shard %d: %d dead letters left, %v", i, len(dead), err)
		}
		all, err := b.Stream(i).Entries(ctx)
		if err != nil || len(all) != 6 {
			t.Fatalf("shard %d: %d entries, %v; want the 3 written and the 3 replayed", i, len(all), err)
		}
		for _, e := range all[3:] {
			if e.Malformed != nil || e.Kind != store.KindGrant || !strings.HasPrefix(e.PacketID, "p-"+strconv.Itoa(i)+"/") || e.Amount != 100 {
				t.Errorf("shard %d: replayed entry %+v", i, e)
			}
		}
	}
}
