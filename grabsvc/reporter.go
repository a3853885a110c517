package grabsvc

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
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

// Counters are the status fields the grab service owns, all from one snapshot.
type Counters struct {
	RemainingCount  int64
	RemainingAmount int64
	ClaimedCount    int64
	ClaimedAmount   int64
	SettledCount    int64
	SettledAmount   int64
	DeadLetterCount int64
}

// CountersFrom takes the reported counters from a snapshot.
func CountersFrom(s lua.Snapshot) Counters {
	return Counters{
		RemainingCount:  s.RemainingCount,
		RemainingAmount: s.RemainingAmount(),
		ClaimedCount:    s.ClaimedCount,
		ClaimedAmount:   s.ClaimedAmount,
		SettledCount:    s.SettledCount,
		SettledAmount:   s.SettledAmount,
		DeadLetterCount: s.DeadCount,
	}
}

// Reporter writes the activity's counters from Redis into its status with
// server-side apply under FieldManager, forcing ownership of exactly its own
// fields: remainingCount, remainingAmount, claimedCount, claimedAmount,
// settledCount, settledAmount, deadLetterCount and lastReportTime. It applies at
// most once per Interval and only when the counters changed, except for a
// heartbeat every Heartbeat that refreshes lastReportTime. Replicas of the grab
// service all apply under the same manager and converge on the latest snapshot.
// The reporter runs on its own goroutine with its own timeouts, so a slow or
// absent API server never touches the grab path.
type Reporter struct {
	// Client writes the status subresource.
	Client client.Client
	// Redis reads the snapshot, through the activity's handle (lua.NewActivity).
	Redis redis.Cmdable
	// Activity returns the current activity, nil until it has been read.
	Activity func() *Activity
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

// ReportOnce reads a snapshot and applies it when it changed or the heartbeat is
// due. It returns whether it applied.
func (r *Reporter) ReportOnce(ctx context.Context) (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	act := r.Activity()
	if act == nil {
		return false, nil
	}
	timeout := r.Timeout
	if timeout <= 0 {
		timeout = DefaultReportTimeout
	}
	snap, err := callWithDeadline(ctx, timeout, r.handles.of(r.Redis, act).Snapshot)
	if err != nil {
		r.countFailure("snapshot")
		return false, fmt.Errorf("reading the counters: %w", err)
	}
	if !snap.Exists() {
		// Redis does not hold the activity: there is nothing true to report, and the
		// controller tells that story on the resource.
		return false, nil
	}
	c := CountersFrom(snap)
	now := r.now()
	heartbeat := r.Heartbeat
	if heartbeat <= 0 {
		heartbeat = DefaultReportHeartbeat
	}
	changed := act.Object.UID != r.lastUID || c != r.last
	if !changed && now.Sub(r.lastApplied) < heartbeat {
		return false, nil
	}
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := r.Client.Status().Apply(actx, client.ApplyConfigurationFromUnstructured(statusApply(act.Object, c, now)),
		client.FieldOwner(FieldManager), client.ForceOwnership); err != nil {
		r.countFailure("apply")
		return false, fmt.Errorf("applying the status of %s: %w", act.Ref, err)
	}
	r.lastUID, r.last, r.lastApplied = act.Object.UID, c, now
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

// statusApply builds the apply object: identity plus only the reporter's fields.
func statusApply(o *redpacketv1alpha1.RedPacketActivity, c Counters, now time.Time) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": redpacketv1alpha1.GroupVersion.String(),
		"kind":       "RedPacketActivity",
		"metadata": map[string]any{
			"name":      o.Name,
			"namespace": o.Namespace,
		},
		"status": map[string]any{
			"remainingCount":  c.RemainingCount,
			"remainingAmount": c.RemainingAmount,
			"claimedCount":    c.ClaimedCount,
			"claimedAmount":   c.ClaimedAmount,
			"settledCount":    c.SettledCount,
			"settledAmount":   c.SettledAmount,
			"deadLetterCount": c.DeadLetterCount,
			"lastReportTime":  now.UTC().Format(time.RFC3339),
		},
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
