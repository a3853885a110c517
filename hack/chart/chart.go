package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// The chart's fixed facts.
const (
	chartName    = "redpacket-operator"
	chartVersion = "0.2.0"
	// chartAppVersion is the in-tree chart's appVersion, the tag of the operator image
	// it installs when image.tag is empty: the chart's own version, never config/'s
	// mutable "latest" (the tag hack/render-install.sh replaces). make release
	// packages the chart with the release version as its appVersion instead.
	chartAppVersion = "v" + chartVersion
	// installNamespace is the namespace config/ installs into; in the chart it is the
	// release's namespace.
	installNamespace = "redpacket-system"
	// dashboardFile is the dashboard's file name in config/grafana and in the chart's
	// dashboards/ folder.
	dashboardFile = "redpacket-operator.json"
)

// Placeholders put into the objects before they are written as YAML, and replaced by
// template text afterwards. A scalar placeholder stands for one value; a block
// placeholder (blockPrefix...) for whole lines.
const (
	phNamespace   = "__RELEASE_NAMESPACE__"
	phService     = "__RELEASE_SERVICE__"
	phChartLabel  = "__CHART_LABEL__"
	phReplicas    = "__REPLICAS__"
	phImage       = "__IMAGE__"
	phPullPolicy  = "__PULL_POLICY__"
	phMetricsPort = "__METRICS_PORT__"
	phProbePort   = "__PROBE_PORT__"
	phDashboard   = "__DASHBOARD_DATA__"
	phDashboardNS = "__DASHBOARD_NAMESPACE__"
	blockPrefix   = "__BLOCK_"
)

var scalarPlaceholders = map[string]string{
	phNamespace:   "{{ .Release.Namespace }}",
	phService:     "{{ .Release.Service }}",
	phChartLabel:  `{{ include "redpacket-operator.chart" . }}`,
	phReplicas:    "{{ int64 .Values.replicaCount }}",
	phImage:       `{{ include "redpacket-operator.image" . | quote }}`,
	phPullPolicy:  "{{ .Values.image.pullPolicy }}",
	phMetricsPort: "{{ int64 .Values.metrics.port }}",
	phProbePort:   "{{ int64 .Values.healthProbe.port }}",
	phDashboard:   `{{ .Files.Get "dashboards/` + dashboardFile + `" | toJson }}`,
	phDashboardNS: "{{ default .Release.Namespace .Values.monitoring.dashboard.namespace }}",
}

// object is one Kubernetes object as decoded YAML.
type object map[string]any

func (o object) kind() string { s, _ := o["kind"].(string); return s }
func (o object) meta() map[string]any {
	m, _ := o["metadata"].(map[string]any)
	return m
}
func (o object) name() string { s, _ := o.meta()["name"].(string); return s }

// templateFile is one file of the chart's templates/: its objects' template text and
// the value that switches it on (empty: always rendered).
type templateFile struct {
	name  string
	guard string
	docs  []string
}

// decodeObjects splits a YAML stream into objects.
func decodeObjects(stream []byte) ([]object, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(stream)))
	var out []object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("reading YAML: %w", err)
		}
		var o object
		if err := yaml.Unmarshal(doc, &o); err != nil {
			return nil, fmt.Errorf("decoding YAML: %w", err)
		}
		if len(o) > 0 {
			out = append(out, o)
		}
	}
}

// chartInputs are the kustomize renderings of config/ the chart is made from.
type chartInputs struct {
	install, prometheus, grafana []object
	dashboard                    []byte
}

