package controllers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// The operator's policy and the activity's own Redis user in the grab workload,
// redis user and Redis connection steps, against the fakes. The fake store manages users by
// logging "users.EnsureUser <password>" and "users.DeleteUser"; its fail map makes
// them fail.

// UserName is the activity's user name, as the real handle names it.
func (f *fakeStore) UserName() string { return store.NewActivity(nil, string(f.uid), 1).UserName() }

func (f *fakeStore) EnsureUser(_ context.Context, password string) (store.UserChange, error) {
	f.log.add("users.EnsureUser %s", password)
	if err := f.err("EnsureUser"); err != nil {
		return store.UserChange{}, err
	}
	return store.UserChange{Nodes: 1}, nil
}

func (f *fakeStore) DeleteUser(context.Context) (int, error) {
	f.log.add("users.DeleteUser")
	if err := f.err("DeleteUser"); err != nil {
		return 0, err
	}
	return 1, nil
}

var _ redisUsers = (*fakeStore)(nil)

// ownedRedisSecret is quiz-grab-redis, controlled by the activity, with data.
func ownedRedisSecret(a *redpacketv1alpha1.RedPacketActivity, data map[string]string) *corev1.Secret {
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "quiz-grab-redis", Namespace: a.Namespace,
		OwnerReferences: []metav1.OwnerReference{{APIVersion: redpacketv1alpha1.GroupVersion.String(), Kind: "RedPacketActivity",
			Name: a.Name, UID: a.UID, Controller: ptrTo(true)}}}, Data: map[string][]byte{}}
	for k, v := range data {
		s.Data[k] = []byte(v)
	}
	return s
}

// ownGrabWorkload runs the grab workload ownership step on a scope of a, which must
// find the workload the activity's to touch.
func (p *phaseTest) ownGrabWorkload(t *testing.T, a *redpacketv1alpha1.RedPacketActivity) *activityScope {
	t.Helper()
	s := p.scope(a)
	if res, err := p.r.reconcileGrabOwnership(context.Background(), s); err != nil || res.blocker != nil || !s.grabOwned {
		t.Fatalf("ownership step: %+v, %v, owned %t (%s)", res, err, s.grabOwned, s.notAdopted)
	}
	return s
}

