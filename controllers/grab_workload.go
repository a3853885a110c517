package controllers

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	rbacv1ac "k8s.io/client-go/applyconfigurations/rbac/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// Labels and annotations of the grab workload.
const (
	labelName      = "app.kubernetes.io/name"
	labelInstance  = "app.kubernetes.io/instance"
	labelComponent = "app.kubernetes.io/component"
	labelManagedBy = "app.kubernetes.io/managed-by"
	labelActivity  = "redpacket.io/activity"

	grabAppName    = "redpacket-grab"
	managedByValue = "redpacket-operator"

	// AnnotationSpecReplicas on the grab Deployment records spec.grabService.replicas
	// as last applied ("" when unset). While it matches the spec, the live replica
	// count is kept, so kubectl scale and autoscalers are not undone.
	AnnotationSpecReplicas = "redpacket.io/spec-replicas"

	// ReplicasFieldManager applies the grab Deployment's spec.replicas and the
	// AnnotationSpecReplicas annotation, and nothing else, only when the Deployment is
	// created or spec.grabService.replicas changed. The workload's other fields are
	// applied under FieldManager, which never includes spec.replicas: a field dropped
	// from an apply is deleted when nobody else owns it, and a field kept in every
	// apply would undo kubectl scale. kubectl scale and autoscalers take spec.replicas
	// over from this manager.
	ReplicasFieldManager = "redpacket-controller-replicas"
)

// The grab container's port and mount points.
const (
	grabPort          = 8080
	grabPortName      = "http"
	tokenKeyDir       = "/etc/redpacket/token"
	webhookKeyDir     = "/etc/redpacket/webhook"
	secretKeyName     = "key"
	nonRootUID        = 65532
	grabContainerName = "grab"
	// keyFileMode is the mode of the mounted key files: readable by their owner and
	// group only. The kubelet gives the files the pod's fsGroup (nonRootUID), the
	// group the grab container runs with, so the grab service can read them.
	keyFileMode = 0o440
	// grabCommand is where the operator's image keeps the grab service binary; a
	// custom grab image must keep it there too.
	grabCommand = "/grabsvc"
)

// The grab service's graceful shutdown, passed to it as --shutdown-delay and
// --shutdown-timeout, and the pod's terminationGracePeriodSeconds, which must leave
// room for both and for what follows them: on SIGTERM the service fails readiness
// for GrabShutdownDelay, gives in-flight requests up to GrabShutdownTimeout, then
// stops its settlement worker (acknowledging finished deliveries, up to 5 s) and
// writes a last status report (up to 3 s). GrabShutdownMargin covers that tail, so
// the kubelet's SIGKILL never cuts a drain short.
const (
	GrabShutdownDelay   = 5 * time.Second
	GrabShutdownTimeout = 20 * time.Second
	GrabShutdownMargin  = 10 * time.Second
)

// GrabTerminationGracePeriodSeconds is the grab pod's terminationGracePeriodSeconds:
// the shutdown delay, the drain timeout and the margin, in whole seconds.
func GrabTerminationGracePeriodSeconds() int64 {
	return terminationGracePeriodSeconds(GrabShutdownDelay, GrabShutdownTimeout, GrabShutdownMargin)
}

// terminationGracePeriodSeconds is the sum of the durations in whole seconds, rounded
// up, so the kubelet never cuts the last fraction of a second off.
func terminationGracePeriodSeconds(parts ...time.Duration) int64 {
	var sum time.Duration
	for _, p := range parts {
		sum += p
	}
	return int64((sum + time.Second - 1) / time.Second)
}

// grabName is the name of every object of the activity's grab workload.
func grabName(a *redpacketv1alpha1.RedPacketActivity) string { return a.Name + "-grab" }

// grabRedisSecretName is the name of the Secret that holds the operator's default
// Redis connection for an activity without spec.redis.
func grabRedisSecretName(a *redpacketv1alpha1.RedPacketActivity) string {
	return a.Name + "-grab-redis"
}

