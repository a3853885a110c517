package grabsvc

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// reporterEnv is a real API server and a real Redis holding one seeded activity.
type reporterEnv struct {
	cp    *controlplane.ControlPlane
	rc    *redisconn.PipelinedClient
	admin *redis.Client
	act   *Resource
}

func newReporterEnv(t *testing.T, name string, count int64) *reporterEnv {
	t.Helper()
	cp := controlPlane(t)
	ns := cp.Namespace(t)
	srv := redistest.Start(t)
	rc, err := srv.Conn().NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	amounts := ones(int(count))
	var total int64
	for _, a := range amounts {
		total += a
	}
	obj := activityForStatus(ns, name, count, total)
	if err := cp.Client.Create(context.Background(), obj); err != nil {
		t.Fatalf("creating the activity: %v", err)
	}
	act := NewResource(obj)
	seed(t, rc.Client, act, amounts, 0, 0, false)
	return &reporterEnv{cp: cp, rc: rc, admin: srv.Client(t), act: act}
}

func (e *reporterEnv) reporter(interval time.Duration, m *Metrics) *Reporter {
	return &Reporter{Client: e.cp.Client, Redis: e.rc.Pipeliner, Resource: func() *Resource { return e.act },
		Interval: interval, Metrics: m}
}

func (e *reporterEnv) get(t *testing.T) *redpacketv1alpha1.RedPacketActivity {
	t.Helper()
	o := &redpacketv1alpha1.RedPacketActivity{}
	if err := e.cp.Client.Get(context.Background(), client.ObjectKeyFromObject(e.act.Object), o); err != nil {
		t.Fatalf("reading the activity: %v", err)
	}
	return o
}

func (e *reporterEnv) burst(t *testing.T, prefix string, n int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := handleOf(e.rc.Pipeliner, e.act).Shard(0).Grab(context.Background(), fmt.Sprintf("%s-%d", prefix, i))
			if err == nil && res.Outcome != store.Granted {
				err = fmt.Errorf("outcome %s", res.Outcome)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("burst grab: %v", err)
		}
	}
}

func statusMatches(o *redpacketv1alpha1.RedPacketActivity, s store.Snapshot) (bool, string) {
	st := o.Status
	got := fmt.Sprintf("remaining %v/%v claimed %v/%v settled %v/%v dead %v reported %v",
		ptrStr(st.RemainingCount), ptrStr(st.RemainingAmount), ptrStr(st.ClaimedCount), ptrStr(st.ClaimedAmount),
		ptrStr(st.SettledCount), ptrStr(st.SettledAmount), ptrStr(st.DeadLetterCount), st.LastReportTime)
	want := fmt.Sprintf("remaining %d/%d claimed %d/%d settled %d/%d dead %d",
		s.RemainingCount, s.RemainingAmount(), s.ClaimedCount, s.ClaimedAmount, s.SettledCount, s.SettledAmount, s.DeadCount)
	ok := st.LastReportTime != nil && deref(st.RemainingCount) == s.RemainingCount && st.RemainingCount != nil &&
		deref(st.RemainingAmount) == s.RemainingAmount() && deref(st.ClaimedCount) == s.ClaimedCount &&
		st.ClaimedCount != nil && deref(st.ClaimedAmount) == s.ClaimedAmount && st.SettledCount != nil &&
		deref(st.SettledCount) == s.SettledCount && deref(st.SettledAmount) == s.SettledAmount &&
		st.DeadLetterCount != nil && deref(st.DeadLetterCount) == s.DeadCount
	return ok, "status " + got + ", want " + want
}

func ptrStr(p *int64) string {
	if p == nil {
		return "nil"
	}
	return fmt.Sprint(*p)
}

