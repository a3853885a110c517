package controllers_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/test/wait"
)

// The grab pods run hardened (no root, no capabilities, no privilege escalation, a
// read-only root filesystem, the runtime's seccomp profile, the service-account token
// the reporter needs; the API server's restricted Pod Security Standard admits them),
// behind a NetworkPolicy that admits the grab port only; a
// PodDisruptionBudget exists while the Deployment has two replicas or more (from the
// spec or from kubectl scale) and goes when it has fewer. Both are controlled by the
// activity, and a deleted NetworkPolicy comes back.
func TestGrabPodsAreHardenedAndGuarded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()

	e.create(e.activity("guarded", 1000, 10, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.GrabService.Replicas = ptr(int32(2))
	}))
	a := e.waitPhase("guarded", redpacketv1alpha1.PhaseActive, 20*time.Second)
	key := client.ObjectKey{Namespace: e.ns, Name: "guarded-grab"}

	d := &appsv1.Deployment{}
	if err := e.c.Get(ctx, key, d); err != nil {
		t.Fatal(err)
	}
	pod := d.Spec.Template.Spec
	if pod.AutomountServiceAccountToken == nil || !*pod.AutomountServiceAccountToken {
		t.Errorf("automountServiceAccountToken %v, want true: the reporter writes the status", pod.AutomountServiceAccountToken)
	}
	if psc := pod.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.SeccompProfile == nil ||
		psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod security context %+v", psc)
	}
	if pod.HostNetwork || pod.HostPID || pod.HostIPC {
		t.Errorf("the grab pod shares a host namespace: network %t, pid %t, ipc %t", pod.HostNetwork, pod.HostPID, pod.HostIPC)
	}
	csc := pod.Containers[0].SecurityContext
	switch {
	case csc == nil:
		t.Fatal("the grab container has no security context")
	case csc.Privileged == nil || *csc.Privileged:
		t.Errorf("privileged %v, want false", csc.Privileged)
	case csc.AllowPrivilegeEscalation == nil || *csc.AllowPrivilegeEscalation:
		t.Errorf("allowPrivilegeEscalation %v, want false", csc.AllowPrivilegeEscalation)
	case csc.ReadOnlyRootFilesystem == nil || !*csc.ReadOnlyRootFilesystem:
		t.Errorf("readOnlyRootFilesystem %v, want true", csc.ReadOnlyRootFilesystem)
	case csc.RunAsNonRoot == nil || !*csc.RunAsNonRoot:
		t.Errorf("runAsNonRoot %v, want true", csc.RunAsNonRoot)
	case csc.Capabilities == nil || !slices.Equal(csc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(csc.Capabilities.Add) > 0:
		t.Errorf("capabilities %+v, want all dropped and none added", csc.Capabilities)
	case csc.SeccompProfile == nil || csc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault:
		t.Errorf("seccomp %+v, want RuntimeDefault", csc.SeccompProfile)
	}

	// The API server's PodSecurity admission admits the grab pod in a namespace that
	// enforces the restricted standard (a dry run: envtest runs no pods).
	restricted := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "restricted-",
		Labels: map[string]string{"pod-security.kubernetes.io/enforce": "restricted",
			"pod-security.kubernetes.io/enforce-version": "latest"}}}
	if err := e.c.Create(ctx, restricted); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.c.Delete(context.Background(), restricted) })
	probe := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "grab-pod", Namespace: restricted.Name}, Spec: *pod.DeepCopy()}
	if err := e.c.Create(ctx, probe, client.DryRunAll); err != nil {
		t.Errorf("the grab pod is refused under the restricted Pod Security Standard: %v", err)
	}
	privileged := probe.DeepCopy()
	privileged.Spec.Containers[0].SecurityContext.Capabilities.Add = []corev1.Capability{"NET_ADMIN"}
	if err := e.c.Create(ctx, privileged, client.DryRunAll); err == nil {
		t.Error("a pod adding NET_ADMIN passed the restricted standard: the namespace does not enforce it")
	}

	np := &networkingv1.NetworkPolicy{}
	if err := e.c.Get(ctx, key, np); err != nil {
		t.Fatalf("the grab NetworkPolicy: %v", err)
	}
	if !metav1.IsControlledBy(np, a) {
		t.Errorf("the NetworkPolicy is not controlled by the activity: %+v", np.OwnerReferences)
	}
	selects := func(sel *metav1.LabelSelector) bool {
		s, err := metav1.LabelSelectorAsSelector(sel)
		return err == nil && !s.Empty() && s.Matches(labels.Set(d.Spec.Template.Labels))
	}
	if !selects(&np.Spec.PodSelector) || !slices.Equal(np.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}) {
		t.Errorf("NetworkPolicy selector %+v, policy types %v", np.Spec.PodSelector, np.Spec.PolicyTypes)
	}
	if in := np.Spec.Ingress; len(in) != 1 || len(in[0].From) != 0 || len(in[0].Ports) != 1 || in[0].Ports[0].Port == nil ||
		*in[0].Ports[0].Port != intstr.FromInt32(8080) || in[0].Ports[0].Protocol == nil || *in[0].Ports[0].Protocol != corev1.ProtocolTCP {
		t.Errorf("NetworkPolicy ingress %+v, want TCP 8080 only", in)
	}

	pdb := e.waitBudget(key, true)
	if !metav1.IsControlledBy(pdb, a) {
		t.Errorf("the PodDisruptionBudget is not controlled by the activity: %+v", pdb.OwnerReferences)
	}
	if pdb.Spec.MaxUnavailable == nil || *pdb.Spec.MaxUnavailable != intstr.FromInt32(1) || pdb.Spec.MinAvailable != nil ||
		!selects(pdb.Spec.Selector) || pdb.Spec.UnhealthyPodEvictionPolicy == nil ||
		*pdb.Spec.UnhealthyPodEvictionPolicy != policyv1.AlwaysAllow {
		t.Errorf("PodDisruptionBudget spec %+v", pdb.Spec)
	}

	// One replica: no budget. kubectl scale to three: a budget again.
	e.patch("guarded", func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.GrabService.Replicas = ptr(int32(1)) })
	e.waitBudget(key, false)
	e.scale(d, 3)
	e.reconcileRoundTrip("guarded")
	e.waitBudget(key, true)

	// A deleted NetworkPolicy is put back.
	if err := e.c.Delete(ctx, np); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "the NetworkPolicy to come back", func() (bool, string) {
		back := &networkingv1.NetworkPolicy{}
		err := e.c.Get(ctx, key, back)
		return err == nil && back.UID != np.UID, fmt.Sprint(err)
	})
}

