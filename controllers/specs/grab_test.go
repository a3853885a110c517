package specs

import (
	"encoding/json"
	"maps"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// The grab workload's objects as they are sent to the API server: every builder's
// apply configuration is turned into its API type through JSON, the way the apply
// sends it, and the fields that matter are checked there.

// testActivity is the activity "quiz" in namespace "ns", changed by mutate.
func testActivity(mutate ...func(*redpacketv1alpha1.RedPacketActivity)) *redpacketv1alpha1.RedPacketActivity {
	a := &redpacketv1alpha1.RedPacketActivity{ObjectMeta: metav1.ObjectMeta{Name: "quiz", Namespace: "ns", UID: types.UID("uid-1")}}
	for _, m := range mutate {
		m(a)
	}
	return a
}

// sent is the object an apply configuration sends, as its API type T.
func sent[T any](t *testing.T, ac any) *T {
	t.Helper()
	b, err := json.Marshal(ac)
	if err != nil {
		t.Fatal(err)
	}
	obj := new(T)
	if err := json.Unmarshal(b, obj); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	return obj
}

// objectHead is the kind and metadata of any object.
type objectHead struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
}

// checkObjectMeta checks what every applied object of the workload carries: its
// kind, the name and namespace, the workload's labels, and the activity's
// controller reference, which makes the garbage collector delete it with the
// activity.
func checkObjectMeta(t *testing.T, a *redpacketv1alpha1.RedPacketActivity, wantKind, wantName string, ac any) {
	t.Helper()
	obj := sent[objectHead](t, ac)
	if obj.Kind != wantKind || obj.Name != wantName || obj.Namespace != a.Namespace {
		t.Errorf("%s %s/%s, want %s %s/%s", obj.Kind, obj.Namespace, obj.Name, wantKind, a.Namespace, wantName)
	}
	if !maps.Equal(obj.Labels, GrabLabels(a)) {
		t.Errorf("%s labels %v, want %v", wantKind, obj.Labels, GrabLabels(a))
	}
	if obj.Labels[LabelManagedBy] != ManagedByValue {
		t.Errorf("%s lacks %s=%s, so the operator's cache would not see it", wantKind, LabelManagedBy, ManagedByValue)
	}
	if !metav1.IsControlledBy(obj, a) {
		t.Fatalf("%s is not controlled by the activity: %+v", wantKind, obj.OwnerReferences)
	}
	ref := obj.OwnerReferences[0]
	if len(obj.OwnerReferences) != 1 || ref.Kind != "RedPacketActivity" || ref.APIVersion != redpacketv1alpha1.GroupVersion.String() ||
		ref.Name != a.Name || ref.BlockOwnerDeletion == nil || !*ref.BlockOwnerDeletion {
		t.Errorf("%s owner references %+v, want one blocking controller reference to the activity", wantKind, obj.OwnerReferences)
	}
}

func TestGrabNames(t *testing.T) {
	a := testActivity()
	if got := GrabName(a); got != "quiz-grab" {
		t.Errorf("GrabName %q", got)
	}
	if got := GrabRedisSecretName(a); got != "quiz-grab-redis" {
		t.Errorf("GrabRedisSecretName %q", got)
	}
	if got := GrabEndpoint(a); got != "http://quiz-grab.ns.svc:8080" {
		t.Errorf("GrabEndpoint %q", got)
	}
}

// The selector picks the activity's own pods, which carry it among their labels,
// and never another activity's.
func TestGrabSelector(t *testing.T) {
	a, other := testActivity(), testActivity(func(a *redpacketv1alpha1.RedPacketActivity) { a.Name = "quiz-2" })
	selector := labels.SelectorFromSet(GrabSelector(a))
	if !selector.Matches(labels.Set(GrabLabels(a))) {
		t.Errorf("selector %s does not select the activity's pods %v", selector, GrabLabels(a))
	}
	if selector.Matches(labels.Set(GrabLabels(other))) {
		t.Errorf("selector %s selects another activity's pods %v", selector, GrabLabels(other))
	}
}

// The objects are applied in an order where each finds what it refers to.
func TestGrabObjects(t *testing.T) {
	a := testActivity()
	objects := GrabObjects(Grab{Activity: a, OperatorImage: "operator/grab:1"})
	var kinds []string
	for _, obj := range objects {
		kinds = append(kinds, *obj.(interface{ GetKind() *string }).GetKind())
		checkObjectMeta(t, a, kinds[len(kinds)-1], "quiz-grab", obj)
	}
	want := []string{"ServiceAccount", "Role", "RoleBinding", "Service", "Deployment"}
	if !slices.Equal(kinds, want) {
		t.Errorf("objects %q, want %q", kinds, want)
	}
}

