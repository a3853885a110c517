package grabsvc

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"redpacket.io/operator/store"
)

// Outcome values of the grab API, as they appear in the JSON field "outcome" and
// in the outcome label of the grab counter.
const (
	OutcomeGranted        = string(store.Granted)
	OutcomeAlreadyClaimed = string(store.AlreadyClaimed)
	OutcomeSoldOut        = string(store.SoldOut)
	OutcomeNotStarted     = string(store.NotStarted)
	OutcomeEnded          = string(store.Ended)
	OutcomePaused         = string(store.Paused)
	OutcomeInvalidRequest = "invalid_request"
	OutcomeUnauthorized   = "unauthorized"
	OutcomeRateLimited    = "rate_limited"
	OutcomeUnavailable    = "unavailable"
)

// AllOutcomes lists every outcome of the grab API.
var AllOutcomes = []string{
	OutcomeGranted, OutcomeAlreadyClaimed, OutcomeSoldOut, OutcomeNotStarted, OutcomeEnded,
	OutcomePaused, OutcomeInvalidRequest, OutcomeUnauthorized, OutcomeRateLimited, OutcomeUnavailable,
}

// Metrics are the grab service's Prometheus metrics.
type Metrics struct {
	// Grabs counts grab requests by outcome.
	Grabs *prometheus.CounterVec
	// ClaimLatency is how long Redis took to decide a claim.
	ClaimLatency prometheus.Histogram
	// RedisErrors counts failed Redis calls by operation (grab, snapshot).
	RedisErrors *prometheus.CounterVec
	// ReportFailures counts status reports that failed, by stage (snapshot, apply).
	ReportFailures *prometheus.CounterVec
	// Reports counts status reports applied, by kind (change, heartbeat).
	Reports *prometheus.CounterVec
	// ActivityRefreshFailures counts failed reads of the activity from the API server.
	ActivityRefreshFailures prometheus.Counter

	outcomes map[string]prometheus.Counter
	// lastReport is the unix nanosecond time of the last successful report, or of
	// the metrics' creation before the first one.
	lastReport atomic.Int64
}

// NewMetrics creates the metrics and registers them, together with the Go runtime
// and process collectors, with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Grabs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redpacket_grab_requests_total",
			Help: "Grab requests by outcome.",
		}, []string{"outcome"}),
		ClaimLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "redpacket_grab_claim_duration_seconds",
			Help: "Time Redis took to decide a claim, queueing in the pipeline included.",
			Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
				0.05, 0.1, 0.25, 0.5, 1},
		}),
		RedisErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redpacket_grab_redis_errors_total",
			Help: "Redis calls that failed or ran past their deadline, by operation.",
		}, []string{"op"}),
		ReportFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redpacket_grab_report_failures_total",
			Help: "Status reports that failed, by stage (snapshot, apply).",
		}, []string{"stage"}),
		Reports: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redpacket_grab_reports_total",
			Help: "Status reports applied to the activity, by kind (change, heartbeat).",
		}, []string{"kind"}),
		ActivityRefreshFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redpacket_grab_activity_refresh_failures_total",
			Help: "Failed reads of the RedPacketActivity from the API server.",
		}),
		outcomes: map[string]prometheus.Counter{},
	}
	m.lastReport.Store(time.Now().UnixNano())
	lag := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "redpacket_grab_report_lag_seconds",
		Help: "Seconds since the status reporter last applied a report successfully.",
	}, func() float64 {
		return time.Since(time.Unix(0, m.lastReport.Load())).Seconds()
	})
	for _, o := range AllOutcomes {
		m.outcomes[o] = m.Grabs.WithLabelValues(o)
	}
	for _, op := range []string{"grab", "snapshot"} {
		m.RedisErrors.WithLabelValues(op)
	}
	for _, s := range []string{"snapshot", "apply"} {
		m.ReportFailures.WithLabelValues(s)
	}
	reg.MustRegister(m.Grabs, m.ClaimLatency, m.RedisErrors, m.ReportFailures, m.Reports,
		m.ActivityRefreshFailures, lag,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// countOutcome adds one grab with the outcome.
func (m *Metrics) countOutcome(outcome string) {
	if c, ok := m.outcomes[outcome]; ok {
		c.Inc()
		return
	}
	m.Grabs.WithLabelValues(outcome).Inc()
}

// reportSucceeded records a successful status report at t.
func (m *Metrics) reportSucceeded(t time.Time) { m.lastReport.Store(t.UnixNano()) }
