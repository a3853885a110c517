// Package history checks the red-packet activity's histories for linearizability:
// randomized rains through real grab servers (grabsvc) against a real redis-server,
// with faults injected between the services and Redis, between the settlement
// worker and the balance system, and on the services themselves (restarts), every
// call and return recorded and checked with porcupine against a sequential model of
// one activity (Model). The package's tests are the harness; the model, the fault
// proxy and the flaky webhook are plain code so the tests can feed them hand-made
// histories.
package history

import (
	"fmt"
	"hash/fnv"
	"sort"
	"strconv"
	"strings"

	"github.com/anishathalye/porcupine"

	"redpacket.io/operator/store"
)

// Op is what an operation does.
type Op string

// The operations of the model: a user's grab, and the controller's gates.
const (
	OpGrab           Op = "grab"
	OpOpen           Op = "open"            // Configure(paused=false, open=true) on a ready activity
	OpPause          Op = "pause"           // Configure(paused=true, open=true)
	OpResume         Op = "resume"          // Configure(paused=false, open=true)
	OpCloseExpired   Op = "close-expired"   // Close(expired): always closes
	OpCloseExhausted Op = "close-exhausted" // Close(exhausted): closes only when nothing is left
)

// Input is one call: the activity (histories are partitioned by it), the operation
// and, for a grab, the user.
type Input struct {
	Activity string
	Op       Op
	User     string
	// StartMs and EndMs are, for open, pause and resume, the window Configure writes:
	// unix milliseconds on the Redis server's clock, 0 for an open side.
	StartMs, EndMs int64
	// NotBeforeMs and NotAfterMs bound, for a grab, the Redis server's clock (unix
	// milliseconds, as grab.lua reads it with TIME) when its script can have run: at
	// or after NotBeforeMs and, unless NotAfterMs is 0, at or before NotAfterMs. A
	// grab whose outcome is unknown has no upper bound: its command may run late.
	NotBeforeMs, NotAfterMs int64
}

// Output is one return. Unknown marks a call that timed out or failed: it may or may
// not have taken effect. Such an operation is recorded with a return at the very end
// of the history, so the checker may place it anywhere after its call, including
// after every completed operation, where it is the same as never having happened.
// An unknown grab's Packet, when set, is the packet its user holds at the end (see
// Resolve): the grab took that packet, or it changed nothing and is placed where its
// user already holds it. Unset, a grab that took a packet leaves it to the first
// later already_claimed of the user to name.
type Output struct {
	Unknown bool
	// Resolved marks a grab whose call timed out or failed but which the final read
	// shows granted Packet (see Resolve); it returns at the end of the history.
	Resolved bool
	// Outcome is a grab's outcome.
	Outcome store.Outcome
	// Packet is the packet id of granted and already_claimed.
	Packet string
	// State is what Configure returned ("open", "closed"); for a close, the close
	// outcome ("closed", "open").
	State string
	// Reason is the close reason a close returned.
	Reason store.CloseReason
	// Bounded marks an unknown outcome whose effect, if it had one, took place before
	// the recorded return: the history keeps that return instead of moving it to the
	// end. A spec edit that a later edit superseded before the controller reported
	// acting on it is one (see operator_test.go): every write the controller made for
	// it came before the status that reports the later edit.
	Bounded bool
}

// unknownClaim is the placeholder packet of a user whose grab had an unknown outcome
// and is linearized as having taken a packet: which one is bound by the first later
// already_claimed that names it.
const unknownClaim = "?"

// state is the model's state for one activity. It is never mutated once built:
// steps that change it copy the maps.
type state struct {
	count     int // packets seeded, ids "1".."count"
	remaining int
	opened    bool
	paused    bool
	startMs   int64 // the window Configure wrote, 0 for an open side
	endMs     int64
	closed    store.CloseReason // "" while not closed
	// halfClosed marks a close whose outcome was unknown: it may have stopped after
	// closing the shard and before writing the activity's refund (store.Activity.Close
	// takes two steps). Grabs then end as the close's reason says, while Configure
	// still answers open (store.Activity.ConfigureWith), so that the next Close
	// finishes it; a close with a known outcome does.
	halfClosed bool
	claims     map[string]string // user -> packet id (or unknownClaim)
	held       map[string]string // packet id -> user
	hash       uint64            // order-independent hash of claims, kept with them
}

func entryHash(user, packet string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(user))
	h.Write([]byte{0})
	h.Write([]byte(packet))
	return h.Sum64()
}

func (s *state) gateHash() uint64 {
	var g uint64
	if s.opened {
		g |= 1
	}
	if s.paused {
		g |= 2
	}
	g |= uint64(len(s.closed)) << 2
	if s.halfClosed {
		g |= 1 << 10
	}
	return s.hash ^ uint64(s.remaining)*0x9e3779b97f4a7c15 ^ g*0xc2b2ae3d27d4eb4f ^
		uint64(s.startMs)*0x165667b19e3779f9 ^ uint64(s.endMs)*0x27d4eb2f165667c5
}

