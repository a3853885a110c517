package faults

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/history"
	"redpacket.io/operator/test/redistest"
)

// replicatedPair is a primary and a replica (replicaof), as a Sentinel or managed
// deployment runs them. The replica reaches the primary through link, so that the
// test can cut replication; the grab service reaches whichever is primary through
// front, the service address that a failover moves.
type replicatedPair struct {
	primary, replica *redistest.Server
	link, front      *history.Proxy
	padmin, radmin   *redis.Client
}

// startReplicatedPair starts both servers and waits until the replica is in sync.
func startReplicatedPair(t *testing.T) *replicatedPair {
	t.Helper()
	fullSyncAtOnce := []string{"--repl-diskless-sync-delay", "0"}
	p := &replicatedPair{primary: *startRedis(t, fullSyncAtOnce...)}
	var err error
	if p.link, err = history.NewProxy(p.primary.Addr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.link.Close)
	linkPort := p.link.Addr()[len("127.0.0.1:"):]
	p.replica = *startReplica(t, p.primary, "127.0.0.1:"+linkPort, fullSyncAtOnce...)
	if p.front, err = history.NewProxy(p.primary.Addr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.front.Close)
	p.padmin, p.radmin = adminClient(t, p.primary), adminClient(t, p.replica)
	waitLinkUp(t, p.radmin)
	return p
}

// waitLinkUp waits until replica c is in sync with its primary.
func waitLinkUp(t *testing.T, c *redis.Client) {
	t.Helper()
	waitFor(t, 20*time.Second, "the replica "+c.Options().Addr+" in sync", func() bool {
		return infoField(t, c, "replication", "master_link_status") == "up"
	})
}

// cutReplication cuts the replica's link: it keeps what it received and gets nothing
// more, while the primary goes on accepting writes.
func (p *replicatedPair) cutReplication(t *testing.T) {
	t.Helper()
	p.link.Retarget(deadAddr(t))
	waitFor(t, 10*time.Second, "the replica's link down", func() bool {
		return infoField(t, p.radmin, "replication", "master_link_status") == "down"
	})
}

// killPrimary ends the primary with SIGKILL.
func (p *replicatedPair) killPrimary(t *testing.T) {
	t.Helper()
	if err := p.primary.Kill(); err != nil {
		t.Fatal(err)
	}
}

// promote makes the replica a primary (REPLICAOF NO ONE), without moving the
// service address yet. It returns the promoted replica's counters.
func (p *replicatedPair) promote(t *testing.T, act *grabsvc.Resource) store.Snapshot {
	t.Helper()
	ctx := context.Background()
	if err := p.radmin.Do(ctx, "REPLICAOF", "NO", "ONE").Err(); err != nil {
		t.Fatalf("promoting the replica: %v", err)
	}
	if role := infoField(t, p.radmin, "replication", "role"); role != "master" {
		t.Fatalf("the promoted replica's role is %q", role)
	}
	snap, err := readSnapshot(p.radmin, act)
	if err != nil {
		t.Fatal(err)
	}
	return snap
}

// seedReplicated seeds on the primary and waits until the replica holds the seed.
func (p *replicatedPair) seedReplicated(t *testing.T, act *grabsvc.Resource, amounts []int64) {
	t.Helper()
	seedOpen(t, p.padmin, act, amounts)
	if n, err := p.padmin.Wait(context.Background(), 1, 10*time.Second).Result(); err != nil || n != 1 {
		t.Fatalf("WAIT for the replica after seeding: %d %v", n, err)
	}
}

