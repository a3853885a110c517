package controllers

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/types"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// activityStore is everything the controller does to one activity's data in Redis,
// in the manner of an external client: observe it (the server clock and a snapshot
// of every counter), create it (seed the packets exactly once), update it (load the
// scripts, configure the gate, close it) and delete it (purge), its own Redis user
// (redisUsers) and its shards one by one (shardsReader). The steps of a
// reconcile reach Redis only through it, so each step can be run against a fake.
//
// store.Activity is the production implementation: an activity spread over
// spec.shards hash tags, which with one shard is exactly store.Shard.
type activityStore interface {
	redisUsers
	shardsReader

	// Time is the Redis server's clock, the one the grab script gates on.
	Time(ctx context.Context) (time.Time, error)
	// Snapshot reads every counter of the activity at one instant.
	Snapshot(ctx context.Context) (store.Snapshot, error)
	// Seed stages and commits the packets exactly once.
	Seed(ctx context.Context, amounts []int64, p store.SeedParams) (store.SeedResult, error)
	// LoadScripts loads every script ahead of use, on every master.
	LoadScripts(ctx context.Context) error
	// Configure writes the schedule and the pause flag; open moves a ready activity
	// to open.
	Configure(ctx context.Context, startMs, endMs int64, paused, open bool) (store.ConfigureResult, error)
	// ConfigureWith writes the schedule, the pause flag and the payee; it writes
	// nothing to a fenced activity.
	ConfigureWith(ctx context.Context, st store.Settings) (store.ConfigureResult, error)
	// Fence stops an activity whose Redis rolled back; it returns the fence's reason.
	Fence(ctx context.Context, why string) (string, error)
	// Accept lifts the fence and starts a new epoch, provided Redis is at epoch seen.
	Accept(ctx context.Context, seen int64) (int64, error)
	// CheckFsync checks that the activity's master fsyncs every write before it
	// answers (wraps store.ErrDurabilityNotMet when not).
	CheckFsync(ctx context.Context) error
	// CheckReplicas checks that the activity's master has at least n replicas
	// connected (wraps store.ErrDurabilityNotMet when not).
	CheckReplicas(ctx context.Context, n int) error
	// Close ends grabbing for the given reason and refunds the remainder.
	Close(ctx context.Context, reason store.CloseReason) (store.CloseResult, error)
	// Purge deletes every key of the activity.
	Purge(ctx context.Context) error
	// PurgeKeepingUnsettled deletes the activity's keys except the settlement and
	// dead-letter streams, kept for retention; it returns the keys kept.
	PurgeKeepingUnsettled(ctx context.Context, retention time.Duration) ([]string, error)
}

var _ activityStore = (*store.Activity)(nil)

// storeFactory returns the store of the activity with the given UID on the Redis
// that conn names.
type storeFactory func(conn redisconn.Conn, uid types.UID) activityStore

// storeFor returns the store of activity a: the reconciler's factory when it has one
// (the phase tests), else the activity's handle over its spec.shards shards on the
// cached client for conn (redisClient: its errors are safe for status, and a
// connection from spec.redis dials only allowed addresses), seeding with the
// reconciler's Seeder.
func (r *RedPacketActivityReconciler) storeFor(conn redisconn.Conn, a *redpacketv1alpha1.RedPacketActivity) activityStore {
	if r.newStore != nil {
		return r.newStore(conn, a.UID)
	}
	c := r.redisClient(conn)
	// The operator's handle reloads the grab-side function library when a call finds
	// it missing (a snapshot, a transfer it finishes), and retries once.
	h := store.NewActivity(c, string(a.UID), a.Spec.ShardCount()).RestoreFunctions()
	h.Seeder = r.Seeder
	if d := a.Spec.Durability; d != nil && d.Mode == redpacketv1alpha1.DurabilityReplicas && d.Replicas > 0 && h.N() > 1 {
		// Transfers the controller finishes (Resolve) wait for the replicas as the grab
		// service's do; they are rare, so each wait has a waiter of its own.
		timeout := grabsvcReplicaTimeout(d)
		h.Replicated = func(ctx context.Context, shard int) error {
			w := h.Shard(shard).ReplicaWaiter(int(d.Replicas), timeout)
			defer func() { _ = w.Close() }()
			return w.Wait(ctx)
		}
	}
	return h
}

// grabsvcReplicaTimeout is how long a wait for replicas may take under d: its
// timeoutMilliseconds, or the grab service's default.
func grabsvcReplicaTimeout(d *redpacketv1alpha1.Durability) time.Duration {
	if d.TimeoutMilliseconds > 0 {
		return time.Duration(d.TimeoutMilliseconds) * time.Millisecond
	}
	return store.DefaultReplicaTimeout
}
