package packaging

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// devRedisSecret is the Secret the dev Redis makes the operator's user from and the
// install manifests give the operator: the docs create it before anything else.
const devRedisSecret = "redpacket-redis"

// container is the named container of the one Deployment among objs.
func container(t *testing.T, objs []*unstructured.Unstructured, name string) corev1.Container {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() != "Deployment" {
			continue
		}
		var d appsv1.Deployment
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &d); err != nil {
			t.Fatalf("%s: %v", key(o), err)
		}
		for _, c := range d.Spec.Template.Spec.Containers {
			if c.Name == name {
				return c
			}
		}
	}
	t.Fatalf("no Deployment has a container %q", name)
	return corev1.Container{}
}

// secretEnv is where c's variable name comes from: the Secret, the key and whether it
// is optional; empty, and an error of the test, unless the variable is read from a
// Secret.
func secretEnv(t *testing.T, c corev1.Container, name string) (secret, key string, optional bool) {
	t.Helper()
	for _, e := range c.Env {
		if e.Name != name {
			continue
		}
		if e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil {
			t.Errorf("container %s sets %s other than from a Secret: %+v", c.Name, name, e)
			return "", "", false
		}
		ref := e.ValueFrom.SecretKeyRef
		return ref.Name, ref.Key, ref.Optional != nil && *ref.Optional
	}
	t.Errorf("container %s has no variable %s", c.Name, name)
	return "", "", false
}

// expandArgs replaces $(NAME) in args with env's values, as the kubelet does with a
// container's arguments ($$ is a literal $). A reference to a variable env does not
// hold fails: the kubelet would leave it as it is, and the Redis would get the text.
func expandArgs(args []string, env map[string]string) ([]string, error) {
	out := make([]string, len(args))
	for i, a := range args {
		var b strings.Builder
		for j := 0; j < len(a); j++ {
			switch {
			case strings.HasPrefix(a[j:], "$$"):
				b.WriteByte('$')
				j++
			case strings.HasPrefix(a[j:], "$("):
				end := strings.IndexByte(a[j:], ')')
				if end < 0 {
					return nil, fmt.Errorf("argument %q: unterminated $(", a)
				}
				name := a[j+2 : j+end]
				v, ok := env[name]
				if !ok {
					return nil, fmt.Errorf("argument %q names $(%s), which the container does not set", a, name)
				}
				b.WriteString(v)
				j += end
			default:
				b.WriteByte(a[j])
			}
		}
		out[i] = b.String()
	}
	return out, nil
}

// freeLoopbackPort is a free TCP port on 127.0.0.1.
func freeLoopbackPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startDevRedis runs redis-server in dir on port with the arguments of
// config/dev-redis's container, the Secret's username and password put in as the
// kubelet puts them, and only the port, a loopback address (the manifest binds every
// address), the directory and the log file added after them (a later --port or --bind
// wins). It waits until the port answers and returns the address and the process,
// which the test's cleanup kills.
func startDevRedis(t *testing.T, args []string, dir string, port int) (string, *exec.Cmd) {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("redis-server is not installed: %v", err)
	}
	all := append(append([]string(nil), args...), "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--dir", dir, "--daemonize", "no", "--logfile", filepath.Join(dir, "redis.log"))
	cmd := exec.Command(bin, all...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = redistest.KillProcess(cmd) })
	addr := "127.0.0.1:" + strconv.Itoa(port)
	for deadline := time.Now().Add(10 * time.Second); ; {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			_ = c.Close()
			return addr, cmd
		}
		if time.Now().After(deadline) {
			t.Fatalf("redis-server with config/dev-redis's arguments did not listen on %s: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// refusedUnauthenticated checks that conn, not logged in, can run nothing: PING and a
// read of key get NOAUTH.
func refusedUnauthenticated(t *testing.T, ctx context.Context, conn *redis.Conn, after, key string) {
	t.Helper()
	if err := conn.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Errorf("PING %s: %v, want NOAUTH", after, err)
	}
	if v, err := conn.HGetAll(ctx, key).Result(); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Errorf("HGETALL %s %s: %v %v, want NOAUTH", key, after, v, err)
	}
}

