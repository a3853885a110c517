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

// Outcome is what a grab decided.
type Outcome string

// The outcomes of a grab, as the grab script returns them.
const (
	Granted        Outcome = "granted"
	AlreadyClaimed Outcome = "already_claimed"
	SoldOut        Outcome = "sold_out"
	NotStarted     Outcome = "not_started"
	Ended          Outcome = "ended"
	Paused         Outcome = "paused"
	// Missing means Redis holds no committed activity under these keys.
	Missing Outcome = "missing"
	// Fenced means the activity is fenced: its Redis came back older than what was
	// acknowledged (see grab.lua), and nothing is granted until the state is accepted.
	Fenced Outcome = "fenced"
)

// Watermark is what a caller has already seen a shard's Redis reach, within an
// epoch: its claimed count and its transfer sequence (the meta field transfer_seq,
// which every transfer step raises and nothing lowers: transfer_out.lua). A Redis
// below either has rolled back: below the claimed count it forgot grants, below the
// transfer sequence it forgot a transfer, and may list again packets that left it.
// The zero value checks nothing.
type Watermark struct {
	Epoch        int64
	ClaimedCount int64
	TransferSeq  int64
}

// Raise returns the higher of w and o: a later epoch wins whatever its figures;
// within one epoch each figure is the higher of the two.
func (w Watermark) Raise(o Watermark) Watermark {
	switch {
	case o.Epoch > w.Epoch:
		return o
	case o.Epoch < w.Epoch:
		return w
	}
	return Watermark{Epoch: w.Epoch, ClaimedCount: max(w.ClaimedCount, o.ClaimedCount), TransferSeq: max(w.TransferSeq, o.TransferSeq)}
}

// ShardMarks keeps what a caller has seen each shard of one activity reach (the grab
// service's RollbackGuard). A transfer between shards sends each shard's mark to the
// script that runs there, which fences a shard below it before it gives or takes a
// packet, and reports the transfer sequence and epoch each script answered with.
type ShardMarks interface {
	// Mark is the watermark of shard i.
	Mark(i int) Watermark
	// Saw raises the watermark of shard i to w.
	Saw(i int, w Watermark)
}

// GrabResult is the decision on one claim. PacketID and Amount are set for Granted
// and AlreadyClaimed.
type GrabResult struct {
	Outcome  Outcome
	PacketID string
	Amount   int64
	// Seen is set for Granted: the claimed_count this grant raised and its epoch, a
	// watermark Redis must never fall below again.
	Seen Watermark
}

// Grab decides one claim for userID on their home shard, which must not be below
// markOf(home) (nil checks no watermark of the caller's). With more than one shard,
// the home shard must not be below the transfer mark its siblings keep of it
// either (RecordedMark, read before every grab there, skipped when a sibling does not
// answer within siblingMarkTimeout): a home shard that came back
// from before a transfer out of it is fenced by the grab that would have granted
// again one of the packets that left it, whichever process made the transfer. When
// the home shard has run dry it refills from its siblings and tries again, so
// sold_out means no packet was left anywhere. It returns the home shard with the
// result.
func (s *Activity) Grab(ctx context.Context, userID string, markOf func(shard int) Watermark) (GrabResult, int, error) {
	h := s.Home(userID)
	home := s.shards[h]
	for {
		var mark Watermark
		if markOf != nil {
			mark = markOf(h)
		}
		if len(s.shards) > 1 {
			mctx, cancel := context.WithTimeout(ctx, siblingMarkTimeout)
			kept, err := s.RecordedMark(mctx, h)
			cancel()
			switch {
			case err == nil:
				mark = mark.Raise(kept)
			case errors.Is(err, errCorruptMark) || ctx.Err() != nil:
				return GrabResult{}, h, fmt.Errorf("the siblings' transfer marks of shard %d: %w", h, err)
			default:
				// A sibling's master does not answer (down, failing over): the grab goes
				// on with the marks this process learnt before (markOf, which every
				// earlier read raised). What that leaves open is a home shard that came
				// back from before a transfer while the sibling holding its record is
				// out at the same moment: two masters failing at once.
			}
		}
		r, err := home.GrabAbove(ctx, userID, mark)
		if err != nil || r.Outcome != SoldOut || len(s.shards) == 1 || s.recentlySoldOut() {
			return r, h, err
		}
		refilled, err := s.Refill(ctx, h)
		if err != nil {
			return GrabResult{}, h, fmt.Errorf("refilling shard %d: %w", h, err)
		}
		if !refilled {
			return r, h, nil
		}
	}
}

// recentlySoldOut reports whether a steady reading found nothing within soldOutFor.
func (s *Activity) recentlySoldOut() bool {
	at := s.soldOutAt.Load()
	return at != 0 && time.Since(time.Unix(0, at)) < soldOutFor
}

// soldOutFor is how long a steady reading that found no packet anywhere answers for
// the grabs that follow it.
const soldOutFor = time.Second

// Grab decides one claim for userID (grab.lua), checking no watermark. The user id
// travels as an ARGV, never a KEY.
func (a *Shard) Grab(ctx context.Context, userID string) (GrabResult, error) {
	return a.grabCall.grab(ctx, a, userID, Watermark{})
}

// GrabAbove decides one claim for userID on a Redis that must not be below mark: a
// Redis that rolled back below it is fenced and the answer is Fenced (grab.lua).
func (a *Shard) GrabAbove(ctx context.Context, userID string, mark Watermark) (GrabResult, error) {
	return a.grabCall.grab(ctx, a, userID, mark)
}

