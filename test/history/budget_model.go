package history

import (
	"fmt"
	"math"
	"sort"
	"strings"

	"github.com/anishathalye/porcupine"

	"redpacket.io/operator/store"
)

// The sequential model of a RedPacketBudget's runtime packets (docs/budgets.md),
// partitioned per packet id: creations of the id, grabs of the packet and reads of
// its detail. The money of the budget is not in it (a partition sees one packet);
// the harness checks the budget's money, and each budget_exhausted answer against
// the creations that may have drawn on the shard before it (BudgetExhaustionBound).

// The operations of the packet model.
const (
	OpCreate     Op = "create"      // POST /v1/packets with one of the id's bodies
	OpPacketGrab Op = "packet-grab" // POST /v1/packets/{id}/grab
	OpDetail     Op = "detail"      // GET /v1/packets/{id}
)

// PacketBody is one body a creation of a packet id may send, as the model needs it:
// the sender, total and count as sent, the time to live the create function applies
// (the budget's default for a body that names none) and the shares the creation
// seeds, in grab order (lua/split, seeded by the budget's UID and the id).
type PacketBody struct {
	Sender       string
	Total, Count int64
	TTLMs        int64
	Shares       []int64
	// OverLimit marks a body outside the budget's limits: the create function
	// answers limit_exceeded for it once it finds no packet of the id.
	OverLimit bool
}

// BudgetInput is one call on a packet.
type BudgetInput struct {
	Packet string
	Op     Op
	// Body is a creation's body: an index into the id's bodies.
	Body int
	// User is a grab's user.
	User string
	// NotBeforeMs and NotAfterMs bound the Redis clock (unix ms) when the call's
	// function ran, as Input's do; NotAfterMs is 0 for a call with no answer.
	NotBeforeMs, NotAfterMs int64
}

// BudgetOutput is one return. Unknown is a call with no answer (a timeout, a 503, a
// connection cut): it may or may not have taken effect; the recorder returns it at
// the end of the history. Resolved is an unknown call that the final state shows
// took effect (ResolveBudget): it is checked as the answer it stands for, and also
// returns at the end.
type BudgetOutput struct {
	Unknown, Resolved bool
	// Create is a creation's outcome; CreatedMs and ExpiresMs are the packet's times
	// on the Redis clock as created and existing answer them.
	Create               store.CreateOutcome
	CreatedMs, ExpiresMs int64
	// Grab is a grab's outcome; Share and Amount are the share of granted and
	// already_claimed. An unknown grab resolved to "took this share or nothing" has
	// HasShare set.
	Grab     store.PacketGrabOutcome
	Share    int
	Amount   int64
	HasShare bool
	// Found is a detail read's answer: the packet and its grabs (user -> share), its
	// body as stored, and whether it was marked expired.
	Found   bool
	Sender  string
	Total   int64
	Count   int64
	Grabs   map[string]int
	Expired bool
	// Forgotten is set when the detail read found only the packet's tombstone.
	Forgotten bool
}

// atEnd says whether the recorder moves the return to the end of the history.
func (o BudgetOutput) atEnd() bool { return o.Unknown || o.Resolved }

// packetPhase is where a packet id is in its life: no packet yet, a packet (live or
// expired: its hash exists), or its tombstone (the hash shrunk once it expired: at
// once when nothing was left, else once its refund settled; packet_forget.lua). A
// tombstone outlives every run, so an id that named a packet never names another.
type packetPhase int

const (
	phaseAbsent packetPhase = iota
	phaseCreated
	phaseTomb
)

// packetState is one packet's state in the model. It is never mutated once built.
type packetState struct {
	phase packetPhase
	body  int
	// expLo and expHi bound the packet's expiry on the Redis clock (unix ms): what
	// the answers so far allow. A creation that answered gives it exactly.
	expLo, expHi int64
	// marked is set once a detail read showed the packet expired by the expiry
	// runner (its remainder refunded): no grant after it.
	marked bool
	// holders are the users of the shares granted so far, in share order.
	holders []string
}

