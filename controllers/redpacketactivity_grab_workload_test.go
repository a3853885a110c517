package controllers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// Every child of the grab workload (and the Secret with the operator's default Redis
// connection) is controlled by its activity, the Role grants
// exactly the activity's own object and status, and the replica count follows the
// spec only when the spec changes it.
func TestGrabWorkloadIsOwnedAndKeepsScaledReplicas(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()

	e.create(e.activity("owned", 1000, 10, withSettlement, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.GrabService.Auth = &redpacketv1alpha1.GrabAuth{TokenSecretRef: redpacketv1alpha1.SecretReference{Name: "grab-hmac"}}
		a.Spec.Settlement.Webhook.SecretRef = &redpacketv1alpha1.SecretReference{Name: "balance-hmac"}
	}))
	a := e.waitPhase("owned", redpacketv1alpha1.PhaseActive, 20*time.Second)

	key := client.ObjectKey{Namespace: e.ns, Name: "owned-grab"}
	children := map[string]client.Object{
		"ServiceAccount": &corev1.ServiceAccount{},
		"Role":           &rbacv1.Role{},
		"RoleBinding":    &rbacv1.RoleBinding{},
		"Service":        &corev1.Service{},
		"Deployment":     &appsv1.Deployment{},
	}
	redisSecret := &corev1.Secret{}
	children["Secret"] = redisSecret
	for kind, obj := range children {
		key := key
		if kind == "Secret" {
			key.Name = "owned-grab-redis"
		}
		if err := e.c.Get(ctx, key, obj); err != nil {
			t.Fatalf("%s %s: %v", kind, key.Name, err)
		}
		if !metav1.IsControlledBy(obj, a) {
			t.Errorf("%s %s is not controlled by the activity: %+v", kind, key.Name, obj.GetOwnerReferences())
		}
		refs := obj.GetOwnerReferences()
		if len(refs) != 1 || refs[0].Kind != "RedPacketActivity" || refs[0].BlockOwnerDeletion == nil || !*refs[0].BlockOwnerDeletion {
			t.Errorf("%s owner references %+v", kind, refs)
		}
		if !slices.ContainsFunc(obj.GetManagedFields(), func(m metav1.ManagedFieldsEntry) bool {
			return m.Manager == controllers.FieldManager && m.Operation == metav1.ManagedFieldsOperationApply
		}) {
			t.Errorf("%s was not applied by %s", kind, controllers.FieldManager)
		}
	}

	role := children["Role"].(*rbacv1.Role)
	wantRules := []rbacv1.PolicyRule{
		{APIGroups: []string{"redpacket.io"}, Resources: []string{"redpacketactivities"}, ResourceNames: []string{"owned"}, Verbs: []string{"get"}},
		{APIGroups: []string{"redpacket.io"}, Resources: []string{"redpacketactivities/status"}, ResourceNames: []string{"owned"}, Verbs: []string{"get", "patch"}},
	}
	if !slices.EqualFunc(role.Rules, wantRules, func(x, y rbacv1.PolicyRule) bool {
		return slices.Equal(x.APIGroups, y.APIGroups) && slices.Equal(x.Resources, y.Resources) &&
			slices.Equal(x.ResourceNames, y.ResourceNames) && slices.Equal(x.Verbs, y.Verbs)
	}) {
		t.Errorf("role rules %+v, want %+v", role.Rules, wantRules)
	}
	rb := children["RoleBinding"].(*rbacv1.RoleBinding)
	if rb.RoleRef.Name != "owned-grab" || len(rb.Subjects) != 1 || rb.Subjects[0].Name != "owned-grab" || rb.Subjects[0].Kind != "ServiceAccount" {
		t.Errorf("role binding %+v", rb)
	}
	svc := children["Service"].(*corev1.Service)
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != 8080 || svc.Spec.Ports[0].Name != "http" {
		t.Errorf("service ports %+v", svc.Spec.Ports)
	}

	d := children["Deployment"].(*appsv1.Deployment)
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 1 {
		t.Errorf("replicas %v, want the operator's default 1", d.Spec.Replicas)
	}
	pod := d.Spec.Template.Spec
	if pod.ServiceAccountName != "owned-grab" || pod.SecurityContext == nil || pod.SecurityContext.RunAsNonRoot == nil || !*pod.SecurityContext.RunAsNonRoot {
		t.Errorf("pod spec: service account %q, security context %+v", pod.ServiceAccountName, pod.SecurityContext)
	}
	c := pod.Containers[0]
	if c.Image != "registry.example/redpacket-operator:test" {
		t.Errorf("image %q, want the operator's grab image", c.Image)
	}
	if !slices.Equal(c.Command, []string{"/grabsvc"}) {
		t.Errorf("command %q, want /grabsvc", c.Command)
	}
	wantArgs := []string{"--namespace=" + e.ns, "--activity=owned", "--activity-uid=" + string(a.UID), "--listen=:8080",
		"--shutdown-delay=5s", "--shutdown-timeout=20s",
		"--token-key-file=/etc/redpacket/token/key", "--token-max-lifetime=24h0m0s"}
	if !slices.Equal(c.Args, wantArgs) {
		t.Errorf("args %q, want %q", c.Args, wantArgs)
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/readyz" ||
		c.LivenessProbe == nil || c.LivenessProbe.HTTPGet == nil || c.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("probes: readiness %+v liveness %+v", c.ReadinessProbe, c.LivenessProbe)
	}
	env := map[string]corev1.EnvVar{}
	for _, v := range c.Env {
		env[v.Name] = v
	}
	for _, name := range []string{"REDIS_ADDRESSES", "REDIS_MODE", "REDIS_USERNAME", "REDIS_PASSWORD", "REDIS_TLS"} {
		v := env[name]
		if v.Value != "" || v.ValueFrom == nil || v.ValueFrom.SecretKeyRef == nil || v.ValueFrom.SecretKeyRef.Name != "owned-grab-redis" {
			t.Errorf("%s %+v, want a reference to Secret owned-grab-redis", name, v)
		}
	}
	if got := string(redisSecret.Data["addresses"]); got != e.redis.Addr || string(redisSecret.Data["mode"]) != "standalone" ||
		string(redisSecret.Data["tls"]) != "false" {
		t.Errorf("secret owned-grab-redis data %q, want the operator's connection", redisSecret.Data)
	}
	if f := env["POD_NAME"].ValueFrom; f == nil || f.FieldRef == nil || f.FieldRef.FieldPath != "metadata.name" {
		t.Errorf("POD_NAME %+v, want the downward API", env["POD_NAME"])
	}
	volumes := map[string]string{}
	for _, v := range pod.Volumes {
		if v.Secret != nil {
			volumes[v.Name] = v.Secret.SecretName
			// Group-readable only: the pod's fsGroup is the group the service runs as.
			if v.Secret.DefaultMode == nil || *v.Secret.DefaultMode != 0o440 {
				t.Errorf("volume %s defaultMode %v, want 0440", v.Name, v.Secret.DefaultMode)
			}
		}
	}
	// The webhook's secretRef (deprecated) is never mounted: grab pods do not settle.
	if volumes["token-key"] != "grab-hmac" || len(volumes) != 1 {
		t.Errorf("secret volumes %v", volumes)
	}
	// The key files are root:root 0440 unless the pod has an fsGroup: the service runs
	// as 65532:65532, so the volumes must be given group 65532.
	if sc := pod.SecurityContext; sc.FSGroup == nil || *sc.FSGroup != 65532 || sc.RunAsUser == nil || *sc.RunAsUser != 65532 ||
		sc.RunAsGroup == nil || *sc.RunAsGroup != 65532 {
		t.Errorf("pod security context %+v, want user, group and fsGroup 65532", sc)
	}
	if g := pod.TerminationGracePeriodSeconds; g == nil || *g != specs.GrabTerminationGracePeriodSeconds() || *g <= 5+20 {
		t.Errorf("terminationGracePeriodSeconds %v, want %d, above the shutdown delay and timeout (25s)", g, specs.GrabTerminationGracePeriodSeconds())
	}

	// kubectl scale survives reconciles.
	e.scale(d, 4)
	e.reconcileRoundTrip("owned")
	if got := e.replicas(key); got != 4 {
		t.Fatalf("replicas %d after kubectl scale and reconciles, want 4", got)
	}

	// A change of spec.grabService.replicas wins over the live count.
	e.patch("owned", func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.GrabService.Replicas = ptr(int32(3)) })
	wait.Until(t, 10*time.Second, "replicas 3 from the spec", func() (bool, string) {
		got := e.replicas(key)
		return got == 3, fmt.Sprintf("replicas %d", got)
	})
	e.scale(d, 6)
	e.reconcileRoundTrip("owned")
	if got := e.replicas(key); got != 6 {
		t.Fatalf("replicas %d after a second kubectl scale, want 6", got)
	}
}