// grabEndpoint is the grab service's in-cluster URL.
func grabEndpoint(a *redpacketv1alpha1.RedPacketActivity) string {
	return fmt.Sprintf("http://%s.%s.svc:%d", grabName(a), a.Namespace, grabPort)
}

func grabLabels(a *redpacketv1alpha1.RedPacketActivity) map[string]string {
	return map[string]string{
		labelName:      grabAppName,
		labelInstance:  a.Name,
		labelComponent: "grab",
		labelManagedBy: managedByValue,
		labelActivity:  a.Name,
	}
}

func grabSelector(a *redpacketv1alpha1.RedPacketActivity) map[string]string {
	return map[string]string{labelName: grabAppName, labelActivity: a.Name}
}

// reconcileGrabWorkload applies the activity's grab workload with server-side apply
// under FieldManager: a ServiceAccount; a Role allowing get on this one activity and
// get/patch on its status (resourceNames), bound to it; a Service on port 8080; and
// the Deployment <activity>-grab running the grab service. Every object carries a
// controller owner reference to the activity. An object of the same name that this
// activity does not control is never adopted: nothing is applied, a Warning event is
// emitted and GrabServiceAvailable says NotAdopted. An activity without spec.redis
// also gets the Secret <activity>-grab-redis holding the default Redis's address with
// the activity's own Redis user and password (activityRedisSecretData), which the
// Deployment reads, so no password is part of the Deployment; when the default Redis
// cannot make that user, nothing is applied. A spec.grabService.image the operator
// does not allow leaves the workload as it is (grabImageRefused).
// The replica count comes from
// spec.grabService.replicas (else the operator's default) when the Deployment is
// created or that field changes; otherwise the live count is kept. status.endpoint
// names the Service.
func (r *RedPacketActivityReconciler) reconcileGrabWorkload(ctx context.Context, s *activityScope) (stepResult, error) {
	a := s.activity
	if res, refused := r.grabImageRefused(a); refused {
		return res, nil
	}
	s.workloadChecked = true
	name := grabName(a)
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
	var live *appsv1.Deployment
	if deploymentExists {
		live = deployment
		s.deployment = deployment
	}

	owner := metav1ac.OwnerReference().
		WithAPIVersion(redpacketv1alpha1.GroupVersion.String()).
		WithKind("RedPacketActivity").
		WithName(a.Name).
		WithUID(a.UID).
		WithController(true).
		WithBlockOwnerDeletion(true)
	labels := grabLabels(a)

	objects := []runtime.ApplyConfiguration{
		corev1ac.ServiceAccount(name, a.Namespace).WithLabels(labels).WithOwnerReferences(owner),
		grabRole(a, labels, owner),
		rbacv1ac.RoleBinding(name, a.Namespace).WithLabels(labels).WithOwnerReferences(owner).
			WithRoleRef(rbacv1ac.RoleRef().WithAPIGroup(rbacv1.GroupName).WithKind("Role").WithName(name)).
			WithSubjects(rbacv1ac.Subject().WithKind(rbacv1.ServiceAccountKind).WithName(name).WithNamespace(a.Namespace)),
		corev1ac.Service(name, a.Namespace).WithLabels(labels).WithOwnerReferences(owner).
			WithSpec(corev1ac.ServiceSpec().
				WithType(corev1.ServiceTypeClusterIP).
				WithSelector(grabSelector(a)).
				WithPorts(corev1ac.ServicePort().WithName(grabPortName).WithPort(grabPort).
					WithProtocol(corev1.ProtocolTCP).WithTargetPort(intstr.FromString(grabPortName)))),
		r.grabDeployment(a, labels, owner),
	}
	apply := func(obj runtime.ApplyConfiguration, manager string) (stepResult, error) {
		if err := r.Client.Apply(ctx, obj, client.FieldOwner(manager), client.ForceOwnership); err != nil {
			var res stepResult
			if !apierrors.IsConflict(err) {
				res = blocked(redpacketv1alpha1.ReasonWorkloadFailed, "applying the grab workload: %v", err)
			}
			return res, fmt.Errorf("applying the grab workload: %w", err)
		}
		return stepResult{}, nil
	}
	if a.Spec.Redis == nil {
		// The Secret first: the Deployment's pods read it. It holds the activity's own
		// Redis user (redis_acl.go).
		data, res, err := r.activityRedisSecretData(ctx, s, redisSecret)
		if err != nil || data == nil {
			return res, err
		}
		annotateGrabPods(objects, data)
		if redisSecret == nil || !secretDataEqual(redisSecret.Data, data) {
			objects = append([]runtime.ApplyConfiguration{
				corev1ac.Secret(grabRedisSecretName(a), a.Namespace).WithLabels(labels).WithOwnerReferences(owner).
					WithType(corev1.SecretTypeOpaque).WithData(data),
			}, objects...)
		}
	} else if redisSecret != nil {
		// The activity names its own Secret now; its user on the default Redis and
		// the Secret with its credentials are not needed any more.
		if err := r.deleteActivityRedisUser(ctx, a); err != nil {
			return stepResult{}, err
		}
		if err := r.Client.Delete(ctx, redisSecret, client.Preconditions{UID: &redisSecret.UID}); err != nil && !apierrors.IsNotFound(err) {
			return stepResult{}, fmt.Errorf("deleting secret %s: %w", redisSecret.Name, err)
		}
	}
	for _, obj := range objects {
		if res, err := apply(obj, FieldManager); err != nil {
			return res, err
		}
	}
	if replicas, specValue, ok := r.replicasToApply(a, live); ok {
		scale := appsv1ac.Deployment(name, a.Namespace).
			WithAnnotations(map[string]string{AnnotationSpecReplicas: specValue}).
			WithSpec(appsv1ac.DeploymentSpec().WithReplicas(replicas))
		if res, err := apply(scale, ReplicasFieldManager); err != nil {
			return res, err
		}
	}
	if err := r.reconcileGrabGuards(ctx, a, live, labels); err != nil {
		var res stepResult
		if !apierrors.IsConflict(err) {
			res = blocked(redpacketv1alpha1.ReasonWorkloadFailed, "applying the grab workload: %v", err)
		}
		return res, err
	}
	s.status.Endpoint = grabEndpoint(a)
	return stepResult{}, nil
}