func TestReporterShowsABurstWithinTwoSeconds(t *testing.T) {
	e := newReporterEnv(t, "burst", 500)
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	r := e.reporter(0, m) // the default interval, 1s
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()

	e.burst(t, "b1", 120)
	burstEnd := time.Now()
	snap, err := handleOf(e.admin, e.act).Snapshot(context.Background())
	if err != nil || snap.ClaimedCount != 120 {
		t.Fatalf("snapshot %+v %v", snap, err)
	}
	wait.Until(t, 2*time.Second, "the status to show the burst", func() (bool, string) {
		return statusMatches(e.get(t), snap)
	})
	t.Logf("status showed the burst %s after it ended", time.Since(burstEnd).Round(time.Millisecond))
	o := e.get(t)
	if *o.Status.ClaimedAmount+*o.Status.RemainingAmount != o.Spec.TotalAmount {
		t.Fatalf("claimed %d + remaining %d != total %d", *o.Status.ClaimedAmount, *o.Status.RemainingAmount, o.Spec.TotalAmount)
	}

	// Settlement and dead-letter counters come from the same snapshot.
	if err := e.admin.HSet(context.Background(), keysOf(e.act).Meta, "settled_count", 7, "settled_amount", 21, "dead_count", 1).Err(); err != nil {
		t.Fatal(err)
	}
	e.burst(t, "b2", 30)
	snap, err = handleOf(e.admin, e.act).Snapshot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 2*time.Second, "the status to show the second burst", func() (bool, string) {
		return statusMatches(e.get(t), snap)
	})
	cancel()
	<-done
	if got := counterValue(t, reg, "redpacket_grab_reports_total", "kind", "change"); got < 2 {
		t.Fatalf("change reports: %v", got)
	}
}

func TestReporterAppliesOnlyOnChangeOrHeartbeat(t *testing.T) {
	e := newReporterEnv(t, "quiet", 20)
	now := time.Now()
	r := e.reporter(time.Second, nil)
	r.Heartbeat = 5 * time.Second
	r.Now = func() time.Time { return now }
	ctx := context.Background()

	applied, err := r.ReportOnce(ctx)
	if err != nil || !applied {
		t.Fatalf("first report: applied %v, %v", applied, err)
	}
	rv := e.get(t).ResourceVersion
	now = now.Add(time.Second)
	if applied, err := r.ReportOnce(ctx); err != nil || applied {
		t.Fatalf("unchanged counters: applied %v, %v", applied, err)
	}
	if got := e.get(t).ResourceVersion; got != rv {
		t.Fatalf("an unchanged report wrote the resource (%s -> %s)", rv, got)
	}
	e.burst(t, "q", 1)
	now = now.Add(time.Second)
	if applied, err := r.ReportOnce(ctx); err != nil || !applied {
		t.Fatalf("changed counters: applied %v, %v", applied, err)
	}
	if c := e.get(t).Status.ClaimedCount; c == nil || *c != 1 {
		t.Fatalf("claimedCount %v", c)
	}
	// No change, but the heartbeat is due: lastReportTime moves on.
	before := e.get(t).Status.LastReportTime.Time
	now = now.Add(5 * time.Second)
	if applied, err := r.ReportOnce(ctx); err != nil || !applied {
		t.Fatalf("heartbeat: applied %v, %v", applied, err)
	}
	after := e.get(t).Status.LastReportTime.Time
	if !after.After(before) || !after.Equal(now.Truncate(time.Second)) {
		t.Fatalf("lastReportTime %s -> %s, want %s", before, after, now.Truncate(time.Second))
	}
	// Redis without the activity: nothing is reported.
	if err := handleOf(e.admin, e.act).Purge(ctx); err != nil {
		t.Fatal(err)
	}
	now = now.Add(time.Minute)
	if applied, err := r.ReportOnce(ctx); err != nil || applied {
		t.Fatalf("missing activity: applied %v, %v", applied, err)
	}
}

