package grabsvc

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

func TestActivitySourceWaitsThenFollowsChanges(t *testing.T) {
	cp := controlPlane(t)
	ns := cp.Namespace(t)
	var changes atomic.Int32
	var lastPaused atomic.Bool
	src := &ActivitySource{
		Client:  cp.Client,
		Key:     types.NamespacedName{Namespace: ns, Name: "later"},
		Refresh: 100 * time.Millisecond,
		Retry:   50 * time.Millisecond,
		Log:     slog.New(slog.DiscardHandler),
		OnChange: func(a *Resource) {
			changes.Add(1)
			lastPaused.Store(a.Object.Spec.Paused)
		},
	}
	srv, err := NewServer(Config{Redis: redistest.Start(t).Client(t), Resource: src.Current})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() { defer close(done); src.Run(ctx) }()

	time.Sleep(200 * time.Millisecond)
	if src.Current() != nil {
		t.Fatal("an activity that does not exist was found")
	}
	if ok, why := srv.Ready(ctx); ok {
		t.Fatal("ready before the activity exists")
	} else if why == "" {
		t.Fatal("no reason for not being ready")
	}

	obj := activityForStatus(ns, "later", 10, 100)
	if err := cp.Client.Create(ctx, obj); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 3*time.Second, "the activity to be found", func() (bool, string) { return src.Current() != nil, "" })
	cur := src.Current()
	if cur.Object.UID != obj.UID || handleOf(nil, cur).UID() != string(obj.UID) || cur.Ref != ns+"/later" {
		t.Fatalf("activity %+v, keys %+v", cur.Object.ObjectMeta, keysOf(cur))
	}
	if ok, why := srv.Ready(ctx); !ok {
		t.Fatalf("not ready once the activity is known: %s", why)
	}
	if changes.Load() != 1 {
		t.Fatalf("%d change callbacks, want 1", changes.Load())
	}

	// A spec change is seen at the next refresh.
	obj.Spec.Paused = true
	obj.Spec.Settlement = &redpacketv1alpha1.Settlement{
		Webhook: &redpacketv1alpha1.Webhook{URL: "http://balance.example:8080/credit"}, MaxAttempts: 3,
	}
	if err := cp.Client.Update(ctx, obj); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 3*time.Second, "the spec change", func() (bool, string) {
		a := src.Current()
		return a.Object.Spec.Paused && a.Object.Spec.Settlement != nil && lastPaused.Load(), ""
	})
	if n := changes.Load(); n != 2 {
		t.Fatalf("%d change callbacks, want 2", n)
	}
	// Unchanged re-reads do not call back.
	time.Sleep(350 * time.Millisecond)
	if n := changes.Load(); n != 2 {
		t.Fatalf("%d change callbacks after idle refreshes, want 2", n)
	}

	// A failed refresh (the resource is gone) keeps the last activity.
	if err := cp.Client.Delete(ctx, obj); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if a := src.Current(); a == nil || a.Object.UID != obj.UID {
		t.Fatal("the last activity was dropped after a failed refresh")
	}
	cancel()
	<-done
}

// TestActivitySourceFollowsOneUID checks that a source pinned to a UID never takes
// up a new activity created under the same name after the first was deleted.
func TestActivitySourceFollowsOneUID(t *testing.T) {
	cp := controlPlane(t)
	ns := cp.Namespace(t)
	ctx := t.Context()
	first := activityForStatus(ns, "again", 10, 100)
	if err := cp.Client.Create(ctx, first); err != nil {
		t.Fatal(err)
	}
	src := &ActivitySource{Client: cp.Client, Key: types.NamespacedName{Namespace: ns, Name: "again"}, UID: first.UID,
		Log: slog.New(slog.DiscardHandler)}
	if err := src.Fetch(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cp.Client.Delete(ctx, first); err != nil {
		t.Fatal(err)
	}
	second := activityForStatus(ns, "again", 10, 100)
	wait.Until(t, 10*time.Second, "the activity created again", func() (bool, string) {
		return cp.Client.Create(ctx, second) == nil, ""
	})
	err := src.Fetch(ctx)
	if err == nil {
		t.Fatal("a source pinned to the first activity accepted its successor")
	}
	if cur := src.Current(); cur == nil || cur.Object.UID != first.UID {
		t.Fatalf("current activity %v, want the first (uid %s)", cur, first.UID)
	}

	// Without a UID the source follows the name, as before.
	free := &ActivitySource{Client: cp.Client, Key: src.Key, Log: slog.New(slog.DiscardHandler)}
	if err := free.Fetch(ctx); err != nil || free.Current().Object.UID != second.UID {
		t.Fatalf("an unpinned source: %v, %v", free.Current(), err)
	}
}