// buildTemplates turns the rendered objects into the chart's template files and
// values defaults.
func buildTemplates(in chartInputs) ([]templateFile, map[string]any, error) {
	files := map[string]*templateFile{}
	var order []string
	add := func(name, guard, doc string) {
		f, ok := files[name]
		if !ok {
			f = &templateFile{name: name, guard: guard}
			files[name] = f
			order = append(order, name)
		}
		f.docs = append(f.docs, doc)
	}
	var defaults map[string]any
	for _, o := range in.install {
		common(o)
		var blocks map[string]blockFunc
		file, guard := "", ""
		switch o.kind() {
		case "Namespace":
			// helm install --create-namespace makes it; docs/operations.md says which
			// labels to give it.
			continue
		case "CustomResourceDefinition":
			file, guard = "crds.yaml", ".Values.crds.install"
			annotations := ensureMap(o.meta(), "annotations")
			annotations[blockPrefix+"CRD_KEEP__"] = nil
			blocks = map[string]blockFunc{blockPrefix + "CRD_KEEP__": lines(
				"{{- if .Values.crds.keep }}",
				"helm.sh/resource-policy: keep",
				"{{- end }}")}
		case "ServiceAccount", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding":
			file = "rbac.yaml"
		case "Deployment":
			file = "deployment.yaml"
			var err error
			blocks, defaults, err = templateDeployment(o)
			if err != nil {
				return nil, nil, err
			}
		case "Service":
			file = "service.yaml"
			if err := templateMetricsService(o); err != nil {
				return nil, nil, err
			}
		default:
			file = strings.ToLower(o.kind()) + ".yaml"
		}
		doc, err := render(o, blocks)
		if err != nil {
			return nil, nil, err
		}
		add(file, guard, doc)
	}
	if defaults == nil {
		return nil, nil, fmt.Errorf("config/default renders no Deployment")
	}
	monitors := map[string]string{"ServiceMonitor": "serviceMonitor", "PodMonitor": "podMonitor", "PrometheusRule": "prometheusRule"}
	for _, o := range in.prometheus {
		key, ok := monitors[o.kind()]
		if !ok {
			return nil, nil, fmt.Errorf("config/prometheus renders a %s; the chart knows ServiceMonitor, PodMonitor and PrometheusRule", o.kind())
		}
		common(o)
		doc, err := render(o, extraLabels(o, "monitoring."+key+".labels"))
		if err != nil {
			return nil, nil, err
		}
		add(strings.ToLower(o.kind())+".yaml", ".Values.monitoring."+key+".enabled", doc)
	}
	for _, o := range in.grafana {
		if o.kind() != "ConfigMap" {
			return nil, nil, fmt.Errorf("config/grafana renders a %s; the chart knows only the dashboard ConfigMap", o.kind())
		}
		common(o)
		o.meta()["namespace"] = phDashboardNS
		data, _ := o["data"].(map[string]any)
		if len(data) != 1 || data[dashboardFile] == nil {
			return nil, nil, fmt.Errorf("the dashboard ConfigMap must hold exactly %s", dashboardFile)
		}
		data[dashboardFile] = phDashboard
		doc, err := render(o, extraLabels(o, "monitoring.dashboard.labels"))
		if err != nil {
			return nil, nil, err
		}
		add("dashboard.yaml", ".Values.monitoring.dashboard.enabled", doc)
	}
	var out []templateFile
	for _, name := range order {
		out = append(out, *files[name])
	}
	return out, defaults, nil
}

// common makes an object the release's: its namespace (and its subjects') the
// release namespace, managed by Helm, and labelled with the chart.
func common(o object) {
	m := o.meta()
	if m["namespace"] == installNamespace {
		m["namespace"] = phNamespace
	}
	labels := ensureMap(m, "labels")
	if _, ok := labels["app.kubernetes.io/managed-by"]; ok {
		labels["app.kubernetes.io/managed-by"] = phService
	}
	labels["helm.sh/chart"] = phChartLabel
	if subjects, ok := o["subjects"].([]any); ok {
		for _, s := range subjects {
			if sm, ok := s.(map[string]any); ok && sm["namespace"] == installNamespace {
				sm["namespace"] = phNamespace
			}
		}
	}
}

// extraLabels adds a value's labels to the object's.
func extraLabels(o object, valuePath string) map[string]blockFunc {
	marker := blockPrefix + "LABELS__"
	ensureMap(o.meta(), "labels")[marker] = nil
	return map[string]blockFunc{marker: func(indent string) string {
		return indent + "{{- with .Values." + valuePath + " }}\n" +
			indent + fmt.Sprintf("{{- toYaml . | nindent %d }}\n", len(indent)) +
			indent + "{{- end }}\n"
	}}
}

