package grabsvc

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// FieldManager is the server-side apply field manager of the grab service's status
// fields.
const FieldManager = "redpacket-grab-service"

// Reporter defaults.
const (
	DefaultReportInterval  = time.Second
	DefaultReportHeartbeat = 5 * time.Second
	DefaultReportTimeout   = 5 * time.Second
)

// Counters are the status fields the grab service reports, all from one snapshot.
type Counters = redpacketv1alpha1.Counters

// CountersFrom takes the reported counters from a snapshot.
func CountersFrom(s store.Snapshot) Counters { return s.Counters() }

// Reporter writes the activity's counters from Redis into its status with
// server-side apply under FieldManager, forcing ownership of exactly its own
// fields: the money counters (redpacketv1alpha1.Counters: remaining, claimed,
// refunded, settled, dead letters; all from one snapshot, so they add up to the
// total) and lastReportTime. It applies at most once per Interval and only when the
// counters changed, except for a heartbeat every Heartbeat that refreshes
// lastReportTime.
//
// Each report reads the live activity first and Redis second, so that every
// counter the live status records comes from a snapshot taken before this one. It
// never lowers a recorded counter: a snapshot below the live status (or fenced, or
// of an earlier epoch) means Redis rolled back, and the reporter fences the activity
// in Redis (fence.lua), marks it on the Guard (so /readyz fails) and writes nothing.
// The apply carries the live resourceVersion as its precondition, so a report never
// overwrites a status that moved since it was read (another replica's report, the
// controller's); it is simply skipped until the next tick. The reporter runs on its
// own goroutine with its own timeouts, so a slow or absent API server never touches
// the grab path.
type Reporter struct {
	// Client writes the status subresource.
	Client client.Client
	// Redis reads the snapshot, through the activity's handle (store.NewActivity).
	Redis redis.Cmdable
	// Resource returns the current activity, nil until it has been read.
	Resource func() *Resource
	// Interval is the report period; 0 means DefaultReportInterval.
	Interval time.Duration
	// Heartbeat is the longest time without an apply; 0 means DefaultReportHeartbeat.
	Heartbeat time.Duration
	// Timeout bounds each snapshot and each apply; 0 means DefaultReportTimeout.
	Timeout time.Duration
	// Metrics, when set, records failures and the time of the last report.
	Metrics *Metrics
	// Log receives failures; nil means slog.Default().
	Log *slog.Logger
	// Now returns the current time; nil means time.Now.
	Now func() time.Time
	// Guard, shared with the Server, receives the status's watermark and why the
	// activity cannot be served; nil means a private one.
	Guard *RollbackGuard

	mu          sync.Mutex
	handles     handles
	lastUID     types.UID
	last        Counters
	lastApplied time.Time
}

// Run reports every Interval until ctx is done.
func (r *Reporter) Run(ctx context.Context) {
	interval := r.Interval
	if interval <= 0 {
		interval = DefaultReportInterval
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if _, err := r.ReportOnce(ctx); err != nil && ctx.Err() == nil {
			r.logger().Warn("status report failed", "err", err)
		}
	}
}

