// Package policy_test evaluates the admission policies of config/policy with the
// API server's own CEL admission library (k8s.io/apiserver, the version the
// kube-apiserver of bin/ is built from): compiled as the API server compiles a
// ValidatingAdmissionPolicy, evaluated on tables of requests. It needs no server; the
// tests that send the same requests to a real API server are in controllers
// (TestPlatformDecisionsNeedThePlatformRole, TestGrabStatusPolicyAllowsOnlyMonotonicReports)
// and test/e2e.
package policy_test

import (
	"context"
	"os"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/admission"
	plugincel "k8s.io/apiserver/pkg/admission/plugin/cel"
	"k8s.io/apiserver/pkg/admission/plugin/policy/validating"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/authorization/authorizer"
	"k8s.io/apiserver/pkg/cel/environment"
	"sigs.k8s.io/yaml"
)

// authz allows everything or nothing: the verb check of a platform decision.
type authz struct{ allow bool }

func (a authz) Authorize(context.Context, authorizer.Attributes) (authorizer.Decision, string, error) {
	if a.allow {
		return authorizer.DecisionAllow, "", nil
	}
	return authorizer.DecisionDeny, "no", nil
}

// load reads the policy, the first document of the file.
func load(t *testing.T, path string) *admissionregistrationv1.ValidatingAdmissionPolicy {
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	doc, _, _ := strings.Cut(string(data), "\n---\n")
	p := &admissionregistrationv1.ValidatingAdmissionPolicy{}
	if err := yaml.UnmarshalStrict([]byte(doc), p); err != nil {
		t.Fatal(err)
	}
	return p
}

// compile compiles the policy as the API server's validating admission plugin does
// (k8s.io/apiserver/pkg/admission/plugin/policy/validating, compilePolicy).
func compile(t *testing.T, p *admissionregistrationv1.ValidatingAdmissionPolicy) validating.Validator {
	env := environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion())
	c, err := plugincel.NewCompositedCompiler(env)
	if err != nil {
		t.Fatal(err)
	}
	opts := plugincel.OptionalVariableDeclarations{HasAuthorizer: true}
	var vars []plugincel.NamedExpressionAccessor
	for _, v := range p.Spec.Variables {
		vars = append(vars, &validating.Variable{Name: v.Name, Expression: v.Expression})
	}
	c.CompileAndStoreVariables(vars, opts, environment.StoredExpressions)
	var vals, msgs []plugincel.ExpressionAccessor
	for _, v := range p.Spec.Validations {
		vals = append(vals, &validating.ValidationCondition{Expression: v.Expression, Message: v.Message, Reason: v.Reason})
		msgs = append(msgs, &validating.MessageExpressionCondition{MessageExpression: v.MessageExpression})
	}
	fp := admissionregistrationv1.Fail
	return validating.NewValidator(c.CompileCondition(vals, opts, environment.StoredExpressions), nil,
		c.CompileCondition(nil, opts, environment.StoredExpressions),
		c.CompileCondition(msgs, plugincel.OptionalVariableDeclarations{}, environment.StoredExpressions), &fp, nil)
}

// obj is an activity in namespace "ns" with the given annotations and status.
func obj(name string, annotations map[string]any, status map[string]any) *unstructured.Unstructured {
	o := map[string]any{"apiVersion": "redpacket.io/v1alpha1", "kind": "RedPacketActivity",
		"metadata": map[string]any{"name": name, "namespace": "ns"}}
	if annotations != nil {
		o["metadata"].(map[string]any)["annotations"] = annotations
	}
	if status != nil {
		o["status"] = status
	}
	return &unstructured.Unstructured{Object: o}
}

