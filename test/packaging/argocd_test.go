package packaging

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	lua "github.com/yuin/gopher-lua"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// health is what an Argo CD health script returns.
type health struct {
	Status, Message string
}

// runHealthScript runs an Argo CD health.lua against obj the way Argo CD does: in
// gopher-lua, with the object as the global table obj, the script's return value a
// table with status and message.
func runHealthScript(t *testing.T, script string, obj map[string]any) health {
	t.Helper()
	L := lua.NewState(lua.Options{SkipOpenLibs: false})
	defer L.Close()
	L.SetGlobal("obj", toLua(L, obj))
	if err := L.DoString(script); err != nil {
		t.Fatalf("health.lua: %v", err)
	}
	ret, ok := L.Get(-1).(*lua.LTable)
	if !ok {
		t.Fatalf("health.lua returned %s, want a table", L.Get(-1).Type())
	}
	return health{Status: lua.LVAsString(ret.RawGetString("status")), Message: lua.LVAsString(ret.RawGetString("message"))}
}

// toLua converts a decoded JSON value into Lua values: objects and arrays become
// tables (arrays indexed from 1), numbers LNumber, as Argo CD's conversion does.
func toLua(L *lua.LState, v any) lua.LValue {
	switch x := v.(type) {
	case nil:
		return lua.LNil
	case bool:
		return lua.LBool(x)
	case string:
		return lua.LString(x)
	case int64:
		return lua.LNumber(x)
	case float64:
		return lua.LNumber(x)
	case map[string]any:
		tbl := L.NewTable()
		for k, e := range x {
			tbl.RawSetString(k, toLua(L, e))
		}
		return tbl
	case []any:
		tbl := L.NewTable()
		for _, e := range x {
			tbl.Append(toLua(L, e))
		}
		return tbl
	default:
		panic(fmt.Sprintf("toLua: unexpected %T", v))
	}
}