func (s *packetState) share(user string) (int, bool) {
	for i, u := range s.holders {
		if u == user {
			return i, true
		}
	}
	return 0, false
}

// mayBeExpiredBy says whether the expiry can be at or before some clock reading of
// a call that ran no later than notAfter (0: unbounded).
func (s *packetState) mayBeExpiredBy(notAfter int64) bool {
	return notAfter == 0 || s.expLo <= notAfter
}

// mayBeLiveAt says whether the expiry can be after some clock reading at or after
// notBefore.
func (s *packetState) mayBeLiveAt(notBefore int64) bool { return notBefore < s.expHi }

func (s *packetState) with(f func(n *packetState)) *packetState {
	n := *s
	n.holders = append([]string(nil), s.holders...)
	f(&n)
	return &n
}

// expiredBy narrows the expiry to at or before notAfter (0: no narrowing).
func (s *packetState) expiredBy(notAfter int64) *packetState {
	if notAfter == 0 || notAfter >= s.expHi {
		return s
	}
	return s.with(func(n *packetState) { n.expHi = notAfter })
}

func (s *packetState) stepCreate(bodies []PacketBody, in BudgetInput, out BudgetOutput) (bool, *packetState) {
	b := bodies[in.Body]
	if out.Unknown {
		// Kept by ResolveBudget only when the final state shows this body's packet
		// existed and no answer said created: it took the id, or it ran once the
		// packet existed and changed nothing. (A call that changed nothing and ran
		// before is placed after the creation instead: its return is at the end.)
		if s.phase == phaseAbsent {
			if b.OverLimit {
				return false, s
			}
			lo := in.NotBeforeMs + b.TTLMs
			return true, &packetState{phase: phaseCreated, body: in.Body, expLo: lo, expHi: math.MaxInt64}
		}
		return true, s
	}
	if out.Create == store.CreateQuotaExceeded {
		// The sender's quota refused (budget_quota.go): only while no packet holds
		// the id, since a retry of an existing packet is answered as it is whatever
		// the quota; it changes nothing. Whether the quota allowed it is the run's
		// separate check of the counters against the packets created.
		return s.phase == phaseAbsent, s
	}
	switch s.phase {
	case phaseAbsent:
		switch out.Create {
		case store.CreateCreated:
			if b.OverLimit || out.ExpiresMs-out.CreatedMs != b.TTLMs || out.CreatedMs < in.NotBeforeMs ||
				in.NotAfterMs != 0 && out.CreatedMs > in.NotAfterMs {
				return false, s
			}
			return true, &packetState{phase: phaseCreated, body: in.Body, expLo: out.ExpiresMs, expHi: out.ExpiresMs}
		case store.CreateExisting:
			// The grab path's client retries a command once after a connection
			// error: the first run created the packet, its reply was lost, and the
			// retry found it. One call, one creation.
			if b.OverLimit || out.ExpiresMs-out.CreatedMs != b.TTLMs || out.CreatedMs < in.NotBeforeMs ||
				in.NotAfterMs != 0 && out.CreatedMs > in.NotAfterMs {
				return false, s
			}
			return true, &packetState{phase: phaseCreated, body: in.Body, expLo: out.ExpiresMs, expHi: out.ExpiresMs}
		case store.CreateLimitExceeded:
			return b.OverLimit, s
		case store.CreateBudgetExhausted:
			return !b.OverLimit, s
		}
		return false, s
	case phaseCreated:
		switch out.Create {
		case store.CreateExisting:
			if in.Body != s.body || out.ExpiresMs < s.expLo || out.ExpiresMs > s.expHi {
				return false, s
			}
			return true, s.with(func(n *packetState) { n.expLo, n.expHi = out.ExpiresMs, out.ExpiresMs })
		case store.CreateConflict:
			return in.Body != s.body, s
		}
		return false, s
	}
	// The tombstone: the id stays taken, the same body is the packet as it ended,
	// another a conflict; nothing is created again.
	switch out.Create {
	case store.CreateExisting:
		return in.Body == s.body && out.ExpiresMs >= s.expLo && out.ExpiresMs <= s.expHi, s
	case store.CreateConflict:
		return in.Body != s.body, s
	}
	return false, s
}