// getChild reads a workload object: from the cache, which holds only objects with the
// operator's label, and else from the API server, so that an unlabeled object of the
// same name is seen too. It reports whether the object exists.
func (r *RedPacketActivityReconciler) getChild(ctx context.Context, key client.ObjectKey, obj client.Object) (bool, error) {
	err := r.Client.Get(ctx, key, obj)
	if err == nil {
		return true, nil
	}
	if !apierrors.IsNotFound(err) {
		return false, err
	}
	err = r.APIReader.Get(ctx, key, obj)
	if err == nil {
		return true, nil
	}
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	return false, err
}

// lookUpGrabRedisSecret reads the activity's <activity>-grab-redis Secret from the API
// server (the cache holds no Secrets); nil when there is none.
func (r *RedPacketActivityReconciler) lookUpGrabRedisSecret(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity) (*corev1.Secret, error) {
	secret := &corev1.Secret{}
	key := client.ObjectKey{Namespace: a.Namespace, Name: grabRedisSecretName(a)}
	if err := r.APIReader.Get(ctx, key, secret); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		return nil, fmt.Errorf("looking up Secret %s: %w", key.Name, err)
	}
	return secret, nil
}

// secretDataEqual reports whether a Secret's data is exactly want.
func secretDataEqual(got, want map[string][]byte) bool {
	return maps.EqualFunc(got, want, bytes.Equal)
}