// The grab pods' Redis credentials (the activity's own Redis user, never the
// operator's password) reach them through an owned Secret, never as a plain value in
// the Deployment; an activity that names its own Secret uses that one, and the
// operator's Secret is removed from its namespace.
func TestDefaultRedisPasswordStaysInASecret(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const password = "s3cret-default-pw"
	srv, _ := redistest.StartProtected(t, password)
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Options.DefaultRedis = srv.Conn()
	})
	ctx := context.Background()

	e.create(e.activity("secretive", 1000, 10))
	e.waitPhase("secretive", redpacketv1alpha1.PhaseActive, 20*time.Second)

	d := &appsv1.Deployment{}
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "secretive-grab"}, d); err != nil {
		t.Fatal(err)
	}
	raw, err := json.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(raw), password) {
		t.Errorf("the Deployment holds the Redis password in plain: %s", raw)
	}
	var ref *corev1.SecretKeySelector
	for _, v := range d.Spec.Template.Spec.Containers[0].Env {
		if v.Name == "REDIS_PASSWORD" && v.ValueFrom != nil {
			ref = v.ValueFrom.SecretKeyRef
		}
	}
	if ref == nil || ref.Name != "secretive-grab-redis" || ref.Key != "password" {
		t.Fatalf("REDIS_PASSWORD comes from %+v, want Secret secretive-grab-redis key password", ref)
	}
	secret := &corev1.Secret{}
	key := client.ObjectKey{Namespace: e.ns, Name: "secretive-grab-redis"}
	if err := e.c.Get(ctx, key, secret); err != nil {
		t.Fatal(err)
	}
	conn, err := redisconn.ConnFromSecret(secret.Data)
	if err != nil {
		t.Fatalf("the Secret is not in the spec.redis.secretRef format: %v", err)
	}
	a := e.get("secretive")
	if conn.Password == password || conn.Username != store.NewActivity(nil, string(a.UID), 1).UserName() || len(conn.Addresses) != 1 ||
		conn.Addresses[0] != srv.Addr || conn.Mode != redisconn.ModeStandalone {
		t.Errorf("connection in the Secret %+v, want the default Redis with the activity's own user", conn)
	}

	// Pointing the activity at its own Secret (credentials the tenant brings) moves the
	// Deployment to it and takes the activity's Secret out of the namespace.
	own := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "own-redis", Namespace: e.ns},
		StringData: map[string]string{"addresses": srv.Addr, "mode": "standalone", "username": srv.Username, "password": password},
	}
	if err := e.c.Create(ctx, own); err != nil {
		t.Fatal(err)
	}
	e.patch("secretive", func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Redis = &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: "own-redis"}}
	})
	wait.Until(t, 10*time.Second, "the operator's Secret removed", func() (bool, string) {
		err := e.c.Get(ctx, key, &corev1.Secret{})
		return isNotFound(err), "get: " + errString(err)
	})
	wait.Until(t, 10*time.Second, "REDIS_PASSWORD from own-redis", func() (bool, string) {
		if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "secretive-grab"}, d); err != nil {
			return false, err.Error()
		}
		for _, v := range d.Spec.Template.Spec.Containers[0].Env {
			if v.Name == "REDIS_PASSWORD" && v.ValueFrom != nil && v.ValueFrom.SecretKeyRef != nil {
				return v.ValueFrom.SecretKeyRef.Name == "own-redis", v.ValueFrom.SecretKeyRef.Name
			}
		}
		return false, "no REDIS_PASSWORD reference"
	})
}