func (s *packetState) stepGrab(bodies []PacketBody, in BudgetInput, out BudgetOutput) (bool, *packetState) {
	if !out.Unknown && out.Grab == store.PacketQuotaExceeded {
		// The recipient's quota refused: never to a user who holds a share of the
		// packet (a repeat answers already_claimed whatever the quota), on any
		// packet, one that does not exist or is sold out too (the quota is taken
		// first when it lives on another shard); it changes nothing. A tombstone
		// keeps no claims: a holder refused means the packet is one now, as a
		// holder's sold_out or expired does (below).
		if _, has := s.share(in.User); s.phase == phaseCreated && has {
			if !s.mayBeExpiredBy(in.NotAfterMs) {
				return false, s
			}
			return true, s.expiredBy(in.NotAfterMs).with(func(n *packetState) { n.phase = phaseTomb; n.marked = true })
		}
		return true, s
	}
	if s.phase == phaseAbsent {
		// No hash: every grab answers missing and changes nothing. An unknown grab
		// of a user who ends with a share goes after the grant instead.
		return !out.HasShare && (out.Unknown || out.Grab == store.PacketMissing), s
	}
	b := bodies[s.body]
	held, has := s.share(in.User)
	if s.phase == phaseTomb {
		// The tombstone keeps no claims: every grab, a holder's too, answers
		// sold_out when every share was granted, else expired, and changes nothing.
		if out.Unknown {
			return !out.HasShare || has && held == out.Share, s
		}
		full := int64(len(s.holders)) >= b.Count
		return full && out.Grab == store.PacketSoldOut || !full && out.Grab == store.PacketExpired, s
	}
	// grant is a grant of the next share to the user, if the packet may hand it out.
	grant := func(share int, amount int64) (bool, *packetState) {
		k := len(s.holders)
		if has || s.marked || int64(k) >= b.Count || share != k || amount != b.Shares[k] || !s.mayBeLiveAt(in.NotBeforeMs) {
			return false, s
		}
		return true, s.with(func(n *packetState) {
			n.holders = append(n.holders, in.User)
			n.expLo = max(n.expLo, in.NotBeforeMs+1)
		})
	}
	if out.Unknown {
		if !out.HasShare {
			return !has, s // ResolveBudget keeps none of these: changed nothing
		}
		// The user holds out.Share at the end: this call took it, or changed
		// nothing and is placed where the user already holds it.
		if has {
			return held == out.Share, s
		}
		return grant(out.Share, b.Shares[min(out.Share, len(b.Shares)-1)])
	}
	switch out.Grab {
	case store.PacketGranted:
		return grant(out.Share, out.Amount)
	case store.PacketAlreadyClaimed:
		if has {
			return held == out.Share && out.Amount == b.Shares[held], s
		}
		// The grab path's client retries a command once after a connection error:
		// the first run granted the share and its reply was lost.
		return grant(out.Share, out.Amount)
	}
	if out.Grab == store.PacketMissing {
		return false, s // the hash, and then its tombstone, outlive the run
	}
	if has {
		// While the packet's hash is whole, a holder is answered already_claimed;
		// sold_out or expired means it is a tombstone now: the packet expired.
		full := int64(len(s.holders)) >= b.Count
		if !(full && out.Grab == store.PacketSoldOut || !full && out.Grab == store.PacketExpired) || !s.mayBeExpiredBy(in.NotAfterMs) {
			return false, s
		}
		return true, s.expiredBy(in.NotAfterMs).with(func(n *packetState) { n.phase = phaseTomb; n.marked = true })
	}
	switch out.Grab {
	case store.PacketSoldOut:
		return int64(len(s.holders)) >= b.Count, s
	case store.PacketExpired:
		if int64(len(s.holders)) >= b.Count || !s.marked && !s.mayBeExpiredBy(in.NotAfterMs) {
			return false, s
		}
		return true, s.expiredBy(in.NotAfterMs)
	}
	return false, s
}

