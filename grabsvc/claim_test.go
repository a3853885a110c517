package grabsvc

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

func TestGrabOutcomesOverHTTP(t *testing.T) {
	h := newHarness(t)
	now := time.Now().UnixMilli()
	ctx := context.Background()

	open := testActivity("open")
	h.useActivity(open, []int64{10, 20, 30}, 0, 0, false)

	first := h.grab("alice", nil)
	if first.Status != http.StatusOK || first.Outcome != OutcomeGranted || first.PacketID != "1" ||
		first.Amount == nil || *first.Amount != 10 {
		t.Fatalf("first grab: %d %s", first.Status, first.Raw)
	}
	again := h.grab("alice", nil)
	if again.Status != http.StatusOK || again.Outcome != OutcomeAlreadyClaimed || again.PacketID != first.PacketID ||
		again.Amount == nil || *again.Amount != *first.Amount {
		t.Fatalf("retry: %d %s, want already_claimed with packet %s", again.Status, again.Raw, first.PacketID)
	}
	for i, u := range []string{"bob", "carol 山田"} {
		r := h.grab(u, nil)
		if r.Status != http.StatusOK || r.Outcome != OutcomeGranted || r.PacketID != fmt.Sprint(i+2) {
			t.Fatalf("grab by %s: %d %s", u, r.Status, r.Raw)
		}
	}
	if r := h.grab("dave", nil); r.Status != http.StatusConflict || r.Outcome != OutcomeSoldOut || r.PacketID != "" || r.Amount != nil {
		t.Fatalf("sold out: %d %s", r.Status, r.Raw)
	}
	// A user with a packet still gets it back after the sell-out.
	if r := h.grab("bob", nil); r.Status != http.StatusOK || r.Outcome != OutcomeAlreadyClaimed || r.PacketID != "2" {
		t.Fatalf("bob after sell-out: %d %s", r.Status, r.Raw)
	}
	snap, err := handleOf(h.admin, open).Snapshot(ctx)
	if err != nil || snap.ClaimedCount != 3 || snap.ClaimedAmount != 60 || snap.RemainingCount != 0 {
		t.Fatalf("snapshot after the grabs: %+v %v", snap, err)
	}

	later := testActivity("later")
	h.useActivity(later, ones(5), now+time.Hour.Milliseconds(), 0, false)
	if r := h.grab("erin", nil); r.Status != http.StatusConflict || r.Outcome != OutcomeNotStarted {
		t.Fatalf("before the start: %d %s", r.Status, r.Raw)
	}

	// Committed but not opened by the controller yet: not started either.
	ready := testActivity("ready")
	if _, err := handleOf(h.admin, ready).Seed(ctx, ones(3), store.SeedParams{Count: 3, Total: 6, Sponsor: "s"}); err != nil {
		t.Fatal(err)
	}
	h.act.Store(ready)
	if r := h.grab("erin", nil); r.Status != http.StatusConflict || r.Outcome != OutcomeNotStarted {
		t.Fatalf("not opened: %d %s", r.Status, r.Raw)
	}

	past := testActivity("past")
	h.useActivity(past, ones(5), now-2*time.Hour.Milliseconds(), now-time.Hour.Milliseconds(), false)
	if r := h.grab("frank", nil); r.Status != http.StatusConflict || r.Outcome != OutcomeEnded {
		t.Fatalf("after the end: %d %s", r.Status, r.Raw)
	}

	closed := testActivity("closed")
	h.useActivity(closed, ones(5), 0, 0, false)
	if _, err := handleOf(h.admin, closed).Close(ctx, store.CloseExpired); err != nil {
		t.Fatal(err)
	}
	if r := h.grab("frank", nil); r.Status != http.StatusConflict || r.Outcome != OutcomeEnded {
		t.Fatalf("closed: %d %s", r.Status, r.Raw)
	}

	paused := testActivity("paused")
	h.useActivity(paused, ones(5), 0, 0, true)
	if r := h.grab("gina", nil); r.Status != http.StatusConflict || r.Outcome != OutcomePaused {
		t.Fatalf("paused: %d %s", r.Status, r.Raw)
	}
	if _, err := handleOf(h.admin, paused).Configure(ctx, 0, 0, false, true); err != nil {
		t.Fatal(err)
	}
	if r := h.grab("gina", nil); r.Status != http.StatusOK || r.Outcome != OutcomeGranted {
		t.Fatalf("after unpausing: %d %s", r.Status, r.Raw)
	}

	if r := h.grab("", nil); r.Status != http.StatusBadRequest || r.Outcome != OutcomeInvalidRequest || r.Error == "" {
		t.Fatalf("invalid: %d %s", r.Status, r.Raw)
	}

	// Redis lacks the activity (lost data, wrong UID): 503 with a clear error.
	missing := testActivity("missing")
	h.act.Store(missing)
	r := h.grab("hank", nil)
	if r.Status != http.StatusServiceUnavailable || r.Outcome != OutcomeUnavailable || !strings.Contains(r.Error, "not in the packet store") {
		t.Fatalf("missing activity: %d %s", r.Status, r.Raw)
	}
	if n, err := h.admin.Exists(ctx, keysOf(missing).All()...).Result(); err != nil || n != 0 {
		t.Fatalf("a grab on a missing activity created %d keys (%v)", n, err)
	}

	// Every outcome was counted.
	for outcome, want := range map[string]float64{
		OutcomeGranted: 4, OutcomeAlreadyClaimed: 2, OutcomeSoldOut: 1, OutcomeNotStarted: 2,
		OutcomeEnded: 2, OutcomePaused: 1, OutcomeInvalidRequest: 1, OutcomeUnavailable: 1,
	} {
		if got := counterValue(t, h.reg, "redpacket_grab_requests_total", "outcome", outcome); got != want {
			t.Errorf("grabs with outcome %s: %v, want %v", outcome, got, want)
		}
	}
}

