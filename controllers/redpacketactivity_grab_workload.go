package controllers

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/store"
)

// ReplicasFieldManager applies the grab Deployment's spec.replicas and the
// specs.AnnotationSpecReplicas annotation (specs.GrabScale), and nothing else, only
// when the Deployment is created or spec.grabService.replicas changed. The
// workload's other fields are applied under FieldManager, which never includes
// spec.replicas: a field dropped from an apply is deleted when nobody else owns it,
// and a field kept in every apply would undo kubectl scale. kubectl scale and
// autoscalers take spec.replicas over from this manager.
const ReplicasFieldManager = "redpacket-controller-replicas"

// reconcileGrabOwnership decides whether this reconcile may touch the activity's
// grab workload at all; the redis user step and the grab workload step act only
// when it says so (s.grabOwned), so no Redis user is made for a workload that is not
// applied. It may not when spec.grabService.image names an image the operator does
// not allow (grabImageRefused: the workload is left as it is). Nor may it when an
// object of the workload's names (the ServiceAccount, Role, RoleBinding, Service and
// Deployment <activity>-grab and, for an activity without spec.redis, the Secret
// <activity>-grab-redis) exists and this activity does not control it: such an
// object is never adopted, s.notAdopted names it, and GrabServiceAvailable says
// NotAdopted (with a Warning event). Otherwise it records the live Deployment the
// activity controls, if any (s.deployment: its replica count is kept), and the
// activity's own <activity>-grab-redis, if any (s.grabRedisSecret). A Secret of that
// name that another owner has is no matter with spec.redis, and is never touched.
func (r *RedPacketActivityReconciler) reconcileGrabOwnership(ctx context.Context, s *activityScope) (stepResult, error) {
	a := s.activity
	if res, refused := r.grabImageRefused(a); refused {
		return res, nil
	}
	s.workloadChecked = true
	name := specs.GrabName(a)
	key := client.ObjectKey{Namespace: a.Namespace, Name: name}

	deployment := &appsv1.Deployment{}
	children := []struct {
		kind string
		obj  client.Object
	}{
		{"ServiceAccount", &corev1.ServiceAccount{}},
		{"Role", &rbacv1.Role{}},
		{"RoleBinding", &rbacv1.RoleBinding{}},
		{"Service", &corev1.Service{}},
		{"Deployment", deployment},
	}
	var foreign []string
	deploymentExists := false
	for _, child := range children {
		found, err := r.getChild(ctx, key, child.obj)
		if err != nil {
			return stepResult{}, fmt.Errorf("looking up %s %s: %w", child.kind, name, err)
		}
		if !found {
			continue
		}
		if !metav1.IsControlledBy(child.obj, a) {
			foreign = append(foreign, child.kind+" "+name)
			continue
		}
		if child.obj == client.Object(deployment) {
			deploymentExists = true
		}
	}
	s.deploymentLooked = true
	redisSecret, err := r.lookUpGrabRedisSecret(ctx, a)
	if err != nil {
		return stepResult{}, err
	}
	if redisSecret != nil && !metav1.IsControlledBy(redisSecret, a) {
		if a.Spec.Redis == nil {
			foreign = append(foreign, "Secret "+redisSecret.Name)
		}
		redisSecret = nil // never touched
	}
	if len(foreign) > 0 {
		s.notAdopted = fmt.Sprintf("%s already exists and is not controlled by this activity; not adopting it (delete or rename it)",
			strings.Join(foreign, ", "))
		return stepResult{}, nil
	}
	if deploymentExists {
		s.deployment = deployment
	}
	s.grabRedisSecret = redisSecret
	s.grabOwned = true
	return stepResult{}, nil
}

// reconcileGrabWorkload applies the activity's grab workload, as package specs
// builds it, with server-side apply under FieldManager, in the order of
// specs.GrabObjects: a ServiceAccount; a Role allowing get on this one activity and
// get/patch on its status (resourceNames), bound to it; a Service on port 8080; and
// the Deployment <activity>-grab running the grab service, which reads its Redis
// connection from the activity's Secret or from <activity>-grab-redis. Every object
// carries a controller owner reference to the activity.
//
// It applies nothing unless the grab workload ownership step found the workload the
// activity's to touch and the redis user step settled how its pods reach Redis: a
// workload refused, not adopted, or without the activity's own Redis user (the
// step before says why) is left as it is.
//
// The replica count comes from spec.grabService.replicas (else the operator's
// default) when the Deployment is created or that field changes (replicasToApply,
// under ReplicasFieldManager); otherwise the live count is kept. Then the guards
// (reconcileGrabGuards). status.endpoint names the Service. A failed apply makes
// Ready False with WorkloadFailed, except a conflict, which is only retried.
func (r *RedPacketActivityReconciler) reconcileGrabWorkload(ctx context.Context, s *activityScope) (stepResult, error) {
	if !s.grabOwned || !s.grabRedisSettled {
		return stepResult{}, nil
	}
	a := s.activity
	workload := specs.Grab{
		Activity:         a,
		OperatorImage:    r.Options.GrabImage,
		OperatorLibrary:  store.LibraryName,
		TokenMaxLifetime: r.Options.GrabTokenMaxLifetime,
		DefaultRedis:     s.defaultRedisLogin,
	}
	for _, obj := range specs.GrabObjects(workload) {
		if res, err := r.applyGrabObject(ctx, obj, FieldManager); err != nil {
			return res, err
		}
	}
	// s.deployment is the live Deployment as the ownership step found it, nil when
	// this reconcile creates it.
	live := s.deployment
	if replicas, specValue, ok := r.replicasToApply(a, live, s.capacity); ok {
		if res, err := r.applyGrabObject(ctx, specs.GrabScale(a, replicas, specValue), ReplicasFieldManager); err != nil {
			return res, err
		}
	}
	if err := r.reconcileGrabGuards(ctx, a, live, s.capacity); err != nil {
		return workloadFailed(err), err
	}
	s.status.Endpoint = specs.GrabEndpoint(a)
	return stepResult{}, nil
}

