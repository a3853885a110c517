package grabsvc

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"redpacket.io/operator/internal/rain"
)

// spreadUsers are the user ids the spread tests place: n ids as a rain's
// players would have them.
func spreadUsers(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("user-%05d", i)
	}
	return ids
}

// Over 10,000 users the offsets of a 3 s spread are uniform over [0, 3 s): the
// Kolmogorov-Smirnov distance to the uniform law stays under its 1 % critical value
// (1.628/√n), and a χ² over 30 equal bins under its 0.1 % critical value at 29
// degrees of freedom (58.30). Every offset is inside the window, in whole ms.
func TestStartSpreadIsUniform(t *testing.T) {
	const uid = "0b6e1c1e-3f7d-4c55-9a0e-6a7f1d2b9c41"
	const spread = 3 * time.Second
	users := spreadUsers(10_000)
	xs := make([]float64, len(users))
	bins := make([]int, 30)
	for i, u := range users {
		off := SpreadOffset(uid, u, spread)
		if off < 0 || off >= spread || off%time.Millisecond != 0 {
			t.Fatalf("offset %v of %s: want whole milliseconds in [0, %v)", off, u, spread)
		}
		xs[i] = float64(off) / float64(spread)
		bins[int(xs[i]*float64(len(bins)))]++
	}
	sort.Float64s(xs)
	n := float64(len(xs))
	d := 0.0
	for i, x := range xs {
		d = math.Max(d, math.Max(float64(i+1)/n-x, x-float64(i)/n))
	}
	if crit := 1.628 / math.Sqrt(n); d > crit {
		t.Errorf("Kolmogorov-Smirnov distance %.4f above the 1%% critical value %.4f", d, crit)
	}
	want := n / float64(len(bins))
	chi2 := 0.0
	for _, c := range bins {
		chi2 += (float64(c) - want) * (float64(c) - want) / want
	}
	if chi2 > 58.30 {
		t.Errorf("χ² %.1f over %d bins above the 0.1%% critical value 58.30 (counts %v)", chi2, len(bins), bins)
	}
	t.Logf("10,000 users over %v: KS distance %.4f (critical %.4f), χ² %.1f (critical 58.30)", spread, d, 1.628/math.Sqrt(n), chi2)

	// Another activity places the same users elsewhere: a late user is not late in
	// every rain.
	same := 0
	for _, u := range users[:1000] {
		if SpreadOffset(uid, u, spread) == SpreadOffset("another-uid", u, spread) {
			same++
		}
	}
	if same > 10 {
		t.Errorf("%d of 1,000 users have the same offset in two activities", same)
	}
	if got := SpreadOffset(uid, "u", 0); got != 0 {
		t.Errorf("no spread: offset %v", got)
	}
	if got := OpensAt(uid, "u", time.Time{}, spread); !got.IsZero() {
		t.Errorf("no startTime: opens at %v, want at once", got)
	}
}

// spreadChildEnv makes the test binary print the offsets of spreadUsers(1000) and
// exit, from TestMain: the other process of TestStartSpreadIsStableAcrossProcesses.
const spreadChildEnv = "GRABSVC_SPREAD_CHILD"

// The offsets are the same in another process, and the same as this version
// computed them when it was written (three pinned values): pods of two versions
// side by side in a rolling update open a user at the same instant.
func TestStartSpreadIsStableAcrossProcesses(t *testing.T) {
	const uid = "0b6e1c1e-3f7d-4c55-9a0e-6a7f1d2b9c41"
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), spreadChildEnv+"=1")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("the other process: %v\n%s", err, out)
	}
	line := ""
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, "offsets ") {
			line = strings.TrimPrefix(l, "offsets ")
		}
	}
	var theirs []int64
	if err := json.Unmarshal([]byte(line), &theirs); err != nil {
		t.Fatalf("the other process printed %q: %v", out, err)
	}
	users := spreadUsers(1000)
	if len(theirs) != len(users) {
		t.Fatalf("the other process placed %d users, want %d", len(theirs), len(users))
	}
	for i, u := range users {
		if ours := SpreadOffset(uid, u, 3*time.Second).Milliseconds(); ours != theirs[i] {
			t.Fatalf("%s: %d ms here, %d ms in the other process", u, ours, theirs[i])
		}
	}
	for u, want := range map[string]int64{"user-00000": pinnedSpread[0], "user-00001": pinnedSpread[1], "alice": pinnedSpread[2]} {
		if got := SpreadOffset(uid, u, 3*time.Second).Milliseconds(); got != want {
			t.Errorf("%s: offset %d ms, pinned %d ms: the hash changed, and pods of two versions would open a user at different instants", u, got, want)
		}
	}
}

