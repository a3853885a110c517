package packaging

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

const (
	chartDir         = "charts/redpacket-operator"
	releaseNamespace = "redpacket-system"
	// Labels and annotations only the chart sets.
	chartLabel     = "helm.sh/chart"
	managedByLabel = "app.kubernetes.io/managed-by"
	keepAnnotation = "helm.sh/resource-policy"
)

// loadChart loads the chart from its directory, as helm install does.
func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	ch, err := loader.Load(filepath.Join(root, chartDir))
	if err != nil {
		t.Fatalf("loading the chart: %v", err)
	}
	return ch
}

// renderChart renders the chart with values, as helm template does: the values are
// checked against values.schema.json first.
func renderChart(ch *chart.Chart, values map[string]any) ([]*unstructured.Unstructured, error) {
	vals, err := chartutil.ToRenderValues(ch, values, chartutil.ReleaseOptions{
		Name: "redpacket", Namespace: releaseNamespace, IsInstall: true, Revision: 1,
	}, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	files, err := engine.Engine{}.Render(ch, vals)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	var stream bytes.Buffer
	for _, n := range names {
		if strings.HasSuffix(n, "NOTES.txt") || strings.HasPrefix(filepath.Base(n), "_") {
			continue
		}
		stream.WriteString("\n---\n" + files[n])
	}
	return decode(stream.Bytes())
}

// decode splits a YAML stream into objects, skipping empty documents.
func decode(stream []byte) ([]*unstructured.Unstructured, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(stream)))
	var out []*unstructured.Unstructured
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("reading YAML: %w", err)
		}
		var m map[string]any
		if err := yaml.Unmarshal(doc, &m); err != nil {
			return nil, fmt.Errorf("decoding YAML: %w\n%s", err, doc)
		}
		if len(m) > 0 {
			out = append(out, &unstructured.Unstructured{Object: m})
		}
	}
}

// kustomize renders a kustomization directory with bin/kubectl.
func kustomize(t *testing.T, dir string) []*unstructured.Unstructured {
	t.Helper()
	out, err := exec.Command(kubectlBin(t), "kustomize", dir).CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl kustomize %s: %v\n%s", dir, err, out)
	}
	objs, err := decode(out)
	if err != nil {
		t.Fatalf("kustomize output of %s: %v", dir, err)
	}
	return objs
}

// renderInstall is what make render (hack/render-install.sh) gives for the operator
// image of version.
func renderInstall(t *testing.T, version string) []*unstructured.Unstructured {
	t.Helper()
	out := filepath.Join(t.TempDir(), "install.yaml")
	if b, err := exec.Command(filepath.Join(root, "hack", "render-install.sh"), version, out).CombinedOutput(); err != nil {
		t.Fatalf("hack/render-install.sh %s: %v\n%s", version, err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := decode(b)
	if err != nil {
		t.Fatalf("hack/render-install.sh %s: %v", version, err)
	}
	return objs
}

// key names an object uniquely in a rendering.
func key(o *unstructured.Unstructured) string {
	return o.GetKind() + " " + o.GetNamespace() + "/" + o.GetName()
}

// chartOnly takes off an object of the chart what only the chart sets, after
// checking it: the chart label on every object, managed-by Helm where config/ says
// managed-by kustomize, and the keep policy on the CRD when keep is on. What remains
// must equal what kustomize renders.
func chartOnly(t *testing.T, o *unstructured.Unstructured, keep bool) {
	t.Helper()
	labels := o.GetLabels()
	if !strings.HasPrefix(labels[chartLabel], "redpacket-operator-") {
		t.Errorf("%s: label %s is %q", key(o), chartLabel, labels[chartLabel])
	}
	delete(labels, chartLabel)
	if v, ok := labels[managedByLabel]; ok {
		if v != "Helm" {
			t.Errorf("%s: %s is %q, want Helm", key(o), managedByLabel, v)
		}
		labels[managedByLabel] = "kustomize"
	}
	o.SetLabels(labels)
	if o.GetKind() == "CustomResourceDefinition" {
		ann := o.GetAnnotations()
		if got := ann[keepAnnotation]; (got == "keep") != keep {
			t.Errorf("%s: annotation %s is %q with crds.keep=%v", key(o), keepAnnotation, got, keep)
		}
		delete(ann, keepAnnotation)
		o.SetAnnotations(ann)
	}
}

// compareRenderings checks that the chart rendered exactly the objects kustomize
// rendered, field by field, except the Namespace (helm install --create-namespace
// makes it) and what chartOnly takes off. argsUnordered compares the manager's
// arguments as a set (the chart orders the flags it adds its own way), except that
// the last one must be the same.
func compareRenderings(t *testing.T, fromChart, fromKustomize []*unstructured.Unstructured, keep, argsUnordered bool) {
	t.Helper()
	want := map[string]*unstructured.Unstructured{}
	namespaces := 0
	for _, o := range fromKustomize {
		if o.GetKind() == "Namespace" {
			namespaces++
			continue
		}
		want[key(o)] = o
	}
	if namespaces != 1 {
		t.Errorf("kustomize rendered %d Namespaces, want 1", namespaces)
	}
	got := map[string]*unstructured.Unstructured{}
	for _, o := range fromChart {
		if _, dup := got[key(o)]; dup {
			t.Errorf("the chart renders %s twice", key(o))
		}
		chartOnly(t, o, keep)
		got[key(o)] = o
	}
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			t.Errorf("the chart does not render %s", k)
			continue
		}
		if argsUnordered && g.GetKind() == "Deployment" {
			sortArgs(t, g)
			sortArgs(t, w)
		}
		if !equality.Semantic.DeepEqual(g.Object, w.Object) {
			gy, _ := yaml.Marshal(g.Object)
			wy, _ := yaml.Marshal(w.Object)
			t.Errorf("%s differs\n%s", k, lineDiff(string(wy), string(gy)))
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("the chart renders %s, which kustomize does not", k)
		}
	}
}