// applyGrabObject applies one object of the grab workload with server-side apply
// under manager, forcing ownership of the fields it sets.
func (r *RedPacketActivityReconciler) applyGrabObject(ctx context.Context, obj runtime.ApplyConfiguration, manager string) (stepResult, error) {
	if err := r.Client.Apply(ctx, obj, client.FieldOwner(manager), client.ForceOwnership); err != nil {
		return workloadFailed(err), fmt.Errorf("applying the grab workload: %w", err)
	}
	return stepResult{}, nil
}

// getChild reads a workload object as getGrabChild does.
func (r *RedPacketActivityReconciler) getChild(ctx context.Context, key client.ObjectKey, obj client.Object) (bool, error) {
	return getGrabChild(ctx, r.Client, r.APIReader, key, obj)
}

// lookUpGrabRedisSecret reads the activity's <activity>-grab-redis Secret from the API
// server (the cache holds no Secrets); nil when there is none.
func (r *RedPacketActivityReconciler) lookUpGrabRedisSecret(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity) (*corev1.Secret, error) {
	secret := &corev1.Secret{}
	key := client.ObjectKey{Namespace: a.Namespace, Name: specs.GrabRedisSecretName(a)}
	if err := r.APIReader.Get(ctx, key, secret); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		return nil, fmt.Errorf("looking up Secret %s: %w", key.Name, err)
	}
	return secret, nil
}

// replicasToApply says whether spec.replicas must be applied, and to what: when the
// Deployment is new, or spec.grabService.replicas changed since it was last applied
// (the annotation says), the spec's value (or the operator's default). Otherwise the
// live count, whoever set it, is left alone.
//
// With autoscaling (capacity) the operator's HPA owns the count: a new Deployment
// starts at the HPA's current minimum, and a live one is never scaled here, so the
// controller and the HPA never take turns at spec.replicas. The annotation still
// records spec.grabService.replicas, so removing autoscaling later applies the spec
// only if it changed meanwhile.
func (r *RedPacketActivityReconciler) replicasToApply(a *redpacketv1alpha1.RedPacketActivity, live *appsv1.Deployment,
	capacity *specs.Capacity) (int32, string, bool) {
	replicas := r.Options.GrabReplicas
	specValue := ""
	if a.Spec.GrabService.Replicas != nil {
		replicas = *a.Spec.GrabService.Replicas
		specValue = strconv.FormatInt(int64(replicas), 10)
	}
	if capacity != nil {
		return capacity.MinReplicas, specValue, live == nil
	}
	if live != nil {
		if applied, ok := live.Annotations[specs.AnnotationSpecReplicas]; ok && applied == specValue {
			return 0, "", false
		}
	}
	return replicas, specValue, true
}

// reconcileGrabGuards keeps the activity's grab guards (keepGrabGuards): the
// NetworkPolicy and PodDisruptionBudget <activity>-grab, selecting GrabSelector. The
// replica count is the live Deployment's, unless this reconcile applies a new one
// (replicasToApply): kubectl scale and autoscalers count. With autoscaling the
// PodDisruptionBudget follows the HPA's minimum instead (capacity).
func (r *RedPacketActivityReconciler) reconcileGrabGuards(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity,
	live *appsv1.Deployment, capacity *specs.Capacity) error {
	return keepGrabGuards(ctx, r.Client, r.APIReader, r.Recorder, grabGuarded{
		owner: a, kind: "activity", name: specs.GrabName(a), labels: specs.GrabLabels(a),
		selector: specs.GrabSelector(a), replicas: r.grabReplicas(a, live, capacity), capacity: capacity,
	})
}

// grabReplicas is the grab Deployment's replica count after this reconcile: what
// replicasToApply applies, else the live count (1 when the live Deployment leaves
// it unset, as the API server's default).
func (r *RedPacketActivityReconciler) grabReplicas(a *redpacketv1alpha1.RedPacketActivity, live *appsv1.Deployment,
	capacity *specs.Capacity) int32 {
	if replicas, _, ok := r.replicasToApply(a, live, capacity); ok {
		return replicas
	}
	return deploymentReplicas(live)
}
