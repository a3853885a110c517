package settlement

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"redpacket.io/operator/store"
)

// Allowance is what the operator seeded for an activity, the most its settlement
// may credit: its total and count and the amount of every packet, recomputed from
// the spec and status.splitSeed. With an Allowance in its Config, a worker checks
// every entry against it before delivering (activityVerifier), and the operator
// announces it to the balance system first (AnnounceAllowance). (The word
// "budget" names the RedPacketBudget kind; the wire keeps the kind "budget" for
// this announcement, and the ledger its "budget" field.)
type Allowance struct {
	// Total is the activity's total amount, Count its number of packets.
	Total, Count int64
	// Amounts are the seeded packets: packet id i+1 was seeded with Amounts[i]
	// (store.Activity.Seed numbers them so, across shards too). Its length is Count.
	Amounts []int64
	// At is when the activity was seeded; the announcement carries it, so every
	// resend of the announcement has the same body.
	At time.Time
}

// check validates the allowance.
func (b *Allowance) check() error {
	if b.Count < 1 || b.Total < 1 {
		return fmt.Errorf("budget of %d in %d packets is empty", b.Total, b.Count)
	}
	if int64(len(b.Amounts)) != b.Count {
		return fmt.Errorf("budget of %d packets lists %d amounts", b.Count, len(b.Amounts))
	}
	return nil
}

// amountOf is the seeded amount of the packet with the given id, and false when no
// packet has that id.
func (b *Allowance) amountOf(packetID string) (int64, bool) {
	id, err := strconv.ParseInt(packetID, 10, 64)
	if err != nil || id < 1 || id > int64(len(b.Amounts)) || strconv.FormatInt(id, 10) != packetID {
		return 0, false
	}
	return b.Amounts[id-1], true
}

// Reasons an entry is dead-lettered as forged: the values of the forged counter's
// "reason" label and of ForgedEntry.Reason.
const (
	// ReasonClaimMismatch: the entry is not the one its grant (or the close) wrote
	// (store.Shard.VerifyEntries).
	ReasonClaimMismatch = "claim_mismatch"
	// ReasonPacketOutOfRange: no packet of the activity has the entry's id.
	ReasonPacketOutOfRange = "packet_out_of_range"
	// ReasonAmountMismatch: the amount differs from the packet's seeded amount.
	ReasonAmountMismatch = "amount_mismatch"
	// ReasonPacketListed: the packet is still waiting in the packets list, so no
	// grab granted it.
	ReasonPacketListed = "packet_listed"
	// ReasonDuplicatePacket: the ledger credited the packet to another user already.
	ReasonDuplicatePacket = store.LedgerDuplicatePacket
	// ReasonOverBudget: the credits and the refund would exceed the total.
	ReasonOverBudget = store.LedgerOverBudget
	// ReasonOverCount: more grants than the activity has packets.
	ReasonOverCount = store.LedgerOverCount
)

// ForgedError is why an entry is not delivered but dead-lettered as forged. It
// wraps store.ErrForged.
type ForgedError struct {
	// Reason is one of the Reason* constants.
	Reason string
	// Detail says what did not match.
	Detail string
}

func (e *ForgedError) Error() string {
	return fmt.Sprintf("%v (%s): %s", store.ErrForged, e.Reason, e.Detail)
}

// Unwrap makes errors.Is(err, store.ErrForged) hold.
func (e *ForgedError) Unwrap() error { return store.ErrForged }

// ForgedEntry describes an entry dead-lettered as forged, for Config.OnForged.
type ForgedEntry struct {
	// EntryID is its stream id; Shard the shard whose stream held it.
	EntryID string
	Shard   int
	// Kind, PacketID, UserID and Amount are what it asked to credit.
	Kind, PacketID, UserID string
	Amount                 int64
	// Reason is one of the Reason* constants; Detail says what did not match.
	Reason, Detail string
}

// allowanceDelivery is the body of an activity's allowance announcement.
type allowanceDelivery struct {
	Kind        string `json:"kind"`
	Activity    string `json:"activity"`
	ActivityUID string `json:"activityUID"`
	Amount      int64  `json:"amount"`
	Count       int64  `json:"count"`
	Currency    string `json:"currency"`
	At          string `json:"at"`
}

// KindAnnouncement is the delivery kind of an announcement of what may be credited:
// an activity's allowance (AnnounceAllowance) and a RedPacketBudget's total
// (AnnounceBudgetTotal). The wire says "budget" for both, as it always has.
const KindAnnouncement = "budget"

// AllowanceIdempotencyKey is the Idempotency-Key of an activity's allowance
// announcement, "<uid>/budget".
func AllowanceIdempotencyKey(activityUID string) string { return activityUID + "/" + KindAnnouncement }

