package controllers_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	eventsv1 "k8s.io/api/events/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/yaml"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/wait"
)

// The platform's decisions (accepting a rolled-back Redis state, abandoning a held
// deletion) and the grab ServiceAccount's reports, as the admission policies of
// config/policy and the roles of config/rbac enforce them on the real API server.
// The built-in edit and admin roles get our rules only through the aggregation
// controller of kube-controller-manager, which envtest does not run: the tenant is
// bound to the aggregated role itself (redpacketactivity-editor-role), which is what
// edit and admin grant of activities.

var installPoliciesOnce sync.Once

// installPolicies creates the admission policies of config/policy and the roles of
// config/rbac the tests bind (the platform, editor and grab service roles) on the
// package's API server, once. The policies only restrict grab ServiceAccounts and
// requests that set platform decisions, so they do not disturb other tests.
func installPolicies(t *testing.T) {
	t.Helper()
	needsServers(t)
	var failed error
	installPoliciesOnce.Do(func() {
		root, err := controlplane.Root()
		if err != nil {
			failed = err
			return
		}
		for _, f := range []string{
			"config/policy/grab_status_policy.yaml", "config/policy/platform_annotations_policy.yaml",
			"config/rbac/platform_role.yaml", "config/rbac/redpacketactivity_editor_role.yaml", "config/rbac/grab_role.yaml",
		} {
			data, err := os.ReadFile(filepath.Join(root, f))
			if err != nil {
				failed = err
				return
			}
			for _, doc := range strings.Split(string(data), "\n---\n") {
				obj := &unstructured.Unstructured{}
				if err := yaml.Unmarshal([]byte(doc), &obj.Object); err != nil {
					failed = fmt.Errorf("%s: %w", f, err)
					return
				}
				if len(obj.Object) == 0 {
					continue
				}
				if err := cp.Client.Create(context.Background(), obj); err != nil && !apierrors.IsAlreadyExists(err) {
					failed = fmt.Errorf("%s: %w", f, err)
					return
				}
			}
		}
	})
	if failed != nil {
		t.Fatalf("installing the policies: %v", failed)
	}
}

