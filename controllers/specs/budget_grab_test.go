package specs

import (
	"encoding/base64"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// testBudget is the budget "shop" in namespace "ns" with 16 shards, changed by mutate.
func testBudget(mutate ...func(*redpacketv1alpha1.RedPacketBudget)) *redpacketv1alpha1.RedPacketBudget {
	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Name: "shop", Namespace: "ns", UID: types.UID("buid-1")},
		Spec:       redpacketv1alpha1.RedPacketBudgetSpec{Total: 1_000_000, BudgetShards: 16},
	}
	for _, m := range mutate {
		m(b)
	}
	return b
}

// checkBudgetMeta checks the kind, name, labels and the budget's one blocking
// controller reference of an applied object.
func checkBudgetMeta(t *testing.T, b *redpacketv1alpha1.RedPacketBudget, wantKind, wantName string, ac any) {
	t.Helper()
	obj := sent[objectHead](t, ac)
	if obj.Kind != wantKind || obj.Name != wantName || obj.Namespace != b.Namespace {
		t.Errorf("%s %s/%s, want %s %s/%s", obj.Kind, obj.Namespace, obj.Name, wantKind, b.Namespace, wantName)
	}
	if !maps.Equal(obj.Labels, BudgetLabels(b)) || obj.Labels[LabelManagedBy] != ManagedByValue {
		t.Errorf("%s labels %v, want %v", wantKind, obj.Labels, BudgetLabels(b))
	}
	if len(obj.OwnerReferences) != 1 || !metav1.IsControlledBy(obj, b) {
		t.Fatalf("%s owner references %+v, want the budget's controller reference", wantKind, obj.OwnerReferences)
	}
	ref := obj.OwnerReferences[0]
	if ref.Kind != "RedPacketBudget" || ref.APIVersion != redpacketv1alpha1.GroupVersion.String() || ref.Name != b.Name ||
		ref.BlockOwnerDeletion == nil || !*ref.BlockOwnerDeletion {
		t.Errorf("%s owner reference %+v", wantKind, ref)
	}
}

