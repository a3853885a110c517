package controllers

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
	ctrl "sigs.k8s.io/controller-runtime"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store/redisconn"
)

// The operator's policy on what an activity's spec may ask of it: which Redis
// servers spec.redis may name (Options.AllowedRedisHosts, --allowed-redis-hosts) and
// whether spec.grabService.image may replace the operator's grab image
// (Options.AllowGrabImageOverride, --allow-grab-image-override). Whoever may create
// an activity may ask; the operator decides.

// RedisHosts are the hosts and networks that spec.redis may name besides the
// operator's default Redis. Its zero value allows none: an activity may then name
// only the default Redis's own addresses.
type RedisHosts struct {
	names    []string
	prefixes []netip.Prefix
}

// ParseRedisHosts reads a comma-separated list of host names, IP addresses and CIDR
// networks (db.example.com, 10.0.3.7, 10.0.0.0/16, fd00::/8). An entry names hosts
// only, never a port: an allowed host may be named with any port. A host name allows
// exactly that name (case does not matter), never the addresses it resolves to; an IP
// address or network allows the addresses in it.
func ParseRedisHosts(list string) (RedisHosts, error) {
	var h RedisHosts
	for _, entry := range strings.Split(list, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		if p, err := netip.ParsePrefix(entry); err == nil {
			h.prefixes = append(h.prefixes, p.Masked())
			continue
		}
		if ip, err := netip.ParseAddr(entry); err == nil {
			h.prefixes = append(h.prefixes, netip.PrefixFrom(ip.Unmap(), ip.Unmap().BitLen()))
			continue
		}
		name := strings.ToLower(strings.TrimSuffix(entry, "."))
		if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
			return RedisHosts{}, fmt.Errorf("allowed Redis host %q is neither a host name, an IP address nor a CIDR network (no port): %s",
				entry, strings.Join(errs, "; "))
		}
		h.names = append(h.names, name)
	}
	return h, nil
}

// MustParseRedisHosts is ParseRedisHosts for lists known to be valid; it panics on
// an invalid one.
func MustParseRedisHosts(list string) RedisHosts {
	h, err := ParseRedisHosts(list)
	if err != nil {
		panic(err)
	}
	return h
}

// String lists the hosts and networks, comma-separated.
func (h RedisHosts) String() string {
	out := slices.Clone(h.names)
	for _, p := range h.prefixes {
		if p.IsSingleIP() {
			out = append(out, p.Addr().String())
		} else {
			out = append(out, p.String())
		}
	}
	return strings.Join(out, ",")
}

// allows reports whether host (a name or an IP address, without a port) is allowed.
func (h RedisHosts) allows(host string) bool {
	if ip, err := netip.ParseAddr(host); err == nil {
		ip = ip.Unmap().WithZone("")
		return slices.ContainsFunc(h.prefixes, func(p netip.Prefix) bool { return p.Contains(ip) })
	}
	return slices.Contains(h.names, strings.ToLower(strings.TrimSuffix(host, ".")))
}

// RedisNotAllowedError refuses a spec.redis connection that names an address the
// operator does not allow.
type RedisNotAllowedError struct {
	// Address is the refused host:port, as the Secret names it.
	Address string
}

func (e *RedisNotAllowedError) Error() string {
	return fmt.Sprintf("spec.redis names %s, which is neither the operator's default Redis nor on the operator's list "+
		"of allowed Redis hosts (--allowed-redis-hosts); no connection was attempted", e.Address)
}

// addressAllowed says whether a connection from spec.redis may reach addr: one of
// the default Redis's own addresses, or a host the operator allows (any port).
func (a *RedisAccess) addressAllowed(addr string) error {
	if slices.Contains(a.DefaultRedis.Addresses, addr) {
		return nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err == nil && a.AllowedHosts.allows(host) {
		return nil
	}
	return &RedisNotAllowedError{Address: addr}
}

// checkRedisAllowed refuses a connection from spec.redis that names an address the
// operator does not allow (addressAllowed), before anything dials it.
func (a *RedisAccess) checkRedisAllowed(conn redisconn.Conn) error {
	for _, addr := range conn.Addresses {
		if err := a.addressAllowed(addr); err != nil {
			return err
		}
	}
	return nil
}

// connectionFailureReason is Ready's reason when the activity's Redis connection
// cannot be used: RedisNotAllowed when the operator's policy refuses it, else
// RedisConfigInvalid.
func connectionFailureReason(err error) string {
	var notAllowed *RedisNotAllowedError
	if errors.As(err, &notAllowed) {
		return redpacketv1alpha1.ReasonRedisNotAllowed
	}
	return redpacketv1alpha1.ReasonRedisConfigInvalid
}

// isDefaultRedis reports whether conn is the operator's default connection.
func (a *RedisAccess) isDefaultRedis(conn redisconn.Conn) bool {
	d := a.DefaultRedis
	if d.Mode == "" {
		d.Mode = redisconn.ModeStandalone
	}
	return conn.Key() == d.Key()
}

// redisClientOptions are the options of the controller's Redis clients. Every client
// of a connection from spec.redis checks each address it dials against the policy
// (addressAllowed), so neither a cluster's announcements nor its redirects lead the
// operator elsewhere. safeErrors makes the clients' errors fixed phrases (redisconn.MakeSafe),
// for the clients whose errors reach status and events.
func (a *RedisAccess) redisClientOptions(conn redisconn.Conn, safeErrors bool) redisconn.ClientOptions {
	o := redisconn.ClientOptions{SafeErrors: safeErrors, ErrorLog: logRedisError}
	if !a.isDefaultRedis(conn) {
		o.DialCheck = a.addressAllowed
	}
	return o
}

// logRedisError logs a failed Redis command's error as the server put it, at -v=1:
// status and events get only its fixed phrase (redisconn.SafeError).
func logRedisError(ctx context.Context, command string, err error) {
	ctrl.LoggerFrom(ctx).V(1).Info("a Redis command failed", "command", command, "error", err.Error())
}

// grabImageRefused is the grab workload ownership step's answer when the spec names
// a grab image and the operator does not allow that: Ready False with reason
// GrabImageNotAllowed, and the workload left exactly as it is (no Redis user is made
// for it either). The chain goes on, so the activity still opens and closes on
// schedule.
func (r *RedPacketActivityReconciler) grabImageRefused(a *redpacketv1alpha1.RedPacketActivity) (stepResult, bool) {
	image := a.Spec.GrabService.Image
	if image == "" || image == r.Options.GrabImage || r.Options.AllowGrabImageOverride {
		return stepResult{}, false
	}
	return stepResult{blocker: notReady(redpacketv1alpha1.ReasonGrabImageNotAllowed,
		"spec.grabService.image %q is not allowed: this operator runs only its own grab image (it was not started with "+
			"--allow-grab-image-override); remove the field to use it. The grab workload is left as it is", image)}, true
}