// sortArgs sorts the first container's arguments but the last, which stays last.
func sortArgs(t *testing.T, d *unstructured.Unstructured) {
	t.Helper()
	containers, _, _ := unstructured.NestedSlice(d.Object, "spec", "template", "spec", "containers")
	if len(containers) == 0 {
		t.Fatalf("%s has no container", key(d))
	}
	c := containers[0].(map[string]any)
	args, _ := c["args"].([]any)
	if len(args) > 1 {
		head := args[:len(args)-1]
		sort.Slice(head, func(i, j int) bool { return fmt.Sprint(head[i]) < fmt.Sprint(head[j]) })
	}
	if err := unstructured.SetNestedSlice(d.Object, containers, "spec", "template", "spec", "containers"); err != nil {
		t.Fatal(err)
	}
}

// lineDiff lists the lines only in want (-) and only in got (+).
func lineDiff(want, got string) string {
	wl, gl := strings.Split(want, "\n"), strings.Split(got, "\n")
	var b strings.Builder
	for _, l := range wl {
		if !slices.Contains(gl, l) {
			b.WriteString("- " + l + "\n")
		}
	}
	for _, l := range gl {
		if !slices.Contains(wl, l) {
			b.WriteString("+ " + l + "\n")
		}
	}
	return b.String()
}

// TestChartDefaultsRenderTheInstallManifests renders the chart with its defaults and
// an image tag, and hack/render-install.sh (make render) for the same tag: the same
// objects, field by field.
func TestChartDefaultsRenderTheInstallManifests(t *testing.T) {
	kubectlBin(t)
	rendered := renderInstall(t, "v1.2.3")
	ch := loadChart(t)
	fromChart, err := renderChart(ch, map[string]any{"image": map[string]any{"tag": "v1.2.3"}})
	if err != nil {
		t.Fatalf("rendering the chart: %v", err)
	}
	compareRenderings(t, fromChart, rendered, true, false)
	t.Logf("%d objects from the chart, %d from make render (one of them the Namespace)", len(fromChart), len(rendered))

	// Without a tag the image is the chart's appVersion, a version of its own: what
	// make render gives for that version, and never a mutable "latest".
	app := ch.Metadata.AppVersion
	if app == "" || app == "latest" {
		t.Errorf("the chart's appVersion is %q; want a release version, the default image tag", app)
	}
	fromChart, err = renderChart(ch, nil)
	if err != nil {
		t.Fatalf("rendering the chart: %v", err)
	}
	compareRenderings(t, fromChart, renderInstall(t, app), true, false)
	for _, o := range fromChart {
		containers, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
		for _, c := range containers {
			image, _, _ := unstructured.NestedString(c.(map[string]any), "image")
			if image != "redpacket-operator:"+app {
				t.Errorf("%s: by default the chart runs image %q, want redpacket-operator:%s (the appVersion)", key(o), image, app)
			}
		}
	}
}