func TestRedisUserStepGivesTheActivityItsOwnUser(t *testing.T) {
	const keptPassword = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	cases := []struct {
		name         string
		existing     map[string]string
		wantPassword string // "" means a new random one
	}{
		{name: "no Secret yet (or deleted to rotate): a new password"},
		{name: "the Secret of the activity's user: its password is kept, the Secret unchanged",
			existing: map[string]string{"username": "rpa-uid-1", "password": keptPassword, "addresses": "redis.test:6379",
				"mode": "standalone", "tls": "true"}, wantPassword: keptPassword},
		{name: "the Secret of the activity's user, the default Redis moved: its password is kept",
			existing:     map[string]string{"username": "rpa-uid-1", "password": keptPassword, "addresses": "redis-old.test:6379"},
			wantPassword: keptPassword},
		{name: "an older operator's copy of its own credentials: replaced",
			existing: map[string]string{"username": "", "password": "operator-pw"}},
		{name: "a short password: replaced",
			existing: map[string]string{"username": "rpa-uid-1", "password": "short"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			objs := []client.Object{a.DeepCopy()}
			if tc.existing != nil {
				objs = append(objs, ownedRedisSecret(a, tc.existing))
			}
			p := newPhaseTest(t, openSnapshot(), objs...)
			p.r.DefaultRedis = redisconn.Conn{Addresses: []string{"redis.test:6379"}, Password: "operator-pw", TLS: true}
			ctx := context.Background()
			key := client.ObjectKey{Namespace: "default", Name: "quiz-grab-redis"}
			before := &corev1.Secret{}
			_ = p.client.Get(ctx, key, before)

			s := p.ownGrabWorkload(t, a)
			res, err := p.r.reconcileRedisUser(ctx, s)
			if err != nil || res.blocker != nil || res.halt || !s.grabRedisSettled || s.defaultRedisLogin == nil {
				t.Fatalf("redis user step: %+v, %v, settled %t", res, err, s.grabRedisSettled)
			}
			secret := &corev1.Secret{}
			if err := p.client.Get(ctx, key, secret); err != nil {
				t.Fatal(err)
			}
			conn, err := redisconn.ConnFromSecret(secret.Data)
			if err != nil {
				t.Fatal(err)
			}
			if conn.Username != "rpa-uid-1" || conn.Addresses[0] != "redis.test:6379" || conn.Mode != redisconn.ModeStandalone || !conn.TLS {
				t.Errorf("connection in the Secret %+v, want the default Redis with the activity's user", conn)
			}
			if conn.Password == "operator-pw" || len(conn.Password) != 64 {
				t.Errorf("password %q, want 64 hex characters that are not the operator's", conn.Password)
			}
			if tc.wantPassword != "" && conn.Password != tc.wantPassword {
				t.Errorf("password %q, want the Secret's %q", conn.Password, tc.wantPassword)
			}
			if tc.wantPassword == "" && tc.existing != nil && conn.Password == tc.existing["password"] {
				t.Errorf("password kept, want a new one")
			}
			if unchanged := secret.ResourceVersion == before.ResourceVersion; unchanged != (len(tc.existing) == 5 && tc.wantPassword != "") {
				t.Errorf("Secret written: %t (resourceVersion %s, was %s); only a Secret that already holds the login is left as it is",
					!unchanged, secret.ResourceVersion, before.ResourceVersion)
			}
			if got := p.log.with("users."); len(got) != 1 || got[0] != "users.EnsureUser "+conn.Password {
				t.Errorf("user calls %q, want EnsureUser with the Secret's password", got)
			}
			if got := s.defaultRedisLogin.Password; got != conn.Password {
				t.Errorf("the scope's login has password %q, the Secret %q", got, conn.Password)
			}

			if res, err := p.r.reconcileGrabWorkload(ctx, s); err != nil || res.blocker != nil {
				t.Fatalf("workload step: %+v, %v", res, err)
			}
			d := &appsv1.Deployment{}
			if err := p.client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "quiz-grab"}, d); err != nil {
				t.Fatal(err)
			}
			if got := d.Spec.Template.Annotations[specs.AnnotationRedisCredentials]; got != specs.RedisCredentialsDigest(secret.Data) || len(got) != 16 {
				t.Errorf("pod template annotation %q, want the digest of the Secret's credentials", got)
			}
		})
	}
}

func TestRedisUserStepWithoutRedisACL(t *testing.T) {
	aclErr := fmt.Errorf("ensuring Redis user rpa-uid-1: %w", store.ErrACLUnavailable)
	cases := []struct {
		name        string
		fail        error
		existing    map[string]string
		wantBlocker string
		wantHalt    bool
		wantErr     bool
		wantSecret  bool
	}{
		{name: "no ACL: refused, the operator's copied credentials are deleted", fail: aclErr,
			existing:    map[string]string{"username": "ops", "password": "operator-pw"},
			wantBlocker: redpacketv1alpha1.ReasonRedisACLUnavailable},
		{name: "no ACL: a Secret with other credentials stays", fail: aclErr,
			existing:    map[string]string{"username": "rpa-uid-1", "password": "something-else"},
			wantBlocker: redpacketv1alpha1.ReasonRedisACLUnavailable, wantSecret: true},
		{name: "Redis down: retried", fail: errors.New("timed out"),
			wantBlocker: redpacketv1alpha1.ReasonRedisUnavailable, wantHalt: true, wantErr: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			objs := []client.Object{a.DeepCopy()}
			if tc.existing != nil {
				objs = append(objs, ownedRedisSecret(a, tc.existing))
			}
			p := newPhaseTest(t, openSnapshot(), objs...)
			p.r.DefaultRedis = redisconn.Conn{Addresses: []string{"redis.test:6379"}, Username: "ops", Password: "operator-pw"}
			p.store.fail = map[string]error{"EnsureUser": tc.fail}
			ctx := context.Background()
			s := p.ownGrabWorkload(t, a)
			res, err := p.r.reconcileRedisUser(ctx, s)
			if (err != nil) != tc.wantErr || blockerReason(res) != tc.wantBlocker || res.halt != tc.wantHalt || s.grabRedisSettled {
				t.Fatalf("redis user step: %+v (blocker %q), %v, settled %t", res, blockerReason(res), err, s.grabRedisSettled)
			}
			if res, err := p.r.reconcileGrabWorkload(ctx, s); err != nil || res != (stepResult{}) || s.status.Endpoint != "" {
				t.Errorf("workload step without the activity's Redis user: %+v, %v, endpoint %q", res, err, s.status.Endpoint)
			}
			if tc.wantBlocker == redpacketv1alpha1.ReasonRedisACLUnavailable && !strings.Contains(res.blocker.message, "Redis 6") {
				t.Errorf("message %q does not say what is needed", res.blocker.message)
			}
			for _, obj := range []client.Object{&appsv1.Deployment{}, &corev1.Service{}} {
				if err := p.client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "quiz-grab"}, obj); err == nil {
					t.Errorf("%T applied without the activity's own Redis user", obj)
				}
			}
			err = p.client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "quiz-grab-redis"}, &corev1.Secret{})
			if (err == nil) != tc.wantSecret {
				t.Errorf("Secret quiz-grab-redis exists: %t, want %t", err == nil, tc.wantSecret)
			}
		})
	}
}

