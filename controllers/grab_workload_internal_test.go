package controllers

import (
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

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
	r := &RedPacketActivityReconciler{Options: Options{}.withDefaults()}
	cases := []struct {
		name   string
		mutate func(*redpacketv1alpha1.RedPacketActivity)
	}{
		{"plain", func(*redpacketv1alpha1.RedPacketActivity) {}},
		{"signed tokens", func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Spec.GrabService.Auth = &redpacketv1alpha1.GrabAuth{TokenSecretRef: redpacketv1alpha1.SecretReference{Name: "grab-hmac"}}
		}},
		{"signed webhook", func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Spec.Settlement = &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{
				URL: "http://balance:8080/credit", SecretRef: &redpacketv1alpha1.SecretReference{Name: "balance-hmac"}}}
		}},
		{"own image and redis", func(a *redpacketv1alpha1.RedPacketActivity) {
			a.Spec.GrabService.Image = "example/grab:2"
			a.Spec.Redis = &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: "redis-conn"}}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := &redpacketv1alpha1.RedPacketActivity{ObjectMeta: metav1.ObjectMeta{Name: "quiz", Namespace: "ns", UID: "u-1"}}
			tc.mutate(a)
			d := r.grabDeployment(a, grabLabels(a), metav1ac.OwnerReference())
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
