package controllers

import (
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// The watch's predicates: which writes to an activity make the controller look at it
// at once. The grab service reports every second; only the reports that change what
// the controller says may pass.

// reporting is an Active activity whose grab service has reported, with
// GrabServiceAvailable True: the steady state in which reports must not pass.
func reporting() *redpacketv1alpha1.RedPacketActivity {
	a := testActivity(withWebhook)
	a.Status.Phase = redpacketv1alpha1.PhaseActive
	at := metav1.NewTime(testNow.Add(-time.Second))
	a.Status.LastReportTime = &at
	a.Status.RemainingCount, a.Status.ClaimedCount = ptrTo[int64](6), ptrTo[int64](4)
	a.Status.SettledCount, a.Status.DeadLetterCount = ptrTo[int64](2), ptrTo[int64](0)
	meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{Type: redpacketv1alpha1.ConditionGrabServiceAvailable,
		Status: metav1.ConditionTrue, Reason: redpacketv1alpha1.ReasonReporting})
	return a
}

type activityChange struct {
	name string
	// old is applied to both objects, new to the updated one only.
	old func(*redpacketv1alpha1.RedPacketActivity)
	new func(*redpacketv1alpha1.RedPacketActivity)
	// want is whether the grab-service signal predicate, the deletion predicate and
	// the whole watch predicate let the update through.
	wantSignal, wantDeletion, wantWatch bool
}

func nextReport(a *redpacketv1alpha1.RedPacketActivity) {
	at := metav1.NewTime(a.Status.LastReportTime.Add(time.Second))
	a.Status.LastReportTime = &at
}

var activityChanges = []activityChange{
	{
		name: "a report that only refreshes the time and counters",
		new: func(a *redpacketv1alpha1.RedPacketActivity) {
			nextReport(a)
			a.Status.RemainingCount, a.Status.ClaimedCount = ptrTo[int64](5), ptrTo[int64](5)
		},
	},
	{
		name: "the first report",
		old: func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Status.LastReportTime = nil
			meta.RemoveStatusCondition(&a.Status.Conditions, redpacketv1alpha1.ConditionGrabServiceAvailable)
		},
		new: func(a *redpacketv1alpha1.RedPacketActivity) {
			at := metav1.NewTime(testNow)
			a.Status.LastReportTime = &at
		},
		wantSignal: true, wantWatch: true,
	},
	{
		name: "a report while GrabServiceAvailable is False",
		old: func(a *redpacketv1alpha1.RedPacketActivity) {
			meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{Type: redpacketv1alpha1.ConditionGrabServiceAvailable,
				Status: metav1.ConditionFalse, Reason: redpacketv1alpha1.ReasonNoReplicas})
		},
		new: func(a *redpacketv1alpha1.RedPacketActivity) {
			meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{Type: redpacketv1alpha1.ConditionGrabServiceAvailable,
				Status: metav1.ConditionFalse, Reason: redpacketv1alpha1.ReasonNoReplicas})
			nextReport(a)
		},
		wantSignal: true, wantWatch: true,
	},
	{
		name: "a report while GrabServiceAvailable is False, without a new report time",
		old: func(a *redpacketv1alpha1.RedPacketActivity) {
			meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{Type: redpacketv1alpha1.ConditionGrabServiceAvailable,
				Status: metav1.ConditionFalse, Reason: redpacketv1alpha1.ReasonNoReplicas})
		},
		new: func(a *redpacketv1alpha1.RedPacketActivity) {
			meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{Type: redpacketv1alpha1.ConditionGrabServiceAvailable,
				Status: metav1.ConditionFalse, Reason: redpacketv1alpha1.ReasonNoReplicas})
			a.Status.RemainingCount = ptrTo[int64](5)
		},
	},
	{
		name:       "the last packet claimed",
		new:        func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.RemainingCount = ptrTo[int64](0) },
		wantSignal: true, wantWatch: true,
	},
	{
		name: "still no packet left",
		old:  func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.RemainingCount = ptrTo[int64](0) },
		new:  func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.RemainingCount = ptrTo[int64](0); nextReport(a) },
	},
	{
		name: "every claim of a closed activity settled",
		old:  func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.Phase = redpacketv1alpha1.PhaseExpired },
		new: func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Status.Phase = redpacketv1alpha1.PhaseExpired
			a.Status.SettledCount = ptrTo[int64](4)
		},
		wantSignal: true, wantWatch: true,
	},
	{
		name: "every claim of a deleted activity settled",
		old:  func(a *redpacketv1alpha1.RedPacketActivity) { a.DeletionTimestamp = &metav1.Time{Time: testNow} },
		new: func(a *redpacketv1alpha1.RedPacketActivity) {
			a.DeletionTimestamp = &metav1.Time{Time: testNow}
			a.Status.SettledCount = ptrTo[int64](4)
		},
		wantSignal: true, wantWatch: true,
	},
	{
		name: "every claim of an open activity settled",
		new:  func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.SettledCount = ptrTo[int64](4) },
	},
	{
		name:       "the first dead letter",
		new:        func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.DeadLetterCount = ptrTo[int64](1) },
		wantSignal: true, wantWatch: true,
	},
	{
		name: "another dead letter",
		old:  func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.DeadLetterCount = ptrTo[int64](1) },
		new:  func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.DeadLetterCount = ptrTo[int64](2) },
	},
	{
		name:      "a spec change (new generation)",
		new:       func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Paused = true; a.Generation++ },
		wantWatch: true,
	},
	{
		name:      "an annotation",
		new:       func(a *redpacketv1alpha1.RedPacketActivity) { a.Annotations = map[string]string{"poke": "1"} },
		wantWatch: true,
	},
	{
		name:      "a label",
		new:       func(a *redpacketv1alpha1.RedPacketActivity) { a.Labels = map[string]string{"team": "growth"} },
		wantWatch: true,
	},
	{
		name:         "marked for deletion",
		new:          func(a *redpacketv1alpha1.RedPacketActivity) { a.DeletionTimestamp = &metav1.Time{Time: testNow} },
		wantDeletion: true, wantWatch: true,
	},
	{
		name: "the controller's own status write",
		new: func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Status.Phase = redpacketv1alpha1.PhaseExhausted
			a.Status.ObservedGeneration = a.Generation
		},
	},
}