// grabCall is the grab function's FCALL on one activity's keys, with what never
// changes between grabs (the command, the function's name, the key count and the
// four keys) boxed once: Activity keeps one, since the claim path sends one per grab
// and boxing those six arguments anew each time was a tenth of its client's CPU.
type grabCall struct {
	keys []string
	head [7]any
}

func newGrabCall(k Keys) *grabCall {
	g := &grabCall{keys: []string{k.Meta, k.Packets, k.Claims, k.Stream}}
	g.head = [7]any{"fcall", lua.GrabScript.Function(), len(g.keys), k.Meta, k.Packets, k.Claims, k.Stream}
	return g
}

// commandProcessor is what every go-redis client, pipeline and auto-pipeliner
// offers: a command built by the caller, routed by its first key.
type commandProcessor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// grab calls the grab function for userID, with mark as ARGV[2] and ARGV[3] unless
// it is the zero watermark, which checks nothing either way, and its transfer
// sequence as ARGV[4] when there is one (grab.lua). It never falls back to EVAL: a
// server without the function library fails the call (the grab service answers
// 503), and only a handle of the operator's restores it.
func (g *grabCall) grab(ctx context.Context, a *Shard, userID string, mark Watermark) (GrabResult, error) {
	n := len(g.head) + 1
	if mark != (Watermark{}) {
		n += 2
		if mark.TransferSeq > 0 {
			n++
		}
	}
	args := make([]any, n)
	copy(args, g.head[:])
	args[len(g.head)] = userID
	if mark != (Watermark{}) {
		args[len(g.head)+1], args[len(g.head)+2] = mark.ClaimedCount, mark.Epoch
		if mark.TransferSeq > 0 {
			args[len(g.head)+3] = mark.TransferSeq
		}
	}
	var cmd *redis.Cmd
	if p, ok := a.c.(commandProcessor); ok && !a.restores {
		cmd = redis.NewCmd(ctx, args...)
		cmd.SetFirstKeyPos(3)
		_ = p.Process(ctx, cmd)
	} else {
		cmd = a.call(ctx, lua.GrabScript, g.keys, args[len(g.head):]...)
	}
	reply, err := cmd.Result()
	if err != nil {
		return GrabResult{}, fmt.Errorf("grab script: %w", functionErr(err))
	}
	res, err := decodeGrab(reply)
	if err != nil {
		return GrabResult{}, fmt.Errorf("grab script: %w", err)
	}
	return res, nil
}

// decodeGrab reads the grab script's reply: for a grant one string (decodeGrant);
// otherwise a list,
// {already_claimed, "<packetId>:<amount>:<entryId>"} (the user's claim as stored) or
// {outcome} alone. The script hands the packet, the claim and the counters on as
// strings and they are split here, off the server.
func decodeGrab(reply any) (GrabResult, error) {
	if grant, ok := reply.(string); ok {
		return decodeGrant(grant)
	}
	vals, ok := reply.([]any)
	if !ok || len(vals) == 0 {
		return GrabResult{}, fmt.Errorf("reply %v (%T) is neither a grant nor an outcome", reply, reply)
	}
	outcome, ok := vals[0].(string)
	if !ok {
		return GrabResult{}, fmt.Errorf("outcome is %T, not a string", vals[0])
	}
	res := GrabResult{Outcome: Outcome(outcome)}
	switch res.Outcome {
	case Granted:
		return GrabResult{}, errors.New("a grant answered as a list")
	case AlreadyClaimed:
		if len(vals) != 2 {
			return GrabResult{}, fmt.Errorf("%d values in already_claimed, want 2", len(vals))
		}
		raw, _ := vals[1].(string)
		c, ok := parseClaim(raw)
		if !ok {
			return GrabResult{}, fmt.Errorf("claim %q is not <packetId>:<amount>:<entryId>", raw)
		}
		res.PacketID, res.Amount = c.PacketID, c.Amount
	default:
		if len(vals) != 1 {
			return GrabResult{}, fmt.Errorf("%d values in outcome %q, want 1", len(vals), outcome)
		}
	}
	return res, nil
}

// decodeGrant reads a grant,
// "<packetId>:<amount>@<countBefore>:<amountBefore>:<epoch>:<currency>": the packet
// as it was listed, then the gate's epoch and currency. The count this grant raised,
// the caller's next watermark, is countBefore + 1.
func decodeGrant(v string) (GrabResult, error) {
	bad := func(what string) (GrabResult, error) {
		return GrabResult{}, fmt.Errorf("grant %q is not <packetId>:<amount>@<countBefore>:<amountBefore>:<epoch>:<currency>: %s", v, what)
	}
	packet, rest, ok := strings.Cut(v, "@")
	if !ok {
		return bad("no '@'")
	}
	id, amount, ok := strings.Cut(packet, ":")
	if !ok || id == "" {
		return bad("no packet id")
	}
	// The fields are cut one by one (no slice of them is allocated: this runs once
	// per grant); the currency, last, may itself hold ':'.
	var fields [4]string
	fields[0] = amount
	for i := 1; i < 4; i++ {
		var ok bool
		if fields[i], rest, ok = strings.Cut(rest, ":"); !ok {
			return bad("too few fields")
		}
	}
	var nums [4]int64
	for i, f := range fields {
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil || n < 0 {
			return bad(fmt.Sprintf("%q is not a non-negative integer", f))
		}
		nums[i] = n
	}
	return GrabResult{Outcome: Granted, PacketID: id, Amount: nums[0],
		Seen: Watermark{ClaimedCount: nums[1] + 1, Epoch: nums[3]}}, nil
}
