package grabsvc

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// usersAt returns n user ids at home on shard i of h, named after prefix.
func usersAt(h *store.Activity, prefix string, i, n int) []string {
	var out []string
	for k := 0; len(out) < n; k++ {
		if u := prefix + "-" + strconv.Itoa(k); h.Home(u) == i {
			out = append(out, u)
		}
	}
	return out
}

// failoverTotal is what openTwoShards seeds: packets 1 to 8 of 10 to 80.
const failoverTotal = 360

// openTwoShards seeds act over two shards with packets 1 to 8 of 10, 20, ... 80
// (failoverTotal), opens it and serves it from h; it returns the admin's handle.
func openTwoShards(t *testing.T, h *harness, act *Resource) *store.Activity {
	t.Helper()
	ctx := context.Background()
	act.Object.Spec.Shards = 2
	sh := handleOf(h.admin, act)
	if _, err := sh.Seed(ctx, []int64{10, 20, 30, 40, 50, 60, 70, 80},
		store.SeedParams{Count: 8, Total: failoverTotal, Sponsor: "sponsor-1", Currency: "CNY"}); err != nil {
		t.Fatal(err)
	}
	if r, err := sh.ConfigureWith(ctx, store.Settings{Open: true}); err != nil || r.State != store.StateOpen {
		t.Fatalf("opening: %+v %v", r, err)
	}
	h.act.Store(act)
	return sh
}

// The experiment of a shard failover after a transfer, on a real redis-server, with
// the grab service's own guard: 2 shards, 8 packets (shard 0 lists 1, 3, 5, 7 and
// shard 1 lists 2, 4, 6, 8). One grant on shard 1; then a copy of shard 1's keys
// (its replica: DUMP of every key of the shard at that instant, the bytes a replica
// that had all writes up to here holds); then Transfer(1→0, 2) through the service's
// handle, which moves 8 and 6 to shard 0 and raises the guard's transfer mark of
// both shards; then shard 1's keys are replaced by the copy (the failover: every
// client of the shard's master now reads the replica's data at the same address).
// Shard 1 holds every claim it held, so its claims watermark sees nothing, and it
// lists 6 and 8 again while shard 0 holds them too. 15 grabs follow over HTTP. The
// first grab on shard 1 carries the guard's transfer mark and fences it; shard 0's
// refill finds shard 1 fenced and takes nothing: no packet is granted twice, and
// the activity is fenced.
func TestShardFailoverAfterTransferFencesBeforeItRegrants(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	act := testActivity("failover")
	const total = failoverTotal
	sh := openTwoShards(t, h, act)

	on0, on1 := usersAt(sh, "z", 0, 8), usersAt(sh, "o", 1, 9)
	granted := map[string]string{} // packet id -> user
	var claimed int64
	first := h.grab(on1[0], nil)
	if first.Status != http.StatusOK || first.Outcome != "granted" {
		t.Fatalf("first grab on shard 1: %d %s", first.Status, first.Raw)
	}
	granted[first.PacketID] = on1[0]
	claimed += *first.Amount

	k1 := sh.Shard(1).Keys()
	replica := takeBackup(t, h.admin, k1)

	// The transfer, through the grab service's own handle and guard.
	moved, err := h.srv.redis.of(h.srv.cfg.Redis, act).Transfer(ctx, 1, 0, 2)
	if err != nil || moved != 2 {
		t.Fatalf("Transfer(1→0, 2): %d moved, %v", moved, err)
	}
	if m := h.srv.cfg.Guard.MarkShard(act, 1); m.TransferSeq == 0 {
		t.Fatalf("the guard kept no transfer mark for shard 1 after the transfer: %+v", m)
	}

	// The failover: shard 1's master is now its replica from before the transfer.
	replica.restore(t, h.admin, k1)

	users := append(append([]string{}, on1[1:9]...), on0[:7]...) // 15 grabs, 8 of them on shard 1
	fencedAnswers := 0
	for _, u := range users {
		r := h.grab(u, nil)
		switch {
		case r.Status == http.StatusOK && r.Outcome == "granted":
			if prev, dup := granted[r.PacketID]; dup {
				t.Errorf("packet %s granted to %s and again to %s", r.PacketID, prev, u)
			}
			granted[r.PacketID] = u
			claimed += *r.Amount
		case r.Status == http.StatusServiceUnavailable:
			fencedAnswers++
		case r.Status == http.StatusConflict && r.Outcome == "sold_out":
		default:
			t.Fatalf("grab of %s: %d %s", u, r.Status, r.Raw)
		}
	}
	if claimed > total {
		t.Errorf("%d claimed of a total of %d", claimed, total)
	}
	view, err := sh.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if view.Shards[1].Fenced == "" || view.Whole.Fenced == "" {
		t.Fatalf("shard 1 came back from before a transfer and is not fenced: shards %v", fencedShards(view))
	}
	if fencedAnswers == 0 || h.srv.cfg.Guard.Problem(act.Object.UID) == "" {
		t.Fatalf("no grab was refused (%d) or the guard does not say the activity is fenced (%q)",
			fencedAnswers, h.srv.cfg.Guard.Problem(act.Object.UID))
	}
	t.Logf("%d granted (%d of %d claimed), %d refused; shards fenced %v", len(granted), claimed, total, fencedAnswers, fencedShards(view))
}