func TestThreeReportersConvergeWithoutConflicts(t *testing.T) {
	e := newReporterEnv(t, "replicas", 400)
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for i := 0; i < 3; i++ {
		r := e.reporter(100*time.Millisecond, m)
		wg.Add(1)
		go func() { defer wg.Done(); r.Run(ctx) }()
	}
	for round := 0; round < 5; round++ {
		e.burst(t, fmt.Sprintf("r%d", round), 40)
		time.Sleep(60 * time.Millisecond)
	}
	snap, err := handleOf(e.admin, e.act).Snapshot(context.Background())
	if err != nil || snap.ClaimedCount != 200 {
		t.Fatalf("snapshot %+v %v", snap, err)
	}
	wait.Until(t, 3*time.Second, "the replicas to converge", func() (bool, string) {
		return statusMatches(e.get(t), snap)
	})
	// Stay converged: no replica writes an older view afterwards.
	time.Sleep(400 * time.Millisecond)
	if ok, detail := statusMatches(e.get(t), snap); !ok {
		t.Fatalf("after convergence: %s", detail)
	}
	cancel()
	wg.Wait()
	if f := counterValue(t, reg, "redpacket_grab_report_failures_total", "stage", "apply"); f != 0 {
		t.Fatalf("%v applies failed (conflicts?)", f)
	}
	if n := counterValue(t, reg, "redpacket_grab_reports_total", "kind", "change"); n < 3 {
		t.Fatalf("only %v reports applied", n)
	}
	managers := statusManagers(e.get(t))
	if len(managers) != 1 || managers[FieldManager] != 1 {
		t.Fatalf("status managers %v, want one entry for %s", managers, FieldManager)
	}
}

// statusManagers counts managedFields entries on the status subresource by manager.
func statusManagers(o *redpacketv1alpha1.RedPacketActivity) map[string]int {
	m := map[string]int{}
	for _, mf := range o.ManagedFields {
		if mf.Subresource == "status" {
			m[mf.Manager]++
		}
	}
	return m
}

func TestControllerFieldsSurviveReports(t *testing.T) {
	e := newReporterEnv(t, "owners", 50)
	ctx := context.Background()
	controllerApply := func(phase string, sha string) {
		t.Helper()
		u := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": redpacketv1alpha1.GroupVersion.String(),
			"kind":       "RedPacketActivity",
			"metadata":   map[string]any{"name": e.act.Object.Name, "namespace": e.act.Object.Namespace},
			"status": map[string]any{
				"phase":              phase,
				"observedGeneration": int64(1),
				"scriptSHA":          sha,
				"conditions": []any{map[string]any{
					"type": "Ready", "status": "True", "reason": "Active", "message": "grabbing is open",
					"lastTransitionTime": time.Now().UTC().Format(time.RFC3339), "observedGeneration": int64(1),
				}},
			},
		}}
		if err := e.cp.Client.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(u),
			client.FieldOwner("redpacket-controller"), client.ForceOwnership); err != nil {
			t.Fatalf("controller apply: %v", err)
		}
	}
	controllerApply("Active", lua.GrabScript.SHA())

	r := e.reporter(time.Second, nil)
	for i := 0; i < 3; i++ {
		e.burst(t, fmt.Sprintf("o%d", i), 5)
		if applied, err := r.ReportOnce(ctx); err != nil || !applied {
			t.Fatalf("report %d: applied %v, %v", i, applied, err)
		}
	}
	o := e.get(t)
	if o.Status.Phase != redpacketv1alpha1.PhaseActive || o.Status.ScriptSHA != lua.GrabScript.SHA() ||
		o.Status.ObservedGeneration != 1 || len(o.Status.Conditions) != 1 || o.Status.Conditions[0].Type != "Ready" {
		t.Fatalf("controller fields after the reports: %+v", o.Status)
	}
	if c := o.Status.ClaimedCount; c == nil || *c != 15 {
		t.Fatalf("claimedCount %v, want 15", c)
	}
	managers := statusManagers(o)
	if managers["redpacket-controller"] != 1 || managers[FieldManager] != 1 {
		t.Fatalf("status managers %v, want both", managers)
	}
	// Each manager owns only its own fields.
	for _, mf := range o.ManagedFields {
		if mf.Subresource != "status" || mf.FieldsV1 == nil {
			continue
		}
		fields := string(mf.FieldsV1.GetRawBytes())
		switch mf.Manager {
		case FieldManager:
			for _, f := range []string{"f:phase", "f:conditions", "f:scriptSHA"} {
				if strings.Contains(fields, f) {
					t.Fatalf("the reporter owns %s: %s", f, fields)
				}
			}
			for _, f := range []string{"f:claimedCount", "f:remainingAmount", "f:lastReportTime", "f:deadLetterCount"} {
				if !strings.Contains(fields, f) {
					t.Fatalf("the reporter does not own %s: %s", f, fields)
				}
			}
		case "redpacket-controller":
			if strings.Contains(fields, "f:claimedCount") || strings.Contains(fields, "f:lastReportTime") {
				t.Fatalf("the controller owns reporter fields: %s", fields)
			}
		}
	}
	// The controller's next apply leaves the counters alone.
	controllerApply("Exhausted", lua.GrabScript.SHA())
	o = e.get(t)
	if o.Status.Phase != redpacketv1alpha1.PhaseExhausted || o.Status.ClaimedCount == nil || *o.Status.ClaimedCount != 15 ||
		o.Status.LastReportTime == nil {
		t.Fatalf("after the controller's second apply: %+v", o.Status)
	}
}