// run admits newO (an update of oldO, or a create when oldO is nil) on subresource
// sub as username in groups, and returns the denials, "" when admitted.
func run(t *testing.T, v validating.Validator, newO, oldO *unstructured.Unstructured, sub, username string, groups []string, allow bool) string {
	gvr := schema.GroupVersionResource{Group: "redpacket.io", Version: "v1alpha1", Resource: "redpacketactivities"}
	op := admission.Update
	var oldObj any = oldO
	if oldO == nil {
		op = admission.Create
		oldObj = nil
	}
	var attr admission.Attributes
	if oldObj == nil {
		attr = admission.NewAttributesRecord(newO, nil, newO.GroupVersionKind(), "ns", newO.GetName(), gvr, sub, op, nil, false, &user.DefaultInfo{Name: username, Groups: groups})
	} else {
		attr = admission.NewAttributesRecord(newO, oldO, newO.GroupVersionKind(), "ns", newO.GetName(), gvr, sub, op, nil, false, &user.DefaultInfo{Name: username, Groups: groups})
	}
	vattr := &admission.VersionedAttributes{Attributes: attr, VersionedKind: newO.GroupVersionKind(), VersionedObject: admission.NewLazyObject(newO)}
	if oldO != nil {
		vattr.VersionedOldObject = admission.NewLazyObject(oldO)
	}
	res := v.Validate(context.Background(), gvr, vattr, nil, nil, 10000000, authorizer.UnconditionalAuthorizer(authz{allow}))
	var out []string
	for _, d := range res.Decisions {
		if d.Action != validating.ActionAdmit {
			out = append(out, string(d.Action)+": "+d.Message)
		}
	}
	return strings.Join(out, " | ")
}

// The grab ServiceAccount's status writes: only its own activity's, only monotonic
// within one Redis epoch, watermarks only of the current epoch.
func TestGrabStatusPolicyTable(t *testing.T) {
	v := compile(t, load(t, "../../config/policy/grab_status_policy.yaml"))
	if err := v.CompileError(); err != nil {
		t.Fatal(err)
	}
	sa := "system:serviceaccount:ns:owned-grab"
	base := func() map[string]any {
		return map[string]any{"phase": "Active", "claimedCount": int64(2), "claimedAmount": int64(200), "remainingCount": int64(8), "remainingAmount": int64(800),
			"shardWatermarks": map[string]any{"epoch": int64(0), "claimedCounts": []any{int64(1), int64(1)}}}
	}
	with := func(m map[string]any, kv ...any) map[string]any {
		for i := 0; i < len(kv); i += 2 {
			if kv[i+1] == nil {
				delete(m, kv[i].(string))
			} else {
				m[kv[i].(string)] = kv[i+1]
			}
		}
		return m
	}
	cases := []struct {
		name     string
		old, new map[string]any
		user     string
		objName  string
		wantDeny bool
	}{
		{"first report", map[string]any{"phase": "Active"}, base(), sa, "owned", false},
		{"raise", base(), with(base(), "claimedCount", int64(3), "claimedAmount", int64(300), "remainingCount", int64(7), "remainingAmount", int64(700),
			"shardWatermarks", map[string]any{"epoch": int64(0), "claimedCounts": []any{int64(2), int64(1)}}), sa, "owned", false},
		{"same", base(), base(), sa, "owned", false},
		{"lower claimed", base(), with(base(), "claimedCount", int64(1)), sa, "owned", true},
		{"raise remaining", base(), with(base(), "remainingCount", int64(9)), sa, "owned", true},
		{"remove claimed", base(), with(base(), "claimedCount", nil), sa, "owned", true},
		{"lower mark", base(), with(base(), "shardWatermarks", map[string]any{"epoch": int64(0), "claimedCounts": []any{int64(0), int64(1)}}), sa, "owned", true},
		{"shorter marks", base(), with(base(), "shardWatermarks", map[string]any{"epoch": int64(0), "claimedCounts": []any{int64(1)}}), sa, "owned", true},
		{"drop marks", base(), with(base(), "shardWatermarks", nil), sa, "owned", true},
		{"other epoch marks", base(), with(base(), "shardWatermarks", map[string]any{"epoch": int64(5), "claimedCounts": []any{int64(9), int64(9)}}), sa, "owned", true},
		{"new epoch after bump", with(base(), "redisEpoch", int64(1)), with(base(), "redisEpoch", int64(1), "shardWatermarks", map[string]any{"epoch": int64(1), "claimedCounts": []any{int64(0), int64(0)}}), sa, "owned", false},
		{"old epoch marks after bump", with(base(), "redisEpoch", int64(1)), with(base(), "redisEpoch", int64(1), "shardWatermarks", map[string]any{"epoch": int64(0), "claimedCounts": []any{int64(3), int64(3)}}), sa, "owned", true},
		{"deadletters down", with(base(), "deadLetterCount", int64(2)), with(base(), "deadLetterCount", int64(1)), sa, "owned", false},
		{"other activity", base(), with(base(), "claimedCount", int64(3)), "system:serviceaccount:ns:other-grab", "owned", true},
		{"raise epoch", base(), with(base(), "redisEpoch", int64(1)), sa, "owned", true},
	}
	for _, tc := range cases {
		got := run(t, v, obj(tc.objName, nil, tc.new), obj(tc.objName, nil, tc.old), "status", tc.user, nil, true)
		if (got != "") != tc.wantDeny {
			t.Errorf("%s: %q, want deny %t", tc.name, got, tc.wantDeny)
		} else {
			t.Logf("%s: %s", tc.name, got)
		}
	}
}