// grabRole lets the grab service read its own activity and report into its status,
// and nothing else.
func grabRole(a *redpacketv1alpha1.RedPacketActivity, labels map[string]string, owner *metav1ac.OwnerReferenceApplyConfiguration) *rbacv1ac.RoleApplyConfiguration {
	group := redpacketv1alpha1.GroupVersion.Group
	return rbacv1ac.Role(grabName(a), a.Namespace).WithLabels(labels).WithOwnerReferences(owner).
		WithRules(
			rbacv1ac.PolicyRule().WithAPIGroups(group).WithResources("redpacketactivities").
				WithResourceNames(a.Name).WithVerbs("get"),
			rbacv1ac.PolicyRule().WithAPIGroups(group).WithResources("redpacketactivities/status").
				WithResourceNames(a.Name).WithVerbs("get", "patch"),
		)
}

// replicasToApply says whether spec.replicas must be applied, and to what: when the
// Deployment is new, or spec.grabService.replicas changed since it was last applied
// (the annotation says), the spec's value (or the operator's default). Otherwise the
// live count, whoever set it, is left alone.
func (r *RedPacketActivityReconciler) replicasToApply(a *redpacketv1alpha1.RedPacketActivity, live *appsv1.Deployment) (int32, string, bool) {
	replicas := r.Options.GrabReplicas
	specValue := ""
	if a.Spec.GrabService.Replicas != nil {
		replicas = *a.Spec.GrabService.Replicas
		specValue = strconv.FormatInt(int64(replicas), 10)
	}
	if live != nil {
		if applied, ok := live.Annotations[AnnotationSpecReplicas]; ok && applied == specValue {
			return 0, "", false
		}
	}
	return replicas, specValue, true
}

