package controllers

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// The condition summary: what Ready, GrabServiceAvailable and Settled say, computed
// from the scope at the end of a reconcile.

func TestComputeSettled(t *testing.T) {
	pending := store.Snapshot{State: store.StateOpen, Count: 10, Total: 1000, ClaimedCount: 2, ClaimedAmount: 150, SettledCount: 1}
	cases := []struct {
		name        string
		webhook     bool
		read        bool
		snap        store.Snapshot
		before      string // Settled already in status, Status/Reason
		notReady    string
		want        string
		wantMessage string
	}{
		{
			name: "no settlement configured", read: true, snap: pending,
			want: "False/NotConfigured", wantMessage: "spec.settlement is absent; 2 claims wait in the activity's stream until it is configured",
		},
		{
			name: "no settlement configured, Redis not read", want: "False/NotConfigured",
			wantMessage: "spec.settlement is absent; 0 claims wait",
		},
		{name: "Redis not read yet", webhook: true, want: "Unknown/Pending", wantMessage: "Redis has not been read yet"},
		{name: "Redis not read this time: what status says stands", webhook: true, before: "True/AllSettled", want: "True/AllSettled"},
		{name: "Redis holds nothing", webhook: true, read: true, want: "Unknown/Pending", wantMessage: "Redis holds no data for the activity"},
		{name: "Redis lost it", webhook: true, read: true, notReady: redpacketv1alpha1.ReasonDataLost, want: "Unknown/DataLost"},
		{
			name: "claims to settle", webhook: true, read: true, snap: pending,
			want: "False/SettlementPending", wantMessage: "1 of 2 claims settled",
		},
		{
			name: "claims and the refund to settle", webhook: true, read: true,
			snap: store.Snapshot{State: store.StateClosed, CloseReason: store.CloseExpired, Count: 10, Total: 1000, ClaimedCount: 2,
				ClaimedAmount: 150, SettledCount: 2, SettledAmount: 150, Refunded: 850},
			want: "False/SettlementPending", wantMessage: "2 of 2 claims settled; 0 of the 850 refund settled",
		},
		{
			name: "dead letters", webhook: true, read: true,
			snap: store.Snapshot{State: store.StateOpen, Count: 10, Total: 1000, ClaimedCount: 2, SettledCount: 1, DeadCount: 1},
			want: "False/DeadLetters", wantMessage: "1 deliveries were parked in the dead-letter stream",
		},
		{
			name: "all settled", webhook: true, read: true,
			snap: store.Snapshot{State: store.StateClosed, CloseReason: store.CloseExpired, Count: 10, Total: 1000, ClaimedCount: 2,
				ClaimedAmount: 150, SettledCount: 2, SettledAmount: 150, Refunded: 850, RefundSettled: 850},
			want: "True/AllSettled", wantMessage: "all 2 claims (150) and the refund (850) are credited",
		},
		{
			name: "nothing claimed yet counts as settled", webhook: true, read: true, snap: openSnapshot(),
			want: "True/AllSettled",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			if tc.webhook {
				withWebhook(a)
			}
			s := newActivityScope(a, testNow)
			s.snapshot, s.snapshotRead = tc.snap, tc.read
			if tc.before != "" {
				status, reason, _ := strings.Cut(tc.before, "/")
				s.setCondition(redpacketv1alpha1.ConditionSettled, metav1.ConditionStatus(status), reason, "before")
			}
			if tc.notReady != "" {
				s.notReady = notReady(tc.notReady, "lost")
			}
			computeSettled(s)
			if got := condition(s.status, redpacketv1alpha1.ConditionSettled); got != tc.want {
				t.Errorf("Settled %s, want %s", got, tc.want)
			}
			if msg := conditionMessage(s.status, redpacketv1alpha1.ConditionSettled); !strings.Contains(msg, tc.wantMessage) {
				t.Errorf("Settled's message %q, want it to contain %q", msg, tc.wantMessage)
			}
		})
	}
}

// settled is the rule behind Settled=True and behind purging a deleted activity.
func TestSettled(t *testing.T) {
	cases := []struct {
		snap store.Snapshot
		want bool
	}{
		{store.Snapshot{}, true},
		{store.Snapshot{ClaimedCount: 3, SettledCount: 3}, true},
		{store.Snapshot{ClaimedCount: 3, SettledCount: 2}, false},
		{store.Snapshot{ClaimedCount: 3, SettledCount: 3, Refunded: 10}, false},
		{store.Snapshot{ClaimedCount: 3, SettledCount: 3, Refunded: 10, RefundSettled: 10}, true},
	}
	for _, tc := range cases {
		if got := settled(tc.snap); got != tc.want {
			t.Errorf("settled(%+v) = %t, want %t", tc.snap, got, tc.want)
		}
	}
}

