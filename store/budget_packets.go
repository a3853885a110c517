package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
)

// The grab fleet's calls on a budget: the functions of lua.GrabLibrary (FCALL),
// which the budget's own Redis user may run. A call that finds the library missing
// fails with the server's "Function not found" wrapped (ErrFunctionMissing: the
// grab service answers 503, and nothing ran); a handle of the operator's
// (RestoreFunctions) loads it and calls once more.

// MaxUserIDLength bounds a user id, as the scripts do.
const MaxUserIDLength = 1024

// ErrInvalidUserID is returned by GrabPacket for a user id that is empty or longer
// than MaxUserIDLength: no packet could hold its claim.
var ErrInvalidUserID = errors.New("a user id is 1 to 1024 bytes")

// ValidPacketID reports whether id is a packet id: 1 to MaxPacketIDLength of
// [A-Za-z0-9._-], the first alphanumeric (the scripts check the same).
func ValidPacketID(id string) bool {
	if id == "" || len(id) > MaxPacketIDLength {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '.' && c != '_' && c != '-') {
			return false
		}
	}
	return true
}

// RestoreFunctions makes the handle load the function library when a call finds it
// missing, and retry that call once. Only the operator's handles do this (its Redis
// user may run FUNCTION LOAD). It returns the handle.
func (b *Budget) RestoreFunctions() *Budget {
	b.restores = true
	return b
}

// call runs a function of the library on the budget's client (callFunction),
// restoring a missing library on the operator's handles.
func (b *Budget) call(ctx context.Context, s *lua.Script, keys []string, args ...any) *redis.Cmd {
	return callFunction(ctx, b.c, b.restores, s, keys, args...)
}

// CreateResult is what a creation decided: the packet for created and existing,
// and for a refusal the reason the script or the checks gave (for the 4xx answer).
type CreateResult struct {
	Outcome CreateOutcome
	Packet  PacketDetail
	Reason  string
	// Quota is the rule of a CreateQuotaExceeded.
	Quota *QuotaRefusal
}

// CreatePacket splits p.Total into p.Count shares (lua/split, seeded by the budget's
// UID and the packet id, so a repeat yields the same shares), draws the money from
// the packet's shard and seeds the packet, in one script.
func (b *Budget) CreatePacket(ctx context.Context, p NewPacket) (PacketDetail, CreateOutcome, error) {
	r, err := b.Create(ctx, p)
	return r.Packet, r.Outcome, err
}

// Fingerprint is the fingerprint of a creation's body, which decides whether a
// repeat with the same id is the same packet (existing) or another (conflict): the
// first 16 hex digits of the SHA-256 of the sender, total, count, distribution and
// time to live as requested.
func (p NewPacket) Fingerprint() string {
	sum := sha256.Sum256([]byte(p.Sender + "\x00" + strconv.FormatInt(p.Total, 10) + "\x00" +
		strconv.FormatInt(p.Count, 10) + "\x00" + p.Distribution + "\x00" + strconv.FormatInt(p.TTL.Milliseconds(), 10)))
	return hex.EncodeToString(sum[:8])
}

// check reports why p cannot be a packet of any budget ("" when it can); the
// budget's own limits are the script's to check.
func (p NewPacket) check() string {
	switch {
	case !ValidPacketID(p.ID):
		return "id must be 1 to 64 of [A-Za-z0-9._-], the first alphanumeric"
	case p.Sender == "" || len(p.Sender) > MaxUserIDLength:
		return "sender must be 1 to 1024 bytes"
	case p.Total < 1 || p.Total > MaxPacketTotal:
		return fmt.Sprintf("totalAmount must be from 1 to %d", int64(MaxPacketTotal))
	case p.Count < 1:
		return "count must be at least 1"
	case p.Distribution != split.TypeRandom && p.Distribution != split.TypeLineCut && p.Distribution != split.TypeFixed:
		return fmt.Sprintf("distribution %q is not %s, %s or %s", p.Distribution, split.TypeRandom, split.TypeLineCut, split.TypeFixed)
	case p.TTL < 0 || p.TTL > 0 && p.TTL < time.Millisecond:
		return "ttl must be 0 (the budget's default) or at least 1ms"
	}
	return ""
}