// The platform decisions: only a user with the verb may set them, naming themselves
// (and, optionally, their own groups); anyone may leave them alone or remove them.
func TestPlatformAnnotationsPolicyTable(t *testing.T) {
	v := compile(t, load(t, "../../config/policy/platform_annotations_policy.yaml"))
	if err := v.CompileError(); err != nil {
		t.Fatal(err)
	}
	acc := "redpacket.io/accept-redis-state"
	by := "redpacket.io/accepted-by"
	cases := []struct {
		name     string
		old, new map[string]any
		user     string
		groups   []string
		allow    bool
		create   bool
		wantDeny bool
	}{
		{"unrelated", nil, map[string]any{"x": "y"}, "bob", nil, false, false, false},
		{"tenant sets accept", nil, map[string]any{acc: "0", by: "bob"}, "bob", nil, false, false, true},
		{"platform sets accept", nil, map[string]any{acc: "0", by: "alice"}, "alice", nil, true, false, false},
		{"platform without by", nil, map[string]any{acc: "0"}, "alice", nil, true, false, true},
		{"platform forging by", nil, map[string]any{acc: "0", by: "carol"}, "alice", nil, true, false, true},
		{"tenant forging by", map[string]any{acc: "0", by: "alice"}, map[string]any{acc: "0", by: "carol"}, "bob", nil, false, false, true},
		{"tenant keeps", map[string]any{acc: "0", by: "alice"}, map[string]any{acc: "0", by: "alice", "x": "1"}, "bob", nil, false, false, false},
		{"tenant removes", map[string]any{acc: "0", by: "alice"}, map[string]any{}, "bob", nil, false, false, false},
		{"platform groups ok", nil, map[string]any{acc: "0", by: "alice", "redpacket.io/accepted-by-groups": "ops,system:authenticated"}, "alice", []string{"ops", "system:authenticated"}, true, false, false},
		{"platform groups forged", nil, map[string]any{acc: "0", by: "alice", "redpacket.io/accepted-by-groups": "system:masters"}, "alice", []string{"ops"}, true, false, true},
		{"create with abandon tenant", nil, map[string]any{"redpacket.io/abandon": "u", "redpacket.io/abandoned-by": "bob"}, "bob", nil, false, true, true},
		{"create with abandon platform", nil, map[string]any{"redpacket.io/abandon": "u", "redpacket.io/abandoned-by": "alice"}, "alice", nil, true, true, false},
		{"create no annotations", nil, nil, "bob", nil, false, true, false},
	}
	for _, tc := range cases {
		var oldO *unstructured.Unstructured
		if !tc.create {
			oldO = obj("a", tc.old, nil)
		}
		got := run(t, v, obj("a", tc.new, nil), oldO, "", tc.user, tc.groups, tc.allow)
		if (got != "") != tc.wantDeny {
			t.Errorf("%s: %q, want deny %t", tc.name, got, tc.wantDeny)
		} else {
			t.Logf("%s: %s", tc.name, got)
		}
	}
}