// The shared grab Deployment for each shape of budget: the budget-mode flags, the
// Redis Secret its pods read, the mounted sender credential and token key, the
// replicas (applied only when the spec sets them) and the resources.
func TestBudgetGrabDeployment(t *testing.T) {
	login := RedisLogin{Addresses: []string{"redis.test:6379"}, Mode: "standalone", Username: "rpb-buid-1",
		Password: strings.Repeat("cd", 32)}
	cases := []struct {
		name            string
		mutate          func(*redpacketv1alpha1.RedPacketBudget)
		login           *RedisLogin
		wantImage       string
		wantRedisSecret string
		wantVolumes     map[string]string // volume → Secret
		wantArgs        []string
		unwantedFlags   []string
		wantReplicas    *int32
		wantRequests    corev1.ResourceList
		wantLimits      corev1.ResourceList
	}{
		{
			name: "on the default Redis, no auth, replicas left to the Deployment", login: &login,
			wantImage: "operator/grab:1", wantRedisSecret: "shop-grab-redis",
			wantVolumes:   map[string]string{"sender-token": "shop-sender"},
			unwantedFlags: []string{"--token-key-file", "--token-max-lifetime", "--activity", "--activity-uid", "--send-windows", "--send-time-zone", "--claim-secret", "--quota-"},
			wantRequests:  corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			wantLimits:    corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		},
		{
			name: "signed user tokens and replicas from the spec", login: &login,
			mutate: func(b *redpacketv1alpha1.RedPacketBudget) {
				b.Spec.GrabService.Auth = &redpacketv1alpha1.GrabAuth{TokenSecretRef: redpacketv1alpha1.SecretReference{Name: "grab-hmac"}}
				b.Spec.GrabService.Replicas = new(int32(3))
			},
			wantImage: "operator/grab:1", wantRedisSecret: "shop-grab-redis",
			wantVolumes:  map[string]string{"sender-token": "shop-sender", "token-key": "grab-hmac"},
			wantArgs:     []string{"--token-key-file=/etc/redpacket/token/key", "--token-max-lifetime=1h0m0s"},
			wantReplicas: new(int32(3)),
			wantRequests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			wantLimits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		},
		{
			name: "autoscaling: replicas left to the operator's HPA, even with the spec's", login: &login,
			mutate: func(b *redpacketv1alpha1.RedPacketBudget) {
				b.Spec.GrabService.Replicas = new(int32(3))
				b.Spec.GrabService.Autoscaling = &redpacketv1alpha1.GrabAutoscaling{MinReplicas: 2, MaxReplicas: 6}
			},
			wantImage: "operator/grab:1", wantRedisSecret: "shop-grab-redis",
			wantVolumes:  map[string]string{"sender-token": "shop-sender"},
			wantRequests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			wantLimits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		},
		{
			name: "its own Redis, image, shards and resources",
			mutate: func(b *redpacketv1alpha1.RedPacketBudget) {
				b.Spec.Redis = &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: "redis-conn"}}
				b.Spec.GrabService.Image = "example.test/grab:2"
				b.Spec.BudgetShards = 64
				b.Spec.GrabService.Replicas = new(int32(0))
				b.Spec.GrabService.Resources = &corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("500m")},
					Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
				}
			},
			wantImage: "example.test/grab:2", wantRedisSecret: "redis-conn",
			wantVolumes:  map[string]string{"sender-token": "shop-sender"},
			wantArgs:     []string{"--budget-shards=64"},
			wantReplicas: new(int32(0)),
			wantRequests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("500m")},
			wantLimits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		},
		{
			name: "send windows in a time zone, and claim secrets", login: &login,
			mutate: func(b *redpacketv1alpha1.RedPacketBudget) {
				b.Spec.Packets.SendWindows = []redpacketv1alpha1.SendWindow{"08:00-12:00", "14:00-24:00"}
				b.Spec.Packets.TimeZone = "Asia/Shanghai"
				b.Spec.Packets.ClaimSecret = true
			},
			wantImage: "operator/grab:1", wantRedisSecret: "shop-grab-redis",
			wantVolumes:  map[string]string{"sender-token": "shop-sender"},
			wantArgs:     []string{"--send-windows=08:00-12:00,14:00-24:00", "--send-time-zone=Asia/Shanghai", "--claim-secret"},
			wantRequests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			wantLimits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		},
		{
			name: "quotas per sender and per recipient, with the day in the time zone", login: &login,
			mutate: func(b *redpacketv1alpha1.RedPacketBudget) {
				b.Spec.Packets.TimeZone = "Asia/Shanghai"
				b.Spec.Packets.Quotas = &redpacketv1alpha1.PacketQuotas{
					PerSender:    &redpacketv1alpha1.SenderQuotas{PacketsPerMinute: 1800, AmountPerDay: 500000},
					PerRecipient: &redpacketv1alpha1.RecipientQuotas{SharesPerDay: 10},
				}
			},
			wantImage: "operator/grab:1", wantRedisSecret: "shop-grab-redis",
			wantVolumes: map[string]string{"sender-token": "shop-sender"},
			wantArgs: []string{"--quota-packets-per-minute=1800", "--quota-amount-per-day=500000", "--quota-shares-per-day=10",
				"--send-time-zone=Asia/Shanghai"},
			unwantedFlags: []string{"--quota-packets-per-day", "--send-windows"},
			wantRequests:  corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			wantLimits:    corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		},
		{
			name: "resources without a memory limit get one, no lower than the memory request", login: &login,
			mutate: func(b *redpacketv1alpha1.RedPacketBudget) {
				b.Spec.GrabService.Resources = &corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")},
					Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("2")},
				}
			},
			wantImage: "operator/grab:1", wantRedisSecret: "shop-grab-redis",
			wantVolumes:  map[string]string{"sender-token": "shop-sender"},
			wantRequests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")},
			wantLimits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("2"), corev1.ResourceMemory: resource.MustParse("1Gi")},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := testBudget()
			if tc.mutate != nil {
				tc.mutate(b)
			}
			ac := BudgetGrabDeployment(BudgetGrab{Budget: b, OperatorImage: "operator/grab:1", TokenMaxLifetime: time.Hour, DefaultRedis: tc.login})
			checkBudgetMeta(t, b, "Deployment", "shop-grab", ac)
			d := sent[appsv1.Deployment](t, ac)
			switch {
			case tc.wantReplicas == nil && d.Spec.Replicas != nil:
				t.Errorf("replicas %d applied although the spec leaves them to an autoscaler", *d.Spec.Replicas)
			case tc.wantReplicas != nil && (d.Spec.Replicas == nil || *d.Spec.Replicas != *tc.wantReplicas):
				t.Errorf("replicas %v, want %d", d.Spec.Replicas, *tc.wantReplicas)
			}
			if !maps.Equal(d.Spec.Selector.MatchLabels, BudgetSelector(b)) || !maps.Equal(d.Spec.Template.Labels, BudgetLabels(b)) {
				t.Errorf("selector %v pod labels %v", d.Spec.Selector.MatchLabels, d.Spec.Template.Labels)
			}
			if sel, err := labels.Parse(BudgetSelectorString(b)); err != nil || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
				t.Errorf("status selector %q does not select the pods (%v)", BudgetSelectorString(b), err)
			}
			if digest := d.Spec.Template.Annotations[AnnotationRedisCredentials]; (tc.login == nil) != (digest == "") ||
				(tc.login != nil && digest != tc.login.Digest()) {
				t.Errorf("credentials digest %q with login %v", digest, tc.login)
			}
			pod := d.Spec.Template.Spec
			if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
				t.Errorf("automount %v: a budget's grab pods never talk to the API server", pod.AutomountServiceAccountToken)
			}
			if len(pod.Containers) != 1 {
				t.Fatalf("%d containers", len(pod.Containers))
			}
			c := pod.Containers[0]
			if c.Image != tc.wantImage || !slices.Equal(c.Command, []string{"/grabsvc"}) {
				t.Errorf("image %q command %q, want %q running /grabsvc", c.Image, c.Command, tc.wantImage)
			}
			shards := "--budget-shards=16"
			if b.Spec.BudgetShards == 64 {
				shards = "--budget-shards=64"
			}
			for _, want := range append([]string{"--namespace=ns", "--budget=shop", "--budget-uid=buid-1", shards,
				"--listen=:8080", "--sender-token-file=/etc/redpacket/sender/token"}, tc.wantArgs...) {
				if !slices.Contains(c.Args, want) {
					t.Errorf("args %q lack %q", c.Args, want)
				}
			}
			for _, flag := range tc.unwantedFlags {
				if slices.ContainsFunc(c.Args, func(arg string) bool { return strings.HasPrefix(arg, flag+"=") }) {
					t.Errorf("args %q set %s", c.Args, flag)
				}
			}
			checkBudgetVolumes(t, pod, tc.wantVolumes)
			checkRedisEnv(t, c, tc.wantRedisSecret)
			checkPodSecurity(t, pod)
			if !maps.EqualFunc(c.Resources.Requests, tc.wantRequests, resource.Quantity.Equal) ||
				!maps.EqualFunc(c.Resources.Limits, tc.wantLimits, resource.Quantity.Equal) {
				t.Errorf("resources %+v, want requests %v limits %v", c.Resources, tc.wantRequests, tc.wantLimits)
			}
			if len(c.Ports) != 1 || c.Ports[0].ContainerPort != 8080 || c.Ports[0].Name != "http" {
				t.Errorf("ports %+v", c.Ports)
			}
		})
	}
}