func (s *packetState) stepDetail(bodies []PacketBody, in BudgetInput, out BudgetOutput) (bool, *packetState) {
	if out.Unknown {
		return true, s
	}
	if s.phase == phaseAbsent {
		return !out.Found, s
	}
	if !out.Found {
		return false, s // the hash, and then its tombstone, outlive the run
	}
	b := bodies[s.body]
	if out.Forgotten {
		// The tombstone: the body and expiry as they were, expired, no grabs.
		if out.Sender != b.Sender || out.Total != b.Total || out.Count != b.Count || !out.Expired ||
			out.ExpiresMs < s.expLo || out.ExpiresMs > s.expHi || len(out.Grabs) != 0 || !s.mayBeExpiredBy(in.NotAfterMs) {
			return false, s
		}
		return true, s.expiredBy(in.NotAfterMs).with(func(n *packetState) {
			n.phase, n.marked, n.expLo, n.expHi = phaseTomb, true, out.ExpiresMs, out.ExpiresMs
		})
	}
	if s.phase == phaseTomb {
		return false, s // a tombstone is never whole again
	}
	if out.Sender != b.Sender || out.Total != b.Total || out.Count != b.Count ||
		out.ExpiresMs < s.expLo || out.ExpiresMs > s.expHi || len(out.Grabs) != len(s.holders) {
		return false, s
	}
	for i, u := range s.holders {
		if sh, ok := out.Grabs[u]; !ok || sh != i {
			return false, s
		}
	}
	if s.marked && !out.Expired {
		return false, s
	}
	n := s.with(func(n *packetState) { n.expLo, n.expHi = out.ExpiresMs, out.ExpiresMs })
	if out.Expired && !s.marked {
		if !n.mayBeExpiredBy(in.NotAfterMs) {
			return false, s
		}
		n.marked = true
	}
	return true, n
}

func (s *packetState) hash() uint64 {
	h := uint64(s.phase) + uint64(s.body)<<4 + uint64(s.expLo)*0x9e3779b97f4a7c15 ^ uint64(s.expHi)*0xc2b2ae3d27d4eb4f
	if s.marked {
		h ^= 1 << 8
	}
	for i, u := range s.holders {
		h ^= entryHash(u, fmt.Sprint(i))
	}
	return h
}

func (s *packetState) equal(o *packetState) bool {
	if s.phase != o.phase || s.body != o.body || s.expLo != o.expLo || s.expHi != o.expHi || s.marked != o.marked ||
		len(s.holders) != len(o.holders) {
		return false
	}
	for i := range s.holders {
		if s.holders[i] != o.holders[i] {
			return false
		}
	}
	return true
}

