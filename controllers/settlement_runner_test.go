package controllers_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"redpacket.io/operator/controllers"
	"redpacket.io/operator/test/wait"
)

// fakeWorker records the runs of one registered worker.
type fakeWorker struct {
	mu      sync.Mutex
	started int
	running int
}

func (f *fakeWorker) run(ctx context.Context) {
	f.mu.Lock()
	f.started++
	f.running++
	f.mu.Unlock()
	<-ctx.Done()
	f.mu.Lock()
	f.running--
	f.mu.Unlock()
}

func (f *fakeWorker) counts() (started, running int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.started, f.running
}

// The registry of the operator's deletion settlement workers runs one worker per
// activity, only on the elected leader, from the manager's start to its stop;
// restarts a worker whose configuration changed; and stops workers on request,
// waiting until they have stopped.
func TestSettlementRunnerRunOneWorkerPerActivity(t *testing.T) {
	t.Parallel()
	d := controllers.NewSettlementRunner()
	var _ manager.Runnable = d
	if !d.NeedLeaderElection() {
		t.Fatal("NeedLeaderElection() is false: every operator replica would deliver")
	}
	name := types.NamespacedName{Namespace: "ns", Name: "quiz"}
	first, second, other := &fakeWorker{}, &fakeWorker{}, &fakeWorker{}

	// Asked for before the manager starts it: started by Start.
	d.Ensure("uid-1", name, "v1", first.run)
	if s, _ := first.counts(); s != 0 {
		t.Fatalf("worker started before the registry")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Start(ctx) }()
	wait.Until(t, 5*time.Second, "the worker started", func() (bool, string) {
		_, r := first.counts()
		return r == 1, ""
	})

	// The same configuration again: left alone.
	d.Ensure("uid-1", name, "v1", second.run)
	time.Sleep(50 * time.Millisecond)
	if s, r := first.counts(); s != 1 || r != 1 {
		t.Fatalf("first worker started %d, running %d after the same configuration; want 1, 1", s, r)
	}
	if s, _ := second.counts(); s != 0 {
		t.Fatalf("a second worker started for the same configuration")
	}
	// A new configuration: the old worker has stopped before the new one runs.
	d.Ensure("uid-1", name, "v2", second.run)
	if _, r := first.counts(); r != 0 {
		t.Fatalf("the old worker still runs after a configuration change")
	}
	wait.Until(t, 5*time.Second, "the new worker started", func() (bool, string) {
		_, r := second.counts()
		return r == 1, ""
	})
	// A worker of another activity of the same name (re-created) is stopped by name.
	d.Ensure("uid-2", name, "v1", other.run)
	wait.Until(t, 5*time.Second, "the other worker started", func() (bool, string) {
		_, r := other.counts()
		return r == 1, ""
	})
	d.StopNamed(name, "uid-2")
	if _, r := second.counts(); r != 0 || d.Running("uid-1") {
		t.Fatalf("the replaced activity's worker still runs")
	}
	if !d.Running("uid-2") {
		t.Fatalf("the kept activity's worker was stopped")
	}
	d.Stop("uid-2")
	if _, r := other.counts(); r != 0 || d.Len() != 0 {
		t.Fatalf("worker still running after Stop (running %d, registered %d)", r, d.Len())
	}

	// The manager stops: every worker stops, and none starts afterwards.
	late := &fakeWorker{}
	d.Ensure("uid-3", name, "v1", first.run)
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Start returned %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Start did not return after its context ended")
	}
	if _, r := first.counts(); r != 0 || d.Len() != 0 {
		t.Fatalf("workers left after the manager stopped: running %d, registered %d", r, d.Len())
	}
	d.Ensure("uid-4", name, "v1", late.run)
	time.Sleep(50 * time.Millisecond)
	if s, _ := late.counts(); s != 0 || d.Len() != 0 {
		t.Fatalf("a worker started after the manager stopped")
	}
}
