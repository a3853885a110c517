package controllers_test

import (
	"context"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// A namespace whose admission policy refuses every Service: the grab workload
// cannot be applied (the API server refuses it), yet the activity is seeded, opened, closed at endTime
// and the sponsor refunded, with the counters exact in status.
func TestCloseAndRefundDoNotWaitOnTheGrabWorkload(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	// An admission policy that refuses every Service in the test's namespace, as a
	// cluster's policy engine might.
	fail := admissionregistrationv1.Fail
	policy := &admissionregistrationv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "no-services-" + e.ns},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: &fail,
			MatchConstraints: &admissionregistrationv1.MatchResources{
				ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
					RuleWithOperations: admissionregistrationv1.RuleWithOperations{
						Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update},
						Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"services"}},
					},
				}},
			},
			Validations: []admissionregistrationv1.Validation{{Expression: "false", Message: "no Services in this namespace"}},
		},
	}
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "no-services-" + e.ns},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{
			PolicyName:        policy.Name,
			ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny},
			MatchResources: &admissionregistrationv1.MatchResources{NamespaceSelector: &metav1.LabelSelector{
				MatchLabels: map[string]string{"kubernetes.io/metadata.name": e.ns},
			}},
		},
	}
	for _, o := range []client.Object{policy, binding} {
		if err := e.c.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = e.c.Delete(context.Background(), o) })
	}
	// The policy takes effect once the API server has loaded it.
	deadline := time.Now().Add(20 * time.Second)
	for {
		probe := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "probe", Namespace: e.ns},
			Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 80}}}}
		err := e.c.Create(ctx, probe, client.DryRunAll)
		if err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the admission policy did not take effect")
		}
		time.Sleep(200 * time.Millisecond)
	}
	e.startController(nil)

	end := metav1.NewTime(time.Now().Add(4 * time.Second).Truncate(time.Second))
	a := e.create(e.activity("no-room", 1000, 10, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.EndTime = &end
	}))
	e.waitCondition("no-room", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonWorkloadFailed, 20*time.Second)
	for _, u := range []string{"a", "b"} {
		if res := e.grab(a, u); res.Outcome != store.Granted {
			t.Fatalf("grab for %s while the workload fails: %+v", u, res)
		}
	}
	// The workload keeps failing, so the generation is never observed; the phase
	// moves on all the same.
	a = e.waitStatus("no-room", "phase Expired", func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return a.Status.Phase == redpacketv1alpha1.PhaseExpired
	})
	snap := e.snapshot(a)
	if snap.State != store.StateClosed || snap.Refunded != 1000-snap.ClaimedAmount || snap.ClaimedCount != 2 {
		t.Fatalf("Redis after endTime: %+v, want closed with the rest refunded", snap)
	}
	a = e.waitStatus("no-room", "the refund in status", func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return a.Status.RefundedAmount != nil && *a.Status.RefundedAmount == snap.Refunded
	})
	st := a.Status
	if *st.ClaimedAmount+*st.RemainingAmount+*st.RefundedAmount != 1000 || *st.ClaimedCount != 2 || *st.RemainingCount != 0 {
		t.Errorf("status counters after the close: claimed %d (%d packets) + remaining %d (%d packets) + refunded %d, want 1000 with 2 claimed and none left",
			*st.ClaimedAmount, *st.ClaimedCount, *st.RemainingAmount, *st.RemainingCount, *st.RefundedAmount)
	}
}
