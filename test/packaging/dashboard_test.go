package packaging

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/test/wait"
)

// dashboardPanel is the part of a Grafana panel the test reads.
type dashboardPanel struct {
	Title   string `json:"title"`
	Type    string `json:"type"`
	Targets []struct{ Expr string }
	Panels  []dashboardPanel `json:"panels"`
}

// dashboardQueries returns every query of the dashboard by where it is: panel
// targets and the templating variables' queries.
func dashboardQueries(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "config", "grafana", "redpacket-operator.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels     []dashboardPanel `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	queries := map[string]string{}
	var walk func([]dashboardPanel)
	walk = func(ps []dashboardPanel) {
		for _, p := range ps {
			if p.Type != "row" && len(p.Targets) == 0 && len(p.Panels) == 0 {
				t.Errorf("panel %q has no query", p.Title)
			}
			for i, tg := range p.Targets {
				queries[fmt.Sprintf("panel %q query %d", p.Title, i)] = tg.Expr
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		q, _ := v.Query.(map[string]any)
		s, _ := q["query"].(string)
		queries["variable "+v.Name] = s
	}
	return queries
}

// promqlKeywords are the words of PromQL that are not metric names: aggregations,
// the binary and set operators, and the modifiers.
var promqlKeywords = map[string]bool{
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
	"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true,
	"limitk": true, "limit_ratio": true, "by": true, "without": true, "on": true, "ignoring": true,
	"group_left": true, "group_right": true, "bool": true, "and": true, "or": true, "unless": true,
	"offset": true, "atan2": true,
}

// labelListKeywords take a parenthesized list of label names.
var labelListKeywords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

// metricNames returns the metric names a PromQL expression selects: identifiers
// outside label matchers, ranges and strings that are not keywords, not functions
// (followed by "("), and not in a by/without/on/ignoring label list. Grafana's
// label_values(metric, label) names its first argument.
func metricNames(expr string) ([]string, error) {
	if strings.HasPrefix(strings.TrimSpace(expr), "label_values(") {
		inner := strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(expr), "label_values("), ")")
		sel, _, ok := strings.Cut(inner, ",")
		if !ok {
			return nil, fmt.Errorf("label_values without a label: %q", expr)
		}
		expr = sel
	}
	var names []string
	isStart := func(c byte) bool { return c == '_' || c == ':' || (c|0x20 >= 'a' && c|0x20 <= 'z') }
	isPart := func(c byte) bool { return isStart(c) || (c >= '0' && c <= '9') }
	skipTo := func(i int, open, close byte) (int, error) {
		depth := 0
		for j := i; j < len(expr); j++ {
			switch expr[j] {
			case '"', '\'', '`':
				end := strings.IndexByte(expr[j+1:], expr[j])
				if end < 0 {
					return 0, fmt.Errorf("unterminated string in %q", expr)
				}
				j += end + 1
			case open:
				depth++
			case close:
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, fmt.Errorf("unbalanced %c in %q", open, expr)
	}
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '{':
			j, err := skipTo(i, '{', '}')
			if err != nil {
				return nil, err
			}
			i = j
		case c == '[':
			j, err := skipTo(i, '[', ']')
			if err != nil {
				return nil, err
			}
			i = j
		case c == '"' || c == '\'' || c == '`':
			end := strings.IndexByte(expr[i+1:], c)
			if end < 0 {
				return nil, fmt.Errorf("unterminated string in %q", expr)
			}
			i += end + 2
		case c >= '0' && c <= '9' || c == '.':
			for i < len(expr) && (isPart(expr[i]) || expr[i] == '.') {
				i++
			}
		case isStart(c):
			j := i
			for j < len(expr) && isPart(expr[j]) {
				j++
			}
			word := expr[i:j]
			k := j
			for k < len(expr) && expr[k] == ' ' {
				k++
			}
			followedByParen := k < len(expr) && expr[k] == '('
			switch {
			case labelListKeywords[word] && followedByParen:
				end, err := skipTo(k, '(', ')')
				if err != nil {
					return nil, err
				}
				j = end
			case promqlKeywords[word], followedByParen:
			default:
				names = append(names, word)
			}
			i = j
		default:
			i++
		}
	}
	return names, nil
}

