package main

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// The Grafana dashboard: one JSON model, shipped as a ConfigMap that Grafana's
// dashboard sidecar picks up by its grafana_dashboard label. Every panel query
// filters on the $namespace variable and on $activity, or on $budget in the budgets'
// row; test/packaging checks that each names a metric the operator or the grab
// service exports, and that the budgets' panels are there.

// dashboardUID is the dashboard's stable identifier (links survive re-imports).
const dashboardUID = "redpacket-operator"

// activityFilter selects the series of the chosen activities.
const activityFilter = `namespace=~"$namespace", name=~"$activity"`

// settlementFilter selects the operator's settlement series of the chosen activities,
// which name the activity in one label, activity="<namespace>/<name>".
const settlementFilter = `activity=~"$namespace/$activity"`

// budgetFilter selects the series of the chosen budgets: the operator's
// redpacket_budget_* gauges, and the packet metrics of a budget's grab pods (the
// PodMonitor names them after the pod's redpacket.io/budget label).
const budgetFilter = `namespace=~"$namespace", name=~"$budget"`

// budgetSettlementFilter selects the operator's settlement series of the chosen
// budgets, which name the budget in the activity label, "<namespace>/<name>", as
// settlement.BudgetConfigFor does.
const budgetSettlementFilter = `activity=~"$namespace/$budget"`

type gridPos struct {
	H int `json:"h"`
	W int `json:"w"`
	X int `json:"x"`
	Y int `json:"y"`
}

type target struct {
	RefID        string         `json:"refId"`
	Datasource   map[string]any `json:"datasource"`
	Expr         string         `json:"expr"`
	LegendFormat string         `json:"legendFormat,omitempty"`
	Instant      bool           `json:"instant,omitempty"`
	Format       string         `json:"format,omitempty"`
}

type panel struct {
	ID          int            `json:"id"`
	Type        string         `json:"type"`
	Title       string         `json:"title"`
	Description string         `json:"description,omitempty"`
	GridPos     gridPos        `json:"gridPos"`
	Datasource  map[string]any `json:"datasource,omitempty"`
	Targets     []target       `json:"targets,omitempty"`
	FieldConfig map[string]any `json:"fieldConfig,omitempty"`
	Options     map[string]any `json:"options,omitempty"`
	Collapsed   *bool          `json:"collapsed,omitempty"`
	Panels      []panel        `json:"panels,omitempty"`
}

// query is one panel query: a PromQL expression (with %s standing for the activity
// filter) and its legend.
type query struct {
	expr, legend string
}

// panelSpec is a panel before layout.
type panelSpec struct {
	kind, title, description, unit string
	width                          int
	queries                        []query
}

var datasourceRef = map[string]any{"type": "prometheus", "uid": "${datasource}"}