// Create is CreatePacket with the reason of a refusal. Every outcome but
// CreateCreated and CreateExisting changed nothing; an error means Redis did not
// answer (or the budget's shard was never configured), and nothing may be assumed
// of a creation that errs but that a repeat of it is safe.
func (b *Budget) Create(ctx context.Context, p NewPacket) (CreateResult, error) {
	if why := p.check(); why != "" {
		return CreateResult{Outcome: CreateInvalid, Reason: why}, nil
	}
	if p.Count > MaxPacketShares {
		return CreateResult{Outcome: CreateLimitExceeded, Reason: fmt.Sprintf("count %d is above the budget's maximum", p.Count)}, nil
	}
	i := b.ShardOf(p.ID)
	limits, ok, err := b.limitsFor(ctx, i)
	if err != nil {
		return CreateResult{}, fmt.Errorf("creating packet %s: %w", p.ID, err)
	}
	if !ok {
		if reason, _ := b.c.HGet(ctx, b.keys[i].Meta, "fenced").Result(); reason != "" {
			return CreateResult{}, &FencedError{What: "creating packet " + p.ID, Reason: reason}
		}
		return CreateResult{}, fmt.Errorf("creating packet %s: budget shard %d is not configured", p.ID, i)
	}
	shares, err := split.Split(split.Params{Type: p.Distribution, Total: p.Total, Count: p.Count, Min: limits.MinShare,
		Seed: split.SeedFromUID(b.uid + "/" + p.ID)})
	if err != nil {
		// The shares cannot meet the minimum. A packet of that id may exist all the
		// same: the script answers that before it looks at the body.
		shares = nil
	}
	k := b.keys[i]
	args := make([]any, 0, 12+len(shares))
	args = append(args, p.ID, p.Fingerprint(), p.Sender, p.Total, p.Count, p.Distribution, p.TTL.Milliseconds())
	for _, a := range shares {
		args = append(args, a)
	}
	keys := []string{k.Meta, k.Packet(p.ID), k.Due, k.Stream}
	// The sender's quotas: counted by the create itself on the sender's home shard,
	// else taken there first and given back unless the packet is created.
	took := -1
	var takenAt time.Time
	if q := p.Quota; q != nil && q.Limits.Sender() {
		h := b.QuotaShardOf(p.Sender)
		if h == i || b.oneServer {
			keys = append(keys, b.keys[h].QuotaDay(q.At.Day))
			args = append(args, senderQuotaArgs(q)...)
		} else {
			refused, at, err := b.quota(ctx, h, "take", "send", p.Sender, p.Total, q)
			if err != nil {
				return CreateResult{}, fmt.Errorf("creating packet %s: %w", p.ID, err)
			}
			if refused != nil {
				// A retry of a packet that exists answers existing (or conflict), not
				// the quota: the create is asked without it, and creates nothing.
				if _, found, err := b.Packet(ctx, p.ID); err != nil || !found {
					if err != nil {
						return CreateResult{}, fmt.Errorf("creating packet %s: %w", p.ID, err)
					}
					return CreateResult{Outcome: CreateQuotaExceeded, Quota: refused}, nil
				}
			} else {
				took, takenAt = h, at
				defer func() {
					// What the take counted stays counted only for a packet created
					// now; after an error nothing is known, and it stays counted
					// (the quota allows one fewer today, never one more). A give
					// that fails leaves the same.
					if took >= 0 {
						_, _, _ = b.quota(context.WithoutCancel(ctx), took, "give", "send", p.Sender, p.Total, q)
					}
				}()
			}
		}
	}
	reply, err := b.call(ctx, lua.PacketCreateScript, keys, args...).StringSlice()
	// A shard that cannot pay borrows from its siblings (budget_moves.go), and the
	// creation is tried again: budget_exhausted answers only what the whole budget
	// cannot pay.
	for attempt := 0; err == nil && len(reply) == 1 && reply[0] == string(CreateBudgetExhausted) && len(b.keys) > 1 &&
		attempt < maxMoveAttempts; attempt++ {
		got, merr := b.refillShard(ctx, i, p.Total)
		if merr != nil {
			return CreateResult{}, fmt.Errorf("creating packet %s: %w", p.ID, merr)
		}
		// Asked again whatever the refill came to: a racing creation of the same id
		// (a client's retry) may have made the packet meanwhile, with the money this
		// one saw, and the answer is then existing (or conflict), not a
		// budget_exhausted read before the packet was there. Racing borrowers that
		// took the money from under the refill make it try again; only a budget that
		// holds less than the total in all ends the tries.
		reply, err = b.call(ctx, lua.PacketCreateScript, keys, args...).StringSlice()
		if got == refillShort {
			break
		}
	}
	if err != nil {
		took = -1
		return CreateResult{}, fmt.Errorf("creating packet %s: %w", p.ID, err)
	}
	if len(reply) == 0 {
		return CreateResult{}, fmt.Errorf("creating packet %s: empty reply", p.ID)
	}
	if reply[0] == string(CreateCreated) {
		took = -1
	}
	if reply[0] == "fenced" {
		return CreateResult{}, &FencedError{What: "creating packet " + p.ID, Reason: strings.Join(reply[1:], " ")}
	}
	res := CreateResult{Outcome: CreateOutcome(reply[0])}
	switch res.Outcome {
	case CreateCreated:
		if len(reply) != 3 {
			return CreateResult{}, fmt.Errorf("creating packet %s: reply %q", p.ID, reply)
		}
		created, err1 := strconv.ParseInt(reply[1], 10, 64)
		expires, err2 := strconv.ParseInt(reply[2], 10, 64)
		if err := errors.Join(err1, err2); err != nil {
			return CreateResult{}, fmt.Errorf("creating packet %s: reply %q: %w", p.ID, reply, err)
		}
		res.Packet = PacketDetail{ID: p.ID, Sender: p.Sender, Distribution: p.Distribution, Currency: limits.Currency,
			Total: p.Total, Count: p.Count, RemainingAmount: p.Total, RemainingCount: p.Count,
			CreatedAt: time.UnixMilli(created).UTC(), ExpiresAt: time.UnixMilli(expires).UTC()}
	case CreateExisting:
		d, found, err := b.Packet(ctx, p.ID)
		if err != nil {
			took = -1
			return CreateResult{}, fmt.Errorf("creating packet %s: reading the existing packet: %w", p.ID, err)
		}
		if !found {
			return CreateResult{}, fmt.Errorf("creating packet %s: the existing packet is gone", p.ID)
		}
		if !d.CreatedAt.Before(takenAt.Add(-QuotaClockMargin)) {
			// Created after the quota was taken: perhaps by this call's first run,
			// whose reply was lost. It stays counted.
			took = -1
		}
		res.Packet = d
	case CreateConflict, CreateClosed, CreateBudgetExhausted:
	case CreateQuotaExceeded:
		q, err := parseQuotaRefusal(reply)
		if err != nil {
			return CreateResult{}, fmt.Errorf("creating packet %s: %w", p.ID, err)
		}
		res.Quota = q
	case CreateInvalid, CreateLimitExceeded:
		if len(reply) > 1 {
			res.Reason = reply[1]
		}
		if shares == nil && res.Outcome == CreateInvalid {
			// The script found no shares: the total cannot give each the minimum.
			res.Outcome = CreateLimitExceeded
			res.Reason = fmt.Sprintf("total %d cannot give %d shares the minimum share of %d", p.Total, p.Count, limits.MinShare)
		}
	default:
		return CreateResult{}, fmt.Errorf("creating packet %s: outcome %q", p.ID, reply[0])
	}
	return res, nil
}

