package node

import (
	"fmt"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/internal/rain"
)

// TestDeleteWithEveryPropagation deletes three activities with claims, one with
// each propagation policy, right after a rain. Foreground deletion (what Argo CD's
// prune uses) removes the grab Deployment before the activity; orphan deletion
// leaves the Deployment running; the operator settles in every case. Whatever
// the policy, every grant and the sponsor's refund must be credited, the activity
// must go away, and no Redis key of its UID may remain.
func TestDeleteWithEveryPropagation(t *testing.T) {
	requireNode(t)
	ns := namespace(t, "e2e-delete")
	const (
		total = int64(50000)
		count = int64(500)
		users = 300
	)
	policies := []string{"background", "foreground", "orphan"}
	uids := map[string]string{}
	grants := map[string]rain.Result{}
	for _, p := range policies {
		kubectl(t, activityManifest(ns, "del-"+p, total, count, 1), "apply", "-f", "-")
	}
	for _, p := range policies {
		name := "del-" + p
		kubectl(t, "", "-n", ns, "wait", "--for=condition=Ready", "rpa/"+name, "--timeout=180s")
		uids[p] = string(activity(t, ns, name).UID)
		r := rain.Run(t.Context(), rain.Spec{URL: grabURL(t, ns, name) + "/v1/grab", Users: users, Connections: 8,
			Timeout: 10 * time.Second, RetryUnavailable: true, Token: tokens(t, ns, name), UserPrefix: name})
		if r.Granted != users || r.DupPackets != 0 {
			t.Fatalf("%s: granted %d of %d users, %d packets twice (%s)", name, r.Granted, users, r.DupPackets, r.FirstError)
		}
		grants[p] = r
	}
	for _, p := range policies {
		kubectl(t, "", "-n", ns, "delete", "rpa", "del-"+p, "--cascade="+p, "--wait=false")
	}
	for _, p := range policies {
		name := "del-" + p
		took := eventually(t, 4*time.Minute, name+" to be gone", func() error {
			a := &redpacketv1alpha1.RedPacketActivity{}
			err := env.client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name}, a)
			if apierrors.IsNotFound(err) {
				return nil
			}
			if err != nil {
				return err
			}
			st := a.Status
			return fmt.Errorf("still there: phase %s, settled %d of %d", st.Phase, val(st.SettledCount), val(st.ClaimedCount))
		})
		credited, refund := booked(t, uids[p])
		var sum int64
		for _, d := range credited {
			sum += d.Amount
		}
		r := grants[p]
		if int64(len(credited)) != r.Granted || sum != r.GrantedSum {
			t.Errorf("%s: credited %d grants summing to %d, want %d summing to %d", name, len(credited), sum, r.Granted, r.GrantedSum)
		}
		if sum+refund != total {
			t.Errorf("%s: credited grants %d + refund %d != total %d", name, sum, refund, total)
		}
		if keys := keysOf(t, uids[p]); len(keys) != 0 {
			t.Errorf("%s: Redis still holds %v", name, keys)
		}
		t.Logf("--cascade=%s: gone %s after deletion, %d grants and the refund of %d credited", p, took.Round(100*time.Millisecond), len(credited), refund)
	}
}