// grabDeployment is the apply configuration of the grab Deployment. Its pods run as
// UID and GID nonRootUID with fsGroup nonRootUID, so the token and webhook key files,
// mounted with keyFileMode (0440), belong to the container's group and are readable
// by the service and nobody else. The service's shutdown flags come from
// GrabShutdownDelay and GrabShutdownTimeout, and the pod's grace period from
// GrabTerminationGracePeriodSeconds, which exceeds their sum.
func (r *RedPacketActivityReconciler) grabDeployment(a *redpacketv1alpha1.RedPacketActivity, labels map[string]string,
	owner *metav1ac.OwnerReferenceApplyConfiguration) *appsv1ac.DeploymentApplyConfiguration {
	name := grabName(a)
	image := a.Spec.GrabService.Image
	if image == "" {
		image = r.Options.GrabImage
	}

	args := []string{
		"--namespace=" + a.Namespace,
		"--activity=" + a.Name,
		"--activity-uid=" + string(a.UID),
		fmt.Sprintf("--listen=:%d", grabPort),
		"--settlement=true",
		"--shutdown-delay=" + GrabShutdownDelay.String(),
		"--shutdown-timeout=" + GrabShutdownTimeout.String(),
	}
	var volumes []*corev1ac.VolumeApplyConfiguration
	var mounts []*corev1ac.VolumeMountApplyConfiguration
	addKeyVolume := func(volume, secret, dir, flag string) {
		volumes = append(volumes, corev1ac.Volume().WithName(volume).WithSecret(
			corev1ac.SecretVolumeSource().WithSecretName(secret).WithDefaultMode(keyFileMode).
				WithItems(corev1ac.KeyToPath().WithKey(secretKeyName).WithPath(secretKeyName))))
		mounts = append(mounts, corev1ac.VolumeMount().WithName(volume).WithMountPath(dir).WithReadOnly(true))
		args = append(args, flag+"="+dir+"/"+secretKeyName)
	}
	if auth := a.Spec.GrabService.Auth; auth != nil {
		addKeyVolume("token-key", auth.TokenSecretRef.Name, tokenKeyDir, "--token-key-file")
		args = append(args, "--token-max-lifetime="+r.Options.GrabTokenMaxLifetime.String())
	}
	if st := a.Spec.Settlement; st != nil && st.Webhook != nil && st.Webhook.SecretRef != nil {
		addKeyVolume("webhook-key", st.Webhook.SecretRef.Name, webhookKeyDir, "--webhook-key-file")
	}

	container := corev1ac.Container().
		WithName(grabContainerName).
		WithImage(image).
		WithImagePullPolicy(corev1.PullIfNotPresent).
		WithCommand(grabCommand).
		WithArgs(args...).
		WithPorts(corev1ac.ContainerPort().WithName(grabPortName).WithContainerPort(grabPort).WithProtocol(corev1.ProtocolTCP)).
		WithEnv(r.grabEnv(a)...).
		WithReadinessProbe(corev1ac.Probe().
			WithHTTPGet(corev1ac.HTTPGetAction().WithPath("/readyz").WithPort(intstr.FromString(grabPortName))).
			WithPeriodSeconds(5).WithFailureThreshold(2)).
		WithLivenessProbe(corev1ac.Probe().
			WithHTTPGet(corev1ac.HTTPGetAction().WithPath("/healthz").WithPort(intstr.FromString(grabPortName))).
			WithInitialDelaySeconds(5).WithPeriodSeconds(10).WithFailureThreshold(3)).
		WithResources(corev1ac.ResourceRequirements().WithRequests(corev1.ResourceList{
			corev1.ResourceCPU:    resource.MustParse("100m"),
			corev1.ResourceMemory: resource.MustParse("64Mi"),
		})).
		WithSecurityContext(grabContainerSecurityContext()).
		WithVolumeMounts(mounts...)

	return appsv1ac.Deployment(name, a.Namespace).
		WithLabels(labels).
		WithOwnerReferences(owner).
		WithSpec(appsv1ac.DeploymentSpec().
			WithSelector(metav1ac.LabelSelector().WithMatchLabels(grabSelector(a))).
			WithTemplate(corev1ac.PodTemplateSpec().
				WithLabels(labels).
				WithSpec(corev1ac.PodSpec().
					WithServiceAccountName(name).
					// The status reporter talks to the API server as the grab
					// ServiceAccount, whose Role reaches this one activity only (and
					// whose status writes the admission policy narrows to the reported
					// fields), so the pod keeps its token.
					WithAutomountServiceAccountToken(true).
					WithTerminationGracePeriodSeconds(GrabTerminationGracePeriodSeconds()).
					WithSecurityContext(corev1ac.PodSecurityContext().
						WithRunAsNonRoot(true).
						WithRunAsUser(nonRootUID).
						WithRunAsGroup(nonRootUID).
						WithFSGroup(nonRootUID).
						WithSeccompProfile(corev1ac.SeccompProfile().WithType(corev1.SeccompProfileTypeRuntimeDefault))).
					WithContainers(container).
					WithVolumes(volumes...))))
}

// grabEnv is the grab container's environment: its pod name and namespace, and the
// Redis connection, from the activity's Secret or else the <activity>-grab-redis
// Secret that holds the operator's default connection (every key optional).
func (r *RedPacketActivityReconciler) grabEnv(a *redpacketv1alpha1.RedPacketActivity) []*corev1ac.EnvVarApplyConfiguration {
	env := []*corev1ac.EnvVarApplyConfiguration{
		corev1ac.EnvVar().WithName("POD_NAME").WithValueFrom(corev1ac.EnvVarSource().
			WithFieldRef(corev1ac.ObjectFieldSelector().WithFieldPath("metadata.name"))),
		corev1ac.EnvVar().WithName("POD_NAMESPACE").WithValueFrom(corev1ac.EnvVarSource().
			WithFieldRef(corev1ac.ObjectFieldSelector().WithFieldPath("metadata.namespace"))),
	}
	redisEnv := []struct{ env, secretKey string }{
		{"REDIS_ADDRESSES", "addresses"},
		{"REDIS_MODE", "mode"},
		{"REDIS_USERNAME", "username"},
		{"REDIS_PASSWORD", "password"},
		{"REDIS_TLS", "tls"},
	}
	secretName := grabRedisSecretName(a)
	if a.Spec.Redis != nil {
		secretName = a.Spec.Redis.SecretRef.Name
	}
	for _, e := range redisEnv {
		env = append(env, corev1ac.EnvVar().WithName(e.env).WithValueFrom(corev1ac.EnvVarSource().
			WithSecretKeyRef(corev1ac.SecretKeySelector().
				WithName(secretName).WithKey(e.secretKey).WithOptional(true))))
	}
	return env
}