// GrabPacket decides one user's grab of a packet, once per user per packet. A
// packet id that no packet can have answers PacketMissing without a call.
func (b *Budget) GrabPacket(ctx context.Context, packetID, userID string) (PacketGrab, error) {
	return b.GrabPacketWithin(ctx, packetID, userID, nil)
}

// GrabPacketWithin is GrabPacket counted against the recipient's quota when q sets
// SharesPerDay (budget_quota.go): a grant counts one share of the user's day, and
// a grab the quota refuses answers PacketQuotaExceeded and writes nothing. A
// repeat of a granted grab answers already_claimed whatever the quota.
func (b *Budget) GrabPacketWithin(ctx context.Context, packetID, userID string, q *QuotaCheck) (PacketGrab, error) {
	if userID == "" || len(userID) > MaxUserIDLength {
		return PacketGrab{}, ErrInvalidUserID
	}
	if !ValidPacketID(packetID) {
		return PacketGrab{Outcome: PacketMissing}, nil
	}
	i := b.ShardOf(packetID)
	k := b.keys[i]
	keys, args := []string{k.Meta, k.Packet(packetID), k.Stream}, []any{packetID, userID}
	took := false
	var takenAt time.Time
	if q != nil && q.Limits.SharesPerDay > 0 {
		h := b.QuotaShardOf(userID)
		if h == i || b.oneServer {
			keys = append(keys, b.keys[h].QuotaRecipients(q.At.Day))
			args = append(args, q.Limits.SharesPerDay, q.At.dayExpiry())
		} else {
			refused, at, err := b.quota(ctx, h, "take", "recv", userID, 0, q)
			if err != nil {
				return PacketGrab{}, fmt.Errorf("grabbing packet %s: %w", packetID, err)
			}
			if refused != nil {
				// A repeat still answers already_claimed: the grab is asked without
				// the quota when the user holds a share of the packet, and grants
				// nothing.
				d, found, err := b.Packet(ctx, packetID)
				if err != nil {
					return PacketGrab{}, fmt.Errorf("grabbing packet %s: %w", packetID, err)
				}
				if !found || !slices.ContainsFunc(d.Grabs, func(s PacketShare) bool { return s.UserID == userID }) {
					return PacketGrab{Outcome: PacketQuotaExceeded, Quota: refused}, nil
				}
			} else {
				took, takenAt = true, at
				defer func() {
					// Given back unless granted; after an error it stays counted (see
					// Create).
					if took {
						_, _, _ = b.quota(context.WithoutCancel(ctx), h, "give", "recv", userID, 0, q)
					}
				}()
			}
		}
	}
	reply, err := b.call(ctx, lua.PacketGrabScript, keys, args...).StringSlice()
	if err != nil {
		took = false
		return PacketGrab{}, fmt.Errorf("grabbing packet %s: %w", packetID, err)
	}
	if len(reply) > 0 && reply[0] == string(PacketGranted) {
		took = false
	}
	if len(reply) == 0 {
		return PacketGrab{}, fmt.Errorf("grabbing packet %s: empty reply", packetID)
	}
	if reply[0] == "fenced" {
		return PacketGrab{}, &FencedError{What: "grabbing packet " + packetID, Reason: strings.Join(reply[1:], " ")}
	}
	g := PacketGrab{Outcome: PacketGrabOutcome(reply[0])}
	switch g.Outcome {
	case PacketGranted:
		if len(reply) != 3 {
			return PacketGrab{}, fmt.Errorf("grabbing packet %s: reply %q", packetID, reply)
		}
		share, err1 := strconv.Atoi(reply[1])
		amount, err2 := strconv.ParseInt(reply[2], 10, 64)
		if err := errors.Join(err1, err2); err != nil {
			return PacketGrab{}, fmt.Errorf("grabbing packet %s: reply %q: %w", packetID, reply, err)
		}
		g.Share, g.Amount = share, amount
	case PacketAlreadyClaimed:
		if len(reply) != 2 {
			return PacketGrab{}, fmt.Errorf("grabbing packet %s: reply %q", packetID, reply)
		}
		c, ok := parsePacketClaim(userID, reply[1])
		if !ok {
			took = false
			return PacketGrab{}, fmt.Errorf("grabbing packet %s: claim %q is not <share>:<amount>:<entryId>", packetID, reply[1])
		}
		g.Share, g.Amount = c.Share, c.Amount
		if !c.At.Before(takenAt.Add(-QuotaClockMargin)) {
			// Granted after the quota was taken: perhaps by this call's first run,
			// whose reply was lost. It stays counted.
			took = false
		}
	case PacketSoldOut, PacketExpired, PacketMissing:
	case PacketQuotaExceeded:
		r, err := parseQuotaRefusal(reply)
		if err != nil {
			return PacketGrab{}, fmt.Errorf("grabbing packet %s: %w", packetID, err)
		}
		g.Quota = r
	default:
		return PacketGrab{}, fmt.Errorf("grabbing packet %s: outcome %q", packetID, reply[0])
	}
	return g, nil
}