func (s *state) withGate() *state {
	n := *s
	return &n
}

// withClaim returns a copy of s in which user holds packet (unknownClaim: some packet
// not yet named). A new claim takes one packet from remaining; binding an unknown
// claim does not.
func (s *state) withClaim(user, packet string) *state {
	n := *s
	n.claims = make(map[string]string, len(s.claims)+1)
	for k, v := range s.claims {
		n.claims[k] = v
	}
	n.held = make(map[string]string, len(s.held)+1)
	for k, v := range s.held {
		n.held[k] = v
	}
	if prev, ok := n.claims[user]; ok {
		n.hash ^= entryHash(user, prev)
	} else {
		n.remaining--
	}
	n.claims[user] = packet
	n.hash ^= entryHash(user, packet)
	if packet != unknownClaim {
		n.held[packet] = user
	}
	return &n
}

// grabbable says whether a grab by a user without a claim passes grab.lua's state
// gates (in their order: closed, not open, paused) and reaches its clock.
func (s *state) grabbable() bool { return s.closed == "" && s.opened && !s.paused }

// someTime says whether the Redis clock can have read some t with from <= t and,
// unless until is 0, t < until while in's script ran.
func someTime(in Input, from, until int64) bool {
	lo := max(from, in.NotBeforeMs)
	if in.NotAfterMs != 0 && lo > in.NotAfterMs {
		return false
	}
	return until == 0 || lo < until
}

// reachesPop says whether a grab by a user without a claim can reach LPOP: it passes
// the state gates and then the window, on the Redis clock when its script ran.
func (s *state) reachesPop(in Input) bool {
	return s.grabbable() && someTime(in, s.startMs, s.endMs)
}

// mayAnswerNotStarted says whether a grab by a user without a claim can answer
// not_started: the activity is not open yet, or it is and the clock is before the
// window's start.
func (s *state) mayAnswerNotStarted(in Input) bool {
	if s.closed != "" {
		return false
	}
	return !s.opened || !s.paused && s.startMs > 0 && someTime(in, 0, s.startMs)
}

// mayAnswerEnded says whether a grab by a user without a claim can answer ended: the
// activity was closed as expired, or it is open and the clock is at or past the
// window's end (and past its start, which grab.lua checks first).
func (s *state) mayAnswerEnded(in Input) bool {
	if s.closed != "" {
		return s.closed == store.CloseExpired
	}
	return s.opened && !s.paused && s.endMs > 0 && someTime(in, max(s.startMs, s.endMs), 0)
}

// freePacket says whether p is a packet id of the activity that nobody holds.
func (s *state) freePacket(p string) bool {
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 || n > s.count {
		return false
	}
	_, taken := s.held[p]
	return !taken
}

func (s *state) stepGrab(in Input, out Output) (bool, *state) {
	user := in.User
	claim, has := s.claims[user]
	if out.Unknown {
		if has {
			return true, s // a grab of a user holding a packet changes nothing
		}
		if out.Packet == "" {
			if !s.reachesPop(in) || s.remaining == 0 {
				return true, s
			}
			return true, s.withClaim(user, unknownClaim)
		}
		// The user holds out.Packet at the end (see Resolve): this call took that
		// packet, or it changed nothing. A call that changed nothing is placed where
		// its user already holds the packet (always possible before its return, see
		// Resolve), never where it could have taken it, so the checker does not try
		// every subset of such calls as no-ops.
		if !s.reachesPop(in) || s.remaining == 0 || !s.freePacket(out.Packet) {
			return false, s
		}
		return true, s.withClaim(user, out.Packet)
	}
	switch out.Outcome {
	case store.AlreadyClaimed:
		switch {
		case has && claim == out.Packet:
			return true, s
		case has && claim == unknownClaim && s.freePacket(out.Packet):
			return true, s.withClaim(user, out.Packet)
		case !has && s.reachesPop(in) && s.remaining > 0 && s.freePacket(out.Packet):
			// The grab path's client retries a command once after a connection
			// error (redisconn.GrabClientOptions): the first run granted the packet, its
			// reply was lost, and the retry answered already_claimed with the same
			// packet. One call, one grant.
			return true, s.withClaim(user, out.Packet)
		}
		return false, s
	case store.Granted:
		if has || !s.reachesPop(in) || s.remaining == 0 || !s.freePacket(out.Packet) {
			return false, s
		}
		return true, s.withClaim(user, out.Packet)
	}
	if has {
		return false, s // a user holding a packet is always answered already_claimed
	}
	switch out.Outcome {
	case store.SoldOut:
		return s.closed == store.CloseExhausted || s.reachesPop(in) && s.remaining == 0, s
	case store.Ended:
		return s.mayAnswerEnded(in), s
	case store.NotStarted:
		return s.mayAnswerNotStarted(in), s
	case store.Paused:
		return s.closed == "" && s.opened && s.paused, s
	}
	return false, s
}