// templateDeployment puts the values into the operator's Deployment: replicas,
// image, pull policy, arguments, the Redis credential Secret, extra environment,
// resources, ports, pod annotations and scheduling. It returns the block templates
// and the values defaults taken from config/.
func templateDeployment(o object) (map[string]blockFunc, map[string]any, error) {
	spec := ensureMap(o, "spec")
	replicas, ok := spec["replicas"].(float64)
	if !ok {
		return nil, nil, fmt.Errorf("the Deployment in config/ sets no replicas")
	}
	spec["replicas"] = phReplicas
	tmpl := ensureMap(spec, "template")
	ensureMap(tmpl, "metadata")[blockPrefix+"POD_ANNOTATIONS__"] = nil
	pod := ensureMap(tmpl, "spec")
	pod[blockPrefix+"POD_SCHEDULING__"] = nil
	containers, _ := pod["containers"].([]any)
	if len(containers) != 1 {
		return nil, nil, fmt.Errorf("the Deployment in config/ has %d containers; the chart templates exactly one", len(containers))
	}
	c := containers[0].(map[string]any)
	image, _ := c["image"].(string)
	repo, _, ok := strings.Cut(image, ":")
	if !ok {
		return nil, nil, fmt.Errorf("the manager image %q has no tag", image)
	}
	c["image"] = phImage
	pullPolicy, _ := c["imagePullPolicy"].(string)
	c["imagePullPolicy"] = phPullPolicy

	var rawArgs []string
	for _, a := range c["args"].([]any) {
		rawArgs = append(rawArgs, fmt.Sprint(a))
	}
	args, err := parseConfigArgs(rawArgs)
	if err != nil {
		return nil, nil, err
	}
	defaults, err := flagDefaults(args, image)
	if err != nil {
		return nil, nil, err
	}
	c["args"] = blockPrefix + "ARGS__"

	env, cred, err := credentialEnv(c["env"])
	if err != nil {
		return nil, nil, err
	}
	envYAML, err := yaml.Marshal(env)
	if err != nil {
		return nil, nil, fmt.Errorf("encoding the manager's env: %w", err)
	}
	c["env"] = blockPrefix + "ENV__"

	resources := c["resources"]
	c["resources"] = blockPrefix + "RESOURCES__"

	ports, _ := c["ports"].([]any)
	for _, p := range ports {
		pm := p.(map[string]any)
		switch pm["name"] {
		case "metrics":
			pm["containerPort"] = phMetricsPort
		case "probes":
			pm["containerPort"] = phProbePort
		}
	}
	if defaults["metrics.port"] == nil || defaults["healthProbe.port"] == nil {
		return nil, nil, fmt.Errorf("config/manager does not set the metrics and probe ports")
	}

	defaults["redis.passwordSecret.name"] = cred.name
	defaults["redis.passwordSecret.key"] = cred.passwordKey
	defaults["redis.passwordSecret.usernameKey"] = cred.usernameKey
	defaults["redis.passwordSecret.optional"] = cred.optional
	defaults["replicaCount"] = int(replicas)
	defaults["image.repository"] = repo
	defaults["image.pullPolicy"] = pullPolicy
	defaults["resources"] = resources

	blocks := map[string]blockFunc{
		blockPrefix + "POD_ANNOTATIONS__": lines(
			"{{- with .Values.podAnnotations }}",
			"annotations:",
			"  {{- toYaml . | nindent INDENT+2 }}",
			"{{- end }}"),
		blockPrefix + "POD_SCHEDULING__": lines(
			"{{- with .Values.imagePullSecrets }}",
			"imagePullSecrets:",
			"  {{- toYaml . | nindent INDENT }}",
			"{{- end }}",
			"{{- with .Values.nodeSelector }}",
			"nodeSelector:",
			"  {{- toYaml . | nindent INDENT+2 }}",
			"{{- end }}",
			"{{- with .Values.tolerations }}",
			"tolerations:",
			"  {{- toYaml . | nindent INDENT }}",
			"{{- end }}",
			"{{- with .Values.affinity }}",
			"affinity:",
			"  {{- toYaml . | nindent INDENT+2 }}",
			"{{- end }}"),
		blockPrefix + "ARGS__": func(indent string) string {
			return indent + "args:\n" + argsTemplate(args, indent)
		},
		blockPrefix + "ENV__": func(indent string) string {
			var b strings.Builder
			b.WriteString(indent + "env:\n")
			for _, l := range strings.Split(strings.TrimRight(templateEscaper.Replace(string(envYAML)), "\n"), "\n") {
				b.WriteString(indent + l + "\n")
			}
			b.WriteString(lines(
				"{{- with .Values.redis.passwordSecret }}",
				"{{- if .name }}",
				"{{- if .usernameKey }}",
				"- name: REDIS_USERNAME",
				"  valueFrom:",
				"    secretKeyRef:",
				"      name: {{ .name | quote }}",
				"      key: {{ .usernameKey | quote }}",
				"      optional: {{ .optional }}",
				"{{- end }}",
				"- name: REDIS_PASSWORD",
				"  valueFrom:",
				"    secretKeyRef:",
				"      name: {{ .name | quote }}",
				"      key: {{ .key | quote }}",
				"      optional: {{ .optional }}",
				"{{- end }}",
				"{{- end }}",
				"{{- with .Values.extraEnv }}",
				"{{- toYaml . | nindent INDENT }}",
				"{{- end }}")(indent))
			return b.String()
		},
		blockPrefix + "RESOURCES__": lines(
			"resources:",
			"  {{- toYaml .Values.resources | nindent INDENT+2 }}"),
	}
	return blocks, defaults, nil
}