// ReportOnce reads the live activity and a snapshot, and applies the counters when
// they changed or the heartbeat is due. It returns whether it applied.
func (r *Reporter) ReportOnce(ctx context.Context) (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := ctx.Err(); err != nil {
		// Shutting down: not a failed report.
		return false, err
	}
	act := r.Resource()
	if act == nil {
		return false, nil
	}
	if r.Guard == nil {
		r.Guard = &RollbackGuard{}
	}
	uid := act.Object.UID
	timeout := r.Timeout
	if timeout <= 0 {
		timeout = DefaultReportTimeout
	}
	live, err := callWithDeadline(ctx, timeout, func(ctx context.Context) (*redpacketv1alpha1.RedPacketActivity, error) {
		o := &redpacketv1alpha1.RedPacketActivity{}
		return o, r.Client.Get(ctx, client.ObjectKeyFromObject(act.Object), o)
	})
	if err != nil {
		r.countFailure("read")
		return false, fmt.Errorf("reading the live status of %s: %w", act.Ref, err)
	}
	if live.UID != uid {
		return false, fmt.Errorf("activity %s was replaced (uid %s, now %s)", act.Ref, uid, live.UID)
	}
	n := act.Object.Spec.ShardCount()
	if n == 1 {
		// The status's counters are the one shard's.
		r.Guard.Saw(uid, statusMark(&live.Status))
	} else {
		for i := range n {
			r.Guard.SawShard(uid, i, n, shardMark(&live.Status, i))
		}
	}
	h := r.handles.of(r.Redis, act)
	view, err := callWithDeadline(ctx, timeout, h.ReadShards)
	if err != nil {
		r.countFailure("snapshot")
		return false, fmt.Errorf("reading the counters: %w", err)
	}
	snap := view.Whole
	if !snap.Exists() {
		// Redis does not hold the activity: there is nothing true to report, and the
		// controller tells that story on the resource.
		r.Guard.SetProblem(uid, problemMissing)
		return false, nil
	}
	why := view.RolledBack(&live.Status)
	if why == "" && view.Steady && view.Duplicated() {
		why = "the shards hold more packets than were seeded (a master forgot a transfer between shards)"
	}
	if why != "" {
		r.Guard.SetProblem(uid, problemFenced)
		if !snap.FullyFenced() {
			if _, err := callWithDeadline(ctx, timeout, func(ctx context.Context) (string, error) {
				return h.Fence(ctx, "rolled_back")
			}); err != nil {
				r.countFailure("fence")
				return false, fmt.Errorf("fencing the rolled-back activity (%s): %w", why, err)
			}
			r.logger().Error("Redis rolled back: the activity is fenced and grants nothing until an operator accepts its state",
				"activity", act.Ref, "why", why)
		}
		return false, nil
	}
	r.Guard.SetProblem(uid, "")
	// Redis never goes below what it once held, short of a rollback.
	for i, sh := range view.Shards {
		r.Guard.SawShard(uid, i, n, sh.Watermark())
	}
	if live.Status.RedisEpoch == nil && snap.Epoch > 0 || live.Status.RedisEpoch != nil && snap.Epoch > *live.Status.RedisEpoch {
		// An accept started a new epoch that status does not record yet: the
		// controller writes the accepted counters first.
		return false, nil
	}
	c := snap.Counters()
	now := r.now()
	heartbeat := r.Heartbeat
	if heartbeat <= 0 {
		heartbeat = DefaultReportHeartbeat
	}
	recorded, _ := redpacketv1alpha1.RecordedCounters(&live.Status)
	marks := view.Watermarks(&live.Status)
	changed := uid != r.lastUID || c != r.last || c != recorded || !sameWatermarks(marks, live.Status.ShardWatermarks)
	if !changed && now.Sub(r.lastApplied) < heartbeat {
		return false, nil
	}
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	obj := statusApply(live, c, marks, now)
	obj.SetResourceVersion(live.ResourceVersion)
	if err := r.Client.Status().Apply(actx, client.ApplyConfigurationFromUnstructured(obj),
		client.FieldOwner(FieldManager), client.ForceOwnership); err != nil {
		if apierrors.IsConflict(err) {
			// The status moved since it was read: the next tick reads it again.
			return false, nil
		}
		r.countFailure("apply")
		return false, fmt.Errorf("applying the status of %s: %w", act.Ref, err)
	}
	r.lastUID, r.last, r.lastApplied = uid, c, now
	if r.Metrics != nil {
		r.Metrics.reportSucceeded(now)
		kind := "heartbeat"
		if changed {
			kind = "change"
		}
		r.Metrics.Reports.WithLabelValues(kind).Inc()
	}
	return true, nil
}

// statusApply builds the apply object: identity plus only the reporter's fields
// (the counters, the shards' watermarks of a sharded activity, the report time).
func statusApply(o *redpacketv1alpha1.RedPacketActivity, c Counters, marks *redpacketv1alpha1.ShardWatermarks, now time.Time) *unstructured.Unstructured {
	status := c.StatusFields()
	status["lastReportTime"] = now.UTC().Format(time.RFC3339)
	if marks != nil {
		counts := make([]any, len(marks.ClaimedCounts))
		for i, n := range marks.ClaimedCounts {
			counts[i] = n
		}
		wm := map[string]any{"epoch": marks.Epoch, "claimedCounts": counts}
		if len(marks.TransferSeqs) > 0 {
			seqs := make([]any, len(marks.TransferSeqs))
			for i, n := range marks.TransferSeqs {
				seqs[i] = n
			}
			wm["transferSeqs"] = seqs
		}
		status["shardWatermarks"] = wm
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": redpacketv1alpha1.GroupVersion.String(),
		"kind":       "RedPacketActivity",
		"metadata": map[string]any{
			"name":      o.Name,
			"namespace": o.Namespace,
		},
		"status": status,
	}}
}

func (r *Reporter) countFailure(stage string) {
	if r.Metrics != nil {
		r.Metrics.ReportFailures.WithLabelValues(stage).Inc()
	}
}

func (r *Reporter) now() time.Time {
	if r.Now != nil {
		return r.Now()
	}
	return time.Now()
}

func (r *Reporter) logger() *slog.Logger {
	if r.Log != nil {
		return r.Log
	}
	return slog.Default()
}

// sameWatermarks reports whether a and b hold the same figures.
func sameWatermarks(a, b *redpacketv1alpha1.ShardWatermarks) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Epoch == b.Epoch && slices.Equal(a.ClaimedCounts, b.ClaimedCounts) && slices.Equal(a.TransferSeqs, b.TransferSeqs)
}
