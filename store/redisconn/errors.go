package redisconn

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/redis/go-redis/v9"
)

// ErrAddressNotAllowed is wrapped by the dial errors of a client whose
// ClientOptions.DialCheck refused an address: no connection was attempted.
var ErrAddressNotAllowed = errors.New("the address is not allowed")

// SafeError is the error of a Redis command as a client opened with
// ClientOptions.SafeErrors reports it: its text is a fixed phrase that holds no byte
// the server (or whatever answered at the address) sent, so it may go into a
// resource's status and events. The original error stays reachable with errors.Is,
// errors.As and Unwrap, for decisions and for logs.
//
// A Redis error reply keeps its error code in front when the code is a known one
// ("NOSCRIPT script not in the script cache"), so code checks such as IsNoScript and
// the consumer group's NOGROUP and BUSYGROUP work on it as on the original.
type SafeError struct {
	code   string
	phrase string
	err    error
}

// Error is the fixed phrase, after the known error code if there is one.
func (e *SafeError) Error() string {
	if e.code != "" {
		return e.code + " " + e.phrase
	}
	return e.phrase
}

// Unwrap is the original error.
func (e *SafeError) Unwrap() error { return e.err }

// replyPhrases are the Redis error codes whose replies SafeErrors keeps the code of,
// each with the phrase that replaces the server's text.
var replyPhrases = map[string]string{
	"NOSCRIPT":    "script not in the script cache",
	"NOGROUP":     "no such consumer group",
	"BUSYGROUP":   "consumer group already exists",
	"WRONGPASS":   "authentication failed",
	"NOAUTH":      "authentication failed: a password is required",
	"NOPERM":      "permission denied by the Redis ACL",
	"LOADING":     "Redis is loading its data set",
	"READONLY":    "the node is a read-only replica",
	"MASTERDOWN":  "the master is down",
	"CLUSTERDOWN": "the cluster is down",
	"OOM":         "Redis is out of memory",
	"BUSY":        "Redis is busy running a script",
	"MOVED":       "the slot moved",
	"ASK":         "the slot is migrating",
	"TRYAGAIN":    "the slot is migrating, try again",
	"CROSSSLOT":   "keys of different slots",
	"WRONGTYPE":   "a key holds the wrong kind of value",
	"EXECABORT":   "transaction aborted",
	"ERR":         "Redis answered with an error",
}

// MakeSafe returns err as a *SafeError (nil for nil, and redis.Nil as it is, which
// is an answer, not a failure). The phrase says what kind of failure it was:
//
//   - "not a Redis server": whatever answered does not speak the Redis protocol;
//   - "DNS lookup failed" (the name does not resolve, or its lookup timed out),
//     "connection refused", "timed out", "host unreachable",
//     "the connection was closed", "network error";
//   - "TLS handshake failed";
//   - "authentication failed" (with WRONGPASS or NOAUTH, or ERR for servers before
//     Redis 6), "permission denied by the Redis ACL" (NOPERM), and the other known
//     error codes of replyPhrases;
//   - "the address is not allowed by the operator" (ErrAddressNotAllowed);
//   - "Redis call failed" for anything else.
func MakeSafe(err error) error {
	if err == nil || errors.Is(err, redis.Nil) {
		return err
	}
	var already *SafeError
	if errors.As(err, &already) {
		return err
	}
	code, phrase := classify(err)
	return &SafeError{code: code, phrase: phrase, err: err}
}

// classify is the code and phrase MakeSafe gives err.
func classify(err error) (code, phrase string) {
	var (
		re      redis.Error
		dnsErr  *net.DNSError
		netErr  net.Error
		opErr   *net.OpError
		tlsRec  tls.RecordHeaderError
		tlsAl   tls.AlertError
		tlsVer  *tls.CertificateVerificationError
		unknown x509.UnknownAuthorityError
		host    x509.HostnameError
		invalid x509.CertificateInvalidError
	)
	switch {
	case errors.Is(err, ErrAddressNotAllowed):
		return "", "the address is not allowed by the operator"
	case errors.As(err, &re):
		msg := re.Error()
		first, _, _ := strings.Cut(msg, " ")
		if first == "ERR" && isPasswordComplaint(msg) {
			return "", "authentication failed"
		}
		if p, ok := replyPhrases[first]; ok {
			return first, p
		}
		return "", "Redis answered with an error"
	case errors.As(err, &dnsErr):
		// Before the timeouts: a lookup that times out is a DNS failure, and saying
		// "timed out" sends people looking at Redis instead of at the name.
		return "", "DNS lookup failed"
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &netErr) && netErr.Timeout():
		return "", "timed out"
	case errors.Is(err, context.Canceled):
		return "", "canceled"
	case errors.Is(err, redis.ErrClosed):
		return "", "the client is closed"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "", "connection refused"
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return "", "host unreachable"
	case errors.As(err, &tlsRec), errors.As(err, &tlsAl), errors.As(err, &tlsVer), errors.As(err, &unknown),
		errors.As(err, &host), errors.As(err, &invalid):
		return "", "TLS handshake failed"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.EPIPE), errors.Is(err, net.ErrClosed):
		return "", "the connection was closed"
	case errors.As(err, &opErr):
		return "", "network error"
	case isProtocolError(err):
		return "", "not a Redis server"
	}
	return "", "Redis call failed"
}

// isPasswordComplaint reports whether an ERR reply is how servers before Redis 6 turn
// a password down.
func isPasswordComplaint(msg string) bool {
	m := strings.ToLower(msg)
	return strings.Contains(m, "invalid password") || strings.Contains(m, "no password is set") ||
		strings.Contains(m, "without any password configured")
}

// isProtocolError reports whether err is go-redis's complaint about a reply it cannot
// read: whatever answered does not speak the Redis protocol (RESP).
func isProtocolError(err error) bool {
	for e := err; e != nil; e = errors.Unwrap(e) {
		msg := e.Error()
		if strings.HasPrefix(msg, "redis: invalid reply") || strings.HasPrefix(msg, "redis: can't parse") ||
			strings.HasPrefix(msg, "redis: unexpected") || strings.HasPrefix(msg, "redis: got") {
			return true
		}
	}
	msg := err.Error()
	return strings.Contains(msg, "redis: invalid reply") || strings.Contains(msg, "redis: can't parse")
}

// safeErrorsHook makes every command error of a client a *SafeError, in the command
// itself (Cmder.Err), which is where the project's callers read it, and hands the
// original to log, when set.
type safeErrorsHook struct {
	log func(ctx context.Context, command string, err error)
}

var _ redis.Hook = safeErrorsHook{}

func (safeErrorsHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h safeErrorsHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err == nil {
			return nil
		}
		if cmd.Err() == nil {
			// A dial or handshake failure: the client sets it on the command only
			// after the hooks.
			cmd.SetErr(err)
		}
		h.makeSafe(ctx, cmd)
		return cmd.Err()
	}
}

func (h safeErrorsHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			h.makeSafe(ctx, cmd)
		}
		return MakeSafe(err)
	}
}

// makeSafe replaces the command's error, if it failed, with a *SafeError.
func (h safeErrorsHook) makeSafe(ctx context.Context, cmd redis.Cmder) {
	err := cmd.Err()
	if err == nil || errors.Is(err, redis.Nil) {
		return
	}
	var already *SafeError
	if errors.As(err, &already) {
		return
	}
	if h.log != nil {
		h.log(ctx, cmd.FullName(), err)
	}
	cmd.SetErr(MakeSafe(err))
}
