package specs

import (
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/intstr"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

func withTokens(a *redpacketv1alpha1.RedPacketActivity) {
	a.Spec.GrabService.Auth = &redpacketv1alpha1.GrabAuth{TokenSecretRef: redpacketv1alpha1.SecretReference{Name: "grab-hmac"}}
}

func withSignedWebhook(a *redpacketv1alpha1.RedPacketActivity) {
	a.Spec.Settlement = &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{
		URL: "http://balance:8080/credit", SecretRef: &redpacketv1alpha1.SecretReference{Name: "balance-hmac"}}}
}

func withOwnRedis(a *redpacketv1alpha1.RedPacketActivity) {
	a.Spec.Redis = &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: "redis-conn"}}
}

var testLogin = RedisLogin{Addresses: []string{"redis.test:6379"}, Mode: "standalone", Username: "rpa-uid-1",
	Password: strings.Repeat("ab", 32)}

// The grab Deployment for each shape of activity: what runs (image, command,
// flags), what it reads (key files, the Redis Secret), and what it may do.
func TestGrabDeployment(t *testing.T) {
	const lifetime = 90 * time.Second
	cases := []struct {
		name   string
		mutate []func(*redpacketv1alpha1.RedPacketActivity)
		login  *RedisLogin
		// wantImage runs the container.
		wantImage string
		// wantRedisSecret is the Secret the REDIS_* variables read.
		wantRedisSecret string
		// wantKeys maps each key volume to its Secret, wantArgs are flags that must be
		// there, and unwantedFlags flags that must not.
		wantKeys      map[string]string
		wantArgs      []string
		unwantedFlags []string
	}{
		{
			name: "on the default Redis, the operator's image", login: &testLogin,
			wantImage: "operator/grab:1", wantRedisSecret: "quiz-grab-redis",
			unwantedFlags: []string{"--token-key-file", "--token-max-lifetime", "--webhook-key-file"},
		},
		{
			name: "signed tokens", mutate: []func(*redpacketv1alpha1.RedPacketActivity){withTokens}, login: &testLogin,
			wantImage: "operator/grab:1", wantRedisSecret: "quiz-grab-redis",
			wantKeys:      map[string]string{"token-key": "grab-hmac"},
			wantArgs:      []string{"--token-key-file=/etc/redpacket/token/key", "--token-max-lifetime=1m30s"},
			unwantedFlags: []string{"--webhook-key-file"},
		},
		{
			// The deprecated webhook secretRef never reaches the grab pods: the operator
			// settles, with its own key.
			name: "a webhook secretRef mounts nothing", mutate: []func(*redpacketv1alpha1.RedPacketActivity){withTokens, withSignedWebhook},
			login: &testLogin, wantImage: "operator/grab:1", wantRedisSecret: "quiz-grab-redis",
			wantKeys:      map[string]string{"token-key": "grab-hmac"},
			wantArgs:      []string{"--token-key-file=/etc/redpacket/token/key"},
			unwantedFlags: []string{"--webhook-key-file", "--settlement"},
		},
		{
			name: "a webhook without a key is not signed",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){func(a *redpacketv1alpha1.RedPacketActivity) {
				a.Spec.Settlement = &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: "http://balance:8080/credit"}}
			}},
			login: &testLogin, wantImage: "operator/grab:1", wantRedisSecret: "quiz-grab-redis",
			unwantedFlags: []string{"--webhook-key-file"},
		},
		{
			name: "its own image and its own Redis",
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){withOwnRedis, func(a *redpacketv1alpha1.RedPacketActivity) {
				a.Spec.GrabService.Image = "example.test/grab:2"
			}},
			wantImage: "example.test/grab:2", wantRedisSecret: "redis-conn",
		},
		{
			name: "replicas in the spec are not the workload's to apply", login: &testLogin,
			mutate: []func(*redpacketv1alpha1.RedPacketActivity){func(a *redpacketv1alpha1.RedPacketActivity) {
				a.Spec.GrabService.Replicas = new(int32(3))
			}},
			wantImage: "operator/grab:1", wantRedisSecret: "quiz-grab-redis",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity(tc.mutate...)
			ac := GrabDeployment(Grab{Activity: a, OperatorImage: "operator/grab:1", TokenMaxLifetime: lifetime, DefaultRedis: tc.login})
			checkObjectMeta(t, a, "Deployment", "quiz-grab", ac)
			d := sent[appsv1.Deployment](t, ac)
			if d.Spec.Replicas != nil {
				t.Errorf("replicas %d in the workload's apply: it would undo kubectl scale (GrabScale applies them)", *d.Spec.Replicas)
			}
			if !maps.Equal(d.Spec.Selector.MatchLabels, GrabSelector(a)) || len(d.Spec.Selector.MatchExpressions) != 0 {
				t.Errorf("selector %+v, want %v", d.Spec.Selector, GrabSelector(a))
			}
			if !maps.Equal(d.Spec.Template.Labels, GrabLabels(a)) {
				t.Errorf("pod labels %v, want %v", d.Spec.Template.Labels, GrabLabels(a))
			}
			digest, annotated := d.Spec.Template.Annotations[AnnotationRedisCredentials]
			if tc.login == nil && annotated {
				t.Errorf("pods annotated with credentials %q although they read the activity's own Secret", digest)
			}
			if tc.login != nil && (digest != tc.login.Digest() || len(digest) != 16) {
				t.Errorf("pod annotation %s=%q, want the login's digest %q", AnnotationRedisCredentials, digest, tc.login.Digest())
			}

			pod := d.Spec.Template.Spec
			if pod.ServiceAccountName != "quiz-grab" || pod.AutomountServiceAccountToken == nil || !*pod.AutomountServiceAccountToken {
				t.Errorf("service account %q automount %v: the status reporter needs the grab ServiceAccount's token",
					pod.ServiceAccountName, pod.AutomountServiceAccountToken)
			}
			if len(pod.Containers) != 1 {
				t.Fatalf("%d containers", len(pod.Containers))
			}
			c := pod.Containers[0]
			if c.Name != "grab" || c.Image != tc.wantImage || !slices.Equal(c.Command, []string{"/grabsvc"}) || c.ImagePullPolicy != corev1.PullIfNotPresent {
				t.Errorf("container %q image %q command %q pull %s, want grab running /grabsvc from %q",
					c.Name, c.Image, c.Command, c.ImagePullPolicy, tc.wantImage)
			}
			for _, want := range append([]string{"--namespace=ns", "--activity=quiz", "--activity-uid=uid-1", "--listen=:8080"},
				tc.wantArgs...) {
				if !slices.Contains(c.Args, want) {
					t.Errorf("args %q lack %q", c.Args, want)
				}
			}
			for _, flag := range tc.unwantedFlags {
				if slices.ContainsFunc(c.Args, func(arg string) bool { return strings.HasPrefix(arg, flag+"=") }) {
					t.Errorf("args %q set %s", c.Args, flag)
				}
			}
			checkKeyVolumes(t, pod, tc.wantKeys)
			checkRedisEnv(t, c, tc.wantRedisSecret)
			checkGrabContainer(t, c)
			checkPodSecurity(t, pod)
		})
	}
}