// TestMetricNamesOfPromQL checks the extractor the dashboard test relies on.
func TestMetricNamesOfPromQL(t *testing.T) {
	for expr, want := range map[string]string{
		`sum by (outcome) (rate(a_total{namespace=~"$namespace", name=~"x"}[$__rate_interval]))`:    "a_total",
		`histogram_quantile(0.99, sum by (le) (rate(b_bucket{x="{"}[5m])))`:                         "b_bucket",
		`max by (namespace, name) (c) == 0 unless on (namespace, name) max(d{phase="Failed"}) == 1`: "c d",
		`label_values(e{namespace=~"$namespace"}, name)`:                                            "e",
		`sum without (pod) (f offset 5m) / ignoring (le) g`:                                         "f g",
	} {
		got, err := metricNames(expr)
		if err != nil {
			t.Fatalf("%s: %v", expr, err)
		}
		if strings.Join(got, " ") != want {
			t.Errorf("metricNames(%s) = %q, want %q", expr, got, want)
		}
	}
}

// scrape reads a /metrics endpoint.
func scrape(url string) (map[string]*dto.MetricFamily, error) {
	resp, err := http.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return nil, fmt.Errorf("GET %s: HTTP %d: %s", url, resp.StatusCode, b)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(resp.Body)
}

// findSeries returns the series of family name that has the labels, or nil.
func findSeries(fams map[string]*dto.MetricFamily, name string, labels map[string]string) *dto.Metric {
	f, ok := fams[name]
	if !ok {
		return nil
	}
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, lp := range m.GetLabel() {
			have[lp.GetName()] = lp.GetValue()
		}
		match := true
		for k, v := range labels {
			match = match && have[k] == v
		}
		if match {
			return m
		}
	}
	return nil
}

// hasSeries reports whether fams has a series of family name with the labels.
func hasSeries(fams map[string]*dto.MetricFamily, name string, labels map[string]string) bool {
	return findSeries(fams, name, labels) != nil
}

// gaugeValue is the value of the gauge of family name with the labels, or -1.
func gaugeValue(fams map[string]*dto.MetricFamily, name string, labels map[string]string) float64 {
	if m := findSeries(fams, name, labels); m != nil {
		return m.GetGauge().GetValue()
	}
	return -1
}