// The development Redis, run with exactly config/dev-redis's arguments and the
// Secret's credentials, lets nobody in as the default user (issue 26, item 8): a
// command without AUTH gets NOAUTH; AUTH as default, with any password, and AUTH of
// an activity's user with a wrong password fail and leave the connection
// unauthenticated, where redis-cli used to fall back to a default user without a
// password; the operator's user from the Secret manages the activities' users (ACL
// SETUSER) and loads the functions (FUNCTION LOAD); and with an append-only file the
// same arguments keep a grant across a crash. The operator reads the same Secret,
// optional, and the Redis needs it; its probes need no password.
func TestDevRedisRefusesTheDefaultUser(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a redis-server; not under -short")
	}
	kubectlBin(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	redisC := container(t, kustomize(t, filepath.Join(root, "config", "dev-redis")), "redis")
	managerC := container(t, kustomize(t, filepath.Join(root, "config", "default")), "manager")
	env := map[string]string{}
	for variable, key := range map[string]string{"REDIS_USERNAME": "username", "REDIS_PASSWORD": "password"} {
		secret, k, optional := secretEnv(t, redisC, variable)
		if secret != devRedisSecret || k != key || optional {
			t.Errorf("the dev Redis reads %s from secret %s key %s (optional %t), want %s key %s, not optional",
				variable, secret, k, optional, devRedisSecret, key)
		}
		secret, k, optional = secretEnv(t, managerC, variable)
		if secret != devRedisSecret || k != key || !optional {
			t.Errorf("the operator reads %s from secret %s key %s (optional %t), want %s key %s, optional",
				variable, secret, k, optional, devRedisSecret, key)
		}
	}
	for name, p := range map[string]*corev1.Probe{"readiness": redisC.ReadinessProbe, "liveness": redisC.LivenessProbe} {
		if p != nil && p.TCPSocket == nil {
			t.Errorf("the dev Redis's %s probe is %+v; a probe that talks to Redis gets NOAUTH without the password", name, p.ProbeHandler)
		}
	}

	// The Secret, as the docs' line makes it.
	password, err := redistest.NewPassword()
	if err != nil {
		t.Fatal(err)
	}
	env["REDIS_USERNAME"], env["REDIS_PASSWORD"] = "redpacket-operator", password
	args, err := expandArgs(append(append([]string(nil), redisC.Command...), redisC.Args...), env)
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := startDevRedis(t, args, t.TempDir(), freeLoopbackPort(t))

	// (c) The operator's user: FUNCTION LOAD and ACL SETUSER (an activity's user),
	// as the operator runs them.
	admin := redis.NewClient(&redis.Options{Addr: addr, Username: env["REDIS_USERNAME"], Password: password, MaxRetries: -1})
	defer admin.Close()
	if _, err := lua.GrabLibrary.Load(ctx, admin); err != nil {
		t.Fatalf("FUNCTION LOAD as the operator's user: %v", err)
	}
	const uid, activityPassword = "dev-redis-activity", "activity-password-0123456789"
	act := store.NewActivity(admin, uid, 1)
	if _, err := act.EnsureUser(ctx, activityPassword); err != nil {
		t.Fatalf("ACL SETUSER of an activity's user as the operator's user: %v", err)
	}
	meta := act.Shard(0).Keys().Meta
	if err := admin.HSet(ctx, meta, "probe", "the activity's own data").Err(); err != nil {
		t.Fatal(err)
	}

	// (a) Nothing without AUTH; (b) AUTH as default or with a wrong password fails,
	// and the connection stays unauthenticated.
	anon := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer anon.Close()
	conn := anon.Conn()
	defer conn.Close()
	refusedUnauthenticated(t, ctx, conn, "without AUTH", meta)
	for _, auth := range [][]any{
		{"auth", "default", "anything"},
		{"auth", "default", ""},
		{"auth", password}, // one argument: the default user's password
		{"auth", act.UserName(), "a-wrong-password"},
		{"auth", env["REDIS_USERNAME"], "a-wrong-password"},
	} {
		err := conn.Do(ctx, auth...).Err()
		var rerr redis.Error
		if err == nil || !errors.As(err, &rerr) || !strings.HasPrefix(err.Error(), "WRONGPASS") {
			t.Errorf("AUTH %v: %v, want WRONGPASS", auth[1:len(auth)-1], err)
		}
		refusedUnauthenticated(t, ctx, conn, fmt.Sprintf("after a failed AUTH %v", auth[1:len(auth)-1]), meta)
	}

	// The redis-cli: with a wrong password for the activity's user it went on
	// as the default user and read the keys; now it reads nothing. With the right
	// password it reads the activity's own keys.
	host, port, _ := net.SplitHostPort(addr)
	cli := func(user, pass string) string {
		out, _ := exec.CommandContext(ctx, "redis-cli", "--no-auth-warning", "--user", user, "--pass", pass,
			"-h", host, "-p", port, "HGET", meta, "probe").CombinedOutput()
		return string(out)
	}
	if out := cli(act.UserName(), "a-wrong-password"); !strings.Contains(out, "NOAUTH") || strings.Contains(out, "own data") {
		t.Errorf("redis-cli as %s with a wrong password printed %q, want NOAUTH and nothing read", act.UserName(), out)
	}
	if out := cli(act.UserName(), activityPassword); strings.TrimSpace(out) != "the activity's own data" {
		t.Errorf("redis-cli as %s with its password printed %q, want its key's value", act.UserName(), out)
	}

	// (d) The same arguments on a Redis that keeps its data (an append-only file, as
	// docs/operations.md asks of a real one): a grant, written by the grab function,
	// survives a crash. Redis replays the file's transactions as the default user, so
	// turning it off must not take its permissions (redis/redis#14541).
	dir, pport := t.TempDir(), freeLoopbackPort(t)
	persistent := append(append([]string(nil), args...), "--appendonly", "yes", "--appendfsync", "always")
	paddr, proc := startDevRedis(t, persistent, dir, pport)
	pc := redis.NewClient(&redis.Options{Addr: paddr, Username: env["REDIS_USERNAME"], Password: password, MaxRetries: -1})
	defer pc.Close()
	kept := store.NewActivity(pc, "dev-redis-aof", 1)
	if err := kept.LoadScripts(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := kept.Seed(ctx, []int64{100, 200, 300}, store.SeedParams{Count: 3, Total: 600, Sponsor: "merchant-001", Currency: "CNY"}); err != nil {
		t.Fatal(err)
	}
	if _, err := kept.Configure(ctx, 0, 0, false, true); err != nil {
		t.Fatal(err)
	}
	granted, err := kept.Shard(0).Grab(ctx, "u-1")
	if err != nil || granted.Outcome != store.Granted {
		t.Fatalf("grab: %+v, %v", granted, err)
	}
	if err := redistest.KillProcess(proc); err != nil {
		t.Fatal(err)
	}
	startDevRedis(t, persistent, dir, pport)
	// Redis listens before it has replayed its append-only file, and answers LOADING
	// until it has: wait for that, as a client that retries would.
	for deadline := time.Now().Add(10 * time.Second); ; {
		err := pc.Ping(ctx).Err()
		if err == nil || !strings.Contains(err.Error(), "LOADING") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the restarted Redis still loads its data after 10s: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	again, err := kept.Shard(0).Grab(ctx, "u-1")
	if err != nil || again.Outcome != store.AlreadyClaimed || again.PacketID != granted.PacketID {
		t.Errorf("the same user after a crash and a restart: %+v, %v; want already_claimed with packet %s", again, err, granted.PacketID)
	}
	if snap, err := kept.Snapshot(ctx); err != nil || snap.ClaimedCount != 1 || snap.Count != 3 {
		t.Errorf("the activity after the restart: %+v, %v; want 3 packets, 1 claimed", snap, err)
	}
}
