package specs

import (
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// A budget's grab workload is one Deployment and one Service, <budget>-grab, shared
// by every packet created from the budget, plus two Secrets: <budget>-sender, the
// sender credential the merchant's backend creates packets with (minted once, never
// overwritten), and <budget>-grab-redis, the budget's own login on the operator's
// default Redis (a budget without spec.redis). Its pods need no API access: the
// operator reads the budget's figures from Redis itself, so they run without a
// ServiceAccount token.

const (
	labelBudget = "redpacket.io/budget"

	// SenderTokenKey is the key of the sender Secret that holds the token.
	SenderTokenKey = "token"
	// senderTokenBytes is how many random bytes a sender token has; it is written
	// as unpadded base64url (43 characters).
	senderTokenBytes = 32
	// senderTokenDir is where the grab pods mount the sender Secret.
	senderTokenDir = "/etc/redpacket/sender"
)

// BudgetGrab is what a budget's grab workload is made of: the budget and the
// operator's settings that shape it.
type BudgetGrab struct {
	// Budget is the budget the workload serves; every object is named after it and
	// carries its controller reference.
	Budget *redpacketv1alpha1.RedPacketBudget
	// OperatorImage runs the grab service when spec.grabService.image is empty.
	OperatorImage string
	// OperatorLibrary is the function library OperatorImage calls, as Grab's.
	OperatorLibrary string
	// TokenMaxLifetime is passed as --token-max-lifetime with spec.grabService.auth.
	TokenMaxLifetime time.Duration
	// DefaultRedis is the budget's own user on the operator's default Redis, for a
	// budget without spec.redis; nil with spec.redis.
	DefaultRedis *RedisLogin
}

// BudgetGrabName is the name of the budget's grab Deployment and Service.
func BudgetGrabName(b *redpacketv1alpha1.RedPacketBudget) string { return b.Name + "-grab" }

// BudgetSenderSecretName is the name of the budget's sender credential Secret.
func BudgetSenderSecretName(b *redpacketv1alpha1.RedPacketBudget) string { return b.Name + "-sender" }

// BudgetRedisSecretName is the name of the Secret with the budget's login on the
// operator's default Redis.
func BudgetRedisSecretName(b *redpacketv1alpha1.RedPacketBudget) string {
	return b.Name + "-grab-redis"
}

// BudgetEndpoint is the budget's grab service's in-cluster URL.
func BudgetEndpoint(b *redpacketv1alpha1.RedPacketBudget) string {
	return fmt.Sprintf("http://%s.%s.svc:%d", BudgetGrabName(b), b.Namespace, grabPort)
}

// BudgetLabels are the labels of every object of the budget's workload and of its
// pods.
func BudgetLabels(b *redpacketv1alpha1.RedPacketBudget) map[string]string {
	return map[string]string{
		labelName:      grabAppName,
		labelInstance:  b.Name,
		labelComponent: "grab",
		LabelManagedBy: ManagedByValue,
		labelBudget:    b.Name,
	}
}

// BudgetSelector selects the budget's grab pods and no activity's (an activity's
// pods carry redpacket.io/activity instead). It is part of the Deployment's
// immutable selector.
func BudgetSelector(b *redpacketv1alpha1.RedPacketBudget) map[string]string {
	return map[string]string{labelName: grabAppName, labelBudget: b.Name}
}

// BudgetSelectorString is BudgetSelector as a label selector string, for the
// budget's scale subresource (status.selector).
func BudgetSelectorString(b *redpacketv1alpha1.RedPacketBudget) string {
	return labels.SelectorFromSet(BudgetSelector(b)).String()
}

// budgetOwner is the budget's controller reference, on every object of its workload.
func budgetOwner(b *redpacketv1alpha1.RedPacketBudget) *metav1ac.OwnerReferenceApplyConfiguration {
	return metav1ac.OwnerReference().
		WithAPIVersion(redpacketv1alpha1.GroupVersion.String()).
		WithKind("RedPacketBudget").
		WithName(b.Name).
		WithUID(b.UID).
		WithController(true).
		WithBlockOwnerDeletion(true)
}

// BudgetGrabArgs are the grab container's arguments in budget mode.
func BudgetGrabArgs(in BudgetGrab) []string {
	b := in.Budget
	args := []string{
		"--namespace=" + b.Namespace,
		"--budget=" + b.Name,
		"--budget-uid=" + string(b.UID),
		"--budget-shards=" + strconv.Itoa(b.Spec.ShardCount()),
		fmt.Sprintf("--listen=:%d", grabPort),
		"--sender-token-file=" + senderTokenDir + "/" + SenderTokenKey,
		"--shutdown-delay=" + GrabShutdownDelay.String(),
		"--shutdown-timeout=" + GrabShutdownTimeout.String(),
	}
	if b.Spec.GrabService.Auth != nil {
		args = append(args, "--token-key-file="+tokenKeyDir+"/"+secretKeyName,
			"--token-max-lifetime="+in.TokenMaxLifetime.String())
	}
	if b.Spec.Packets.ClaimSecret {
		args = append(args, "--claim-secret")
	}
	if w := b.Spec.Packets.SendWindows; len(w) > 0 {
		windows := make([]string, len(w))
		for i, s := range w {
			windows[i] = string(s)
		}
		args = append(args, "--send-windows="+strings.Join(windows, ","))
	}
	if q := b.Spec.Packets.Quotas; q != nil {
		if s := q.PerSender; s != nil {
			for _, f := range []struct {
				flag string
				v    int64
			}{{"packets-per-minute", s.PacketsPerMinute}, {"packets-per-day", s.PacketsPerDay}, {"amount-per-day", s.AmountPerDay}} {
				if f.v > 0 {
					args = append(args, fmt.Sprintf("--quota-%s=%d", f.flag, f.v))
				}
			}
		}
		if r := q.PerRecipient; r != nil && r.SharesPerDay > 0 {
			args = append(args, fmt.Sprintf("--quota-shares-per-day=%d", r.SharesPerDay))
		}
	}
	// The zone of the send windows is the zone of the daily quotas' day.
	if tz := b.Spec.Packets.TimeZone; tz != "" && (len(b.Spec.Packets.SendWindows) > 0 || b.Spec.Packets.Quotas != nil) {
		args = append(args, "--send-time-zone="+tz)
	}
	return args
}

// BudgetGrabDeployment is the apply configuration of the budget's shared grab
// Deployment: the grab service in budget mode (BudgetGrabArgs), reaching Redis as an
// activity's grab pods do, the sender Secret mounted read-only, and the token key
// with spec.grabService.auth. Its replicas are spec.grabService.replicas, and left
// out of the apply when that is unset, so the Deployment keeps what it has, and with
// spec.grabService.autoscaling, whose HPA owns the count (BudgetGrabScale hands it
// over). With
// in.DefaultRedis the pod template carries AnnotationRedisCredentials, so a new
// password rolls the pods.
func BudgetGrabDeployment(in BudgetGrab) *appsv1ac.DeploymentApplyConfiguration {
	b := in.Budget
	image := b.Spec.GrabService.Image
	if image == "" {
		image = in.OperatorImage
	}
	redisSecret := BudgetRedisSecretName(b)
	if b.Spec.Redis != nil {
		redisSecret = b.Spec.Redis.SecretRef.Name
	}

	volumes := []*corev1ac.VolumeApplyConfiguration{
		corev1ac.Volume().WithName("sender-token").WithSecret(corev1ac.SecretVolumeSource().
			WithSecretName(BudgetSenderSecretName(b)).WithDefaultMode(keyFileMode).
			WithItems(corev1ac.KeyToPath().WithKey(SenderTokenKey).WithPath(SenderTokenKey))),
	}
	mounts := []*corev1ac.VolumeMountApplyConfiguration{
		corev1ac.VolumeMount().WithName("sender-token").WithMountPath(senderTokenDir).WithReadOnly(true),
	}
	if auth := b.Spec.GrabService.Auth; auth != nil {
		volumes = append(volumes, corev1ac.Volume().WithName("token-key").WithSecret(corev1ac.SecretVolumeSource().
			WithSecretName(auth.TokenSecretRef.Name).WithDefaultMode(keyFileMode).
			WithItems(corev1ac.KeyToPath().WithKey(secretKeyName).WithPath(secretKeyName))))
		mounts = append(mounts, corev1ac.VolumeMount().WithName("token-key").WithMountPath(tokenKeyDir).WithReadOnly(true))
	}

	template := grabPodTemplate(grabPod{
		image: image, args: BudgetGrabArgs(in), redisSecret: redisSecret,
		resources: GrabResources(b.Spec.GrabService.Resources),
		volumes:   volumes, mounts: mounts, labels: BudgetLabels(b),
		// No serviceAccount: the budget's grab pods never talk to the API server.
		defaultRedis: in.DefaultRedis,
		library:      libraryOf(image, in.OperatorImage, in.OperatorLibrary),
	})

	spec := appsv1ac.DeploymentSpec().
		WithSelector(metav1ac.LabelSelector().WithMatchLabels(BudgetSelector(b))).
		WithTemplate(template)
	if r := b.Spec.GrabService.Replicas; r != nil && b.Spec.GrabService.Autoscaling == nil {
		spec.WithReplicas(*r)
	}
	return appsv1ac.Deployment(BudgetGrabName(b), b.Namespace).
		WithLabels(BudgetLabels(b)).
		WithOwnerReferences(budgetOwner(b)).
		WithSpec(spec)
}

// BudgetGrabService is the ClusterIP Service BudgetEndpoint names: port 8080 (as an
// activity's) to the grab pods' named port.
func BudgetGrabService(b *redpacketv1alpha1.RedPacketBudget) *corev1ac.ServiceApplyConfiguration {
	return corev1ac.Service(BudgetGrabName(b), b.Namespace).WithLabels(BudgetLabels(b)).WithOwnerReferences(budgetOwner(b)).
		WithSpec(corev1ac.ServiceSpec().
			WithType(corev1.ServiceTypeClusterIP).
			WithSelector(BudgetSelector(b)).
			WithPorts(corev1ac.ServicePort().WithName(grabPortName).WithPort(grabPort).
				WithProtocol(corev1.ProtocolTCP).WithTargetPort(intstr.FromString(grabPortName))))
}

// BudgetRedisSecret is <budget>-grab-redis holding login, which the grab pods read.
func BudgetRedisSecret(b *redpacketv1alpha1.RedPacketBudget, login RedisLogin) *corev1ac.SecretApplyConfiguration {
	return corev1ac.Secret(BudgetRedisSecretName(b), b.Namespace).WithLabels(BudgetLabels(b)).
		WithOwnerReferences(budgetOwner(b)).WithType(corev1.SecretTypeOpaque).WithData(login.SecretData())
}

// NewSenderToken is a fresh sender credential: 32 random bytes as unpadded
// base64url.
func NewSenderToken() (string, error) {
	buf := make([]byte, senderTokenBytes)
	if _, err := rand.Read(buf); err != nil {
		return "", fmt.Errorf("generating a sender token: %w", err)
	}
	return base64.RawURLEncoding.EncodeToString(buf), nil
}

// BudgetSenderSecret is the Secret <budget>-sender holding token. The controller
// creates it once (Create, never an apply), so a token is never overwritten; it
// carries the budget's controller reference, so it goes with the budget.
func BudgetSenderSecret(b *redpacketv1alpha1.RedPacketBudget, token string) *corev1.Secret {
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:      BudgetSenderSecretName(b),
			Namespace: b.Namespace,
			Labels:    BudgetLabels(b),
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion:         redpacketv1alpha1.GroupVersion.String(),
				Kind:               "RedPacketBudget",
				Name:               b.Name,
				UID:                b.UID,
				Controller:         ptrTo(true),
				BlockOwnerDeletion: ptrTo(true),
			}},
		},
		Type: corev1.SecretTypeOpaque,
		Data: map[string][]byte{SenderTokenKey: []byte(token)},
	}
}

func ptrTo[T any](v T) *T { return &v }

// BudgetGrabScale is the apply of the budget's grab Deployment spec.replicas alone,
// under a field manager of its own: with autoscaling it keeps the count the
// Deployment has (or starts it at the HPA's minimum) while the workload's apply
// leaves the field out.
func BudgetGrabScale(b *redpacketv1alpha1.RedPacketBudget, replicas int32) *appsv1ac.DeploymentApplyConfiguration {
	return appsv1ac.Deployment(BudgetGrabName(b), b.Namespace).WithSpec(appsv1ac.DeploymentSpec().WithReplicas(replicas))
}
