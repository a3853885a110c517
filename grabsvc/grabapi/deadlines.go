package grabapi

import "time"

// The grab service's deadlines on the grab path, in one place: the grab service
// takes its defaults from them (grabsvc.DefaultRedisTimeout, DefaultResolveTimeout),
// the operator passes them to every grab pod (--redis-timeout, --resolve-timeout),
// and the operator derives the timeouts of the HTTPRoute it puts in front of the
// grab Service from GrabDeadline, so that a gateway never cuts a grab the service is
// still resolving: cutting it would answer the user 504 while Redis may have
// granted them a packet.
const (
	// RedisTimeout bounds one Redis call of a grab.
	RedisTimeout = 500 * time.Millisecond
	// ResolveTimeout bounds how long a grab whose Redis call ended without an
	// answer asks Redis again what it decided, before it answers 503.
	ResolveTimeout = time.Second
	// DefaultReplicaWait is how long a grant waits for replicas when
	// spec.durability asks for them without timeoutMilliseconds (the store's
	// DefaultReplicaTimeout; a grabsvc test holds them equal).
	DefaultReplicaWait = 200 * time.Millisecond
	// MaxReplicaWait is the largest spec.durability.timeoutMilliseconds the API
	// admits.
	MaxReplicaWait = 10 * time.Second
)

// GrabDeadline is the longest the grab service spends on one grab before it answers,
// given the wait for replicas the durability asks for (0 without replicas): the
// grab's Redis call, the wait for replicas, then the resolution of an unknown
// outcome. It stays below the grab service's HTTP write timeout (15 s) for every wait
// up to MaxReplicaWait.
func GrabDeadline(replicaWait time.Duration) time.Duration {
	return RedisTimeout + replicaWait + ResolveTimeout
}