// checkKeyVolumes checks that the pod mounts exactly the key Secrets of want (volume
// name to Secret name), each one read-only, with the key file readable by its owner
// and group only.
func checkKeyVolumes(t *testing.T, pod corev1.PodSpec, want map[string]string) {
	t.Helper()
	got := map[string]string{}
	for _, v := range pod.Volumes {
		if v.Secret == nil {
			t.Errorf("volume %s is not a Secret", v.Name)
			continue
		}
		got[v.Name] = v.Secret.SecretName
		if v.Secret.DefaultMode == nil || *v.Secret.DefaultMode != 0o440 {
			t.Errorf("volume %s mode %v, want 0440", v.Name, v.Secret.DefaultMode)
		}
		if len(v.Secret.Items) != 1 || v.Secret.Items[0].Key != "key" || v.Secret.Items[0].Path != "key" {
			t.Errorf("volume %s items %+v, want only key", v.Name, v.Secret.Items)
		}
	}
	if !maps.Equal(got, want) {
		t.Errorf("key volumes %v, want %v", got, want)
	}
	for _, m := range pod.Containers[0].VolumeMounts {
		if !m.ReadOnly {
			t.Errorf("mount %s at %s is writable", m.Name, m.MountPath)
		}
		if _, ok := want[m.Name]; !ok {
			t.Errorf("mount %s of no key volume", m.Name)
		}
	}
	if len(pod.Containers[0].VolumeMounts) != len(want) {
		t.Errorf("mounts %+v, want one per key volume %v", pod.Containers[0].VolumeMounts, want)
	}
}