// The same failover seen by a grab pod that did not make the transfer: two grab
// services on a real redis-server, each with its own clients, handle and guard, as
// two pods have. Pod A grants one packet on shard 1 and pod B one on shard 0 (B has
// served the sharded activity before, so a mark read when a pod first uses it would
// be stale). Then pod A moves 8 and 6 from shard 1 to shard 0, shard 1 comes back
// from before the transfer (listing 4, 6 and 8 again), and at once pod B takes 12
// users of shard 1 concurrently, then everyone drains shard 0 through both pods. Pod
// B's guard never saw the transfer; shard 0 keeps shard 1's transfer mark
// (transfer_in.lua) and B reads it before its grabs there (store.Activity.RecordedMark):
// B's grabs on shard 1 answer 503 and fence it, shard 0 grants 6 and 8 once, and the
// claims in Redis, read shard by shard, hold no packet twice and no more than the
// total.
func TestShardFailoverAfterTransferFencesOnEveryPod(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	act := testActivity("failover-two-pods")
	const total = failoverTotal
	sh := openTwoShards(t, h, act)
	podB, podBHTTP := secondServer(t, h)

	on0, on1 := usersAt(sh, "z", 0, 9), usersAt(sh, "o", 1, 13)
	if r := h.grab(on1[0], nil); r.Status != http.StatusOK || r.Outcome != "granted" {
		t.Fatalf("pod A's grab on shard 1: %d %s", r.Status, r.Raw)
	}
	if r, err := postGrab(podBHTTP.Client(), podBHTTP.URL, on0[0]); err != nil || r.Status != http.StatusOK || r.Outcome != "granted" {
		t.Fatalf("pod B's grab on shard 0: %+v %v", r, err)
	}

	k1 := sh.Shard(1).Keys()
	replica := takeBackup(t, h.admin, k1)
	moved, err := h.srv.redis.of(h.srv.cfg.Redis, act).Transfer(ctx, 1, 0, 2)
	if err != nil || moved != 2 {
		t.Fatalf("pod A's Transfer(1→0, 2): %d moved, %v", moved, err)
	}
	if m := podB.cfg.Guard.MarkShard(act, 1); m.TransferSeq != 0 {
		t.Fatalf("pod B's guard holds a transfer mark of shard 1 (%+v): the test needs a pod that never saw the transfer", m)
	}
	// The failover: shard 1's master is now its replica from before the transfer.
	replica.restore(t, h.admin, k1)

	type answer struct {
		user string
		r    reply
		err  error
	}
	burst := func(url string, c *http.Client, users []string) []answer {
		out := make([]answer, len(users))
		var wg sync.WaitGroup
		for i, u := range users {
			wg.Go(func() {
				r, err := postGrab(c, url, u)
				out[i] = answer{u, r, err}
			})
		}
		wg.Wait()
		return out
	}
	onStale := burst(podBHTTP.URL, podBHTTP.Client(), on1[1:])
	drain := append(burst(podBHTTP.URL, podBHTTP.Client(), on0[1:5]), burst(h.http.URL, h.http.Client(), on0[5:])...)

	refused := 0
	for _, a := range onStale {
		switch {
		case a.err != nil:
			t.Fatalf("pod B's grab of %s: %v", a.user, a.err)
		case a.r.Status == http.StatusServiceUnavailable:
			refused++
		default:
			t.Errorf("pod B's grab of %s on the shard that came back: %d %s, want 503", a.user, a.r.Status, a.r.Raw)
		}
	}
	for _, a := range drain {
		if a.err != nil || a.r.Status != http.StatusOK && a.r.Status != http.StatusConflict && a.r.Status != http.StatusServiceUnavailable {
			t.Fatalf("grab of %s on shard 0: %+v, %v", a.user, a.r, a.err)
		}
	}

	// What Redis holds, whatever the answers said.
	granted := map[string]string{} // packet id -> user
	var claimed int64
	for i := range 2 {
		claims, err := sh.Shard(i).Claims(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for u, c := range claims {
			if prev, dup := granted[c.PacketID]; dup {
				t.Errorf("packet %s granted to %s and again to %s", c.PacketID, prev, u)
			}
			granted[c.PacketID] = u
			claimed += c.Amount
		}
	}
	if claimed > total {
		t.Errorf("claimed %d of %d", claimed, total)
	}
	view, err := sh.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if view.Shards[1].Fenced == "" || podB.cfg.Guard.Problem(act.Object.UID) == "" {
		t.Fatalf("shard 1 fenced %q, pod B's guard says %q; want both to say the shard rolled back",
			view.Shards[1].Fenced, podB.cfg.Guard.Problem(act.Object.UID))
	}
	if m := podB.cfg.Guard.MarkShard(act, 1); m.TransferSeq == 0 {
		t.Errorf("pod B's guard learnt no transfer mark of shard 1: %+v", m)
	}
	t.Logf("%d packets claimed (%d of %d); pod B refused %d of %d grabs on shard 1; shards fenced %v",
		len(granted), claimed, total, refused, len(onStale), fencedShards(view))
}

// secondServer is another grab replica of h's activity on the same redis-server, with
// its own clients and guard behind its own listener: another pod.
func secondServer(t *testing.T, h *harness) (*Server, *httptest.Server) {
	t.Helper()
	rc, err := h.redis.Conn().NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	srv, err := NewServer(Config{Redis: rc.Pipeliner, Resource: h.act.Load, Ping: rc.Client, RedisTimeout: 2 * time.Second,
		Metrics: NewMetrics(prometheus.NewRegistry()), Guard: &RollbackGuard{}})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(hs.Close)
	return srv, hs
}

// postGrab posts one grab to the service at url; safe on any goroutine.
func postGrab(c *http.Client, url, userID string) (reply, error) {
	resp, err := c.Post(url+"/v1/grab", "application/json", strings.NewReader(fmt.Sprintf(`{"userId":%q}`, userID)))
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, err
	}
	r := reply{Status: resp.StatusCode, Raw: string(raw)}
	if err := json.Unmarshal(raw, &r); err != nil {
		return reply{}, fmt.Errorf("body %q: %w", raw, err)
	}
	return r, nil
}

