package grabsvc

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// Resource is the grab service's view of its RedPacketActivity: the resource as last
// read from the API server, and how user tokens name it.
type Resource struct {
	// Object is the resource. Treat it as read-only: it is shared.
	Object *redpacketv1alpha1.RedPacketActivity
	// Ref is "<namespace>/<name>", as user tokens name the activity.
	Ref string
}

// NewResource wraps a resource read from the API server.
func NewResource(obj *redpacketv1alpha1.RedPacketActivity) *Resource {
	return &Resource{
		Object: obj,
		Ref:    obj.Namespace + "/" + obj.Name,
	}
}

// handles keeps the Redis handle (store.Activity) of the current activity on one
// client, so the hot path builds it once per activity, not once per call. The
// zero value is ready to use; the client must be the same on every call.
type handles struct {
	cur atomic.Pointer[handle]
	// replicated, when set, gives each new handle its Replicated (store.Activity): how a
	// transfer between shards waits for replicas.
	replicated func(shard int) func(context.Context) error
	// marks, when set, gives each new handle of a sharded activity its Marks
	// (store.Activity): the guard's watermarks, for the transfers of its refills.
	marks func(uid types.UID, n int) store.ShardMarks
}

type handle struct {
	uid types.UID
	h   *store.Activity
}

// of returns the handle of act, over its spec.shards shards, on c.
func (hs *handles) of(c redis.Cmdable, act *Resource) *store.Activity {
	if cur := hs.cur.Load(); cur != nil && cur.uid == act.Object.UID {
		return cur.h
	}
	h := &handle{uid: act.Object.UID, h: store.NewActivity(c, string(act.Object.UID), act.Object.Spec.ShardCount())}
	if hs.replicated != nil {
		h.h.Replicated = func(ctx context.Context, shard int) error {
			if wait := hs.replicated(shard); wait != nil {
				return wait(ctx)
			}
			return nil
		}
	}
	if n := act.Object.Spec.ShardCount(); hs.marks != nil && n > 1 {
		h.h.Marks = hs.marks(act.Object.UID, n)
	}
	hs.cur.Store(h)
	return h.h
}

// ActivitySource reads the activity from the API server: first until it is found,
// then periodically, so spec changes (pause, window, settlement) are seen.
type ActivitySource struct {
	// Client reads RedPacketActivity objects.
	Client client.Reader
	// Key names the activity.
	Key types.NamespacedName
	// UID, when set, is the one activity this source follows. A resource of the same
	// name with another UID (the activity was deleted and created again, perhaps with
	// other auth or settlement settings) is not this service's: it is never installed,
	// and the last activity read stays current, so a grab pod left running by an
	// orphaning deletion cannot serve its successor.
	UID types.UID
	// Refresh is the period of re-reads once found; 0 means 5s.
	Refresh time.Duration
	// Retry is the wait between reads until the activity is first found; 0 means 1s.
	Retry time.Duration
	// Timeout bounds each read; 0 means 5s.
	Timeout time.Duration
	// OnChange, when set, runs (on the source's goroutine) after every read that
	// returned a different resourceVersion, with the new activity.
	OnChange func(*Resource)
	// Metrics, when set, counts failed reads.
	Metrics *Metrics
	// Log receives read failures; nil means slog.Default().
	Log *slog.Logger

	cur atomic.Pointer[Resource]
}

// Current returns the last activity read, or nil before the first successful read.
func (s *ActivitySource) Current() *Resource { return s.cur.Load() }

// Set installs an activity as the current one, as a read would.
func (s *ActivitySource) Set(a *Resource) {
	old := s.cur.Swap(a)
	if s.OnChange != nil && (old == nil || old.Object.ResourceVersion != a.Object.ResourceVersion) {
		s.OnChange(a)
	}
}

// Fetch reads the activity once and installs it.
func (s *ActivitySource) Fetch(ctx context.Context) error {
	timeout := s.Timeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	obj := &redpacketv1alpha1.RedPacketActivity{}
	if err := s.Client.Get(ctx, s.Key, obj); err != nil {
		if s.Metrics != nil {
			s.Metrics.ActivityRefreshFailures.Inc()
		}
		if apierrors.IsNotFound(err) {
			return fmt.Errorf("activity %s not found: %w", s.Key, err)
		}
		return fmt.Errorf("reading activity %s: %w", s.Key, err)
	}
	if s.UID != "" && obj.UID != s.UID {
		return fmt.Errorf("activity %s is another activity now (uid %s); this service serves uid %s only", s.Key, obj.UID, s.UID)
	}
	if cur := s.Current(); cur != nil && cur.Object.ResourceVersion == obj.ResourceVersion {
		return nil
	}
	s.Set(NewResource(obj))
	return nil
}

// Run reads the activity until ctx is done: every Retry until it is first found,
// then every Refresh. A failed refresh keeps the last activity read.
func (s *ActivitySource) Run(ctx context.Context) {
	log := s.Log
	if log == nil {
		log = slog.Default()
	}
	retry, refresh := s.Retry, s.Refresh
	if retry <= 0 {
		retry = time.Second
	}
	if refresh <= 0 {
		refresh = 5 * time.Second
	}
	failures := 0
	for {
		err := s.Fetch(ctx)
		switch {
		case err == nil:
			failures = 0
		case ctx.Err() == nil:
			// Log the first failure of a streak and then every 30th, not every retry.
			if failures%30 == 0 {
				log.Warn("reading the activity failed", "activity", s.Key.String(), "err", err, "failures", failures+1)
			}
			failures++
		}
		wait := refresh
		if s.Current() == nil {
			wait = retry
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}