// as returns a client that impersonates user (with groups), as the API server
// authenticates a person or a pod's token.
func as(t *testing.T, user string, groups ...string) client.Client {
	t.Helper()
	cfg := rest.CopyConfig(cp.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: groups}
	c, err := client.New(cfg, client.Options{Scheme: cp.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// bind binds the ClusterRole role to the subject in the test's namespace.
func (e *env) bind(role string, subject rbacv1.Subject) {
	e.t.Helper()
	rb := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%s", role, strings.ToLower(strings.ReplaceAll(subject.Name, ":", "-"))), Namespace: e.ns},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
		Subjects:   []rbacv1.Subject{subject},
	}
	if err := e.c.Create(context.Background(), rb); err != nil {
		e.t.Fatal(err)
	}
}

// people are a tenant bound to the editor role (what edit and admin grant) and a
// member of the platform team bound to the platform role, with their clients.
type people struct {
	tenant, platform     string
	asTenant, asPlatform client.Client
}

func (e *env) people() people {
	e.t.Helper()
	p := people{tenant: "tenant-" + e.ns, platform: "platform-" + e.ns}
	e.bind("redpacketactivity-editor-role", rbacv1.Subject{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: p.tenant})
	e.bind("platform", rbacv1.Subject{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: p.platform})
	p.asTenant, p.asPlatform = as(e.t, p.tenant), as(e.t, p.platform)
	return p
}

// annotate merge-patches annotations of the named activity as c.
func (e *env) annotate(c client.Client, name string, kv map[string]string, opts ...client.PatchOption) error {
	a := e.get(name)
	orig := a.DeepCopy()
	if a.Annotations == nil {
		a.Annotations = map[string]string{}
	}
	for k, v := range kv {
		a.Annotations[k] = v
	}
	return c.Patch(context.Background(), a, client.MergeFrom(orig), opts...)
}

// waitPlatformPolicy waits until the platform policy refuses the tenant a dry-run
// acceptance of the named activity: the API server loads policies in the background.
func (e *env) waitPlatformPolicy(p people, name string) {
	e.t.Helper()
	wait.Until(e.t, 30*time.Second, "the platform policy in force", func() (bool, string) {
		err := e.annotate(p.asTenant, name, map[string]string{
			redpacketv1alpha1.AnnotationAcceptRedisState: "0", redpacketv1alpha1.AnnotationAcceptedBy: p.tenant}, client.DryRunAll)
		return apierrors.IsForbidden(err) && strings.Contains(err.Error(), "platform decision"), errString(err)
	})
}

// eventNote returns the note of the activity's event of the given type and reason.
func (e *env) eventNote(name, eventType, reason string) string {
	e.t.Helper()
	list := &eventsv1.EventList{}
	if err := e.c.List(context.Background(), list, client.InNamespace(e.ns)); err != nil {
		e.t.Fatal(err)
	}
	for _, ev := range list.Items {
		if ev.Regarding.Name == name && ev.Type == eventType && ev.Reason == reason {
			return ev.Note
		}
	}
	return ""
}

// fence fences the activity in Redis, as a grab replica does when it sees a rollback,
// and waits until the controller says RedisRolledBack.
func (e *env) fence(a *redpacketv1alpha1.RedPacketActivity) {
	e.t.Helper()
	if _, err := e.handle(a).Fence(context.Background(), "rolled_back"); err != nil {
		e.t.Fatal(err)
	}
	e.bump(a.Name, 1)
	e.waitCondition(a.Name, redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonRedisRolledBack, 15*time.Second)
}

// A tenant who may edit activities cannot lift a rollback fence: setting the accept
// annotation is Forbidden, and so is naming a platform user as the one who accepted;
// the activity stays fenced. A member of the platform team can; the controller then
// records who and when in status.lastAcceptance and in an event.
func TestPlatformDecisionsNeedThePlatformRole(t *testing.T) {
	t.Parallel()
	installPolicies(t)
	e := newEnv(t)
	e.startController(nil)
	p := e.people()

	a := e.create(e.activity("rewound", 1000, 10))
	e.waitPhase("rewound", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if res := e.grab(a, "u1"); res.Outcome != store.Granted {
		t.Fatalf("grab: %+v", res)
	}
	e.fence(a)
	e.waitPlatformPolicy(p, "rewound")

	for _, c := range []struct {
		what string
		by   string
	}{{"the tenant accepting in their own name", p.tenant}, {"the tenant accepting in the platform's name", p.platform}} {
		err := e.annotate(p.asTenant, "rewound", map[string]string{
			redpacketv1alpha1.AnnotationAcceptRedisState: "0", redpacketv1alpha1.AnnotationAcceptedBy: c.by})
		if !apierrors.IsForbidden(err) {
			t.Fatalf("%s: %v, want Forbidden", c.what, err)
		}
	}
	// The platform team may; but not in someone else's name either.
	err := e.annotate(p.asPlatform, "rewound", map[string]string{
		redpacketv1alpha1.AnnotationAcceptRedisState: "0", redpacketv1alpha1.AnnotationAcceptedBy: p.tenant})
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "your own user name") {
		t.Fatalf("the platform user naming another: %v, want Forbidden", err)
	}
	consistently(t, time.Second, "the fence after the tenant's attempts", func() (bool, string) {
		snap := e.snapshot(a)
		got := e.get("rewound")
		return snap.Fenced != "" && got.Status.Phase == redpacketv1alpha1.PhaseFailed && got.Annotations[redpacketv1alpha1.AnnotationAcceptRedisState] == "",
			snapshotLine(snap) + "; " + describe(got)
	})
	if res := e.grab(a, "u2"); res.Outcome != store.Fenced {
		t.Fatalf("grab on the fenced activity: %+v", res)
	}

	before := time.Now().Add(-time.Second)
	if err := e.annotate(p.asPlatform, "rewound", map[string]string{
		redpacketv1alpha1.AnnotationAcceptRedisState: "0", redpacketv1alpha1.AnnotationAcceptedBy: p.platform}); err != nil {
		t.Fatalf("the platform user accepting: %v", err)
	}
	got := e.waitStatus("rewound", "the accepted state", func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return a.Status.RedisEpoch != nil && *a.Status.RedisEpoch == 1 && a.Status.Phase == redpacketv1alpha1.PhaseActive &&
			a.Status.LastAcceptance != nil
	})
	la := got.Status.LastAcceptance
	if la.By != p.platform || la.Epoch != 0 || la.At.Time.Before(before.Truncate(time.Second)) || la.At.Time.After(time.Now()) {
		t.Errorf("lastAcceptance %+v, want epoch 0 by %s just now", la, p.platform)
	}
	e.waitEvent("rewound", "Normal", redpacketv1alpha1.ReasonRedisStateAccepted)
	if note := e.eventNote("rewound", "Normal", redpacketv1alpha1.ReasonRedisStateAccepted); !strings.Contains(note, p.platform) {
		t.Errorf("the acceptance event %q does not name %s", note, p.platform)
	}
	if res := e.grab(a, "u3"); res.Outcome != store.Granted {
		t.Errorf("grab after the accept: %+v", res)
	}
}

// The grab ServiceAccount reports as the grab service does, and may not rewrite what
// it reported: lowering claimedCount or a shard's watermark is refused, and so is
// writing another activity's status (even where RBAC would allow it). After the
// controller starts a new epoch (as an accept does: redisEpoch and the accepted,
// lower counters in one apply), a report of the new epoch passes, and one that still
// carries the old epoch's marks does not.
func TestGrabStatusPolicyAllowsOnlyMonotonicReports(t *testing.T) {
	t.Parallel()
	installPolicies(t)
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()
	for _, sa := range []string{"owned-grab", "other-grab"} {
		// Namespace-wide, unlike the Role the operator makes: only the policy stands
		// between one activity's grab service and another's status.
		e.bind("grab-service-role", rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: sa, Namespace: e.ns})
	}
	saUser := func(sa string) client.Client {
		return as(t, "system:serviceaccount:"+e.ns+":"+sa, "system:serviceaccounts", "system:serviceaccounts:"+e.ns, "system:authenticated")
	}
	asGrab, asOther := saUser("owned-grab"), saUser("other-grab")

	a := e.create(e.activity("owned", 1000, 10))
	e.create(e.activity("other", 1000, 10))
	e.waitPhase("owned", redpacketv1alpha1.PhaseActive, 20*time.Second)
	e.waitPhase("other", redpacketv1alpha1.PhaseActive, 20*time.Second)

	report := func(c client.Client, name string, fields map[string]any, opts ...client.SubResourcePatchOption) error {
		obj := &unstructured.Unstructured{Object: map[string]any{"status": fields}}
		obj.SetAPIVersion(redpacketv1alpha1.GroupVersion.String())
		obj.SetKind("RedPacketActivity")
		obj.SetNamespace(e.ns)
		obj.SetName(name)
		return c.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(obj),
			append([]client.SubResourceApplyOption{client.FieldOwner(grabsvc.FieldManager), client.ForceOwnership}, toApply(opts)...)...)
	}
	// The policy is loaded in the background: wait until a dry run of a report on
	// another activity is refused.
	wait.Until(t, 30*time.Second, "the grab status policy in force", func() (bool, string) {
		err := report(asOther, "owned", map[string]any{"lastReportTime": time.Now().UTC().Format(time.RFC3339)}, client.DryRunAll)
		return apierrors.IsForbidden(err) && strings.Contains(err.Error(), "its own activity"), errString(err)
	})

	// The grab service's own reports, as its ServiceAccount: the first, then after
	// grabs. The reporter applies every counter it reports, with the shards' marks of
	// a sharded activity; marks are written here by hand for the one shard.
	act := e.get("owned")
	reporter := &grabsvc.Reporter{Client: asGrab, Redis: e.rdb, Resource: func() *grabsvc.Resource { return grabsvc.NewResource(act) }}
	if applied, err := reporter.ReportOnce(ctx); err != nil || !applied {
		t.Fatalf("the first report: applied %t, %v", applied, err)
	}
	for _, u := range []string{"u1", "u2", "u3"} {
		if res := e.grab(a, u); res.Outcome != store.Granted {
			t.Fatalf("grab: %+v", res)
		}
	}
	if applied, err := reporter.ReportOnce(ctx); err != nil || !applied {
		t.Fatalf("the report after three grabs: applied %t, %v", applied, err)
	}
	counters := func(claimed int64) map[string]any {
		return map[string]any{"remainingCount": 10 - claimed, "remainingAmount": 1000 - 100*claimed, "claimedCount": claimed,
			"claimedAmount": 100 * claimed, "refundedAmount": 0, "settledCount": 0, "settledAmount": 0, "deadLetterCount": 0}
	}
	withMarks := func(m map[string]any, epoch int64, marks ...int64) map[string]any {
		list := make([]any, len(marks))
		for i, v := range marks {
			list[i] = v
		}
		m["shardWatermarks"] = map[string]any{"epoch": epoch, "claimedCounts": list}
		return m
	}
	got := e.get("owned")
	claimed := *got.Status.ClaimedCount
	amount := *got.Status.ClaimedAmount
	steady := func() map[string]any {
		m := counters(claimed)
		m["claimedAmount"], m["remainingAmount"] = amount, 1000-amount
		return m
	}
	if err := report(asGrab, "owned", withMarks(steady(), 0, 3)); err != nil {
		t.Fatalf("a steady report with the shard's mark: %v", err)
	}

	refused := func(what, want string, err error) {
		t.Helper()
		if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want Forbidden naming %q", what, err, want)
		}
	}
	lowered := steady()
	lowered["claimedCount"] = claimed - 1
	refused("lowering claimedCount", "claimedCount", report(asGrab, "owned", withMarks(lowered, 0, 3)))
	refused("lowering the shard's mark", "shardWatermarks", report(asGrab, "owned", withMarks(steady(), 0, 2)))
	refused("raising the mark of another activity", "its own activity", report(asOther, "owned", withMarks(steady(), 0, 9)))
	refused("the marks of another epoch", "epoch", report(asGrab, "owned", withMarks(steady(), 7, 3)))
	after := e.get("owned")
	if *after.Status.ClaimedCount != claimed || after.Status.ShardWatermarks == nil || after.Status.ShardWatermarks.ClaimedCounts[0] != 3 {
		t.Fatalf("refused reports changed the status: %s, marks %+v", describe(after), after.Status.ShardWatermarks)
	}

	// A new epoch, as the controller writes it when a rolled-back state is accepted:
	// redisEpoch and the accepted counters together, under its counters manager. It
	// is done on a third activity, which no controller reconciles against a Redis of
	// epoch 0.
	quiet := newEnv(t)
	quiet.bind("grab-service-role", rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: "calm-grab", Namespace: quiet.ns})
	asCalm := as(t, "system:serviceaccount:"+quiet.ns+":calm-grab", "system:serviceaccounts", "system:authenticated")
	quiet.create(quiet.activity("calm", 1000, 10))
	applyCalm := func(c client.Client, manager string, fields map[string]any) error {
		obj := &unstructured.Unstructured{Object: map[string]any{"status": fields}}
		obj.SetAPIVersion(redpacketv1alpha1.GroupVersion.String())
		obj.SetKind("RedPacketActivity")
		obj.SetNamespace(quiet.ns)
		obj.SetName("calm")
		return c.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(obj), client.FieldOwner(manager), client.ForceOwnership)
	}
	if err := applyCalm(asCalm, grabsvc.FieldManager, withMarks(counters(4), 0, 4)); err != nil {
		t.Fatalf("the first report of calm: %v", err)
	}
	accepted := counters(1)
	accepted["redisEpoch"] = int64(1)
	if err := applyCalm(quiet.c, controllers.CountersFieldManager, accepted); err != nil {
		t.Fatalf("the controller's accepted counters: %v", err)
	}
	if got := quiet.get("calm"); got.Status.RedisEpoch == nil || *got.Status.RedisEpoch != 1 || *got.Status.ClaimedCount != 1 {
		t.Fatalf("the accepted counters did not land: %s, epoch %v, managed %+v", describe(got), got.Status.RedisEpoch, got.ManagedFields)
	}
	// A replica that still counts in the old epoch: its marks moved on, in epoch 0.
	refused("the old epoch's marks after the accept", "epoch", applyCalm(asCalm, grabsvc.FieldManager, withMarks(counters(5), 0, 5)))
	if err := applyCalm(asCalm, grabsvc.FieldManager, withMarks(counters(2), 1, 2)); err != nil {
		t.Fatalf("a report of the new epoch: %v", err)
	}
	refused("lowering within the new epoch", "claimedCount", applyCalm(asCalm, grabsvc.FieldManager, withMarks(counters(1), 1, 2)))
}