// checkBudgetVolumes checks that the pod mounts exactly the Secrets of want, each
// read-only with mode 0440 and one item: the sender token or the token key.
func checkBudgetVolumes(t *testing.T, pod corev1.PodSpec, want map[string]string) {
	t.Helper()
	got := map[string]string{}
	for _, v := range pod.Volumes {
		if v.Secret == nil {
			t.Errorf("volume %s is not a Secret", v.Name)
			continue
		}
		got[v.Name] = v.Secret.SecretName
		item := "key"
		if v.Name == "sender-token" {
			item = "token"
		}
		if v.Secret.DefaultMode == nil || *v.Secret.DefaultMode != 0o440 || len(v.Secret.Items) != 1 ||
			v.Secret.Items[0].Key != item || v.Secret.Items[0].Path != item {
			t.Errorf("volume %s: mode %v items %+v, want 0440 and only %s", v.Name, v.Secret.DefaultMode, v.Secret.Items, item)
		}
	}
	if !maps.Equal(got, want) {
		t.Errorf("volumes %v, want %v", got, want)
	}
	mounts := map[string]string{}
	for _, m := range pod.Containers[0].VolumeMounts {
		if !m.ReadOnly {
			t.Errorf("mount %s is writable", m.Name)
		}
		mounts[m.Name] = m.MountPath
	}
	if mounts["sender-token"] != "/etc/redpacket/sender" {
		t.Errorf("sender token mounted at %q, want /etc/redpacket/sender (the flag names its token file)", mounts["sender-token"])
	}
	if _, ok := want["token-key"]; ok && mounts["token-key"] != "/etc/redpacket/token" {
		t.Errorf("token key mounted at %q", mounts["token-key"])
	}
	if len(mounts) != len(want) {
		t.Errorf("mounts %v, want one per volume %v", mounts, want)
	}
}