func TestWatchPredicates(t *testing.T) {
	predicates := []struct {
		name string
		p    predicate.Predicate
		want func(activityChange) bool
	}{
		{"grab service signal", grabServiceSignalPredicate(), func(c activityChange) bool { return c.wantSignal }},
		{"deletion", deletionPredicate(), func(c activityChange) bool { return c.wantDeletion }},
		{"watch", activityChangePredicate(), func(c activityChange) bool { return c.wantWatch }},
	}
	for _, tc := range activityChanges {
		t.Run(tc.name, func(t *testing.T) {
			old, updated := reporting(), reporting()
			if tc.old != nil {
				tc.old(old)
				tc.old(updated)
			}
			tc.new(updated)
			for _, p := range predicates {
				if got := p.p.Update(event.UpdateEvent{ObjectOld: old, ObjectNew: updated}); got != p.want(tc) {
					t.Errorf("%s predicate lets the update through: %t, want %t", p.name, got, p.want(tc))
				}
			}
		})
	}
}

// Creation and removal: the watch sees a new activity and a removed one; the signal
// and deletion predicates judge only their own kind of event.
func TestWatchPredicatesOnCreateAndDelete(t *testing.T) {
	a := reporting()
	cases := []struct {
		name               string
		p                  predicate.Predicate
		create, del, other bool
	}{
		{"watch", activityChangePredicate(), true, true, true},
		{"grab service signal", grabServiceSignalPredicate(), false, false, false},
		{"deletion", deletionPredicate(), false, true, false},
	}
	for _, tc := range cases {
		if got := tc.p.Create(event.CreateEvent{Object: a}); got != tc.create {
			t.Errorf("%s predicate on create: %t, want %t", tc.name, got, tc.create)
		}
		if got := tc.p.Delete(event.DeleteEvent{Object: a}); got != tc.del {
			t.Errorf("%s predicate on delete: %t, want %t", tc.name, got, tc.del)
		}
		if got := tc.p.Generic(event.GenericEvent{Object: a}); got != tc.other {
			t.Errorf("%s predicate on a generic event: %t, want %t", tc.name, got, tc.other)
		}
	}
}