// grabContainerSecurityContext is the grab container's security context: not root,
// no privilege escalation, no capabilities at all, a read-only root filesystem (the
// service writes no file; its keys are mounted read-only) and the runtime's default
// seccomp profile (also set for the pod).
func grabContainerSecurityContext() *corev1ac.SecurityContextApplyConfiguration {
	return corev1ac.SecurityContext().
		WithPrivileged(false).
		WithAllowPrivilegeEscalation(false).
		WithReadOnlyRootFilesystem(true).
		WithRunAsNonRoot(true).
		WithCapabilities(corev1ac.Capabilities().WithDrop("ALL")).
		WithSeccompProfile(corev1ac.SeccompProfile().WithType(corev1.SeccompProfileTypeRuntimeDefault))
}

// minReplicasForDisruptionBudget is the replica count from which the grab
// Deployment gets a PodDisruptionBudget. With one replica a budget could only
// block voluntary evictions (node drains) or allow them all, so there is none.
const minReplicasForDisruptionBudget = 2

// reconcileGrabGuards keeps the grab workload's NetworkPolicy and, while the
// Deployment has minReplicasForDisruptionBudget replicas or more, its
// PodDisruptionBudget, and deletes that budget when the replicas drop below. The
// controller is their only writer: it creates them, and updates them when their
// labels or spec drift.
//
// The NetworkPolicy <activity>-grab selects the grab pods and admits ingress on the
// grab port only (TCP 8080: the grab API, the probes and /metrics share it);
// egress is not restricted (Redis, the API server and the balance system's webhook
// are wherever the activity says). The PodDisruptionBudget <activity>-grab allows one
// grab pod at a time to be evicted, and always allows evicting a pod that is not
// ready, so a broken replica never blocks a node drain.
//
// The replica count is the live Deployment's, unless this reconcile applies a new
// one (replicasToApply): kubectl scale and autoscalers count. Both objects carry a
// controller reference to the activity; one of the same name that the activity does
// not control is left alone, with a Warning event.
func (r *RedPacketActivityReconciler) reconcileGrabGuards(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity,
	live *appsv1.Deployment, labels map[string]string) error {
	name := grabName(a)
	key := client.ObjectKey{Namespace: a.Namespace, Name: name}

	policy := &networkingv1.NetworkPolicy{}
	found, err := r.getChild(ctx, key, policy)
	if err != nil {
		return fmt.Errorf("looking up NetworkPolicy %s: %w", name, err)
	}
	if found && !metav1.IsControlledBy(policy, a) {
		r.warnForeign(a, "NetworkPolicy", name)
	} else if err := r.keepGrabChild(ctx, a, policy, labels, func() { policy.Spec = grabNetworkPolicySpec(a) }); err != nil {
		return err
	}

	budget := &policyv1.PodDisruptionBudget{}
	found, err = r.getChild(ctx, key, budget)
	if err != nil {
		return fmt.Errorf("looking up PodDisruptionBudget %s: %w", name, err)
	}
	switch {
	case found && !metav1.IsControlledBy(budget, a):
		r.warnForeign(a, "PodDisruptionBudget", name)
	case r.grabReplicas(a, live) >= minReplicasForDisruptionBudget:
		return r.keepGrabChild(ctx, a, budget, labels, func() { budget.Spec = grabDisruptionBudgetSpec(a) })
	case found:
		if err := r.Client.Delete(ctx, budget, client.Preconditions{UID: &budget.UID}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("deleting PodDisruptionBudget %s: %w", name, err)
		}
	}
	return nil
}

