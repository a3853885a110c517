package rpactl

import (
	"errors"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"redpacket.io/operator/internal/rain"
)

// The rain's verdicts pass for a clean rain and name each way one can fail.
func TestRainChecks(t *testing.T) {
	before := MoneyOf(activityWith(10, 500, 4990, 199500, nil))
	after := MoneyOf(activityWith(60, 3000, 4940, 197000, nil))
	clean := rain.Result{ByOutcome: map[string]int64{"granted": 50}, Granted: 50, GrantedSum: 2500, Retries: 5, RetriesSame: 5}
	failed := func(checks []Check) []string {
		var names []string
		for _, c := range checks {
			if !c.OK {
				names = append(names, c.Name)
			}
		}
		return names
	}
	if f := failed(RainChecks(clean, before, after, nil)); len(f) != 0 {
		t.Fatalf("a clean rain failed %v", f)
	}
	for _, tc := range []struct {
		name   string
		res    func(r *rain.Result)
		after  Money
		report error
		want   string
	}{
		{"a user without an answer", func(r *rain.Result) { r.ByOutcome["error"] = 1; r.FirstError = "HTTP 500" }, after, nil, "every user got an answer"},
		{"a failed answer", func(r *rain.Result) { r.Failed = 1 }, after, nil, "every user got an answer"},
		{"a packet granted twice", func(r *rain.Result) { r.DupPackets = 1 }, after, nil, "no packet granted twice"},
		{"an inconsistent retry", func(r *rain.Result) { r.RetriesInconsistent = 1 }, after, nil, "every retry got the same answer"},
		{"grants the status does not count", func(r *rain.Result) { r.Granted = 51 }, after, nil, "the status counts every grant"},
		{"money the status does not count", func(r *rain.Result) { r.GrantedSum = 2501 }, after, nil, "the status counts every grant"},
		{"no report after the rain", func(*rain.Result) {}, after, errors.New("no status report within 30s after the rain"), "the status counts every grant"},
		{"a violated invariant", func(*rain.Result) {}, MoneyOf(activityWith(60, 3000, 4940, 197001, nil)), nil, "claimed + remaining + refunded = total"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := clean
			r.ByOutcome = map[string]int64{"granted": 50}
			tc.res(&r)
			f := failed(RainChecks(r, before, tc.after, tc.report))
			if len(f) != 1 || f[0] != tc.want {
				t.Errorf("failed checks %v, want only %q", f, tc.want)
			}
		})
	}
}

// The rain's flags are bounded: a rehearsal never turns into an unbounded load.
func TestRainOptionsValidate(t *testing.T) {
	ok := rainOptions{users: 100, connections: 16, retryEvery: 10, timeout: time.Second, deadline: time.Minute, reportWait: time.Second}
	if err := ok.validate(); err != nil {
		t.Fatal(err)
	}
	for name, change := range map[string]func(*rainOptions){
		"no users":              func(o *rainOptions) { o.users = 0 },
		"too many users":        func(o *rainOptions) { o.users = MaxRainUsers + 1 },
		"no connections":        func(o *rainOptions) { o.connections = 0 },
		"too many connections":  func(o *rainOptions) { o.connections = MaxRainConnections + 1 },
		"a negative rate":       func(o *rainOptions) { o.rate = -1 },
		"no deadline":           func(o *rainOptions) { o.deadline = 0 },
		"a URL without host":    func(o *rainOptions) { o.url = "http://" },
		"a URL of another kind": func(o *rainOptions) { o.url = "ftp://grab:8080" },
		"user ids too long":     func(o *rainOptions) { o.userPrefix = strings.Repeat("u", 125) },
	} {
		o := ok
		change(&o)
		if err := o.validate(); err == nil {
			t.Errorf("%s: accepted %+v", name, o)
		}
	}
}

// The port-forward goes to a Running, Ready pod that is not being deleted, on the
// Service's target port resolved through the pod.
func TestPickReadyPodAndTargetPort(t *testing.T) {
	pod := func(name string, phase corev1.PodPhase, ready bool, deleting bool) corev1.Pod {
		p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: corev1.PodStatus{Phase: phase}}
		status := corev1.ConditionFalse
		if ready {
			status = corev1.ConditionTrue
		}
		p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: status}}
		if deleting {
			p.DeletionTimestamp = &metav1.Time{Time: time.Now()}
		}
		p.Spec.Containers = []corev1.Container{{Name: "grab", Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}}}
		return p
	}
	pods := []corev1.Pod{
		pod("d-deleting", corev1.PodRunning, true, true),
		pod("c-ready", corev1.PodRunning, true, false),
		pod("a-pending", corev1.PodPending, false, false),
		pod("b-unready", corev1.PodRunning, false, false),
	}
	got := pickReadyPod(pods)
	if got == nil || got.Name != "c-ready" {
		t.Fatalf("picked %v, want c-ready", got)
	}
	if p := pickReadyPod(pods[2:3]); p != nil {
		t.Errorf("picked %s among pods none of which is ready", p.Name)
	}
	for _, tc := range []struct {
		sp   corev1.ServicePort
		want int32
		ok   bool
	}{
		{corev1.ServicePort{Port: 80, TargetPort: intstr.FromString("http")}, 8080, true},
		{corev1.ServicePort{Port: 80, TargetPort: intstr.FromInt32(9090)}, 9090, true},
		{corev1.ServicePort{Port: 80}, 80, true},
		{corev1.ServicePort{Port: 80, TargetPort: intstr.FromString("metrics")}, 0, false},
	} {
		port, err := targetPort(tc.sp, got)
		if (err == nil) != tc.ok || port != tc.want {
			t.Errorf("targetPort(%+v) = %d, %v; want %d", tc.sp, port, err, tc.want)
		}
	}
}