func TestConditionSummary(t *testing.T) {
	const timeout = 10 * time.Second
	report := func(age time.Duration) func(*redpacketv1alpha1.RedPacketActivity) {
		return func(a *redpacketv1alpha1.RedPacketActivity) {
			at := metav1.NewTime(testNow.Add(-age))
			a.Status.LastReportTime = &at
		}
	}
	available := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "quiz-grab"}, Status: appsv1.DeploymentStatus{AvailableReplicas: 2}}
	cases := []struct {
		name string
		// phase, phaseMessage, notReady, deployment, notAdopted and workloadChecked
		// are what the steps left in the scope.
		mutate          func(*redpacketv1alpha1.RedPacketActivity)
		phase           redpacketv1alpha1.Phase
		phaseMessage    string
		notReady        *readyBlocker
		deployment      *appsv1.Deployment
		notAdopted      string
		workloadChecked bool
		wantPhase       redpacketv1alpha1.Phase
		wantReady       string
		wantReadyMsg    string
		wantGrab        string
		wantSeeded      string
		wantStaleIn     time.Duration
	}{
		{
			name: "nothing happened yet", wantPhase: redpacketv1alpha1.PhasePending,
			wantReady: "False/Pending", wantReadyMsg: "the activity is Pending", wantGrab: "False/NoReplicaAvailable", wantSeeded: "False/Pending",
		},
		{
			name: "a step's blocker wins over the phase", phase: redpacketv1alpha1.PhaseActive, mutate: report(time.Second),
			notReady: notReady(redpacketv1alpha1.ReasonRedisUnavailable, "Redis at r:1 does not answer"), workloadChecked: true,
			wantPhase: redpacketv1alpha1.PhaseActive, wantReady: "False/RedisUnavailable", wantReadyMsg: "Redis at r:1 does not answer",
			wantGrab: "True/Reporting", wantStaleIn: timeout - time.Second + 100*time.Millisecond,
		},
		{
			name: "Active with a fresh report: Ready", phase: redpacketv1alpha1.PhaseActive, phaseMessage: "grabbing is open",
			mutate: report(3 * time.Second), workloadChecked: true,
			wantPhase: redpacketv1alpha1.PhaseActive, wantReady: "True/Active", wantReadyMsg: "grabbing is open",
			wantGrab: "True/Reporting", wantStaleIn: timeout - 3*time.Second + 100*time.Millisecond,
		},
		{
			name: "Active with an available Deployment: Ready", phase: redpacketv1alpha1.PhaseActive, phaseMessage: "grabbing is open",
			deployment: available, workloadChecked: true,
			wantPhase: redpacketv1alpha1.PhaseActive, wantReady: "True/Active", wantGrab: "True/ReplicasAvailable",
		},
		{
			name: "a report before the Deployment has an available replica: not Ready", phase: redpacketv1alpha1.PhaseActive,
			phaseMessage: "grabbing is open", mutate: report(time.Second), workloadChecked: true,
			deployment: &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "quiz-grab"},
				Status: appsv1.DeploymentStatus{ObservedGeneration: 1, Replicas: 2, UnavailableReplicas: 2}},
			wantPhase: redpacketv1alpha1.PhaseActive, wantReady: "False/GrabServiceUnavailable", wantGrab: "False/NoReplicaAvailable",
			wantReadyMsg: "deployment quiz-grab has no available replica of 2 (last report 2026-12-31T19:59:59Z",
		},
		{
			name: "a report where no Deployment controller acts: Ready", phase: redpacketv1alpha1.PhaseActive,
			phaseMessage: "grabbing is open", mutate: report(time.Second), workloadChecked: true,
			deployment: &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "quiz-grab"}},
			wantPhase:  redpacketv1alpha1.PhaseActive, wantReady: "True/Active", wantGrab: "True/Reporting",
			wantStaleIn: timeout - time.Second + 100*time.Millisecond,
		},
		{
			name: "Active with no replica: not Ready", phase: redpacketv1alpha1.PhaseActive, phaseMessage: "grabbing is open with 10 of 10 packets left",
			workloadChecked: true,
			wantPhase:       redpacketv1alpha1.PhaseActive, wantReady: "False/GrabServiceUnavailable",
			wantReadyMsg: "grabbing is open with 10 of 10 packets left, but no grab replica is available to answer users (NoReplicaAvailable: ",
			wantGrab:     "False/NoReplicaAvailable",
		},
		{
			name: "Scheduled with a stale report: not Ready", phase: redpacketv1alpha1.PhaseScheduled, mutate: report(timeout),
			workloadChecked: true,
			wantPhase:       redpacketv1alpha1.PhaseScheduled, wantReady: "False/GrabServiceUnavailable", wantGrab: "False/NoReplicaAvailable",
			wantReadyMsg: "(last report 2026-12-31T19:59:50Z)",
		},
		{
			name: "Paused with no replica: not Ready", phase: redpacketv1alpha1.PhasePaused, workloadChecked: true,
			wantPhase: redpacketv1alpha1.PhasePaused, wantReady: "False/GrabServiceUnavailable", wantGrab: "False/NoReplicaAvailable",
		},
		{
			name: "Exhausted needs no replica", phase: redpacketv1alpha1.PhaseExhausted, phaseMessage: "all 10 packets were claimed",
			workloadChecked: true,
			wantPhase:       redpacketv1alpha1.PhaseExhausted, wantReady: "True/Exhausted", wantGrab: "False/NoReplicaAvailable",
		},
		{
			name: "Expired needs no replica", phase: redpacketv1alpha1.PhaseExpired, workloadChecked: true,
			wantPhase: redpacketv1alpha1.PhaseExpired, wantReady: "True/Expired", wantReadyMsg: "the activity is Expired", wantGrab: "False/NoReplicaAvailable",
		},
		{
			name: "Failed is not Ready", phase: redpacketv1alpha1.PhaseFailed, workloadChecked: true,
			wantPhase: redpacketv1alpha1.PhaseFailed, wantReady: "False/Failed", wantGrab: "False/NoReplicaAvailable",
		},
		{
			name: "a foreign workload: NotAdopted, whatever reports", phase: redpacketv1alpha1.PhaseActive, mutate: report(time.Second),
			deployment: available, notAdopted: "Deployment quiz-grab already exists", workloadChecked: true,
			wantPhase: redpacketv1alpha1.PhaseActive, wantReady: "False/GrabServiceUnavailable", wantGrab: "False/NotAdopted",
		},
		{
			name: "the workload step did not run: NotAdopted stands", phase: redpacketv1alpha1.PhaseActive, mutate: func(a *redpacketv1alpha1.RedPacketActivity) {
				report(time.Second)(a)
				meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{Type: redpacketv1alpha1.ConditionGrabServiceAvailable,
					Status: metav1.ConditionFalse, Reason: redpacketv1alpha1.ReasonNotAdopted, Message: "Deployment quiz-grab", ObservedGeneration: a.Generation})
			},
			wantPhase: redpacketv1alpha1.PhaseActive, wantReady: "False/GrabServiceUnavailable", wantGrab: "False/NotAdopted",
		},
		{
			name: "the schedule step did not run: Ready's last message stands", phase: redpacketv1alpha1.PhaseExpired,
			mutate: func(a *redpacketv1alpha1.RedPacketActivity) {
				meta.SetStatusCondition(&a.Status.Conditions, metav1.Condition{Type: redpacketv1alpha1.ConditionReady,
					Status: metav1.ConditionTrue, Reason: "Expired", Message: "700 was refunded to the sponsor"})
			},
			wantPhase: redpacketv1alpha1.PhaseExpired, wantReady: "True/Expired", wantReadyMsg: "700 was refunded to the sponsor",
			wantGrab: "False/NoReplicaAvailable",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			a.Status.ObservedGeneration = 1
			if tc.mutate != nil {
				tc.mutate(a)
			}
			p := newPhaseTest(t, store.Snapshot{})
			p.r.Options.GrabReportTimeout = timeout
			s := newActivityScope(a, testNow)
			s.status.Phase = tc.phase
			s.phaseMessage = tc.phaseMessage
			s.notReady = tc.notReady
			s.deployment = tc.deployment
			s.notAdopted = tc.notAdopted
			s.workloadChecked = tc.workloadChecked
			st, staleIn := p.r.computeStatus(s)
			if st.Phase != tc.wantPhase {
				t.Errorf("phase %q, want %q", st.Phase, tc.wantPhase)
			}
			if got := condition(st, redpacketv1alpha1.ConditionReady); got != tc.wantReady {
				t.Errorf("Ready %s, want %s", got, tc.wantReady)
			}
			if msg := conditionMessage(st, redpacketv1alpha1.ConditionReady); !strings.Contains(msg, tc.wantReadyMsg) {
				t.Errorf("Ready's message %q, want it to contain %q", msg, tc.wantReadyMsg)
			}
			if got := condition(st, redpacketv1alpha1.ConditionGrabServiceAvailable); got != tc.wantGrab {
				t.Errorf("GrabServiceAvailable %s, want %s", got, tc.wantGrab)
			}
			if tc.wantSeeded != "" {
				if got := condition(st, redpacketv1alpha1.ConditionSeeded); got != tc.wantSeeded {
					t.Errorf("Seeded %s, want %s", got, tc.wantSeeded)
				}
			}
			if condition(st, redpacketv1alpha1.ConditionSettled) == "" {
				t.Error("no Settled condition")
			}
			if staleIn != tc.wantStaleIn {
				t.Errorf("stale in %s, want %s", staleIn, tc.wantStaleIn)
			}
			if st.ObservedGeneration != 1 {
				t.Errorf("observedGeneration %d: the summary must leave it to Reconcile", st.ObservedGeneration)
			}
			for _, c := range st.Conditions {
				if c.ObservedGeneration != a.Generation {
					t.Errorf("%s observed generation %d, want %d", c.Type, c.ObservedGeneration, a.Generation)
				}
			}
		})
	}
}