// pinnedSpread are the offsets, in ms of a 3 s spread, of user-00000, user-00001
// and alice in the activity of TestStartSpreadIsStableAcrossProcesses.
var pinnedSpread = [3]int64{2524, 508, 2879}

// printSpreadOffsets is the other process of TestStartSpreadIsStableAcrossProcesses:
// TestMain calls it, and exits, when spreadChildEnv is set.
func printSpreadOffsets() {
	users := spreadUsers(1000)
	offs := make([]int64, len(users))
	for i, u := range users {
		offs[i] = SpreadOffset("0b6e1c1e-3f7d-4c55-9a0e-6a7f1d2b9c41", u, 3*time.Second).Milliseconds()
	}
	raw, _ := json.Marshal(offs)
	fmt.Println("offsets " + string(raw))
}

// A grab before the user's own instant answers 409 not_started with Retry-After
// (the whole seconds left, rounded up) and its opensAt, and changes nothing in
// Redis; GET /v1/activity?userId= tells the same instant; at the instant the same
// grab is granted. The activity is open in Redis all along (startTime passed by
// Redis's clock): only the spread holds the user back, by the service's clock,
// which the test sets.
func TestGrabBeforeTheUsersInstantChangesNothing(t *testing.T) {
	var clock atomic.Int64
	h := newHarness(t, func(c *Config) { c.Now = func() time.Time { return time.UnixMilli(clock.Load()) } })
	act := testActivity("spread-night")
	start := time.Now().Add(-time.Second).Truncate(time.Millisecond)
	end := start.Add(time.Hour)
	act.Object.Spec.StartTime, act.Object.Spec.EndTime = &metav1.Time{Time: start}, &metav1.Time{Time: end}
	act.Object.Spec.GrabService.StartSpread = &metav1.Duration{Duration: 10 * time.Minute}
	h.useActivity(act, ones(50), start.UnixMilli(), end.UnixMilli(), false)

	// A user whose instant is late in the window.
	user := ""
	for _, u := range spreadUsers(200) {
		if SpreadOffset(string(act.Object.UID), u, 10*time.Minute) > 5*time.Minute {
			user = u
			break
		}
	}
	off := SpreadOffset(string(act.Object.UID), user, 10*time.Minute)
	opens := start.Add(off)
	clock.Store(opens.Add(-90_500 * time.Millisecond).UnixMilli())

	before := h.state(act)
	r := h.grab(user, nil)
	if r.Status != http.StatusConflict || r.Outcome != OutcomeNotStarted || r.RetryAfter != "91" {
		t.Fatalf("90.5 s before %s's instant: %d %s, Retry-After %q; want 409 not_started, Retry-After 91", user, r.Status, r.Raw, r.RetryAfter)
	}
	var body struct {
		OpensAt string `json:"opensAt"`
	}
	if err := json.Unmarshal([]byte(r.Raw), &body); err != nil || body.OpensAt != opens.UTC().Format(timeMillis) {
		t.Fatalf("opensAt %q, want %s (%v)", body.OpensAt, opens.UTC().Format(timeMillis), err)
	}
	if after := h.state(act); after != before {
		t.Fatalf("a grab before the user's instant changed Redis: %+v, was %+v", after, before)
	}

	view := h.do(http.MethodGet, "/v1/activity?userId="+user, "", nil)
	var v ActivityView
	if err := json.Unmarshal([]byte(view.Raw), &v); err != nil || view.Status != http.StatusOK {
		t.Fatalf("GET /v1/activity?userId=: %d %s", view.Status, view.Raw)
	}
	if v.OpensAt != body.OpensAt || v.StartSpreadMillis != 600_000 {
		t.Fatalf("the view says opensAt %q and a spread of %d ms, the grab %q and 600000", v.OpensAt, v.StartSpreadMillis, body.OpensAt)
	}
	if bad := h.do(http.MethodGet, "/v1/activity?userId="+strings.Repeat("x", MaxUserIDLen+1), "", nil); bad.Status != http.StatusBadRequest {
		t.Fatalf("a user id too long: %d %s, want 400", bad.Status, bad.Raw)
	}

	// One millisecond before: still refused, Retry-After at least 1.
	clock.Store(opens.Add(-time.Millisecond).UnixMilli())
	if r := h.grab(user, nil); r.Status != http.StatusConflict || r.RetryAfter != "1" {
		t.Fatalf("1 ms before the instant: %d %s, Retry-After %q", r.Status, r.Raw, r.RetryAfter)
	}
	if after := h.state(act); after != before {
		t.Fatalf("a grab before the user's instant changed Redis: %+v, was %+v", after, before)
	}
	// At the instant: granted.
	clock.Store(opens.UnixMilli())
	if r := h.grab(user, nil); r.Status != http.StatusOK || r.Outcome != OutcomeGranted {
		t.Fatalf("at the instant: %d %s, want granted", r.Status, r.Raw)
	}
	// A user whose offset has passed grabs at once; one whose offset has not waits.
	early, late := 0, 0
	for _, u := range spreadUsers(200) {
		if u == user {
			continue
		}
		r := h.grab(u, nil)
		switch o := SpreadOffset(string(act.Object.UID), u, 10*time.Minute); {
		case o <= off && r.Outcome == OutcomeGranted || o <= off && r.Outcome == OutcomeSoldOut:
			early++
		case o > off && r.Outcome == OutcomeNotStarted:
			late++
		default:
			t.Fatalf("%s, offset %v, at offset %v: %d %s", u, o, off, r.Status, r.Raw)
		}
	}
	t.Logf("at %s's instant (%v into the spread): %d users opened, %d still waiting", user, off, early, late)
}