// The Service maps port 80 to the pods' named port.
func TestBudgetGrabService(t *testing.T) {
	b := testBudget()
	ac := BudgetGrabService(b)
	checkBudgetMeta(t, b, "Service", "shop-grab", ac)
	svc := sent[corev1.Service](t, ac)
	if svc.Spec.Type != corev1.ServiceTypeClusterIP || !maps.Equal(svc.Spec.Selector, BudgetSelector(b)) {
		t.Errorf("type %s selector %v", svc.Spec.Type, svc.Spec.Selector)
	}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != 8080 || svc.Spec.Ports[0].TargetPort != intstr.FromString("http") {
		t.Errorf("ports %+v, want 80 → http", svc.Spec.Ports)
	}
	if got := BudgetEndpoint(b); got != "http://shop-grab.ns.svc:8080" {
		t.Errorf("endpoint %q", got)
	}
}

// A budget's selector never selects an activity's pods of the same name, nor the
// other way round: their Deployments may live side by side.
func TestBudgetSelectorIsNotAnActivitys(t *testing.T) {
	b := testBudget()
	a := testActivity(func(a *redpacketv1alpha1.RedPacketActivity) { a.Name = "shop" })
	if labels.SelectorFromSet(BudgetSelector(b)).Matches(labels.Set(GrabLabels(a))) {
		t.Error("the budget's selector selects the activity's pods")
	}
	if labels.SelectorFromSet(GrabSelector(a)).Matches(labels.Set(BudgetLabels(b))) {
		t.Error("the activity's selector selects the budget's pods")
	}
}

// The Redis Secret holds the login; the sender Secret a fresh 32-byte token.
func TestBudgetSecrets(t *testing.T) {
	b := testBudget()
	login := RedisLogin{Addresses: []string{"a:1", "b:2"}, Mode: "cluster", Username: "rpb-buid-1", Password: "pw"}
	ac := BudgetRedisSecret(b, login)
	checkBudgetMeta(t, b, "Secret", "shop-grab-redis", ac)
	if s := sent[corev1.Secret](t, ac); !maps.EqualFunc(s.Data, login.SecretData(), slices.Equal) {
		t.Errorf("data %q, want %q", s.Data, login.SecretData())
	}

	t1, err := NewSenderToken()
	if err != nil {
		t.Fatal(err)
	}
	t2, _ := NewSenderToken()
	raw, err := base64.RawURLEncoding.DecodeString(t1)
	if err != nil || len(raw) != 32 || t1 == t2 || len(t1) != 43 {
		t.Errorf("tokens %q %q: want distinct unpadded base64url of 32 bytes (%v)", t1, t2, err)
	}
	s := BudgetSenderSecret(b, t1)
	if s.Name != "shop-sender" || s.Namespace != "ns" || string(s.Data["token"]) != t1 || !metav1.IsControlledBy(s, b) {
		t.Errorf("sender secret %+v", s)
	}
}

// A grab pod template names the function library its pods call when they run the
// operator's image, for both kinds, and names none for a custom image, whose library
// nobody can name (the function keeper then retires no library).
func TestGrabPodTemplateNamesItsFunctionLibrary(t *testing.T) {
	const image, library = "operator/grab:1", "rpa_0123abcd"
	for _, tc := range []struct {
		name   string
		custom string
		want   string
	}{
		{"the operator's image", "", library},
		{"the operator's image named in the spec", image, library},
		{"a custom image", "custom/grab:9", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := testBudget(func(b *redpacketv1alpha1.RedPacketBudget) { b.Spec.GrabService.Image = tc.custom })
			d := sent[appsv1.Deployment](t, BudgetGrabDeployment(BudgetGrab{Budget: b, OperatorImage: image, OperatorLibrary: library}))
			if got := d.Spec.Template.Annotations[AnnotationFunctionLibrary]; got != tc.want {
				t.Errorf("budget: library %q, want %q", got, tc.want)
			}
			a := testActivity(func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.GrabService.Image = tc.custom })
			d = sent[appsv1.Deployment](t, GrabDeployment(Grab{Activity: a, OperatorImage: image, OperatorLibrary: library}))
			if got := d.Spec.Template.Annotations[AnnotationFunctionLibrary]; got != tc.want {
				t.Errorf("activity: library %q, want %q", got, tc.want)
			}
		})
	}
}