// asJSONMap is the object as the API server serves it, decoded from JSON.
func asJSONMap(t *testing.T, a *redpacketv1alpha1.RedPacketActivity) map[string]any {
	t.Helper()
	u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(a)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(u)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestArgoCDHealth drives real activities through the manager, a real Redis and
// real grab services into the states Argo CD users see, takes each status as the API
// server served it, and runs config/argocd/health.lua on it in gopher-lua: open and
// Ready is Healthy, paused is Suspended, seeding (and waiting for a grab replica, and
// a spec change not acted on yet) is Progressing, an activity whose Redis lost its
// data is Degraded, and Exhausted and Expired are Healthy.
func TestArgoCDHealth(t *testing.T) {
	scriptBytes, err := os.ReadFile(filepath.Join(root, "config", "argocd", "health.lua"))
	if err != nil {
		t.Fatal(err)
	}
	script := string(scriptBytes)
	checkArgoPatch(t, script)

	e := startLive(t)
	e.dumpLogs(t)
	ns := e.namespace(t)
	aw := e.watchActivities(t, ns)
	ctx := t.Context()
	create := func(a *redpacketv1alpha1.RedPacketActivity) {
		t.Helper()
		if err := e.client.Create(ctx, a); err != nil {
			t.Fatalf("creating %s: %v", a.Name, err)
		}
	}
	ready := func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return meta.IsStatusConditionTrue(a.Status.Conditions, redpacketv1alpha1.ConditionReady) &&
			a.Status.ObservedGeneration == a.Generation
	}
	inPhase := func(p redpacketv1alpha1.Phase) func(*redpacketv1alpha1.RedPacketActivity) bool {
		return func(a *redpacketv1alpha1.RedPacketActivity) bool { return a.Status.Phase == p }
	}
	const within = 90 * time.Second

	// A large activity: its status shows Seeding while the packets are written.
	create(newActivity(ns, "seeding", 4_000_000, 400_000))
	// Open, with a grab service answering.
	create(newActivity(ns, "open", 10_000, 100))
	// Paused by spec.
	paused := newActivity(ns, "paused", 10_000, 100)
	paused.Spec.Paused = true
	create(paused)
	// Three packets, all claimed.
	create(newActivity(ns, "exhausted", 300, 3))
	// Closes two seconds from now; no grab service is needed for Expired.
	expired := newActivity(ns, "expired", 1_000, 10)
	end := metav1.NewTime(time.Now().Add(3 * time.Second))
	expired.Spec.EndTime = &end
	create(expired)
	// Seeded, without a grab replica; then its Redis keys vanish.
	create(newActivity(ns, "lost", 1_000, 10))

	e.startGrab(t, ns, "open")
	e.startGrab(t, ns, "paused")
	exhaustedURL := e.startGrab(t, ns, "exhausted")

	seeding := aw.await(t, "seeding", "phase Seeding", within, inPhase(redpacketv1alpha1.PhaseSeeding))
	open := aw.await(t, "open", "Ready in phase Active", within, func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return ready(a) && a.Status.Phase == redpacketv1alpha1.PhaseActive
	})
	pausedNow := aw.await(t, "paused", "Ready in phase Paused", within, func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return ready(a) && a.Status.Phase == redpacketv1alpha1.PhasePaused
	})

	// A spec change the controller has not acted on yet: the first version with the
	// new generation.
	var fresh redpacketv1alpha1.RedPacketActivity
	if err := e.client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "open"}, &fresh); err != nil {
		t.Fatal(err)
	}
	patch := client.MergeFrom(fresh.DeepCopy())
	fresh.Spec.Sponsor = "merchant-002"
	if err := e.client.Patch(ctx, &fresh, patch); err != nil {
		t.Fatal(err)
	}
	newGeneration := fresh.Generation
	if newGeneration < 2 {
		t.Fatalf("patching the spec left generation %d", newGeneration)
	}
	changed := aw.await(t, "open", "a new generation", within, func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return a.Generation == newGeneration && a.Status.ObservedGeneration < newGeneration
	})

	for _, user := range []string{"u1", "u2", "u3"} {
		resp, err := http.Post(exhaustedURL+"/v1/grab", "application/json", strings.NewReader(`{"userId":"`+user+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("grab for %s: HTTP %d", user, resp.StatusCode)
		}
	}
	exhausted := aw.await(t, "exhausted", "Ready in phase Exhausted", within, func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return ready(a) && a.Status.Phase == redpacketv1alpha1.PhaseExhausted
	})
	expiredNow := aw.await(t, "expired", "Ready in phase Expired", within, func(a *redpacketv1alpha1.RedPacketActivity) bool {
		return ready(a) && a.Status.Phase == redpacketv1alpha1.PhaseExpired
	})

	waiting := aw.await(t, "lost", "seeded without a grab replica", within, func(a *redpacketv1alpha1.RedPacketActivity) bool {
		c := meta.FindStatusCondition(a.Status.Conditions, redpacketv1alpha1.ConditionReady)
		return meta.IsStatusConditionTrue(a.Status.Conditions, redpacketv1alpha1.ConditionSeeded) &&
			c != nil && c.Reason == redpacketv1alpha1.ReasonGrabServiceUnavailable
	})
	if n, err := e.redis.Del(ctx, store.NewActivity(e.redis, string(waiting.UID), 1).Shard(0).Keys().All()...).Result(); err != nil || n == 0 {
		t.Fatalf("deleting the Redis keys of %s: %d keys, %v", waiting.Name, n, err)
	}
	var lostNow redpacketv1alpha1.RedPacketActivity
	if err := e.client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "lost"}, &lostNow); err != nil {
		t.Fatal(err)
	}
	patch = client.MergeFrom(lostNow.DeepCopy())
	metav1.SetMetaDataAnnotation(&lostNow.ObjectMeta, "test.redpacket.io/nudge", "1")
	if err := e.client.Patch(ctx, &lostNow, patch); err != nil {
		t.Fatal(err)
	}
	lost := aw.await(t, "lost", "phase Failed", within, inPhase(redpacketv1alpha1.PhaseFailed))

	for _, tc := range []struct {
		name        string
		obj         *redpacketv1alpha1.RedPacketActivity
		want        string
		wantMessage string
	}{
		{"open and Ready", open, "Healthy", "Active"},
		{"paused", pausedNow, "Suspended", ""},
		{"seeding", seeding, "Progressing", "eeding"},
		{"spec change not acted on yet", changed, "Progressing", "generation 2"},
		{"seeded, no grab replica yet", waiting, "Progressing", "GrabServiceUnavailable"},
		{"Redis lost the data", lost, "Degraded", "DataLost"},
		{"exhausted", exhausted, "Healthy", "Exhausted"},
		{"expired", expiredNow, "Healthy", "Expired"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := runHealthScript(t, script, asJSONMap(t, tc.obj))
			if got.Status != tc.want {
				y, _ := yaml.Marshal(tc.obj.Status)
				t.Fatalf("health %s (%q), want %s; status:\n%s", got.Status, got.Message, tc.want, y)
			}
			if got.Message == "" || !strings.Contains(got.Message, tc.wantMessage) {
				t.Errorf("health message %q does not contain %q", got.Message, tc.wantMessage)
			}
			t.Logf("phase %s: %s, %q", tc.obj.Status.Phase, got.Status, got.Message)
		})
	}

	// No status at all yet: Progressing.
	if got := runHealthScript(t, script, map[string]any{"metadata": map[string]any{"generation": int64(1)}}); got.Status != "Progressing" {
		t.Errorf("an activity without status is %s, want Progressing", got.Status)
	}
}

