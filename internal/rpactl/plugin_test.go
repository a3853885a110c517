package rpactl_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/internal/rpactl"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// world is a real kube-apiserver + etcd, a real redis-server, the real controller
// (in this process) and one activity's real grab service (in this process, on an
// httptest server), with a kubeconfig for the plugin.
type world struct {
	t          *testing.T
	cp         *controlplane.ControlPlane
	ns         string
	kubeconfig string
	redis      *redistest.Server
	rdb        *redis.Client
}

// tokenKey is the HMAC key of user tokens; the Secret holds it with a trailing
// newline, as `kubectl create secret --from-file` of a file ending in one does.
var tokenKey = []byte("plugin-test-token-key")

func newWorld(t *testing.T) *world {
	t.Helper()
	if testing.Short() {
		t.Skip("needs kube-apiserver, etcd and redis-server; run without -short")
	}
	cp := controlplane.Start(t)
	w := &world{t: t, cp: cp, ns: cp.Namespace(t), kubeconfig: filepath.Join(t.TempDir(), "kubeconfig")}
	if err := cp.Kubeconfig(w.kubeconfig); err != nil {
		t.Fatal(err)
	}
	w.redis = redistest.Start(t)
	w.rdb = w.redis.Client(t)
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "grab-hmac"},
		Data: map[string][]byte{"key": append(append([]byte{}, tokenKey...), '\n')}}
	if err := cp.Client.Create(t.Context(), secret); err != nil {
		t.Fatal(err)
	}
	return w
}

// startController runs the reconciler for the world's namespace with the world's
// Redis as the operator's default, until the test ends.
func (w *world) startController() {
	w.t.Helper()
	grace := 10 * time.Second
	mgr, err := ctrl.NewManager(w.cp.Config, ctrl.Options{
		Scheme:                  w.cp.Scheme,
		Metrics:                 metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress:  "0",
		Cache:                   controllers.CacheOptions(w.ns),
		GracefulShutdownTimeout: &grace,
	})
	if err != nil {
		w.t.Fatal(err)
	}
	r := &controllers.RedPacketActivityReconciler{Options: controllers.Options{
		DefaultRedis:        w.redis.Conn(),
		GrabImage:           "redpacket-operator:test",
		GrabReplicas:        1,
		CleanupGracePeriod:  time.Minute,
		GrabReportTimeout:   10 * time.Second,
		RedisTimeout:        3 * time.Second,
		ActiveResyncPeriod:  300 * time.Millisecond,
		CleanupPollInterval: 200 * time.Millisecond,
		MaxBackoff:          time.Second,
		Name:                "rpactl-" + w.ns,
		SkipNameValidation:  true,
	}}
	if err := r.SetupWithManager(mgr); err != nil {
		w.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	w.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			w.t.Errorf("manager: %v", err)
		}
	})
}

// startGrabService serves the activity's grab API as its grab pods do: it follows
// the resource, checks tokens with the key in the Secret and reports the counters
// into the status. It returns the base URL.
func (w *world) startGrabService(name string) string {
	w.t.Helper()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	source := &grabsvc.ActivitySource{Client: w.cp.Client, Key: types.NamespacedName{Namespace: w.ns, Name: name},
		Refresh: 200 * time.Millisecond, Retry: 100 * time.Millisecond, Log: log}
	tokens, err := grabsvc.NewTokenVerifier(tokenKey)
	if err != nil {
		w.t.Fatal(err)
	}
	srv, err := grabsvc.NewServer(grabsvc.Config{Redis: w.rdb, Ping: w.rdb, Resource: source.Current, Tokens: tokens, Log: log})
	if err != nil {
		w.t.Fatal(err)
	}
	reporter := &grabsvc.Reporter{Client: w.cp.Client, Redis: w.rdb, Resource: source.Current,
		Interval: 200 * time.Millisecond, Heartbeat: time.Second, Log: log}
	ctx, cancel := context.WithCancel(context.Background())
	go source.Run(ctx)
	go reporter.Run(ctx)
	hs := httptest.NewServer(srv.Handler())
	w.t.Cleanup(func() {
		cancel()
		hs.Close()
	})
	return hs.URL
}

