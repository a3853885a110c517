package controllers_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// kstatusOf is what kstatus (the library Flux and kpt use) computes for the live
// object.
func kstatusOf(t *testing.T, a *redpacketv1alpha1.RedPacketActivity) status.Status {
	t.Helper()
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(a)
	if err != nil {
		t.Fatal(err)
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion(redpacketv1alpha1.GroupVersion.String())
	u.SetKind("RedPacketActivity")
	res, err := status.Compute(u)
	if err != nil {
		t.Fatalf("kstatus: %v", err)
	}
	return res.Status
}

// A Redis restored to an older copy of an activity, behind what status records: the
// controller fences it, never reopens or closes it, says so on Ready and Stalled
// (kstatus reads Failed), and the accept annotation of the current epoch takes the
// state as it is and lets grabbing go on in a new epoch.
func TestRolledBackRedisIsFencedUntilAccepted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()

	a := e.create(e.activity("rewound", 1000, 10))
	e.waitPhase("rewound", redpacketv1alpha1.PhaseActive, 20*time.Second)
	k := e.keys(a)
	if res := e.grab(a, "u1"); res.Outcome != store.Granted {
		t.Fatalf("grab: %+v", res)
	}
	backup := map[string]string{}
	for _, key := range k.All() {
		if v, err := e.rdb.Dump(ctx, key).Result(); err == nil {
			backup[key] = v
		} else if err != redis.Nil {
			t.Fatal(err)
		}
	}
	for _, u := range []string{"u2", "u3", "u4"} {
		if res := e.grab(a, u); res.Outcome != store.Granted {
			t.Fatalf("grab for %s: %+v", u, res)
		}
	}
	e.runReporter("rewound")
	e.waitStatus("rewound", "status to record 4 claims", func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return a.Status.ClaimedCount != nil && *a.Status.ClaimedCount == 4
	})

	for _, key := range k.All() {
		if err := e.rdb.Del(ctx, key).Err(); err != nil {
			t.Fatal(err)
		}
		if v, ok := backup[key]; ok {
			if err := e.rdb.RestoreReplace(ctx, key, 0, v).Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	e.bump("rewound", 1)
	a = e.waitCondition("rewound", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonRedisRolledBack, 15*time.Second)
	if a.Status.Phase != redpacketv1alpha1.PhaseFailed {
		t.Errorf("phase %s, want Failed", a.Status.Phase)
	}
	if c := findCondition(a, redpacketv1alpha1.ConditionStalled); c == nil || c.Status != metav1.ConditionTrue || c.Reason != redpacketv1alpha1.ReasonRedisRolledBack {
		t.Errorf("Stalled %+v, want True/RedisRolledBack", c)
	}
	if a.Status.ObservedGeneration != a.Generation {
		t.Errorf("observedGeneration %d of generation %d: a fenced activity is a final outcome", a.Status.ObservedGeneration, a.Generation)
	}
	if got := kstatusOf(t, a); got != status.FailedStatus {
		t.Errorf("kstatus %s, want Failed", got)
	}
	e.waitEvent("rewound", "Warning", redpacketv1alpha1.ReasonRedisRolledBack)
	if got := *a.Status.ClaimedCount; got != 4 {
		t.Errorf("claimedCount %d: a recorded counter was lowered", got)
	}

	// More reconciles: the activity stays fenced, nothing is granted or refunded.
	for i := range 3 {
		e.bump("rewound", 10+i)
	}
	consistently(t, 2*time.Second, "the fence", func() (bool, string) {
		snap := e.snapshot(a)
		return snap.Fenced != "" && snap.State == store.StateOpen && snap.Refunded == 0, snapshotLine(snap)
	})
	if res := e.grab(a, "u5"); res.Outcome != store.Fenced {
		t.Errorf("grab on the fenced activity: %+v, want fenced", res)
	}

	// The platform team reconciled the balances and accepts the state of epoch 0, in
	// its own name (shared_platform_permission_test.go).
	installPolicies(t)
	p := e.people()
	if err := e.annotate(p.asPlatform, "rewound", map[string]string{
		redpacketv1alpha1.AnnotationAcceptRedisState: "0", redpacketv1alpha1.AnnotationAcceptedBy: p.platform}); err != nil {
		t.Fatalf("accepting as the platform team: %v", err)
	}
	a = e.waitStatus("rewound", "the accepted state", func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return a.Status.RedisEpoch != nil && *a.Status.RedisEpoch == 1 && a.Status.Phase == redpacketv1alpha1.PhaseActive &&
			findCondition(a, redpacketv1alpha1.ConditionStalled) == nil
	})
	if a.Status.ClaimedCount == nil || *a.Status.ClaimedCount != 1 {
		t.Errorf("claimedCount %v after the accept, want Redis's 1", a.Status.ClaimedCount)
	}
	if got := kstatusOf(t, a); got == status.FailedStatus {
		t.Errorf("kstatus still Failed after the accept")
	}
	e.waitEvent("rewound", "Normal", redpacketv1alpha1.ReasonRedisStateAccepted)
	if res := e.grab(a, "u6"); res.Outcome != store.Granted {
		t.Errorf("grab after the accept: %+v, want granted", res)
	}
}

func snapshotLine(s store.Snapshot) string {
	return "state " + string(s.State) + ", fenced " + s.Fenced
}

// waitStatus polls the activity until ok says so.
func (e *env) waitStatus(name, what string, ok func(*redpacketv1alpha1.RedPacketActivity) bool) *redpacketv1alpha1.RedPacketActivity {
	e.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		a := e.get(name)
		if ok(a) {
			return a
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("waiting for %s: %s", what, describe(a))
		}
		time.Sleep(100 * time.Millisecond)
	}
}
