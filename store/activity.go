package store

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
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

// Watermark is what a caller has already seen an activity's Redis reach: the
// claimed_count, within an epoch. A Redis below it has rolled back. The zero value
// checks nothing.
type Watermark struct {
	Epoch        int64
	ClaimedCount int64
}

// Raise returns the higher of w and o: a later epoch wins whatever its count.
func (w Watermark) Raise(o Watermark) Watermark {
	if o.Epoch > w.Epoch || (o.Epoch == w.Epoch && o.ClaimedCount > w.ClaimedCount) {
		return o
	}
	return w
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

// grabCall is the grab script's EVALSHA on one activity's keys, with what never
// changes between grabs (the command, the digest, the key count and the four keys)
// boxed once: Activity keeps one, since the claim path sends one per grab and
// boxing those six arguments anew each time was a tenth of its client's CPU.
type grabCall struct {
	keys []string
	head [7]any
}

func newGrabCall(k Keys) *grabCall {
	g := &grabCall{keys: []string{k.Meta, k.Packets, k.Claims, k.Stream}}
	g.head = [7]any{"evalsha", lua.GrabScript.SHA(), len(g.keys), k.Meta, k.Packets, k.Claims, k.Stream}
	return g
}

// commandProcessor is what every go-redis client, pipeline and auto-pipeliner
// offers: a command built by the caller, routed by its first key.
type commandProcessor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// grab sends the grab script for userID, with mark as ARGV[2] and ARGV[3] unless
// it is the zero watermark, which checks nothing either way (grab.lua), and falls
// back to EVAL on NOSCRIPT as Script.Run does.
func (g *grabCall) grab(ctx context.Context, c redis.Scripter, userID string, mark Watermark) (GrabResult, error) {
	n := len(g.head) + 1
	if mark != (Watermark{}) {
		n += 2
	}
	args := make([]any, n)
	copy(args, g.head[:])
	args[len(g.head)] = userID
	if mark != (Watermark{}) {
		args[len(g.head)+1], args[len(g.head)+2] = mark.ClaimedCount, mark.Epoch
	}
	argv := args[len(g.head):]
	var cmd *redis.Cmd
	if p, ok := c.(commandProcessor); ok {
		cmd = redis.NewCmd(ctx, args...)
		cmd.SetFirstKeyPos(3)
		_ = p.Process(ctx, cmd)
		if lua.IsNoScript(cmd.Err()) {
			cmd = c.Eval(ctx, lua.GrabScript.Source(), g.keys, argv...)
		}
	} else {
		cmd = lua.GrabScript.Run(ctx, c, g.keys, argv...)
	}
	reply, err := cmd.Result()
	if err != nil {
		return GrabResult{}, fmt.Errorf("grab script: %w", err)
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

// SeedParams are the activity's facts written at commit.
type SeedParams struct {
	Count   int64
	Total   int64
	StartMs int64
	EndMs   int64
	Paused  bool
	Sponsor string
	// Currency is recorded in every settlement entry.
	Currency string
}

// DefaultChunkSize is how many packets one staging call appends.
const DefaultChunkSize = 10000

// Seeder writes an activity's packets into Redis exactly once: it appends them to a
// staging list in chunks (each chunk lands once, at its offset, even when the seeder
// is retried or runs twice at the same time) and then commits the complete list in
// one atomic step guarded by the activity's marker.
type Seeder struct {
	// ChunkSize is how many packets one staging call appends; 0 means DefaultChunkSize.
	ChunkSize int
	// AfterChunk, when set, runs after each staged chunk with the staged length. An
	// error stops seeding there, as a crash would.
	AfterChunk func(staged int64) error
	// ScriptOnly stages every chunk through seed_stage.lua, never with the
	// optimistic transaction (stageDirect); for tests of the script.
	ScriptOnly bool
	// IDStride and IDOffset number the packets: packet i (from 0) gets the id
	// i*IDStride + IDOffset + 1. The zero values number them 1, 2, 3, ...; shard k of
	// n gets stride n and offset k, so ids stay unique across an activity's shards.
	IDStride, IDOffset int64
}

// packetID is the id of the i-th packet (from 0) this seeder stages.
func (s Seeder) packetID(i int64) int64 {
	stride := s.IDStride
	if stride <= 0 {
		stride = 1
	}
	return i*stride + s.IDOffset + 1
}

// SeedResult says what Seed did.
type SeedResult struct {
	// Committed is true when this call committed the activity, false when it had
	// been committed before (the existing data is adopted untouched).
	Committed bool
}

// seed stages amounts (packet i+1 gets amounts[i]) on the shard whose keys are k and
// commits them. amounts must be positive and sum to p.Total, with len(amounts) ==
// p.Count.
func (s Seeder) seed(ctx context.Context, c redis.Scripter, k Keys, amounts []int64, p SeedParams) (SeedResult, error) {
	if err := checkSplit(amounts, p); err != nil {
		return SeedResult{}, err
	}
	chunk := s.ChunkSize
	if chunk <= 0 {
		chunk = DefaultChunkSize
	}

	fp := fingerprint(amounts)
	// Ask where staging stands with an empty chunk at offset -1, which never matches.
	staged, err := s.stage(ctx, c, k, -1, fp, nil)
	if err != nil {
		return SeedResult{}, err
	}
	sums := prefixSums{amounts: amounts}
	for staged >= 0 && staged < p.Count {
		end := min(staged+int64(chunk), p.Count)
		args := make([]any, 0, end-staged+2)
		args = append(args, staged, fp)
		before := sums.upTo(staged)
		for i := staged; i < end; i++ {
			args = append(args, packetEntry(s.packetID(i), amounts[i], i, before))
			before += amounts[i]
		}
		next, err := s.stageChunk(ctx, c, k, staged, fp, args)
		if err != nil {
			return SeedResult{}, err
		}
		staged = next
		if s.AfterChunk != nil && staged >= 0 {
			if err := s.AfterChunk(staged); err != nil {
				return SeedResult{}, err
			}
		}
	}
	if staged > p.Count {
		return SeedResult{}, fmt.Errorf("seeding: staging holds %d packets, more than the %d declared", staged, p.Count)
	}
	paused := "0"
	if p.Paused {
		paused = "1"
	}
	n, err := lua.SeedCommitScript.Run(ctx, c, []string{k.Meta, k.Staging, k.Packets},
		p.Count, p.Total, p.StartMs, p.EndMs, paused, p.Sponsor, p.Currency).Int64()
	if err != nil {
		return SeedResult{}, fmt.Errorf("seed commit: %w", err)
	}
	return SeedResult{Committed: n == 1}, nil
}

// checkSplit checks that amounts are p.Count positive amounts summing to p.Total.
func checkSplit(amounts []int64, p SeedParams) error {
	if int64(len(amounts)) != p.Count {
		return fmt.Errorf("seeding: %d packets, want %d", len(amounts), p.Count)
	}
	var sum int64
	for i, a := range amounts {
		if a <= 0 {
			return fmt.Errorf("seeding: packet %d has amount %d", i+1, a)
		}
		sum += a
	}
	if sum != p.Total {
		return fmt.Errorf("seeding: packets sum to %d, want %d", sum, p.Total)
	}
	return nil
}

// packetEntry is a packet as the packets list holds it,
// "<id>:<amount>@<countBefore>:<amountBefore>": the packets and the money claimed
// from the list before it, which the seeder, numbering the list from its head, gives
// as the packets ahead of it (see grab.lua: the head's numbers are the claimed count
// and amount, so no grab reads or raises a counter).
func packetEntry(id, amount, countBefore, amountBefore int64) string {
	b := make([]byte, 0, 48)
	b = strconv.AppendInt(b, id, 10)
	b = append(b, ':')
	b = strconv.AppendInt(b, amount, 10)
	b = append(b, '@')
	b = strconv.AppendInt(b, countBefore, 10)
	b = append(b, ':')
	b = strconv.AppendInt(b, amountBefore, 10)
	return string(b)
}

// prefixSums reads sums of amounts[:n] for n that mostly grow, as staging's offset
// does, in one pass over the amounts.
type prefixSums struct {
	amounts []int64
	n, sum  int64
}

// upTo returns the sum of amounts[:n].
func (p *prefixSums) upTo(n int64) int64 {
	if n < p.n {
		p.n, p.sum = 0, 0
	}
	for ; p.n < n; p.n++ {
		p.sum += p.amounts[p.n]
	}
	return p.sum
}

// stageChunk appends one chunk (args: the offset and fingerprint, then the packets)
// with a plain RPUSH in an optimistic transaction when the client can run one
// (stageDirect), and through seed_stage.lua otherwise, or when staging holds another
// split.
func (s Seeder) stageChunk(ctx context.Context, c redis.Scripter, k Keys, offset int64, fp string, args []any) (int64, error) {
	if w, ok := c.(watcher); ok && !s.ScriptOnly {
		n, err := stageDirect(ctx, w, k, offset, fp, args[2:])
		if !errors.Is(err, errStageByScript) {
			return n, err
		}
	}
	return s.stage(ctx, c, k, offset, fp, args)
}

// stage runs one staging call; args is the offset and fingerprint followed by the
// chunk's entries.
func (s Seeder) stage(ctx context.Context, c redis.Scripter, k Keys, offset int64, fp string, args []any) (int64, error) {
	if args == nil {
		args = []any{offset, fp}
	}
	n, err := lua.SeedStageScript.Run(ctx, c, []string{k.Meta, k.Staging}, args...).Int64()
	if err != nil {
		return 0, fmt.Errorf("seed stage at %d: %w", offset, err)
	}
	return n, nil
}

// fingerprint identifies a split by its amounts, so staging never mixes two splits.
func fingerprint(amounts []int64) string {
	h := sha256.New()
	buf := make([]byte, 8)
	for _, a := range amounts {
		binary.LittleEndian.PutUint64(buf, uint64(a))
		h.Write(buf)
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// ConfigureResult says what Configure found: the state afterwards, and whether Redis
// holds the activity at all (when it does not, nothing was written). Fenced is true
// when the activity is fenced after a rollback: nothing was written either.
type ConfigureResult struct {
	State  State
	Found  bool
	Fenced bool
}

// Settings are what configure.lua writes: the schedule, the pause flag, whether to
// open a ready activity, and the payee of the refund and the currency of later
// settlement entries (both kept as they are when Sponsor is empty).
type Settings struct {
	StartMs, EndMs int64
	Paused, Open   bool
	Sponsor        string
	Currency       string
}

// configure writes the settings on one shard (configure.lua).
func configure(ctx context.Context, c redis.Scripter, k Keys, st Settings) (ConfigureResult, error) {
	args := []any{st.StartMs, st.EndMs, boolArg(st.Paused), boolArg(st.Open)}
	if st.Sponsor != "" {
		args = append(args, st.Sponsor, st.Currency)
	}
	state, err := lua.ConfigureScript.Run(ctx, c, []string{k.Meta}, args...).Text()
	if err != nil {
		return ConfigureResult{}, fmt.Errorf("configure script: %w", err)
	}
	switch state {
	case string(Missing):
		return ConfigureResult{}, nil
	case string(Fenced):
		return ConfigureResult{Found: true, Fenced: true}, nil
	}
	return ConfigureResult{State: State(state), Found: true}, nil
}

// fence stops one shard after a rollback (fence.lua) and returns the fence's
// reason, the first one written; "" when Redis does not hold the activity.
func fence(ctx context.Context, c redis.Scripter, k Keys, why string) (string, error) {
	got, err := lua.FenceScript.Run(ctx, c, []string{k.Meta}, why).Text()
	if err != nil {
		return "", fmt.Errorf("fence script: %w", err)
	}
	if got == string(Missing) {
		return "", nil
	}
	return got, nil
}

// ErrEpochMoved is returned by Accept when Redis is no longer at the epoch the
// caller decided on.
var ErrEpochMoved = errors.New("the activity's Redis epoch moved since it was read")

// accept lifts one shard's fence and starts a new epoch there (accept.lua), provided
// it is still at epoch seen. It returns the new epoch.
func accept(ctx context.Context, c redis.Scripter, k Keys, seen int64) (int64, error) {
	n, err := lua.AcceptScript.Run(ctx, c, []string{k.Meta}, seen).Int64()
	if err != nil {
		return 0, fmt.Errorf("accept script: %w", err)
	}
	switch n {
	case -1:
		return 0, ErrMissing
	case -2:
		return 0, ErrEpochMoved
	}
	return n, nil
}

// CloseReason is why an activity closed.
type CloseReason string

// The reasons an activity closes.
const (
	CloseExpired   CloseReason = "expired"
	CloseExhausted CloseReason = "exhausted"
)

// CloseOutcome is what a close did.
type CloseOutcome string

// The outcomes of a close.
const (
	// Closed: the activity is closed (now or by an earlier close, whose figures are
	// returned).
	Closed CloseOutcome = "closed"
	// CloseStillOpen: exhausted was asked for while packets remain; nothing changed.
	CloseStillOpen CloseOutcome = "open"
	// CloseMissing: Redis does not hold the activity.
	CloseMissing CloseOutcome = "missing"
	// CloseFenced: the activity is fenced after a rollback; nothing changed.
	CloseFenced CloseOutcome = "fenced"
)

// CloseResult says what Close found or did.
type CloseResult struct {
	Outcome CloseOutcome
	// Reason is why the activity closed.
	Reason CloseReason
	// Refunded is the unclaimed remainder handed to the sponsor.
	Refunded int64
}

// closeShard runs close.lua on one shard: it ends grabbing there for good and records
// the claimed amount, writing no refund (the activity's one refund is
// refund_activity's, Activity.Close).
func closeShard(ctx context.Context, c redis.Scripter, k Keys, reason CloseReason) (CloseResult, error) {
	vals, err := lua.CloseScript.Run(ctx, c, []string{k.Meta, k.Packets}, string(reason)).Slice()
	if err != nil {
		return CloseResult{}, fmt.Errorf("close script: %w", err)
	}
	if len(vals) != 2 {
		return CloseResult{}, fmt.Errorf("close script: %d values in reply, want 2", len(vals))
	}
	res, _ := vals[0].(string)
	why, _ := vals[1].(string)
	return CloseResult{Outcome: CloseOutcome(res), Reason: CloseReason(why)}, nil
}

// Snapshot is every counter of an activity read at one instant.
type Snapshot struct {
	// State is StateReady, StateOpen, StateClosed, or "" when Redis lacks the activity.
	State          State
	Paused         bool
	Total          int64
	Count          int64
	ClaimedCount   int64
	ClaimedAmount  int64
	Refunded       int64
	SettledCount   int64
	SettledAmount  int64
	RefundSettled  int64
	DeadCount      int64
	RemainingCount int64
	StagedCount    int64
	CloseReason    CloseReason
	StartMs        int64
	EndMs          int64
	SeededMs       int64
	Sponsor        string
	Currency       string
	// Fenced is the fence's reason when the activity is fenced after a rollback.
	Fenced string
	// Epoch counts the rollbacks accepted by an operator (0 before any).
	Epoch int64

	// Shard 0 of a sharded activity also holds the activity's own count and total,
	// and once every shard closed, its one refund (shards.go).
	activityCount, activityTotal, activityRefund int64
	activityReason                               CloseReason
	activityRefunded                             bool
	// partlyFenced is true when some shards of a sharded activity are fenced and
	// others not yet.
	partlyFenced bool
}

// FullyFenced reports whether the activity is fenced everywhere: Fenced is set and,
// for a sharded activity, every shard is fenced. A fence found on one shard must be
// spread to the others (Fence), so that no shard grants while one rolled back.
func (s Snapshot) FullyFenced() bool { return s.Fenced != "" && !s.partlyFenced }

// Watermark is the snapshot's claimed count within its epoch.
func (s Snapshot) Watermark() Watermark {
	return Watermark{Epoch: s.Epoch, ClaimedCount: s.ClaimedCount}
}

// Exists reports whether Redis holds the committed activity.
func (s Snapshot) Exists() bool { return s.State != "" }

// RemainingAmount is the money neither claimed nor refunded.
func (s Snapshot) RemainingAmount() int64 { return s.Total - s.ClaimedAmount - s.Refunded }

// readSnapshot reads every counter of one shard at one instant. The script
// returns the meta hash's fields by name; each is decoded by its name (fields the
// snapshot does not know, such as the staging fingerprint, are skipped), so the
// order of fields in Redis or in the script means nothing.
func readSnapshot(ctx context.Context, c redis.Scripter, k Keys) (Snapshot, error) {
	vals, err := lua.SnapshotScript.Run(ctx, c, []string{k.Meta, k.Packets, k.Staging, k.Claims}).StringSlice()
	if err != nil {
		return Snapshot{}, fmt.Errorf("snapshot script: %w", err)
	}
	return decodeSnapshot(vals)
}

// snapshotInts are the snapshot's integer fields by meta field name.
var snapshotInts = map[string]func(*Snapshot) *int64{
	fieldTotal:          func(s *Snapshot) *int64 { return &s.Total },
	fieldCount:          func(s *Snapshot) *int64 { return &s.Count },
	fieldClaimedCount:   func(s *Snapshot) *int64 { return &s.ClaimedCount },
	fieldClaimedAmount:  func(s *Snapshot) *int64 { return &s.ClaimedAmount },
	fieldRefunded:       func(s *Snapshot) *int64 { return &s.Refunded },
	fieldSettledCount:   func(s *Snapshot) *int64 { return &s.SettledCount },
	fieldSettledAmount:  func(s *Snapshot) *int64 { return &s.SettledAmount },
	fieldRefundSettled:  func(s *Snapshot) *int64 { return &s.RefundSettled },
	fieldDeadCount:      func(s *Snapshot) *int64 { return &s.DeadCount },
	fieldStartMs:        func(s *Snapshot) *int64 { return &s.StartMs },
	fieldEndMs:          func(s *Snapshot) *int64 { return &s.EndMs },
	fieldSeededMs:       func(s *Snapshot) *int64 { return &s.SeededMs },
	fieldEpoch:          func(s *Snapshot) *int64 { return &s.Epoch },
	fieldRemainingCount: func(s *Snapshot) *int64 { return &s.RemainingCount },
	fieldStagedCount:    func(s *Snapshot) *int64 { return &s.StagedCount },
	fieldActivityCount:  func(s *Snapshot) *int64 { return &s.activityCount },
	fieldActivityTotal:  func(s *Snapshot) *int64 { return &s.activityTotal },
	fieldActivityRefund: func(s *Snapshot) *int64 {
		s.activityRefunded = true
		return &s.activityRefund
	},
}

// decodeSnapshot decodes the snapshot script's flat list of names and values.
func decodeSnapshot(vals []string) (Snapshot, error) {
	if len(vals)%2 != 0 {
		return Snapshot{}, fmt.Errorf("snapshot script: %d values in reply, want name/value pairs", len(vals))
	}
	var snap Snapshot
	for i := 0; i < len(vals); i += 2 {
		name, v := vals[i], vals[i+1]
		switch name {
		case fieldState:
			snap.State = State(v)
		case fieldCloseReason:
			snap.CloseReason = CloseReason(v)
		case fieldSponsor:
			snap.Sponsor = v
		case fieldCurrency:
			snap.Currency = v
		case fieldFenced:
			snap.Fenced = v
		case fieldActivityReason:
			snap.activityReason = CloseReason(v)
		case fieldPaused:
			snap.Paused = v == "1"
		default:
			field, ok := snapshotInts[name]
			if !ok {
				continue
			}
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return Snapshot{}, fmt.Errorf("snapshot script: field %s = %q: %w", name, v, err)
			}
			*field(&snap) = n
		}
	}
	return snap, nil
}

// Settlement entry kinds.
const (
	KindGrant  = "grant"
	KindRefund = "refund"
)

// ack acknowledges a delivered stream entry and counts it as settled. It returns
// false when the entry had been acknowledged before, so nothing is counted twice.
func ack(ctx context.Context, c redis.Scripter, k Keys, group, entryID, kind string, amount int64) (bool, error) {
	n, err := lua.SettleAckScript.Run(ctx, c, []string{k.Meta, k.Stream}, group, entryID, kind, amount).Int64()
	if err != nil {
		return false, fmt.Errorf("settle ack of %s: %w", entryID, err)
	}
	return n == 1, nil
}

// deadLetter parks an undeliverable entry with its fields and the last error. It
// returns false when the entry had been acknowledged before.
func deadLetter(ctx context.Context, c redis.Scripter, k Keys, group, entryID, lastErr string, fields map[string]any) (bool, error) {
	args := []any{group, entryID, lastErr}
	for f, v := range fields {
		args = append(args, f, v)
	}
	n, err := lua.DeadLetterScript.Run(ctx, c, []string{k.Meta, k.Stream, k.DeadLetters}, args...).Int64()
	if err != nil {
		return false, fmt.Errorf("dead-letter of %s: %w", entryID, err)
	}
	return n == 1, nil
}

// purge deletes every key of one shard with UNLINK: the memory of a large
// activity (millions of packets and claims) is freed off the event loop, so a shared
// Redis does not stall while it goes.
func purge(ctx context.Context, c redis.Cmdable, k Keys) error {
	// One UNLINK per key keeps cluster clients happy whatever their slot checks.
	for _, key := range k.All() {
		if err := c.Unlink(ctx, key).Err(); err != nil {
			return fmt.Errorf("deleting %s: %w", key, err)
		}
	}
	return nil
}

// purgeKeepingUnsettled deletes one shard's keys except its settlement stream and
// dead-letter stream, which still record claims and refunds that were never
// credited; those two are kept for retention, then expire. It returns the keys kept.
func purgeKeepingUnsettled(ctx context.Context, c redis.Cmdable, k Keys, retention time.Duration) ([]string, error) {
	for _, key := range []string{k.Meta, k.Staging, k.Packets, k.Claims, k.Transfers, k.Applied} {
		if err := c.Unlink(ctx, key).Err(); err != nil {
			return nil, fmt.Errorf("deleting %s: %w", key, err)
		}
	}
	var kept []string
	for _, key := range []string{k.Stream, k.DeadLetters} {
		ok, err := c.Expire(ctx, key, retention).Result()
		if err != nil {
			return nil, fmt.Errorf("setting the retention of %s: %w", key, err)
		}
		if ok {
			kept = append(kept, key)
		}
	}
	return kept, nil
}

// ErrMissing is returned by callers that need a committed activity and find none.
var ErrMissing = errors.New("activity not found in Redis")

func boolArg(b bool) string {
	if b {
		return "1"
	}
	return "0"
}
