package controllers_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/test/wait"
)

// The operator's policy flags: a grab image of the activity's own is refused unless
// the operator allows it, and spec.redis may name only the hosts it allows.

func withImage(image string) func(*redpacketv1alpha1.RedPacketActivity) {
	return func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.GrabService.Image = image }
}

func TestGrabImageOverrideIsRefusedUnlessAllowed(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	e.startController(nil) // AllowGrabImageOverride false, as by default
	const evil = "example.test/not-the-grab-service:1"

	// A new activity naming its own image: seeded and open, but no workload.
	e.create(e.activity("custom", 1000, 10, withImage(evil)))
	a := e.waitCondition("custom", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonGrabImageNotAllowed, 20*time.Second)
	if c := findCondition(a, redpacketv1alpha1.ConditionReady); !strings.Contains(c.Message, evil) ||
		!strings.Contains(c.Message, "--allow-grab-image-override") {
		t.Errorf("Ready's message %q does not say which image and which flag", c.Message)
	}
	if a.Status.Phase != redpacketv1alpha1.PhaseActive {
		t.Errorf("phase %s, want Active", a.Status.Phase)
	}
	e.waitEvent("custom", "Warning", redpacketv1alpha1.ReasonGrabImageNotAllowed)
	for _, obj := range []client.Object{&appsv1.Deployment{}, &corev1.ServiceAccount{}, &corev1.Service{}} {
		if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "custom-grab"}, obj); !isNotFound(err) {
			t.Errorf("%T custom-grab: %v, want none", obj, err)
		}
	}

	// An activity that runs, then names its own image: its workload stays as it was.
	e.create(e.activity("plain", 1000, 10))
	e.waitPhase("plain", redpacketv1alpha1.PhaseActive, 20*time.Second)
	d := &appsv1.Deployment{}
	key := client.ObjectKey{Namespace: e.ns, Name: "plain-grab"}
	if err := e.c.Get(ctx, key, d); err != nil {
		t.Fatal(err)
	}
	before := d.Generation
	e.patch("plain", withImage(evil))
	e.waitCondition("plain", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonGrabImageNotAllowed, 10*time.Second)
	consistently(t, time.Second, "the grab Deployment unchanged", func() (bool, string) {
		if err := e.c.Get(ctx, key, d); err != nil {
			return false, err.Error()
		}
		image := d.Spec.Template.Spec.Containers[0].Image
		return image == "registry.example/redpacket-operator:test" && d.Generation == before,
			fmt.Sprintf("image %q, generation %d (was %d)", image, d.Generation, before)
	})
	// Dropping the field lifts the refusal.
	e.patch("plain", withImage(""))
	wait.Until(t, 10*time.Second, "Ready no longer GrabImageNotAllowed", func() (bool, string) {
		a := e.get("plain")
		c := findCondition(a, redpacketv1alpha1.ConditionReady)
		return c != nil && c.Reason != redpacketv1alpha1.ReasonGrabImageNotAllowed && c.ObservedGeneration == a.Generation, describe(a)
	})

	// An operator that allows it runs the activity's image.
	allowing := newEnv(t)
	allowing.startController(func(r *controllers.RedPacketActivityReconciler) { r.Options.AllowGrabImageOverride = true })
	allowing.create(allowing.activity("custom", 1000, 10, withImage(evil)))
	wait.Until(t, 20*time.Second, "the allowed image in the grab Deployment", func() (bool, string) {
		d := &appsv1.Deployment{}
		if err := allowing.c.Get(ctx, client.ObjectKey{Namespace: allowing.ns, Name: "custom-grab"}, d); err != nil {
			return false, err.Error()
		}
		return d.Spec.Template.Spec.Containers[0].Image == evil, d.Spec.Template.Spec.Containers[0].Image
	})
}

// listener is a loopback TCP server that counts its connections and greets each
// with banner (nothing when empty).
type listener struct {
	addr     string
	accepted atomic.Int64
}

func listen(t *testing.T, banner string) *listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	s := &listener{addr: l.Addr().String()}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			s.accepted.Add(1)
			go func() {
				defer c.Close()
				_, _ = c.Write([]byte(banner))
				_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
				r := bufio.NewReader(c)
				for {
					if _, err := r.ReadString('\n'); err != nil {
						return
					}
				}
			}()
		}
	}()
	return s
}

