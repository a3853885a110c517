package controllers_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// operatorRedisPassword is the password of the operator's Redis user (the server's
// admin user) in the tests of the activities' own Redis users: a known one, so the
// tests can look for it where it must not be.
const operatorRedisPassword = "operator-only-3f9c1e"

// newProtectedEnv is newEnv with a Redis whose admin user, the operator's, has
// operatorRedisPassword; e.rdb is logged in as the operator.
func newProtectedEnv(t *testing.T) *env {
	t.Helper()
	needsServers(t)
	srv, rdb := redistest.StartProtected(t, operatorRedisPassword)
	e := &env{t: t, ns: cp.Namespace(t), redis: srv, rdb: rdb, c: cp.Client}
	e.createSettlementKeys()
	return e
}

// startProtectedController runs the controller with the operator's password.
func (e *env) startProtectedController(configure func(r *controllers.RedPacketActivityReconciler)) {
	e.t.Helper()
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Options.DefaultRedis.Password = operatorRedisPassword
		if configure != nil {
			configure(r)
		}
	})
}

// grabRedisConn reads the connection in <name>-grab-redis, the grab pods' Secret.
func (e *env) grabRedisConn(name string) (redisconn.Conn, *corev1.Secret) {
	e.t.Helper()
	secret := &corev1.Secret{}
	if err := e.c.Get(context.Background(), client.ObjectKey{Namespace: e.ns, Name: name + "-grab-redis"}, secret); err != nil {
		e.t.Fatalf("the grab pods' Redis Secret of %s: %v", name, err)
	}
	conn, err := redisconn.ConnFromSecret(secret.Data)
	if err != nil {
		e.t.Fatalf("the grab pods' Redis Secret of %s: %v", name, err)
	}
	return conn, secret
}

// noOperatorPassword fails the test when any object of the namespace that a tenant
// may read carries the operator's Redis password.
func (e *env) noOperatorPassword() {
	e.t.Helper()
	ctx := context.Background()
	lists := []client.ObjectList{&corev1.SecretList{}, &corev1.ConfigMapList{}, &appsv1.DeploymentList{},
		&redpacketv1alpha1.RedPacketActivityList{}, &corev1.ServiceAccountList{}}
	for _, l := range lists {
		if err := e.c.List(ctx, l, client.InNamespace(e.ns)); err != nil {
			e.t.Fatal(err)
		}
		raw, err := json.Marshal(l)
		if err != nil {
			e.t.Fatal(err)
		}
		if strings.Contains(string(raw), operatorRedisPassword) {
			e.t.Errorf("a %T in the activity's namespace holds the operator's Redis password", l)
		}
	}
}

