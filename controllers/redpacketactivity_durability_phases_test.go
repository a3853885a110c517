package controllers

import (
	"context"
	"fmt"
	"slices"
	"testing"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// The durability step: a Redis that cannot give what spec.durability asks for keeps
// the activity from opening, with a reason that says so.
func TestDurabilityStep(t *testing.T) {
	mode := func(m redpacketv1alpha1.DurabilityMode, replicas int32) func(*redpacketv1alpha1.RedPacketActivity) {
		return func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Spec.Durability = &redpacketv1alpha1.Durability{Mode: m, Replicas: replicas}
		}
	}
	notMet := fmt.Errorf("%w: appendfsync everysec", store.ErrDurabilityNotMet)
	cases := []struct {
		name       string
		mutate     []func(*redpacketv1alpha1.RedPacketActivity)
		fail       map[string]error
		wantStore  []string
		wantReason string
		wantErr    bool
	}{
		{name: "no durability asked: nothing checked"},
		{name: "None: nothing checked", mutate: fns(mode(redpacketv1alpha1.DurabilityNone, 0))},
		{name: "Fsync held", mutate: fns(mode(redpacketv1alpha1.DurabilityFsync, 0)), wantStore: []string{"store.CheckFsync"}},
		{name: "Fsync not held: not opened", mutate: fns(mode(redpacketv1alpha1.DurabilityFsync, 0)),
			fail: map[string]error{"CheckFsync": notMet}, wantStore: []string{"store.CheckFsync"}, wantReason: redpacketv1alpha1.ReasonDurabilityNotMet},
		{name: "Replicas held", mutate: fns(mode(redpacketv1alpha1.DurabilityReplicas, 2)), wantStore: []string{"store.CheckReplicas 2"}},
		{name: "too few replicas: not opened", mutate: fns(mode(redpacketv1alpha1.DurabilityReplicas, 2)),
			fail:      map[string]error{"CheckReplicas": fmt.Errorf("%w: 1 connected", store.ErrDurabilityNotMet)},
			wantStore: []string{"store.CheckReplicas 2"}, wantReason: redpacketv1alpha1.ReasonDurabilityNotMet},
		{name: "Redis fails the check: retried", mutate: fns(mode(redpacketv1alpha1.DurabilityReplicas, 1)),
			fail: map[string]error{"CheckReplicas": errRedisDown}, wantStore: []string{"store.CheckReplicas 1"},
			wantReason: redpacketv1alpha1.ReasonRedisUnavailable, wantErr: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity(tc.mutate...)
			p := newPhaseTest(t, openSnapshot())
			p.store.fail = tc.fail
			res, err := p.r.reconcileDurability(context.Background(), p.scope(a))
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v, want one: %t", err, tc.wantErr)
			}
			if got := p.log.with("store."); !slices.Equal(got, tc.wantStore) {
				t.Errorf("store calls %q, want %q", got, tc.wantStore)
			}
			if tc.wantReason == "" {
				if res.halt || res.blocker != nil {
					t.Errorf("result %+v, want the chain to go on", res)
				}
				return
			}
			if !res.halt || res.blocker == nil || res.blocker.reason != tc.wantReason {
				t.Errorf("result %+v, want a halt with reason %s", res, tc.wantReason)
			}
		})
	}
}
