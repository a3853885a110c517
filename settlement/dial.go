package settlement

import (
	"context"
	"net"
	"strings"
)

// fullyQualifiedAddr is addr ("host:port") with a host name made absolute: a
// trailing dot, so the resolver looks the name up as written and never through its
// search domains (where "balance.payments.svc" could become a name under a domain
// someone else controls). IP literals and names already absolute are kept.
func fullyQualifiedAddr(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil || host == "" || strings.HasSuffix(host, ".") || net.ParseIP(host) != nil {
		return addr
	}
	return net.JoinHostPort(host+".", port)
}

// dialFullyQualified wraps dial so that it dials every host name as fully
// qualified (fullyQualifiedAddr). The request's Host header and the TLS server name
// stay as the URL spells them.
func dialFullyQualified(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		return dial(ctx, network, fullyQualifiedAddr(addr))
	}
}
