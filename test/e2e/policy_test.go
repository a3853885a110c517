package e2e

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/test/controlplane"
)

// TestGrabServiceAccountWritesOnlyReportedStatusFields installs the admission
// policy of config/policy on the real API server and acts as an activity's grab
// ServiceAccount (impersonated, with the Role and RoleBinding the operator made):
// the grab service's own status report (grabsvc.Reporter, server-side apply under
// its field manager) passes, while a patch of seededTime, of a condition, of the
// phase, or the removal of scriptSHA is refused with a message naming the field, and
// leaves the status as it was.
func TestGrabServiceAccountWritesOnlyReportedStatusFields(t *testing.T) {
	mustKubectl(t, "", "apply", "-k", filepath.Join(env.root, "config", "policy"))
	t.Cleanup(func() {
		_, _, _ = kubectl(t, "", "delete", "-k", filepath.Join(env.root, "config", "policy"), "--ignore-not-found")
	})
	ns := namespace(t, "e2e-policy")
	const name = "owned"
	path := writeFile(t, "owned.yaml", manifest(ns, name, "  totalAmount: 1000\n  count: 10\n  sponsor: merchant-policy\n"))
	mustKubectl(t, "", "apply", "-f", path)
	mustKubectl(t, "", "wait", "--for=condition=Seeded", "rpa/"+name, "-n", ns, "--timeout=90s")

	admin, asGrab := policyClients(t, ns, name+"-grab")
	ctx := t.Context()
	key := client.ObjectKey{Namespace: ns, Name: name}
	// The controller's fields are there, and so is the grab workload's Role: the grab
	// ServiceAccount can read its activity.
	before := &redpacketv1alpha1.RedPacketActivity{}
	eventually(t, 60*time.Second, "seededTime, scriptSHA and the grab Role", func() error {
		if err := admin.Get(ctx, key, before); err != nil {
			return err
		}
		if before.Status.SeededTime == nil || before.Status.ScriptSHA == "" {
			return fmt.Errorf("status %+v", before.Status)
		}
		return asGrab.Get(ctx, key, &redpacketv1alpha1.RedPacketActivity{})
	})

	// The policy is compiled and loaded in the background: wait until a dry run of
	// a forbidden patch is refused, so no real write happens without it.
	seededPatch := statusMergePatch(map[string]any{"seededTime": "2001-01-01T00:00:00Z"})
	eventually(t, 30*time.Second, "the policy to refuse a dry-run patch of seededTime", func() error {
		err := asGrab.Status().Patch(ctx, before.DeepCopy(), seededPatch, client.DryRunAll)
		if err == nil {
			return fmt.Errorf("the dry run was allowed")
		}
		if !strings.Contains(err.Error(), "seededTime") {
			return fmt.Errorf("refused for another reason: %w", err)
		}
		return nil
	})

	// The grab service's own report passes, as the grab ServiceAccount.
	act := &redpacketv1alpha1.RedPacketActivity{}
	if err := asGrab.Get(ctx, key, act); err != nil {
		t.Fatalf("the grab ServiceAccount reads its activity: %v", err)
	}
	reporter := &grabsvc.Reporter{Client: asGrab, Redis: env.redis, Resource: func() *grabsvc.Resource { return grabsvc.NewResource(act) }}
	applied, err := reporter.ReportOnce(ctx)
	if err != nil || !applied {
		t.Fatalf("the grab service's report as its ServiceAccount: applied %t, %v", applied, err)
	}
	reported := &redpacketv1alpha1.RedPacketActivity{}
	if err := admin.Get(ctx, key, reported); err != nil {
		t.Fatal(err)
	}
	if reported.Status.LastReportTime == nil || reported.Status.RemainingCount == nil || *reported.Status.RemainingCount != 10 {
		t.Fatalf("the report did not land: %+v", reported.Status)
	}

	// Everything else is refused, whatever the patch type.
	ready := map[string]any{"type": redpacketv1alpha1.ConditionReady, "status": "True", "reason": "Forged",
		"message": "forged", "lastTransitionTime": "2001-01-01T00:00:00Z"}
	applyCondition := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": redpacketv1alpha1.GroupVersion.String(), "kind": "RedPacketActivity",
		"metadata": map[string]any{"name": name, "namespace": ns},
		"status":   map[string]any{"conditions": []any{ready}},
	}}
	for _, c := range []struct {
		what  string
		field string
		write func() error
	}{
		{"a merge patch of seededTime", "seededTime", func() error {
			return asGrab.Status().Patch(ctx, reported.DeepCopy(), seededPatch)
		}},
		{"a merge patch of the phase and a counter", "phase", func() error {
			return asGrab.Status().Patch(ctx, reported.DeepCopy(), statusMergePatch(map[string]any{"phase": "Exhausted", "remainingCount": 0}))
		}},
		{"a merge patch removing scriptSHA", "scriptSHA", func() error {
			return asGrab.Status().Patch(ctx, reported.DeepCopy(), statusMergePatch(map[string]any{"scriptSHA": nil}))
		}},
		{"a server-side apply of a Ready condition under the grab service's field manager", "conditions", func() error {
			return asGrab.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(applyCondition.DeepCopy()),
				client.FieldOwner(grabsvc.FieldManager), client.ForceOwnership)
		}},
		{"a JSON patch appending a condition", "conditions", func() error {
			forged := map[string]any{"type": "Forged", "status": "True", "reason": "Forged", "message": "forged",
				"lastTransitionTime": "2001-01-01T00:00:00Z"}
			patch := mustJSON([]map[string]any{{"op": "add", "path": "/status/conditions/-", "value": forged}})
			return asGrab.Status().Patch(ctx, reported.DeepCopy(), client.RawPatch(types.JSONPatchType, patch))
		}},
	} {
		err := c.write()
		if err == nil {
			t.Fatalf("%s by the grab ServiceAccount was allowed", c.what)
		}
		if !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), c.field) ||
			!strings.Contains(err.Error(), "grab ServiceAccount") {
			t.Fatalf("%s: refused with %v; want the policy's refusal naming %s", c.what, err, c.field)
		}
	}
	after := &redpacketv1alpha1.RedPacketActivity{}
	if err := admin.Get(ctx, key, after); err != nil {
		t.Fatal(err)
	}
	if !after.Status.SeededTime.Equal(before.Status.SeededTime) || after.Status.ScriptSHA != before.Status.ScriptSHA ||
		after.Status.Phase == redpacketv1alpha1.PhaseExhausted {
		t.Fatalf("refused writes changed the status: %+v -> %+v", before.Status, after.Status)
	}
	for _, cond := range after.Status.Conditions {
		if cond.Reason == "Forged" {
			t.Fatalf("a forged condition landed: %+v", cond)
		}
	}
}

// policyClients returns an administrator's client and one that impersonates the
// ServiceAccount sa of namespace ns, as the API server authenticates a pod's token.
func policyClients(t *testing.T, ns, sa string) (client.Client, client.Client) {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", env.kubeconfig)
	if err != nil {
		t.Fatalf("loading the kubeconfig: %v", err)
	}
	scheme := controlplane.NewScheme()
	admin, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	impersonated := rest.CopyConfig(cfg)
	impersonated.Impersonate = rest.ImpersonationConfig{
		UserName: "system:serviceaccount:" + ns + ":" + sa,
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
	}
	asSA, err := client.New(impersonated, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	return admin, asSA
}

// statusMergePatch is a JSON merge patch of the given status fields.
func statusMergePatch(fields map[string]any) client.Patch {
	return client.RawPatch(types.MergePatchType, mustJSON(map[string]any{"status": fields}))
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}