// The grab pods of an activity on the default Redis get a Redis user of their own:
// with it the grab service and its reporter do their work (the operator settles),
// and nothing else. The operator's password stays out of the namespace. Deleting
// the Secret rotates the password; deleting the activity removes the user.
func TestActivityGetsItsOwnRedisUser(t *testing.T) {
	t.Parallel()
	e := newProtectedEnv(t)
	ctx := context.Background()
	var delivered atomic.Int64
	balance := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if !strings.Contains(string(body), `"kind":"budget"`) {
			delivered.Add(1) // the grants; the budget goes first
		}
	}))
	t.Cleanup(balance.Close)
	e.allowWebhook(balance.URL)
	e.startProtectedController(func(r *controllers.RedPacketActivityReconciler) {
		r.Options.CleanupGracePeriod = 2 * time.Second
	})

	e.create(e.activity("alpha", 1000, 10, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Settlement = &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: balance.URL}, MaxAttempts: 3}
	}))
	e.create(e.activity("beta", 500, 5))
	alpha := e.waitPhase("alpha", redpacketv1alpha1.PhaseActive, 20*time.Second)
	beta := e.waitPhase("beta", redpacketv1alpha1.PhaseActive, 20*time.Second)

	conn, secret := e.grabRedisConn("alpha")
	if conn.Username != store.NewActivity(nil, string(alpha.UID), 1).UserName() || conn.Password == operatorRedisPassword ||
		len(conn.Password) != 64 || len(conn.Addresses) != 1 || conn.Addresses[0] != e.redis.Addr {
		t.Fatalf("the grab pods' connection: user %q, %d-character password, addresses %v; want the activity's own user on %s",
			conn.Username, len(conn.Password), conn.Addresses, e.redis.Addr)
	}
	e.noOperatorPassword()
	d := &appsv1.Deployment{}
	if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "alpha-grab"}, d); err != nil {
		t.Fatal(err)
	}
	digest := d.Spec.Template.Annotations[specs.AnnotationRedisCredentials]
	if digest == "" {
		t.Fatalf("the grab pods' template has no %s annotation", specs.AnnotationRedisCredentials)
	}

	// The grab service as its pods run it, on the Secret's credentials: grabs through
	// the HTTP API, readiness and the reporter's snapshots. The operator settles, on its
	// own user; a settlement worker on the activity's user is refused.
	pc, err := conn.NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pc.Close() })
	plain := conn.NewClient()
	t.Cleanup(func() { _ = plain.Close() })
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	t.Cleanup(func() { stop(); wg.Wait() })
	src := &grabsvc.ActivitySource{Client: e.c, Key: types.NamespacedName{Namespace: e.ns, Name: "alpha"}, UID: alpha.UID,
		Refresh: 200 * time.Millisecond, Retry: 100 * time.Millisecond}
	guard := &grabsvc.RollbackGuard{}
	grabSrv, err := grabsvc.NewServer(grabsvc.Config{Redis: pc.Pipeliner, Ping: pc.Client, Resource: src.Current, Guard: guard,
		RedisTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	rep := &grabsvc.Reporter{Client: e.c, Redis: pc.Pipeliner, Resource: src.Current, Guard: guard,
		Interval: 200 * time.Millisecond, Heartbeat: time.Second}
	if err := store.NewActivity(plain, string(alpha.UID), 1).Shard(0).EnsureGroup(ctx, "grab-pod-group"); err == nil ||
		!strings.Contains(err.Error(), "NOPERM") && !strings.Contains(err.Error(), "can't run this command") {
		t.Errorf("a consumer group on the activity's user: %v; want NOPERM (the operator settles)", err)
	}
	wg.Go(func() { src.Run(runCtx) })
	wg.Go(func() { rep.Run(runCtx) })
	api := httptest.NewServer(grabSrv.Handler())
	t.Cleanup(api.Close)

	wait.Until(t, 10*time.Second, "the grab service ready on the activity's own user", func() (bool, string) {
		resp, err := http.Get(api.URL + "/readyz")
		if err != nil {
			return false, err.Error()
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK, fmt.Sprintf("%d %s", resp.StatusCode, body)
	})
	for _, u := range []string{"u1", "u2"} {
		resp, err := http.Post(api.URL+"/v1/grab", "application/json", strings.NewReader(`{"userId":"`+u+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"granted"`) {
			t.Fatalf("grab for %s on the activity's own user: %d %s", u, resp.StatusCode, body)
		}
	}
	wait.Until(t, 10*time.Second, "the reporter's report and the settlement of both grants", func() (bool, string) {
		a := e.get("alpha")
		snap := e.snapshot(a)
		reported := a.Status.ClaimedCount != nil && *a.Status.ClaimedCount == 2 && a.Status.LastReportTime != nil
		return reported && snap.SettledCount == 2 && delivered.Load() == 2,
			fmt.Sprintf("reported %v, settled %d, delivered %d", a.Status.ClaimedCount, snap.SettledCount, delivered.Load())
	})

	// Another activity, and the server as a whole, are out of reach.
	if res, err := store.NewActivity(plain, string(beta.UID), 1).Shard(0).Grab(ctx, "thief"); err == nil || !strings.Contains(err.Error(), "NOPERM") {
		t.Errorf("grab of another activity with this activity's user: %+v, %v; want NOPERM", res, err)
	}
	for _, cmd := range [][]any{{"flushall"}, {"config", "get", "*"}, {"script", "flush"}, {"hgetall", e.keys(beta).Meta}} {
		if err := plain.Do(ctx, cmd...).Err(); err == nil || !strings.HasPrefix(err.Error(), "NOPERM") {
			t.Errorf("%v with the activity's user: %v; want NOPERM", cmd, err)
		}
	}
	if snap := e.snapshot(beta); snap.RemainingCount != 5 {
		t.Errorf("the other activity holds %d packets, want its 5", snap.RemainingCount)
	}

	// Deleting the Secret rotates the password: the old one stops working, also for
	// connections made with it, and the grab pods roll.
	stop()
	wg.Wait()
	if err := e.c.Delete(ctx, secret); err != nil {
		t.Fatal(err)
	}
	var rotated redisconn.Conn
	wait.Until(t, 15*time.Second, "a new Secret with a new password", func() (bool, string) {
		fresh := &corev1.Secret{}
		if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "alpha-grab-redis"}, fresh); err != nil {
			return false, err.Error()
		}
		c, err := redisconn.ConnFromSecret(fresh.Data)
		if err != nil {
			return false, err.Error()
		}
		rotated = c
		return fresh.UID != secret.UID && c.Password != conn.Password && c.Username == conn.Username, "same password"
	})
	if err := plain.Ping(ctx).Err(); err == nil {
		t.Error("a connection made with the old password still works after the rotation")
	}
	old := conn.NewClient(redisconn.ClientOptions{MaxRetries: -1})
	t.Cleanup(func() { _ = old.Close() })
	if err := old.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "WRONGPASS") {
		t.Errorf("logging in with the old password: %v, want WRONGPASS", err)
	}
	fresh := rotated.NewClient()
	t.Cleanup(func() { _ = fresh.Close() })
	if err := fresh.Ping(ctx).Err(); err != nil {
		t.Errorf("logging in with the new password: %v", err)
	}
	wait.Until(t, 10*time.Second, "the grab pods' template rolled", func() (bool, string) {
		if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "alpha-grab"}, d); err != nil {
			return false, err.Error()
		}
		got := d.Spec.Template.Annotations[specs.AnnotationRedisCredentials]
		return got != "" && got != digest, got
	})
	e.noOperatorPassword()

	// A deleted activity's user goes with its keys.
	betaUser := store.NewActivity(nil, string(beta.UID), 1).UserName()
	if err := e.rdb.Do(ctx, "acl", "getuser", betaUser).Err(); err != nil {
		t.Fatalf("the user of beta before its deletion: %v", err)
	}
	if err := e.c.Delete(ctx, e.get("beta")); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 20*time.Second, "beta gone", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "beta"}, &redpacketv1alpha1.RedPacketActivity{})
		return isNotFound(err), errString(err)
	})
	if err := e.rdb.Do(ctx, "acl", "getuser", betaUser).Err(); !errors.Is(err, redis.Nil) {
		t.Errorf("ACL GETUSER %s after the activity is gone: %v, want no such user", betaUser, err)
	}
	if err := e.rdb.Do(ctx, "acl", "getuser", store.NewActivity(nil, string(alpha.UID), 1).UserName()).Err(); err != nil {
		t.Errorf("the user of alpha, which still exists: %v", err)
	}
}

// A default Redis on which the operator's user may not manage users: the activity
// says so, and no grab workload (nor any copy of the operator's credentials) is made.
func TestActivityWithoutRedisACLPermission(t *testing.T) {
	t.Parallel()
	e := newProtectedEnv(t)
	ctx := context.Background()
	if err := e.rdb.Do(ctx, "acl", "setuser", "ops", "on", ">ops-pw-1234", "~*", "&*", "+@all", "-acl").Err(); err != nil {
		t.Fatal(err)
	}
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Options.DefaultRedis.Username, r.Options.DefaultRedis.Password = "ops", "ops-pw-1234"
	})
	e.create(e.activity("noacl", 1000, 10))
	a := e.waitCondition("noacl", redpacketv1alpha1.ConditionReady, "False", redpacketv1alpha1.ReasonRedisACLUnavailable, 20*time.Second)
	if a.Status.Phase != redpacketv1alpha1.PhaseActive {
		t.Errorf("phase %s, want Active: the packets are seeded and grabbing opens on schedule", a.Status.Phase)
	}
	e.waitEvent("noacl", "Warning", redpacketv1alpha1.ReasonRedisACLUnavailable)
	for _, obj := range []client.Object{&appsv1.Deployment{}, &corev1.Secret{}} {
		name := "noacl-grab"
		if _, ok := obj.(*corev1.Secret); ok {
			name = "noacl-grab-redis"
		}
		if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: name}, obj); !isNotFound(err) {
			t.Errorf("%T %s: %v, want none", obj, name, err)
		}
	}
	raw, err := json.Marshal(e.get("noacl"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(raw), "ops-pw-1234") {
		t.Error("the activity holds the operator's Redis password")
	}
}
