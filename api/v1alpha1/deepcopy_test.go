package v1alpha1_test

import (
	"reflect"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "redpacket.io/operator/api/v1alpha1"
)

func TestDeepCopyIsIndependent(t *testing.T) {
	orig := &v1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Name: "a", Namespace: "n", Labels: map[string]string{"k": "v"}},
		Spec: v1alpha1.RedPacketActivitySpec{
			TotalAmount: 100, Count: 10,
			Distribution: v1alpha1.Distribution{Seed: ptr.To[int64](1)},
			StartTime:    at("2026-12-31T20:00:00Z"),
			Redis:        &v1alpha1.RedisConnection{SecretRef: v1alpha1.SecretReference{Name: "r"}},
			GrabService: v1alpha1.GrabService{Replicas: ptr.To[int32](2),
				Auth: &v1alpha1.GrabAuth{TokenSecretRef: v1alpha1.SecretReference{Name: "t"}}},
			Settlement: &v1alpha1.Settlement{Webhook: &v1alpha1.Webhook{URL: "http://x",
				SecretRef: &v1alpha1.SecretReference{Name: "w"}}},
		},
		Status: v1alpha1.RedPacketActivityStatus{
			Conditions:     []metav1.Condition{{Type: v1alpha1.ConditionReady}},
			RemainingCount: ptr.To[int64](3),
			SplitSeed:      ptr.To[int64](9),
		},
	}
	dup := orig.DeepCopy()
	if !reflect.DeepEqual(orig, dup) {
		t.Fatal("the copy differs from the original")
	}
	*dup.Spec.Distribution.Seed = 2
	dup.Spec.StartTime.Time = dup.Spec.StartTime.Add(1)
	dup.Spec.Redis.SecretRef.Name = "changed"
	*dup.Spec.GrabService.Replicas = 5
	dup.Spec.GrabService.Auth.TokenSecretRef.Name = "changed"
	dup.Spec.Settlement.Webhook.SecretRef.Name = "changed"
	dup.Status.Conditions[0].Type = "changed"
	*dup.Status.RemainingCount = 0
	dup.Labels["k"] = "changed"
	if *orig.Spec.Distribution.Seed != 1 || orig.Spec.Redis.SecretRef.Name != "r" || *orig.Spec.GrabService.Replicas != 2 ||
		orig.Spec.GrabService.Auth.TokenSecretRef.Name != "t" || orig.Spec.Settlement.Webhook.SecretRef.Name != "w" ||
		orig.Status.Conditions[0].Type != v1alpha1.ConditionReady || *orig.Status.RemainingCount != 3 ||
		orig.Labels["k"] != "v" || !orig.Spec.StartTime.Equal(at("2026-12-31T20:00:00Z")) {
		t.Fatalf("changing the copy changed the original: %+v", orig)
	}
	list := &v1alpha1.RedPacketActivityList{Items: []v1alpha1.RedPacketActivity{*orig}}
	lc := list.DeepCopyObject().(*v1alpha1.RedPacketActivityList)
	lc.Items[0].Spec.Count = 99
	if list.Items[0].Spec.Count != 10 {
		t.Fatal("changing the copied list changed the original")
	}
}