// TestDashboardQueriesNameExportedMetrics runs an activity with settlement to its end
// through the manager (which settles it) and a grab service (real processes, a real
// Redis and API server), scrapes both /metrics endpoints, and checks that every metric each
// dashboard query names is one of them exports. It also checks that no redpacket_
// series carries a label outside a small fixed set, or a user id as a value.
func TestDashboardQueriesNameExportedMetrics(t *testing.T) {
	queries := dashboardQueries(t)
	if len(queries) < 15 {
		t.Fatalf("the dashboard has %d queries, want the grab, money and settlement panels' (15 or more)", len(queries))
	}

	e := startLive(t)
	e.dumpLogs(t)
	ns := e.namespace(t)
	a := newActivity(ns, "dash", 600, 6)
	a.Spec.Settlement = &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: e.balanceURL}}
	if err := e.client.Create(t.Context(), a); err != nil {
		t.Fatal(err)
	}
	grabURL := e.startGrab(t, ns, "dash")

	// A budget, configured by the manager (its redpacket_budget_* gauges), and a
	// grab service of its fleet (the redpacket_packets_* metrics).
	budget := &redpacketv1alpha1.RedPacketBudget{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "dash-budget"},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{Total: 10_000, BudgetShards: 2,
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 1000}}}
	if err := e.client.Create(t.Context(), budget); err != nil {
		t.Fatal(err)
	}
	budgetURL := e.startBudgetGrab(t, budget)
	var users []string
	for i := range 7 {
		users = append(users, fmt.Sprintf("dash-user-%d", i))
	}
	for _, u := range users {
		resp, err := http.Post(grabURL+"/v1/grab", "application/json", strings.NewReader(`{"userId":"`+u+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
	}

	// The activity is exhausted (the seventh user found it sold out), its six grants
	// settled, and the manager has seen it closed: then every series is there.
	activity := map[string]string{"namespace": ns, "name": "dash"}
	var manager, grab, fleet map[string]*dto.MetricFamily
	wait.Until(t, 60*time.Second, "the activity's series in both scrapes", func() (bool, string) {
		var err error
		if manager, err = scrape(e.metricsURL); err != nil {
			return false, err.Error()
		}
		if grab, err = scrape(grabURL + "/metrics"); err != nil {
			return false, err.Error()
		}
		if fleet, err = scrape(budgetURL + "/metrics"); err != nil {
			return false, err.Error()
		}
		switch {
		case gaugeValue(manager, "redpacket_budget_total_amount", map[string]string{"namespace": ns, "name": "dash-budget"}) != 10_000:
			return false, "the budget's total is not exported yet (not configured)"
		case !hasSeries(manager, "redpacket_activity_conservation_error", activity):
			return false, "no conservation error series of the activity (refundedAmount not set yet)"
		case !hasSeries(manager, "redpacket_activity_redis_imbalance", map[string]string{"namespace": ns, "name": "dash", "unit": "packets"}):
			return false, "no Redis imbalance series of the activity (no conservation check yet)"
		case !hasSeries(manager, "redpacket_activity_phase", map[string]string{"namespace": ns, "name": "dash", "phase": "Exhausted"}):
			return false, "no phase series"
		case gaugeValue(manager, "redpacket_activity_claimed_amount", activity) != 600:
			return false, fmt.Sprintf("claimed amount %v, want 600", gaugeValue(manager, "redpacket_activity_claimed_amount", activity))
		case gaugeValue(manager, "redpacket_activity_settled_packets", activity) != 6:
			return false, fmt.Sprintf("settled packets %v, want 6", gaugeValue(manager, "redpacket_activity_settled_packets", activity))
		case !hasSeries(manager, "redpacket_settlement_deliveries_total", map[string]string{"result": "settled", "activity": ns + "/dash"}):
			return false, "no settled delivery in the operator's settlement metrics"
		}
		return true, ""
	})
	for _, unit := range []string{"packets", "amount"} {
		if v := gaugeValue(manager, "redpacket_activity_redis_imbalance", map[string]string{"namespace": ns, "name": "dash", "unit": unit}); v != 0 {
			t.Errorf("redpacket_activity_redis_imbalance{unit=%q} = %v, want 0", unit, v)
		}
	}

	exported := map[string]dto.MetricType{}
	for _, fams := range []map[string]*dto.MetricFamily{manager, grab, fleet} {
		for name, f := range fams {
			exported[name] = f.GetType()
		}
	}
	known := func(name string) bool {
		if _, ok := exported[name]; ok {
			return true
		}
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			base, ok := strings.CutSuffix(name, suffix)
			if !ok {
				continue
			}
			if typ, ok := exported[base]; ok && (typ == dto.MetricType_HISTOGRAM || (suffix != "_bucket" && typ == dto.MetricType_SUMMARY)) {
				return true
			}
		}
		return false
	}
	where := make([]string, 0, len(queries))
	for w := range queries {
		where = append(where, w)
	}
	sort.Strings(where)
	used := map[string]bool{}
	for _, w := range where {
		names, err := metricNames(queries[w])
		if err != nil {
			t.Errorf("%s: %v", w, err)
			continue
		}
		if len(names) == 0 {
			t.Errorf("%s names no metric: %s", w, queries[w])
		}
		for _, n := range names {
			used[n] = true
			if !known(n) {
				t.Errorf("%s names %s, which neither the manager nor the grab service exports: %s", w, n, queries[w])
			}
		}
	}
	t.Logf("%d dashboard queries name %d metrics; the manager and the grab services export %d families", len(queries), len(used), len(exported))

	// Labels: a small fixed set, never a user id.
	allowed := map[string]bool{"namespace": true, "name": true, "phase": true, "reason": true, "outcome": true,
		"op": true, "stage": true, "kind": true, "result": true, "activity": true, "le": true, "unit": true}
	for _, fams := range []map[string]*dto.MetricFamily{manager, grab, fleet} {
		for name, f := range fams {
			if !strings.HasPrefix(name, "redpacket_") {
				continue
			}
			for _, m := range f.GetMetric() {
				for _, lp := range m.GetLabel() {
					if !allowed[lp.GetName()] {
						t.Errorf("%s has label %s=%q, outside the allowed set", name, lp.GetName(), lp.GetValue())
					}
					if strings.Contains(lp.GetValue(), "dash-user-") {
						t.Errorf("%s carries a user id: %s=%q", name, lp.GetName(), lp.GetValue())
					}
				}
			}
		}
	}
	if v := gaugeValue(manager, "redpacket_activity_conservation_error", activity); v != 0 {
		t.Errorf("redpacket_activity_conservation_error of the exhausted activity is %v, want 0", v)
	}
}

