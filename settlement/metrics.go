package settlement

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Delivery results, the values of the deliveries counter's "result" label.
const (
	// ResultSettled: a 2xx answer, acknowledged and counted as settled by this call.
	ResultSettled = "settled"
	// ResultAlreadySettled: a 2xx answer for an entry acknowledged before (by another
	// worker, say); nothing was counted.
	ResultAlreadySettled = "already_settled"
	// ResultRejected: the receiver answered with a status other than 2xx.
	ResultRejected = "rejected"
	// ResultNoAnswer: no answer (connection error, timeout).
	ResultNoAnswer = "no_answer"
)

// metrics are the worker's collectors. They are always set, registered only when
// the config has a Registerer.
type metrics struct {
	lag         prometheus.Observer
	deliveries  *prometheus.CounterVec
	retries     prometheus.Counter
	hedges      prometheus.Counter
	deadLetters prometheus.Counter
	pending     prometheus.Gauge
	limit       prometheus.Gauge
	forged      *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer, activity string) (*metrics, error) {
	labels := prometheus.Labels{"activity": activity}
	lag := prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace:   "redpacket",
		Subsystem:   "settlement",
		Name:        "lag_seconds",
		Help:        "Seconds from a claim (or refund) to its acknowledged delivery to the balance system.",
		ConstLabels: labels,
		Buckets:     prometheus.ExponentialBuckets(0.005, 4, 11),
	})
	deliveries := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace:   "redpacket",
		Subsystem:   "settlement",
		Name:        "deliveries_total",
		Help:        "Settlement webhook deliveries by result (settled, already_settled, rejected, no_answer).",
		ConstLabels: labels,
	}, []string{"result"})
	retries := prometheus.NewCounter(prometheus.CounterOpts{
		Namespace:   "redpacket",
		Subsystem:   "settlement",
		Name:        "retries_total",
		Help:        "Failed settlement deliveries scheduled for another attempt.",
		ConstLabels: labels,
	})
	hedges := prometheus.NewCounter(prometheus.CounterOpts{
		Namespace:   "redpacket",
		Subsystem:   "settlement",
		Name:        "hedges_total",
		Help:        "Second deliveries of an entry sent while its first went unanswered past the hedge delay.",
		ConstLabels: labels,
	})
	dead := prometheus.NewCounter(prometheus.CounterOpts{
		Namespace:   "redpacket",
		Subsystem:   "settlement",
		Name:        "dead_letters_total",
		Help:        "Entries this process moved to the dead-letter stream.",
		ConstLabels: labels,
	})
	pending := prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace:   "redpacket",
		Subsystem:   "settlement",
		Name:        "pending_entries",
		Help:        "Entries read by the consumer group and not yet acknowledged (all consumers).",
		ConstLabels: labels,
	})
	limit := prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace:   "redpacket",
		Subsystem:   "settlement",
		Name:        "concurrency_limit",
		Help:        "The adaptive limit on first deliveries in flight, summed over the activity's shard workers in this process (retries run within the limit scaled by retry:first concurrency).",
		ConstLabels: labels,
	})
	forged := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace:   "redpacket",
		Subsystem:   "settlement",
		Name:        "forged_total",
		Help:        "Entries dead-lettered as forged, never delivered, by reason (claim_mismatch, packet_out_of_range, amount_mismatch, packet_listed, duplicate_packet, over_budget, over_count; for a budget's packets also malformed, packet_id_malformed, stale_entry).",
		ConstLabels: labels,
	}, []string{"reason"})
	m := &metrics{lag: lag, deliveries: deliveries, retries: retries, hedges: hedges, deadLetters: dead, pending: pending, limit: limit, forged: forged}
	if reg == nil {
		return m, nil
	}
	var err error
	if m.lag, err = register(reg, lag); err != nil {
		return nil, err
	}
	if m.deliveries, err = register(reg, deliveries); err != nil {
		return nil, err
	}
	if m.retries, err = register(reg, retries); err != nil {
		return nil, err
	}
	if m.hedges, err = register(reg, hedges); err != nil {
		return nil, err
	}
	if m.deadLetters, err = register(reg, dead); err != nil {
		return nil, err
	}
	if m.pending, err = register(reg, pending); err != nil {
		return nil, err
	}
	if m.limit, err = register(reg, limit); err != nil {
		return nil, err
	}
	if m.forged, err = register(reg, forged); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers c, or returns the collector registered before under the same
// description (several workers of one activity in one process share them).
func register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing, nil
			}
		}
		return c, fmt.Errorf("registering settlement metrics: %w", err)
	}
	return c, nil
}