// checkArgoPatch checks that config/argocd/argocd-cm-patch.yaml carries health.lua
// under the keys Argo CD reads for group redpacket.io, kinds RedPacketActivity and
// RedPacketBudget.
func checkArgoPatch(t *testing.T, script string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "config", "argocd", "argocd-cm-patch.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var patch struct {
		Data map[string]string `json:"data"`
	}
	if err := yaml.Unmarshal(b, &patch); err != nil {
		t.Fatalf("argocd-cm-patch.yaml: %v", err)
	}
	for _, kind := range []string{"RedPacketActivity", "RedPacketBudget"} {
		got, ok := patch.Data["resource.customizations.health.redpacket.io_"+kind]
		if !ok {
			t.Fatalf("argocd-cm-patch.yaml has no health customization for redpacket.io/%s: keys %v", kind, patch.Data)
		}
		if got != script {
			t.Errorf("argocd-cm-patch.yaml does not hold config/argocd/health.lua as it is for %s: run make chart", kind)
		}
	}
}

// The same health.lua reads a RedPacketBudget, which has no phase: money that does
// not add up (Stalled ConservationBroken) or a Redis that does not answer is
// Degraded, a budget waiting for its grab replica or not yet configured is
// Progressing, and a Ready one is Healthy.
func TestArgoCDHealthOfABudget(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(root, "config", "argocd", "health.lua"))
	if err != nil {
		t.Fatal(err)
	}
	script := string(raw)
	checkArgoPatch(t, script)
	budget := func(conds ...metav1.Condition) map[string]any {
		b := &redpacketv1alpha1.RedPacketBudget{ObjectMeta: metav1.ObjectMeta{Name: "group", Namespace: "shop", Generation: 2}}
		b.Status.ObservedGeneration = 2
		b.Status.Conditions = conds
		u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(b)
		if err != nil {
			t.Fatal(err)
		}
		j, err := json.Marshal(u)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(j, &m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	cond := func(typ string, status metav1.ConditionStatus, reason string) metav1.Condition {
		return metav1.Condition{Type: typ, Status: status, Reason: reason, Message: reason + " here"}
	}
	for _, tc := range []struct {
		name string
		obj  map[string]any
		want string
	}{
		{"ready", budget(cond("Ready", metav1.ConditionTrue, "Ready")), "Healthy"},
		{"conservation broken", budget(cond("Ready", metav1.ConditionFalse, "ConservationBroken"),
			cond("Stalled", metav1.ConditionTrue, "ConservationBroken")), "Degraded"},
		{"redis down", budget(cond("Ready", metav1.ConditionFalse, "RedisUnavailable")), "Degraded"},
		{"waiting for a grab replica", budget(cond("Ready", metav1.ConditionFalse, "GrabServiceUnavailable")), "Progressing"},
		{"no status yet", map[string]any{"metadata": map[string]any{"name": "group"}}, "Progressing"},
	} {
		if got := runHealthScript(t, script, tc.obj); got.Status != tc.want {
			t.Errorf("%s: %s (%s), want %s", tc.name, got.Status, got.Message, tc.want)
		}
	}
}