// TestChartValuesRenderLikeAKustomizeOverlay sets every value away from its default,
// and writes a kustomize overlay of config/default, config/prometheus and
// config/grafana that makes the same changes: both render the same objects.
func TestChartValuesRenderLikeAKustomizeOverlay(t *testing.T) {
	values := map[string]any{}
	if err := yaml.Unmarshal([]byte(`
image: {repository: redpacket-operator-custom, tag: v9, pullPolicy: Always}
imagePullSecrets: [{name: pull-secret}]
replicaCount: 1
leaderElection: false
metrics: {port: 9090}
healthProbe: {port: 9091}
redis:
  addresses: redis-a:6379,redis-b:6379
  mode: cluster
  username: operator
  tls: true
  passwordSecret: {name: redis-default, key: pw, usernameKey: user, optional: false}
grab: {image: "grab-image:v2", replicas: 0}
cleanupGracePeriod: 30m
unsettledRetention: 720h
grabReportTimeout: 15s
redisTimeout: 3s
activeResyncPeriod: 2s
maxConcurrentReconciles: 4
redisClientIdleTimeout: 20m
extraArgs: ["--v=2"]
extraEnv: [{name: GOMAXPROCS, value: "2"}]
resources: {requests: {cpu: 50m}}
podAnnotations: {team: payments}
nodeSelector: {kubernetes.io/os: linux}
tolerations: [{key: dedicated, operator: Exists, effect: NoSchedule}]
affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: kubernetes.io/arch, operator: In, values: [amd64]}]}]}}}
crds: {install: true, keep: false}
monitoring:
  serviceMonitor: {enabled: true, labels: {release: prom}}
  podMonitor: {enabled: true, labels: {release: prom}}
  prometheusRule: {enabled: true, labels: {release: prom}}
  dashboard: {enabled: true, labels: {team: payments}}
`), &values); err != nil {
		t.Fatal(err)
	}
	fromChart, err := renderChart(loadChart(t), values)
	if err != nil {
		t.Fatalf("rendering the chart: %v", err)
	}

	// The same settings as a kustomize overlay. The manager's arguments: config's,
	// with the flags above set to their values, --leader-elect dropped, the flags
	// config leaves out added, --v=2 last.
	base := kustomize(t, filepath.Join(root, "config", "default"))
	var configArgs []string
	for _, o := range base {
		if o.GetKind() == "Deployment" {
			containers, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
			for _, a := range containers[0].(map[string]any)["args"].([]any) {
				configArgs = append(configArgs, a.(string))
			}
		}
	}
	set := map[string]string{
		"metrics-bind-address": ":9090", "health-probe-bind-address": ":9091",
		"redis-addresses": "redis-a:6379,redis-b:6379", "redis-mode": "cluster", "redis-username": "operator",
		"grab-image": "grab-image:v2", "grab-replicas": "0", "cleanup-grace-period": "30m",
		"unsettled-retention": "720h", "grab-report-timeout": "15s", "redis-timeout": "3s",
		"active-resync-period": "2s", "max-concurrent-reconciles": "4", "redis-client-idle-timeout": "20m",
	}
	var args []string
	for _, a := range configArgs {
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		switch v, ok := set[name]; {
		case name == "leader-elect" || name == "redis-tls":
		case ok:
			args = append(args, "--"+name+"="+v)
			delete(set, name)
		default:
			args = append(args, a)
		}
	}
	for name, v := range set {
		args = append(args, "--"+name+"="+v)
	}
	args = append(args, "--redis-tls", "--v=2")
	overlay := t.TempDir()
	// kustomize takes bases by relative path only.
	configRel, err := filepath.Rel(overlay, filepath.Join(root, "config"))
	if err != nil {
		t.Fatal(err)
	}
	kustomization := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- %[1]s/default
- %[1]s/prometheus
- %[1]s/grafana
images:
- name: redpacket-operator
  newName: redpacket-operator-custom
  newTag: v9
patches:
- target: {kind: Deployment, name: redpacket-controller-manager}
  patch: |-
    - {op: replace, path: /spec/replicas, value: 1}
    - {op: add, path: /spec/template/metadata/annotations, value: {team: payments}}
    - {op: add, path: /spec/template/spec/imagePullSecrets, value: [{name: pull-secret}]}
    - {op: add, path: /spec/template/spec/nodeSelector, value: {kubernetes.io/os: linux}}
    - {op: add, path: /spec/template/spec/tolerations, value: [{key: dedicated, operator: Exists, effect: NoSchedule}]}
    - {op: add, path: /spec/template/spec/affinity, value: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: kubernetes.io/arch, operator: In, values: [amd64]}]}]}}}}
    - {op: replace, path: /spec/template/spec/containers/0/imagePullPolicy, value: Always}
    - {op: replace, path: /spec/template/spec/containers/0/args, value: %[2]s}
    - {op: replace, path: /spec/template/spec/containers/0/env/1, value: {name: REDIS_USERNAME, valueFrom: {secretKeyRef: {name: redis-default, key: user, optional: false}}}}
    - {op: replace, path: /spec/template/spec/containers/0/env/2, value: {name: REDIS_PASSWORD, valueFrom: {secretKeyRef: {name: redis-default, key: pw, optional: false}}}}
    - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: GOMAXPROCS, value: "2"}}
    - {op: replace, path: /spec/template/spec/containers/0/resources/requests/cpu, value: 50m}
    - {op: replace, path: /spec/template/spec/containers/0/ports/0/containerPort, value: 9090}
    - {op: replace, path: /spec/template/spec/containers/0/ports/1/containerPort, value: 9091}
