package grabsvc

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"

	"redpacket.io/operator/controllers"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// FUNCTION FLUSH and SCRIPT FLUSH every 200 ms during a burst of concurrent grabs,
// made as the grab service makes them: as the activity's own Redis user, which may
// not load the library, through the auto-pipeliner. The operator's function keeper
// runs beside, checking every 100 ms. Every answer is a correct outcome or an error
// (the grab service's retryable 503); retried afterwards, every user who was told
// granted holds exactly that packet, no packet went to two users, an errored grab
// took at most one packet that its retry returns, and the totals conserve.
func TestFunctionFlushDuringBurstWithKeeper(t *testing.T) {
	ctx := redistest.Context(t)
	const operatorPassword, userPassword = "operator-pw-0123", "grab-user-pw-0123456789"
	srv, admin := redistest.StartProtected(t, operatorPassword)
	act := testActivity("fflush")
	uid := string(act.Object.UID)
	const (
		workers = 32
		packets = 3000
		// The burst lasts until this many flushes have hit it, and at least until
		// more users than packets have grabbed.
		minFlushes = 6
	)
	amounts := ones(packets)
	var total int64
	for _, a := range amounts {
		total += a
	}
	seed(t, admin, act, amounts, 0, 0, false)
	if _, err := handleOf(admin, act).EnsureUser(ctx, userPassword); err != nil {
		t.Fatal(err)
	}
	userConn := redisconn.Conn{Addresses: []string{srv.Addr}, Mode: redisconn.ModeStandalone,
		Username: handleOf(nil, act).UserName(), Password: userPassword}
	rc, err := userConn.NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	// The activity's user may not restore the library itself.
	if err := rc.Client.FunctionLoad(ctx, lua.GrabLibrary.Code()).Err(); err == nil {
		t.Fatal("the activity's user could run FUNCTION LOAD")
	}

	keeper := controllers.NewFunctionKeeper(func(redisconn.Conn) redis.UniversalClient { return admin })
	keeper.Interval = 100 * time.Millisecond
	keeper.Track(types.UID(uid), srv.Conn())
	kctx, stopKeeper := context.WithCancel(ctx)
	defer stopKeeper()
	go func() { _ = keeper.Start(kctx) }()

	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		granted  = map[string]store.GrabResult{} // by user
		byPacket = map[string]string{}
		errored  []string
		wrong    []error
		done     atomic.Bool
	)
	h := handleOf(rc.Pipeliner, act)
	var flushes, grabs atomic.Int64
	for w := range workers {
		wg.Go(func() {
			for i := 0; flushes.Load() < minFlushes || grabs.Load() < packets+500; i++ {
				user := fmt.Sprintf("w%d-u%d", w, i)
				res, _, err := h.Grab(ctx, user, nil)
				grabs.Add(1)
				mu.Lock()
				switch {
				case err != nil:
					errored = append(errored, user)
				case res.Outcome == store.Granted:
					if prev, dup := byPacket[res.PacketID]; dup {
						wrong = append(wrong, fmt.Errorf("packet %s granted to %s and %s", res.PacketID, prev, user))
					}
					byPacket[res.PacketID] = user
					granted[user] = res
				case res.Outcome == store.SoldOut:
				default:
					wrong = append(wrong, fmt.Errorf("outcome %s for %s, a first grab", res.Outcome, user))
				}
				mu.Unlock()
				time.Sleep(2 * time.Millisecond) // spread the burst over the flushes
			}
		})
	}
	go func() { wg.Wait(); done.Store(true) }()
	for !done.Load() {
		time.Sleep(200 * time.Millisecond)
		if err := admin.FunctionFlush(ctx).Err(); err != nil {
			t.Fatalf("FUNCTION FLUSH: %v", err)
		}
		if err := admin.ScriptFlush(ctx).Err(); err != nil {
			t.Fatalf("SCRIPT FLUSH: %v", err)
		}
		flushes.Add(1)
	}
	for _, err := range wrong {
		t.Error(err)
	}
	t.Logf("%d flushes, %d grabs, %d grants, %d errors (503), %d restores by the keeper", flushes.Load(), grabs.Load(),
		len(granted), len(errored), keeper.Restored())
	if len(errored) == 0 || keeper.Restored() < minFlushes/2 {
		t.Fatalf("%d errored grabs, %d restores: the flushes did not hit the burst", len(errored), keeper.Restored())
	}

	// The keeper has the library back within its interval; the errored users retry.
	time.Sleep(300 * time.Millisecond)
	for _, user := range errored {
		res, _, err := h.Grab(ctx, user, nil)
		if err != nil {
			t.Fatalf("retry for %s after the burst: %v", user, err)
		}
		switch res.Outcome {
		case store.Granted, store.AlreadyClaimed:
			if prev, dup := byPacket[res.PacketID]; dup {
				t.Errorf("packet %s granted to %s and, on retry, to %s", res.PacketID, prev, user)
			}
			byPacket[res.PacketID] = user
			granted[user] = res
		case store.SoldOut:
		default:
			t.Errorf("retry for %s: %s", user, res.Outcome)
		}
	}
	claims, err := handleOf(admin, act).Shard(0).Claims(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var sum int64
	for user, c := range claims {
		g, ok := granted[user]
		if !ok || g.PacketID != c.PacketID || g.Amount != c.Amount {
			t.Errorf("user %s holds %s (%d), was told %+v", user, c.PacketID, c.Amount, g)
		}
		sum += c.Amount
	}
	snap, err := handleOf(admin, act).Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(claims) != len(granted) || len(claims) != packets || sum != total ||
		snap.ClaimedCount+snap.RemainingCount != packets || snap.ClaimedAmount+snap.RemainingAmount() != total {
		t.Fatalf("%d claims (sum %d), %d told granted, snapshot %+v; want %d packets summing to %d",
			len(claims), sum, len(granted), snap, packets, total)
	}
}

// Over HTTP: with the function library gone, a grab answers 503 unavailable with a
// sentence saying so, changes nothing and does not load the library; once the
// operator loaded it again, the same user's retry is granted.
func TestMissingFunctionsAnswerUnavailable(t *testing.T) {
	h := newHarness(t)
	act := testActivity("nofunctions")
	h.useActivity(act, ones(3), 0, 0, false)
	ctx := context.Background()
	before := h.state(act)
	if err := h.admin.FunctionFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	r := h.grab("u1", nil)
	if r.Status != 503 || r.Outcome != OutcomeUnavailable || !strings.Contains(r.Error, "operator is loading them again") {
		t.Fatalf("grab without the functions: %d %s %q", r.Status, r.Outcome, r.Error)
	}
	if ok, err := lua.GrabLibrary.LoadedOn(ctx, h.admin); err != nil || ok {
		t.Fatalf("the grab service loaded the library itself: %v, %v", ok, err)
	}
	if err := handleOf(h.admin, act).LoadScripts(ctx); err != nil {
		t.Fatal(err)
	}
	if after := h.state(act); after != before {
		t.Fatalf("the refused grab changed Redis: %+v, was %+v", after, before)
	}
	if r := h.grab("u1", nil); r.Status != 200 || r.Outcome != "granted" {
		t.Fatalf("retry once the operator loaded the functions: %d %s %q", r.Status, r.Outcome, r.Error)
	}
}
