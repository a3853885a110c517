package grabsvc

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// senderSecret is the sender credential of the test budgets.
const senderSecret = "s3nder-credential"

// packetLimits are the test budgets' spec.packets.
func packetLimits() store.BudgetLimits {
	return store.BudgetLimits{Currency: "CNY", MaxTotal: 20_000, MaxCount: 10, MinShare: 1,
		Distributions: []string{split.TypeRandom, split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
}

// packetHarness is a budget's PacketServer on a real redis-server behind an httptest
// listener, the budget of shards shards configured with total and packetLimits (each
// shard is allotted its part of total, and a packet draws from its own shard's).
type packetHarness struct {
	t       testing.TB
	redis   *redistest.Server
	admin   *redis.Client
	budget  Budget
	handle  *store.Budget // on the admin client
	srv     *PacketServer
	http    *httptest.Server
	metrics *PacketMetrics
}

func newPacketHarness(t testing.TB, total int64, shards int, opts ...func(*PacketConfig)) *packetHarness {
	t.Helper()
	h := &packetHarness{t: t, redis: redistest.Start(t)}
	h.admin = h.redis.Client(t)
	h.budget = Budget{Namespace: "shop", Name: "group-packets", UID: types.UID(uuid.NewUUID()), Shards: shards}
	h.handle = store.NewBudget(h.admin, string(h.budget.UID), h.budget.Shards)
	if err := h.handle.Configure(context.Background(), total, packetLimits()); err != nil {
		t.Fatalf("configuring the budget: %v", err)
	}
	rc, err := h.redis.Conn().NewPipelinedClient(redisconn.GrabClientOptions(time.Second))
	if err != nil {
		t.Fatalf("redis clients: %v", err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	sender, err := NewSenderCredential([]byte(senderSecret))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	h.metrics = NewPacketMetrics(reg)
	cfg := PacketConfig{Budget: h.budget, Redis: rc.Pipeliner, Ping: rc.Client, Sender: sender,
		RedisTimeout: time.Second, Metrics: h.metrics, Gatherer: reg, Page: true}
	for _, o := range opts {
		o(&cfg)
	}
	if h.srv, err = NewPacketServer(cfg); err != nil {
		t.Fatalf("packet server: %v", err)
	}
	h.http = httptest.NewServer(h.srv.Handler())
	t.Cleanup(h.http.Close)
	return h
}

// answer is any answer of the packet API, decoded loosely.
type answer struct {
	Status int
	Header http.Header
	Raw    string
	Body   map[string]any
}

func (a answer) str(k string) string { s, _ := a.Body[k].(string); return s }
func (a answer) num(k string) int64 {
	f, ok := a.Body[k].(float64)
	if !ok {
		return -1
	}
	return int64(f)
}

func (h *packetHarness) do(method, path, body string, header map[string]string) answer {
	h.t.Helper()
	req, err := http.NewRequest(method, h.http.URL+path, strings.NewReader(body))
	if err != nil {
		h.t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		h.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	a := answer{Status: resp.StatusCode, Header: resp.Header, Raw: string(raw)}
	if method != http.MethodHead {
		if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
			h.t.Fatalf("%s %s: Content-Type %q, body %s", method, path, ct, raw)
		}
		if err := json.Unmarshal(raw, &a.Body); err != nil {
			h.t.Fatalf("%s %s: body %q is not a JSON object: %v", method, path, raw, err)
		}
	}
	return a
}

var asSender = map[string]string{"Authorization": "Bearer " + senderSecret}

func (h *packetHarness) create(body string) answer {
	h.t.Helper()
	return h.do(http.MethodPost, "/v1/packets", body, asSender)
}

func (h *packetHarness) grab(id, user string, header map[string]string) answer {
	h.t.Helper()
	return h.do(http.MethodPost, "/v1/packets/"+id+"/grab", fmt.Sprintf(`{"userId":%q}`, user), header)
}

// commands is how many commands the server has processed, minus those of the
// reading itself, so that two readings around a request differ by the request's.
func (h *packetHarness) commands() int64 {
	h.t.Helper()
	read := func() int64 {
		info, err := h.admin.Info(context.Background(), "stats").Result()
		if err != nil {
			h.t.Fatalf("info stats: %v", err)
		}
		for _, line := range strings.Split(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "total_commands_processed:"); ok {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					h.t.Fatal(err)
				}
				return n
			}
		}
		h.t.Fatal("no total_commands_processed")
		return 0
	}
	return read()
}

// dump is every key of the server with its DUMP.
func (h *packetHarness) dump() map[string]string {
	h.t.Helper()
	ctx := context.Background()
	keys, err := h.admin.Keys(ctx, "*").Result()
	if err != nil {
		h.t.Fatal(err)
	}
	out := make(map[string]string, len(keys))
	for _, k := range keys {
		v, err := h.admin.Dump(ctx, k).Result()
		if err != nil {
			h.t.Fatalf("DUMP %s: %v", k, err)
		}
		out[k] = v
	}
	return out
}

// conserved fails unless the budget's money adds up; it returns the snapshot.
func (h *packetHarness) conserved() store.BudgetSnapshot {
	h.t.Helper()
	snap, err := h.handle.Snapshot(context.Background())
	if err != nil {
		h.t.Fatal(err)
	}
	if !snap.Conserved() {
		h.t.Fatalf("the budget does not add up: %+v", snap)
	}
	return snap
}

// TestPacketCreateGrabDetail is seed 004's group packet through HTTP: the sender's
// backend creates a packet, a repeat of the creation answers the same packet, five
// users take its five shares, a repeat grab answers the same share, the sixth user
// finds it sold out, and the detail list shows who got what in grab order, summing
// to the packet's total.
func TestPacketCreateGrabDetail(t *testing.T) {
	h := newPacketHarness(t, 100_000, 4)
	body := `{"id":"order-1001","sender":"merchant-7","totalAmount":1000,"count":5,"distribution":"Random","ttlSeconds":600}`
	c := h.create(body)
	if c.Status != http.StatusCreated || c.str("outcome") != "created" || c.str("id") != "order-1001" ||
		c.num("totalAmount") != 1000 || c.num("count") != 5 || c.num("remainingAmount") != 1000 || c.num("remainingCount") != 5 ||
		c.str("sender") != "merchant-7" || c.str("currency") != "CNY" || c.str("distribution") != "Random" {
		t.Fatalf("create: %d %s", c.Status, c.Raw)
	}
	t.Logf("created: %d %s", c.Status, strings.TrimSpace(c.Raw))
	created, err1 := time.Parse(time.RFC3339, c.str("createdAt"))
	expires, err2 := time.Parse(time.RFC3339, c.str("expiresAt"))
	if err1 != nil || err2 != nil || expires.Sub(created) != 10*time.Minute {
		t.Fatalf("createdAt %q, expiresAt %q: want 600 s apart", c.str("createdAt"), c.str("expiresAt"))
	}
	if snap := h.conserved(); snap.Available != 100_000-1000 || snap.Live != 1000 || snap.LivePackets != 1 {
		t.Fatalf("after the creation: %+v", snap)
	}
	again := h.create(body)
	if again.Status != http.StatusOK || again.str("outcome") != "existing" || again.str("expiresAt") != c.str("expiresAt") {
		t.Fatalf("identical repeat: %d %s", again.Status, again.Raw)
	}
	if snap := h.conserved(); snap.Available != 100_000-1000 {
		t.Fatalf("a repeat drew money again: %+v", snap)
	}

	var sum int64
	amounts := map[string]int64{}
	for i := range 5 {
		user := fmt.Sprintf("friend-%d", i)
		g := h.grab("order-1001", user, nil)
		if g.Status != http.StatusOK || g.str("outcome") != "granted" || g.num("share") != int64(i) || g.num("amount") < 1 ||
			g.str("packetId") != "order-1001" {
			t.Fatalf("grab %d: %d %s", i, g.Status, g.Raw)
		}
		amounts[user] = g.num("amount")
		t.Logf("grab: %d %s", g.Status, strings.TrimSpace(g.Raw))
		sum += g.num("amount")
	}
	if sum != 1000 {
		t.Fatalf("the five shares sum to %d, want 1000", sum)
	}
	if g := h.grab("order-1001", "friend-2", nil); g.Status != http.StatusOK || g.str("outcome") != "already_claimed" ||
		g.num("share") != 2 || g.num("amount") != amounts["friend-2"] {
		t.Fatalf("repeat grab: %d %s, want share 2 of %d", g.Status, g.Raw, amounts["friend-2"])
	}
	if g := h.grab("order-1001", "late-friend", nil); g.Status != http.StatusConflict || g.str("outcome") != "sold_out" {
		t.Fatalf("sixth user: %d %s", g.Status, g.Raw)
	}
	if g := h.grab("order-404", "friend-0", nil); g.Status != http.StatusNotFound || g.str("outcome") != OutcomeNotFound {
		t.Fatalf("grab of a packet never created: %d %s", g.Status, g.Raw)
	}

	d := h.do(http.MethodGet, "/v1/packets/order-1001", "", nil)
	t.Logf("detail: %d %s", d.Status, strings.TrimSpace(d.Raw))
	var detail PacketDetailView
	if err := json.Unmarshal([]byte(d.Raw), &detail); err != nil || d.Status != http.StatusOK {
		t.Fatalf("detail: %d %s", d.Status, d.Raw)
	}
	if detail.RemainingCount != 0 || detail.RemainingAmount != 0 || len(detail.Grabs) != 5 || detail.Expired {
		t.Fatalf("detail: %s", d.Raw)
	}
	for i, g := range detail.Grabs {
		if g.Share != i || g.UserID != fmt.Sprintf("friend-%d", i) || g.Amount != amounts[g.UserID] || g.At == "" {
			t.Fatalf("detail list entry %d: %+v, want friend-%d's share of %d", i, g, i, amounts[g.UserID])
		}
	}
	if snap := h.conserved(); snap.Claimed != 1000 || snap.Live != 0 || snap.GrabbedShares != 5 {
		t.Fatalf("after the five grabs: %+v", snap)
	}
	if d := h.do(http.MethodGet, "/v1/packets/order-404", "", nil); d.Status != http.StatusNotFound || d.str("error") != OutcomeNotFound {
		t.Fatalf("detail of a packet never created: %d %s", d.Status, d.Raw)
	}

	for _, m := range []struct {
		c    prometheus.Collector
		want float64
	}{
		{h.metrics.Creates.WithLabelValues("created"), 1},
		{h.metrics.Creates.WithLabelValues("existing"), 1},
		{h.metrics.Grabs.WithLabelValues("granted"), 5},
		{h.metrics.Grabs.WithLabelValues("already_claimed"), 1},
		{h.metrics.Grabs.WithLabelValues("sold_out"), 1},
		{h.metrics.Grabs.WithLabelValues(OutcomeNotFound), 1},
		{h.metrics.CreatedAmount, 1000},
		{h.metrics.GrantedAmount, 1000},
	} {
		if got := testutil.ToFloat64(m.c); got != m.want {
			t.Errorf("metric %v = %v, want %v", m.c, got, m.want)
		}
	}
	if m := h.do(http.MethodGet, "/readyz", "", nil); m.Status != http.StatusOK {
		t.Errorf("readyz: %d %s", m.Status, m.Raw)
	}
}

// TestPacketExpired: once its time is up a packet answers expired (409) to a new
// user and still answers its share to a user who got one; after the operator's
// expiry the detail says expired and the remainder went back to the budget's
// refunded money.
func TestPacketExpired(t *testing.T) {
	h := newPacketHarness(t, 10_000, 1)
	if a := h.create(`{"id":"short","sender":"m","totalAmount":300,"count":3,"ttlSeconds":1}`); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	first := h.grab("short", "u-1", nil)
	if first.str("outcome") != "granted" {
		t.Fatalf("grab: %s", first.Raw)
	}
	time.Sleep(1100 * time.Millisecond)
	if a := h.grab("short", "u-2", nil); a.Status != http.StatusConflict || a.str("outcome") != OutcomeExpired {
		t.Fatalf("grab after the expiry time: %d %s", a.Status, a.Raw)
	}
	if a := h.grab("short", "u-1", nil); a.Status != http.StatusOK || a.str("outcome") != "already_claimed" || a.num("amount") != first.num("amount") {
		t.Fatalf("repeat grab after the expiry time: %d %s", a.Status, a.Raw)
	}
	n, refunded, err := h.handle.ExpireDue(context.Background(), 0, 10)
	if err != nil || n != 1 || refunded != 300-first.num("amount") {
		t.Fatalf("expiry: %d packets, %d refunded, %v", n, refunded, err)
	}
	d := h.do(http.MethodGet, "/v1/packets/short", "", nil)
	if d.Status != http.StatusOK || d.Body["expired"] != true {
		t.Fatalf("detail after the expiry: %d %s", d.Status, d.Raw)
	}
	if snap := h.conserved(); snap.Refunded != refunded || snap.Claimed != first.num("amount") {
		t.Fatalf("after the expiry: %+v", snap)
	}
}

// TestPacketCreateIdempotentUnderRace: twenty concurrent identical creations create
// one packet (one 201, the others 200 with the same packet) and draw its money once;
// the same id with another body is a 409 conflict that changes nothing.
func TestPacketCreateIdempotentUnderRace(t *testing.T) {
	h := newPacketHarness(t, 50_000, 4)
	body := `{"id":"order-77","sender":"merchant-1","totalAmount":888,"count":8,"distribution":"Fixed"}`
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		status  = map[int]int{}
		expires = map[string]bool{}
	)
	for range 20 {
		wg.Go(func() {
			a := h.create(body)
			mu.Lock()
			defer mu.Unlock()
			status[a.Status]++
			expires[a.str("expiresAt")] = true
		})
	}
	wg.Wait()
	if status[http.StatusCreated] != 1 || status[http.StatusOK] != 19 || len(expires) != 1 {
		t.Fatalf("statuses %v, expiries %v: want one 201 and nineteen 200 of one packet", status, expires)
	}
	if snap := h.conserved(); snap.Available != 50_000-888 || snap.CreatedPackets != 1 {
		t.Fatalf("after the race: %+v", snap)
	}
	before := h.dump()
	for _, other := range []string{
		`{"id":"order-77","sender":"merchant-1","totalAmount":889,"count":8,"distribution":"Fixed"}`,
		`{"id":"order-77","sender":"merchant-2","totalAmount":888,"count":8,"distribution":"Fixed"}`,
		`{"id":"order-77","sender":"merchant-1","totalAmount":888,"count":8,"distribution":"Random"}`,
		`{"id":"order-77","sender":"merchant-1","totalAmount":888,"count":8,"distribution":"Fixed","ttlSeconds":60}`,
	} {
		if a := h.create(other); a.Status != http.StatusConflict || a.str("error") != "conflict" || a.str("message") == "" {
			t.Errorf("%s: %d %s, want 409 conflict", other, a.Status, a.Raw)
		}
	}
	if !maps.Equal(before, h.dump()) {
		t.Fatal("a conflicting creation changed Redis")
	}
}

// TestPacketRefusalsChangeNothing: every 4xx of the packet API leaves Redis exactly
// as it was (every key's DUMP), and those the service decides alone (credential,
// method, body, ids) send Redis no command at all.
func TestPacketRefusalsChangeNothing(t *testing.T) {
	h := newPacketHarness(t, 3000, 1)
	// A packet to grab and conflict with, and most of the budget drawn.
	if a := h.create(`{"id":"p-1","sender":"m","totalAmount":2500,"count":5}`); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	if a := h.grab("p-1", "u-1", nil); a.str("outcome") != "granted" {
		t.Fatalf("grab: %s", a.Raw)
	}
	long := strings.Repeat("x", 65)
	cases := []struct {
		name, method, path, body string
		header                   map[string]string
		status                   int
		code                     string // the "error" of create and detail, the "outcome" of a grab
		local                    bool   // decided without Redis
	}{
		{"no credential", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":10,"count":1}`, nil, 401, "unauthorized", true},
		{"wrong credential", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":10,"count":1}`,
			map[string]string{"Authorization": "Bearer " + senderSecret + "x"}, 401, "unauthorized", true},
		{"credential not bearer", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":10,"count":1}`,
			map[string]string{"Authorization": "Basic " + senderSecret}, 401, "unauthorized", true},
		{"PUT on create", "PUT", "/v1/packets", "", asSender, 405, "invalid_request", true},
		{"list without credential", "GET", "/v1/packets", "", nil, 401, "unauthorized", true},
		{"list with a bad limit", "GET", "/v1/packets?limit=1000", "", asSender, 400, "invalid_request", true},
		{"empty body", "POST", "/v1/packets", "", asSender, 400, "invalid_request", true},
		{"not JSON", "POST", "/v1/packets", `{"id":`, asSender, 400, "invalid_request", true},
		{"an array", "POST", "/v1/packets", `[1]`, asSender, 400, "invalid_request", true},
		{"unknown field", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":10,"count":1,"memo":"x"}`, asSender, 400, "invalid_request", true},
		{"two objects", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":10,"count":1}{}`, asSender, 400, "invalid_request", true},
		{"no id", "POST", "/v1/packets", `{"sender":"m","totalAmount":10,"count":1}`, asSender, 400, "invalid_request", true},
		{"no sender", "POST", "/v1/packets", `{"id":"p-2","totalAmount":10,"count":1}`, asSender, 400, "invalid_request", true},
		{"no count", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":10}`, asSender, 400, "invalid_request", true},
		{"fractional amount", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":10.5,"count":1}`, asSender, 400, "invalid_request", true},
		{"amount as string", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":"10","count":1}`, asSender, 400, "invalid_request", true},
		{"zero amount", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":0,"count":1}`, asSender, 400, "invalid_request", true},
		{"more shares than minor units", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":3,"count":4}`, asSender, 400, "invalid_request", true},
		{"too many shares", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":100000,"count":1001}`, asSender, 400, "invalid_request", true},
		{"id with a slash", "POST", "/v1/packets", `{"id":"a/b","sender":"m","totalAmount":10,"count":1}`, asSender, 400, "invalid_request", true},
		{"id too long", "POST", "/v1/packets", `{"id":"` + long + `","sender":"m","totalAmount":10,"count":1}`, asSender, 400, "invalid_request", true},
		{"empty sender", "POST", "/v1/packets", `{"id":"p-2","sender":"","totalAmount":10,"count":1}`, asSender, 400, "invalid_request", true},
		{"unknown distribution", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":10,"count":1,"distribution":"Even"}`, asSender, 400, "invalid_request", true},
		{"negative ttl", "POST", "/v1/packets", `{"id":"p-2","sender":"m","totalAmount":10,"count":1,"ttlSeconds":-1}`, asSender, 400, "invalid_request", true},
		{"body too large", "POST", "/v1/packets", `{"id":"p-2","sender":"` + strings.Repeat("m", MaxBodyBytes) + `"}`, asSender, 413, "invalid_request", true},
		// Decided by the create function, which writes nothing when it refuses.
		{"budget exhausted", "POST", "/v1/packets", `{"id":"p-3","sender":"m","totalAmount":600,"count":2}`, asSender, 409, "budget_exhausted", false},
		{"above maxCount", "POST", "/v1/packets", `{"id":"p-3","sender":"m","totalAmount":100,"count":11}`, asSender, 422, "limit_exceeded", false},
		{"above maxTotal", "POST", "/v1/packets", `{"id":"p-3","sender":"m","totalAmount":20001,"count":2}`, asSender, 422, "limit_exceeded", false},
		{"distribution not allowed", "POST", "/v1/packets", `{"id":"p-3","sender":"m","totalAmount":100,"count":2,"distribution":"LineCut"}`, asSender, 422, "limit_exceeded", false},
		{"above maxTTL", "POST", "/v1/packets", `{"id":"p-3","sender":"m","totalAmount":100,"count":2,"ttlSeconds":86401}`, asSender, 422, "limit_exceeded", false},
		{"conflict", "POST", "/v1/packets", `{"id":"p-1","sender":"m","totalAmount":2400,"count":5}`, asSender, 409, "conflict", false},
		// Grabs.
		{"GET on grab", "GET", "/v1/packets/p-1/grab", "", nil, 405, "invalid_request", true},
		{"grab without body", "POST", "/v1/packets/p-1/grab", "", nil, 400, "invalid_request", true},
		{"grab with empty user", "POST", "/v1/packets/p-1/grab", `{"userId":""}`, nil, 400, "invalid_request", true},
		{"grab with extra field", "POST", "/v1/packets/p-1/grab", `{"userId":"u-2","x":1}`, nil, 400, "invalid_request", true},
		{"grab of a bad id", "POST", "/v1/packets/-p/grab", `{"userId":"u-2"}`, nil, 400, "invalid_request", true},
		{"grab of a missing packet", "POST", "/v1/packets/p-9/grab", `{"userId":"u-2"}`, nil, 404, "not_found", false},
		// Details.
		{"POST on detail", "POST", "/v1/packets/p-1", "{}", nil, 405, "invalid_request", true},
		{"detail of a bad id", "GET", "/v1/packets/_p", "", nil, 400, "invalid_request", true},
		{"detail of a missing packet", "GET", "/v1/packets/p-9", "", nil, 404, "not_found", false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before, cmds := h.dump(), h.commands()
			overhead := h.commands() - cmds // the reading itself
			cmds += overhead
			a := h.do(tc.method, tc.path, tc.body, tc.header)
			sent := h.commands() - cmds - overhead
			code := a.str("error")
			if strings.HasSuffix(tc.path, "/grab") {
				code = a.str("outcome")
			}
			if a.Status != tc.status || code != tc.code {
				t.Fatalf("%d %s, want %d %s", a.Status, a.Raw, tc.status, tc.code)
			}
			if tc.status == 401 && a.Header.Get("WWW-Authenticate") == "" {
				t.Error("a 401 without WWW-Authenticate")
			}
			if !maps.Equal(before, h.dump()) {
				t.Fatal("the refusal changed Redis")
			}
			if tc.local && sent != 0 {
				t.Fatalf("a refusal decided without Redis sent it %d commands", sent)
			}
			t.Logf("%d %s", a.Status, strings.TrimSpace(a.Raw))
		})
	}
	if snap := h.conserved(); snap.Available != 500 || snap.CreatedPackets != 1 {
		t.Fatalf("after the refusals: %+v", snap)
	}
}

// TestPacketRedisOutage: with Redis gone, creation, grabs and details answer 503
// unavailable within the Redis deadline, and /readyz fails.
func TestPacketRedisOutage(t *testing.T) {
	h := newPacketHarness(t, 10_000, 4)
	if a := h.create(`{"id":"before","sender":"m","totalAmount":100,"count":2}`); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	if err := h.redis.Kill(); err != nil {
		t.Fatal(err)
	}
	for _, r := range []struct{ method, path, body string }{
		{"POST", "/v1/packets", `{"id":"during","sender":"m","totalAmount":100,"count":2}`},
		{"POST", "/v1/packets/before/grab", `{"userId":"u-1"}`},
		{"GET", "/v1/packets/before", ""},
	} {
		start := time.Now()
		a := h.do(r.method, r.path, r.body, asSender)
		took := time.Since(start)
		code := a.str("error")
		if strings.HasSuffix(r.path, "/grab") {
			code = a.str("outcome")
		}
		if a.Status != http.StatusServiceUnavailable || code != OutcomeUnavailable || took > 3*time.Second {
			t.Errorf("%s %s with Redis down: %d %s after %s", r.method, r.path, a.Status, a.Raw, took)
		}
		t.Logf("%s %s: %d %s (%s)", r.method, r.path, a.Status, strings.TrimSpace(a.Raw), took.Round(time.Millisecond))
	}
	if a := h.do(http.MethodGet, "/readyz", "", nil); a.Status != http.StatusServiceUnavailable {
		t.Errorf("readyz with Redis down: %d %s", a.Status, a.Raw)
	}
	if got := testutil.ToFloat64(h.metrics.RedisErrors.WithLabelValues("create")); got != 1 {
		t.Errorf("redis errors of create: %v", got)
	}
}

// newTokenPacketHarness is a packet harness whose budget takes user tokens signed
// with key, holding one packet per id created with the body fields (JSON members
// after the id), and a function that makes the Authorization header of a token
// signed with a key.
func newTokenPacketHarness(t *testing.T, key []byte, fields string, ids ...string) (*packetHarness, func([]byte, TokenClaims) map[string]string) {
	t.Helper()
	v, err := NewTokenVerifier(key)
	if err != nil {
		t.Fatal(err)
	}
	h := newPacketHarness(t, 10_000, 4, func(c *PacketConfig) { c.Tokens = v })
	for _, id := range ids {
		if a := h.create(`{"id":"` + id + `",` + fields + `}`); a.Status != http.StatusCreated {
			t.Fatalf("create: %d %s", a.Status, a.Raw)
		}
	}
	sign := func(k []byte, c TokenClaims) map[string]string {
		tok, err := SignToken(k, c)
		if err != nil {
			t.Fatal(err)
		}
		return map[string]string{"Authorization": "Bearer " + tok}
	}
	return h, sign
}

// TestPacketTokens: with user tokens on, a grab needs a token for this budget (name
// and UID), for this packet when it names one, and for this user; every refusal is a
// 401 that changes nothing.
func TestPacketTokens(t *testing.T) {
	key := []byte("budget-token-key")
	h, sign := newTokenPacketHarness(t, key, `"sender":"m","totalAmount":100,"count":3`, "p-1", "p-2")
	exp := time.Now().Add(5 * time.Minute).Unix()
	ref := h.budget.Ref()
	for _, tc := range []struct {
		name   string
		header map[string]string
		want   error
	}{
		{"no token", nil, ErrTokenMissing},
		{"forged", sign([]byte("other"), TokenClaims{UserID: "u-1", Budget: ref, BudgetUID: h.budget.UID, Exp: exp}), ErrTokenSignature},
		{"expired", sign(key, TokenClaims{UserID: "u-1", Budget: ref, BudgetUID: h.budget.UID, Exp: time.Now().Unix() - 1}), ErrTokenExpired},
		{"another budget", sign(key, TokenClaims{UserID: "u-1", Budget: "shop/other", BudgetUID: h.budget.UID, Exp: exp}), ErrTokenBudget},
		{"another budget uid", sign(key, TokenClaims{UserID: "u-1", Budget: ref, BudgetUID: "old-uid", Exp: exp}), ErrTokenBudget},
		{"an activity's token", sign(key, TokenClaims{UserID: "u-1", Activity: ref, ActivityUID: h.budget.UID, Exp: exp}), ErrTokenBudget},
		{"another packet", sign(key, TokenClaims{UserID: "u-1", Budget: ref, BudgetUID: h.budget.UID, Packet: "p-2", Exp: exp}), ErrTokenPacket},
		{"another user", sign(key, TokenClaims{UserID: "u-2", Budget: ref, BudgetUID: h.budget.UID, Exp: exp}), ErrTokenUser},
	} {
		before := h.dump()
		a := h.grab("p-1", "u-1", tc.header)
		if a.Status != http.StatusUnauthorized || a.str("outcome") != OutcomeUnauthorized || !strings.HasPrefix(a.str("error"), tc.want.Error()) {
			t.Errorf("%s: %d %s, want 401 %q", tc.name, a.Status, a.Raw, tc.want)
		}
		if !maps.Equal(before, h.dump()) {
			t.Fatalf("%s: the refusal changed Redis", tc.name)
		}
	}
	budgetWide := sign(key, TokenClaims{UserID: "u-1", Budget: ref, BudgetUID: h.budget.UID, Exp: exp})
	onePacket := sign(key, TokenClaims{UserID: "u-3", Budget: ref, BudgetUID: h.budget.UID, Packet: "p-1", Exp: exp})
	for _, g := range []struct {
		packet, user string
		header       map[string]string
	}{{"p-1", "u-1", budgetWide}, {"p-2", "u-1", budgetWide}, {"p-1", "u-3", onePacket}} {
		if a := h.grab(g.packet, g.user, g.header); a.Status != http.StatusOK || a.str("outcome") != "granted" {
			t.Errorf("%s by %s with a good token: %d %s", g.packet, g.user, a.Status, a.Raw)
		}
	}
	// Creation takes the sender's credential, never a user's token.
	if a := h.do(http.MethodPost, "/v1/packets", `{"id":"p-3","sender":"m","totalAmount":100,"count":3}`, budgetWide); a.Status != http.StatusUnauthorized {
		t.Errorf("creation with a user token: %d %s", a.Status, a.Raw)
	}
}

// TestSenderCredential: only "Bearer <the token>" passes, and a rotated token
// replaces the old one.
func TestSenderCredential(t *testing.T) {
	c, err := NewSenderCredential([]byte("one"))
	if err != nil {
		t.Fatal(err)
	}
	for h, want := range map[string]bool{"Bearer one": true, "bearer one": true, "Bearer one ": true, "Bearer on": false,
		"Bearer one1": false, "one": false, "": false, "Bearer ": false, "Basic one": false} {
		if got := c.Check(h) == nil; got != want {
			t.Errorf("Check(%q) passes %v, want %v", h, got, want)
		}
	}
	if err := c.Set([]byte("two")); err != nil {
		t.Fatal(err)
	}
	if c.Check("Bearer one") == nil || c.Check("Bearer two") != nil {
		t.Error("the rotated credential is not the one checked")
	}
	if _, err := NewSenderCredential(nil); err == nil {
		t.Error("an empty credential was accepted")
	}
}

// Issue 34, case 1: a budget whose Redis lost or rolled back its data is fenced in
// Redis by the operator (store.Budget.Fence), and the fleet then creates and grants
// nothing: a creation, a retried creation of a packet that exists and a grab answer
// 503 unavailable with a message that names the fence, and Redis is left as it was,
// key for key. A shard that lost everything (FLUSHALL, then the fence) answers the
// same, not "not configured".
func TestPacketFencedBudgetCreatesAndGrantsNothing(t *testing.T) {
	h := newPacketHarness(t, 10_000, 2)
	body := `{"id":"order-1","sender":"m","totalAmount":1000,"count":2,"distribution":"Fixed"}`
	if a := h.create(body); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	if a := h.grab("order-1", "alice", nil); a.Status != http.StatusOK {
		t.Fatalf("alice's grab: %d %s", a.Status, a.Raw)
	}
	ctx := context.Background()
	if err := h.handle.Fence(ctx, "RedisRolledBack"); err != nil {
		t.Fatal(err)
	}
	before := h.dump()
	check := func(what string, a answer, code string) {
		t.Helper()
		if a.Status != http.StatusServiceUnavailable || a.str(code) != OutcomeUnavailable ||
			!strings.Contains(a.Raw, "RedisRolledBack") || !strings.Contains(a.Raw, "fenced") {
			t.Errorf("%s on a fenced budget: %d %s; want 503 unavailable naming the fence", what, a.Status, a.Raw)
		}
	}
	check("a creation", h.create(`{"id":"order-2","sender":"m","totalAmount":100,"count":1}`), "error")
	check("a retried creation", h.create(body), "error")
	check("bob's grab", h.grab("order-1", "bob", nil), "outcome")
	check("alice's grab again", h.grab("order-1", "alice", nil), "outcome")
	if after := h.dump(); !maps.Equal(before, after) {
		t.Errorf("a fenced budget's Redis changed under the fleet's calls")
	}

	if err := h.admin.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := h.handle.Fence(ctx, "DataLost"); err != nil {
		t.Fatal(err)
	}
	a := h.create(`{"id":"order-3","sender":"m","totalAmount":100,"count":1}`)
	if a.Status != http.StatusServiceUnavailable || !strings.Contains(a.Raw, "DataLost") {
		t.Errorf("a creation on a flushed, fenced budget: %d %s; want 503 naming the fence", a.Status, a.Raw)
	}
	if a := h.grab("order-1", "carol", nil); a.Status != http.StatusServiceUnavailable || !strings.Contains(a.Raw, "DataLost") {
		t.Errorf("a grab on a flushed, fenced budget: %d %s; want 503 naming the fence, not not_found", a.Status, a.Raw)
	}
}