// budgetPanels are what the dashboard must show of budgets: each metric, filtered on
// the $budget variable (budgetFilter, or the settlement series' activity label).
var budgetPanels = map[string]string{
	"redpacket_budget_total_amount":           "money: total",
	"redpacket_budget_available_amount":       "money: available",
	"redpacket_budget_in_packets_amount":      "money: in packets",
	"redpacket_budget_claimed_amount":         "money: claimed",
	"redpacket_budget_refunded_amount":        "money: refunded",
	"redpacket_budget_live_packets":           "live packets",
	"redpacket_budget_created_packets":        "created packets",
	"redpacket_budget_expired_packets":        "expired packets",
	"redpacket_budget_overdue_packets":        "overdue packets (expiry backlog)",
	"redpacket_budget_conservation_error":     "conservation error",
	"redpacket_packets_create_requests_total": "created/s",
	"redpacket_packets_grab_requests_total":   "grabbed/s",
	"redpacket_settlement_pending_entries":    "settlement pending",
	"redpacket_settlement_dead_letters_total": "settlement dead letters",
}

// The dashboard shows every budget figure an operator of budgets needs, each in a
// panel query that follows the $budget variable: removing a budget panel, or one of
// its queries, fails here. The budget variable lists the budgets the operator exports.
func TestDashboardHasBudgetPanels(t *testing.T) {
	queries := dashboardQueries(t)
	shown := map[string][]string{}
	for where, q := range queries {
		if !strings.Contains(q, "$budget") || !strings.HasPrefix(where, "panel ") {
			continue
		}
		names, err := metricNames(q)
		if err != nil {
			t.Fatalf("%s: %v", where, err)
		}
		for _, n := range names {
			shown[n] = append(shown[n], where)
		}
	}
	for metric, what := range budgetPanels {
		if len(shown[metric]) == 0 {
			t.Errorf("no panel shows the budgets' %s (%s filtered on $budget)", what, metric)
		}
	}
	for metric, wheres := range shown {
		if _, ok := budgetPanels[metric]; !ok {
			t.Errorf("%v filter on $budget but name %s, which is no budget figure the test knows", wheres, metric)
		}
	}
	if v := queries["variable budget"]; !strings.Contains(v, "redpacket_budget_") {
		t.Errorf("the budget variable's query %q does not list budgets", v)
	}
}