// TestAPIServerOutageDoesNotTouchGrabs points the reporter at an API server that
// accepts connections and never answers: while a report hangs, grabs go on at their
// usual speed, and the failed report is counted.
func TestAPIServerOutageDoesNotTouchGrabs(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		conns    sync.WaitGroup
		accepted atomic.Int32
	)
	stopHang := make(chan struct{})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			conns.Add(1)
			go func() { defer conns.Done(); <-stopHang; c.Close() }()
		}
	}()
	t.Cleanup(func() { ln.Close(); close(stopHang); conns.Wait() })
	hung, err := client.New(&rest.Config{Host: "http://" + ln.Addr().String()}, client.Options{
		Scheme: controlplane.NewScheme(), Mapper: staticMapper(),
	})
	if err != nil {
		t.Fatal(err)
	}

	h := newHarness(t)
	act := testActivity("apiserver-down")
	h.useActivity(act, ones(300), 0, 0, false)
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	r := &Reporter{Client: hung, Redis: h.rc.Pipeliner, Resource: h.act.Load, Interval: 50 * time.Millisecond,
		Timeout: 30 * time.Second, Metrics: m, Log: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()
	wait.Until(t, 5*time.Second, "a report to reach the hung API server", func() (bool, string) {
		return accepted.Load() > 0, ""
	})

	start := time.Now()
	var slowest time.Duration
	for i := 0; i < 100; i++ {
		t0 := time.Now()
		if res := h.grab(fmt.Sprintf("busy-%d", i), nil); res.Status != 200 || res.Outcome != OutcomeGranted {
			t.Fatalf("grab %d during the API server outage: %d %s", i, res.Status, res.Raw)
		}
		slowest = max(slowest, time.Since(t0))
	}
	took := time.Since(start)
	if f := counterValue(t, reg, "redpacket_grab_report_failures_total", "stage", "read"); f != 0 {
		t.Fatalf("the hung report ended early (%v failures): the test did not overlap it with the grabs", f)
	}
	cancel()
	<-done
	if f := counterValue(t, reg, "redpacket_grab_report_failures_total", "stage", "read"); f != 1 {
		t.Fatalf("failed reports counted: %v, want 1", f)
	}
	t.Logf("100 grabs in %s during a hung report, slowest %s", took.Round(time.Millisecond), slowest.Round(time.Microsecond))
	if slowest > time.Second {
		t.Fatalf("slowest grab during the outage took %s", slowest)
	}
}

// staticMapper knows RedPacketActivity without asking an API server.
func staticMapper() meta.RESTMapper {
	m := meta.NewDefaultRESTMapper([]schema.GroupVersion{redpacketv1alpha1.GroupVersion})
	m.Add(redpacketv1alpha1.GroupVersion.WithKind("RedPacketActivity"), meta.RESTScopeNamespace)
	return m
}