- target: {kind: Service, name: redpacket-controller-manager-metrics}
  patch: |-
    - {op: replace, path: /spec/ports/0/port, value: 9090}
- target: {group: monitoring.coreos.com}
  patch: |-
    - {op: add, path: /metadata/labels/release, value: prom}
- target: {kind: ConfigMap, name: redpacket-dashboard}
  patch: |-
    - {op: add, path: /metadata/labels/team, value: payments}
`, configRel, strings.ReplaceAll(strings.TrimSpace(string(mustJSON(t, args))), "\n", " "))
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), []byte(kustomization), 0o644); err != nil {
		t.Fatal(err)
	}
	compareRenderings(t, fromChart, kustomize(t, overlay), false, true)

	kinds := map[string]int{}
	for _, o := range fromChart {
		kinds[o.GetKind()]++
	}
	for _, k := range []string{"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"} {
		if kinds[k] != 1 {
			t.Errorf("with monitoring on the chart renders %d %s, want 1", kinds[k], k)
		}
	}
	if last := lastArg(t, fromChart); last != "--v=2" {
		t.Errorf("the manager's last argument is %q, want the extraArgs entry --v=2", last)
	}
}

// The operator's Redis user comes from redis.passwordSecret: by default both
// variables from the Secret redpacket-redis, optional (as make render gives them);
// without a usernameKey the password alone; without a name neither, and no other
// variable is lost.
func TestChartRedisCredentialSecret(t *testing.T) {
	ch := loadChart(t)
	for _, tc := range []struct {
		name   string
		secret map[string]any
		want   map[string]string // variable: "secret/key optional"
	}{
		{"defaults", nil, map[string]string{"REDIS_USERNAME": "redpacket-redis/username true", "REDIS_PASSWORD": "redpacket-redis/password true"}},
		{"password only", map[string]any{"name": "mine", "usernameKey": ""}, map[string]string{"REDIS_PASSWORD": "mine/password true"}},
		{"required", map[string]any{"optional": false}, map[string]string{"REDIS_USERNAME": "redpacket-redis/username false", "REDIS_PASSWORD": "redpacket-redis/password false"}},
		{"none", map[string]any{"name": ""}, map[string]string{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			values := map[string]any{}
			if tc.secret != nil {
				values["redis"] = map[string]any{"passwordSecret": tc.secret}
			}
			objs, err := renderChart(ch, values)
			if err != nil {
				t.Fatalf("rendering the chart: %v", err)
			}
			got := map[string]string{}
			names := map[string]bool{}
			for _, o := range objs {
				if o.GetKind() != "Deployment" {
					continue
				}
				containers, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
				env, _, _ := unstructured.NestedSlice(containers[0].(map[string]any), "env")
				for _, e := range env {
					m := e.(map[string]any)
					name, _ := m["name"].(string)
					names[name] = true
					ref, ok, _ := unstructured.NestedMap(m, "valueFrom", "secretKeyRef")
					if ok {
						got[name] = fmt.Sprintf("%v/%v %v", ref["name"], ref["key"], ref["optional"])
					}
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("variables from Secrets %v, want %v", got, tc.want)
			}
			if !names["POD_NAMESPACE"] {
				t.Errorf("the manager lost POD_NAMESPACE: %v", names)
			}
		})
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := yaml.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	j, err := yaml.YAMLToJSON(b)
	if err != nil {
		t.Fatal(err)
	}
	return j
}

func lastArg(t *testing.T, objs []*unstructured.Unstructured) string {
	t.Helper()
	args := managerArgs(t, objs)
	if len(args) == 0 {
		return ""
	}
	return args[len(args)-1]
}

// managerArgs returns the arguments of the operator's container.
func managerArgs(t *testing.T, objs []*unstructured.Unstructured) []string {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() != "Deployment" {
			continue
		}
		containers, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
		var args []string
		for _, a := range containers[0].(map[string]any)["args"].([]any) {
			args = append(args, a.(string))
		}
		return args
	}
	t.Fatal("no Deployment rendered")
	return nil
}

// TestChartRejectsBadValues: values that do not fit values.schema.json are refused
// before anything is rendered, naming the value.
func TestChartRejectsBadValues(t *testing.T) {
	ch := loadChart(t)
	for _, tc := range []struct {
		name, values, want string
	}{
		{"unknown Redis mode", `redis: {mode: sentinel}`, "mode"},
		{"negative replicas", `replicaCount: -1`, "replicaCount"},
		{"misspelt value", `replicas: 3`, "replicas"},
		{"duration that is not one", `cleanupGracePeriod: ten minutes`, "cleanupGracePeriod"},
		{"port out of range", `metrics: {port: 70000}`, "port"},
		{"grab replicas out of range", `grab: {replicas: 5000}`, "replicas"},
		{"extra argument that is not a flag", `extraArgs: [v=2]`, "extraArgs"},
		{"empty Redis address", `redis: {addresses: ""}`, "addresses"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var values map[string]any
			if err := yaml.Unmarshal([]byte(tc.values), &values); err != nil {
				t.Fatal(err)
			}
			objs, err := renderChart(ch, values)
			if err == nil {
				t.Fatalf("values %s rendered %d objects; want a schema error", tc.values, len(objs))
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("the error does not name %q: %v", tc.want, err)
			}
		})
	}
}

// TestChartFlagsExistInTheManager renders the chart with every optional flag set
// and runs the manager built from this tree with exactly those arguments and
// --help: the manager knows every flag the chart can pass.
func TestChartFlagsExistInTheManager(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the manager; not under -short")
	}
	var values map[string]any
	if err := yaml.Unmarshal([]byte(`
redis: {username: u, tls: true, allowedHosts: "10.0.0.0/8,redis.example"}
grab: {replicas: 2, allowImageOverride: true}
unsettledRetention: 1h
grabReportTimeout: 10s
redisTimeout: 5s
activeResyncPeriod: 5s
maxConcurrentReconciles: 2
redisClientIdleTimeout: 10m
`), &values); err != nil {
		t.Fatal(err)
	}
	objs, err := renderChart(loadChart(t), values)
	if err != nil {
		t.Fatal(err)
	}
	args := managerArgs(t, objs)
	bins := buildBinaries(t)
	out, err := exec.Command(bins.manager, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("manager --help: %v\n%s", err, out)
	}
	known := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\s+-([a-z0-9-]+)`).FindAllStringSubmatch(string(out), -1) {
		known[m[1]] = true
	}
	for _, a := range args {
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !known[name] {
			t.Errorf("the chart passes --%s, which the manager does not know", name)
		}
	}
	if len(args) < 18 {
		t.Errorf("the chart passes %d arguments with every value set, want at least 18: %q", len(args), args)
	}
}
