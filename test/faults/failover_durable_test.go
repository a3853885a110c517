package faults

import (
	"context"
	"testing"
	"time"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// The same failover with spec.durability Replicas 1: a grant is answered only once
// the replica holds it (WAIT, batched). When replication is cut, the primary goes on
// granting but no grab is answered 200 any more (each answers 503 once the WAIT
// falls short); then the primary is killed and the replica promoted. Every grant
// acknowledged before the failover is on the promoted replica, which is therefore
// not behind the grab service's watermark and is not fenced. Once the promoted
// replica has a replica of its own, the rain goes on there and sells out: every
// packet granted once, every acknowledged grant in the claims hash and the stream.
func TestFailoverWithReplicaDurabilityLosesNoAcknowledgedGrant(t *testing.T) {
	needsServers(t)
	pair := startReplicatedPair(t)
	const packets = 8000
	act, amounts := newActivity("replicated", packets)
	act.Object.Spec.Durability = &redpacketv1alpha1.Durability{
		Mode: redpacketv1alpha1.DurabilityReplicas, Replicas: 1, TimeoutMilliseconds: 200,
	}
	pair.seedReplicated(t, act, amounts)
	svc := startGrabService(t, pair.primary, pair.front.Addr(), act)
	r := newRain(svc, "dur", rainUsers)
	start := time.Now()
	r.start(rainWorkers)

	waitFor(t, 30*time.Second, "2500 acknowledged grants", func() bool { return r.led.acknowledged() >= 2500 })
	pair.cutReplication(t)
	r.phase.Store(1)
	// The primary goes on running grabs, but none is acknowledged: the WAITs fall short.
	waitFor(t, 20*time.Second, "grabs held back by a replica that does not answer", func() bool {
		return r.led.phase(1).Unavailable >= 3*rainWorkers
	})
	pair.killPrimary(t)
	r.phase.Store(2)
	promoted := pair.promote(t, act)
	waitFor(t, 10*time.Second, "grabs refused while no primary answers", func() bool {
		return r.led.phase(2).Unavailable >= rainWorkers
	})
	r.settle(t, 1)
	mark := svc.guard.Mark(act)
	// Every grant acknowledged so far is on the promoted replica.
	v := readRedis(t, pair.radmin, act)
	atFailover := check(t, r.led, v, act)
	if atFailover.Lost != 0 || atFailover.Relisted != 0 || promoted.ClaimedCount < mark.ClaimedCount || promoted.Fenced != "" {
		t.Fatalf("the promoted replica lacks %d of the %d grants acknowledged (%d packets back in its list); it holds %d claims, the watermark is %d, fenced %q",
			atFailover.Lost, atFailover.Acknowledged, atFailover.Relisted, promoted.ClaimedCount, mark.ClaimedCount, promoted.Fenced)
	}

	// The promoted replica gets a replica of its own, and the service address moves.
	second := *startReplica(t, pair.replica, "")
	waitLinkUp(t, adminClient(t, second))
	pair.front.Retarget(pair.replica.Addr)
	r.wait(t, 40*time.Second)
	elapsed := time.Since(start)

	v = readRedis(t, pair.radmin, act)
	f := check(t, r.led, v, act)
	t.Logf("answers: before the cut %+v; replication cut %+v; from the kill of the primary on %+v",
		r.led.phase(0), r.led.phase(1), r.led.phase(2))
	t.Logf("%d grants acknowledged before the failover, all on the promoted replica (%d claims there, watermark %d); %d grants whose answer was held back came back as already_claimed; %s",
		atFailover.Acknowledged, promoted.ClaimedCount, mark.ClaimedCount, f.Recovered, elapsed.Round(time.Millisecond))
	t.Logf("faults: failover with durability replicas:1: %d grants acknowledged (%d before the failover), %d lost, %d regranted",
		f.Acknowledged, atFailover.Acknowledged, f.Lost, f.Regranted)
	if f.Lost != 0 || f.Regranted != 0 || f.Relisted != 0 {
		t.Errorf("%d acknowledged grants lost, %d regranted, %d acknowledged packets back in the list; want 0", f.Lost, f.Regranted, f.Relisted)
	}
	if f.Acknowledged != packets || v.snap.RemainingCount != 0 || v.snap.Fenced != "" {
		t.Errorf("after the rain: %d grants acknowledged, %d packets left, fenced %q; want all %d packets granted and acknowledged",
			f.Acknowledged, v.snap.RemainingCount, v.snap.Fenced, packets)
	}
	if p := r.led.phase(1); p.Granted+p.AlreadyClaimed != 0 {
		t.Errorf("%d grabs started while the replica was cut off were answered 200; want 503 for each", p.Granted+p.AlreadyClaimed)
	}
	if cr, err := handleOf(pair.radmin, act).Configure(context.Background(), 0, 0, false, true); err != nil || cr.Fenced {
		t.Errorf("configure on the promoted replica: %+v %v, want it open", cr, err)
	}
}
