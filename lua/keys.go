// Package lua holds the atomic Redis programs of an activity and the typed Go
// bindings that run them. It is the one place that knows the keyspace, and the only
// package that issues Redis commands: Activity (handle.go) makes every call of an
// activity, including the settlement stream's consumer group (stream.go), Conn
// opens every client (conn.go), and measure.go holds the benchmark's measurement
// helpers.
//
// Every key of an activity carries the hash tag {<uid>}, so an activity lives on one
// Redis Cluster slot and every script can touch all of its keys.
//
//	rpa:{uid}:meta     hash: state, schedule, totals and every counter
//	rpa:{uid}:staging  list: packets written in chunks before the commit
//	rpa:{uid}:packets  list: the unclaimed packets, "<packetId>:<amount>"
//	rpa:{uid}:claims   hash: userId -> "<packetId>:<amount>:<stream entry id>"
//	rpa:{uid}:stream   stream: one entry per grant and per refund, for settlement
//	rpa:{uid}:dead     stream: deliveries parked after too many failures
package lua

// Keys are the Redis keys of one activity.
type Keys struct {
	Meta        string
	Staging     string
	Packets     string
	Claims      string
	Stream      string
	DeadLetters string
}

// KeysFor returns the keys of the activity with the given UID.
func KeysFor(uid string) Keys {
	p := "rpa:{" + uid + "}:"
	return Keys{
		Meta:        p + "meta",
		Staging:     p + "staging",
		Packets:     p + "packets",
		Claims:      p + "claims",
		Stream:      p + "stream",
		DeadLetters: p + "dead",
	}
}

// All lists every key of the activity, for deletion.
func (k Keys) All() []string {
	return []string{k.Meta, k.Staging, k.Packets, k.Claims, k.Stream, k.DeadLetters}
}

// Meta hash fields.
const (
	fieldState         = "state"
	fieldCloseReason   = "close_reason"
	fieldTotal         = "total"
	fieldCount         = "count"
	fieldStartMs       = "start_ms"
	fieldEndMs         = "end_ms"
	fieldPaused        = "paused"
	fieldSponsor       = "sponsor"
	fieldClaimedCount  = "claimed_count"
	fieldClaimedAmount = "claimed_amount"
	fieldRefunded      = "refunded"
	fieldSettledCount  = "settled_count"
	fieldSettledAmount = "settled_amount"
	fieldRefundSettled = "refund_settled"
	fieldDeadCount     = "dead_count"
	fieldSeededMs      = "seeded_ms"
	fieldCurrency      = "currency"
	fieldFenced        = "fenced"
	fieldEpoch         = "epoch"
	// The snapshot's list lengths, reported under these names.
	fieldRemainingCount = "remaining_count"
	fieldStagedCount    = "staged_count"
)

// State is the state of an activity inside Redis (the meta hash's "state" field);
// "" means Redis does not hold the committed activity.
type State string

// The states an activity can be in inside Redis.
const (
	// StateReady means the packets are committed but grabbing has not been opened.
	StateReady State = "ready"
	// StateOpen means grabs are served, subject to the pause flag and the schedule.
	StateOpen State = "open"
	// StateClosed means grabbing ended for good (expired or exhausted).
	StateClosed State = "closed"
)