// reconcileRoundTrip makes the controller reconcile the activity after this point and
// waits for it: a generation change, observed in status.
func (e *env) reconcileRoundTrip(name string) {
	e.t.Helper()
	e.patch(name, func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Paused = !a.Spec.Paused })
	a := e.get(name)
	gen := a.Generation
	wait.Until(e.t, 10*time.Second, "observedGeneration "+name, func() (bool, string) {
		a := e.get(name)
		return a.Status.ObservedGeneration >= gen, describe(a)
	})
	e.patch(name, func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Paused = !a.Spec.Paused })
	gen++
	wait.Until(e.t, 10*time.Second, "observedGeneration "+name, func() (bool, string) {
		a := e.get(name)
		return a.Status.ObservedGeneration >= gen, describe(a)
	})
}

// scale changes the Deployment's replicas through the scale subresource, as kubectl
// scale and autoscalers do.
func (e *env) scale(d *appsv1.Deployment, replicas int32) {
	e.t.Helper()
	s := &autoscalingv1.Scale{
		ObjectMeta: metav1.ObjectMeta{Name: d.Name, Namespace: d.Namespace},
		Spec:       autoscalingv1.ScaleSpec{Replicas: replicas},
	}
	if err := e.c.SubResource("scale").Update(context.Background(), d, client.WithSubResourceBody(s)); err != nil {
		e.t.Fatalf("scaling %s to %d: %v", d.Name, replicas, err)
	}
}

