package grabsvc

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"redpacket.io/operator/store"
)

// CreateOutcomes are the outcomes of POST /v1/packets, as the JSON field "outcome" of
// a creation and "error" of a refusal spell them, and as the create counter's label.
var CreateOutcomes = []string{
	string(store.CreateCreated), string(store.CreateExisting), string(store.CreateConflict),
	string(store.CreateBudgetExhausted), string(store.CreateLimitExceeded), string(store.CreateInvalid),
	string(store.CreateClosed), OutcomeUnauthorized, OutcomeUnavailable, string(store.CreateQuotaExceeded),
}

// PacketGrabOutcomes are the outcomes of POST /v1/packets/{id}/grab.
var PacketGrabOutcomes = []string{
	string(store.PacketGranted), string(store.PacketAlreadyClaimed), string(store.PacketSoldOut),
	OutcomeExpired, OutcomeNotFound, OutcomeInvalidRequest, OutcomeUnauthorized, OutcomeRateLimited,
	OutcomeUnavailable, string(store.PacketQuotaExceeded),
}

// PacketMetrics are the budget mode's Prometheus metrics, all named redpacket_packets_*.
type PacketMetrics struct {
	// Creates counts POST /v1/packets by outcome; Creates{outcome="created"} is the
	// packets created through this pod.
	Creates *prometheus.CounterVec
	// Grabs counts POST /v1/packets/{id}/grab by outcome.
	Grabs *prometheus.CounterVec
	// Details counts GET /v1/packets/{id} by outcome (ok or the error code).
	Details *prometheus.CounterVec
	// CreatedAmount is the money drawn from the budget by the packets created here;
	// GrantedAmount the money granted by the grabs decided here (minor units).
	CreatedAmount, GrantedAmount prometheus.Counter
	// RedisDuration is how long Redis took to answer, by operation (create, grab, detail).
	RedisDuration *prometheus.HistogramVec
	// RedisErrors counts failed Redis calls by operation.
	RedisErrors *prometheus.CounterVec

	creates, grabs, details map[string]prometheus.Counter
}

// NewPacketMetrics creates the metrics and registers them, together with the Go
// runtime and process collectors, with reg.
func NewPacketMetrics(reg prometheus.Registerer) *PacketMetrics {
	m := &PacketMetrics{
		Creates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redpacket_packets_create_requests_total",
			Help: "Packet creation requests by outcome (created, existing, conflict, budget_exhausted, ...).",
		}, []string{"outcome"}),
		Grabs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redpacket_packets_grab_requests_total",
			Help: "Grabs of runtime packets by outcome.",
		}, []string{"outcome"}),
		Details: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redpacket_packets_detail_requests_total",
			Help: "Reads of a packet's detail list by outcome.",
		}, []string{"outcome"}),
		CreatedAmount: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redpacket_packets_created_amount_total",
			Help: "Money drawn from the budget by the packets this pod created, in minor units.",
		}),
		GrantedAmount: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redpacket_packets_granted_amount_total",
			Help: "Money granted by the grabs this pod decided, in minor units.",
		}),
		RedisDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "redpacket_packets_redis_duration_seconds",
			Help: "Time Redis took to answer, by operation (create, grab, detail), queueing in the pipeline included.",
			Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
				0.05, 0.1, 0.25, 0.5, 1},
		}, []string{"op"}),
		RedisErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redpacket_packets_redis_errors_total",
			Help: "Redis calls that failed or ran past their deadline, by operation.",
		}, []string{"op"}),
		creates: map[string]prometheus.Counter{},
		grabs:   map[string]prometheus.Counter{},
		details: map[string]prometheus.Counter{},
	}
	for _, o := range CreateOutcomes {
		m.creates[o] = m.Creates.WithLabelValues(o)
	}
	for _, o := range PacketGrabOutcomes {
		m.grabs[o] = m.Grabs.WithLabelValues(o)
	}
	for _, o := range []string{"ok", OutcomeNotFound, OutcomeInvalidRequest, OutcomeUnauthorized, OutcomeRateLimited, OutcomeUnavailable} {
		m.details[o] = m.Details.WithLabelValues(o)
	}
	for _, op := range []string{"create", "grab", "detail"} {
		m.RedisErrors.WithLabelValues(op)
		m.RedisDuration.WithLabelValues(op)
	}
	reg.MustRegister(m.Creates, m.Grabs, m.Details, m.CreatedAmount, m.GrantedAmount, m.RedisDuration, m.RedisErrors,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func count(known map[string]prometheus.Counter, vec *prometheus.CounterVec, outcome string) {
	if c, ok := known[outcome]; ok {
		c.Inc()
		return
	}
	vec.WithLabelValues(outcome).Inc()
}

func (m *PacketMetrics) countCreate(outcome string) { count(m.creates, m.Creates, outcome) }
func (m *PacketMetrics) countGrab(outcome string)   { count(m.grabs, m.Grabs, outcome) }
func (m *PacketMetrics) countDetail(outcome string) { count(m.details, m.Details, outcome) }