// toApply keeps the dry-run option of a report for the status apply.
func toApply(opts []client.SubResourcePatchOption) []client.SubResourceApplyOption {
	var out []client.SubResourceApplyOption
	for _, o := range opts {
		if o == client.DryRunAll {
			out = append(out, client.DryRunAll)
		}
	}
	return out
}

// fencedWithTwoSettledClaims makes an activity of 1000 in 10 fixed packets of 100,
// grants and settles 2 of them (200), and fences it, as the scenario does.
func (e *env) fencedWithTwoSettledClaims(name string, mutate ...func(*redpacketv1alpha1.RedPacketActivity)) *redpacketv1alpha1.RedPacketActivity {
	e.t.Helper()
	fixed := func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Distribution.Type = redpacketv1alpha1.DistributionFixed
	}
	a := e.create(e.activity(name, 1000, 10, append([]func(*redpacketv1alpha1.RedPacketActivity){fixed}, mutate...)...))
	e.waitPhase(name, redpacketv1alpha1.PhaseActive, 20*time.Second)
	for _, u := range []string{"u1", "u2"} {
		if res := e.grab(a, u); res.Outcome != store.Granted || res.Amount != 100 {
			e.t.Fatalf("grab: %+v", res)
		}
	}
	if a.Spec.Settlement != nil && a.Spec.Settlement.Webhook != nil {
		// The operator's settlement runner delivers them.
		wait.Until(e.t, 20*time.Second, "the 2 grants settled by the operator", func() (bool, string) {
			snap := e.snapshot(a)
			return snap.SettledCount == 2, snapshotLine(snap)
		})
	} else if n := e.settleAll(a); n != 2 {
		e.t.Fatalf("settled %d entries, want the 2 grants", n)
	}
	e.fence(a)
	return a
}

