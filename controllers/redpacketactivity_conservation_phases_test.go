package controllers

import (
	"context"
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/apimachinery/pkg/types"

	"redpacket.io/operator/store"
)

// shardedFakeStore is a fake store that also reads shard by shard.
type shardedFakeStore struct {
	*fakeStore
	view     store.View
	readErr  error
	resolved int
}

func (f *shardedFakeStore) Resolve(context.Context) (int, error) {
	f.log.add("store.Resolve")
	f.resolved++
	return 0, nil
}

func (f *shardedFakeStore) ReadShards(context.Context) (store.View, error) {
	f.log.add("store.ReadShards")
	return f.view, f.readErr
}

// The conservation step finishes half-done transfers of an open activity only, and
// exports what a steady reading finds out of place; it never halts the chain.
func TestConservationPhase(t *testing.T) {
	open := openSnapshot()
	closed := open
	closed.State = store.StateClosed
	balanced := store.View{Whole: open, Shards: []store.Snapshot{open}, Steady: true}
	lost := open
	lost.RemainingCount = 9 // a packet left the list outside any script
	unbalanced := store.View{Whole: lost, Shards: []store.Snapshot{lost}, Steady: true}
	unsteady := unbalanced
	unsteady.Steady = false

	cases := map[string]struct {
		snap        store.Snapshot
		seeded      bool
		view        store.View
		readErr     error
		wantCalls   []string
		wantPackets float64 // -1: no series
	}{
		"open and balanced":     {snap: open, seeded: true, view: balanced, wantCalls: []string{"store.Resolve", "store.ReadShards"}, wantPackets: 0},
		"open and a packet off": {snap: open, seeded: true, view: unbalanced, wantCalls: []string{"store.Resolve", "store.ReadShards"}, wantPackets: 1},
		"closed: no transfers":  {snap: closed, seeded: true, view: balanced, wantCalls: []string{"store.ReadShards"}, wantPackets: 0},
		"not steady: no figure": {snap: open, seeded: true, view: unsteady, wantCalls: []string{"store.Resolve", "store.ReadShards"}, wantPackets: -1},
		"read fails":            {snap: open, seeded: true, readErr: errors.New("down"), wantCalls: []string{"store.Resolve", "store.ReadShards"}, wantPackets: -1},
		"not seeded yet":        {snap: open, seeded: false, view: balanced, wantCalls: nil, wantPackets: -1},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			p := newPhaseTest(t, tc.snap)
			store := &shardedFakeStore{fakeStore: p.store, view: tc.view, readErr: tc.readErr}
			a := testActivity()
			a.Name = "conservation-" + name
			if tc.seeded {
				seededStatus(a)
			}
			s := p.scope(a)
			s.store = store
			s.seededRecorded = tc.seeded
			activityMetrics.Forget(types.NamespacedName{Namespace: a.Namespace, Name: a.Name})
			res, err := p.r.reconcileConservation(context.Background(), s)
			if err != nil || res.halt || res.blocker != nil {
				t.Fatalf("result %+v, %v; want nothing that stops the chain", res, err)
			}
			var calls []string
			for _, c := range p.log.all() {
				if c == "store.Resolve" || c == "store.ReadShards" {
					calls = append(calls, c)
				}
			}
			if len(calls) != len(tc.wantCalls) || (len(calls) > 0 && calls[0] != tc.wantCalls[0]) {
				t.Fatalf("calls %v, want %v", calls, tc.wantCalls)
			}
			if tc.wantPackets < 0 {
				if got := seriesOf(a.Namespace, a.Name); got != 0 {
					t.Fatalf("%d imbalance series of the activity, want none", got)
				}
				return
			}
			if got := testutil.ToFloat64(activityMetrics.redisImbalance.WithLabelValues(a.Namespace, a.Name, "packets")); got != tc.wantPackets {
				t.Fatalf("imbalance %v packets, want %v", got, tc.wantPackets)
			}
		})
	}
}

// seriesOf counts the imbalance series of one activity.
func seriesOf(ns, name string) int {
	n := 0
	for _, unit := range []string{"packets", "amount"} {
		if activityMetrics.redisImbalance.DeleteLabelValues(ns, name, unit) {
			n++
		}
	}
	return n
}
