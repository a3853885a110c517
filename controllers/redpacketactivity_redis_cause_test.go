package controllers_test

import (
	"context"
	"net"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// When the controller cannot use an activity's Redis, Ready's message names the
// cause in a fixed phrase: a name that does not resolve is a DNS failure (not a
// timeout), a closed port is refused, a wrong password fails authentication. Each
// against the real thing: the resolver, a closed loopback port, a redis-server with
// a password.
func TestReadyNamesTheCauseOfARedisFailure(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(func(r *controllers.RedPacketActivityReconciler) {
		r.Options.AllowedRedisHosts = controllers.MustParseRedisHosts("127.0.0.0/8,redis.invalid")
	})
	closedAddr := closedPort(t)
	protected, _ := redistest.StartProtected(t, "the-right-password")

	cases := []struct {
		name     string
		data     map[string]string
		want     string // the cause's phrase
		mustNot  string // a cause it must not be mistaken for
		notInMsg []string
	}{
		{name: "unresolvable", data: map[string]string{redisconn.SecretAddresses: "redis.invalid:6379"},
			want: "DNS lookup failed", mustNot: "timed out"},
		{name: "closed-port", data: map[string]string{redisconn.SecretAddresses: closedAddr},
			want: "connection refused"},
		{name: "wrong-password", data: map[string]string{redisconn.SecretAddresses: protected.Addr, redisconn.SecretPassword: "a-wrong-password"},
			want: "authentication failed", notInMsg: []string{"invalid username-password pair", "a-wrong-password"}},
	}
	for _, tc := range cases {
		secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: tc.name, Namespace: e.ns}, StringData: tc.data}
		secret.StringData[redisconn.SecretMode] = redisconn.ModeStandalone
		if err := e.c.Create(context.Background(), secret); err != nil {
			t.Fatal(err)
		}
		e.create(e.activity(tc.name, 1000, 10, withRedisSecret(tc.name)))
	}
	for _, tc := range cases {
		a := e.waitCondition(tc.name, redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonRedisUnavailable, 20*time.Second)
		msg := findCondition(a, redpacketv1alpha1.ConditionReady).Message
		t.Logf("%s: Ready is False/%s: %s", tc.name, redpacketv1alpha1.ReasonRedisUnavailable, msg)
		if !strings.Contains(msg, tc.want) {
			t.Errorf("%s: Ready's message %q does not say %q", tc.name, msg, tc.want)
		}
		if tc.mustNot != "" && strings.Contains(msg, tc.mustNot) {
			t.Errorf("%s: Ready's message %q says %q", tc.name, msg, tc.mustNot)
		}
		for _, s := range tc.notInMsg {
			if strings.Contains(msg, s) {
				t.Errorf("%s: Ready's message %q echoes %q", tc.name, msg, s)
			}
		}
	}
}

// closedPort is a loopback address where nothing listens and nothing can start to
// while the test runs: a TCP socket bound to it and never put to listen holds the port
// (a connection to it is refused), where a port merely closed again could be taken by
// a redis-server another test starts.
func closedPort(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
}