func TestGrabUnauthorizedAndTokens(t *testing.T) {
	key := []byte("grab-key-1")
	v, err := NewTokenVerifier(key)
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, func(c *Config) { c.Tokens = v })
	act := testActivity("tokens")
	h.useActivity(act, ones(4), 0, 0, false)
	tok := func(user, activity string, exp time.Time) map[string]string {
		s, err := SignToken(key, TokenClaims{UserID: user, Activity: activity, ActivityUID: act.Object.UID, Exp: exp.Unix()})
		if err != nil {
			t.Fatal(err)
		}
		return map[string]string{"Authorization": "Bearer " + s}
	}
	if r := h.grab("ivy", tok("ivy", act.Ref, time.Now().Add(time.Minute))); r.Status != http.StatusOK || r.Outcome != OutcomeGranted {
		t.Fatalf("valid token: %d %s", r.Status, r.Raw)
	}
	if r := h.grab("jack", nil); r.Status != http.StatusUnauthorized || r.Outcome != OutcomeUnauthorized || r.Error == "" {
		t.Fatalf("no token: %d %s", r.Status, r.Raw)
	}
	if got := h.state(act).Claims; got != 1 {
		t.Fatalf("claims after one authorized grab: %d", got)
	}
}

func TestBadInputsHaveNoRedisEffect(t *testing.T) {
	key := []byte("another-key")
	v, err := NewTokenVerifier(key)
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, func(c *Config) { c.Tokens = v })
	act := testActivity("strict")
	h.useActivity(act, ones(10), 0, 0, false)
	sign := func(c TokenClaims) string {
		s, err := SignToken(key, c)
		if err != nil {
			t.Fatal(err)
		}
		return "Bearer " + s
	}
	future := time.Now().Add(time.Hour).Unix()
	good := sign(TokenClaims{UserID: "u1", Activity: act.Ref, ActivityUID: act.Object.UID, Exp: future})
	forged, err := SignToken([]byte("not-the-key"), TokenClaims{UserID: "u1", Activity: act.Ref, ActivityUID: act.Object.UID, Exp: future})
	if err != nil {
		t.Fatal(err)
	}
	payload, sig, _ := strings.Cut(strings.TrimPrefix(good, "Bearer "), ".")

	cases := []struct {
		name, method, body, auth string
		status                   int
		outcome, errPart         string
	}{
		{"empty body", "POST", "", good, 400, OutcomeInvalidRequest, "empty"},
		{"blank body", "POST", "  \n", good, 400, OutcomeInvalidRequest, "empty"},
		{"oversized body", "POST", `{"userId":"` + strings.Repeat("x", MaxBodyBytes) + `"}`, good, 413, OutcomeInvalidRequest, "larger"},
		{"not json", "POST", `userId=u1`, good, 400, OutcomeInvalidRequest, "JSON"},
		{"array", "POST", `["u1"]`, good, 400, OutcomeInvalidRequest, "object"},
		{"string", "POST", `"u1"`, good, 400, OutcomeInvalidRequest, "object"},
		{"number user", "POST", `{"userId":42}`, good, 400, OutcomeInvalidRequest, "string"},
		{"null user", "POST", `{"userId":null}`, good, 400, OutcomeInvalidRequest, "string"},
		{"object user", "POST", `{"userId":{"id":"u1"}}`, good, 400, OutcomeInvalidRequest, "string"},
		{"bool user", "POST", `{"userId":true}`, good, 400, OutcomeInvalidRequest, "string"},
		{"unknown field", "POST", `{"userId":"u1","amount":100}`, good, 400, OutcomeInvalidRequest, "unknown field"},
		{"differently cased field", "POST", `{"UserID":"u1"}`, good, 400, OutcomeInvalidRequest, "unknown field"},
		{"duplicate field", "POST", `{"userId":"u1","userId":"u2"}`, good, 400, OutcomeInvalidRequest, "twice"},
		{"trailing data", "POST", `{"userId":"u1"} x`, good, 400, OutcomeInvalidRequest, "after"},
		{"two objects", "POST", `{"userId":"u1"}{"userId":"u1"}`, good, 400, OutcomeInvalidRequest, "after"},
		{"unterminated", "POST", `{"userId":"u1"`, good, 400, OutcomeInvalidRequest, "JSON"},
		{"missing user", "POST", `{}`, good, 400, OutcomeInvalidRequest, "required"},
		{"empty user", "POST", `{"userId":""}`, good, 400, OutcomeInvalidRequest, "empty"},
		{"huge user", "POST", `{"userId":"` + strings.Repeat("u", MaxUserIDLen+1) + `"}`, good, 400, OutcomeInvalidRequest, "limit"},
		{"huge multibyte user", "POST", `{"userId":"` + strings.Repeat("红", MaxUserIDLen+1) + `"}`, good, 400, OutcomeInvalidRequest, "limit"},
		{"control char", "POST", `{"userId":"u\u0000"}`, good, 400, OutcomeInvalidRequest, "printable"},
		{"newline", "POST", `{"userId":"u\n1"}`, good, 400, OutcomeInvalidRequest, "printable"},
		{"delete char", "POST", "{\"userId\":\"u\x7f\"}", good, 400, OutcomeInvalidRequest, "printable"},
		{"invalid utf-8", "POST", "{\"userId\":\"u\xff\"}", good, 400, OutcomeInvalidRequest, "UTF-8"},
		{"lone surrogate", "POST", `{"userId":"u\ud800"}`, good, 400, OutcomeInvalidRequest, "printable"},
		{"wrong method", "GET", ``, good, 405, OutcomeInvalidRequest, "POST"},
		{"put", "PUT", `{"userId":"u1"}`, good, 405, OutcomeInvalidRequest, "POST"},
		{"no token", "POST", `{"userId":"u1"}`, "", 401, OutcomeUnauthorized, "required"},
		{"not bearer", "POST", `{"userId":"u1"}`, "Basic dTE6cA==", 401, OutcomeUnauthorized, "malformed"},
		{"garbage token", "POST", `{"userId":"u1"}`, "Bearer abc", 401, OutcomeUnauthorized, "malformed"},
		{"three parts", "POST", `{"userId":"u1"}`, good + ".x", 401, OutcomeUnauthorized, "malformed"},
		{"bad signature", "POST", `{"userId":"u1"}`, "Bearer " + forged, 401, OutcomeUnauthorized, "signature"},
		{"tampered payload", "POST", `{"userId":"u1"}`, "Bearer " + payload + "x." + sig, 401, OutcomeUnauthorized, ""},
		{"expired token", "POST", `{"userId":"u1"}`, sign(TokenClaims{UserID: "u1", Activity: act.Ref, ActivityUID: act.Object.UID, Exp: time.Now().Add(-time.Second).Unix()}), 401, OutcomeUnauthorized, "expired"},
		{"other activity", "POST", `{"userId":"u1"}`, sign(TokenClaims{UserID: "u1", Activity: "default/other", ActivityUID: act.Object.UID, Exp: future}), 401, OutcomeUnauthorized, "another activity"},
		{"other user", "POST", `{"userId":"u2"}`, good, 401, OutcomeUnauthorized, "another user"},
	}
	before := h.state(act)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			hdr := map[string]string{}
			if c.auth != "" {
				hdr["Authorization"] = c.auth
			}
			calls := scriptCalls(t, h.admin)
			r := h.do(c.method, "/v1/grab", c.body, hdr)
			if n := scriptCalls(t, h.admin) - calls; n != 0 {
				t.Fatalf("the request ran %d scripts in redis, want none", n)
			}
			if r.Status != c.status || r.Outcome != c.outcome || r.Error == "" || !strings.Contains(r.Error, c.errPart) {
				t.Fatalf("got %d %s, want %d %s with an error mentioning %q", r.Status, r.Raw, c.status, c.outcome, c.errPart)
			}
			if c.status == 405 && r.Header.Get("Allow") != "POST" {
				t.Fatalf("405 without Allow: POST")
			}
			if after := h.state(act); after != before {
				t.Fatalf("redis changed:\nbefore %+v\nafter  %+v", before, after)
			}
		})
	}
	// The same server still grants a well-formed, authorized request, and the
	// script counter sees it.
	calls := scriptCalls(t, h.admin)
	if r := h.do("POST", "/v1/grab", `{"userId":"u1"}`, map[string]string{"Authorization": good}); r.Status != 200 || r.Outcome != OutcomeGranted {
		t.Fatalf("good request after the bad ones: %d %s", r.Status, r.Raw)
	}
	if n := scriptCalls(t, h.admin) - calls; n < 1 {
		t.Fatalf("a grant ran %d scripts", n)
	}
}