// Normal refills and transfers under load never fence: two grab replicas (their own
// handles, transfer ids and guards) serve a rain over 4 shards with users skewed so
// that the heavy shards refill again and again from the light ones, while a third
// reader raises each guard from steady readings as the reporter does. Every guard
// ends with transfer marks, every packet is granted once, the rain sells out, and no
// grab is refused, no shard fenced.
func TestRefillsUnderLoadNeverFenceFalsely(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	act := testActivity("refills")
	act.Object.Spec.Shards = 4
	const count = 400
	amounts := ones(count)
	var total int64
	for _, a := range amounts {
		total += a
	}
	sh := handleOf(h.admin, act)
	if _, err := sh.Seed(ctx, amounts, store.SeedParams{Count: count, Total: total, Sponsor: "sponsor-1", Currency: "CNY"}); err != nil {
		t.Fatal(err)
	}
	if r, err := sh.ConfigureWith(ctx, store.Settings{Open: true}); err != nil || r.State != store.StateOpen {
		t.Fatalf("opening: %+v %v", r, err)
	}
	h.act.Store(act)
	second, secondHTTP := secondServer(t, h)
	guards := []*RollbackGuard{h.srv.cfg.Guard, second.cfg.Guard}
	urls := []string{h.http.URL, secondHTTP.URL}
	for _, s := range []*Server{h.srv, second} {
		// Small refills: many transfers.
		s.redis.of(s.cfg.Redis, act).TransferBatch = 4
	}

	// 600 users for 400 packets, 70% of them at home on shard 0.
	var users []string
	onZero := usersAt(sh, "heavy", 0, 420)
	users = append(users, onZero...)
	for i := 1; i < 4; i++ {
		users = append(users, usersAt(sh, "light"+strconv.Itoa(i), i, 60)...)
	}
	stop := make(chan struct{})
	var reader sync.WaitGroup
	reader.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			v, err := sh.ReadShards(ctx)
			if err != nil || !v.Steady {
				continue
			}
			for _, g := range guards {
				for i, s := range v.Shards {
					g.SawShard(act.Object.UID, i, 4, s.Watermark())
				}
			}
		}
	})
	type answer struct {
		user string
		r    reply
		err  error
	}
	answers := make(chan answer, len(users))
	var wg sync.WaitGroup
	for w := range 8 {
		url, c := urls[w%2], h.http.Client()
		wg.Go(func() {
			for i := w; i < len(users); i += 8 {
				r, err := postGrab(c, url, users[i])
				answers <- answer{users[i], r, err}
			}
		})
	}
	wg.Wait()
	close(stop)
	reader.Wait()
	close(answers)

	granted := map[string]string{}
	var claimed int64
	soldOut := 0
	for a := range answers {
		switch {
		case a.err != nil:
			t.Fatalf("grab of %s: %v", a.user, a.err)
		case a.r.Status == http.StatusOK && a.r.Outcome == "granted":
			if prev, dup := granted[a.r.PacketID]; dup {
				t.Fatalf("packet %s granted to %s and %s", a.r.PacketID, prev, a.user)
			}
			granted[a.r.PacketID] = a.user
			claimed += *a.r.Amount
		case a.r.Status == http.StatusConflict && a.r.Outcome == "sold_out":
			soldOut++
		default:
			t.Fatalf("grab of %s: %d %s", a.user, a.r.Status, a.r.Raw)
		}
	}
	if len(granted) != count || claimed != total || soldOut != len(users)-count {
		t.Fatalf("%d granted (%d of %d), %d sold out; want every packet granted once", len(granted), claimed, total, soldOut)
	}
	view, err := sh.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if view.Whole.Fenced != "" || !view.Conservation().Zero() {
		t.Fatalf("after the rain: shards fenced %v, imbalance %+v", fencedShards(view), view.Conservation())
	}
	for g, guard := range guards {
		for i := range 4 {
			if m := guard.MarkShard(act, i); m.TransferSeq == 0 || m.TransferSeq > view.Shards[i].TransferSeq {
				t.Errorf("guard %d, shard %d: transfer mark %d, shard at %d; want a mark the shard reached", g, i, m.TransferSeq, view.Shards[i].TransferSeq)
			}
		}
	}
	var seqs []int64
	for _, s := range view.Shards {
		seqs = append(seqs, s.TransferSeq)
	}
	t.Logf("transfer sequences after the rain: %v", seqs)
}