// run runs the plugin with args against the world's API server, in its namespace.
func (w *world) run(args ...string) (string, error) {
	w.t.Helper()
	var out, errOut bytes.Buffer
	cmd := rpactl.NewCommand(rpactl.Streams{In: strings.NewReader(""), Out: &out, ErrOut: &errOut})
	cmd.SetArgs(append([]string{"--kubeconfig", w.kubeconfig, "-n", w.ns}, args...))
	ctx, cancel := context.WithTimeout(w.t.Context(), 3*time.Minute)
	defer cancel()
	err := cmd.ExecuteContext(ctx)
	w.t.Logf("kubectl rpa %s\n%s%s(error: %v)", strings.Join(args, " "), out.String(), errOut.String(), err)
	return out.String(), err
}

// mustRun is run that fails the test when the plugin fails.
func (w *world) mustRun(args ...string) string {
	w.t.Helper()
	out, err := w.run(args...)
	if err != nil {
		w.t.Fatalf("kubectl rpa %s: %v", strings.Join(args, " "), err)
	}
	return out
}

func (w *world) activity(name string) *redpacketv1alpha1.RedPacketActivity {
	w.t.Helper()
	a := &redpacketv1alpha1.RedPacketActivity{}
	if err := w.cp.Client.Get(w.t.Context(), client.ObjectKey{Namespace: w.ns, Name: name}, a); err != nil {
		w.t.Fatal(err)
	}
	return a
}

func (w *world) waitPhase(name string, phase redpacketv1alpha1.Phase) {
	w.t.Helper()
	wait.Until(w.t, 30*time.Second, fmt.Sprintf("%s to be %s", name, phase), func() (bool, string) {
		a := w.activity(name)
		return a.Status.Phase == phase && a.Status.ObservedGeneration == a.Generation, string(a.Status.Phase)
	})
}

// grab posts one grab with a bearer token and returns the HTTP status and outcome.
func grab(t *testing.T, base, user, token string) (int, string) {
	t.Helper()
	return postGrab(t, base+"/v1/grab", user, token)
}

