package packaging

import (
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// promtool returns the path of promtool (Debian's prometheus package; make test
// installs it through hack/ensure-prometheus.sh). Without it the test skips saying
// why, except under CI=true, where it fails.
func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("promtool is missing: hack/ensure-prometheus.sh installs it")
		}
		t.Skip("promtool is missing: run hack/ensure-prometheus.sh (apt-get install prometheus)")
	}
	return p
}

// ruleFile is the part of a PrometheusRule (or a rule file) the tests read.
type ruleFile struct {
	Groups []struct {
		Name  string `json:"name"`
		Rules []struct {
			Alert string            `json:"alert"`
			Expr  string            `json:"expr"`
			For   string            `json:"for"`
			Label map[string]string `json:"labels"`
		} `json:"rules"`
	} `json:"groups"`
}

// promtoolTests is the part of a promtool test file the tests read.
type promtoolTests struct {
	Tests []struct {
		Name          string `json:"name"`
		AlertRuleTest []struct {
			Alertname string `json:"alertname"`
			ExpAlerts []any  `json:"exp_alerts"`
		} `json:"alert_rule_test"`
	} `json:"tests"`
}

// TestAlertRules writes the PrometheusRule's rule groups to a rule file, checks it
// with promtool check rules, and runs config/prometheus/tests with promtool test
// rules: every alert fires on the series it is for and stays silent on the others.
// It also checks that each alert has a firing and a silent case there, a severity,
// and that no rule groups by a user id.
func TestAlertRules(t *testing.T) {
	bin := promtool(t)
	raw, err := os.ReadFile(filepath.Join(root, "config", "prometheus", "prometheus_rule.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var rule struct {
		Kind string         `json:"kind"`
		Spec map[string]any `json:"spec"`
	}
	if err := yaml.Unmarshal(raw, &rule); err != nil {
		t.Fatalf("prometheus_rule.yaml: %v", err)
	}
	if rule.Kind != "PrometheusRule" {
		t.Fatalf("prometheus_rule.yaml holds a %q", rule.Kind)
	}
	groups, err := yaml.Marshal(rule.Spec)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), groups, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(bin, "check", "rules", filepath.Join(dir, "rules.yaml")).CombinedOutput(); err != nil {
		t.Fatalf("promtool check rules: %v\n%s", err, out)
	}

	var rules ruleFile
	if err := yaml.Unmarshal(groups, &rules); err != nil {
		t.Fatal(err)
	}
	alerts := map[string]bool{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			alerts[r.Alert] = true
			if s := r.Label["severity"]; s != "critical" && s != "warning" {
				t.Errorf("alert %s has severity %q, want critical or warning", r.Alert, s)
			}
			for _, unbounded := range []string{"user", "packet_id", "packetid"} {
				if strings.Contains(strings.ToLower(r.Expr), unbounded) {
					t.Errorf("alert %s's expression mentions %q: no label may carry a user or packet id", r.Alert, unbounded)
				}
			}
		}
	}
	if len(alerts) < 10 {
		t.Errorf("%d alerts, want the dozen the PrometheusRule defines", len(alerts))
	}

	testDir := filepath.Join(root, "config", "prometheus", "tests")
	entries, err := os.ReadDir(testDir)
	if err != nil {
		t.Fatal(err)
	}
	fires, silent := map[string]int{}, map[string]int{}
	var testFiles []string
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".yaml") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(testDir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		var tests promtoolTests
		if err := yaml.Unmarshal(b, &tests); err != nil {
			t.Fatalf("%s: %v", e.Name(), err)
		}
		for _, tc := range tests.Tests {
			for _, a := range tc.AlertRuleTest {
				if !alerts[a.Alertname] {
					t.Errorf("%s: test %q checks alert %s, which the rules do not define", e.Name(), tc.Name, a.Alertname)
				}
				if len(a.ExpAlerts) > 0 {
					fires[a.Alertname]++
				} else {
					silent[a.Alertname]++
				}
			}
		}
		if err := os.WriteFile(filepath.Join(dir, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
		testFiles = append(testFiles, e.Name())
	}
	var names []string
	for a := range alerts {
		names = append(names, a)
	}
	sort.Strings(names)
	for _, a := range names {
		if fires[a] == 0 || silent[a] == 0 {
			t.Errorf("alert %s has %d firing and %d silent cases in config/prometheus/tests; want at least one of each", a, fires[a], silent[a])
		}
	}

	cmd := exec.Command(bin, append([]string{"test", "rules"}, testFiles...)...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "SUCCESS") {
		t.Fatalf("promtool test rules did not report SUCCESS:\n%s", out)
	}
	t.Logf("promtool test rules: %d alerts, each firing and silent, in %v", len(names), testFiles)
}
