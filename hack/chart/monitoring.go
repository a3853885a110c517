package main

import (
	"fmt"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// Labels the monitors select by. The operator's metrics Service carries
// operatorSelector (config/manager/metrics_service.yaml); every grab pod carries
// specs.GrabSelector (controllers/specs/grab.go), and its label redpacket.io/activity
// names its activity (grabActivityMetaLabel, as service discovery presents it); a
// budget's grab pod carries redpacket.io/budget instead (grabBudgetMetaLabel).
var (
	operatorSelector = map[string]string{
		"app.kubernetes.io/name":      "redpacket-operator",
		"app.kubernetes.io/component": "controller",
	}
	grabSelector = map[string]string{
		"app.kubernetes.io/name":       "redpacket-grab",
		"app.kubernetes.io/managed-by": "redpacket-operator",
	}
)

const (
	grabActivityMetaLabel = "__meta_kubernetes_pod_label_redpacket_io_activity"
	grabBudgetMetaLabel   = "__meta_kubernetes_pod_label_redpacket_io_budget"
	// operatorJob is the job label Prometheus gives the operator's targets: the
	// prometheus-operator names a ServiceMonitor's job after the Service, and the
	// install manifests name the metrics Service so.
	operatorJob    = "redpacket-controller-manager-metrics"
	scrapeInterval = monitoringv1.Duration("30s")
)

// monitorLabels are the labels every monitoring object carries in config/.
func monitorLabels(component string) map[string]string {
	return map[string]string{
		"app.kubernetes.io/name":      "redpacket-operator",
		"app.kubernetes.io/component": component,
	}
}

// serviceMonitor scrapes the operator's metrics Service. honorLabels keeps the
// activity gauges' own namespace label (the activity's namespace) instead of
// renaming it to exported_namespace in favour of the operator pod's namespace.
func serviceMonitor() *monitoringv1.ServiceMonitor {
	return &monitoringv1.ServiceMonitor{
		TypeMeta:   metav1.TypeMeta{APIVersion: monitoringv1.SchemeGroupVersion.String(), Kind: monitoringv1.ServiceMonitorsKind},
		ObjectMeta: metav1.ObjectMeta{Name: "controller-manager", Labels: monitorLabels("controller")},
		Spec: monitoringv1.ServiceMonitorSpec{
			Selector: metav1.LabelSelector{MatchLabels: operatorSelector},
			Endpoints: []monitoringv1.Endpoint{{
				Port:        "metrics",
				Path:        "/metrics",
				Interval:    scrapeInterval,
				HonorLabels: true,
			}},
		},
	}
}

// podMonitor scrapes every grab pod, in every namespace, on its http port, and
// names the activity in a "name" label (the pod's namespace is the activity's), so
// that grab and settlement series join the operator's activity gauges on
// (namespace, name).
func podMonitor() *monitoringv1.PodMonitor {
	port := "http"
	return &monitoringv1.PodMonitor{
		TypeMeta:   metav1.TypeMeta{APIVersion: monitoringv1.SchemeGroupVersion.String(), Kind: monitoringv1.PodMonitorsKind},
		ObjectMeta: metav1.ObjectMeta{Name: "grab", Labels: monitorLabels("grab")},
		Spec: monitoringv1.PodMonitorSpec{
			Selector:          metav1.LabelSelector{MatchLabels: grabSelector},
			NamespaceSelector: monitoringv1.NamespaceSelector{Any: true},
			PodMetricsEndpoints: []monitoringv1.PodMetricsEndpoint{{
				Port:     &port,
				Path:     "/metrics",
				Interval: scrapeInterval,
				// name is the activity's, or the budget's for a budget's grab pod
				// (only a label that is set replaces it: regex (.+)).
				RelabelConfigs: []monitoringv1.RelabelConfig{{
					Action:       "replace",
					SourceLabels: []monitoringv1.LabelName{grabActivityMetaLabel},
					TargetLabel:  "name",
				}, {
					Action:       "replace",
					SourceLabels: []monitoringv1.LabelName{grabBudgetMetaLabel},
					Regex:        "(.+)",
					TargetLabel:  "name",
				}},
			}},
		},
	}
}

// alert is one alerting rule.
type alert struct {
	name, expr, forDuration, severity, summary, description string
}

// perActivity gives the series of an expression aggregated by the activity label,
// which the operator's settlement metrics carry as "<namespace>/<name>" (the operator
// settles every activity from its own namespace), the activity's namespace and name
// labels, as the other alerts have them.
func perActivity(expr string) string {
	return `label_replace(label_replace(` + expr + `, "namespace", "$1", "activity", "([^/]*)/.*"), "name", "$1", "activity", "[^/]*/(.*)")`
}

// alertGroups are the alerts, by the component whose metrics they read. Every one
// says what an on-call person must act on; docs/monitoring.md has what to do.
// config/prometheus/tests/ has a promtool test of each firing and of each staying
// silent.
var alertGroups = []struct {
	name   string
	alerts []alert
}{
	{"redpacket-grab", []alert{
		{
			name: "RedPacketGrabErrors",
			expr: `sum by (namespace, name) (rate(redpacket_grab_requests_total{outcome="unavailable"}[5m]))
  / sum by (namespace, name) (rate(redpacket_grab_requests_total[5m])) > 0.05`,
			forDuration: "5m", severity: "critical",
			summary:     "Grab service of {{ $labels.namespace }}/{{ $labels.name }} answers 503 to {{ $value | humanizePercentage }} of grabs",
			description: "Users of {{ $labels.namespace }}/{{ $labels.name }} are turned away with 503 (unavailable): the grab service cannot reach Redis or its calls time out. Check Redis and redpacket_grab_redis_errors_total.",
		},
		{
			name:        "RedPacketGrabRedisErrors",
			expr:        `sum by (namespace, name) (rate(redpacket_grab_redis_errors_total[5m])) > 0.1`,
			forDuration: "5m", severity: "warning",
			summary:     "Grab service of {{ $labels.namespace }}/{{ $labels.name }} sees Redis errors ({{ $value | humanize }}/s)",
			description: "Redis calls of the grab service fail or run past their deadline. Check the activity's Redis (spec.redis or the operator's default) and the grab pods' logs.",
		},
		{
			name:        "RedPacketGrabReporterStale",
			expr:        `max by (namespace, name, pod) (redpacket_grab_report_lag_seconds) > 60`,
			forDuration: "2m", severity: "warning",
			summary:     "Grab pod {{ $labels.pod }} of {{ $labels.namespace }}/{{ $labels.name }} has not reported status for {{ $value | humanizeDuration }}",
			description: "The grab service could not write the activity's status counters: it cannot reach the API server or Redis. kubectl get shows stale counts and GrabServiceAvailable may turn False. Check redpacket_grab_report_failures_total and the pod's log.",
		},
	}},
	{"redpacket-settlement", []alert{
		{
			name:        "RedPacketSettlementLagging",
			expr:        perActivity(`histogram_quantile(0.99, sum by (activity, le) (rate(redpacket_settlement_lag_seconds_bucket[10m]))) > 300`),
			forDuration: "10m", severity: "warning",
			summary:     "Claims of {{ $labels.namespace }}/{{ $labels.name }} take {{ $value | humanizeDuration }} to be credited (p99)",
			description: "The balance system acknowledges settlement deliveries late: users see their packet but not the money. Check the webhook's latency and errors (redpacket_settlement_deliveries_total by result).",
		},
		{
			name: "RedPacketSettlementStuck",
			expr: perActivity(`max by (activity) (redpacket_settlement_pending_entries) > 0
unless on (activity)
  sum by (activity) (increase(redpacket_settlement_deliveries_total{result=~"settled|already_settled"}[15m])) > 0`),
			forDuration: "15m", severity: "critical",
			summary:     "Settlement of {{ $labels.namespace }}/{{ $labels.name }} delivered nothing for 15 minutes with {{ $value }} claims pending",
			description: "No claim was credited while claims wait: the balance system rejects or does not answer the webhook. Deliveries are retried; after spec.settlement.maxAttempts they go to the dead-letter stream.",
		},
		{
			name:        "RedPacketSettlementDeadLettering",
			expr:        perActivity(`sum by (activity) (increase(redpacket_settlement_dead_letters_total[15m])) > 0`),
			forDuration: "0m", severity: "critical",
			summary:     "Settlement of {{ $labels.namespace }}/{{ $labels.name }} parked {{ $value | humanize }} claims in the dead-letter stream",
			description: "Deliveries failed spec.settlement.maxAttempts times and were parked: those users are not credited until the dead letters are replayed (docs/operations.md).",
		},
		{
			name:        "RedPacketSettlementForgedEntries",
			expr:        perActivity(`sum by (activity) (increase(redpacket_settlement_forged_total[15m])) > 0`),
			forDuration: "0m", severity: "critical",
			summary:     "Settlement of {{ $labels.namespace }}/{{ $labels.name }} refused {{ $value | humanize }} entries that no grab of the activity wrote",
			description: "Entries that do not match the seeded split, credit a packet twice or exceed the activity's total were dead-lettered, not delivered: someone holding the activity's Redis credentials wrote them. The Warning events ForgedSettlementEntry name each packet, user and reason (docs/operations.md, Who can do what).",
		},
		{
			name:        "RedPacketReconciliationMismatch",
			expr:        `max by (source, kind) (redpacket_reconciliation_mismatch{kind=~"unpaid|differing|missing"}) > 0`,
			forDuration: "1m", severity: "critical",
			summary:     "The balance system's book of {{ $labels.source }} differs from what the operator paid: {{ $value }} {{ $labels.kind }} credits",
			description: "The last reconciliation found credits booked that the operator never paid (unpaid), booked with another user or amount (differing), or paid and not booked even after a re-delivery (missing). The resource's Reconciled condition and its Warning events BooksDiffer name the keys; a person must put the book right (docs/operations.md, Reconciliation).",
		},
	}},
	{"redpacket-activity", []alert{
		{
			name:        "RedPacketActivityDeadLetters",
			expr:        `max by (namespace, name) (redpacket_activity_dead_letters) > 0`,
			forDuration: "15m", severity: "warning",
			summary:     "{{ $labels.namespace }}/{{ $labels.name }} has {{ $value }} dead-lettered settlement deliveries",
			description: "Claims in the dead-letter stream are not credited to users. Fix the balance system, then replay them (docs/operations.md).",
		},
		{
			name: "RedPacketActivityNotReady",
			expr: `max by (namespace, name) (redpacket_activity_ready) == 0
unless on (namespace, name)
  max by (namespace, name) (redpacket_activity_phase{phase=~"Exhausted|Expired|Failed"}) == 1`,
			forDuration: "10m", severity: "warning",
			summary:     "{{ $labels.namespace }}/{{ $labels.name }} has not been Ready for 10 minutes",
			description: "The activity is not serving what its phase promises (no grab replica, Redis unavailable, seeding stuck, deletion waiting for settlement). kubectl describe rpa shows the Ready condition's reason and message.",
		},
		{
			name:        "RedPacketActivityStalled",
			expr:        `max by (namespace, name, reason) (redpacket_activity_stalled) == 1`,
			forDuration: "1m", severity: "critical",
			summary:     "{{ $labels.namespace }}/{{ $labels.name }} is stalled: {{ $labels.reason }}",
			description: "The activity cannot go on without a person: its Redis lost its data (DataLost) or rolled back (RedisRolledBack), so grabbing is fenced to avoid paying twice. Follow docs/operations.md before accepting the Redis state.",
		},
		{
			name:        "RedPacketActivityNotPrewarmed",
			expr:        `max by (namespace, name) (redpacket_activity_not_prewarmed) == 1`,
			forDuration: "1m", severity: "critical",
			summary:     "{{ $labels.namespace }}/{{ $labels.name }} started without its prewarmed grab fleet",
			description: "startTime has come and fewer grab pods than spec.grabService.prewarm.replicas are available: the rain is served by a smaller fleet than planned. The Prewarmed condition and the NotPrewarmed Warning say how many are available; check pending grab pods (node capacity, quota, image pulls) and the HPA's maxReplicas (docs/operations.md, Prewarm).",
		},
		{
			name: "RedPacketActivityFailed",
			expr: `max by (namespace, name) (redpacket_activity_phase{phase="Failed"}) == 1
unless on (namespace, name)
  max by (namespace, name) (redpacket_activity_stalled) == 1`,
			forDuration: "5m", severity: "critical",
			summary:     "{{ $labels.namespace }}/{{ $labels.name }} is in phase Failed",
			description: "The activity is Failed (for example DataLost or an invalid spec) and grabbing stays closed. kubectl describe rpa says why.",
		},
		{
			name:        "RedPacketConservationError",
			expr:        `max by (namespace, name) (abs(redpacket_activity_conservation_error)) > 0`,
			forDuration: "5m", severity: "critical",
			summary:     "Money of {{ $labels.namespace }}/{{ $labels.name }} does not add up: off by {{ $value }} minor units",
			description: "claimedAmount + remainingAmount + refundedAmount differs from totalAmount in the activity's status. Stop and reconcile the activity's Redis stream against the balance system before anything else is paid.",
		},
		{
			name:        "RedPacketRedisImbalance",
			expr:        `max by (namespace, name, unit) (redpacket_activity_redis_imbalance) > 0`,
			forDuration: "2m", severity: "critical",
			summary:     "Redis holds {{ $value }} {{ $labels.unit }} of {{ $labels.namespace }}/{{ $labels.name }} out of place",
			description: "A reading of every shard found packets or money that are in none of the places they can be (listed, claimed, in transfer between shards, refunded), or in two. Pause the activity and compare its claims and stream with the balance system before anything else is paid.",
		},
	}},
	{"redpacket-budget", []alert{
		{
			name:        "RedPacketBudgetNearlyExhausted",
			expr:        `max by (namespace, name) (redpacket_budget_available_amount) / max by (namespace, name) (redpacket_budget_total_amount) < 0.05`,
			forDuration: "5m", severity: "warning",
			summary:     "Budget {{ $labels.namespace }}/{{ $labels.name }} has {{ $value | humanizePercentage }} of its total left to draw",
			description: "New packets are refused with budget_exhausted once a packet's total is more than its shard has available. Raise spec.total to refill the budget, or let the merchant know.",
		},
		{
			name:        "RedPacketBudgetExpiryBacklog",
			expr:        `max by (namespace, name) (redpacket_budget_overdue_packets) > 10000`,
			forDuration: "5m", severity: "warning",
			summary:     "{{ $value }} packets of budget {{ $labels.namespace }}/{{ $labels.name }} are past their expiry and not expired",
			description: "The operator's expiry driver runs every 250 ms and leaves a few hundred overdue packets at thousands of expiries a second; a backlog this large for 5 minutes means it is not running (no leader, Redis unreachable) or cannot keep up, and senders wait for their refunds. Check the operator's log and the budget's Stalled condition.",
		},
		{
			name:        "RedPacketBudgetExpiryOverdue",
			expr:        `max by (namespace, name) (redpacket_budget_expiry_overdue_seconds) > 1`,
			forDuration: "2m", severity: "warning",
			summary:     "Budget {{ $labels.namespace }}/{{ $labels.name }} has a packet waiting {{ $value | humanizeDuration }} past its expiry",
			description: "Each budget's due packets are expired on their own within the driver's 250 ms interval and one pass, whatever other budgets hold; a wait over 1 s for 2 minutes means this budget's due index grows faster than its pass expires it (a flood of its own due index, for example forged through its Redis user) or its Redis is slow. Its senders wait for their refunds; other budgets are not held. Check the budget's due index (ZCARD of its rpb:{<uid>.<shard>}:due keys) and the operator's log.",
		},
		{
			name:        "RedPacketBudgetConservationError",
			expr:        `max by (namespace, name) (abs(redpacket_budget_conservation_error)) > 0`,
			forDuration: "2m", severity: "critical",
			summary:     "Money of budget {{ $labels.namespace }}/{{ $labels.name }} does not add up: off by {{ $value }} minor units",
			description: "available + in packets + claimed + refunded differs from the total in Redis (the budget is Stalled ConservationBroken). Something wrote the budget's keys outside its scripts. Stop creation and compare the budget's streams with the balance system before anything else is paid.",
		},
		{
			name:        "RedPacketBudgetMoneyFault",
			expr:        `max by (namespace, name) (redpacket_budget_money_faults) > 0`,
			forDuration: "2m", severity: "critical",
			summary:     "Budget {{ $labels.namespace }}/{{ $labels.name }} broke {{ $value }} money checks in Redis",
			description: "A shard's own sums, the money borrowed between shards against what was lent, money below zero, or the settlement ledger against what the shards paid out do not add up, even where the budget's sums still agree (the budget is Stalled ConservationBroken; its Warning names each fault). No script leaves that: the budget's Redis user wrote its keys by hand, for example a forged budget_borrow that makes money no sibling gave, or a packet hash with its grant. It can re-route this budget's money only, and the operator's ledger still credits no more than the announced total. Stop creation, read the budget's events, and compare its streams with the balance system.",
		},
	}},
	{"redpacket-operator", []alert{
		{
			name:        "RedPacketOperatorDown",
			expr:        fmt.Sprintf(`absent(up{job=%q} == 1)`, operatorJob),
			forDuration: "10m", severity: "critical",
			summary:     "No redpacket-operator replica has been scraped for 10 minutes",
			description: "Without the operator no activity is seeded, opened, closed or refunded on schedule, and deleted activities are not cleaned up. Check the redpacket-controller-manager Deployment.",
		},
	}},
}

// prometheusRule holds alertGroups.
func prometheusRule() *monitoringv1.PrometheusRule {
	rule := &monitoringv1.PrometheusRule{
		TypeMeta:   metav1.TypeMeta{APIVersion: monitoringv1.SchemeGroupVersion.String(), Kind: monitoringv1.PrometheusRuleKind},
		ObjectMeta: metav1.ObjectMeta{Name: "alerts", Labels: monitorLabels("alerts")},
	}
	for _, g := range alertGroups {
		group := monitoringv1.RuleGroup{Name: g.name}
		for _, a := range g.alerts {
			r := monitoringv1.Rule{
				Alert:       a.name,
				Expr:        intstr.FromString(a.expr),
				Labels:      map[string]string{"severity": a.severity},
				Annotations: map[string]string{"summary": a.summary, "description": a.description},
			}
			if a.forDuration != "0m" {
				d := monitoringv1.Duration(a.forDuration)
				r.For = &d
			}
			group.Rules = append(group.Rules, r)
		}
		rule.Spec.Groups = append(rule.Spec.Groups, group)
	}
	return rule
}
