package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"redpacket.io/operator/lua"
)

// Fields of a settlement stream entry (dead_letter.lua and replay_dead.lua carry
// them over). A grant, as grab.lua writes it, is one field, entryGrant =
// "<packetId>:<amount>:<epoch>:<currency>:<userId>" (the user id last: it may hold
// ':'), and happened at its entry id's time; replay_dead.lua adds entryAt to a grant
// it moves, so the grant keeps its own time. A refund (refund_activity.lua) has the
// fields kind (always "refund"), packet, user, amount, currency and at.
const (
	entryGrant    = "grant"
	entryCreate   = "create"
	entryKind     = "kind"
	entryPacket   = "packet"
	entryUser     = "user"
	entryAmount   = "amount"
	entryCurrency = "currency"
	entryAt       = "at"
)

// entryFields are the fields decodeStreamEntry reads.
var entryFields = map[string]bool{entryGrant: true, entryCreate: true, entryKind: true, entryPacket: true, entryUser: true,
	entryAmount: true, entryCurrency: true, entryAt: true}

// RefundPacketID is the packet id of the refund entry close.lua writes.
const RefundPacketID = "refund"

// StreamEntry is one entry of an activity's settlement stream: a grant, written by
// grab.lua, or the refund of the remainder, written by close.lua.
//
// An entry whose fields do not decode (Malformed is set) still carries its ID and
// raw Fields, so it can be parked in the dead-letter stream as it was; its other
// fields are then meaningless.
type StreamEntry struct {
	// ID is the entry's stream id.
	ID string
	// Kind is KindGrant, KindRefund or, in a budget's stream, KindCreate.
	Kind string
	// PacketID is the granted packet's id, RefundPacketID for the refund; never empty.
	PacketID string
	// UserID is the credited account: the claiming user, or the sponsor for the
	// refund; never empty.
	UserID string
	// Amount is in minor units, never negative.
	Amount int64
	// Currency is the activity's currency when the entry was written (display only;
	// deliveries carry the spec's).
	Currency string
	// At is when the grant or refund happened, by the Redis server's clock, to the
	// millisecond (UTC).
	At time.Time
	// Fields are the entry's field/value pairs as Redis holds them.
	Fields map[string]string
	// Malformed says why the fields are not a grant or refund; nil when they are.
	Malformed error

	// Shares and Expires are a creation record's (KindCreate): the packet's shares in
	// grab order, which sum to Amount (its total), and when it expires. UserID is then
	// its sender and At its creation (the entry id's time).
	Shares  []int64
	Expires time.Time

	// amount is Amount as the entry spells it, which is what the claim records.
	amount string
}

// decodeStreamEntry decodes the settlement stream entry id with the given fields: a
// packed grant (field grant, "<packetId>:<amount>:<epoch>:<currency>:<userId>", at
// the entry id's time unless an at field says otherwise), or a refund, the fields
// kind ("refund"), packet, user, amount, currency and at (unix milliseconds). Packet and user
// must not be empty and the amount must be a non-negative integer. Fields it does
// not know are ignored. When the fields do not decode, the entry's Malformed says
// why.
func decodeStreamEntry(id string, fields map[string]string) StreamEntry {
	e := StreamEntry{ID: id, Fields: fields}
	if err := e.decode(); err != nil {
		return StreamEntry{ID: id, Fields: fields, Malformed: err}
	}
	return e
}

func (e *StreamEntry) decode() error {
	if packed, ok := e.Fields[entryGrant]; ok {
		return e.decodePacked(packed)
	}
	if rec, ok := e.Fields[entryCreate]; ok {
		return e.decodeCreate(rec)
	}
	str := func(name string) (string, error) {
		v, ok := e.Fields[name]
		if !ok {
			return "", fmt.Errorf("field %q missing", name)
		}
		return v, nil
	}
	var err error
	if e.Kind, err = str(entryKind); err != nil {
		return err
	}
	switch e.Kind {
	case KindRefund:
	case KindGrant:
		return fmt.Errorf("a grant without the %q field (grants are packed)", entryGrant)
	default:
		return fmt.Errorf("unknown kind %q", e.Kind)
	}
	if e.PacketID, err = str(entryPacket); err != nil {
		return err
	}
	if e.UserID, err = str(entryUser); err != nil {
		return err
	}
	if e.amount, err = str(entryAmount); err != nil {
		return err
	}
	if e.Amount, err = strconv.ParseInt(e.amount, 10, 64); err != nil || e.Amount < 0 {
		return fmt.Errorf("amount %q is not a non-negative integer", e.amount)
	}
	e.Currency = e.Fields[entryCurrency]
	at, err := str(entryAt)
	if err != nil {
		return err
	}
	if e.At, err = parseAt(at); err != nil {
		return err
	}
	if e.PacketID == "" || e.UserID == "" {
		return errors.New("empty packet or user")
	}
	return nil
}

