package controllers

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// Whole reconciles against the fakes: the status is written once on the way out on
// every path (the deletion's too), after the seed step's mid-way writes; the
// generation counts as observed only after a clean reconcile.

func TestDecideDeletion(t *testing.T) {
	closed := store.Snapshot{State: store.StateClosed, CloseReason: store.CloseExpired, Count: 10, Total: 1000,
		ClaimedCount: 2, ClaimedAmount: 150, Refunded: 850}
	settledSnap := closed
	settledSnap.SettledCount, settledSnap.SettledAmount, settledSnap.RefundSettled = 2, 150, 850
	cases := []struct {
		name      string
		snap      store.Snapshot
		graceLeft time.Duration
		want      deletionAction
	}{
		{"nothing in Redis", store.Snapshot{}, time.Minute, deletionLetGo},
		{"nothing in Redis, grace over", store.Snapshot{}, -time.Minute, deletionLetGo},
		{"only staged packets", store.Snapshot{StagedCount: 30}, time.Minute, deletionPurge},
		{"settled", settledSnap, time.Minute, deletionPurge},
		{"settled, grace over", settledSnap, -time.Minute, deletionPurge},
		{"not settled", closed, time.Minute, deletionWait},
		{"only the refund not settled", store.Snapshot{State: store.StateClosed, Refunded: 10, ClaimedCount: 1, SettledCount: 1}, time.Minute, deletionWait},
		{"not settled, grace over", closed, 0, deletionPurgeKeepingUnsettled},
	}
	for _, tc := range cases {
		if got := decideDeletion(tc.snap, tc.graceLeft); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
}

func TestReconcileWritesStatusOnceOnEveryPath(t *testing.T) {
	deleted := func(ago time.Duration) func(*redpacketv1alpha1.RedPacketActivity) {
		return func(a *redpacketv1alpha1.RedPacketActivity) {
			a.DeletionTimestamp = &metav1.Time{Time: testNow.Add(-ago)}
		}
	}
	observed := func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.ObservedGeneration = 1 }
	unsettled := store.Snapshot{State: store.StateOpen, Count: 10, Total: 1000, RemainingCount: 8, ClaimedCount: 2, ClaimedAmount: 150}
	drained := store.Snapshot{State: store.StateClosed, CloseReason: store.CloseExpired, Count: 10, Total: 1000,
		ClaimedCount: 2, ClaimedAmount: 150, SettledCount: 2, SettledAmount: 150, Refunded: 850, RefundSettled: 850}
	// ended is an activity whose endTime passed a minute ago, which Redis holds open
	// with claims to settle: this reconcile must close it.
	ended := func(a *redpacketv1alpha1.RedPacketActivity) {
		end := metav1.NewTime(testNow.Add(-time.Minute))
		a.Spec.EndTime = &end
	}
	endedInRedis := unsettled
	endedInRedis.EndMs = testNow.Add(-time.Minute).UnixMilli()
	endedInRedis.Sponsor, endedInRedis.Currency = "merchant-001", "CNY"
	const grace = 10 * time.Minute
	fenced := unsettled
	fenced.Fenced = "rolled_back"
	recordedFour := func(a *redpacketv1alpha1.RedPacketActivity) {
		seededStatus(a)
		redpacketv1alpha1.SetCounters(&a.Status, redpacketv1alpha1.Counters{RemainingCount: 6, RemainingAmount: 600, ClaimedCount: 4, ClaimedAmount: 400})
	}
	dataLost := func(a *redpacketv1alpha1.RedPacketActivity) {
		seededStatus(a)
		a.Status.Phase = redpacketv1alpha1.PhaseFailed
		meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{Type: redpacketv1alpha1.ConditionSeeded,
			Status: metav1.ConditionFalse, Reason: redpacketv1alpha1.ReasonDataLost, Message: "gone"})
		meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{Type: redpacketv1alpha1.ConditionStalled,
			Status: metav1.ConditionTrue, Reason: redpacketv1alpha1.ReasonDataLost, Message: "gone"})
	}
	annotate := func(kv ...string) func(*redpacketv1alpha1.RedPacketActivity) {
		return func(a *redpacketv1alpha1.RedPacketActivity) {
			if a.Annotations == nil {
				a.Annotations = map[string]string{}
			}
			for i := 0; i+1 < len(kv); i += 2 {
				a.Annotations[kv[i]] = kv[i+1]
			}
		}
	}
	abandonBy := func(uid, user string) func(*redpacketv1alpha1.RedPacketActivity) {
		return annotate(redpacketv1alpha1.AnnotationAbandon, uid, redpacketv1alpha1.AnnotationAbandonedBy, user)
	}
	acceptBy := func(epoch, user string) func(*redpacketv1alpha1.RedPacketActivity) {
		return annotate(redpacketv1alpha1.AnnotationAcceptRedisState, epoch, redpacketv1alpha1.AnnotationAcceptedBy, user)
	}
	cases := []struct {
		name   string
		mutate []func(*redpacketv1alpha1.RedPacketActivity)
		snap   store.Snapshot
		fail   map[string]error
		// wantWrites are the status writes, each summarised as the phase and the
		// Ready condition; the last is the one on the way out.
		wantWrites   []string
		wantObserved int64
		wantErr      bool
		wantRequeue  time.Duration
		wantStore    []string
		wantEvents   []string
		wantGone     bool
	}{
		{
			name: "a new activity: seeded, recorded, opened, then the one final write",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){func(a *redpacketv1alpha1.RedPacketActivity) {
				a.Finalizers = nil
			}},
			wantWrites: []string{"Seeding Ready=False/Seeding", "Seeding Ready=False/Seeding",
				"Active Ready=False/GrabServiceUnavailable"},
			wantObserved: 2, wantRequeue: 5 * time.Second,
			wantStore: []string{"store.Time", "store.Snapshot", "store.Seed", "store.Snapshot", "store.LoadScripts",
				"store.Configure"},
			wantEvents: []string{"Normal Committed"},
		},
		{
			name: "Redis does not answer: an error, the generation not observed", mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed},
			snap: openSnapshot(), fail: map[string]error{"Time": errRedisDown},
			wantWrites: []string{"Pending Ready=False/RedisUnavailable"}, wantObserved: 1, wantErr: true,
			wantStore: []string{"store.Time"}, wantEvents: []string{"Warning RedisUnavailable"},
		},
		{
			name: "an invalid spec halts: the generation not observed",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, func(a *redpacketv1alpha1.RedPacketActivity) {
				a.Spec.Distribution.MinAmount = 101
			}},
			wantWrites: []string{"Failed Ready=False/InvalidSpec"}, wantObserved: 1,
			wantStore: []string{"store.Time", "store.Snapshot"}, wantEvents: []string{"Warning InvalidSpec"},
		},
		{
			name:       "Redis lost a seeded activity: halted for good (observed, Stalled), looked at again in a minute",
			mutate:     []func(*redpacketv1alpha1.RedPacketActivity){observed, seededStatus},
			wantWrites: []string{"Failed Ready=False/DataLost"}, wantObserved: 2, wantRequeue: dataLostRecheckPeriod,
			wantStore: []string{"store.Time", "store.Snapshot"}, wantEvents: []string{"Warning DataLost"},
		},
		{
			name: "Redis rolled back below status: fenced, Failed and Stalled for good, nothing reopened or closed",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, seededStatus, func(a *redpacketv1alpha1.RedPacketActivity) {
				redpacketv1alpha1.SetCounters(&a.Status, redpacketv1alpha1.Counters{RemainingCount: 6, RemainingAmount: 600, ClaimedCount: 4, ClaimedAmount: 400})
			}},
			snap:       unsettled,
			wantWrites: []string{"Failed Ready=False/RedisRolledBack"}, wantObserved: 2, wantRequeue: dataLostRecheckPeriod,
			wantStore: []string{"store.Time", "store.Snapshot", "store.Fence"}, wantEvents: []string{"Warning RedisRolledBack"},
		},
		{
			name:       "SCRIPT LOAD fails: endTime still closes the activity and refunds, the error is retried",
			mutate:     []func(*redpacketv1alpha1.RedPacketActivity){observed, seededStatus, ended},
			snap:       endedInRedis,
			fail:       map[string]error{"LoadScripts": errRedisDown},
			wantWrites: []string{"Expired Ready=False/RedisUnavailable"}, wantObserved: 1, wantErr: true,
			wantStore: []string{"store.Time", "store.Snapshot", "store.LoadScripts", "store.Close expired"},
		},
		{
			name:       "the activity's Redis user cannot be set up: endTime still closes the activity and refunds, the error is retried",
			mutate:     []func(*redpacketv1alpha1.RedPacketActivity){observed, seededStatus, ended},
			snap:       endedInRedis,
			fail:       map[string]error{"EnsureUser": errRedisDown},
			wantWrites: []string{"Expired Ready=False/RedisUnavailable"}, wantObserved: 1, wantErr: true,
			wantStore: []string{"store.Time", "store.Snapshot", "store.LoadScripts", "store.Close expired"},
		},
		{
			name:       "deleted, settlement pending: closed, then waits with one write",
			mutate:     []func(*redpacketv1alpha1.RedPacketActivity){observed, withWebhook, deleted(time.Minute)},
			snap:       unsettled,
			wantWrites: []string{"Expired Ready=False/Deleting"}, wantObserved: 2,
			wantRequeue: 2 * time.Second,
			wantStore:   []string{"store.Snapshot", "store.Close expired", "store.Snapshot"},
			wantEvents:  []string{"Normal Closed"},
		},
		{
			name:   "deleted, Redis down within the grace period: an error, one write",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(time.Minute)},
			snap:   unsettled, fail: map[string]error{"Snapshot": errRedisDown},
			wantWrites: []string{"Pending Ready=False/Deleting"}, wantObserved: 1, wantErr: true,
			wantStore: []string{"store.Snapshot"},
		},
		{
			name:   "deleted and settled: purged and let go, nothing written",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){deleted(time.Minute)},
			snap:   drained, wantStore: []string{"store.Snapshot", "store.Purge"},
			wantEvents: []string{"Normal Purged"}, wantGone: true,
		},
		{
			name:   "deleted, the grace period over: purged but the streams, let go",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){deleted(grace + time.Second)},
			snap:   unsettled, wantStore: []string{"store.Snapshot", "store.Close expired", "store.Snapshot", "store.PurgeKeepingUnsettled"},
			wantEvents: []string{"Normal Closed", "Warning CleanupGracePeriodExpired"}, wantGone: true,
		},
		{
			name:      "deleted, not in Redis: let go",
			mutate:    []func(*redpacketv1alpha1.RedPacketActivity){deleted(time.Minute)},
			wantStore: []string{"store.Snapshot"}, wantGone: true,
		},
		{
			name:   "deleted, Redis down past the grace period: let go with a warning",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){deleted(grace + time.Second)},
			snap:   unsettled, fail: map[string]error{"Snapshot": errRedisDown},
			wantStore: []string{"store.Snapshot"}, wantEvents: []string{"Warning CleanupAbandoned"}, wantGone: true,
		},
		{
			name:   "deleted while fenced: held, keys and finalizer kept, nothing closed or purged",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(time.Minute)},
			snap:   fenced, wantWrites: []string{"Failed Ready=False/DeletionHeld"}, wantObserved: 2,
			wantRequeue: dataLostRecheckPeriod, wantStore: []string{"store.Snapshot"},
			wantEvents: []string{"Warning DeletionHeld"},
		},
		{
			name:   "deleted after a rollback not yet fenced: fenced and held",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(time.Minute), recordedFour},
			snap:   unsettled, wantWrites: []string{"Failed Ready=False/DeletionHeld"}, wantObserved: 2,
			wantRequeue: dataLostRecheckPeriod, wantStore: []string{"store.Snapshot", "store.Fence rolled_back"},
			wantEvents: []string{"Warning DeletionHeld"},
		},
		{
			name:   "deleted while fenced, past the grace period: still held",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(grace + time.Hour)},
			snap:   fenced, wantWrites: []string{"Failed Ready=False/DeletionHeld"}, wantObserved: 2,
			wantRequeue: dataLostRecheckPeriod, wantStore: []string{"store.Snapshot"},
		},
		{
			name:       "deleted while DataLost: held, not let go",
			mutate:     []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(time.Minute), dataLost},
			wantWrites: []string{"Failed Ready=False/DeletionHeld"}, wantObserved: 2,
			wantRequeue: dataLostRecheckPeriod, wantStore: []string{"store.Snapshot"},
			wantEvents: []string{"Warning DeletionHeld"},
		},
		{
			name:   "deleted while DataLost, Redis down past the grace period: held, not let go",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(grace + time.Hour), dataLost},
			fail:   map[string]error{"Snapshot": errRedisDown}, wantWrites: []string{"Failed Ready=False/DeletionHeld"}, wantObserved: 2,
			wantRequeue: dataLostRecheckPeriod, wantStore: []string{"store.Snapshot"},
		},
		{
			name:   "deleted while fenced, abandoned by the platform: purged without refund, let go",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(time.Minute), abandonBy("uid-1", platformUser)},
			snap:   fenced, wantStore: []string{"store.Snapshot", "store.Purge"},
			wantEvents: []string{"Warning Abandoned"}, wantGone: true,
		},
		{
			name:      "deleted while DataLost, abandoned by the platform: purged, let go",
			mutate:    []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(time.Minute), dataLost, abandonBy("uid-1", platformUser)},
			wantStore: []string{"store.Snapshot", "store.Purge"}, wantEvents: []string{"Warning Abandoned"}, wantGone: true,
		},
		{
			name:   "deleted while fenced, abandoned by a tenant: refused, held",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(time.Minute), abandonBy("uid-1", "tenant-bob")},
			snap:   fenced, wantWrites: []string{"Failed Ready=False/DeletionHeld"}, wantObserved: 2,
			wantRequeue: dataLostRecheckPeriod, wantStore: []string{"store.Snapshot"},
			wantEvents: []string{"Warning AbandonNotAllowed", "Warning DeletionHeld"},
		},
		{
			name:   "deleted while fenced, an abandon copied from another activity: held",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(time.Minute), abandonBy("uid-0", platformUser)},
			snap:   fenced, wantWrites: []string{"Failed Ready=False/DeletionHeld"}, wantObserved: 2,
			wantRequeue: dataLostRecheckPeriod, wantStore: []string{"store.Snapshot"},
		},
		{
			name:   "deleted while fenced, accepted by the platform: a new epoch, closed and refunded, waits to settle",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, withWebhook, deleted(time.Minute), acceptBy("0", platformUser)},
			snap:   fenced, wantWrites: []string{"Expired Ready=False/Deleting"}, wantObserved: 2, wantRequeue: 2 * time.Second,
			wantStore:  []string{"store.Snapshot", "store.Accept 0", "store.Snapshot", "store.Close expired", "store.Snapshot"},
			wantEvents: []string{"Normal RedisStateAccepted", "Normal Closed"},
		},
		{
			name:   "deleted while fenced, accepted by a tenant: refused, held",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){observed, deleted(time.Minute), acceptBy("0", "tenant-bob")},
			snap:   fenced, wantWrites: []string{"Failed Ready=False/DeletionHeld"}, wantObserved: 2,
			wantRequeue: dataLostRecheckPeriod, wantStore: []string{"store.Snapshot"},
			wantEvents: []string{"Warning AcceptNotAllowed", "Warning DeletionHeld"},
		},
		{
			name: "deleted, someone else removed the finalizer: nothing to do",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){deleted(time.Minute), func(a *redpacketv1alpha1.RedPacketActivity) {
				a.Finalizers = []string{"example.com/other"}
			}},
			snap: unsettled,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity(tc.mutate...)
			p := newPhaseTest(t, tc.snap, a)
			p.r.Options.CleanupGracePeriod = grace
			p.r.Options.CleanupPollInterval = 2 * time.Second
			p.store.fail = tc.fail

			res, err := p.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(a)})
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v, want error: %t", err, tc.wantErr)
			}
			if !tc.wantErr && res.RequeueAfter != tc.wantRequeue {
				t.Errorf("requeue after %s, want %s", res.RequeueAfter, tc.wantRequeue)
			}
			var writes []string
			for _, st := range p.status.applied {
				writes = append(writes, string(st.Phase)+" Ready="+condition(st, redpacketv1alpha1.ConditionReady))
			}
			if !slices.Equal(writes, tc.wantWrites) {
				t.Errorf("status writes %q, want %q; calls:\n%s", writes, tc.wantWrites, p.log)
			}
			if len(p.status.applied) > 0 {
				if got := p.status.last(t).ObservedGeneration; got != tc.wantObserved {
					t.Errorf("observedGeneration %d on the way out, want %d (generation %d)", got, tc.wantObserved, a.Generation)
				}
			}
			if got := p.log.with("store."); !prefixesMatch(got, tc.wantStore) {
				t.Errorf("store calls %q, want %q", got, tc.wantStore)
			}
			events := p.eventReasons()
			for _, want := range tc.wantEvents {
				if !slices.Contains(events, want) {
					t.Errorf("events %q, want %q among them", events, want)
				}
			}
			stored := &redpacketv1alpha1.RedPacketActivity{}
			err = p.client.Get(context.Background(), client.ObjectKeyFromObject(a), stored)
			switch {
			case tc.wantGone && !apierrors.IsNotFound(err):
				t.Errorf("the activity is still there (%v), finalizers %q", err, stored.Finalizers)
			case !tc.wantGone && err != nil:
				t.Errorf("the activity: %v", err)
			case !tc.wantGone && a.Finalizers != nil && !controllerutil.ContainsFinalizer(stored, Finalizer) && slices.Contains(a.Finalizers, Finalizer):
				t.Errorf("the finalizer was removed")
			case !tc.wantGone && a.DeletionTimestamp == nil && !controllerutil.ContainsFinalizer(stored, Finalizer):
				t.Errorf("no finalizer on a live activity: %q", stored.Finalizers)
			}
		})
	}
}

