package specs

import (
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/intstr"
	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
)

// The grab container's mount points and identity.
const (
	tokenKeyDir       = "/etc/redpacket/token"
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

// The grab container's default resources. The grab service keeps nothing per
// packet or per user: docs/benchmarks.md measured its resident memory at 34 MiB with
// 1,000 live packets and 36 MiB with 100,000 while serving about 10,000 requests a
// second. The request covers that with room for the heap's growth between
// collections; the limit is seven times the measurement, so a burst of connections
// or a slow Redis that queues requests does not get the pod killed, while a leak does
// and shows as an OOMKilled restart instead of starving the node.
var (
	GrabCPURequest    = resource.MustParse("100m")
	GrabMemoryRequest = resource.MustParse("64Mi")
	GrabMemoryLimit   = resource.MustParse("256Mi")
)

// GrabResources are a grab container's resources: override as it is (a budget's
// spec.grabService.resources) when given, else requests of GrabCPURequest and
// GrabMemoryRequest; either way with a memory limit, GrabMemoryLimit unless override
// sets one, raised to the memory request when that asks for more, so the result is
// always valid.
func GrabResources(override *corev1.ResourceRequirements) *corev1ac.ResourceRequirementsApplyConfiguration {
	requests := corev1.ResourceList{corev1.ResourceCPU: GrabCPURequest, corev1.ResourceMemory: GrabMemoryRequest}
	limits := corev1.ResourceList{}
	if override != nil {
		requests = override.Requests.DeepCopy()
		limits = override.Limits.DeepCopy()
		if limits == nil {
			limits = corev1.ResourceList{}
		}
	}
	if _, ok := limits[corev1.ResourceMemory]; !ok {
		limit := GrabMemoryLimit.DeepCopy()
		if req, ok := requests[corev1.ResourceMemory]; ok && req.Cmp(limit) > 0 {
			limit = req.DeepCopy()
		}
		limits[corev1.ResourceMemory] = limit
	}
	rr := corev1ac.ResourceRequirements().WithLimits(limits)
	if len(requests) > 0 {
		rr.WithRequests(requests)
	}
	return rr
}

// GrabDeployment is the apply configuration of the grab Deployment, without its
// replica count (GrabScale). Its pods run as UID and GID nonRootUID with fsGroup
// nonRootUID, so the token key file, mounted with keyFileMode (0440),
// belong to the container's group and are readable by the service and nobody else.
// The service's shutdown flags come from GrabShutdownDelay and GrabShutdownTimeout,
// and the pod's grace period from GrabTerminationGracePeriodSeconds, which exceeds
// their sum. With in.DefaultRedis the pod template carries
// AnnotationRedisCredentials, the digest of the login the pods read at start, so a
// new password rolls them.
func GrabDeployment(in Grab) *appsv1ac.DeploymentApplyConfiguration {
	a := in.Activity
	name := GrabName(a)
	labels := GrabLabels(a)
	image := a.Spec.GrabService.Image
	if image == "" {
		image = in.OperatorImage
	}

	args := []string{
		"--namespace=" + a.Namespace,
		"--activity=" + a.Name,
		"--activity-uid=" + string(a.UID),
		fmt.Sprintf("--listen=:%d", grabPort),
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
		args = append(args, "--token-max-lifetime="+in.TokenMaxLifetime.String())
	}

	template := grabPodTemplate(grabPod{
		image: image, args: args, redisSecret: grabRedisSecret(in), resources: GrabResources(nil),
		volumes: volumes, mounts: mounts, labels: labels,
		// The status reporter talks to the API server as the grab ServiceAccount,
		// whose Role reaches this one activity only (and whose status writes the
		// admission policy narrows to the reported fields), so the pod keeps its token.
		serviceAccount: name,
		defaultRedis:   in.DefaultRedis,
		library:        libraryOf(image, in.OperatorImage, in.OperatorLibrary),
	})

	return appsv1ac.Deployment(name, a.Namespace).
		WithLabels(labels).
		WithOwnerReferences(grabOwner(a)).
		WithSpec(appsv1ac.DeploymentSpec().
			WithSelector(metav1ac.LabelSelector().WithMatchLabels(GrabSelector(a))).
			WithTemplate(template))
}

// grabRedisSecret is the Secret the activity's grab pods read their Redis
// connection from: the activity's spec.redis Secret or else <activity>-grab-redis,
// its login on the operator's default Redis. No password is part of the Deployment
// itself.
func grabRedisSecret(in Grab) string {
	a := in.Activity
	if a.Spec.Redis != nil {
		return a.Spec.Redis.SecretRef.Name
	}
	return GrabRedisSecretName(a)
}

// grabPod is what sets one kind's grab pods apart; grabPodTemplate builds the rest
// (container, probes, ports, security, grace period) the same way for both kinds.
type grabPod struct {
	image       string
	args        []string
	redisSecret string
	resources   *corev1ac.ResourceRequirementsApplyConfiguration
	volumes     []*corev1ac.VolumeApplyConfiguration
	mounts      []*corev1ac.VolumeMountApplyConfiguration
	labels      map[string]string
	// serviceAccount is the pod's ServiceAccount, whose token is mounted; empty, the
	// pod gets no ServiceAccount token at all.
	serviceAccount string
	// defaultRedis, when set, puts its digest in AnnotationRedisCredentials, so a
	// new password rolls the pods.
	defaultRedis *RedisLogin
	// library, when set, is AnnotationFunctionLibrary (libraryOf).
	library string
}

// libraryOf is the function library pods of image call: the operator's library when
// image is the operator's own, "" (unknown) otherwise.
func libraryOf(image, operatorImage, operatorLibrary string) string {
	if image != operatorImage {
		return ""
	}
	return operatorLibrary
}

// grabPodTemplate is the pod template of a grab Deployment of either kind.
func grabPodTemplate(p grabPod) *corev1ac.PodTemplateSpecApplyConfiguration {
	container := corev1ac.Container().
		WithName(grabContainerName).
		WithImage(p.image).
		WithImagePullPolicy(corev1.PullIfNotPresent).
		WithCommand(grabCommand).
		WithArgs(p.args...).
		WithPorts(corev1ac.ContainerPort().WithName(grabPortName).WithContainerPort(grabPort).WithProtocol(corev1.ProtocolTCP)).
		WithEnv(grabPodEnv(p.redisSecret)...).
		WithReadinessProbe(corev1ac.Probe().
			WithHTTPGet(corev1ac.HTTPGetAction().WithPath("/readyz").WithPort(intstr.FromString(grabPortName))).
			WithPeriodSeconds(5).WithFailureThreshold(2)).
		WithLivenessProbe(corev1ac.Probe().
			WithHTTPGet(corev1ac.HTTPGetAction().WithPath("/healthz").WithPort(intstr.FromString(grabPortName))).
			WithInitialDelaySeconds(5).WithPeriodSeconds(10).WithFailureThreshold(3)).
		WithResources(p.resources).
		WithSecurityContext(grabContainerSecurityContext()).
		WithVolumeMounts(p.mounts...)

	spec := corev1ac.PodSpec()
	if p.serviceAccount != "" {
		spec.WithServiceAccountName(p.serviceAccount)
	}
	spec.WithAutomountServiceAccountToken(p.serviceAccount != "").
		WithTerminationGracePeriodSeconds(GrabTerminationGracePeriodSeconds()).
		WithSecurityContext(corev1ac.PodSecurityContext().
			WithRunAsNonRoot(true).
			WithRunAsUser(nonRootUID).
			WithRunAsGroup(nonRootUID).
			WithFSGroup(nonRootUID).
			WithSeccompProfile(corev1ac.SeccompProfile().WithType(corev1.SeccompProfileTypeRuntimeDefault))).
		WithContainers(container).
		WithVolumes(p.volumes...)
	template := corev1ac.PodTemplateSpec().WithLabels(p.labels).WithSpec(spec)
	if p.defaultRedis != nil {
		template.WithAnnotations(map[string]string{AnnotationRedisCredentials: p.defaultRedis.Digest()})
	}
	if p.library != "" {
		template.WithAnnotations(map[string]string{AnnotationFunctionLibrary: p.library})
	}
	return template
}

// grabPodEnv is a grab container's environment with its Redis connection read from
// the Secret redisSecret (every key optional): the activity's and the budget's grab
// pods reach Redis the same way.
func grabPodEnv(redisSecret string) []*corev1ac.EnvVarApplyConfiguration {
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
	for _, e := range redisEnv {
		env = append(env, corev1ac.EnvVar().WithName(e.env).WithValueFrom(corev1ac.EnvVarSource().
			WithSecretKeyRef(corev1ac.SecretKeySelector().
				WithName(redisSecret).WithKey(e.secretKey).WithOptional(true))))
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