// parsePacketClaim reads a packet's claim, "<share>:<amount>:<entryId>", the
// settlement entry's id carrying the grant's time.
func parsePacketClaim(user, v string) (PacketShare, bool) {
	share, rest, ok1 := strings.Cut(v, ":")
	amount, entry, ok2 := strings.Cut(rest, ":")
	s, err1 := strconv.Atoi(share)
	a, err2 := strconv.ParseInt(amount, 10, 64)
	ms, _, ok3 := parseStreamID(entry)
	if !ok1 || !ok2 || !ok3 || err1 != nil || err2 != nil || s < 0 || a < 0 {
		return PacketShare{}, false
	}
	return PacketShare{Share: s, UserID: user, Amount: a, At: time.UnixMilli(int64(ms)).UTC()}, true
}

// Packet reads a packet and its grabs; false when there is no such packet.
func (b *Budget) Packet(ctx context.Context, packetID string) (PacketDetail, bool, error) {
	if !ValidPacketID(packetID) {
		return PacketDetail{}, false, nil
	}
	k := b.keys[b.ShardOf(packetID)]
	v, err := b.call(ctx, lua.PacketDetailScript, []string{k.Meta, k.Packet(packetID)}, packetID).StringSlice()
	if err != nil {
		return PacketDetail{}, false, fmt.Errorf("reading packet %s: %w", packetID, err)
	}
	if len(v) == 0 {
		return PacketDetail{}, false, nil
	}
	if len(v)%2 != 1 {
		return PacketDetail{}, false, fmt.Errorf("reading packet %s: %d values", packetID, len(v))
	}
	fields := make(map[string]string, len(v)/2)
	for j := 1; j < len(v); j += 2 {
		fields[v[j]] = v[j+1]
	}
	d, err := decodePacket(packetID, v[0], fields)
	if err != nil {
		return PacketDetail{}, false, fmt.Errorf("reading packet %s: %w", packetID, err)
	}
	return d, true, nil
}