func TestHugeHeadersAreRefused(t *testing.T) {
	h := newHarness(t)
	act := testActivity("headers")
	h.useActivity(act, ones(3), 0, 0, false)
	hs := NewHTTPServer("127.0.0.1:0", h.srv.Handler())
	addr := serveOn(t, hs)
	before := h.state(act)
	req, err := http.NewRequest("POST", "http://"+addr+"/v1/grab", strings.NewReader(`{"userId":"u1"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Padding", strings.Repeat("p", 64<<10))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("64 KiB of headers: %d, want 431", resp.StatusCode)
	}
	if after := h.state(act); after != before {
		t.Fatalf("redis changed: %+v -> %+v", before, after)
	}
}

func TestRateLimits(t *testing.T) {
	t.Run("per user", func(t *testing.T) {
		h := newHarness(t, func(c *Config) { c.UserLimiter = NewKeyedLimiter(0.5, 2, 0) })
		act := testActivity("limited")
		h.useActivity(act, ones(10), 0, 0, false)
		for i := 0; i < 2; i++ {
			if r := h.grab("kate", nil); r.Status != http.StatusOK {
				t.Fatalf("grab %d within the burst: %d %s", i, r.Status, r.Raw)
			}
		}
		before := h.state(act)
		r := h.grab("kate", nil)
		if r.Status != http.StatusTooManyRequests || r.Outcome != OutcomeRateLimited || r.Error == "" {
			t.Fatalf("third grab: %d %s", r.Status, r.Raw)
		}
		if r.RetryAfter != "2" {
			t.Fatalf("Retry-After %q, want 2 (one token every 2s)", r.RetryAfter)
		}
		if after := h.state(act); after != before {
			t.Fatalf("a rate-limited grab changed redis")
		}
		if r := h.grab("liam", nil); r.Status != http.StatusOK || r.Outcome != OutcomeGranted {
			t.Fatalf("another user is not limited: %d %s", r.Status, r.Raw)
		}
	})
	t.Run("per client", func(t *testing.T) {
		h := newHarness(t, func(c *Config) { c.ClientLimiter = NewKeyedLimiter(1, 3, 0) })
		act := testActivity("client-limited")
		h.useActivity(act, ones(10), 0, 0, false)
		var limited reply
		for i := 0; i < 4; i++ {
			limited = h.grab(fmt.Sprintf("user-%d", i), nil)
		}
		if limited.Status != http.StatusTooManyRequests || limited.Outcome != OutcomeRateLimited || limited.RetryAfter != "1" {
			t.Fatalf("fourth request from one client: %d %s Retry-After %q", limited.Status, limited.Raw, limited.RetryAfter)
		}
		if got := h.state(act).Claims; got != 3 {
			t.Fatalf("claims: %d, want 3", got)
		}
		// The activity endpoint shares the client's budget.
		if r := h.do("GET", "/v1/activity", "", nil); r.Status != http.StatusTooManyRequests || r.RetryAfter == "" {
			t.Fatalf("activity read over the limit: %d %s", r.Status, r.Raw)
		}
	})
}

func TestKeyedLimiterMemoryIsBounded(t *testing.T) {
	l := NewKeyedLimiter(10, 10, 1024)
	now := time.Now()
	for i := 0; i < 20000; i++ {
		l.Allow(fmt.Sprintf("user-%d", i), now)
	}
	if n := l.Len(); n > 1024 {
		t.Fatalf("limiter tracks %d keys, cap 1024", n)
	}
	// Idle buckets (full again after 1s) are dropped as new keys arrive later.
	later := now.Add(5 * time.Second)
	for i := 0; i < 200; i++ {
		l.Allow(fmt.Sprintf("new-%d", i), later)
	}
	if n := l.Len(); n > 400 {
		t.Fatalf("after the idle period the limiter still tracks %d keys", n)
	}
	// Limiting still works for a hot key.
	hot := NewKeyedLimiter(1, 1, 16)
	if ok, _ := hot.Allow("h", now); !ok {
		t.Fatal("first request refused")
	}
	ok, wait := hot.Allow("h", now)
	if ok || wait <= 0 || wait > time.Second {
		t.Fatalf("second request: allowed %v, wait %s", ok, wait)
	}
	if ok, _ := hot.Allow("h", now.Add(time.Second)); !ok {
		t.Fatal("request after the refill refused")
	}
	if l := NewKeyedLimiter(0, 5, 0); l != nil {
		t.Fatal("rate 0 must mean no limiter")
	}
}

func TestRedisDownGives503WithinTheDeadline(t *testing.T) {
	// A call that times out is asked again for up to the resolve timeout (the grant
	// may have been written): the answer comes within both.
	const deadline, resolve = 300 * time.Millisecond, 200 * time.Millisecond
	h := newHarness(t, func(c *Config) { c.RedisTimeout, c.ResolveTimeout = deadline, resolve })
	act := testActivity("outage")
	h.useActivity(act, ones(10), 0, 0, false)
	if r := h.grab("mia", nil); r.Status != http.StatusOK {
		t.Fatalf("grab before the outage: %d %s", r.Status, r.Raw)
	}

	// A hung Redis: commands queue and no answer comes back.
	if err := h.admin.Do(context.Background(), "CLIENT", "PAUSE", "1500", "ALL").Err(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	r := h.grab("noah", nil)
	took := time.Since(start)
	if r.Status != http.StatusServiceUnavailable || r.Outcome != OutcomeUnavailable || r.Error == "" {
		t.Fatalf("grab on a hung redis: %d %s", r.Status, r.Raw)
	}
	if took > deadline+resolve+400*time.Millisecond {
		t.Fatalf("503 took %s, deadline %s and resolve %s", took, deadline, resolve)
	}
	if rr := h.do("GET", "/readyz", "", nil); rr.Status != http.StatusServiceUnavailable {
		t.Fatalf("readyz on a hung redis: %d %s", rr.Status, rr.Raw)
	}
	// Once Redis answers again a retry is safe: the user holds exactly one packet,
	// whether or not the first attempt went through.
	wait.Until(t, 5*time.Second, "a grab after the pause", func() (bool, string) {
		r := h.grab("noah", nil)
		return r.Status == http.StatusOK && (r.Outcome == OutcomeGranted || r.Outcome == OutcomeAlreadyClaimed), r.Raw
	})
	st := h.state(act)
	if st.Claims != 2 || st.StreamLen != 2 || st.Snapshot.ClaimedCount != 2 {
		t.Fatalf("after the pause: %+v, want exactly two claims", st)
	}

	// A stopped Redis: connections are refused.
	h.redis.Stop()
	start = time.Now()
	r = h.grab("olga", nil)
	took = time.Since(start)
	if r.Status != http.StatusServiceUnavailable || r.Outcome != OutcomeUnavailable {
		t.Fatalf("grab on a stopped redis: %d %s", r.Status, r.Raw)
	}
	if took > deadline+resolve+400*time.Millisecond {
		t.Fatalf("503 took %s, deadline %s and resolve %s", took, deadline, resolve)
	}
	if a := h.do("GET", "/v1/activity", "", nil); a.Status != http.StatusServiceUnavailable {
		t.Fatalf("activity on a stopped redis: %d %s", a.Status, a.Raw)
	}
	if rr := h.do("GET", "/readyz", "", nil); rr.Status != http.StatusServiceUnavailable {
		t.Fatalf("readyz on a stopped redis: %d", rr.Status)
	}
	if rr := h.do("GET", "/healthz", "", nil); rr.Status != http.StatusOK {
		t.Fatalf("healthz on a stopped redis: %d", rr.Status)
	}
	if got := counterValue(t, h.reg, "redpacket_grab_redis_errors_total", "op", "grab"); got < 2 {
		t.Fatalf("redis errors counted: %v, want at least 2", got)
	}
}

// FuzzParseGrabRequest checks that the shortcut for the common body agrees with the
// strict decoder on every input it accepts.
func FuzzParseGrabRequest(f *testing.F) {
	for _, s := range []string{
		`{"userId":"u1"}`, ` { "userId" : "u 1" } `, "{\"userId\":\"u\t1\"}", `{"userId":"a\"b"}`,
		`{"userId":"红包"}`, `{"userId":""}`, `{"userId":"x"}x`, `{"userId":"x","a":1}`, `{"userid":"x"}`,
		"{\"userId\":\"\xff\"}", `{"userId":"\u00e9"}`, `{"userId":"<&>"}`, "{\"userId\":\"a\x7fb\"}",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		id, ok := parseCanonical(body)
		if !ok {
			return
		}
		strictID, strictMsg := parseStrict(body)
		if msg := CheckUserID(id); msg != "" {
			if strictMsg == "" {
				t.Fatalf("%q: shortcut refuses (%s), decoder accepts %q", body, msg, strictID)
			}
			return
		}
		if strictMsg != "" || strictID != id {
			t.Fatalf("%q: shortcut %q, decoder %q (%s)", body, id, strictID, strictMsg)
		}
	})
}