// dashboardRows are the dashboard's rows of panels, top to bottom. A row's filter
// stands for %s in its queries.
var dashboardRows = []struct {
	title, filter string
	panels        []panelSpec
}{
	{"Grabs", activityFilter, []panelSpec{
		{kind: "timeseries", title: "Grabs/s by outcome", unit: "reqps", width: 12,
			description: "Grab requests answered per second, by outcome (granted, already_claimed, sold_out, unavailable, ...).",
			queries:     []query{{`sum by (outcome) (rate(redpacket_grab_requests_total{%s}[$__rate_interval]))`, "{{outcome}}"}}},
		{kind: "timeseries", title: "Claim latency", unit: "s", width: 12,
			description: "Time Redis took to decide a claim, pipeline queueing included: median, 99th and 99.9th percentile.",
			queries: []query{
				{`histogram_quantile(0.5, sum by (le) (rate(redpacket_grab_claim_duration_seconds_bucket{%s}[$__rate_interval])))`, "p50"},
				{`histogram_quantile(0.99, sum by (le) (rate(redpacket_grab_claim_duration_seconds_bucket{%s}[$__rate_interval])))`, "p99"},
				{`histogram_quantile(0.999, sum by (le) (rate(redpacket_grab_claim_duration_seconds_bucket{%s}[$__rate_interval])))`, "p99.9"},
			}},
		{kind: "timeseries", title: "Redis errors/s", unit: "ops", width: 12,
			description: "Redis calls of the grab service that failed or ran past their deadline, by operation.",
			queries:     []query{{`sum by (namespace, name, op) (rate(redpacket_grab_redis_errors_total{%s}[$__rate_interval]))`, "{{namespace}}/{{name}} {{op}}"}}},
		{kind: "timeseries", title: "Status report lag", unit: "s", width: 12,
			description: "Seconds since each grab pod last wrote the activity's status counters.",
			queries:     []query{{`max by (namespace, name, pod) (redpacket_grab_report_lag_seconds{%s})`, "{{pod}}"}}},
	}},
	{"Money", activityFilter, []panelSpec{
		{kind: "timeseries", title: "Remaining packets", unit: "short", width: 8,
			description: "status.remainingCount of each activity.",
			queries:     []query{{`max by (namespace, name) (redpacket_activity_remaining_packets{%s})`, "{{namespace}}/{{name}}"}}},
		{kind: "timeseries", title: "Claimed packets", unit: "short", width: 8,
			description: "status.claimedCount of each activity.",
			queries:     []query{{`max by (namespace, name) (redpacket_activity_claimed_packets{%s})`, "{{namespace}}/{{name}}"}}},
		{kind: "timeseries", title: "Claimed and remaining amount (minor units)", unit: "short", width: 8,
			description: "status.claimedAmount and status.remainingAmount, in the currency's minor unit (fen, cents).",
			queries: []query{
				{`max by (namespace, name) (redpacket_activity_claimed_amount{%s})`, "{{namespace}}/{{name}} claimed"},
				{`max by (namespace, name) (redpacket_activity_remaining_amount{%s})`, "{{namespace}}/{{name}} remaining"},
			}},
		{kind: "table", title: "Activities", unit: "short", width: 16,
			description: "Each activity's phase, Ready, total and refund (minor units); conservation error must be 0.",
			queries: []query{
				{`max by (namespace, name, phase) (redpacket_activity_phase{%s}) == 1`, "phase"},
				{`max by (namespace, name) (redpacket_activity_ready{%s})`, "ready"},
				{`max by (namespace, name) (redpacket_activity_total_amount{%s})`, "total"},
				{`max by (namespace, name) (redpacket_activity_refunded_amount{%s})`, "refunded"},
			}},
		{kind: "stat", title: "Conservation error (minor units)", unit: "short", width: 8,
			description: "totalAmount - (claimedAmount + remainingAmount + refundedAmount) per activity; anything but 0 is a page.",
			queries:     []query{{`max by (namespace, name) (abs(redpacket_activity_conservation_error{%s}))`, "{{namespace}}/{{name}}"}}},
	}},
	{"Settlement", activityFilter, []panelSpec{
		{kind: "timeseries", title: "Settlement lag", unit: "s", width: 12,
			description: "Seconds from a claim (or refund) to its acknowledged delivery to the balance system: 50th and 99th percentile.",
			queries: []query{
				{`histogram_quantile(0.5, sum by (activity, le) (rate(redpacket_settlement_lag_seconds_bucket{` + settlementFilter + `}[$__rate_interval])))`, "{{activity}} p50"},
				{`histogram_quantile(0.99, sum by (activity, le) (rate(redpacket_settlement_lag_seconds_bucket{` + settlementFilter + `}[$__rate_interval])))`, "{{activity}} p99"},
			}},
		{kind: "timeseries", title: "Deliveries/s by result", unit: "ops", width: 12,
			description: "Settlement webhook deliveries by result (settled, already_settled, rejected, no_answer), and retries.",
			queries: []query{
				{`sum by (result) (rate(redpacket_settlement_deliveries_total{` + settlementFilter + `}[$__rate_interval]))`, "{{result}}"},
				{`sum (rate(redpacket_settlement_retries_total{` + settlementFilter + `}[$__rate_interval]))`, "retries"},
			}},
		{kind: "timeseries", title: "Dead letters", unit: "short", width: 12,
			description: "Deliveries parked after too many failures: per activity (status.deadLetterCount) and parked in the interval.",
			queries: []query{
				{`max by (namespace, name) (redpacket_activity_dead_letters{%s})`, "{{namespace}}/{{name}} parked"},
				{`sum by (activity) (increase(redpacket_settlement_dead_letters_total{` + settlementFilter + `}[$__rate_interval]))`, "{{activity}} new"},
			}},
		{kind: "timeseries", title: "Pending and settled", unit: "short", width: 12,
			description: "Claims read by settlement and not yet acknowledged, and grants credited so far (status.settledCount).",
			queries: []query{
				{`max by (activity) (redpacket_settlement_pending_entries{` + settlementFilter + `})`, "{{activity}} pending"},
				{`max by (namespace, name) (redpacket_activity_settled_packets{%s})`, "{{namespace}}/{{name}} settled"},
			}},
	}},
	{"Budgets", budgetFilter, []panelSpec{
		{kind: "timeseries", title: "Budget money (minor units)", unit: "short", width: 12,
			description: "Each budget's total, what new packets may still draw (available), what live packets hold, what was granted (claimed) and refunded; total = available + in packets + claimed + refunded.",
			queries: []query{
				{`max by (namespace, name) (redpacket_budget_total_amount{%s})`, "{{namespace}}/{{name}} total"},
				{`max by (namespace, name) (redpacket_budget_available_amount{%s})`, "{{namespace}}/{{name}} available"},
				{`max by (namespace, name) (redpacket_budget_in_packets_amount{%s})`, "{{namespace}}/{{name}} in packets"},
				{`max by (namespace, name) (redpacket_budget_claimed_amount{%s})`, "{{namespace}}/{{name}} claimed"},
				{`max by (namespace, name) (redpacket_budget_refunded_amount{%s})`, "{{namespace}}/{{name}} refunded"},
			}},
		{kind: "timeseries", title: "Budget packets", unit: "short", width: 12,
			description: "Live packets (not expired), and packets created and expired since the budget was configured.",
			queries: []query{
				{`max by (namespace, name) (redpacket_budget_live_packets{%s})`, "{{namespace}}/{{name}} live"},
				{`max by (namespace, name) (redpacket_budget_created_packets{%s})`, "{{namespace}}/{{name}} created"},
				{`max by (namespace, name) (redpacket_budget_expired_packets{%s})`, "{{namespace}}/{{name}} expired"},
			}},
		{kind: "timeseries", title: "Packets created/s and grabbed/s", unit: "ops", width: 12,
			description: "Packets created (POST /v1/packets answered created) and shares granted per second by each budget's grab fleet.",
			queries: []query{
				{`sum by (namespace, name) (rate(redpacket_packets_create_requests_total{%s, outcome="created"}[$__rate_interval]))`, "{{namespace}}/{{name}} created/s"},
				{`sum by (namespace, name) (rate(redpacket_packets_grab_requests_total{%s, outcome="granted"}[$__rate_interval]))`, "{{namespace}}/{{name}} grabbed/s"},
			}},
		{kind: "timeseries", title: "Overdue packets (expiry backlog)", unit: "short", width: 12,
			description: "Live packets past their expiry that were not expired yet: the expiry driver's backlog. It should stay near 0; a growing backlog delays refunds.",
			queries:     []query{{`max by (namespace, name) (redpacket_budget_overdue_packets{%s})`, "{{namespace}}/{{name}}"}}},
		{kind: "timeseries", title: "Budget settlement: pending and dead letters", unit: "short", width: 12,
			description: "Grants and refunds of each budget read by settlement and not yet acknowledged, and deliveries parked as dead letters in the interval.",
			queries: []query{
				{`max by (activity) (redpacket_settlement_pending_entries{` + budgetSettlementFilter + `})`, "{{activity}} pending"},
				{`sum by (activity) (increase(redpacket_settlement_dead_letters_total{` + budgetSettlementFilter + `}[$__rate_interval]))`, "{{activity}} dead letters"},
			}},
		{kind: "stat", title: "Budget conservation error (minor units)", unit: "short", width: 12,
			description: "total - (available + in packets + claimed + refunded) per budget from one snapshot; anything but 0 is a page.",
			queries:     []query{{`max by (namespace, name) (abs(redpacket_budget_conservation_error{%s}))`, "{{namespace}}/{{name}}"}}},
	}},
}