func (s *state) stepConfigure(in Input, paused bool, out Output) (bool, *state) {
	if s.closed != "" {
		return out.Unknown || out.State == string(store.StateClosed) || s.halfClosed && out.State == string(store.StateOpen), s
	}
	if !out.Unknown && out.State != string(store.StateOpen) {
		return false, s
	}
	n := s.withGate()
	n.opened, n.paused = true, paused
	n.startMs, n.endMs = in.StartMs, in.EndMs
	return true, n
}

func (s *state) stepClose(reason store.CloseReason, out Output) (bool, *state) {
	if s.closed != "" {
		ok := out.Unknown || out.State == string(store.Closed) && out.Reason == s.closed
		if ok && !out.Unknown && s.halfClosed {
			n := s.withGate()
			n.halfClosed = false
			return true, n
		}
		return ok, s
	}
	if reason == store.CloseExhausted && s.remaining > 0 {
		return out.Unknown || out.State == string(store.CloseStillOpen), s
	}
	if !out.Unknown && (out.State != string(store.Closed) || out.Reason != reason) {
		return false, s
	}
	n := s.withGate()
	n.closed, n.halfClosed = reason, out.Unknown
	return true, n
}

// partitionBy returns a porcupine partition of a history by the key of each
// operation's input, the partitions in the order their keys first appear.
func partitionBy(key func(input interface{}) string) func([]porcupine.Operation) [][]porcupine.Operation {
	return func(h []porcupine.Operation) [][]porcupine.Operation {
		by := map[string][]porcupine.Operation{}
		var order []string
		for _, op := range h {
			k := key(op.Input)
			if _, ok := by[k]; !ok {
				order = append(order, k)
			}
			by[k] = append(by[k], op)
		}
		out := make([][]porcupine.Operation, 0, len(order))
		for _, k := range order {
			out = append(out, by[k])
		}
		return out
	}
}

// Model returns the porcupine model of activities seeded with the given packet
// counts (activity -> count), every one starting committed but not open ("ready").
func Model(counts map[string]int) porcupine.Model {
	return porcupine.Model{
		Partition: partitionBy(func(in interface{}) string { return in.(Input).Activity }),
		// Init cannot see the partition, so the state starts without a count and
		// takes it from the first operation's activity.
		Init: func() interface{} { return (*state)(nil) },
		Step: func(st, in, out interface{}) (bool, interface{}) {
			s := st.(*state)
			i, o := in.(Input), out.(Output)
			if s == nil {
				n := counts[i.Activity]
				s = &state{count: n, remaining: n, claims: map[string]string{}, held: map[string]string{}}
			}
			var ok bool
			var next *state
			switch i.Op {
			case OpGrab:
				ok, next = s.stepGrab(i, o)
			case OpOpen, OpResume:
				ok, next = s.stepConfigure(i, false, o)
			case OpPause:
				ok, next = s.stepConfigure(i, true, o)
			case OpCloseExpired:
				ok, next = s.stepClose(store.CloseExpired, o)
			case OpCloseExhausted:
				ok, next = s.stepClose(store.CloseExhausted, o)
			default:
				return false, st
			}
			return ok, next
		},
		Hash: func(st interface{}) uint64 {
			if s := st.(*state); s != nil {
				return s.gateHash()
			}
			return 0
		},
		Equal: func(a, b interface{}) bool {
			x, y := a.(*state), b.(*state)
			if x == nil || y == nil {
				return x == y
			}
			if x.count != y.count || x.remaining != y.remaining || x.opened != y.opened || x.paused != y.paused ||
				x.startMs != y.startMs || x.endMs != y.endMs ||
				x.closed != y.closed || x.halfClosed != y.halfClosed || x.hash != y.hash || len(x.claims) != len(y.claims) {
				return false
			}
			for k, v := range x.claims {
				if y.claims[k] != v {
					return false
				}
			}
			return true
		},
		DescribeOperation: func(in, out interface{}) string {
			i, o := in.(Input), out.(Output)
			var res string
			switch {
			case o.Unknown && o.Packet != "":
				res = "unknown (user ends with " + o.Packet + ")"
			case o.Unknown && o.Bounded:
				res = "unknown, superseded by the return"
			case o.Unknown:
				res = "unknown"
			case i.Op == OpGrab && o.Resolved:
				res = "unknown, resolved: granted " + o.Packet
			case i.Op == OpGrab && o.Packet != "":
				res = string(o.Outcome) + " " + o.Packet
			case i.Op == OpGrab:
				res = string(o.Outcome)
			default:
				res = strings.TrimSpace(o.State + " " + string(o.Reason))
			}
			if i.Op == OpGrab {
				at := ""
				switch {
				case i.NotBeforeMs != 0 && i.NotAfterMs != 0:
					at = fmt.Sprintf(" [redis ms %d..%d]", i.NotBeforeMs, i.NotAfterMs)
				case i.NotBeforeMs != 0:
					at = fmt.Sprintf(" [redis ms %d..]", i.NotBeforeMs)
				}
				return fmt.Sprintf("grab(%s)%s -> %s", i.User, at, res)
			}
			if i.StartMs != 0 || i.EndMs != 0 {
				return fmt.Sprintf("%s [window %d..%d] -> %s", i.Op, i.StartMs, i.EndMs, res)
			}
			return fmt.Sprintf("%s -> %s", i.Op, res)
		},
		DescribeState: func(st interface{}) string {
			s := st.(*state)
			if s == nil {
				return "initial"
			}
			gate := "ready"
			switch {
			case s.closed != "":
				gate = "closed(" + string(s.closed) + ")"
			case s.opened && s.paused:
				gate = "paused"
			case s.opened:
				gate = "open"
			}
			users := make([]string, 0, len(s.claims))
			for u, p := range s.claims {
				users = append(users, u+"="+p)
			}
			sort.Strings(users)
			if len(users) > 12 {
				users = append(users[:12], fmt.Sprintf("… %d more", len(s.claims)-12))
			}
			if s.startMs != 0 || s.endMs != 0 {
				gate += fmt.Sprintf(" [window %d..%d]", s.startMs, s.endMs)
			}
			return fmt.Sprintf("%s, %d/%d left, claims {%s}", gate, s.remaining, s.count, strings.Join(users, ", "))
		},
	}
}