// A PodDisruptionBudget named <activity>-grab that someone else made is left alone,
// with a Warning event, and the rest of the workload is applied.
func TestForeignDisruptionBudgetIsLeftAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	two := intstr.FromInt32(2)
	foreign := &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Name: "theirs-grab", Namespace: e.ns},
		Spec: policyv1.PodDisruptionBudgetSpec{MinAvailable: &two,
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "other"}}},
	}
	if err := e.c.Create(ctx, foreign); err != nil {
		t.Fatal(err)
	}
	e.startController(nil)
	e.create(e.activity("theirs", 1000, 10, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.GrabService.Replicas = ptr(int32(2))
	}))
	e.waitEvent("theirs", corev1.EventTypeWarning, redpacketv1alpha1.ReasonNotAdopted)
	e.reconcileRoundTrip("theirs")
	got := &policyv1.PodDisruptionBudget{}
	if err := e.c.Get(ctx, client.ObjectKeyFromObject(foreign), got); err != nil {
		t.Fatal(err)
	}
	if len(got.OwnerReferences) != 0 || got.Spec.MinAvailable == nil || *got.Spec.MinAvailable != two || got.Spec.MaxUnavailable != nil ||
		got.Spec.Selector.MatchLabels["team"] != "other" {
		t.Fatalf("the foreign budget was changed: %+v %+v", got.OwnerReferences, got.Spec)
	}
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "theirs-grab"}, &appsv1.Deployment{}); err != nil {
		t.Fatalf("the grab Deployment: %v", err)
	}
}

// waitBudget waits until the PodDisruptionBudget key exists (present) or not, and
// returns it when present.
func (e *env) waitBudget(key client.ObjectKey, present bool) *policyv1.PodDisruptionBudget {
	e.t.Helper()
	pdb := &policyv1.PodDisruptionBudget{}
	wait.Until(e.t, 10*time.Second, fmt.Sprintf("PodDisruptionBudget %s present: %t", key.Name, present), func() (bool, string) {
		err := e.c.Get(context.Background(), key, pdb)
		if present {
			return err == nil, fmt.Sprint(err)
		}
		return apierrors.IsNotFound(err), fmt.Sprint(err)
	})
	return pdb
}
