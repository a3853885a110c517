package settlement

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"
)

// Error classes of failed deliveries (ErrorClass): a fixed word for each kind of
// failure, never text the balance system sent, so they may go into status, events
// and metrics labels.
const (
	ErrorClassHTTP4xx           = "http_4xx"
	ErrorClassHTTP5xx           = "http_5xx"
	ErrorClassHTTPOther         = "http_other" // an answer outside 2xx, 4xx and 5xx
	ErrorClassTimeout           = "timeout"
	ErrorClassConnectionRefused = "connection_refused"
	ErrorClassConnectionReset   = "connection_reset"
	ErrorClassTLS               = "tls"
	ErrorClassDNS               = "dns"
	ErrorClassNetwork           = "network" // any other failure to get an answer
)

// ErrorClass is the class of a failed delivery's error: the HTTP status's class
// when the webhook answered, else what kept the answer from coming.
func ErrorClass(err error) string {
	var de *deliveryError
	if errors.As(err, &de) && de.status != 0 {
		switch {
		case de.status >= 500 && de.status < 600:
			return ErrorClassHTTP5xx
		case de.status >= 400 && de.status < 500:
			return ErrorClassHTTP4xx
		}
		return ErrorClassHTTPOther
	}
	var (
		dnsErr  *net.DNSError
		netErr  net.Error
		tlsRec  tls.RecordHeaderError
		tlsAl   tls.AlertError
		tlsVer  *tls.CertificateVerificationError
		unknown x509.UnknownAuthorityError
		host    x509.HostnameError
		invalid x509.CertificateInvalidError
	)
	switch {
	case errors.As(err, &dnsErr):
		return ErrorClassDNS
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &netErr) && netErr.Timeout():
		return ErrorClassTimeout
	case errors.Is(err, syscall.ECONNREFUSED):
		return ErrorClassConnectionRefused
	case errors.As(err, &tlsRec), errors.As(err, &tlsAl), errors.As(err, &tlsVer), errors.As(err, &unknown),
		errors.As(err, &host), errors.As(err, &invalid):
		return ErrorClassTLS
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return ErrorClassConnectionReset
	}
	return ErrorClassNetwork
}

// DeliveryHealthLogInterval is how often, at most, a worker logs that deliveries keep
// failing after it logged the first failure of a run of failures.
const DeliveryHealthLogInterval = time.Minute

// DeliveryHealth is what an activity's settlement workers know about their recent
// deliveries, for the activity's status: the entries whose last delivery failed and
// that are neither credited nor dead-lettered yet, when the oldest of them was
// granted, and the class of the last failure. All shard workers of an activity
// share one (Config.Health); it is safe for concurrent use.
type DeliveryHealth struct {
	mu       sync.Mutex
	failing  map[string]time.Time // entry id -> when its grant or refund happened
	last     DeliveryHealthSnapshot
	streak   int       // failures since the last time nothing was failing
	loggedAt time.Time // when a failure was last logged at Warn
}

// DeliveryHealthSnapshot is DeliveryHealth at one moment.
type DeliveryHealthSnapshot struct {
	// Retrying counts the entries whose last delivery failed and that wait for
	// another one.
	Retrying int
	// OldestUndelivered is when the oldest of those was granted (zero when none).
	OldestUndelivered time.Time
	// LastErrorClass and LastErrorTime describe the last failed delivery (empty and
	// zero before any).
	LastErrorClass string
	LastErrorTime  time.Time
}

// Degraded reports whether deliveries are failing now: some entry waits for a retry.
func (s DeliveryHealthSnapshot) Degraded() bool { return s.Retrying > 0 }

// NewDeliveryHealth returns a health with nothing failing.
func NewDeliveryHealth() *DeliveryHealth {
	return &DeliveryHealth{failing: map[string]time.Time{}}
}

// failed records a failed delivery of entry id (granted at grantedAt) and reports
// whether it should be logged at Warn: the first failure after a time with nothing
// failing, then at most once per DeliveryHealthLogInterval.
func (h *DeliveryHealth) failed(id string, grantedAt time.Time, class string, now time.Time) (logIt bool, streak int) {
	if h == nil {
		return false, 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.failing) == 0 {
		h.streak = 0
		h.loggedAt = time.Time{}
	}
	h.failing[id] = grantedAt
	h.streak++
	h.last.LastErrorClass, h.last.LastErrorTime = class, now
	if h.loggedAt.IsZero() || now.Sub(h.loggedAt) >= DeliveryHealthLogInterval {
		h.loggedAt = now
		return true, h.streak
	}
	return false, h.streak
}

// finished records that entry id was credited, dead-lettered or taken over by
// another consumer: it no longer waits for a retry here.
func (h *DeliveryHealth) finished(id string) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.failing, id)
}

// Snapshot returns the health now.
func (h *DeliveryHealth) Snapshot() DeliveryHealthSnapshot {
	if h == nil {
		return DeliveryHealthSnapshot{}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	s := h.last
	s.Retrying = len(h.failing)
	for _, at := range h.failing {
		if s.OldestUndelivered.IsZero() || at.Before(s.OldestUndelivered) {
			s.OldestUndelivered = at
		}
	}
	return s
}

// String describes the snapshot in one line, in fixed words.
func (s DeliveryHealthSnapshot) String() string {
	if !s.Degraded() {
		return "no delivery is failing"
	}
	return fmt.Sprintf("%d deliveries failing and retrying, the last with %s at %s; the oldest undelivered grant is from %s",
		s.Retrying, s.LastErrorClass, s.LastErrorTime.UTC().Format(time.RFC3339), s.OldestUndelivered.UTC().Format(time.RFC3339))
}