// postGrab posts a grab by user to url with a bearer token and returns the HTTP
// status and the outcome, or the error code of a refusal.
func postGrab(t *testing.T, url, user, token string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"userId":"`+user+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Outcome string `json:"outcome"`
		Error   string `json:"error"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatal(err)
	}
	if body.Outcome == "" {
		return resp.StatusCode, body.Error
	}
	return resp.StatusCode, body.Outcome
}

// fieldsOf returns the fields of the line of out that starts with key.
func fieldsOf(t *testing.T, out, key string) []string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[0] == key {
			return f
		}
	}
	t.Fatalf("no line starts with %q in\n%s", key, out)
	return nil
}

// TestPluginAgainstTheAPIServer runs the plugin's commands for real: against a real
// kube-apiserver with the real controller and grab service over a real Redis. status
// prints what the resource says, pause and resume patch spec.paused and the grab
// service follows, token mints tokens the grab service accepts, rain grabs through
// the service and checks the invariants, and replay-dead-letters moves parked
// entries back with the activity's Redis given by flags.
func TestPluginAgainstTheAPIServer(t *testing.T) {
	w := newWorld(t)
	w.startController()
	const name, total, count = "quiz", int64(10000), int64(100)
	a := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: name},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			TotalAmount: total, Count: count, Currency: "CNY", Sponsor: "merchant-1",
			Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionRandom, MinAmount: 1},
			GrabService: redpacketv1alpha1.GrabService{Auth: &redpacketv1alpha1.GrabAuth{
				TokenSecretRef: redpacketv1alpha1.SecretReference{Name: "grab-hmac"}}},
		},
	}
	if err := w.cp.Client.Create(t.Context(), a); err != nil {
		t.Fatal(err)
	}
	base := w.startGrabService(name)
	w.waitPhase(name, redpacketv1alpha1.PhaseActive)

	// status: the money table of a fresh activity, and its conditions.
	wait.Until(t, 30*time.Second, "Ready=True", func() (bool, string) {
		a := w.activity(name)
		c := meta.FindStatusCondition(a.Status.Conditions, redpacketv1alpha1.ConditionReady)
		return c != nil && c.Status == metav1.ConditionTrue && a.Status.LastReportTime != nil, fmt.Sprint(c)
	})
	out := w.mustRun("status", name)
	for key, want := range map[string]string{
		"Phase:":     "Phase: Active",
		"total":      "total 100 10000 100.00 CNY",
		"claimed":    "claimed 0 0 0.00 CNY",
		"remaining":  "remaining 100 10000 100.00 CNY",
		"Invariant:": "Invariant: OK: claimed + remaining + refunded = 0 + 10000 + 0 = 10000, total 10000",
		"Seeded":     "Seeded True",
		"Ready":      "Ready True Active",
	} {
		if got := strings.Join(fieldsOf(t, out, key), " "); !strings.HasPrefix(got, want) {
			t.Errorf("status: %q, want %q…", got, want)
		}
	}

	// token: the grab service takes it for that user in that activity, and no other.
	tok := strings.TrimSpace(w.mustRun("token", name, "u-1", "--ttl", "10m"))
	verifier, err := grabsvc.NewTokenVerifier(tokenKey)
	if err != nil {
		t.Fatal(err)
	}
	aud := grabsvc.AudienceOf(grabsvc.NewResource(w.activity(name)))
	if err := verifier.Verify("Bearer "+tok, aud, "u-1"); err != nil {
		t.Fatalf("the minted token does not verify: %v", err)
	}
	if err := verifier.Verify("Bearer "+tok, aud, "u-2"); err == nil {
		t.Fatal("the token of u-1 verifies for u-2")
	}
	if code, outcome := grab(t, base, "u-1", tok); code != http.StatusOK || outcome != "granted" {
		t.Fatalf("grab with the minted token: %d %s", code, outcome)
	}
	if code, outcome := grab(t, base, "u-2", tok); code != http.StatusUnauthorized {
		t.Fatalf("grab by u-2 with u-1's token: %d %s", code, outcome)
	}
	for _, args := range [][]string{
		{"token", name, "u-1", "--ttl", "0s"},
		{"token", name, "u-1", "--ttl", "25h"},
		{"token", name, strings.Repeat("x", 129)},
		{"token", "nope", "u-1"},
	} {
		if out, err := w.run(args...); err == nil || out != "" {
			t.Errorf("kubectl rpa %v: printed %q, error %v; want an error and no token", args, out, err)
		}
	}

	// pause: spec.paused is set, the controller pauses the activity in Redis and the
	// grab service answers paused; pausing again changes nothing.
	if out := w.mustRun("pause", name); out != "redpacketactivity.redpacket.io/quiz paused\n" {
		t.Errorf("pause printed %q", out)
	}
	if !w.activity(name).Spec.Paused {
		t.Fatal("spec.paused is not true after pause")
	}
	w.waitPhase(name, redpacketv1alpha1.PhasePaused)
	tok2 := strings.TrimSpace(w.mustRun("token", name, "u-2"))
	wait.Until(t, 10*time.Second, "the grab service to answer paused", func() (bool, string) {
		code, outcome := grab(t, base, "u-2", tok2)
		return code == http.StatusConflict && outcome == "paused", fmt.Sprint(code, " ", outcome)
	})
	if out := w.mustRun("pause", name); !strings.Contains(out, "unchanged (already paused)") {
		t.Errorf("pausing twice printed %q", out)
	}
	if out, err := w.run("rain", name, "--users", "10", "--url", base); err == nil || !strings.Contains(err.Error(), "is Paused") {
		t.Errorf("rain on a paused activity: %q, %v; want a refusal", out, err)
	}

	// resume: grabbing opens again.
	if out := w.mustRun("resume", name); out != "redpacketactivity.redpacket.io/quiz resumed\n" {
		t.Errorf("resume printed %q", out)
	}
	if w.activity(name).Spec.Paused {
		t.Fatal("spec.paused is still true after resume")
	}
	w.waitPhase(name, redpacketv1alpha1.PhaseActive)
	wait.Until(t, 10*time.Second, "the grab service to grant again", func() (bool, string) {
		code, outcome := grab(t, base, "u-2", tok2)
		return code == http.StatusOK && outcome == "granted", fmt.Sprint(code, " ", outcome)
	})

	// rain: 150 users for the 98 packets left, with tokens minted from the Secret; every
	// check passes and the activity is exhausted.
	out, err = w.run("rain", name, "--users", "150", "--connections", "8", "--url", base, "--user-prefix", "rehearsal")
	if err != nil {
		t.Fatalf("rain: %v", err)
	}
	if got := fieldsOf(t, out, "granted"); strings.Join(got, " ") != "granted 98" {
		t.Errorf("rain outcomes: %q, want 98 granted", got)
	}
	if got := fieldsOf(t, out, "sold_out"); strings.Join(got, " ") != "sold_out 52" {
		t.Errorf("rain outcomes: %q, want 52 sold out", got)
	}
	for _, check := range []string{"every user got an answer", "no packet granted twice", "every retry got the same answer",
		"the status counts every grant", "claimed + remaining + refunded = total"} {
		if !strings.Contains(out, check) {
			t.Errorf("rain does not report the check %q", check)
		}
	}
	if strings.Contains(out, "FAILED") {
		t.Errorf("a rain check failed:\n%s", out)
	}
	w.waitPhase(name, redpacketv1alpha1.PhaseExhausted)
	out = w.mustRun("status", name)
	for key, want := range map[string]string{
		"claimed":    fmt.Sprintf("claimed 100 %d", total),
		"remaining":  "remaining 0 0",
		"Invariant:": "Invariant: OK:",
		"Phase:":     "Phase: Exhausted",
	} {
		if got := strings.Join(fieldsOf(t, out, key), " "); !strings.HasPrefix(got, want) {
			t.Errorf("status after the rain: %q, want %q…", got, want)
		}
	}
	if _, err := w.run("rain", name, "--users", "10", "--url", base); err == nil || !strings.Contains(err.Error(), "is Exhausted") {
		t.Errorf("rain on an exhausted activity: %v; want a refusal", err)
	}

	// replay-dead-letters: three grants parked as a settlement worker parks them.
	shard := store.NewActivity(w.rdb, string(w.activity(name).UID), 1).Shard(0)
	keys := shard.Keys()
	ctx := t.Context()
	if err := w.rdb.XGroupCreateMkStream(ctx, keys.Stream, "plugin-test", "0").Err(); err != nil {
		t.Fatal(err)
	}
	read, err := w.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "plugin-test", Consumer: "c", Streams: []string{keys.Stream, ">"}, Count: 3}).Result()
	if err != nil || len(read) != 1 || len(read[0].Messages) != 3 {
		t.Fatalf("reading three grants: %v %v", read, err)
	}
	for _, m := range read[0].Messages {
		if ok, err := shard.DeadLetter(ctx, "plugin-test", m.ID, "HTTP 400", m.Values); err != nil || !ok {
			t.Fatalf("dead-lettering %s: %v %v", m.ID, ok, err)
		}
	}
	streamLen := w.rdb.XLen(ctx, keys.Stream).Val()

	// The operator's default Redis is not something the plugin can see: it says so.
	if _, err := w.run("replay-dead-letters", name); err == nil || !strings.Contains(err.Error(), "--redis-addr") {
		t.Errorf("replay without a Redis: %v; want an error naming --redis-addr", err)
	}
	// Without spec.redis and --redis-secret, the operator's credentials come from
	// REDIS_USERNAME and REDIS_PASSWORD, as docs/kubectl-rpa.md sets them: the test's
	// Redis, like the dev Redis, refuses the default user.
	t.Setenv("REDIS_USERNAME", w.redis.Username)
	t.Setenv("REDIS_PASSWORD", w.redis.Password)
	// Another Redis (with the same admin user and password) does not hold the
	// activity: refused, nothing moved.
	other, _ := redistest.StartProtected(t, w.redis.Password)
	if _, err := w.run("replay-dead-letters", name, "--redis-addr", other.Addr); err == nil || !strings.Contains(err.Error(), "no data of activity") {
		t.Errorf("replay against another Redis: %v; want a refusal", err)
	}
	if out := w.mustRun("replay-dead-letters", name, "--redis-addr", w.redis.Addr, "--max", "2"); !strings.Contains(out, "moved 2 of 3 dead letters") {
		t.Errorf("replay --max 2 printed %q", out)
	}
	// A connection Secret whose addresses are cluster-internal, dialled at --redis-addr.
	conn := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "redis-conn"},
		StringData: map[string]string{"addresses": "redis.redpacket-system.svc:6379", "mode": "standalone",
			"username": w.redis.Username, "password": w.redis.Password}}
	if err := w.cp.Client.Create(ctx, conn); err != nil {
		t.Fatal(err)
	}
	if out := w.mustRun("replay-dead-letters", name, "--redis-secret", "redis-conn", "--redis-addr", w.redis.Addr); !strings.Contains(out, "moved 1 of 1 dead letters") {
		t.Errorf("replay through the Secret printed %q", out)
	}
	if n := w.rdb.XLen(ctx, keys.DeadLetters).Val(); n != 0 {
		t.Errorf("%d dead letters left after the replays", n)
	}
	if n := w.rdb.XLen(ctx, keys.Stream).Val(); n != streamLen+3 {
		t.Errorf("the stream holds %d entries after the replays, want %d", n, streamLen+3)
	}

	// An activity that does not exist is named in the error.
	if _, err := w.run("status", "nope"); err == nil || !strings.Contains(err.Error(), `"nope" not found`) {
		t.Errorf("status of a missing activity: %v", err)
	}
}