// decodePacked decodes a packed grant, "<packetId>:<amount>:<epoch>:<currency>:<userId>"
// (the epoch the grant was made in is checked, not kept).
func (e *StreamEntry) decodePacked(v string) error {
	e.Kind = KindGrant
	parts := strings.SplitN(v, ":", 5)
	if len(parts) != 5 {
		return fmt.Errorf("grant %q is not <packetId>:<amount>:<epoch>:<currency>:<userId>", v)
	}
	e.PacketID, e.amount, e.Currency, e.UserID = parts[0], parts[1], parts[3], parts[4]
	var err error
	if e.Amount, err = strconv.ParseInt(e.amount, 10, 64); err != nil || e.Amount < 0 {
		return fmt.Errorf("amount %q is not a non-negative integer", e.amount)
	}
	if epoch, err := strconv.ParseInt(parts[2], 10, 64); err != nil || epoch < 0 {
		return fmt.Errorf("epoch %q is not a non-negative integer", parts[2])
	}
	if at, ok := e.Fields[entryAt]; ok {
		if e.At, err = parseAt(at); err != nil {
			return err
		}
	} else if e.At, err = entryTime(e.ID); err != nil {
		return err
	}
	if e.PacketID == "" || e.UserID == "" {
		return errors.New("empty packet or user")
	}
	return nil
}

// maxRecordShares is the most shares a creation record may list: a packet's count
// is at most 1000 (budget_configure.lua).
const maxRecordShares = 1000

// decodeCreate decodes a budget packet's creation record (packet_create.lua),
// "<packetId>:<total>:<expires ms>:<s0>,<s1>,...:<sender>": at most maxRecordShares
// positive shares that sum to the total. It happened at its entry id's time.
func (e *StreamEntry) decodeCreate(v string) error {
	e.Kind = KindCreate
	parts := strings.SplitN(v, ":", 5)
	if len(parts) != 5 {
		return fmt.Errorf("creation record %q is not <packetId>:<total>:<expires>:<shares>:<sender>", truncate(v, 128))
	}
	e.PacketID, e.amount, e.UserID = parts[0], parts[1], parts[4]
	var err error
	if e.Amount, err = strconv.ParseInt(e.amount, 10, 64); err != nil || e.Amount < 1 {
		return fmt.Errorf("total %q is not a positive integer", e.amount)
	}
	exp, err := strconv.ParseInt(parts[2], 10, 64)
	if err != nil || exp < 0 {
		return fmt.Errorf("expiry %q is not unix milliseconds", parts[2])
	}
	e.Expires = time.UnixMilli(exp).UTC()
	list := strings.Split(parts[3], ",")
	if len(list) > maxRecordShares {
		return fmt.Errorf("%d shares, at most %d", len(list), maxRecordShares)
	}
	e.Shares = make([]int64, len(list))
	var sum int64
	for i, a := range list {
		n, err := strconv.ParseInt(a, 10, 64)
		if err != nil || n < 1 || strconv.FormatInt(n, 10) != a || n > e.Amount-sum {
			return fmt.Errorf("share %d %q is not a positive integer within the total", i, truncate(a, 32))
		}
		e.Shares[i], sum = n, sum+n
	}
	if sum != e.Amount {
		return fmt.Errorf("the shares sum to %d, not the total %d", sum, e.Amount)
	}
	if e.At, err = entryTime(e.ID); err != nil {
		return err
	}
	if e.PacketID == "" || e.UserID == "" {
		return errors.New("empty packet or sender")
	}
	return nil
}

// entryTime is the time of the stream entry id: when Redis appended it, to the
// millisecond (UTC).
func entryTime(id string) (time.Time, error) {
	ms, _, ok := parseStreamID(id)
	if !ok {
		return time.Time{}, fmt.Errorf("entry id %q has no time", id)
	}
	return time.UnixMilli(int64(ms)).UTC(), nil
}