// A failover to a replica that lags: replication is cut in the middle of a rain (the
// replica's link to the primary is killed and cannot come back), the primary goes on
// granting (and the grab service on acknowledging), the primary is killed, the
// replica promoted and the service address moved to it. The promoted
// replica lacks the last acknowledged grants and holds their packets as unclaimed;
// the next grab carries the service's watermark and fences it. Every grab after the
// failover answers 503, nothing is granted again, /readyz answers 503, and the
// controller can neither reopen nor close the activity there.
func TestFailoverToALaggingReplicaIsFenced(t *testing.T) {
	needsServers(t)
	ctx := context.Background()
	pair := startReplicatedPair(t)
	act, amounts := newActivity("lagging", 20000)
	pair.seedReplicated(t, act, amounts)
	svc := startGrabService(t, pair.primary, pair.front.Addr(), act)
	r := newRain(svc, "lag", rainUsers)
	r.start(rainWorkers)

	waitFor(t, 30*time.Second, "3000 acknowledged grants", func() bool { return r.led.acknowledged() >= 3000 })
	pair.cutReplication(t)
	atCut := r.led.acknowledged()
	waitFor(t, 30*time.Second, "3000 more grants acknowledged by the primary alone", func() bool { return r.led.acknowledged() >= atCut+3000 })
	pair.killPrimary(t)
	r.phase.Store(1)
	promoted := pair.promote(t, act)
	waitFor(t, 10*time.Second, "grabs refused while no primary answers", func() bool { return r.led.phase(1).Unavailable >= rainWorkers })
	mark := svc.guard.Mark(act)
	if promoted.ClaimedCount >= mark.ClaimedCount || promoted.Fenced != "" {
		t.Fatalf("the promoted replica holds %d claims, fenced %q; the test needs it behind the %d acknowledged", promoted.ClaimedCount, promoted.Fenced, mark.ClaimedCount)
	}
	pair.front.Retarget(pair.replica.Addr)
	r.phase.Store(2)
	waitFor(t, 20*time.Second, "1000 grabs on the promoted replica", func() bool { return r.led.phase(2).Attempts >= 1000 })
	r.stop()

	checkFenced(t, svc, r.led, pair.radmin, act)
	if cr, err := handleOf(pair.radmin, act).Configure(ctx, 0, 0, false, true); err != nil || !cr.Fenced {
		t.Errorf("configure on the promoted replica: %+v %v, want fenced", cr, err)
	}
	if cl, err := handleOf(pair.radmin, act).Close(ctx, store.CloseExpired); err != nil || cl.Outcome != store.CloseFenced {
		t.Errorf("close on the promoted replica: %+v %v, want fenced", cl, err)
	}
	v := readRedis(t, pair.radmin, act)
	if v.snap.Fenced == "" || v.snap.ClaimedCount != promoted.ClaimedCount || v.snap.Refunded != 0 {
		t.Errorf("the promoted replica after the grabs: fenced %q, %d claims, refunded %d; want fenced, the %d claims it came with, nothing refunded",
			v.snap.Fenced, v.snap.ClaimedCount, v.snap.Refunded, promoted.ClaimedCount)
	}
	f := check(t, r.led, v, act)
	during, after := r.led.phase(1), r.led.phase(2)
	t.Logf("answers: before the failover %+v; during it %+v; on the promoted replica %+v", r.led.phase(0), during, after)
	t.Logf("the promoted replica holds %d claims, the grab service had acknowledged up to claim %d: %d acknowledged grants missing there, their packets unclaimed (%d), fenced instead of granted again",
		promoted.ClaimedCount, mark.ClaimedCount, f.Lost, f.Relisted)
	t.Logf("faults: failover to a lagging replica: %d grants acknowledged, %d missing on the promoted replica (asynchronous replication), %d granted after the failover, %d regranted",
		f.Acknowledged, f.Lost, during.Granted+after.Granted, f.Regranted)
	if f.Regranted != 0 || during.Granted+after.Granted != 0 || after.Unavailable != after.Attempts-after.AlreadyClaimed {
		t.Errorf("on the promoted replica: %d regranted, answers %+v; want 0 regrants and every new grab refused with 503", f.Regranted, after)
	}
	if f.Lost == 0 || f.Relisted != f.Lost {
		t.Errorf("%d acknowledged grants missing on the promoted replica, %d of their packets unclaimed there; the test needs a lagging replica", f.Lost, f.Relisted)
	}
}

// checkFenced checks what a client and a probe see of a fenced activity: a new user
// is refused with 503; a user acknowledged a grant that c lacks is refused, not
// handed another packet; a user whose grant c holds gets the same packet back as
// already_claimed; /readyz answers 503; c holds the fence.
func checkFenced(t *testing.T, svc *grabService, led *ledger, c *redis.Client, act *grabsvc.Resource) {
	t.Helper()
	if a := svc.grab("fenced-newcomer"); a.Status != http.StatusServiceUnavailable || a.Outcome != grabsvc.OutcomeUnavailable {
		t.Errorf("grab of a new user: %s, want 503", a)
	}
	claims, err := handleOf(c, act).Shard(0).Claims(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var gone, kept string
	led.mu.Lock()
	for user := range led.acks {
		if _, ok := claims[user]; ok {
			kept = user
		} else {
			gone = user
		}
	}
	keptPacket := led.acks[kept]
	led.mu.Unlock()
	if gone == "" || kept == "" {
		t.Fatalf("Redis holds %d of the %d acknowledged grants; the check needs some on each side", len(claims), led.acknowledged())
	}
	if a := svc.grab(gone); a.Status != http.StatusServiceUnavailable {
		t.Errorf("grab of %s, whose acknowledged grant Redis lacks: %s, want 503", gone, a)
	}
	if a := svc.grab(kept); a.Outcome != string(store.AlreadyClaimed) || a.PacketID != keptPacket.PacketID || a.Amount != keptPacket.Amount {
		t.Errorf("grab of %s, acknowledged packet %s which Redis holds: %s, want already_claimed of it", kept, keptPacket.PacketID, a)
	}
	if code := svc.readyz(); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz of the fenced activity: %d, want 503", code)
	}
	if snap, err := readSnapshot(c, act); err != nil || snap.Fenced == "" {
		t.Errorf("Redis after the grabs: fenced %q, %v; want the fence set", snap.Fenced, err)
	}
}