func TestGrabWorkloadStepsRefuseAnotherImage(t *testing.T) {
	cases := []struct {
		name      string
		image     string
		allow     bool
		wantImage string // "" means refused: nothing applied
	}{
		{name: "another image, not allowed", image: "example.test/grab:evil"},
		{name: "another image, allowed", image: "example.test/grab:2", allow: true, wantImage: "example.test/grab:2"},
		{name: "the operator's own image named", image: "operator/grab:1", wantImage: "operator/grab:1"},
		{name: "no image", wantImage: "operator/grab:1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity(func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.GrabService.Image = tc.image })
			p := newPhaseTest(t, openSnapshot(), a.DeepCopy())
			p.r.Options.GrabImage = "operator/grab:1"
			p.r.Options.AllowGrabImageOverride = tc.allow
			s := p.scope(a)
			ctx := context.Background()
			if err := p.runGrabWorkloadSteps(t, s); err != nil || s.halted {
				t.Fatalf("workload steps: halted %t, %v", s.halted, err)
			}
			res := stepResult{blocker: s.notReady}
			d := &appsv1.Deployment{}
			getErr := p.client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "quiz-grab"}, d)
			if tc.wantImage == "" {
				if blockerReason(res) != redpacketv1alpha1.ReasonGrabImageNotAllowed || !strings.Contains(res.blocker.message, tc.image) {
					t.Errorf("blocker %+v, want GrabImageNotAllowed naming the image", res.blocker)
				}
				if getErr == nil || s.workloadChecked || len(p.log.with("users.")) != 0 {
					t.Errorf("a refused image changed the workload: deployment %v, checked %t, user calls %q",
						getErr, s.workloadChecked, p.log.with("users."))
				}
				return
			}
			if res.blocker != nil || getErr != nil || d.Spec.Template.Spec.Containers[0].Image != tc.wantImage {
				t.Errorf("blocker %+v, deployment %v with image %q, want %q", res.blocker, getErr, imageOf(d), tc.wantImage)
			}
		})
	}
}

func imageOf(d *appsv1.Deployment) string {
	if len(d.Spec.Template.Spec.Containers) == 0 {
		return ""
	}
	return d.Spec.Template.Spec.Containers[0].Image
}

// An activity that moves to its own Redis loses its user on the default Redis.
func TestRedisUserStepDropsTheUserWhenSpecRedisIsSet(t *testing.T) {
	a := testActivity(func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Redis = &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: "redis-conn"}}
	})
	p := newPhaseTest(t, openSnapshot(), a.DeepCopy(), ownedRedisSecret(a, map[string]string{"username": "rpa-uid-1", "password": "x"}))
	ctx := context.Background()
	s := p.scope(a)
	if err := p.runGrabWorkloadSteps(t, s); err != nil || s.notReady != nil {
		t.Fatalf("workload steps: blocker %+v, %v", s.notReady, err)
	}
	if s.status.Endpoint == "" {
		t.Error("no endpoint: the workload was not applied after the user was dropped")
	}
	if got := p.log.with("users."); len(got) != 1 || got[0] != "users.DeleteUser" {
		t.Errorf("user calls %q, want DeleteUser", got)
	}
	if err := p.client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "quiz-grab-redis"}, &corev1.Secret{}); err == nil {
		t.Error("the Secret with the activity's user on the default Redis is still there")
	}
}