// BudgetModel returns the porcupine model of a budget's packets: bodies are the
// bodies the creations of each packet id may send (BudgetInput.Body indexes them).
// Every packet id starts with no packet. Expiry is not an operation: it is the
// Redis clock passing a packet's expiry, which a grab reads itself (expired), and
// the expiry runner and settlement acting after it (a detail marked expired, then
// the tombstone: a detail without grabs, and a holder answered sold_out or expired).
// The model bounds the expiry by the answers: the creation's exact time when it
// answered, else at least its call plus the time to live; no grant after a clock
// reading past it, no expired, marked or tombstone answer before it. A packet id
// that named a packet is never missing again: missing and not found are answers
// for an id that named none yet.
func BudgetModel(bodies map[string][]PacketBody) porcupine.Model {
	return porcupine.Model{
		Partition: partitionBy(func(in interface{}) string { return in.(BudgetInput).Packet }),
		Init:      func() interface{} { return &packetState{expHi: math.MaxInt64} },
		Step: func(st, in, out interface{}) (bool, interface{}) {
			s, i, o := st.(*packetState), in.(BudgetInput), out.(BudgetOutput)
			bs := bodies[i.Packet]
			if len(bs) == 0 {
				return false, st
			}
			switch i.Op {
			case OpCreate:
				if i.Body < 0 || i.Body >= len(bs) {
					return false, st
				}
				return s.stepCreate(bs, i, o)
			case OpPacketGrab:
				return s.stepGrab(bs, i, o)
			case OpDetail:
				return s.stepDetail(bs, i, o)
			}
			return false, st
		},
		Hash:  func(st interface{}) uint64 { return st.(*packetState).hash() },
		Equal: func(a, b interface{}) bool { return a.(*packetState).equal(b.(*packetState)) },
		DescribeOperation: func(in, out interface{}) string {
			i, o := in.(BudgetInput), out.(BudgetOutput)
			at := fmt.Sprintf(" [redis ms %d..]", i.NotBeforeMs)
			if i.NotAfterMs != 0 {
				at = fmt.Sprintf(" [redis ms %d..%d]", i.NotBeforeMs, i.NotAfterMs)
			}
			var res string
			switch {
			case o.Unknown && o.HasShare:
				res = fmt.Sprintf("unknown (user ends with share %d)", o.Share)
			case o.Unknown:
				res = "unknown"
			case i.Op == OpCreate:
				res = string(o.Create)
				if o.ExpiresMs != 0 {
					res += fmt.Sprintf(" expires %d", o.ExpiresMs)
				}
			case i.Op == OpPacketGrab && (o.Grab == store.PacketGranted || o.Grab == store.PacketAlreadyClaimed):
				res = fmt.Sprintf("%s share %d (%d)", o.Grab, o.Share, o.Amount)
			case i.Op == OpPacketGrab:
				res = string(o.Grab)
			case o.Found:
				res = fmt.Sprintf("found, expires %d, expired %t, grabs %v", o.ExpiresMs, o.Expired, o.Grabs)
			default:
				res = "not found"
			}
			if o.Resolved {
				res = "unknown, resolved: " + res
			}
			switch i.Op {
			case OpCreate:
				return fmt.Sprintf("create(body %d)%s -> %s", i.Body, at, res)
			case OpPacketGrab:
				return fmt.Sprintf("grab(%s)%s -> %s", i.User, at, res)
			}
			return fmt.Sprintf("detail%s -> %s", at, res)
		},
		DescribeState: func(st interface{}) string {
			s := st.(*packetState)
			exp := fmt.Sprintf("expires %d..", s.expLo)
			if s.expHi != math.MaxInt64 {
				exp += fmt.Sprint(s.expHi)
			}
			switch s.phase {
			case phaseAbsent:
				return "no packet"
			case phaseTomb:
				return fmt.Sprintf("tombstone of body %d, %s, shares to [%s]", s.body, exp, strings.Join(s.holders, " "))
			}
			mark := ""
			if s.marked {
				mark = ", marked expired"
			}
			return fmt.Sprintf("body %d, %s%s, shares to [%s]", s.body, exp, mark, strings.Join(s.holders, " "))
		},
	}
}

// PacketEvidence is what the end of a run shows of one packet id: the shares the
// balance system credited (share -> user and amount) and the refund it credited
// (RefundUser "" when none).
type PacketEvidence struct {
	Grants     map[int]CreditedShare
	RefundUser string
	Refund     int64
}

// CreditedShare is one credited grant.
type CreditedShare struct {
	User   string
	Amount int64
}

// FinalBody says which body the packet of an id was created with, from the
// evidence: -1 when no packet can have existed (nothing credited), or the one body
// consistent with it. ok is false when no body or more than one is consistent:
// the evidence contradicts every packet the id's bodies could have made.
func FinalBody(bodies []PacketBody, ev PacketEvidence) (body int, ok bool) {
	if len(ev.Grants) == 0 && ev.RefundUser == "" {
		return -1, true
	}
	found := -1
	for i, b := range bodies {
		if b.OverLimit {
			continue
		}
		var granted int64
		fits := true
		for share, c := range ev.Grants {
			if int64(share) >= b.Count || c.Amount != b.Shares[share] {
				fits = false
				break
			}
			granted += c.Amount
		}
		switch {
		case !fits:
		case ev.RefundUser == "" && int64(len(ev.Grants)) != b.Count:
			fits = false // a packet with money left is refunded
		case ev.RefundUser != "" && (ev.RefundUser != b.Sender || ev.Refund != b.Total-granted):
			fits = false
		}
		if fits {
			if found >= 0 {
				return -1, false
			}
			found = i
		}
	}
	return found, found >= 0
}

