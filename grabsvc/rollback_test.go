package grabsvc

import (
	"context"
	"net/http"
	"testing"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
)

// backup is a copy of an activity's keys, as a restored backup or a lagging replica
// would hold them.
type backup map[string]string

func takeBackup(t *testing.T, c *redis.Client, k store.Keys) backup {
	t.Helper()
	b := backup{}
	for _, key := range k.All() {
		v, err := c.Dump(context.Background(), key).Result()
		if err == redis.Nil {
			continue
		}
		if err != nil {
			t.Fatalf("dump %s: %v", key, err)
		}
		b[key] = v
	}
	return b
}

// restore puts the activity's keys back as they were in b.
func (b backup) restore(t *testing.T, c *redis.Client, k store.Keys) {
	t.Helper()
	ctx := context.Background()
	for _, key := range k.All() {
		if err := c.Del(ctx, key).Err(); err != nil {
			t.Fatal(err)
		}
		if v, ok := b[key]; ok {
			if err := c.RestoreReplace(ctx, key, 0, v).Err(); err != nil {
				t.Fatalf("restore %s: %v", key, err)
			}
		}
	}
}

// A Redis restored to an older copy after the service acknowledged grants: the next
// grab carries the service's watermark, so it is refused with 503 instead of
// granting a packet that was granted already, /readyz turns 503, and nobody who held
// a packet before the rollback gets a second one.
func TestGrabPathFencesARolledBackRedis(t *testing.T) {
	h := newHarness(t)
	act := testActivity("rolled")
	h.useActivity(act, ones(10), 0, 0, false)

	if r := h.grab("u1", nil); r.Status != http.StatusOK || r.Outcome != "granted" {
		t.Fatalf("grab u1: %d %s", r.Status, r.Raw)
	}
	old := takeBackup(t, h.admin, keysOf(act))
	granted := map[string]string{}
	for _, u := range []string{"u2", "u3", "u4"} {
		r := h.grab(u, nil)
		if r.Status != http.StatusOK || r.Outcome != "granted" {
			t.Fatalf("grab %s: %d %s", u, r.Status, r.Raw)
		}
		granted[r.PacketID] = u
	}
	old.restore(t, h.admin, keysOf(act))

	for _, u := range []string{"u5", "u2"} {
		r := h.grab(u, nil)
		if r.Status != http.StatusServiceUnavailable || r.Error == "" {
			t.Fatalf("grab %s on the rolled-back Redis: %d %s, want 503", u, r.Status, r.Raw)
		}
	}
	if r := h.do(http.MethodGet, "/readyz", "", nil); r.Status != http.StatusServiceUnavailable {
		t.Fatalf("/readyz of a fenced activity: %d %s, want 503", r.Status, r.Raw)
	}
	st := h.state(act)
	if st.Snapshot.Fenced == "" || st.Snapshot.ClaimedCount != 1 || st.StreamLen != 1 {
		t.Fatalf("Redis after the refusals: %+v, want fenced with the restored single claim", st)
	}
	// A replica that never saw a grant (no watermark at all) is refused too: the
	// fence is in Redis.
	if res, err := handleOf(h.admin, act).Shard(0).Grab(context.Background(), "u6"); err != nil || res.Outcome != store.Fenced {
		t.Fatalf("grab without a watermark after the fence: %+v %v, want fenced", res, err)
	}
}

// The reporter never lowers a recorded counter: a Redis behind the live status is
// fenced, the guard says why (so /readyz fails), and the status keeps its figures.
func TestReporterFencesInsteadOfLowering(t *testing.T) {
	e := newReporterEnv(t, "report-rollback", 20)
	ctx := context.Background()
	e.burst(t, "early", 1)
	old := takeBackup(t, e.admin, keysOf(e.act))
	e.burst(t, "late", 3)
	guard := &RollbackGuard{}
	r := e.reporter(0, nil)
	r.Guard = guard
	if ok, err := r.ReportOnce(ctx); err != nil || !ok {
		t.Fatalf("report: %v %v", ok, err)
	}
	if got := e.get(t).Status.ClaimedCount; got == nil || *got != 4 {
		t.Fatalf("claimedCount %v after the report, want 4", ptrStr(got))
	}
	if m := guard.Mark(e.act); m.ClaimedCount != 4 {
		t.Fatalf("watermark %+v after reading the status, want 4 claims", m)
	}

	old.restore(t, e.admin, keysOf(e.act))
	if ok, err := r.ReportOnce(ctx); err != nil || ok {
		t.Fatalf("report on the rolled-back Redis: applied %v, %v; want nothing applied", ok, err)
	}
	o := e.get(t)
	if o.Status.ClaimedCount == nil || *o.Status.ClaimedCount != 4 || *o.Status.RemainingCount != 16 {
		t.Fatalf("status after the rollback: claimed %s remaining %s, want 4 and 16 kept", ptrStr(o.Status.ClaimedCount), ptrStr(o.Status.RemainingCount))
	}
	snap, err := handleOf(e.admin, e.act).Snapshot(ctx)
	if err != nil || snap.Fenced == "" || snap.ClaimedCount != 1 {
		t.Fatalf("Redis after the report: %+v %v, want fenced at 1 claim", snap, err)
	}
	if guard.Problem(e.act.Object.UID) == "" {
		t.Fatalf("the guard does not say the activity is fenced")
	}
}