// truncate is s cut to at most n bytes, for messages.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// parseAt reads an at field, unix milliseconds.
func parseAt(at string) (time.Time, error) {
	ms, err := strconv.ParseInt(at, 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("at %q is not unix milliseconds", at)
	}
	return time.UnixMilli(ms).UTC(), nil
}

// FieldValues are the entry's raw fields in the form DeadLetter takes them.
func (e StreamEntry) FieldValues() map[string]any {
	out := make(map[string]any, len(e.Fields))
	for k, v := range e.Fields {
		out[k] = v
	}
	return out
}

// decodeMessages decodes settlement stream entries as go-redis reads them (XRANGE,
// XREADGROUP): each as decodeStreamEntry does, and Malformed when a field it reads
// is not a string.
func decodeMessages(msgs []redis.XMessage) []StreamEntry {
	if len(msgs) == 0 {
		return nil
	}
	out := make([]StreamEntry, len(msgs))
	for i, m := range msgs {
		fields := make(map[string]string, len(m.Values))
		var bad error
		for k, v := range m.Values {
			s, ok := v.(string)
			if !ok {
				s = fmt.Sprint(v)
				if bad == nil && entryFields[k] {
					bad = fmt.Errorf("field %q is %T, not a string", k, v)
				}
			}
			fields[k] = s
		}
		out[i] = decodeStreamEntry(m.ID, fields)
		if bad != nil {
			out[i] = StreamEntry{ID: m.ID, Fields: fields, Malformed: bad}
		}
	}
	return out
}

// ErrForged is wrapped by the reason VerifyEntries gives for an entry that no script
// of the activity wrote.
var ErrForged = errors.New("forged settlement entry")

// ErrNotInRedis is returned by VerifyEntries when the activity's meta hash holds no
// state (its keys were deleted, or never written): nothing can be verified then.
var ErrNotInRedis = errors.New("the activity is not in Redis")

// claimValue is the value grab.lua stores in the claims hash for a user, in the same
// atomic step that appends the grant's stream entry: "<packetId>:<amount>:<entryId>",
// the packet as it was seeded and the id of that entry.
func claimValue(packetID, amount, entryID string) string {
	return packetID + ":" + amount + ":" + entryID
}

// parseClaim reads a claims hash value.
func parseClaim(v string) (Claim, bool) {
	id, rest, ok := strings.Cut(v, ":")
	if !ok {
		return Claim{}, false
	}
	amount, entry, ok := strings.Cut(rest, ":")
	n, err := strconv.ParseInt(amount, 10, 64)
	if !ok || err != nil || id == "" || entry == "" {
		return Claim{}, false
	}
	return Claim{PacketID: id, Amount: n, EntryID: entry}, true
}