// An address the operator does not allow is refused before the store is made, so
// nothing dials it.
func TestRedisConnectionStepRefusesAddressesNotAllowed(t *testing.T) {
	cases := []struct {
		name        string
		addresses   string
		allowed     string
		wantBlocker string
	}{
		{name: "the default Redis's own address", addresses: "redis.test:6379"},
		{name: "the default Redis's host on another port", addresses: "redis.test:6380", wantBlocker: redpacketv1alpha1.ReasonRedisNotAllowed},
		{name: "any other host", addresses: "10.1.2.3:6379", wantBlocker: redpacketv1alpha1.ReasonRedisNotAllowed},
		{name: "an allowed network", addresses: "10.1.2.3:6379", allowed: "10.1.0.0/16"},
		{name: "one of two cluster seeds outside the network", addresses: "10.1.2.3:6379,10.2.0.1:6379", allowed: "10.1.0.0/16",
			wantBlocker: redpacketv1alpha1.ReasonRedisNotAllowed},
		{name: "an allowed host name, any port", addresses: "Redis.Team-A.svc:7000", allowed: "redis.team-a.svc"},
		{name: "a name is not its address", addresses: "10.9.9.9:6379", allowed: "redis.team-a.svc",
			wantBlocker: redpacketv1alpha1.ReasonRedisNotAllowed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity(func(a *redpacketv1alpha1.RedPacketActivity) {
				a.Spec.Redis = &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: "redis-conn"}}
			})
			secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "redis-conn", Namespace: "default"},
				Data: map[string][]byte{"addresses": []byte(tc.addresses), "mode": []byte(redisconn.ModeCluster)}}
			p := newPhaseTest(t, openSnapshot(), secret)
			p.r.AllowedHosts = MustParseRedisHosts(tc.allowed)
			made := 0
			inner := p.r.newStore
			p.r.newStore = func(c redisconn.Conn, uid types.UID) activityStore { made++; return inner(c, uid) }
			res, err := p.r.reconcileRedisConnection(context.Background(), newActivityScope(a, testNow))
			if blockerReason(res) != tc.wantBlocker {
				t.Fatalf("blocker %q (%v), want %q", blockerReason(res), err, tc.wantBlocker)
			}
			if tc.wantBlocker == "" {
				if err != nil || made != 1 {
					t.Errorf("allowed: %v, %d stores made", err, made)
				}
				return
			}
			if err == nil || !res.halt || made != 0 || len(p.log.with("store.")) != 0 {
				t.Errorf("refused: err %v, halt %t, %d stores made, calls %q", err, res.halt, made, p.log.with("store."))
			}
			if !strings.Contains(res.blocker.message, "--allowed-redis-hosts") {
				t.Errorf("message %q does not name the flag", res.blocker.message)
			}
		})
	}
}

func TestParseRedisHosts(t *testing.T) {
	h, err := ParseRedisHosts(" redis.Team-A.svc. , 10.0.3.7,10.1.0.0/16 ,fd00::/8,, ::ffff:192.0.2.1")
	if err != nil {
		t.Fatal(err)
	}
	if got := h.String(); got != "redis.team-a.svc,10.0.3.7,10.1.0.0/16,fd00::/8,192.0.2.1" {
		t.Errorf("String %q", got)
	}
	for host, want := range map[string]bool{
		"redis.team-a.svc": true, "REDIS.team-a.svc.": true, "redis.team-b.svc": false, "10.0.3.7": true, "10.0.3.8": false,
		"10.1.255.1": true, "10.2.0.1": false, "fd00::1": true, "fe80::1": false, "192.0.2.1": true, "::ffff:10.1.0.5": true,
	} {
		if got := h.allows(host); got != want {
			t.Errorf("allows(%q) = %t, want %t", host, got, want)
		}
	}
	for _, bad := range []string{"redis:6379", "10.0.0.0/33", "under_score", "http://redis", "a b"} {
		if _, err := ParseRedisHosts(bad); err == nil {
			t.Errorf("ParseRedisHosts(%q) accepted it", bad)
		}
	}
	var none RedisHosts
	if none.allows("127.0.0.1") || none.allows("localhost") || none.String() != "" {
		t.Error("the zero RedisHosts allows something")
	}
}