// dashboardJSON is the dashboard's JSON model, indented, with a final newline.
func dashboardJSON() ([]byte, error) {
	var panels []panel
	id, y := 1, 0
	for _, row := range dashboardRows {
		collapsed := false
		panels = append(panels, panel{ID: id, Type: "row", Title: row.title, GridPos: gridPos{H: 1, W: 24, X: 0, Y: y}, Collapsed: &collapsed})
		id++
		y++
		x, rowHeight := 0, 8
		for _, spec := range row.panels {
			if x+spec.width > 24 {
				x = 0
				y += rowHeight
			}
			p := panel{
				ID: id, Type: spec.kind, Title: spec.title, Description: spec.description,
				GridPos:     gridPos{H: rowHeight, W: spec.width, X: x, Y: y},
				Datasource:  datasourceRef,
				FieldConfig: map[string]any{"defaults": map[string]any{"unit": spec.unit}, "overrides": []any{}},
			}
			for i, q := range spec.queries {
				t := target{
					RefID:        string(rune('A' + i)),
					Datasource:   datasourceRef,
					Expr:         fmt.Sprintf(q.expr, repeat(row.filter, countVerbs(q.expr))...),
					LegendFormat: q.legend,
				}
				if spec.kind == "table" {
					t.Instant, t.Format, t.LegendFormat = true, "table", ""
				}
				p.Targets = append(p.Targets, t)
			}
			if spec.kind == "table" {
				p.Options = map[string]any{"showHeader": true}
			}
			panels = append(panels, p)
			id++
			x += spec.width
		}
		y += rowHeight
	}

	variable := func(name, label, query string) map[string]any {
		return map[string]any{
			"name": name, "label": label, "type": "query", "datasource": datasourceRef,
			"query":      map[string]any{"query": query, "refId": name},
			"definition": query, "refresh": 2, "includeAll": true, "multi": true, "allValue": ".*",
			"current": map[string]any{"text": "All", "value": "$__all"}, "sort": 1,
		}
	}
	model := map[string]any{
		"uid":           dashboardUID,
		"title":         "Red packets",
		"description":   "redpacket-operator: grabs, money per activity, settlement, and budgets' money, packets and settlement. docs/monitoring.md explains each panel and alert.",
		"tags":          []string{"redpacket"},
		"timezone":      "browser",
		"editable":      true,
		"schemaVersion": 39,
		"version":       1,
		"refresh":       "30s",
		"time":          map[string]any{"from": "now-1h", "to": "now"},
		"graphTooltip":  1,
		"annotations":   map[string]any{"list": []any{}},
		"links":         []any{},
		"panels":        panels,
		"templating": map[string]any{"list": []any{
			map[string]any{"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
				"current": map[string]any{}, "hide": 0, "refresh": 1},
			variable("namespace", "Namespace", `label_values(redpacket_activity_phase, namespace)`),
			variable("activity", "Activity", `label_values(redpacket_activity_phase{namespace=~"$namespace"}, name)`),
			variable("budget", "Budget", `label_values(redpacket_budget_total_amount{namespace=~"$namespace"}, name)`),
		}},
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(model); err != nil {
		return nil, fmt.Errorf("encoding the dashboard: %w", err)
	}
	return buf.Bytes(), nil
}

// countVerbs counts the %s in a query template.
func countVerbs(s string) int { return bytes.Count([]byte(s), []byte("%s")) }

func repeat(s string, n int) []any {
	out := make([]any, n)
	for i := range out {
		out[i] = s
	}
	return out
}