// VerifyEntries checks each well-formed entry against what the activity's scripts
// recorded in the same atomic step that wrote it, so an entry appended to the
// stream by anyone else (XADD with the activity's Redis credentials) is told apart:
//
//   - a grant (grab.lua) must match its user's claim: HGET claims <user> equals
//     "<packet>:<amount>:<entry id>" of the entry, so a verbatim copy of a genuine
//     entry (another id) is forged too;
//   - the refund (close.lua) must match the close: the meta hash's state is closed,
//     its refunded amount is not zero (close.lua writes no refund of nothing) and
//     equals the entry's amount, its sponsor is the entry's user, and the packet is
//     "refund". The sponsor is not changed once the activity is closed.
//
// Fields the check does not read (at, currency, any other) are not compared. The
// claims hash and the close fields never change once written, so a verdict holds
// for as long as the keys exist. It returns, by entry id, why each entry that does
// not match is forged (wrapping ErrForged); genuine and malformed entries are not in
// the map. All reads go in one pipeline. When the meta hash holds no state it
// returns ErrNotInRedis, and any Redis error with context.
//
// The check trusts the claims hash and the meta hash: it defeats an entry appended
// on its own (a wrong user, packet or amount, an unknown packet, a refund of an open
// activity), not a writer who also edits those hashes.
func (a *Shard) VerifyEntries(ctx context.Context, entries []StreamEntry) (map[string]error, error) {
	forged := map[string]error{}
	if len(entries) == 0 {
		return forged, nil
	}
	pipe := a.c.Pipeline()
	meta := pipe.HMGet(ctx, a.keys.Meta, fieldState, fieldRefunded, fieldSponsor)
	claims := make([]*redis.StringCmd, len(entries))
	for i, e := range entries {
		if e.Malformed == nil && e.Kind == KindGrant {
			claims[i] = pipe.HGet(ctx, a.keys.Claims, e.UserID)
		}
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("verifying settlement entries against %s: %w", a.keys.Claims, err)
	}
	m, err := meta.Result()
	if err != nil {
		return nil, fmt.Errorf("verifying settlement entries: reading %s: %w", a.keys.Meta, err)
	}
	str := func(v any) (string, bool) {
		s, ok := v.(string)
		return s, ok
	}
	state, ok := str(m[0])
	if !ok {
		return nil, fmt.Errorf("verifying settlement entries: %w (%s holds no state)", ErrNotInRedis, a.keys.Meta)
	}
	refunded, _ := str(m[1])
	sponsor, _ := str(m[2])
	for i, e := range entries {
		if e.Malformed != nil {
			continue
		}
		packet, amount := e.PacketID, e.amount
		switch e.Kind {
		case KindGrant:
			held, err := claims[i].Result()
			switch {
			case errors.Is(err, redis.Nil):
				forged[e.ID] = fmt.Errorf("%w: user %q holds no packet in the claims hash", ErrForged, e.UserID)
			case err != nil:
				return nil, fmt.Errorf("verifying settlement entry %s: reading the claim of %q: %w", e.ID, e.UserID, err)
			case held != claimValue(packet, amount, e.ID):
				forged[e.ID] = fmt.Errorf("%w: the entry grants packet %q of %s to user %q, whose claim is %q (an entry must be the one its grant wrote)",
					ErrForged, packet, amount, e.UserID, held)
			}
		case KindRefund:
			switch {
			case State(state) != StateClosed:
				forged[e.ID] = fmt.Errorf("%w: a refund entry, but the activity is %s, not closed", ErrForged, state)
			case packet != RefundPacketID:
				forged[e.ID] = fmt.Errorf("%w: a refund entry with packet %q, not %q", ErrForged, packet, RefundPacketID)
			case refunded == "0" || refunded == "":
				forged[e.ID] = fmt.Errorf("%w: a refund entry, but the close refunded nothing", ErrForged)
			case amount != refunded:
				forged[e.ID] = fmt.Errorf("%w: a refund of %s, but the close refunded %s", ErrForged, amount, refunded)
			case e.UserID != sponsor:
				forged[e.ID] = fmt.Errorf("%w: a refund to %q, but the sponsor is %q", ErrForged, e.UserID, sponsor)
			}
		default:
			forged[e.ID] = fmt.Errorf("%w: a %s entry, which an activity's stream never holds", ErrForged, e.Kind)
		}
	}
	return forged, nil
}

// ErrNoGroup is wrapped by the errors of consumer-group reads when the group does
// not exist (Redis answered NOGROUP).
var ErrNoGroup = errors.New("the consumer group does not exist")

// groupErr wraps err with what was being done, and ErrNoGroup when Redis says the
// group is missing.
func groupErr(what string, err error) error {
	if strings.HasPrefix(err.Error(), "NOGROUP") {
		return fmt.Errorf("%s: %w: %w", what, ErrNoGroup, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// EnsureGroup creates the consumer group at the start of the settlement stream (so
// it reads every entry ever written), creating the stream too if need be
// (ensure_group.lua). A group that exists already is left as it is. When neither the
// activity nor its stream is in Redis (purged), nothing is created and the error
// wraps ErrMissing.
func (s *Stream) EnsureGroup(ctx context.Context, group string) error {
	res, err := lua.EnsureGroupScript.Run(ctx, s.c, []string{s.keys.Meta, s.keys.Stream}, group).Text()
	if err != nil {
		return fmt.Errorf("creating consumer group %s on %s: %w", group, s.keys.Stream, err)
	}
	if res == string(Missing) {
		return fmt.Errorf("creating consumer group %s on %s: %w", group, s.keys.Stream, ErrMissing)
	}
	return nil
}

// ReadNew reads up to count entries never delivered to the group, for consumer: each
// goes into the consumer's pending list with a delivery count of 1. It waits up to
// block for the first one (block <= 0: not at all) and returns none when none came.
func (s *Stream) ReadNew(ctx context.Context, group, consumer string, count int64, block time.Duration) ([]StreamEntry, error) {
	if block <= 0 {
		block = -1 // no BLOCK argument
	}
	return s.readGroup(ctx, group, consumer, ">", count, block, "reading new settlement entries")
}

// ReadOwnPending re-reads up to count entries of consumer's own pending list with ids
// after the given one ("0" for the start), oldest first, without waiting: what an
// earlier run under the same consumer name read and never acknowledged. Like any
// read, it raises each entry's delivery count by one. An empty answer means the list
// has been read to its end. An entry deleted from the stream comes back without
// fields (Malformed).
func (s *Stream) ReadOwnPending(ctx context.Context, group, consumer, after string, count int64) ([]StreamEntry, error) {
	return s.readGroup(ctx, group, consumer, after, count, -1, "re-reading own pending settlement entries")
}

func (s *Stream) readGroup(ctx context.Context, group, consumer, from string, count int64, block time.Duration, what string) ([]StreamEntry, error) {
	streams, err := s.c.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group: group, Consumer: consumer, Count: count, Block: block,
		Streams: []string{s.keys.Stream, from},
	}).Result()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, groupErr(what, err)
	}
	var msgs []redis.XMessage
	for _, s := range streams {
		msgs = append(msgs, s.Messages...)
	}
	return decodeMessages(msgs), nil
}

