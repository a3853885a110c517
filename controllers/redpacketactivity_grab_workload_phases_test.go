package controllers

import (
	"context"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/store"
)

// The grab workload steps: the replica rule, and what they apply or refuse to adopt,
// against the fake API server.

// grabWorkloadStepNames are the normal steps that make the grab workload, in order.
var grabWorkloadStepNames = []string{"grab workload ownership", "redis user", "grab workload"}

// runGrabWorkloadSteps runs the grab workload steps of the normal chain on s, as
// runSteps runs them: their blockers end up in s.notReady, their halts in s.halted.
func (p *phaseTest) runGrabWorkloadSteps(t *testing.T, s *activityScope) error {
	t.Helper()
	var steps []reconcileStep
	for _, step := range p.r.normalSteps(p.r.patchStatusNow) {
		if slices.Contains(grabWorkloadStepNames, step.name) {
			steps = append(steps, step)
		}
	}
	if len(steps) != len(grabWorkloadStepNames) {
		t.Fatalf("%d of the grab workload steps %q are in the chain", len(steps), grabWorkloadStepNames)
	}
	_, err := runSteps(context.Background(), s, steps)
	return err
}

func TestReplicasToApply(t *testing.T) {
	const operatorDefault = 2
	live := func(annotation *string) *appsv1.Deployment {
		d := &appsv1.Deployment{}
		if annotation != nil {
			d.Annotations = map[string]string{specs.AnnotationSpecReplicas: *annotation}
		}
		return d
	}
	autoscaled := &specs.Capacity{MinReplicas: 4, MaxReplicas: 8}
	cases := []struct {
		name      string
		spec      *int32
		live      *appsv1.Deployment
		capacity  *specs.Capacity
		want      int32
		wantValue string
		wantApply bool
	}{
		{name: "autoscaled, new: the HPA's minimum now", spec: ptrTo[int32](3), capacity: autoscaled, want: 4, wantValue: "3", wantApply: true},
		{name: "autoscaled, live: left to the HPA", spec: ptrTo[int32](3), capacity: autoscaled, live: live(ptrTo("3"))},
		{name: "autoscaled, spec changed: still left to the HPA", spec: ptrTo[int32](5), capacity: autoscaled, live: live(ptrTo("3"))},
		{name: "new, spec unset: the operator's default", want: operatorDefault, wantApply: true},
		{name: "new, spec 3", spec: ptrTo[int32](3), want: 3, wantValue: "3", wantApply: true},
		{name: "new, spec 0 is a count too", spec: ptrTo[int32](0), want: 0, wantValue: "0", wantApply: true},
		{name: "spec 3 as last applied: the live count stays (kubectl scale)", spec: ptrTo[int32](3), live: live(ptrTo("3"))},
		{name: "spec unset as last applied: the live count stays", live: live(ptrTo(""))},
		{name: "spec changed from 3 to 5", spec: ptrTo[int32](5), live: live(ptrTo("3")), want: 5, wantValue: "5", wantApply: true},
		{name: "spec unset after 3: the operator's default", live: live(ptrTo("3")), want: operatorDefault, wantApply: true},
		{name: "a Deployment without the annotation", spec: ptrTo[int32](3), live: live(nil), want: 3, wantValue: "3", wantApply: true},
	}
	r := &RedPacketActivityReconciler{Options: Options{GrabReplicas: operatorDefault}.withDefaults()}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			a.Spec.GrabService.Replicas = tc.spec
			got, value, apply := r.replicasToApply(a, tc.live, tc.capacity)
			if apply != tc.wantApply || (apply && (got != tc.want || value != tc.wantValue)) {
				t.Errorf("replicasToApply = %d, %q, %t; want %d, %q, %t", got, value, apply, tc.want, tc.wantValue, tc.wantApply)
			}
		})
	}
}

