package faults

import (
	"context"
	"testing"
	"time"

	"redpacket.io/operator/test/redistest"
)

// kill -9 of a redis-server with appendonly yes and appendfsync always in the middle
// of a rain, then a restart on the same files and port while the clients keep
// grabbing: every grant a client was told about is in the claims hash and in the
// stream afterwards, nobody is told two packets and no packet goes to two users, and
// the rain sells out with every packet granted exactly once. The grab service keeps
// running across the crash, with its watermark: the restarted Redis is not behind
// it, so it is not fenced.
//
// A kill -9 ends the process, not the machine: what Redis wrote to the kernel
// survives either way. appendfsync always additionally puts every write on disk
// before its answer leaves Redis, which covers a machine crash; that part cannot be
// simulated here.
func TestKill9WithAOFAlwaysLosesNoAcknowledgedGrant(t *testing.T) {
	needsServers(t)
	ctx := context.Background()
	args := []string{"--appendonly", "yes", "--appendfsync", "always"}
	srv := startRedis(t, args...)
	addr := (*srv).Addr
	admin := adminClient(t, *srv)
	if cfg, err := admin.ConfigGet(ctx, "append*").Result(); err != nil || cfg["appendonly"] != "yes" || cfg["appendfsync"] != "always" {
		t.Fatalf("redis-server persistence: %v %v, want appendonly yes, appendfsync always", cfg, err)
	}

	const packets = 12000
	act, amounts := newActivity("aof-always", packets)
	seedOpen(t, admin, act, amounts)
	svc := startGrabService(t, *srv, addr, act)
	r := newRain(svc, "aof", rainUsers)
	start := time.Now()
	r.start(rainWorkers)

	waitFor(t, 30*time.Second, "3000 acknowledged grants before the kill", func() bool { return r.led.acknowledged() >= 3000 })
	r.phase.Store(1)
	if err := (*srv).Kill(); err != nil {
		t.Fatal(err)
	}
	// The clients keep grabbing at the dead server for a while: 503s and retries.
	waitFor(t, 10*time.Second, "grabs refused while Redis is down", func() bool {
		p := r.led.phase(1)
		return p.Unavailable+p.Transport >= 2*rainWorkers
	})
	// Every answer Redis sent before it died has arrived by now.
	markAtKill := svc.guard.Mark(act)
	restarted, err := redistest.RestartProcess(*srv, args...)
	if err != nil {
		t.Fatalf("restarting redis-server on its AOF: %v", err)
	}
	*srv = restarted
	r.phase.Store(2)
	// The clients are at it again already, so this is a lower bound of what the AOF held.
	back, err := readSnapshot(admin, act)
	if err != nil {
		t.Fatal(err)
	}
	if back.ClaimedCount < markAtKill.ClaimedCount || back.Fenced != "" {
		t.Errorf("Redis came back with %d claims (fenced %q); the grab service had acknowledged up to %d",
			back.ClaimedCount, back.Fenced, markAtKill.ClaimedCount)
	}

	r.wait(t, 40*time.Second)
	elapsed := time.Since(start)
	v := readRedis(t, admin, act)
	f := check(t, r.led, v, act)
	t.Logf("answers by the phase their request started in (0 before the kill, 1 while Redis was down, 2 after the restart): %s", r.led.summary())
	t.Logf("the grab service had acknowledged grants up to claim %d when Redis died, and Redis held at least that many after the restart; %d grants whose answer was lost came back as already_claimed; %s",
		markAtKill.ClaimedCount, f.Recovered, elapsed.Round(time.Millisecond))
	t.Logf("faults: aof-always kill -9: %d grants acknowledged, %d lost, %d regranted", f.Acknowledged, f.Lost, f.Regranted)
	if f.Lost != 0 || f.Regranted != 0 || f.Relisted != 0 {
		t.Errorf("%d acknowledged grants lost, %d regranted, %d acknowledged packets back in the list; want 0", f.Lost, f.Regranted, f.Relisted)
	}
	if f.Acknowledged != packets || v.snap.RemainingCount != 0 || v.snap.Fenced != "" {
		t.Errorf("after the rain: %d grants acknowledged, %d packets left, fenced %q; want all %d packets granted and acknowledged",
			f.Acknowledged, v.snap.RemainingCount, v.snap.Fenced, packets)
	}
	if p := r.led.phase(2); p.Granted == 0 {
		t.Errorf("no grant after the restart: %+v", p)
	}
}