// ClaimIdle takes over for consumer up to count entries that sat in any consumer's
// pending list for at least minIdle (those of dead consumers), scanning the pending
// entries from cursor ("0-0" for the start). Each claimed entry's delivery count
// goes up by one. It returns the entries and the cursor to continue from, which is
// "0-0" once the scan went round.
func (s *Stream) ClaimIdle(ctx context.Context, group, consumer string, minIdle time.Duration, cursor string, count int64) ([]StreamEntry, string, error) {
	msgs, next, err := s.c.XAutoClaim(ctx, &redis.XAutoClaimArgs{
		Stream: s.keys.Stream, Group: group, Consumer: consumer,
		MinIdle: minIdle, Start: cursor, Count: count,
	}).Result()
	if err != nil {
		return nil, cursor, groupErr("taking over idle settlement entries", err)
	}
	if next == "" {
		next = "0-0"
	}
	return decodeMessages(msgs), next, nil
}

// deliveryCountPage is how many pending entries beyond the asked-for ones one
// DeliveryCounts call reads before it pages on.
const deliveryCountPage = 1024

// DeliveryCounts reads from consumer's pending list how many times Redis has handed
// out each of ids (its delivery count, raised by every read and claim). An id that
// is not in the consumer's pending list is missing from the answer.
func (s *Stream) DeliveryCounts(ctx context.Context, group, consumer string, ids []string) (map[string]int64, error) {
	counts := make(map[string]int64, len(ids))
	if len(ids) == 0 {
		return counts, nil
	}
	want := make(map[string]bool, len(ids))
	first, last := ids[0], ids[0]
	for _, id := range ids {
		want[id] = true
		if compareStreamIDs(id, first) < 0 {
			first = id
		}
		if compareStreamIDs(id, last) > 0 {
			last = id
		}
	}
	page := int64(len(ids)) + deliveryCountPage
	start := first
	for {
		pend, err := s.c.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: s.keys.Stream, Group: group, Consumer: consumer,
			Start: start, End: last, Count: page,
		}).Result()
		if err != nil {
			return counts, groupErr("reading delivery counts of settlement entries", err)
		}
		for _, p := range pend {
			if want[p.ID] {
				counts[p.ID] = p.RetryCount
			}
		}
		if int64(len(pend)) < page || len(counts) == len(want) {
			return counts, nil
		}
		start = "(" + pend[len(pend)-1].ID
	}
}

// compareStreamIDs orders two stream ids ("<ms>-<seq>") as Redis does; ids that do
// not parse compare as strings.
func compareStreamIDs(x, y string) int {
	xm, xs, okx := parseStreamID(x)
	ym, ys, oky := parseStreamID(y)
	if !okx || !oky {
		return strings.Compare(x, y)
	}
	switch {
	case xm != ym:
		if xm < ym {
			return -1
		}
		return 1
	case xs != ys:
		if xs < ys {
			return -1
		}
		return 1
	}
	return 0
}