// prefixesMatch reports whether every call starts with the wanted one, in order.
func prefixesMatch(calls, want []string) bool {
	if len(calls) != len(want) {
		return false
	}
	for i := range want {
		if !strings.HasPrefix(calls[i], want[i]) {
			return false
		}
	}
	return true
}

// A deletion is held while the activity is fenced or DataLost; an acceptance of the
// current epoch or an abandon that carries the UID is what may release it.
func TestDecideDeletionHold(t *testing.T) {
	open := openSnapshot()
	fenced := open
	fenced.Fenced = "rolled_back"
	ahead := func(a *redpacketv1alpha1.RedPacketActivity) {
		redpacketv1alpha1.SetCounters(&a.Status, redpacketv1alpha1.Counters{RemainingCount: 6, RemainingAmount: 600, ClaimedCount: 4, ClaimedAmount: 400})
	}
	lost := func(a *redpacketv1alpha1.RedPacketActivity) {
		meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{Type: redpacketv1alpha1.ConditionSeeded,
			Status: metav1.ConditionFalse, Reason: redpacketv1alpha1.ReasonDataLost})
	}
	annotations := func(kv ...string) func(*redpacketv1alpha1.RedPacketActivity) {
		return func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Annotations = map[string]string{}
			for i := 0; i+1 < len(kv); i += 2 {
				a.Annotations[kv[i]] = kv[i+1]
			}
		}
	}
	cases := []struct {
		name   string
		mutate []func(*redpacketv1alpha1.RedPacketActivity)
		snap   store.Snapshot
		want   deletionHold
	}{
		{"open and current: the usual deletion", nil, open, holdNone},
		{"nothing in Redis and nothing lost: the usual deletion", nil, store.Snapshot{}, holdNone},
		{"fenced in Redis", nil, fenced, holdWait},
		{"Redis behind status", fns(ahead), open, holdWait},
		{"DataLost recorded, Redis empty", fns(lost), store.Snapshot{}, holdWait},
		{"DataLost recorded but Redis holds it again: the fence step's business", fns(lost), open, holdNone},
		{"fenced, accepted at the current epoch", fns(annotations(redpacketv1alpha1.AnnotationAcceptRedisState, "0")), fenced, holdAccept},
		{"fenced, accepted at another epoch", fns(annotations(redpacketv1alpha1.AnnotationAcceptRedisState, "1")), fenced, holdWait},
		{"fenced, abandoned with the UID", fns(annotations(redpacketv1alpha1.AnnotationAbandon, "uid-1")), fenced, holdAbandon},
		{"fenced, abandoned with another UID", fns(annotations(redpacketv1alpha1.AnnotationAbandon, "uid-2")), fenced, holdWait},
		{"DataLost, abandoned with the UID", fns(lost, annotations(redpacketv1alpha1.AnnotationAbandon, "uid-1")), store.Snapshot{}, holdAbandon},
		{"DataLost cannot be accepted", fns(lost, annotations(redpacketv1alpha1.AnnotationAcceptRedisState, "0")), store.Snapshot{}, holdWait},
		{"both: the acceptance, which refunds, wins", fns(annotations(redpacketv1alpha1.AnnotationAcceptRedisState, "0",
			redpacketv1alpha1.AnnotationAbandon, "uid-1")), fenced, holdAccept},
		{"an abandon on an activity that is not held does nothing", fns(annotations(redpacketv1alpha1.AnnotationAbandon, "uid-1")), open, holdNone},
	}
	for _, tc := range cases {
		got, why := decideDeletionHold(testActivity(tc.mutate...), tc.snap)
		if got != tc.want {
			t.Errorf("%s: %s (%s), want %s", tc.name, got, why, tc.want)
		}
		if (got == holdNone) != (why == "") {
			t.Errorf("%s: %s with reason %q", tc.name, got, why)
		}
	}
}
