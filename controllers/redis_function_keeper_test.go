package controllers_test

import (
	"context"
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/wait"
)

// The controller's "load scripts" step loads the grab-side function library, and
// the manager's function keeper loads it again within a second of each FUNCTION
// FLUSH while the activity lives.
func TestFunctionKeeperRestoresTheLibrary(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := t.Context()
	// A Redis that never had the library (the test servers start with it).
	if err := e.rdb.FunctionFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	e.startController(nil)
	e.create(e.activity("keeper", 1000, 10))
	e.waitPhase("keeper", redpacketv1alpha1.PhaseActive, 20*time.Second)
	if ok, err := lua.GrabLibrary.LoadedOn(ctx, e.rdb); err != nil || !ok {
		t.Fatalf("library %s after the activity went Active: loaded %v, %v", lua.GrabLibrary.Name(), ok, err)
	}
	for i := range 3 {
		if err := e.rdb.FunctionFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		flushed := time.Now()
		for {
			ok, err := lua.GrabLibrary.LoadedOn(ctx, e.rdb)
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				t.Logf("flush %d: library back after %v", i+1, time.Since(flushed).Round(time.Millisecond))
				break
			}
			if time.Since(flushed) > time.Second {
				t.Fatalf("flush %d: the library is still missing after %v", i+1, time.Since(flushed))
			}
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(150 * time.Millisecond)
	}
}

// oldLibrary is a function library of another release, as an older operator loaded
// it: an rpa_<hash8> name that is not this release's.
const oldLibrary = "rpa_00c0ffee"

// Issue 34, case 8: libraries of releases that no grab pod runs are deleted, and
// only those. Beside this release's library, Redis holds an older release's. The
// budget's grab Deployment names this release's library in its pod template. The old
// library stays while another grab Deployment names it, while a Deployment names no
// library (a custom image, or an older release's template), and while a Deployment
// rolls out (pods of its older template may still run); once none of these holds for
// the keeper's RetireAfter (1 s here), it is deleted, and this release's library is
// never deleted. Before, every library stayed callable forever.
func TestFunctionKeeperRetiresLibrariesNoGrabPodCalls(t *testing.T) {
	e := newEnv(t)
	ctx := t.Context()
	code := "#!lua name=" + oldLibrary + "\nredis.register_function('" + oldLibrary + "_ping', function() return 'old' end)"
	if err := e.rdb.FunctionLoad(ctx, code).Err(); err != nil {
		t.Fatal(err)
	}
	e.startBudgetController(nil, func(o *controllers.Options) { o.LibraryRetireAfter = time.Second })
	e.createBudget("retire", 1000)
	grab := e.waitDeployment("retire-grab")
	if got := grab.Spec.Template.Annotations[specs.AnnotationFunctionLibrary]; got != store.LibraryName {
		t.Fatalf("the budget's pod template names library %q, want %q", got, store.LibraryName)
	}
	loaded := func(name string) bool {
		t.Helper()
		libs, err := e.rdb.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: name}).Result()
		if err != nil {
			t.Fatal(err)
		}
		return len(libs) == 1
	}
	kept := func(why string) {
		t.Helper()
		time.Sleep(2500 * time.Millisecond) // over twice RetireAfter
		if !loaded(oldLibrary) {
			t.Fatalf("the old library was deleted %s", why)
		}
	}

	// Rolling out: the API server alone writes no Deployment status.
	kept("while the budget's Deployment rolls out")
	e.settleDeployment(grab)
	other := e.grabDeployment("old-release-grab", map[string]string{specs.AnnotationFunctionLibrary: oldLibrary})
	kept("while a grab Deployment names it")
	other.Spec.Template.Annotations = nil
	if err := e.c.Update(ctx, other); err != nil {
		t.Fatal(err)
	}
	e.settleDeployment(other)
	kept("while a grab Deployment names no library")

	if err := e.c.Delete(ctx, other); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "the old library deleted", func() (bool, string) {
		return !loaded(oldLibrary), "still loaded"
	})
	if !loaded(store.LibraryName) {
		t.Fatalf("this release's library %s was deleted", store.LibraryName)
	}
}

// createBudget creates the budget name of total over 2 shards, without settlement.
func (e *env) createBudget(name string, total int64) {
	e.t.Helper()
	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{Total: total, BudgetShards: 2,
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: total, MaxCount: 10}},
	}
	if err := e.c.Create(context.Background(), b); err != nil {
		e.t.Fatal(err)
	}
}

// waitDeployment waits until the Deployment name exists, and returns it.
func (e *env) waitDeployment(name string) *appsv1.Deployment {
	e.t.Helper()
	d := &appsv1.Deployment{}
	wait.Until(e.t, 20*time.Second, "Deployment "+name, func() (bool, string) {
		err := e.c.Get(context.Background(), client.ObjectKey{Namespace: e.ns, Name: name}, d)
		return err == nil, fmt.Sprint(err)
	})
	return d
}

// settleDeployment writes the status a Deployment controller writes once every pod
// runs the current template.
func (e *env) settleDeployment(d *appsv1.Deployment) {
	e.t.Helper()
	if err := e.c.Get(context.Background(), client.ObjectKeyFromObject(d), d); err != nil {
		e.t.Fatal(err)
	}
	d.Status = appsv1.DeploymentStatus{ObservedGeneration: d.Generation, Replicas: 1, UpdatedReplicas: 1, ReadyReplicas: 1, AvailableReplicas: 1}
	if err := e.c.Status().Update(context.Background(), d); err != nil {
		e.t.Fatal(err)
	}
}

// grabDeployment creates a grab Deployment as another release left it, its pod
// template annotated with annotations, and its status settled.
func (e *env) grabDeployment(name string, annotations map[string]string) *appsv1.Deployment {
	e.t.Helper()
	labels := maps.Clone(specs.GrabWorkloadLabels())
	labels["redpacket.io/activity"] = name
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Labels: labels},
		Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels, Annotations: annotations},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "grab", Image: "registry.example/redpacket-operator:old"}}},
			},
		},
	}
	if err := e.c.Create(context.Background(), d); err != nil {
		e.t.Fatal(err)
	}
	e.settleDeployment(d)
	return d
}
