package grabsvc

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"

	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// TestPacketsOnACluster runs the packet API on a 3-master Redis Cluster, as the grab
// fleet's clients reach it: 40 packets of 5 shares are created concurrently through
// HTTP, each raced by 20 users at once, and every packet is exact: 5 winners whose
// amounts sum to its total, no user twice, everyone else sold out; the budget adds up.
func TestPacketsOnACluster(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	ctx := context.Background()
	budget := Budget{Namespace: "shop", Name: "group", UID: types.UID(uuid.NewUUID()), Shards: 12}
	admin := cl.Client(t)
	handle := store.NewBudget(admin, string(budget.UID), budget.Shards)
	if err := handle.Configure(ctx, 1_200_000, packetLimits()); err != nil {
		t.Fatal(err)
	}
	rc, err := cl.Conn().NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	sender, _ := NewSenderCredential([]byte(senderSecret))
	srv, err := NewPacketServer(PacketConfig{Budget: budget, Redis: rc.Pipeliner, Ping: rc.Client, Sender: sender,
		RedisTimeout: 2 * time.Second, Metrics: NewPacketMetrics(prometheus.NewRegistry())})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(hs.Close)
	h := &packetHarness{t: t, http: hs}

	const packets, users = 40, 20
	totals := make([]int64, packets)
	var wg sync.WaitGroup
	for p := range packets {
		totals[p] = int64(1000 + 37*p)
		wg.Go(func() {
			a := h.create(fmt.Sprintf(`{"id":"order-%d","sender":"m","totalAmount":%d,"count":5}`, p, totals[p]))
			if a.Status != http.StatusCreated {
				t.Errorf("create order-%d: %d %s", p, a.Status, a.Raw)
			}
		})
	}
	wg.Wait()
	type win struct {
		user   string
		share  int64
		amount int64
	}
	wins := make([][]win, packets)
	var mu sync.Mutex
	for p := range packets {
		for u := range users {
			wg.Go(func() {
				user := "user-" + strconv.Itoa(u)
				a := h.grab(fmt.Sprintf("order-%d", p), user, nil)
				switch {
				case a.Status == http.StatusOK && a.str("outcome") == "granted":
					mu.Lock()
					wins[p] = append(wins[p], win{user, a.num("share"), a.num("amount")})
					mu.Unlock()
				case a.Status == http.StatusConflict && a.str("outcome") == "sold_out":
				default:
					t.Errorf("grab of order-%d by %s: %d %s", p, user, a.Status, a.Raw)
				}
			})
		}
	}
	wg.Wait()
	shards := map[int]bool{}
	for p := range packets {
		var sum int64
		seen := map[string]bool{}
		shares := map[int64]bool{}
		for _, w := range wins[p] {
			sum += w.amount
			if seen[w.user] || shares[w.share] {
				t.Errorf("order-%d: user %s or share %d twice", p, w.user, w.share)
			}
			seen[w.user], shares[w.share] = true, true
		}
		if len(wins[p]) != 5 || sum != totals[p] {
			t.Errorf("order-%d: %d winners summing to %d, want 5 summing to %d", p, len(wins[p]), sum, totals[p])
		}
		shards[handle.ShardOf(fmt.Sprintf("order-%d", p))] = true
	}
	snap, err := handle.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var all int64
	for _, v := range totals {
		all += v
	}
	if !snap.Conserved() || snap.Claimed != all || snap.GrabbedShares != 5*packets || snap.Live != 0 {
		t.Fatalf("the budget after the race: %+v, want %d claimed", snap, all)
	}
	t.Logf("%d packets over %d of %d budget shards on 3 masters: all exact; claimed %d, available %d", packets, len(shards), budget.Shards, snap.Claimed, snap.Available)
}