// A status write sends only the controller's fields, only when they changed, and
// reports each condition transition once as an event.
func TestPatchStatus(t *testing.T) {
	a := testActivity(withWebhook)
	claimed := int64(3)
	a.Status.ClaimedCount = &claimed // the grab service's
	p := newPhaseTest(t, store.Snapshot{})
	s := newActivityScope(a, testNow)
	s.notReady = notReady(redpacketv1alpha1.ReasonRedisUnavailable, "down")
	ctx := context.Background()

	if _, err := p.r.patchStatus(ctx, s); err != nil {
		t.Fatal(err)
	}
	if len(p.status.applied) != 1 {
		t.Fatalf("%d writes, want 1", len(p.status.applied))
	}
	if w := p.status.applied[0]; w.ClaimedCount != nil {
		t.Errorf("the write carries the grab service's claimedCount")
	}
	events := p.eventReasons()
	for _, want := range []string{"Normal Pending", "Warning RedisUnavailable", "Normal NoReplicaAvailable"} {
		if !slices.Contains(events, want) {
			t.Errorf("events %q, want %q among them", events, want)
		}
	}
	if slices.ContainsFunc(events, func(e string) bool {
		return strings.HasSuffix(e, " "+redpacketv1alpha1.ReasonPending) && e != "Normal Pending"
	}) {
		t.Errorf("events %q", events)
	}
	if a.Status.ClaimedCount == nil || *a.Status.ClaimedCount != 3 || condition(a.Status, redpacketv1alpha1.ConditionReady) != "False/RedisUnavailable" {
		t.Errorf("the scope's activity after the write: %s, claimed %v", describeStatus(a.Status), a.Status.ClaimedCount)
	}

	// The same again: nothing to send, nothing to report.
	s2 := newActivityScope(a, testNow)
	s2.notReady = notReady(redpacketv1alpha1.ReasonRedisUnavailable, "down")
	if _, err := p.r.patchStatus(ctx, s2); err != nil {
		t.Fatal(err)
	}
	if len(p.status.applied) != 1 || len(p.eventReasons()) != 0 {
		t.Errorf("an unchanged status was written again (%d writes) or reported", len(p.status.applied))
	}

	// A failed write leaves the scope's activity as it was and reports nothing.
	p.status.err = errors.New("the API server is down")
	s3 := newActivityScope(a, testNow)
	if _, err := p.r.patchStatus(ctx, s3); err == nil {
		t.Fatal("the write's error was lost")
	}
	if condition(a.Status, redpacketv1alpha1.ConditionReady) != "False/RedisUnavailable" || len(p.eventReasons()) != 0 {
		t.Errorf("after a failed write: %s", describeStatus(a.Status))
	}
}