// A rain of 600 users over a 2 s spread, as kubectl rpa rain makes it: each user
// answered not_started waits for the instant its answer names and asks again, and
// every user ends granted. Redis's stream entry of each grant is stamped (by
// Redis's clock, the same host clock here) no earlier than that user's instant:
// nobody got in before their turn.
func TestRainWaitsForEachUsersInstant(t *testing.T) {
	h := newHarness(t)
	act := testActivity("spread-rain")
	start := time.Now().Add(300 * time.Millisecond).Truncate(time.Second).Add(time.Second)
	end := start.Add(time.Hour)
	const spread = 2 * time.Second
	act.Object.Spec.StartTime, act.Object.Spec.EndTime = &metav1.Time{Time: start}, &metav1.Time{Time: end}
	act.Object.Spec.GrabService.StartSpread = &metav1.Duration{Duration: spread}
	h.useActivity(act, ones(600), start.UnixMilli(), end.UnixMilli(), false)

	res := rain.Run(context.Background(), rain.Spec{URL: h.http.URL + "/v1/grab", Users: 600, Connections: 32,
		UserPrefix: "spread", Timeout: 5 * time.Second, RetryUnavailable: true, WaitForOpening: true})
	if res.ByOutcome[OutcomeGranted] != 600 || res.Failed != 0 {
		t.Fatalf("outcomes %v, failed %d (%s); want 600 granted", res.ByOutcome, res.Failed, res.FirstError)
	}
	claims, err := handleOf(h.admin, act).Shard(0).Claims(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	spec := rain.Spec{UserPrefix: "spread"}
	late := time.Duration(0)
	for i := range 600 {
		u := spec.UserName(i)
		c, ok := claims[u]
		if !ok {
			t.Fatalf("redis holds no packet of %s", u)
		}
		ms, err := strconv.ParseInt(strings.SplitN(c.EntryID, "-", 2)[0], 10, 64)
		if err != nil {
			t.Fatalf("entry id %q: %v", c.EntryID, err)
		}
		opens := OpensAt(string(act.Object.UID), u, start, spread)
		if at := time.UnixMilli(ms); at.Before(opens) {
			t.Fatalf("%s was granted at %s, before its instant %s", u, at.Format(timeMillis), opens.Format(timeMillis))
		} else {
			late = max(late, at.Sub(opens))
		}
	}
	t.Logf("600 users over a %v spread: %d requests in %v; the latest grant came %v after its user's instant",
		spread, res.Requests, res.Elapsed.Round(time.Millisecond), late)
}
