// Package specs builds the objects of an activity's grab workload: its
// ServiceAccount, Role and RoleBinding, Service, Deployment, the Secret with its
// Redis login on the operator's default Redis, its NetworkPolicy and
// PodDisruptionBudget, its HorizontalPodAutoscaler with the prewarm window that
// sizes it (Capacity), and the apply of the Deployment's replica count.
//
// Every function here is pure: it reads only its arguments, and talks to no API
// server and no Redis. The controller decides what to apply and when; this package
// says what each object is. The same inputs always give the same object, so an
// apply of an unchanged activity changes nothing.
package specs

import (
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	rbacv1ac "k8s.io/client-go/applyconfigurations/rbac/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// Labels and annotations of the grab workload.
const (
	labelName      = "app.kubernetes.io/name"
	labelInstance  = "app.kubernetes.io/instance"
	labelComponent = "app.kubernetes.io/component"
	labelActivity  = "redpacket.io/activity"

	// LabelManagedBy, with the value ManagedByValue, is on every object of the grab
	// workload. The operator's cache holds only objects that carry it.
	LabelManagedBy = "app.kubernetes.io/managed-by"
	// ManagedByValue is the value of LabelManagedBy.
	ManagedByValue = "redpacket-operator"

	grabAppName = "redpacket-grab"

	// AnnotationSpecReplicas on the grab Deployment records spec.grabService.replicas
	// as last applied ("" when unset). While it matches the spec, the live replica
	// count is kept, so kubectl scale and autoscalers are not undone.
	AnnotationSpecReplicas = "redpacket.io/spec-replicas"

	// AnnotationFunctionLibrary on a grab pod template names the function library
	// its pods call: the operator's own (OperatorLibrary) when they run the
	// operator's image. A template without it (a custom image, or a release before
	// it) runs a library nobody can name, and the function keeper then deletes no
	// library at all.
	AnnotationFunctionLibrary = "redpacket.io/function-library"
)

// The grab container's port.
const (
	grabPort     = 8080
	grabPortName = "http"
)

// Grab is what the grab workload is made of: the activity and the operator's
// settings that shape it.
type Grab struct {
	// Activity is the activity the workload serves; every object is named after it
	// and carries its controller reference.
	Activity *redpacketv1alpha1.RedPacketActivity
	// OperatorImage is the grab image of the operator, which runs the grab service
	// when spec.grabService.image is empty. Whether another image is allowed is the
	// controller's decision, taken before anything is built.
	OperatorImage string
	// OperatorLibrary is the function library the operator's image calls
	// (store.LibraryName); the pod template carries it in AnnotationFunctionLibrary
	// when the pods run OperatorImage.
	OperatorLibrary string
	// TokenMaxLifetime is passed to the grab service as --token-max-lifetime when
	// spec.grabService.auth asks for signed tokens.
	TokenMaxLifetime time.Duration
	// DefaultRedis is the activity's own user on the operator's default Redis, for
	// an activity without spec.redis; nil with spec.redis, whose Secret the grab pods
	// read instead.
	DefaultRedis *RedisLogin
}

// GrabName is the name of every object of the activity's grab workload.
func GrabName(a *redpacketv1alpha1.RedPacketActivity) string { return a.Name + "-grab" }

// GrabEndpoint is the grab service's in-cluster URL: the Service GrabService on
// its port.
func GrabEndpoint(a *redpacketv1alpha1.RedPacketActivity) string {
	return fmt.Sprintf("http://%s.%s.svc:%d", GrabName(a), a.Namespace, grabPort)
}

// GrabLabels are the labels of every object of the grab workload and of its pods:
// the recommended app.kubernetes.io labels, LabelManagedBy for the operator's
// cache, and the activity's name.
func GrabLabels(a *redpacketv1alpha1.RedPacketActivity) map[string]string {
	return map[string]string{
		labelName:      grabAppName,
		labelInstance:  a.Name,
		labelComponent: "grab",
		LabelManagedBy: ManagedByValue,
		labelActivity:  a.Name,
	}
}

// GrabWorkloadLabels select every grab Deployment and grab pod the operator made, of
// either kind, in every namespace.
func GrabWorkloadLabels() map[string]string {
	return map[string]string{labelName: grabAppName, LabelManagedBy: ManagedByValue}
}

// GrabSelector selects the activity's grab pods and no other activity's: the
// Deployment, the Service, the NetworkPolicy and the PodDisruptionBudget select
// with it. It is part of the Deployment's immutable selector, so it never changes.
func GrabSelector(a *redpacketv1alpha1.RedPacketActivity) map[string]string {
	return map[string]string{labelName: grabAppName, labelActivity: a.Name}
}

// grabOwner is the activity's controller reference, on every applied object: the
// workload goes when the activity goes, and the foreground deletion of the activity
// waits for it.
func grabOwner(a *redpacketv1alpha1.RedPacketActivity) *metav1ac.OwnerReferenceApplyConfiguration {
	return metav1ac.OwnerReference().
		WithAPIVersion(redpacketv1alpha1.GroupVersion.String()).
		WithKind("RedPacketActivity").
		WithName(a.Name).
		WithUID(a.UID).
		WithController(true).
		WithBlockOwnerDeletion(true)
}

// GrabObjects are the objects the grab workload is applied as, in the order they
// are applied: the ServiceAccount, its Role and RoleBinding, the Service, then the
// Deployment, whose pods need all of them. The Secret of GrabRedisSecret, which
// the pods read too, is applied before them, with the activity's Redis user. None
// sets the Deployment's replicas (GrabScale does).
func GrabObjects(in Grab) []runtime.ApplyConfiguration {
	a := in.Activity
	return []runtime.ApplyConfiguration{
		GrabServiceAccount(a),
		GrabRole(a),
		GrabRoleBinding(a),
		GrabService(a),
		GrabDeployment(in),
	}
}

// GrabServiceAccount is the identity the grab pods talk to the API server as; only
// GrabRole is bound to it.
func GrabServiceAccount(a *redpacketv1alpha1.RedPacketActivity) *corev1ac.ServiceAccountApplyConfiguration {
	return corev1ac.ServiceAccount(GrabName(a), a.Namespace).WithLabels(GrabLabels(a)).WithOwnerReferences(grabOwner(a))
}

// GrabRole lets the grab service read its own activity and report into its status,
// and nothing else.
func GrabRole(a *redpacketv1alpha1.RedPacketActivity) *rbacv1ac.RoleApplyConfiguration {
	group := redpacketv1alpha1.GroupVersion.Group
	return rbacv1ac.Role(GrabName(a), a.Namespace).WithLabels(GrabLabels(a)).WithOwnerReferences(grabOwner(a)).
		WithRules(
			rbacv1ac.PolicyRule().WithAPIGroups(group).WithResources("redpacketactivities").
				WithResourceNames(a.Name).WithVerbs("get"),
			rbacv1ac.PolicyRule().WithAPIGroups(group).WithResources("redpacketactivities/status").
				WithResourceNames(a.Name).WithVerbs("get", "patch"),
		)
}

// GrabRoleBinding binds GrabRole to GrabServiceAccount, in the activity's namespace
// only.
func GrabRoleBinding(a *redpacketv1alpha1.RedPacketActivity) *rbacv1ac.RoleBindingApplyConfiguration {
	name := GrabName(a)
	return rbacv1ac.RoleBinding(name, a.Namespace).WithLabels(GrabLabels(a)).WithOwnerReferences(grabOwner(a)).
		WithRoleRef(rbacv1ac.RoleRef().WithAPIGroup(rbacv1.GroupName).WithKind("Role").WithName(name)).
		WithSubjects(rbacv1ac.Subject().WithKind(rbacv1.ServiceAccountKind).WithName(name).WithNamespace(a.Namespace))
}

// GrabService is the ClusterIP Service GrabEndpoint names: port 8080 to the grab
// pods' named port, so the container may move its port without the Service
// changing.
func GrabService(a *redpacketv1alpha1.RedPacketActivity) *corev1ac.ServiceApplyConfiguration {
	return corev1ac.Service(GrabName(a), a.Namespace).WithLabels(GrabLabels(a)).WithOwnerReferences(grabOwner(a)).
		WithSpec(corev1ac.ServiceSpec().
			WithType(corev1.ServiceTypeClusterIP).
			WithSelector(GrabSelector(a)).
			WithPorts(corev1ac.ServicePort().WithName(grabPortName).WithPort(grabPort).
				WithProtocol(corev1.ProtocolTCP).WithTargetPort(intstr.FromString(grabPortName))))
}

// GrabScale is the apply of the grab Deployment's replica count, and of
// AnnotationSpecReplicas recording specValue (spec.grabService.replicas as
// written, "" when unset), and of nothing else: it is applied under its own field
// manager, so the workload's other applies never hold spec.replicas and never undo
// kubectl scale.
func GrabScale(a *redpacketv1alpha1.RedPacketActivity, replicas int32, specValue string) *appsv1ac.DeploymentApplyConfiguration {
	return appsv1ac.Deployment(GrabName(a), a.Namespace).
		WithAnnotations(map[string]string{AnnotationSpecReplicas: specValue}).
		WithSpec(appsv1ac.DeploymentSpec().WithReplicas(replicas))
}