func TestGrabWorkloadSteps(t *testing.T) {
	foreignDeployment := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "quiz-grab", Namespace: "default"}}
	foreignSecret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "quiz-grab-redis", Namespace: "default"}}
	cases := []struct {
		name           string
		objs           []client.Object
		ownRedis       bool
		wantNotAdopted string
		wantSecret     bool
	}{
		{name: "a new workload, with the operator's Redis in a Secret", wantSecret: true},
		{name: "a new workload on the activity's own Redis Secret", ownRedis: true},
		{name: "a foreign Deployment is not adopted", objs: []client.Object{foreignDeployment}, wantNotAdopted: "Deployment quiz-grab"},
		{name: "a foreign Redis Secret is not adopted", objs: []client.Object{foreignSecret}, wantNotAdopted: "Secret quiz-grab-redis"},
		{name: "a foreign Redis Secret is no matter with spec.redis, and left alone", objs: []client.Object{foreignSecret}, ownRedis: true, wantSecret: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			if tc.ownRedis {
				a.Spec.Redis = &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: "redis-conn"}}
			}
			p := newPhaseTest(t, store.Snapshot{}, append([]client.Object{a.DeepCopy()}, tc.objs...)...)
			s := p.scope(a)
			ctx := context.Background()
			if err := p.runGrabWorkloadSteps(t, s); err != nil || s.halted || s.notReady != nil {
				t.Fatalf("workload steps: halted %t, blocker %+v, %v", s.halted, s.notReady, err)
			}
			if !s.workloadChecked {
				t.Error("workloadChecked is false")
			}
			if tc.wantNotAdopted != "" {
				if !strings.Contains(s.notAdopted, tc.wantNotAdopted) {
					t.Errorf("notAdopted %q, want it to name %q", s.notAdopted, tc.wantNotAdopted)
				}
				if err := p.client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "quiz-grab"}, &corev1.Service{}); err == nil {
					t.Error("a Service was applied next to a foreign object: half a workload is no use")
				}
				if s.status.Endpoint != "" {
					t.Errorf("endpoint %q without a workload", s.status.Endpoint)
				}
				if got := p.log.with("users."); len(got) != 0 {
					t.Errorf("user calls %q for a workload that is not applied", got)
				}
				return
			}
			if s.notAdopted != "" {
				t.Fatalf("notAdopted %q", s.notAdopted)
			}
			key := client.ObjectKey{Namespace: "default", Name: "quiz-grab"}
			children := map[string]client.Object{
				"ServiceAccount": &corev1.ServiceAccount{}, "Role": &rbacv1.Role{}, "RoleBinding": &rbacv1.RoleBinding{},
				"Service": &corev1.Service{}, "Deployment": &appsv1.Deployment{},
			}
			for kind, obj := range children {
				if err := p.client.Get(ctx, key, obj); err != nil {
					t.Errorf("%s: %v", kind, err)
					continue
				}
				if !metav1.IsControlledBy(obj, a) {
					t.Errorf("%s is not controlled by the activity: %+v", kind, obj.GetOwnerReferences())
				}
				if obj.GetLabels()[specs.LabelManagedBy] != specs.ManagedByValue {
					t.Errorf("%s lacks the managed-by label the cache selects on", kind)
				}
			}
			d := children["Deployment"].(*appsv1.Deployment)
			if d.Spec.Replicas == nil || *d.Spec.Replicas != p.r.Options.GrabReplicas || d.Annotations[specs.AnnotationSpecReplicas] != "" {
				t.Errorf("deployment replicas %v, annotation %q", d.Spec.Replicas, d.Annotations[specs.AnnotationSpecReplicas])
			}
			secret := &corev1.Secret{}
			secretErr := p.client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "quiz-grab-redis"}, secret)
			if (secretErr == nil) != tc.wantSecret {
				t.Errorf("the Redis Secret quiz-grab-redis exists: %t, want %t", secretErr == nil, tc.wantSecret)
			}
			if secretErr == nil && metav1.IsControlledBy(secret, a) == tc.ownRedis {
				t.Errorf("the Redis Secret is controlled by the activity: %t, with spec.redis: %t", metav1.IsControlledBy(secret, a), tc.ownRedis)
			}
			if s.status.Endpoint != "http://quiz-grab.default.svc:8080" {
				t.Errorf("endpoint %q", s.status.Endpoint)
			}
			if s.deployment != nil {
				t.Error("a Deployment created now counts as observed with its (empty) status")
			}
		})
	}
}