func (e *env) redisSecret(name, addresses string) {
	e.t.Helper()
	s := &corev1.Secret{}
	s.Name, s.Namespace = name, e.ns
	s.StringData = map[string]string{"addresses": addresses, "mode": "standalone"}
	if addresses == e.redis.Addr {
		// The credentials a tenant brings for a Redis of its own: the test's server
		// refuses the default user.
		s.StringData["username"], s.StringData["password"] = e.redis.Username, e.redis.Password
	}
	if err := e.c.Create(context.Background(), s); err != nil {
		e.t.Fatal(err)
	}
}

func withRedisSecret(name string) func(*redpacketv1alpha1.RedPacketActivity) {
	return func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Redis = &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: name}}
	}
}

// eventNotes are the notes of every event about the named activity.
func (e *env) eventNotes(name string) []string {
	e.t.Helper()
	list := &eventsv1.EventList{}
	if err := e.c.List(context.Background(), list, client.InNamespace(e.ns)); err != nil {
		e.t.Fatal(err)
	}
	var out []string
	for _, ev := range list.Items {
		if ev.Regarding.Name == name {
			out = append(out, ev.Reason+": "+ev.Note)
		}
	}
	return out
}

// spec.redis may name the default Redis, or what --allowed-redis-hosts allows; any
// other address is refused before anything connects to it. Where the controller does
// connect, status and events say what failed in fixed words, never with what the
// other side sent.
func TestRedisHostPolicyAndWhatStatusSaysOfRemotes(t *testing.T) {
	t.Parallel()
	const secret = "SSH-2.0-OpenSSH_9.6 internal-db-7 banner-4b1d"
	ssh := listen(t, secret+"\r\n")

	// By default: only the default Redis. The listener is never dialled.
	e := newEnv(t)
	e.startController(nil)
	e.redisSecret("elsewhere", ssh.addr)
	e.create(e.activity("far", 1000, 10, withRedisSecret("elsewhere")))
	a := e.waitCondition("far", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonRedisNotAllowed, 15*time.Second)
	if c := findCondition(a, redpacketv1alpha1.ConditionReady); !strings.Contains(c.Message, ssh.addr) ||
		!strings.Contains(c.Message, "--allowed-redis-hosts") {
		t.Errorf("Ready's message %q does not name the address and the flag", c.Message)
	}
	e.waitEvent("far", "Warning", redpacketv1alpha1.ReasonRedisNotAllowed)
	consistently(t, time.Second, "no connection to the refused address", func() (bool, string) {
		n := ssh.accepted.Load()
		return n == 0, fmt.Sprintf("%d connections", n)
	})
	// The default Redis's own address is fine.
	e.redisSecret("home", e.redis.Addr)
	e.create(e.activity("near", 1000, 10, withRedisSecret("home")))
	e.waitPhase("near", redpacketv1alpha1.PhaseActive, 20*time.Second)

	// An operator that allows loopback: the controller connects, and says in its own
	// words what answered.
	o := newEnv(t)
	o.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Options.AllowedRedisHosts = controllers.MustParseRedisHosts("127.0.0.0/8")
	})
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := dead.Addr().String()
	_ = dead.Close()
	for _, tc := range []struct{ name, addr, want string }{
		{"scanner", ssh.addr, "not a Redis server"},
		{"closed", deadAddr, "connection refused"},
	} {
		o.redisSecret(tc.name, tc.addr)
		o.create(o.activity(tc.name, 1000, 10, withRedisSecret(tc.name)))
		a := o.waitCondition(tc.name, redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonRedisUnavailable, 15*time.Second)
		msg := findCondition(a, redpacketv1alpha1.ConditionReady).Message
		if !strings.Contains(msg, tc.want) {
			t.Errorf("%s: Ready's message %q, want it to say %q", tc.name, msg, tc.want)
		}
		o.waitEvent(tc.name, "Warning", redpacketv1alpha1.ReasonRedisUnavailable)
		// Retries with backoff: still no banner anywhere.
		time.Sleep(1500 * time.Millisecond)
		raw := describe(o.get(tc.name)) + strings.Join(o.eventNotes(tc.name), "\n")
		for _, part := range []string{"SSH-2.0", "OpenSSH", "banner-4b1d", "internal-db-7"} {
			if strings.Contains(raw, part) {
				t.Errorf("%s: status or events echo the remote's %q: %s", tc.name, part, raw)
			}
		}
	}
	if ssh.accepted.Load() == 0 {
		t.Error("the allowing operator never connected to the listener: the test proves nothing")
	}
}