// checkRedisEnv checks the container's environment: its pod name and namespace, and
// every REDIS_* variable from the Secret secret, optional, so no password is part
// of the Deployment.
func checkRedisEnv(t *testing.T, c corev1.Container, secret string) {
	t.Helper()
	want := map[string]string{"REDIS_ADDRESSES": "addresses", "REDIS_MODE": "mode", "REDIS_USERNAME": "username",
		"REDIS_PASSWORD": "password", "REDIS_TLS": "tls"}
	fields := map[string]string{"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
	for _, e := range c.Env {
		if e.Value != "" || e.ValueFrom == nil {
			t.Errorf("env %s has a literal value %q", e.Name, e.Value)
			continue
		}
		if path, ok := fields[e.Name]; ok {
			if e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != path {
				t.Errorf("env %s from %+v, want field %s", e.Name, e.ValueFrom, path)
			}
			delete(fields, e.Name)
			continue
		}
		ref := e.ValueFrom.SecretKeyRef
		if ref == nil || ref.Name != secret || ref.Key != want[e.Name] || ref.Optional == nil || !*ref.Optional {
			t.Errorf("env %s from %+v, want optional key %q of Secret %s", e.Name, e.ValueFrom, want[e.Name], secret)
		}
		delete(want, e.Name)
	}
	if len(want) > 0 || len(fields) > 0 {
		t.Errorf("env lacks %v and %v", want, fields)
	}
}

// checkGrabContainer checks what every grab container has: the named port the
// Service targets, the probes on it, the requests and a locked-down security context.
func checkGrabContainer(t *testing.T, c corev1.Container) {
	t.Helper()
	if len(c.Ports) != 1 || c.Ports[0] != (corev1.ContainerPort{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}) {
		t.Errorf("ports %+v, want http 8080/TCP", c.Ports)
	}
	for name, probe := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Port != intstr.FromString("http") {
			t.Errorf("%s probe %+v, want an HTTP GET on the http port", name, probe)
		}
	}
	if c.ReadinessProbe != nil && c.ReadinessProbe.HTTPGet != nil && c.ReadinessProbe.HTTPGet.Path != "/readyz" {
		t.Errorf("readiness path %q", c.ReadinessProbe.HTTPGet.Path)
	}
	if c.LivenessProbe != nil && c.LivenessProbe.HTTPGet != nil && c.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("liveness path %q", c.LivenessProbe.HTTPGet.Path)
	}
	if cpu, mem, limit := c.Resources.Requests[corev1.ResourceCPU], c.Resources.Requests[corev1.ResourceMemory],
		c.Resources.Limits[corev1.ResourceMemory]; !cpu.Equal(resource.MustParse("100m")) ||
		!mem.Equal(resource.MustParse("64Mi")) || !limit.Equal(resource.MustParse("256Mi")) || len(c.Resources.Limits) != 1 {
		t.Errorf("resources %+v, want requests of 100m CPU and 64Mi memory and a memory limit of 256Mi only", c.Resources)
	}
	sc := c.SecurityContext
	if sc == nil || sc.Privileged == nil || *sc.Privileged || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot ||
		sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 ||
		sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("container security context %+v, want unprivileged, read-only, no capabilities, RuntimeDefault seccomp", sc)
	}
}

// checkPodSecurity checks that the pod runs as nonRootUID with the key files' group.
func checkPodSecurity(t *testing.T, pod corev1.PodSpec) {
	t.Helper()
	psc := pod.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser != 65532 ||
		psc.RunAsGroup == nil || *psc.RunAsGroup != 65532 || psc.FSGroup == nil || *psc.FSGroup != 65532 ||
		psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod security context %+v, want UID, GID and fsGroup 65532 (the key files' group), RuntimeDefault seccomp", psc)
	}
}