// ResolveBudget prepares a budget history for the checker with the final state of
// every packet id (the body its packet was created with, -1 for none, and who holds
// which share: final[id][user] = share), as Resolve does for activities:
//
//   - an unknown creation changed nothing unless the id's packet has its body and
//     no creation answered created; those that remain took the id or changed
//     nothing, and the model lets the first one placed create the packet;
//   - an unknown grab of a user who holds no share at the end, or whose grab
//     answered granted, or called after an already_claimed answer, changed
//     nothing; the one unknown grab of a holder never answered granted or
//     already_claimed took the share (Resolved, granted); any other carries the
//     share (took it or nothing), returning with the first already_claimed answer
//     when there is one;
//   - an unknown detail read is dropped (it changes nothing).
//
// A user holding a share no grab of theirs can have given is a phantom, returned
// as "<id>/<user>" for the caller to fail on, with how many operations were
// dropped.
func ResolveBudget(history []porcupine.Operation, finalBody map[string]int, final map[string]map[string]int,
	bodies map[string][]PacketBody) (ops []porcupine.Operation, dropped int, phantoms []string) {
	type key struct{ packet, user string }
	granted, unknown := map[key]bool{}, map[key]int{}
	firstAlready := map[key]int64{}
	createdAnswered := map[string]bool{}
	for _, op := range history {
		in, o := op.Input.(BudgetInput), op.Output.(BudgetOutput)
		switch {
		case in.Op == OpCreate && !o.Unknown && o.Create == store.CreateCreated:
			createdAnswered[in.Packet] = true
		case in.Op != OpPacketGrab:
		case o.Unknown:
			unknown[key{in.Packet, in.User}]++
		case o.Grab == store.PacketGranted:
			granted[key{in.Packet, in.User}] = true
		case o.Grab == store.PacketAlreadyClaimed:
			k := key{in.Packet, in.User}
			if r, ok := firstAlready[k]; !ok || op.Return < r {
				firstAlready[k] = op.Return
			}
		}
	}
	for p, claims := range final {
		for user := range claims {
			k := key{p, user}
			if _, already := firstAlready[k]; !granted[k] && !already && unknown[k] == 0 {
				phantoms = append(phantoms, p+"/"+user)
			}
		}
	}
	sort.Strings(phantoms)
	ops = make([]porcupine.Operation, 0, len(history))
	for _, op := range history {
		in, o := op.Input.(BudgetInput), op.Output.(BudgetOutput)
		if o.Unknown {
			switch in.Op {
			case OpDetail:
				dropped++
				continue
			case OpCreate:
				fb, ok := finalBody[in.Packet]
				if !ok || fb != in.Body || createdAnswered[in.Packet] {
					dropped++
					continue
				}
			case OpPacketGrab:
				k := key{in.Packet, in.User}
				share, holds := final[in.Packet][in.User]
				alreadyRet, already := firstAlready[k]
				switch {
				case !holds || granted[k] || already && alreadyRet <= op.Call:
					dropped++
					continue
				case unknown[k] == 1 && !already:
					var amount int64
					if b := finalBody[in.Packet]; b >= 0 && share < len(bodies[in.Packet][b].Shares) {
						amount = bodies[in.Packet][b].Shares[share]
					}
					o = BudgetOutput{Resolved: true, Grab: store.PacketGranted, Share: share, Amount: amount}
				default:
					o.Share, o.HasShare = share, true
					if already {
						op.Return = min(op.Return, alreadyRet)
					}
				}
				op.Output = o
			}
		}
		ops = append(ops, op)
	}
	return ops, dropped, phantoms
}