// AnnounceAllowance delivers the activity's allowance to the balance system once, signed:
// {"kind":"budget","activity","activityUID","amount":<total>,"count","currency","at"}
// with Idempotency-Key "<uid>/budget", and records in the activity's ledger that it
// was announced. An allowance recorded before is not sent again. It returns nil once
// it is recorded, an error when the delivery or Redis failed (call it again: the
// balance system dedups the key). cfg must carry an Allowance and a webhook URL.
func AnnounceAllowance(ctx context.Context, cfg Config, shards int) error {
	if cfg.Allowance == nil {
		return errors.New("announcing the budget: no budget configured")
	}
	if err := cfg.Allowance.check(); err != nil {
		return fmt.Errorf("announcing the budget: %w", err)
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return err
	}
	if cfg.WebhookURL == "" {
		return errors.New("announcing the budget: no webhook URL")
	}
	ledger := store.NewActivity(cfg.Redis, cfg.Source.UID, shards).Ledger()
	want := fmt.Sprintf("%d:%d", cfg.Allowance.Total, cfg.Allowance.Count)
	got, err := ledger.AllowanceAnnounced(ctx)
	if err != nil {
		return err
	}
	if got == "" {
		body, err := json.Marshal(allowanceDelivery{Kind: KindAnnouncement, Activity: cfg.Source.Ref(), ActivityUID: cfg.Source.UID,
			Amount: cfg.Allowance.Total, Count: cfg.Allowance.Count, Currency: cfg.Source.Currency,
			At: cfg.Allowance.At.UTC().Format(rfc3339Milli)})
		if err != nil {
			return fmt.Errorf("encoding the budget: %w", err)
		}
		if err := postBody(ctx, cfg, body, AllowanceIdempotencyKey(cfg.Source.UID)); err != nil {
			return fmt.Errorf("announcing the budget: %w", err)
		}
		if got, err = ledger.RecordAllowance(ctx, cfg.Allowance.Total, cfg.Allowance.Count); err != nil {
			return err
		}
	}
	if got != want {
		return fmt.Errorf("the ledger records a budget of %s (amount:count), not %s: the activity's figures changed after it was announced", got, want)
	}
	return nil
}

// forgedParked counts an entry just dead-lettered as forged and reports it to
// OnForged.
func (w *Worker) forgedParked(j job) {
	var fe *ForgedError
	if !errors.As(j.undeliverable, &fe) {
		return
	}
	w.m.forged.WithLabelValues(fe.Reason).Inc()
	if w.cfg.OnForged != nil {
		w.cfg.OnForged(ForgedEntry{EntryID: j.id, Shard: w.shard, Kind: j.entry.Kind, PacketID: j.entry.PacketID,
			UserID: j.entry.UserID, Amount: j.entry.Amount, Reason: fe.Reason, Detail: fe.Detail})
	}
}

// checkAllowance checks the entries that passed the claims check (forged says which
// did not) against the seeded split and decides them in the ledger, adding to
// forged why each one that fails is forged. listedFrom is the id of the first packet
// still listed on an unsharded activity (0: none listed, or not known).
func (v *activityVerifier) checkAllowance(ctx context.Context, entries []store.StreamEntry, forged map[string]error) error {
	b := v.allowance
	listedFrom := int64(0)
	if v.shards == 1 {
		// Packets are popped from the head of an unsharded activity's list in id order,
		// so every packet from the head's id on is still listed: no grant wrote it.
		head, ok, err := v.shard.FirstListedPacket(ctx)
		if err != nil {
			return err
		}
		if ok {
			listedFrom = head
		}
	}
	var decide []store.StreamEntry
	for _, e := range entries {
		if e.Malformed != nil || forged[e.ID] != nil {
			continue
		}
		if e.Kind == store.KindGrant {
			seeded, ok := b.amountOf(e.PacketID)
			switch {
			case !ok:
				forged[e.ID] = &ForgedError{Reason: ReasonPacketOutOfRange, Detail: fmt.Sprintf(
					"packet %q of %d for user %q: the activity's packets are 1 to %d", e.PacketID, e.Amount, e.UserID, b.Count)}
				continue
			case seeded != e.Amount:
				forged[e.ID] = &ForgedError{Reason: ReasonAmountMismatch, Detail: fmt.Sprintf(
					"packet %s for user %q carries %d, but it was seeded with %d", e.PacketID, e.UserID, e.Amount, seeded)}
				continue
			case listedFrom > 0 && mustParse(e.PacketID) >= listedFrom:
				forged[e.ID] = &ForgedError{Reason: ReasonPacketListed, Detail: fmt.Sprintf(
					"packet %s of %d for user %q is still listed (packets from %d on are), no grab granted it",
					e.PacketID, e.Amount, e.UserID, listedFrom)}
				continue
			}
		}
		decide = append(decide, e)
	}
	verdicts, err := v.ledger.Decide(ctx, b.Total, b.Count, decide)
	if err != nil {
		return err
	}
	recordForged(forged, decide, verdicts, func(v store.LedgerVerdict, e store.StreamEntry) string {
		switch v.Verdict {
		case store.LedgerDuplicatePacket:
			return fmt.Sprintf("%s %s of %d for user %q: it was credited to %q already", e.Kind, e.PacketID, e.Amount, e.UserID, v.CreditedTo)
		case store.LedgerOverBudget:
			return fmt.Sprintf("%s %s of %d for user %q: the credits and the refund would exceed the total of %d", e.Kind, e.PacketID, e.Amount, e.UserID, b.Total)
		case store.LedgerOverCount:
			return fmt.Sprintf("grant %s of %d for user %q: more grants than the %d packets", e.PacketID, e.Amount, e.UserID, b.Count)
		}
		return ""
	})
	return nil
}

// mustParse is the numeric id of a packet id amountOf accepted.
func mustParse(id string) int64 {
	n, _ := strconv.ParseInt(id, 10, 64)
	return n
}

// recordForged marks in forged every entry of decide whose ledger verdict (same
// index) refuses it, as a ForgedError with the verdict as its reason and detail's
// sentence, or, when detail says nothing of that verdict, the ledger's answer. It is
// how both kinds' verifiers turn the ledger's verdicts into dead letters.
func recordForged(forged map[string]error, decide []store.StreamEntry, verdicts []store.LedgerVerdict,
	detail func(store.LedgerVerdict, store.StreamEntry) string) {
	for i, v := range verdicts {
		if v.Deliver() {
			continue
		}
		e := decide[i]
		fe := &ForgedError{Reason: v.Verdict, Detail: detail(v, e)}
		if fe.Detail == "" {
			fe.Detail = fmt.Sprintf("%s %s for user %q: the ledger answered %q", e.Kind, e.PacketID, e.UserID, v.Verdict)
		}
		forged[e.ID] = fe
	}
}