// decodePacket reads a packet hash's fields (packet_create.lua, packet_grab.lua).
func decodePacket(id, currency string, f map[string]string) (PacketDetail, error) {
	d := PacketDetail{ID: id, Sender: f["snd"], Distribution: f["dst"], Currency: currency, Expired: f["x"] != "",
		Forgotten: f["f"] != ""}
	var granted int64
	for _, n := range []struct {
		name string
		dst  *int64
	}{{"tot", &d.Total}, {"cnt", &d.Count}, {"g", &granted}, {"r", &d.RemainingAmount}} {
		v, err := strconv.ParseInt(f[n.name], 10, 64)
		if err != nil {
			return PacketDetail{}, fmt.Errorf("field %s %q: %w", n.name, f[n.name], err)
		}
		*n.dst = v
	}
	for _, n := range []struct {
		name string
		dst  *time.Time
	}{{"ct", &d.CreatedAt}, {"ex", &d.ExpiresAt}} {
		v, err := strconv.ParseInt(f[n.name], 10, 64)
		if err != nil {
			return PacketDetail{}, fmt.Errorf("field %s %q: %w", n.name, f[n.name], err)
		}
		*n.dst = time.UnixMilli(v).UTC()
	}
	if ms, err := strconv.ParseInt(f["f"], 10, 64); err == nil && ms > 1 {
		d.ForgottenAt = time.UnixMilli(ms).UTC()
	}
	d.RemainingCount = d.Count - granted
	if d.Expired {
		// What was left went back to the sender.
		d.RemainingCount = 0
	}
	for name, v := range f {
		user, ok := strings.CutPrefix(name, "u:")
		if !ok {
			continue
		}
		c, ok := parsePacketClaim(user, v)
		if !ok {
			return PacketDetail{}, fmt.Errorf("claim %q of %q is not <share>:<amount>:<entryId>", v, user)
		}
		d.Grabs = append(d.Grabs, c)
	}
	slices.SortFunc(d.Grabs, func(x, y PacketShare) int { return x.Share - y.Share })
	return d, nil
}

// LivePackets lists at most limit live packets of shard i, soonest expiry first
// (limit is clamped to 1..100). Their grabs are not listed: Packet reads them.
func (b *Budget) LivePackets(ctx context.Context, i, limit int) ([]PacketDetail, error) {
	limit = min(100, max(limit, 1))
	k := b.keys[i]
	v, err := b.call(ctx, lua.PacketLiveScript, []string{k.Meta, k.Due}, limit).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("listing budget shard %d's live packets: %w", i, err)
	}
	if len(v)%10 != 0 {
		return nil, fmt.Errorf("listing budget shard %d's live packets: %d values, want tens", i, len(v))
	}
	out := make([]PacketDetail, 0, len(v)/10)
	for j := 0; j < len(v); j += 10 {
		f := map[string]string{"snd": v[j+1], "tot": v[j+2], "cnt": v[j+3], "dst": v[j+4], "ct": v[j+5],
			"ex": v[j+6], "g": v[j+7], "r": v[j+8], "x": v[j+9]}
		d, err := decodePacket(v[j], "", f)
		if err != nil {
			return out, fmt.Errorf("listing budget shard %d: packet %s: %w", i, v[j], err)
		}
		out = append(out, d)
	}
	return out, nil
}