// Deleting a fenced activity (total 1000, 2 claims of 200 settled) keeps the resource,
// its finalizer and every Redis key, refunds nothing, and says with a Warning that 800
// was not refunded. The tenant cannot abandon it; the platform team can, and then the
// keys are purged with a Warning that names 800 and who abandoned it.
func TestDeletingAFencedActivityKeepsTheMoneyTrail(t *testing.T) {
	t.Parallel()
	installPolicies(t)
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()
	p := e.people()
	a := e.fencedWithTwoSettledClaims("trail")
	keysBefore := e.dbsize()

	if err := e.c.Delete(ctx, a); err != nil {
		t.Fatal(err)
	}
	held := e.waitCondition("trail", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonDeletionHeld, 15*time.Second)
	if msg := findCondition(held, redpacketv1alpha1.ConditionReady).Message; !strings.Contains(msg, "800 of the total 1000 was not refunded") {
		t.Errorf("Ready's message %q does not name the 800 not refunded", msg)
	}
	if c := findCondition(held, redpacketv1alpha1.ConditionStalled); c == nil || c.Status != metav1.ConditionTrue {
		t.Errorf("Stalled %+v, want True", c)
	}
	e.waitEvent("trail", "Warning", redpacketv1alpha1.ReasonDeletionHeld)
	if note := e.eventNote("trail", "Warning", redpacketv1alpha1.ReasonDeletionHeld); !strings.Contains(note, "800") {
		t.Errorf("the Warning %q does not name 800", note)
	}
	// Reconcile storms change nothing: the keys, the finalizer, no refund.
	for i := range 3 {
		e.bump("trail", 20+i)
	}
	consistently(t, 2*time.Second, "the held deletion", func() (bool, string) {
		got := e.get("trail")
		snap := e.snapshot(a)
		n := e.dbsize()
		return controllerutil.ContainsFinalizer(got, controllers.Finalizer) && n == keysBefore && snap.Refunded == 0 && snap.Fenced != "",
			fmt.Sprintf("%d keys (was %d), %s, refunded %d", n, keysBefore, snapshotLine(snap), snap.Refunded)
	})
	if n := countEvents(e, "trail", "Warning", redpacketv1alpha1.ReasonDeletionHeld); n != 1 {
		t.Errorf("%d DeletionHeld events, want 1", n)
	}

	e.waitPlatformPolicy(p, "trail")
	abandon := func(c client.Client, by string) error {
		return e.annotate(c, "trail", map[string]string{redpacketv1alpha1.AnnotationAbandon: string(a.UID), redpacketv1alpha1.AnnotationAbandonedBy: by})
	}
	if err := abandon(p.asTenant, p.tenant); !apierrors.IsForbidden(err) {
		t.Fatalf("the tenant abandoning: %v, want Forbidden", err)
	}
	if n := e.dbsize(); n != keysBefore {
		t.Fatalf("%d keys after the tenant's attempt, want %d", n, keysBefore)
	}
	if err := abandon(p.asPlatform, p.platform); err != nil {
		t.Fatalf("the platform abandoning: %v", err)
	}
	e.waitGoneAndPurged(a, 15*time.Second, "the abandoned activity")
	e.waitEvent("trail", "Warning", redpacketv1alpha1.ReasonAbandoned)
	if note := e.eventNote("trail", "Warning", redpacketv1alpha1.ReasonAbandoned); !strings.Contains(note, "800") || !strings.Contains(note, p.platform) {
		t.Errorf("the Abandoned warning %q does not name 800 and %s", note, p.platform)
	}
}