// Settled's routine back-and-forth is not reported; dead letters are, and so is full
// settlement of a closed activity.
func TestSettledTransitionEvents(t *testing.T) {
	cases := []struct {
		name  string
		phase redpacketv1alpha1.Phase
		from  string
		to    string
		want  string
	}{
		{"claims flowing", redpacketv1alpha1.PhaseActive, "True/AllSettled", "False/SettlementPending", ""},
		{"caught up while open", redpacketv1alpha1.PhaseActive, "False/SettlementPending", "True/AllSettled", ""},
		{"caught up when closed", redpacketv1alpha1.PhaseExpired, "False/SettlementPending", "True/AllSettled", "Normal AllSettled"},
		{"a dead letter", redpacketv1alpha1.PhaseActive, "False/SettlementPending", "False/DeadLetters", "Warning DeadLetters"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPhaseTest(t, store.Snapshot{})
			cond := func(s string) redpacketv1alpha1.RedPacketActivityStatus {
				status, reason, _ := strings.Cut(s, "/")
				return redpacketv1alpha1.RedPacketActivityStatus{Phase: tc.phase, Conditions: []metav1.Condition{
					{Type: redpacketv1alpha1.ConditionSettled, Status: metav1.ConditionStatus(status), Reason: reason},
				}}
			}
			p.r.emitTransitionEvents(testActivity(), cond(tc.from), cond(tc.to))
			got := strings.Join(p.eventReasons(), ",")
			if got != tc.want {
				t.Errorf("events %q, want %q", got, tc.want)
			}
		})
	}
}