// The transfer marks go through the status, on a real API server: another pod moves
// packets out of shard 1, the reporter writes status.shardWatermarks.transferSeqs, and
// a grab replica that saw nothing but that status (started afterwards) fences shard 1
// when it comes back from before the transfer, at its first grab there.
func TestStatusTransferMarksFenceForAFreshReplica(t *testing.T) {
	h := newHarness(t)
	cp := controlPlane(t)
	ctx := context.Background()
	obj := activityForStatus(cp.Namespace(t), "transfer-marks", 8, 360)
	obj.Spec.Shards = 2
	obj.Spec.Durability = &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityFsync}
	if err := cp.Client.Create(ctx, obj); err != nil {
		t.Fatalf("creating the activity: %v", err)
	}
	sh := store.NewActivity(h.admin, string(obj.UID), 2)
	if _, err := sh.Seed(ctx, []int64{10, 20, 30, 40, 50, 60, 70, 80}, store.SeedParams{Count: 8, Total: 360, Sponsor: "sponsor-1", Currency: "CNY"}); err != nil {
		t.Fatal(err)
	}
	if r, err := sh.ConfigureWith(ctx, store.Settings{Open: true}); err != nil || r.State != store.StateOpen {
		t.Fatalf("opening: %+v %v", r, err)
	}
	h.act.Store(NewResource(obj))
	on1 := usersAt(sh, "o", 1, 2)
	if r := h.grab(on1[0], nil); r.Status != http.StatusOK {
		t.Fatalf("grab on shard 1: %d %s", r.Status, r.Raw)
	}
	k1 := sh.Shard(1).Keys()
	replica := takeBackup(t, h.admin, k1)
	// Another pod's refill.
	if moved, err := store.NewActivity(h.admin, string(obj.UID), 2).Transfer(ctx, 1, 0, 2); err != nil || moved != 2 {
		t.Fatalf("Transfer(1→0, 2): %d, %v", moved, err)
	}
	rep := &Reporter{Client: cp.Client, Redis: h.admin, Resource: h.act.Load, Guard: h.srv.cfg.Guard}
	if applied, err := rep.ReportOnce(ctx); err != nil || !applied {
		t.Fatalf("report: applied %v, %v", applied, err)
	}
	live := &redpacketv1alpha1.RedPacketActivity{}
	if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(obj), live); err != nil {
		t.Fatal(err)
	}
	if w := live.Status.ShardWatermarks; w == nil || !slices.Equal(w.TransferSeqs, []int64{1, 2}) || !slices.Equal(w.ClaimedCounts, []int64{0, 1}) {
		t.Fatalf("status.shardWatermarks %+v, want claimedCounts [0 1] and transferSeqs [1 2]", w)
	}

	// Shard 1 fails over to its replica from before the transfer; a replica started
	// now knows the status alone.
	replica.restore(t, h.admin, k1)
	h.act.Store(NewResource(live))
	_, fresh := secondServer(t, h)
	r, err := postGrab(fresh.Client(), fresh.URL, on1[1])
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("first grab of a fresh replica on the shard that came back: %d %s, want 503", r.Status, r.Raw)
	}
	view, err := sh.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if view.Shards[1].Fenced == "" {
		t.Fatalf("shard 1 is not fenced: %v", fencedShards(view))
	}
	// And the reporter fences every shard.
	if applied, err := rep.ReportOnce(ctx); err != nil || applied {
		t.Fatalf("report after the failover: applied %v, %v; want nothing applied", applied, err)
	}
	if view, err = sh.ReadShards(ctx); err != nil || !view.Whole.FullyFenced() {
		t.Fatalf("after the report: shards fenced %v, %v", fencedShards(view), err)
	}
}