// waitGoneAndPurged waits until the activity is gone from the API server, then checks
// that Redis holds none of its keys (the test's Redis holds this activity alone).
func (e *env) waitGoneAndPurged(a *redpacketv1alpha1.RedPacketActivity, timeout time.Duration, what string) {
	e.t.Helper()
	ctx := context.Background()
	wait.Until(e.t, timeout, what+" gone", func() (bool, string) {
		err := e.c.Get(ctx, client.ObjectKeyFromObject(a), &redpacketv1alpha1.RedPacketActivity{})
		return isNotFound(err), "get: " + errString(err)
	})
	if n := e.dbsize(); n != 0 {
		keys, _ := e.rdb.Keys(ctx, "*").Result()
		e.t.Fatalf("%d keys left after %s was deleted: %v", n, what, keys)
	}
}

// Deleting a fenced activity and then accepting its state (the platform team, after
// reconciling the balances) takes the usual way: closed, the 800 refunded and
// credited, then purged.
func TestDeletingAFencedActivityThenAcceptingRefunds(t *testing.T) {
	t.Parallel()
	installPolicies(t)
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()
	p := e.people()
	bal := newBalance(t, nil)
	bal.setUp(true)
	e.allowWebhook(bal.URL())
	a := e.fencedWithTwoSettledClaims("kept", withWebhook(bal.URL(), ""))

	if err := e.c.Delete(ctx, a); err != nil {
		t.Fatal(err)
	}
	e.waitCondition("kept", redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonDeletionHeld, 15*time.Second)
	e.waitPlatformPolicy(p, "kept")
	if err := e.annotate(p.asPlatform, "kept", map[string]string{
		redpacketv1alpha1.AnnotationAcceptRedisState: "0", redpacketv1alpha1.AnnotationAcceptedBy: p.platform}); err != nil {
		t.Fatalf("the platform accepting: %v", err)
	}
	e.waitGoneAndPurged(a, 30*time.Second, "the accepted activity, refunded and settled,")
	credited, bad := bal.credits()
	var refund int64
	for _, d := range credited {
		if d.Kind == "refund" {
			refund += d.Amount
		}
	}
	if refund != 800 || len(bad) != 0 {
		t.Errorf("refund credited %d (bad: %v), want 800", refund, bad)
	}
	e.waitEvent("kept", "Normal", redpacketv1alpha1.ReasonRedisStateAccepted)
	e.waitEvent("kept", "Normal", "Purged")
}

// countEvents counts the activity's events of a type and reason, by their series.
func countEvents(e *env, name, eventType, reason string) int {
	e.t.Helper()
	list := &eventsv1.EventList{}
	if err := e.c.List(context.Background(), list, client.InNamespace(e.ns)); err != nil {
		e.t.Fatal(err)
	}
	n := 0
	for _, ev := range list.Items {
		if ev.Regarding.Name == name && ev.Type == eventType && ev.Reason == reason {
			n++
			if ev.Series != nil {
				n += int(ev.Series.Count) - 1
			}
		}
	}
	return n
}
