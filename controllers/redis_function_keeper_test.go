package controllers_test

import (
	"testing"
	"time"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
)

// The controller's "load scripts" step loads the grab-side function library, and
// the manager's function keeper loads it again within a second of each FUNCTION
// FLUSH while the activity lives.
func TestFunctionKeeperRestoresTheLibrary(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := t.Context()
	// A Redis that never had the library (the test servers start with it).
	if err := e.rdb.FunctionFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	e.startController(nil)
	e.create(e.activity("keeper", 1000, 10))
	e.waitPhase("keeper", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if ok, err := lua.GrabLibrary.LoadedOn(ctx, e.rdb); err != nil || !ok {
		t.Fatalf("library %s after the activity went Active: loaded %v, %v", lua.GrabLibrary.Name(), ok, err)
	}
	for i := range 3 {
		if err := e.rdb.FunctionFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		flushed := time.Now()
		for {
			ok, err := lua.GrabLibrary.LoadedOn(ctx, e.rdb)
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				t.Logf("flush %d: library back after %v", i+1, time.Since(flushed).Round(time.Millisecond))
				break
			}
			if time.Since(flushed) > time.Second {
				t.Fatalf("flush %d: the library is still missing after %v", i+1, time.Since(flushed))
			}
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(150 * time.Millisecond)
	}
}
