package packaging

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
	"sigs.k8s.io/yaml"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
)

// The manifests a user installs and the grab workloads the operator creates are
// checked by the real kubeconform (a Go tool pinned in go.mod) against schemas taken
// from the real API server's OpenAPI document, with the project's CRDs installed,
// and by the checks of kube-linter's defaults that apply to them (kube-linter itself
// is not available as a Go module here: see lintObjects). Any finding fails.

// installObjects are what make render gives for a release version and what the
// chart renders with its defaults.
func installObjects(t *testing.T) map[string][]*unstructured.Unstructured {
	t.Helper()
	rendered := renderInstall(t, "v9.9.9")
	fromChart, err := renderChart(loadChart(t), nil)
	if err != nil {
		t.Fatalf("rendering the chart: %v", err)
	}
	return map[string][]*unstructured.Unstructured{"make render": rendered, "the chart": fromChart}
}

// grabWorkloadObjects are the grab workloads as the controller's builders make them:
// an activity's (with user tokens, on the operator's default Redis) and a budget's,
// each with its NetworkPolicy and PodDisruptionBudget.
func grabWorkloadObjects(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	a := &redpacketv1alpha1.RedPacketActivity{
		TypeMeta:   metav1.TypeMeta{APIVersion: redpacketv1alpha1.GroupVersion.String(), Kind: "RedPacketActivity"},
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "quiz", UID: "3f1c2b9a-0d4e-4c47-9a59-0b1e4f1d2c3a"},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{TotalAmount: 10000, Count: 100,
			GrabService: redpacketv1alpha1.GrabService{Auth: &redpacketv1alpha1.GrabAuth{
				TokenSecretRef: redpacketv1alpha1.SecretReference{Name: "grab-hmac"}}}},
	}
	b := &redpacketv1alpha1.RedPacketBudget{
		TypeMeta:   metav1.TypeMeta{APIVersion: redpacketv1alpha1.GroupVersion.String(), Kind: "RedPacketBudget"},
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "group", UID: "7a2d4c1e-5b3f-4e8a-9c6d-1f2e3a4b5c6d"},
		Spec:       redpacketv1alpha1.RedPacketBudgetSpec{Total: 100000, Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 1000}},
	}
	login := specs.RedisLogin{Username: "rpa-quiz", Password: strings.Repeat("ab", 32)}
	var applied []runtime.ApplyConfiguration
	applied = append(applied, specs.GrabObjects(specs.Grab{Activity: a, OperatorImage: "redpacket-operator:v9.9.9",
		TokenMaxLifetime: time.Hour, DefaultRedis: &login})...)
	applied = append(applied, specs.GrabScale(a, 2, "2"), specs.GrabRedisSecret(a, login),
		specs.BudgetGrabService(b), specs.BudgetRedisSecret(b, login),
		specs.BudgetGrabDeployment(specs.BudgetGrab{Budget: b, OperatorImage: "redpacket-operator:v9.9.9", DefaultRedis: &login}))
	var out []*unstructured.Unstructured
	for _, obj := range applied {
		u := toUnstructured(t, obj)
		if u.GetKind() == "Deployment" && u.GetName() == "quiz-grab" {
			if _, ok, _ := unstructured.NestedMap(u.Object, "spec", "template"); !ok {
				continue // GrabScale: the replica count alone, merged into the Deployment
			}
		}
		out = append(out, u)
	}
	guards := []struct {
		kind, apiVersion, name, ns string
		spec                       any
	}{
		{"NetworkPolicy", "networking.k8s.io/v1", specs.GrabName(a), a.Namespace, specs.GrabNetworkPolicySpec(specs.GrabSelector(a))},
		{"PodDisruptionBudget", "policy/v1", specs.GrabName(a), a.Namespace, specs.GrabDisruptionBudgetSpec(specs.GrabSelector(a))},
		{"NetworkPolicy", "networking.k8s.io/v1", specs.BudgetGrabName(b), b.Namespace, specs.GrabNetworkPolicySpec(specs.BudgetSelector(b))},
		{"PodDisruptionBudget", "policy/v1", specs.BudgetGrabName(b), b.Namespace, specs.GrabDisruptionBudgetSpec(specs.BudgetSelector(b))},
	}
	for _, g := range guards {
		out = append(out, toUnstructured(t, map[string]any{"apiVersion": g.apiVersion, "kind": g.kind,
			"metadata": map[string]any{"name": g.name, "namespace": g.ns}, "spec": g.spec}))
	}
	return out
}