// keepGrabChild makes obj, named <activity>-grab, carry the grab workload's labels,
// the activity's controller reference and the spec that setSpec writes into it:
// it creates obj when absent and updates it when any of these drifted.
func (r *RedPacketActivityReconciler) keepGrabChild(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity,
	obj client.Object, labels map[string]string, setSpec func()) error {
	kind := fmt.Sprintf("%T", obj)
	if gvk, err := r.Client.GroupVersionKindFor(obj); err == nil {
		kind = gvk.Kind
	}
	obj.SetName(grabName(a))
	obj.SetNamespace(a.Namespace)
	_, err := controllerutil.CreateOrUpdate(ctx, r.Client, obj, func() error {
		merged := maps.Clone(obj.GetLabels())
		if merged == nil {
			merged = map[string]string{}
		}
		maps.Copy(merged, labels)
		obj.SetLabels(merged)
		setSpec()
		return controllerutil.SetControllerReference(a, obj, r.Client.Scheme())
	})
	if err != nil {
		return fmt.Errorf("creating or updating %s %s: %w", kind, obj.GetName(), err)
	}
	return nil
}

// grabReplicas is the grab Deployment's replica count after this reconcile: what
// replicasToApply applies, else the live count (1 when the live Deployment leaves
// it unset, as the API server's default).
func (r *RedPacketActivityReconciler) grabReplicas(a *redpacketv1alpha1.RedPacketActivity, live *appsv1.Deployment) int32 {
	if replicas, _, ok := r.replicasToApply(a, live); ok {
		return replicas
	}
	if live.Spec.Replicas == nil {
		return 1
	}
	return *live.Spec.Replicas
}

// warnForeign emits a Warning event about an object of the grab workload's name
// that the activity does not control and that is therefore left alone.
func (r *RedPacketActivityReconciler) warnForeign(a *redpacketv1alpha1.RedPacketActivity, kind, name string) {
	r.Recorder.Eventf(a, nil, corev1.EventTypeWarning, redpacketv1alpha1.ReasonNotAdopted, "Reconcile",
		"%s %s already exists and is not controlled by this activity; leaving it alone (delete or rename it)", kind, name)
}

// grabNetworkPolicySpec selects the activity's grab pods and admits ingress on the
// grab port only.
func grabNetworkPolicySpec(a *redpacketv1alpha1.RedPacketActivity) networkingv1.NetworkPolicySpec {
	tcp := corev1.ProtocolTCP
	port := intstr.FromInt32(grabPort)
	return networkingv1.NetworkPolicySpec{
		PodSelector: metav1.LabelSelector{MatchLabels: grabSelector(a)},
		PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
		Ingress: []networkingv1.NetworkPolicyIngressRule{{
			Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &port}},
		}},
	}
}

// grabDisruptionBudgetSpec allows one voluntary eviction of the activity's grab pods
// at a time, and the eviction of unready ones always.
func grabDisruptionBudgetSpec(a *redpacketv1alpha1.RedPacketActivity) policyv1.PodDisruptionBudgetSpec {
	one := intstr.FromInt32(1)
	alwaysAllow := policyv1.AlwaysAllow
	return policyv1.PodDisruptionBudgetSpec{
		Selector:                   &metav1.LabelSelector{MatchLabels: grabSelector(a)},
		MaxUnavailable:             &one,
		UnhealthyPodEvictionPolicy: &alwaysAllow,
	}
}
