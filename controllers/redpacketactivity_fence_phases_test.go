package controllers

import (
	"context"
	"slices"
	"strings"
	"testing"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// The fence step: a Redis older than the resource is fenced and the activity Failed
// for good, never reopened; a person's accept of the current epoch lifts it.
func TestFenceStep(t *testing.T) {
	recorded := func(claimed, settled int64) func(*redpacketv1alpha1.RedPacketActivity) {
		return func(a *redpacketv1alpha1.RedPacketActivity) {
			seededStatus(a)
			redpacketv1alpha1.SetCounters(&a.Status, redpacketv1alpha1.Counters{
				RemainingCount: 10 - claimed, RemainingAmount: 1000 - 100*claimed,
				ClaimedCount: claimed, ClaimedAmount: 100 * claimed, SettledCount: settled, SettledAmount: 100 * settled})
		}
	}
	epoch := func(n int64) func(*redpacketv1alpha1.RedPacketActivity) {
		return func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.RedisEpoch = &n }
	}
	exhausted := func(a *redpacketv1alpha1.RedPacketActivity) { a.Status.Phase = redpacketv1alpha1.PhaseExhausted }
	acceptBy := func(v, user string) func(*redpacketv1alpha1.RedPacketActivity) {
		return func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Annotations = map[string]string{redpacketv1alpha1.AnnotationAcceptRedisState: v}
			if user != "" {
				a.Annotations[redpacketv1alpha1.AnnotationAcceptedBy] = user
			}
		}
	}
	accept := func(v string) func(*redpacketv1alpha1.RedPacketActivity) { return acceptBy(v, platformUser) }
	redis := func(claimed, settled, epoch int64, fenced string) store.Snapshot {
		s := openSnapshot()
		s.ClaimedCount, s.ClaimedAmount, s.RemainingCount = claimed, 100*claimed, 10-claimed
		s.SettledCount, s.SettledAmount, s.Epoch, s.Fenced = settled, 100*settled, epoch, fenced
		return s
	}
	cases := []struct {
		name        string
		mutate      []func(*redpacketv1alpha1.RedPacketActivity)
		snap        store.Snapshot
		wantFenced  bool
		wantStore   []string
		wantEpoch   int64
		wantWritten bool
		// wantRefused: the acceptance is refused with a Warning event.
		wantRefused bool
	}{
		{name: "Redis ahead of status: nothing to do", mutate: fns(recorded(4, 2)), snap: redis(5, 2, 0, "")},
		{name: "Redis equal to status: nothing to do", mutate: fns(recorded(4, 2)), snap: redis(4, 2, 0, "")},
		{name: "no counters recorded yet: nothing to compare", snap: redis(0, 0, 0, "")},
		{name: "Redis holds nothing: the seed step's business", mutate: fns(recorded(4, 2))},
		{name: "fewer claims than recorded: fenced", mutate: fns(recorded(4, 2)), snap: redis(1, 1, 0, ""),
			wantFenced: true, wantStore: []string{"store.Fence rolled_back"}},
		{name: "fewer settlements than recorded: fenced", mutate: fns(recorded(4, 2)), snap: redis(4, 1, 0, ""),
			wantFenced: true, wantStore: []string{"store.Fence rolled_back"}},
		{name: "a grab replica fenced it first: not written twice", mutate: fns(recorded(4, 2)), snap: redis(5, 2, 0, "rolled_back"),
			wantFenced: true},
		{name: "an epoch below status: restored from before an accept", mutate: fns(recorded(4, 2), epoch(2)), snap: redis(9, 9, 1, ""),
			wantFenced: true, wantStore: []string{"store.Fence rolled_back"}},
		{name: "a later epoch than status: status has not caught up with an accept", mutate: fns(recorded(4, 2)), snap: redis(1, 0, 1, "")},
		{name: "open in Redis, Exhausted in status: fenced", mutate: fns(recorded(4, 2), exhausted), snap: redis(4, 2, 0, ""),
			wantFenced: true, wantStore: []string{"store.Fence rolled_back"}},
		{name: "accepted at the current epoch: a new epoch, counters as Redis has them", mutate: fns(recorded(4, 2), accept("0")),
			snap: redis(1, 1, 0, "rolled_back"), wantStore: []string{"store.Accept 0", "store.Snapshot"}, wantEpoch: 1, wantWritten: true},
		{name: "an accept of another epoch does nothing", mutate: fns(recorded(4, 2), accept("3")), snap: redis(1, 1, 0, "rolled_back"),
			wantFenced: true},
		{name: "an accept that names nobody is refused", mutate: fns(recorded(4, 2), acceptBy("0", "")), snap: redis(1, 1, 0, "rolled_back"),
			wantFenced: true, wantRefused: true},
		{name: "an accept by a user without the platform verb is refused", mutate: fns(recorded(4, 2), acceptBy("0", "tenant-bob")),
			snap: redis(1, 1, 0, "rolled_back"), wantFenced: true, wantRefused: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity(tc.mutate...)
			p := newPhaseTest(t, tc.snap)
			s := p.scope(a)
			res, err := p.r.reconcileFence(context.Background(), s)
			if err != nil {
				t.Fatalf("fence step: %v", err)
			}
			if got := p.log.with("store."); !slices.Equal(got, tc.wantStore) {
				t.Errorf("store calls %q, want %q", got, tc.wantStore)
			}
			if tc.wantFenced {
				if !res.halt || !res.final || res.blocker == nil || res.blocker.reason != redpacketv1alpha1.ReasonRedisRolledBack {
					t.Fatalf("result %+v, want a final halt with reason RedisRolledBack", res)
				}
				if s.status.Phase != redpacketv1alpha1.PhaseFailed || s.stalled == nil {
					t.Errorf("phase %q stalled %v, want Failed and Stalled", s.status.Phase, s.stalled)
				}
				if !strings.Contains(res.blocker.message, redpacketv1alpha1.AnnotationAcceptRedisState) {
					t.Errorf("message %q does not say the way back", res.blocker.message)
				}
				if p.store.snap.Fenced == "" {
					t.Errorf("Redis is not fenced")
				}
				refusedEvent := slices.Contains(p.eventReasons(), "Warning "+redpacketv1alpha1.ReasonAcceptNotAllowed)
				if refusedEvent != tc.wantRefused || tc.wantRefused && !strings.Contains(res.blocker.message, "the acceptance was refused") {
					t.Errorf("refusal event %t, message %q; want refused: %t", refusedEvent, res.blocker.message, tc.wantRefused)
				}
				return
			}
			if res.halt || res.blocker != nil || s.stalled != nil {
				t.Fatalf("result %+v stalled %v, want the chain to go on", res, s.stalled)
			}
			if p.store.snap.Fenced != "" {
				t.Errorf("Redis is fenced (%s)", p.store.snap.Fenced)
			}
			writes := p.log.with("status.counters")
			if tc.wantWritten != (len(writes) == 1) {
				t.Fatalf("counter writes %q, want one: %t", writes, tc.wantWritten)
			}
			if tc.wantWritten {
				if !strings.HasSuffix(writes[0], "epoch=1 lower=true") || s.status.RedisEpoch == nil || *s.status.RedisEpoch != tc.wantEpoch {
					t.Errorf("counters %q, status epoch %v, want epoch %d written with lower counters allowed", writes[0], s.status.RedisEpoch, tc.wantEpoch)
				}
				if la := s.status.LastAcceptance; la == nil || la.By != platformUser || la.Epoch != 0 || !la.At.Time.Equal(testNow) {
					t.Errorf("lastAcceptance %+v, want epoch 0 by %s at %s", la, platformUser, testNow)
				}
				if got := p.log.with("review"); !slices.Equal(got, []string{"review " + platformUser + " accept-redis-state"}) {
					t.Errorf("access reviews %q", got)
				}
				if p.status.counters[0].ClaimedCount != 1 {
					t.Errorf("accepted counters %+v, want Redis's (1 claim)", p.status.counters[0])
				}
			}
		})
	}
}

func fns(f ...func(*redpacketv1alpha1.RedPacketActivity)) []func(*redpacketv1alpha1.RedPacketActivity) {
	return f
}