// toUnstructured encodes obj as JSON and decodes it as an object.
func toUnstructured(t *testing.T, obj any) *unstructured.Unstructured {
	t.Helper()
	b, err := json.Marshal(obj)
	if err != nil {
		t.Fatal(err)
	}
	u := &unstructured.Unstructured{}
	if err := json.Unmarshal(b, &u.Object); err != nil {
		t.Fatal(err)
	}
	return u
}

// openAPISchemas writes, from the API server's OpenAPI v2 document, one JSON schema
// file per kind that objects use, named as kubeconformLocation says, each a reference
// into one shared definitions.json. The definitions are made strict as kubeconform's
// own strict schemas are: an object schema with properties admits no other property
// (unless it preserves unknown fields), and int-or-string and quantities take a
// string or a number, as the API server does.
func openAPISchemas(t *testing.T, e *liveEnv, objects []*unstructured.Unstructured) string {
	t.Helper()
	dc, err := discovery.NewDiscoveryClientForConfig(e.cp.Config)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := dc.RESTClient().Get().AbsPath("/openapi/v2").SetHeader("Accept", "application/json").DoRaw(t.Context())
	if err != nil {
		t.Fatalf("reading the API server's OpenAPI document: %v", err)
	}
	var doc struct {
		Definitions map[string]any `json:"definitions"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	byGVK := map[schema.GroupVersionKind]string{}
	for name, def := range doc.Definitions {
		m, _ := def.(map[string]any)
		gvks, _ := m["x-kubernetes-group-version-kind"].([]any)
		for _, g := range gvks {
			gm, _ := g.(map[string]any)
			gvk := schema.GroupVersionKind{Group: fmt.Sprint(gm["group"]), Version: fmt.Sprint(gm["version"]), Kind: fmt.Sprint(gm["kind"])}
			byGVK[gvk] = name
		}
		doc.Definitions[name] = strictSchema(def)
	}
	doc.Definitions["io.k8s.apimachinery.pkg.api.resource.Quantity"] = map[string]any{
		"oneOf": []any{map[string]any{"type": "string"}, map[string]any{"type": "number"}}}
	dir := t.TempDir()
	defs, err := json.Marshal(map[string]any{"definitions": doc.Definitions})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "definitions.json"), defs, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, o := range objects {
		gvk := o.GroupVersionKind()
		name, ok := byGVK[gvk]
		if !ok {
			t.Errorf("the API server has no schema of %s (%s)", gvk, key(o))
			continue
		}
		group := gvk.Group
		if group == "" {
			group = gvk.Version // kubeconform's .Group of apiVersion "v1"
		}
		file := filepath.Join(dir, fmt.Sprintf("%s_%s_%s.json", strings.ToLower(gvk.Kind), group, gvk.Version))
		b, _ := json.Marshal(map[string]any{"$ref": "definitions.json#/definitions/" + name})
		if err := os.WriteFile(file, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// kubeconformLocation is the schema location template of openAPISchemas' files.
const kubeconformLocation = "{{ .ResourceKind }}_{{ .Group }}_{{ .ResourceAPIVersion }}.json"

// strictSchema returns the schema s with every object schema closed to unknown
// properties and int-or-string fields open to both.
func strictSchema(s any) any {
	switch v := s.(type) {
	case map[string]any:
		if v["format"] == "int-or-string" || v["x-kubernetes-int-or-string"] == true {
			return map[string]any{"oneOf": []any{map[string]any{"type": "string"}, map[string]any{"type": "integer"}}}
		}
		out := map[string]any{}
		for k, x := range v {
			if k == "properties" {
				props := map[string]any{}
				for p, ps := range x.(map[string]any) {
					props[p] = strictSchema(ps)
				}
				out[k] = props
				continue
			}
			out[k] = strictSchema(x)
		}
		if _, has := v["properties"]; has && v["additionalProperties"] == nil && v["x-kubernetes-preserve-unknown-fields"] != true {
			out["additionalProperties"] = false
		}
		return out
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = strictSchema(x)
		}
		return out
	}
	return s
}

// writeYAML writes the objects as one YAML stream.
func writeYAML(t *testing.T, path string, objects []*unstructured.Unstructured) {
	t.Helper()
	var buf bytes.Buffer
	for _, o := range objects {
		b, err := yaml.Marshal(o.Object)
		if err != nil {
			t.Fatal(err)
		}
		buf.WriteString("---\n")
		buf.Write(b)
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestManifestsPassKubeconform runs kubeconform -strict on the rendered install (make
// render and the chart's defaults) and on the grab workloads the controller's
// builders make, with schemas from the real API server; a finding, or a kind without
// a schema, fails.
func TestManifestsPassKubeconform(t *testing.T) {
	e := startLive(t)
	sets := installObjects(t)
	sets["the grab workloads"] = grabWorkloadObjects(t)
	var all []*unstructured.Unstructured
	for _, objs := range sets {
		all = append(all, objs...)
	}
	dir := openAPISchemas(t, e, all)
	kubeconform := func(objs []*unstructured.Unstructured) ([]byte, error) {
		file := filepath.Join(t.TempDir(), "objects.yaml")
		writeYAML(t, file, objs)
		cmd := exec.Command("go", "tool", "kubeconform", "-strict", "-summary", "-output", "text",
			"-schema-location", filepath.Join(dir, kubeconformLocation), file)
		cmd.Dir = root
		return cmd.CombinedOutput()
	}
	for source, objs := range sets {
		out, err := kubeconform(objs)
		if err != nil {
			t.Errorf("kubeconform on %s (%d objects): %v\n%s", source, len(objs), err, out)
			continue
		}
		t.Logf("kubeconform on %s: %s", source, strings.TrimSpace(string(out)))
	}

	// The schemas are strict: a misspelt field of a grab container is a finding.
	var deployment *unstructured.Unstructured
	for _, o := range sets["the grab workloads"] {
		if o.GetKind() == "Deployment" {
			deployment = o.DeepCopy()
			break
		}
	}
	containers, _, _ := unstructured.NestedSlice(deployment.Object, "spec", "template", "spec", "containers")
	containers[0].(map[string]any)["memoryLimit"] = "256Mi"
	if err := unstructured.SetNestedSlice(deployment.Object, containers, "spec", "template", "spec", "containers"); err != nil {
		t.Fatal(err)
	}
	if out, err := kubeconform([]*unstructured.Unstructured{deployment}); err == nil || !strings.Contains(string(out), "memoryLimit") {
		t.Errorf("kubeconform passed a container with an unknown field: %v\n%s", err, out)
	}
}

// TestManifestsPassLinterChecks applies the checks of kube-linter's default set that
// bear on these objects (golang.stackrox.io/kube-linter is not served by the module
// proxy, so the test carries them): every container of a workload runs a pinned
// image (not latest, not untagged), requests CPU and memory and limits memory, has
// liveness and readiness probes, a read-only root filesystem, no privilege
// escalation, and runs as non-root; and no cluster-scoped object (as the real API
// server's discovery says) carries a namespace.
func TestManifestsPassLinterChecks(t *testing.T) {
	e := startLive(t)
	sets := installObjects(t)
	sets["the grab workloads"] = grabWorkloadObjects(t)
	dc, err := discovery.NewDiscoveryClientForConfig(e.cp.Config)
	if err != nil {
		t.Fatal(err)
	}
	_, lists, err := dc.ServerGroupsAndResources()
	if err != nil {
		t.Fatal(err)
	}
	namespaced := map[schema.GroupVersionKind]bool{}
	for _, l := range lists {
		gv, _ := schema.ParseGroupVersion(l.GroupVersion)
		for _, r := range l.APIResources {
			if !strings.Contains(r.Name, "/") {
				namespaced[gv.WithKind(r.Kind)] = r.Namespaced
			}
		}
	}
	for source, objs := range sets {
		for _, o := range objs {
			for _, finding := range lintObject(o, namespaced) {
				t.Errorf("%s: %s: %s", source, key(o), finding)
			}
		}
	}
}

// lintObject returns what the checks find wrong with o.
func lintObject(o *unstructured.Unstructured, namespaced map[schema.GroupVersionKind]bool) []string {
	var findings []string
	if ns, known := namespaced[o.GroupVersionKind()]; known && !ns && o.GetNamespace() != "" {
		findings = append(findings, fmt.Sprintf("cluster-scoped, yet carries namespace %q", o.GetNamespace()))
	}
	podSpec, ok, _ := unstructured.NestedMap(o.Object, "spec", "template", "spec")
	if !ok {
		return findings
	}
	podNonRoot, _, _ := unstructured.NestedBool(podSpec, "securityContext", "runAsNonRoot")
	containers, _, _ := unstructured.NestedSlice(podSpec, "containers")
	for _, c := range containers {
		cm := c.(map[string]any)
		name, _ := cm["name"].(string)
		bad := func(format string, args ...any) {
			findings = append(findings, fmt.Sprintf("container %s: ", name)+fmt.Sprintf(format, args...))
		}
		image, _ := cm["image"].(string)
		if ref := image[strings.LastIndex(image, "/")+1:]; !strings.Contains(ref, ":") && !strings.Contains(ref, "@") || strings.HasSuffix(ref, ":latest") {
			bad("image %q is not pinned to a version (latest-tag)", image)
		}
		if _, ok, _ := unstructured.NestedFieldNoCopy(cm, "resources", "requests", "cpu"); !ok {
			bad("no CPU request (unset-cpu-requirements)")
		}
		if _, ok, _ := unstructured.NestedFieldNoCopy(cm, "resources", "requests", "memory"); !ok {
			bad("no memory request (unset-memory-requirements)")
		}
		if _, ok, _ := unstructured.NestedFieldNoCopy(cm, "resources", "limits", "memory"); !ok {
			bad("no memory limit (unset-memory-requirements)")
		}
		for _, probe := range []string{"livenessProbe", "readinessProbe"} {
			if _, ok := cm[probe]; !ok {
				bad("no %s (no-%s-probe)", probe, strings.TrimSuffix(strings.ToLower(probe), "probe"))
			}
		}
		if ro, _, _ := unstructured.NestedBool(cm, "securityContext", "readOnlyRootFilesystem"); !ro {
			bad("root filesystem not read-only (no-read-only-root-fs)")
		}
		if esc, ok, _ := unstructured.NestedBool(cm, "securityContext", "allowPrivilegeEscalation"); !ok || esc {
			bad("privilege escalation not ruled out (privilege-escalation-container)")
		}
		if nonRoot, ok, _ := unstructured.NestedBool(cm, "securityContext", "runAsNonRoot"); !(ok && nonRoot || !ok && podNonRoot) {
			bad("may run as root (run-as-non-root)")
		}
	}
	return findings
}

// The lint checks find what they claim to: a table of objects with one fault each.
func TestLintObjectFindsEachFault(t *testing.T) {
	good := func() map[string]any {
		return map[string]any{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": map[string]any{"name": "d", "namespace": "ns"},
			"spec": map[string]any{"template": map[string]any{"spec": map[string]any{
				"securityContext": map[string]any{"runAsNonRoot": true},
				"containers": []any{map[string]any{"name": "c", "image": "example/app:v1",
					"resources":       map[string]any{"requests": map[string]any{"cpu": "100m", "memory": "64Mi"}, "limits": map[string]any{"memory": "256Mi"}},
					"livenessProbe":   map[string]any{},
					"readinessProbe":  map[string]any{},
					"securityContext": map[string]any{"readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false}}}}}}}
	}
	container := func(m map[string]any) map[string]any {
		return m["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)["containers"].([]any)[0].(map[string]any)
	}
	namespaced := map[schema.GroupVersionKind]bool{{Group: "apps", Version: "v1", Kind: "Deployment"}: true,
		{Group: "admissionregistration.k8s.io", Version: "v1", Kind: "ValidatingAdmissionPolicy"}: false}
	if f := lintObject(&unstructured.Unstructured{Object: good()}, namespaced); len(f) != 0 {
		t.Fatalf("a good Deployment: %v", f)
	}
	for want, mutate := range map[string]func(map[string]any){
		"latest-tag":      func(m map[string]any) { container(m)["image"] = "example/app:latest" },
		"not pinned":      func(m map[string]any) { container(m)["image"] = "registry:5000/app" },
		"no memory limit": func(m map[string]any) { delete(container(m)["resources"].(map[string]any), "limits") },
		"no CPU request": func(m map[string]any) {
			delete(container(m)["resources"].(map[string]any)["requests"].(map[string]any), "cpu")
		},
		"no-liveness-probe": func(m map[string]any) { delete(container(m), "livenessProbe") },
		"no-read-only-root-fs": func(m map[string]any) {
			delete(container(m)["securityContext"].(map[string]any), "readOnlyRootFilesystem")
		},
		"privilege-escalation-container": func(m map[string]any) {
			container(m)["securityContext"].(map[string]any)["allowPrivilegeEscalation"] = true
		},
		"run-as-non-root": func(m map[string]any) {
			delete(m["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any), "securityContext")
		},
		"cluster-scoped": func(m map[string]any) {
			m["apiVersion"], m["kind"] = "admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"
			delete(m, "spec")
		},
	} {
		m := good()
		mutate(m)
		f := lintObject(&unstructured.Unstructured{Object: m}, namespaced)
		if len(f) != 1 || !strings.Contains(f[0], want) {
			t.Errorf("%s: findings %v, want one naming it", want, f)
		}
	}
}