func (e *env) replicas(key client.ObjectKey) int32 {
	e.t.Helper()
	d := &appsv1.Deployment{}
	if err := e.c.Get(context.Background(), key, d); err != nil {
		e.t.Fatalf("getting deployment: %v", err)
	}
	return *d.Spec.Replicas
}

// A Deployment named <activity>-grab that someone else created is left alone.
func TestForeignDeploymentIsNotAdopted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()

	foreign := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "taken-grab", Namespace: e.ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr(int32(2)),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "other"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "other"}},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "other", Image: "someone/else:1"}}},
			},
		},
	}
	if err := e.c.Create(ctx, foreign); err != nil {
		t.Fatal(err)
	}
	e.startController(nil)
	e.create(e.activity("taken", 1000, 10))

	a := e.waitCondition("taken", redpacketv1alpha1.ConditionGrabServiceAvailable, metav1.ConditionFalse, redpacketv1alpha1.ReasonNotAdopted, 20*time.Second)
	if c := findCondition(a, redpacketv1alpha1.ConditionGrabServiceAvailable); !strings.Contains(c.Message, "Deployment taken-grab") {
		t.Errorf("NotAdopted message %q does not name the Deployment", c.Message)
	}
	e.waitEvent("taken", "Warning", redpacketv1alpha1.ReasonNotAdopted)
	e.bump("taken", 1)
	e.bump("taken", 2)
	time.Sleep(time.Second)

	got := &appsv1.Deployment{}
	if err := e.c.Get(ctx, client.ObjectKeyFromObject(foreign), got); err != nil {
		t.Fatal(err)
	}
	if len(got.OwnerReferences) != 0 {
		t.Errorf("foreign deployment got owner references %+v", got.OwnerReferences)
	}
	if got.Spec.Template.Spec.Containers[0].Image != "someone/else:1" || *got.Spec.Replicas != 2 {
		t.Errorf("foreign deployment changed: image %q replicas %d", got.Spec.Template.Spec.Containers[0].Image, *got.Spec.Replicas)
	}
	for _, m := range got.ManagedFields {
		if m.Manager == controllers.FieldManager {
			t.Errorf("the controller wrote to the foreign deployment: %+v", m)
		}
	}
	// None of the other children was created either: a half workload is no use.
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "taken-grab"}, &corev1.Service{}); !isNotFound(err) {
		t.Errorf("service created next to a foreign deployment: %v", err)
	}
}