// grabShutdownTail is what the grab service does after its HTTP drain, before it
// exits: stop the settlement worker, whose acknowledgements of finished deliveries
// get up to 5 s, and write a last status report, which gets up to 3 s
// (cmd/grabsvc).
const grabShutdownTail = 5*time.Second + 3*time.Second

// The grab pod's terminationGracePeriodSeconds leaves room for the shutdown delay,
// the drain timeout and what follows them, as the Deployment passes them to the grab
// service, for every shape of activity. Changing the flags without the grace period
// (or the other way round) fails here.
func TestGrabPodGracePeriodCoversTheShutdown(t *testing.T) {
	cases := []struct {
		name   string
		mutate func(*redpacketv1alpha1.RedPacketActivity)
	}{
		{"plain", func(*redpacketv1alpha1.RedPacketActivity) {}},
		{"signed tokens", withTokens},
		{"signed webhook", withSignedWebhook},
		{"own image and redis", func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Spec.GrabService.Image = "example/grab:2"
			withOwnRedis(a)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity(tc.mutate)
			d := GrabDeployment(Grab{Activity: a})
			pod := d.Spec.Template.Spec
			if len(pod.Containers) != 1 {
				t.Fatalf("%d containers", len(pod.Containers))
			}
			flags := map[string]time.Duration{}
			for _, arg := range pod.Containers[0].Args {
				name, value, ok := strings.Cut(arg, "=")
				if !ok || (name != "--shutdown-delay" && name != "--shutdown-timeout") {
					continue
				}
				v, err := time.ParseDuration(value)
				if err != nil {
					t.Fatalf("%s: %v", arg, err)
				}
				flags[name] = v
			}
			delay, hasDelay := flags["--shutdown-delay"]
			timeout, hasTimeout := flags["--shutdown-timeout"]
			if !hasDelay || !hasTimeout {
				t.Fatalf("args %q do not set --shutdown-delay and --shutdown-timeout explicitly", pod.Containers[0].Args)
			}
			if delay != GrabShutdownDelay || timeout != GrabShutdownTimeout {
				t.Errorf("flags delay %s timeout %s, want the constants %s and %s", delay, timeout, GrabShutdownDelay, GrabShutdownTimeout)
			}
			if pod.TerminationGracePeriodSeconds == nil {
				t.Fatal("no terminationGracePeriodSeconds")
			}
			grace := time.Duration(*pod.TerminationGracePeriodSeconds) * time.Second
			if need := delay + timeout + grabShutdownTail; grace <= need {
				t.Errorf("terminationGracePeriodSeconds %s, want above delay %s + timeout %s + the %s after the drain = %s",
					grace, delay, timeout, grabShutdownTail, need)
			}
		})
	}
}

// The grace period is the sum of its parts in whole seconds, rounded up, so a drain
// is never cut short by a fraction of a second; the margin covers what the grab
// service does after its drain.
func TestTerminationGracePeriodSeconds(t *testing.T) {
	cases := []struct {
		parts []time.Duration
		want  int64
	}{
		{[]time.Duration{5 * time.Second, 20 * time.Second, 10 * time.Second}, 35},
		{[]time.Duration{5 * time.Second, 30 * time.Second, 10 * time.Second}, 45},
		{[]time.Duration{1500 * time.Millisecond, 20 * time.Second}, 22},
		{[]time.Duration{time.Nanosecond}, 1},
		{nil, 0},
	}
	for _, tc := range cases {
		if got := terminationGracePeriodSeconds(tc.parts...); got != tc.want {
			t.Errorf("terminationGracePeriodSeconds(%v) = %d, want %d", tc.parts, got, tc.want)
		}
	}
	if got, want := GrabTerminationGracePeriodSeconds(), terminationGracePeriodSeconds(GrabShutdownDelay, GrabShutdownTimeout, GrabShutdownMargin); got != want {
		t.Errorf("GrabTerminationGracePeriodSeconds() = %d, want %d", got, want)
	}
	if GrabShutdownMargin < grabShutdownTail {
		t.Errorf("GrabShutdownMargin %s does not cover the %s the grab service needs after its drain", GrabShutdownMargin, grabShutdownTail)
	}
}