// Resolve prepares a recorded history for the checker with a final read of the claims
// (activity -> user -> packet id, read after the run). Without it, every unknown grab
// doubles the orders the checker may have to try (took a packet, or did not), which
// does not finish for a few dozen of them. Each user holds at most one packet, so:
//
//   - an unknown grab of a user who holds nothing at the end, or of a user one of whose
//     grabs answered granted, or one called after a grab of the same user had already
//     returned already_claimed, changed nothing; it is dropped (a call that changes
//     nothing and answers nothing can always be placed);
//   - the one unknown grab of a user who holds p at the end and was never answered
//     granted or already_claimed is the grab that took p: it becomes granted p, with
//     its return still at the end;
//   - any other unknown grab of a user holding p took p or nothing, and carries p.
//     When the user was answered already_claimed later, the grab returns with the
//     first such answer instead of at the end: it took p before that answer or
//     changed nothing, and a grab that changed nothing can be placed right after the
//     answer. This keeps the orders the checker tries local to the overlapping calls
//     instead of spanning the rest of the history.
//
// A user holding a packet at the end whom no grab can have given it is a phantom
// claim, returned by user for the caller to fail on. Resolve also returns how many
// operations it dropped.
func Resolve(history []porcupine.Operation, final map[string]map[string]string) (ops []porcupine.Operation, dropped int, phantoms []string) {
	type key struct{ activity, user string }
	granted, unknown := map[key]bool{}, map[key]int{}
	firstAlready := map[key]int64{} // the earliest return of an already_claimed answer
	for _, op := range history {
		in, o := op.Input.(Input), op.Output.(Output)
		if in.Op != OpGrab {
			continue
		}
		k := key{in.Activity, in.User}
		switch {
		case o.Unknown:
			unknown[k]++
		case o.Outcome == store.Granted:
			granted[k] = true
		case o.Outcome == store.AlreadyClaimed:
			if r, ok := firstAlready[k]; !ok || op.Return < r {
				firstAlready[k] = op.Return
			}
		}
	}
	for a, claims := range final {
		for user := range claims {
			k := key{a, user}
			if _, already := firstAlready[k]; !granted[k] && !already && unknown[k] == 0 {
				phantoms = append(phantoms, a+"/"+user)
			}
		}
	}
	sort.Strings(phantoms)
	ops = make([]porcupine.Operation, 0, len(history))
	for _, op := range history {
		in, o := op.Input.(Input), op.Output.(Output)
		if in.Op == OpGrab && o.Unknown {
			k := key{in.Activity, in.User}
			p, holds := final[in.Activity][in.User]
			alreadyRet, already := firstAlready[k]
			switch {
			case !holds || granted[k] || already && alreadyRet <= op.Call:
				dropped++
				continue
			case unknown[k] == 1 && !already:
				o = Output{Outcome: store.Granted, Packet: p, Resolved: true}
			default:
				o.Packet = p
				if already {
					op.Return = min(op.Return, alreadyRet)
				}
			}
			op.Output = o
		}
		ops = append(ops, op)
	}
	return ops, dropped, phantoms
}