func parseStreamID(id string) (ms, seq uint64, ok bool) {
	m, s, found := strings.Cut(id, "-")
	ms, err := strconv.ParseUint(m, 10, 64)
	if err != nil {
		return 0, 0, false
	}
	if !found {
		return ms, 0, true
	}
	seq, err = strconv.ParseUint(s, 10, 64)
	return ms, seq, err == nil
}

// HeldEntry is an entry a consumer holds, with the idle time it must have reached for
// the consumer's claim on it to go through (see RefreshHeld).
type HeldEntry struct {
	ID      string
	MinIdle time.Duration
}

// RefreshHeld resets the idle time of entries consumer holds, so no other consumer
// takes them over, in one pipeline of XCLAIM ... JUSTID (which leaves delivery counts
// alone): each entry is claimed for consumer only if it has been idle for at least its
// MinIdle. It returns, for every entry whose claim Redis answered, true when the claim
// went through (consumer holds it) and false when it did not (another consumer took
// it over since, or it is no longer pending); entries whose claim failed are missing,
// and err says why.
func (s *Stream) RefreshHeld(ctx context.Context, group, consumer string, held []HeldEntry) (map[string]bool, error) {
	owned := make(map[string]bool, len(held))
	if len(held) == 0 {
		return owned, nil
	}
	pipe := s.c.Pipeline()
	cmds := make([]*redis.StringSliceCmd, len(held))
	for i, h := range held {
		cmds[i] = pipe.XClaimJustID(ctx, &redis.XClaimArgs{
			Stream: s.keys.Stream, Group: group, Consumer: consumer,
			MinIdle: h.MinIdle, Messages: []string{h.ID},
		})
	}
	_, err := pipe.Exec(ctx)
	for i, cmd := range cmds {
		if cmd.Err() != nil {
			continue
		}
		owned[held[i].ID] = len(cmd.Val()) == 1
	}
	if err != nil {
		return owned, groupErr("refreshing held settlement entries", err)
	}
	return owned, nil
}

// ClaimForRetry claims entry id for consumer before another delivery attempt, if it
// has been idle for at least minIdle. The claim raises the entry's delivery count,
// so the attempt is counted even if the consumer dies during it. It returns false
// when the claim did not go through: another consumer took the entry over since, or
// it is no longer pending.
func (s *Stream) ClaimForRetry(ctx context.Context, group, consumer, id string, minIdle time.Duration) (bool, error) {
	msgs, err := s.c.XClaim(ctx, &redis.XClaimArgs{
		Stream: s.keys.Stream, Group: group, Consumer: consumer,
		MinIdle: minIdle, Messages: []string{id},
	}).Result()
	if err != nil {
		return false, groupErr("claiming settlement entry "+id+" for a retry", err)
	}
	return len(msgs) > 0, nil
}

// PendingCount is how many entries the group has handed out and not had
// acknowledged, over all its consumers.
func (s *Stream) PendingCount(ctx context.Context, group string) (int64, error) {
	p, err := s.c.XPending(ctx, s.keys.Stream, group).Result()
	if err != nil {
		return 0, groupErr("reading the pending settlement entries", err)
	}
	return p.Count, nil
}

// StreamLen is the number of entries in the settlement stream: one per grant, plus the
// refund, plus any replayed dead letters. The stream is never trimmed.
func (s *Stream) StreamLen(ctx context.Context) (int64, error) {
	n, err := s.c.XLen(ctx, s.keys.Stream).Result()
	if err != nil {
		return 0, fmt.Errorf("reading the length of %s: %w", s.keys.Stream, err)
	}
	return n, nil
}

// Entries reads the whole settlement stream, decoded, oldest first. It reads every
// entry at once, so it is for checks after the fact, not for delivery (ReadNew).
func (s *Stream) Entries(ctx context.Context) ([]StreamEntry, error) {
	return s.readAll(ctx, s.keys.Stream)
}

// DeadLetters reads the whole dead-letter stream, decoded, oldest first: each entry
// keeps the fields of the settlement entry it parks, and the last error.
func (s *Stream) DeadLetters(ctx context.Context) ([]StreamEntry, error) {
	return s.readAll(ctx, s.keys.DeadLetters)
}

// readAll reads and decodes every entry of the stream key.
func (s *Stream) readAll(ctx context.Context, key string) ([]StreamEntry, error) {
	msgs, err := s.c.XRange(ctx, key, "-", "+").Result()
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", key, err)
	}
	return decodeMessages(msgs), nil
}