// The Role reaches this one activity and its status, read and status patch only.
func TestGrabRole(t *testing.T) {
	a := testActivity()
	role := sent[rbacv1.Role](t, GrabRole(a))
	want := []rbacv1.PolicyRule{
		{APIGroups: []string{"redpacket.io"}, Resources: []string{"redpacketactivities"}, ResourceNames: []string{"quiz"}, Verbs: []string{"get"}},
		{APIGroups: []string{"redpacket.io"}, Resources: []string{"redpacketactivities/status"}, ResourceNames: []string{"quiz"}, Verbs: []string{"get", "patch"}},
	}
	if redpacketv1alpha1.GroupVersion.Group != "redpacket.io" {
		t.Fatalf("group %q", redpacketv1alpha1.GroupVersion.Group)
	}
	if len(role.Rules) != len(want) {
		t.Fatalf("rules %+v, want %+v", role.Rules, want)
	}
	for i := range want {
		got := role.Rules[i]
		if !slices.Equal(got.APIGroups, want[i].APIGroups) || !slices.Equal(got.Resources, want[i].Resources) ||
			!slices.Equal(got.ResourceNames, want[i].ResourceNames) || !slices.Equal(got.Verbs, want[i].Verbs) {
			t.Errorf("rule %d %+v, want %+v", i, got, want[i])
		}
	}

	binding := sent[rbacv1.RoleBinding](t, GrabRoleBinding(a))
	if binding.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "quiz-grab"}) {
		t.Errorf("roleRef %+v", binding.RoleRef)
	}
	if len(binding.Subjects) != 1 || binding.Subjects[0] != (rbacv1.Subject{Kind: "ServiceAccount", Name: "quiz-grab", Namespace: "ns"}) {
		t.Errorf("subjects %+v, want the grab ServiceAccount in the activity's namespace", binding.Subjects)
	}
}

func TestGrabService(t *testing.T) {
	a := testActivity()
	svc := sent[corev1.Service](t, GrabService(a))
	if svc.Spec.Type != corev1.ServiceTypeClusterIP || !maps.Equal(svc.Spec.Selector, GrabSelector(a)) {
		t.Errorf("type %s selector %v, want ClusterIP selecting the activity's grab pods", svc.Spec.Type, svc.Spec.Selector)
	}
	want := corev1.ServicePort{Name: "http", Port: 8080, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromString("http")}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0] != want {
		t.Errorf("ports %+v, want %+v", svc.Spec.Ports, want)
	}
	if !strings.Contains(GrabEndpoint(a), svc.Name+"."+svc.Namespace+".svc:8080") {
		t.Errorf("the endpoint %q does not name the Service %s/%s", GrabEndpoint(a), svc.Namespace, svc.Name)
	}
}

// The scale apply holds the replica count and the annotation that records the spec's
// value, and no other field: the workload's apply under the other field manager
// owns the rest, and kubectl scale may take the count over.
func TestGrabScale(t *testing.T) {
	cases := []struct {
		replicas  int32
		specValue string
	}{
		{replicas: 0, specValue: "0"},
		{replicas: 2, specValue: ""},
		{replicas: 5, specValue: "5"},
	}
	for _, tc := range cases {
		a := testActivity()
		ac := GrabScale(a, tc.replicas, tc.specValue)
		d := sent[appsv1.Deployment](t, ac)
		if d.Name != "quiz-grab" || d.Namespace != "ns" || d.Spec.Replicas == nil || *d.Spec.Replicas != tc.replicas {
			t.Errorf("%d: %s/%s replicas %v", tc.replicas, d.Namespace, d.Name, d.Spec.Replicas)
		}
		if got, ok := d.Annotations[AnnotationSpecReplicas]; !ok || got != tc.specValue || len(d.Annotations) != 1 {
			t.Errorf("%d: annotations %v, want only %s=%q", tc.replicas, d.Annotations, AnnotationSpecReplicas, tc.specValue)
		}
		raw, err := runtime.DefaultUnstructuredConverter.ToUnstructured(ac)
		if err != nil {
			t.Fatal(err)
		}
		spec, _ := raw["spec"].(map[string]any)
		meta, _ := raw["metadata"].(map[string]any)
		if len(spec) != 1 || len(meta) != 3 {
			t.Errorf("%d: the scale apply sets more than the replicas and the annotation: %v", tc.replicas, raw)
		}
	}
}