// redisCredential is where config/manager's operator reads its Redis user from: the
// Secret and keys of its REDIS_USERNAME and REDIS_PASSWORD variables.
type redisCredential struct {
	name, usernameKey, passwordKey string
	optional                       bool
}

// credentialEnv takes the variables REDIS_USERNAME and REDIS_PASSWORD out of the
// manager container's env, which the chart templates from redis.passwordSecret, and
// returns the rest with where they came from (the values' defaults). Both must come
// from one Secret, both optional or both not, so that one value says it.
func credentialEnv(raw any) ([]any, redisCredential, error) {
	var (
		rest []any
		refs = map[string]map[string]any{}
	)
	list, _ := raw.([]any)
	for _, e := range list {
		m, _ := e.(map[string]any)
		name, _ := m["name"].(string)
		if name != "REDIS_USERNAME" && name != "REDIS_PASSWORD" {
			rest = append(rest, e)
			continue
		}
		from, _ := m["valueFrom"].(map[string]any)
		ref, ok := from["secretKeyRef"].(map[string]any)
		if !ok {
			return nil, redisCredential{}, fmt.Errorf("config/manager sets %s other than from a Secret (valueFrom.secretKeyRef); the chart templates it from redis.passwordSecret", name)
		}
		refs[name] = ref
	}
	user, pass := refs["REDIS_USERNAME"], refs["REDIS_PASSWORD"]
	if user == nil || pass == nil {
		return nil, redisCredential{}, fmt.Errorf("config/manager must set both REDIS_USERNAME and REDIS_PASSWORD from a Secret (found %d of them)", len(refs))
	}
	cred := redisCredential{}
	cred.name, _ = pass["name"].(string)
	cred.passwordKey, _ = pass["key"].(string)
	cred.usernameKey, _ = user["key"].(string)
	cred.optional, _ = pass["optional"].(bool)
	userSecret, _ := user["name"].(string)
	userOptional, _ := user["optional"].(bool)
	if cred.name == "" || cred.passwordKey == "" || cred.usernameKey == "" {
		return nil, redisCredential{}, fmt.Errorf("config/manager's REDIS_USERNAME and REDIS_PASSWORD need a Secret name and a key each")
	}
	if userSecret != cred.name || userOptional != cred.optional {
		return nil, redisCredential{}, fmt.Errorf("config/manager reads REDIS_USERNAME from Secret %q (optional %t) and REDIS_PASSWORD from %q (optional %t); the chart's redis.passwordSecret names one Secret for both",
			userSecret, userOptional, cred.name, cred.optional)
	}
	return rest, cred, nil
}

// templateMetricsService puts the metrics port value into the metrics Service.
func templateMetricsService(o object) error {
	spec := ensureMap(o, "spec")
	ports, _ := spec["ports"].([]any)
	for _, p := range ports {
		pm := p.(map[string]any)
		if pm["name"] == "metrics" {
			pm["port"] = phMetricsPort
			return nil
		}
	}
	return fmt.Errorf("service %s has no port named metrics", o.name())
}

// blockFunc returns the template lines that replace a block placeholder's line,
// indented by indent.
type blockFunc func(indent string) string

// lines is a blockFunc of fixed lines; INDENT+2 and INDENT in them become the
// indentation's width (plus two), for nindent.
func lines(ls ...string) blockFunc {
	return func(indent string) string {
		var b strings.Builder
		for _, l := range ls {
			l = strings.ReplaceAll(l, "INDENT+2", fmt.Sprint(len(indent)+2))
			l = strings.ReplaceAll(l, "INDENT", fmt.Sprint(len(indent)))
			b.WriteString(indent + l + "\n")
		}
		return b.String()
	}
}

// templateEscaper keeps the braces that config/ holds (Prometheus alert templates)
// out of Helm's template engine.
var templateEscaper = strings.NewReplacer("{{", `{{ "{{" }}`, "}}", `{{ "}}" }}`)

