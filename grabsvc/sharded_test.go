package grabsvc

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"testing"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// A sharded activity over HTTP: users are decided by their home shards, a dry home
// shard refills from the others before anyone hears sold_out, every packet is granted
// once, and a grant's watermark is kept per shard. A shard that comes back behind
// what this service saw on it is fenced by the next grab there, and the reporter
// spreads the fence to every shard.
func TestShardedActivityOverHTTP(t *testing.T) {
	h := newHarness(t)
	cp := controlPlane(t)
	const shards = 3
	amounts := ones(90)
	var total int64
	for _, a := range amounts {
		total += a
	}
	ctx := context.Background()
	obj := activityForStatus(cp.Namespace(t), "sharded", 90, total)
	obj.Spec.Shards = shards
	obj.Spec.Durability = &redpacketv1alpha1.Durability{Mode: redpacketv1alpha1.DurabilityFsync}
	if err := cp.Client.Create(ctx, obj); err != nil {
		t.Fatalf("creating the activity: %v", err)
	}
	act := NewResource(obj)
	sh := store.NewActivity(h.admin, string(act.Object.UID), shards)
	if _, err := sh.Seed(ctx, amounts, store.SeedParams{Count: 90, Total: total, Sponsor: "sponsor-1", Currency: "CNY"}); err != nil {
		t.Fatal(err)
	}
	if r, err := sh.ConfigureWith(ctx, store.Settings{Open: true}); err != nil || r.State != store.StateOpen {
		t.Fatalf("opening: %+v %v", r, err)
	}
	h.act.Store(act)

	// 120 users, 60 of them at home on shard 0, which holds 30 packets.
	var users []string
	onZero := 0
	for k := 0; len(users) < 120; k++ {
		u := "u-" + strconv.Itoa(k)
		if sh.Home(u) == 0 {
			if onZero == 60 {
				continue
			}
			onZero++
		} else if len(users)-onZero >= 60 {
			continue
		}
		users = append(users, u)
	}
	replies := make([]reply, len(users))
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < len(users); i += 8 {
				replies[i] = h.grab(users[i], nil)
			}
		})
	}
	wg.Wait()
	granted, soldOut := map[string]string{}, 0
	var sum int64
	for i, r := range replies {
		switch {
		case r.Status == http.StatusOK && r.Outcome == "granted":
			if prev, dup := granted[r.PacketID]; dup {
				t.Fatalf("packet %s to %s and %s", r.PacketID, prev, users[i])
			}
			granted[r.PacketID] = users[i]
			sum += *r.Amount
		case r.Status == http.StatusConflict && r.Outcome == "sold_out":
			soldOut++
		default:
			t.Fatalf("user %s: %d %s", users[i], r.Status, r.Raw)
		}
	}
	if len(granted) != 90 || sum != total || soldOut != 30 {
		t.Fatalf("%d granted (sum %d of %d), %d sold out; want 90 granted and 30 sold out", len(granted), sum, total, soldOut)
	}
	for i := range shards {
		if m := h.srv.cfg.Guard.MarkShard(act, i); m.ClaimedCount == 0 {
			t.Errorf("no watermark kept for shard %d", i)
		}
	}

	// Shard 1 comes back behind, as after a failover to a replica that missed the
	// last grant: one claim is gone and its packet is listed again, numbered with
	// what the shard's other claims add up to.
	k1 := sh.Shard(1).Keys()
	claims, err := sh.Shard(1).Claims(ctx)
	if err != nil || len(claims) == 0 {
		t.Fatalf("claims of shard 1: %d, %v", len(claims), err)
	}
	var victim string
	for u := range claims {
		victim = u
		break
	}
	var othersAmount int64
	for u, cl := range claims {
		if u != victim {
			othersAmount += cl.Amount
		}
	}
	if err := h.admin.HDel(ctx, k1.Claims, victim).Err(); err != nil {
		t.Fatal(err)
	}
	relisted := fmt.Sprintf("%s:%d@%d:%d", claims[victim].PacketID, claims[victim].Amount, len(claims)-1, othersAmount)
	if err := h.admin.RPush(ctx, k1.Packets, relisted).Err(); err != nil {
		t.Fatal(err)
	}
	if r := h.grab(victim, nil); r.Status != http.StatusServiceUnavailable {
		t.Fatalf("grab of %s on the rolled-back shard: %d %s, want 503", victim, r.Status, r.Raw)
	}
	view, err := sh.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if view.Shards[1].Fenced == "" || view.Whole.FullyFenced() {
		t.Fatalf("after the grab: shard 1 fenced %q, all fenced %v; want shard 1 alone", view.Shards[1].Fenced, view.Whole.FullyFenced())
	}
	// The reporter finds the fence and spreads it.
	rep := &Reporter{Client: cp.Client, Redis: h.admin, Resource: h.act.Load, Guard: h.srv.cfg.Guard}
	if applied, err := rep.ReportOnce(ctx); err != nil || applied {
		t.Fatalf("report of the fenced activity: applied %v, %v; want nothing applied", applied, err)
	}
	view, err = sh.ReadShards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !view.Whole.FullyFenced() {
		t.Fatalf("after the report: shards fenced %v", fencedShards(view))
	}
	if h.srv.cfg.Guard.Problem(act.Object.UID) == "" {
		t.Fatalf("the guard does not say the activity is fenced")
	}
}

func fencedShards(v store.View) []string {
	out := make([]string, len(v.Shards))
	for i, s := range v.Shards {
		out[i] = fmt.Sprintf("%d:%q", i, s.Fenced)
	}
	return out
}
