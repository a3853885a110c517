package faults

import (
	"context"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// A Redis restored from an older RDB copy under a running grab service: SAVE in the
// middle of a rain, a copy of dump.rdb, more grants, the server stopped, the copy
// put back, the server started again. The grants acknowledged after the copy are
// gone from Redis and their packets are back in the unclaimed list; the next grab
// carries the service's watermark, above the copy's count, so it fences the activity
// instead of handing those packets out again. From then on every grab answers 503,
// /readyz answers 503, the controller's configure cannot reopen it and close cannot
// refund from it. The fence field lives in Redis, so a second restore of the same
// copy drops it too; the service's watermark fences that one again.
func TestRestoreFromOlderRDBIsFencedNeverReopened(t *testing.T) {
	needsServers(t)
	ctx := context.Background()
	srv := startRedis(t) // RDB only, written by SAVE alone
	addr, dir := (*srv).Addr, (*srv).Dir()
	admin := adminClient(t, *srv)

	const packets = 20000
	act, amounts := newActivity("restored", packets)
	seedOpen(t, admin, act, amounts)
	svc := startGrabService(t, *srv, addr, act)
	r := newRain(svc, "rdb", rainUsers)
	r.start(rainWorkers)

	waitFor(t, 30*time.Second, "2000 acknowledged grants", func() bool { return r.led.acknowledged() >= 2000 })
	if err := admin.Save(ctx).Err(); err != nil {
		t.Fatalf("SAVE: %v", err)
	}
	backup := filepath.Join(t.TempDir(), "dump.rdb")
	copyFile(t, filepath.Join(dir, "dump.rdb"), backup)
	atCopy := r.led.acknowledged()
	waitFor(t, 30*time.Second, "3000 more acknowledged grants", func() bool { return r.led.acknowledged() >= atCopy+3000 })
	r.stop()
	mark := svc.guard.Mark(act)

	restore := func() store.Snapshot {
		t.Helper()
		if err := (*srv).Kill(); err != nil {
			t.Fatal(err)
		}
		copyFile(t, backup, filepath.Join(dir, "dump.rdb"))
		restarted, err := redistest.RestartProcess(*srv)
		if err != nil {
			t.Fatalf("restarting redis-server on the old copy: %v", err)
		}
		*srv = restarted
		snap, err := readSnapshot(admin, act)
		if err != nil {
			t.Fatal(err)
		}
		if snap.ClaimedCount >= mark.ClaimedCount || snap.Fenced != "" {
			t.Fatalf("the restored Redis holds %d claims, fenced %q; want fewer than the %d acknowledged, not fenced", snap.ClaimedCount, snap.Fenced, mark.ClaimedCount)
		}
		return snap
	}
	restored := restore()

	// The next grab fences it.
	if a := svc.grab("rdb-next"); a.Status != http.StatusServiceUnavailable {
		t.Fatalf("first grab on the restored Redis: %s, want 503", a)
	}
	if snap, err := readSnapshot(admin, act); err != nil || snap.Fenced == "" {
		t.Fatalf("Redis after the first grab: %+v %v, want fenced", snap, err)
	}
	checkFenced(t, svc, r.led, admin, act)

	// The rain goes on: every grab is refused.
	r.phase.Store(1)
	r.start(rainWorkers)
	waitFor(t, 20*time.Second, "1000 grabs on the fenced Redis", func() bool { return r.led.phase(1).Attempts >= 1000 })
	r.stop()

	// The controller cannot reopen it or refund from it.
	if cr, err := handleOf(admin, act).Configure(ctx, 0, 0, false, true); err != nil || !cr.Fenced {
		t.Errorf("configure of the fenced activity: %+v %v, want fenced", cr, err)
	}
	if cl, err := handleOf(admin, act).Close(ctx, store.CloseExpired); err != nil || cl.Outcome != store.CloseFenced {
		t.Errorf("close of the fenced activity: %+v %v, want fenced", cl, err)
	}

	// The same copy restored again carries no fence; the service's watermark fences it.
	restore()
	if a := svc.grab("rdb-again"); a.Status != http.StatusServiceUnavailable {
		t.Errorf("first grab after the second restore: %s, want 503", a)
	}
	v := readRedis(t, admin, act)
	if v.snap.Fenced == "" {
		t.Errorf("the second restore is not fenced after a grab")
	}
	if v.snap.ClaimedCount != restored.ClaimedCount || v.snap.Refunded != 0 || v.snap.State != store.StateOpen {
		t.Errorf("Redis after the refusals: %d claims, refunded %d, state %s; want the copy's %d claims, nothing refunded, still open",
			v.snap.ClaimedCount, v.snap.Refunded, v.snap.State, restored.ClaimedCount)
	}
	f := check(t, r.led, v, act)
	after := r.led.phase(1)
	t.Logf("answers before the restore: %+v; on the restored Redis: %+v", r.led.phase(0), after)
	t.Logf("the copy holds %d claims, the grab service had acknowledged up to claim %d: %d acknowledged grants rolled back, their packets back in the unclaimed list (%d), fenced instead of granted again",
		restored.ClaimedCount, mark.ClaimedCount, f.Lost, f.Relisted)
	t.Logf("faults: restore of an older RDB: %d grants acknowledged, %d rolled back by the restore, %d granted after it, %d regranted",
		f.Acknowledged, f.Lost, after.Granted, f.Regranted)
	if f.Regranted != 0 || after.Granted != 0 || after.Unavailable != after.Attempts-after.AlreadyClaimed {
		t.Errorf("on the restored Redis: %d regranted, answers %+v; want 0 regrants and every new grab refused with 503", f.Regranted, after)
	}
	if f.Lost == 0 || f.Relisted != f.Lost {
		t.Errorf("the restore rolled back %d acknowledged grants, %d of their packets are back in the list; the test needs a rollback", f.Lost, f.Relisted)
	}
}