// render writes an object as template text: YAML with its braces escaped, then the
// placeholders replaced.
func render(o object, blocks map[string]blockFunc) (string, error) {
	b, err := yaml.Marshal(o)
	if err != nil {
		return "", fmt.Errorf("encoding %s %s: %w", o.kind(), o.name(), err)
	}
	text := templateEscaper.Replace(string(b))
	var out strings.Builder
	used := map[string]bool{}
	for _, line := range strings.SplitAfter(text, "\n") {
		if line == "" {
			continue
		}
		marker := ""
		if i := strings.Index(line, blockPrefix); i >= 0 {
			end := strings.Index(line[i+len(blockPrefix):], "__")
			if end < 0 {
				return "", fmt.Errorf("broken placeholder in %q", line)
			}
			marker = line[i : i+len(blockPrefix)+end+2]
		}
		if marker == "" {
			for ph, repl := range scalarPlaceholders {
				line = strings.ReplaceAll(line, ph, repl)
			}
			out.WriteString(line)
			continue
		}
		f, ok := blocks[marker]
		if !ok {
			return "", fmt.Errorf("no template for %s in %s %s", marker, o.kind(), o.name())
		}
		used[marker] = true
		indent := line[:len(line)-len(strings.TrimLeft(line, " "))]
		if !strings.HasPrefix(strings.TrimLeft(line, " "), "- ") {
			out.WriteString(f(indent))
			continue
		}
		// The first key of a list item ("- key: __BLOCK_...__"): the block is
		// indented as the item's keys, and its first line takes the dash.
		block := f(indent + "  ")
		first := strings.TrimPrefix(block, indent+"  ")
		if strings.HasPrefix(first, "{{") {
			return "", fmt.Errorf("placeholder %s opens a list item with a template action", marker)
		}
		out.WriteString(indent + "- " + first)
	}
	for marker := range blocks {
		if !used[marker] {
			return "", fmt.Errorf("placeholder %s of %s %s did not appear", marker, o.kind(), o.name())
		}
	}
	if strings.Contains(out.String(), "__RELEASE_") || strings.Contains(out.String(), blockPrefix) {
		return "", fmt.Errorf("a placeholder is left in %s %s", o.kind(), o.name())
	}
	return out.String(), nil
}

func ensureMap(parent map[string]any, key string) map[string]any {
	m, ok := parent[key].(map[string]any)
	if !ok {
		m = map[string]any{}
		parent[key] = m
	}
	return m
}

// writeChart writes the chart into dir, replacing what was there.
func writeChart(dir string, templates []templateFile, defaults map[string]any, appVersion string, dashboard []byte) error {
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("removing the old chart: %w", err)
	}
	files := map[string][]byte{
		"Chart.yaml":                  []byte(chartYAML(appVersion)),
		"values.yaml":                 []byte(valuesYAML(defaults)),
		"values.schema.json":          valuesSchema(),
		"templates/_helpers.tpl":      []byte(helpersTpl),
		"templates/NOTES.txt":         []byte(notesTxt),
		"dashboards/" + dashboardFile: dashboard,
		".helmignore":                 []byte("# Generated by make chart; do not edit.\n*.orig\n*.tmp\n"),
	}
	for _, t := range templates {
		var b strings.Builder
		b.WriteString("# Generated by make chart (hack/chart) from config/; do not edit.\n")
		if t.guard != "" {
			b.WriteString("{{- if " + t.guard + " }}\n")
		}
		for i, d := range t.docs {
			if i > 0 {
				b.WriteString("---\n")
			}
			b.WriteString(d)
		}
		if t.guard != "" {
			b.WriteString("{{- end }}\n")
		}
		files["templates/"+t.name] = []byte(b.String())
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		p := filepath.Join(dir, n)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, files[n], 0o644); err != nil {
			return fmt.Errorf("writing %s: %w", p, err)
		}
	}
	return nil
}

func chartYAML(appVersion string) string {
	return fmt.Sprintf(`# Generated by make chart (hack/chart) from config/; do not edit.
apiVersion: v2
name: %s
description: >-
  The redpacket-operator: red-packet activities (RedPacketActivity) served from
  Redis with exactly-once money, their grab services, settlement to a balance
  system; optional Prometheus monitors, alert rules and a Grafana dashboard.
type: application
version: %s
appVersion: %q
keywords:
- red-packet
- redis
- operator
`, chartName, chartVersion, appVersion)
}

const helpersTpl = `{{/* Generated by make chart (hack/chart); do not edit. */}}

{{/* The chart label of every object: name-version. */}}
{{- define "redpacket-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The operator image, repository:tag; the tag defaults to the chart's appVersion. */}}
{{- define "redpacket-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
`

const notesTxt = `The redpacket-operator is installed in namespace {{ .Release.Namespace }}.

  kubectl -n {{ .Release.Namespace }} rollout status deployment/redpacket-controller-manager
  kubectl get redpacketactivities -A

Activities without spec.redis use the default Redis at {{ .Values.redis.addresses }} ({{ .Values.redis.mode }}).
{{- if or .Values.monitoring.serviceMonitor.enabled .Values.monitoring.podMonitor.enabled .Values.monitoring.prometheusRule.enabled }}
Prometheus monitors and alert rules are installed; docs/monitoring.md says what each alert asks of you.
{{- end }}
`
