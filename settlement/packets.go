package settlement

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"redpacket.io/operator/store"
)

// Settlement of a RedPacketBudget's runtime packets (docs/budgets.md).
//
// The same Worker delivers a budget's shard streams: the same consumer group,
// retries, hedges, dead letters and signing. Only the check before delivery differs.
// An activity's entries are checked against its seeded split; a budget's packets are
// created at runtime, and each one's creation record, which packet_create appends to
// the stream before any grant of it, is what its entries are checked against: the
// budget's ledger (store.BudgetLedger) books the record as the packet's account
// (nothing is delivered for it) and then credits each key ("<packetId>/<share>",
// "<packetId>/refund") with one body at most (user, amount, time), each share for the
// amount its account records, the refund to the sender, never past the packet's
// total, and the grants and refunds together never beyond the budget total announced
// to the balance system (AnnounceBudgetTotal). The balance system applies the same
// bound to the budget's UID as a whole.
//
// Deliveries carry the budget as the activity fields: "activity" is
// "<namespace>/<name>" of the RedPacketBudget, "activityUID" its UID, and "source"
// is "budget" (SourceBudget), so the Idempotency-Keys are "<uid>/<packetId>/<share>"
// and "<uid>/<packetId>/refund".

// SourceBudget is the "source" of the deliveries and announcements of a
// RedPacketBudget. An activity's deliveries have no "source".
const SourceBudget = "budget"

// Reasons a budget's entry is dead-lettered as forged, besides ReasonDuplicatePacket
// and ReasonOverBudget.
const (
	// ReasonMalformed: the entry's fields are not a grant or a refund.
	ReasonMalformed = "malformed"
	// ReasonPacketIDMalformed: the packet id is not "<packetId>/<share>" for a grant,
	// "<packetId>/refund" for a refund, with a packet id a creation accepts and a share
	// below the budget's maxCount.
	ReasonPacketIDMalformed = "packet_id_malformed"
	// ReasonStaleEntry: the entry is older than the ledger remembers its packet for
	// (store.BudgetLedger's retention less the longest time to live), so it cannot be
	// told whether it was credited before. Pay it by hand after checking.
	ReasonStaleEntry = "stale_entry"
	// ReasonPacketUnknown: the entry names a packet that was never created: neither
	// its hash nor its tombstone is in Redis (store.ErrPacketUnknown), or the ledger
	// booked no creation record of it (store.LedgerPacketUnknown). It takes nothing
	// of the budget's total.
	ReasonPacketUnknown = "packet_unknown"
)

// Packets is what a worker of a RedPacketBudget knows about its packets. Set it in
// Config.Packets (and leave Config.Allowance nil) and make the workers with
// NewBudgetWorkers.
type Packets struct {
	// MaxCount is the budget's spec.packets.maxCount: a share index must be below it.
	// 0 means store's bound (a share index below 1,000,000).
	MaxCount int64
	// MaxTTL is the budget's longest packet time to live; 0 means a day.
	MaxTTL time.Duration
	// LedgerRetention is how long the ledger keeps a packet after its last credit;
	// 0 means store.DefaultPacketLedgerRetention. It must exceed MaxTTL, and may not
	// exceed the default: the tombstones of packets that expired fully grabbed are
	// kept for store.GrabbedTombstoneRetention, sized by the default.
	LedgerRetention time.Duration
}

// Defaults of Packets.
const (
	defaultPacketMaxTTL   = 24 * time.Hour
	defaultMaxShareIndex  = 1_000_000
	maxPacketLedgerMargin = time.Hour
)

// withDefaults fills in the defaults and checks p.
func (p Packets) withDefaults() (Packets, error) {
	if p.MaxCount <= 0 {
		p.MaxCount = defaultMaxShareIndex
	}
	if p.MaxTTL <= 0 {
		p.MaxTTL = defaultPacketMaxTTL
	}
	if p.LedgerRetention <= 0 {
		p.LedgerRetention = store.DefaultPacketLedgerRetention
	}
	if p.LedgerRetention < p.MaxTTL+maxPacketLedgerMargin {
		return p, fmt.Errorf("packets: the ledger retention %s must exceed the longest time to live %s by %s",
			p.LedgerRetention, p.MaxTTL, maxPacketLedgerMargin)
	}
	if p.LedgerRetention > store.DefaultPacketLedgerRetention {
		return p, fmt.Errorf("packets: the ledger retention %s is longer than %s, which the tombstones of packet ids are sized by",
			p.LedgerRetention, store.DefaultPacketLedgerRetention)
	}
	return p, nil
}

// packetsCheck is a budget worker's check before delivery and its step after.
type packetsCheck struct {
	cfg    Packets
	budget *store.Budget
	ledger *store.BudgetLedger
	// forget deletes expired packets once their refunds were delivered, after the
	// balance system's 2xx and before the acknowledgement, so a crash between the two
	// leaves the entry pending: it is delivered again (the balance system dedups the
	// key) and the packet forgotten again (which is idempotent) before it is
	// acknowledged. Forgetting leaves a tombstone kept for the ledger's retention, so
	// the id names no second packet while the ledger remembers this one's keys. The
	// errors are by packet, in order (store.Budget.ForgetPacket).
	forget func(ctx context.Context, packetIDs []string, keep time.Duration) []error
	now    func() time.Time
	// knownSince is the ledger's KnownSince, read once (under mu: the budget's
	// workers share the check): entries written since then of a packet without hash
	// or tombstone are ReasonPacketUnknown.
	mu         sync.Mutex
	knownSince time.Time
}

// NewBudgetWorkers checks cfg and returns one worker per budget shard of b, each
// delivering shard i's stream (b.Stream(i)) under one set of metrics, with
// the budget's check before delivery (checkPackets). cfg must carry Packets and no
// Budget.
func NewBudgetWorkers(cfg Config, b *store.Budget) ([]*Worker, error) {
	if cfg.Packets == nil {
		return nil, errors.New("settlement config: a budget's workers need Packets")
	}
	if cfg.Allowance != nil {
		return nil, errors.New("settlement config: a budget's workers take Packets, not an activity's Budget")
	}
	if cfg.Source.UID != b.UID() {
		return nil, fmt.Errorf("settlement config: UID %q, but the budget's is %q", cfg.Source.UID, b.UID())
	}
	if cfg.Source.Kind != SourceKindBudget {
		return nil, fmt.Errorf("settlement config: a budget's workers need a source of kind %s, not %q", SourceKindBudget, cfg.Source.Kind)
	}
	ownTransport := cfg.HTTPClient == nil || cfg.HTTPClient.Transport == nil
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	p, err := cfg.Packets.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("settlement config: %w", err)
	}
	m, err := newMetrics(cfg.Registerer, cfg.Source.Ref())
	if err != nil {
		return nil, err
	}
	check := &packetsCheck{cfg: p, budget: b, ledger: b.SettlementLedger(p.LedgerRetention), forget: b.ForgetPackets, now: time.Now}
	ws := make([]*Worker, b.N())
	for i := range ws {
		ws[i] = newWorker(cfg, m, b.Stream(i), check, ownTransport && i == 0)
		ws[i].shard = i
	}
	return ws, nil
}

// BudgetIdempotencyKeyOf is the Idempotency-Key of the announcement of a budget's
// total: "<uid>/budget:<total>". A packet id has no ':' and every packet's key has a
// share after it, so no credit's key is ever one of these.
func BudgetIdempotencyKeyOf(budgetUID string, total int64) string {
	return budgetUID + "/" + KindAnnouncement + ":" + strconv.FormatInt(total, 10)
}

// budgetTotalDelivery is the body of a budget total's announcement.
type budgetTotalDelivery struct {
	Kind        string `json:"kind"`
	Source      string `json:"source"`
	Activity    string `json:"activity"`
	ActivityUID string `json:"activityUID"`
	Amount      int64  `json:"amount"`
	Currency    string `json:"currency"`
	At          string `json:"at"`
}

// AnnounceBudgetTotal makes sure the balance system was told the budget's total
// before anything beyond the previous one is credited:
// {"kind":"budget","source":"budget","activity","activityUID","amount":<total>,
// "currency","at"}, signed, with Idempotency-Key "<uid>/budget:<total>". The amount
// is the budget's whole total, not the increase: the latest announcement is the
// budget. A total not above the one recorded as announced sends nothing (the total
// only grows; a lower one is never announced). The announcement under way is
// recorded in the ledger before it is sent, with its time, so every resend after a
// failure or a restart has the same body; once a 2xx answers, the ledger's total
// becomes it and the worker may credit up to it. Before anything, it records when
// the budget's packets became known (BudgetLedger.KnownSince), once. It returns the
// announced total.
func AnnounceBudgetTotal(ctx context.Context, cfg Config, b *store.Budget, total int64) (int64, error) {
	if total < 1 {
		return 0, fmt.Errorf("announcing the budget: total %d", total)
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return 0, err
	}
	if cfg.WebhookURL == "" {
		return 0, errors.New("announcing the budget: no webhook URL")
	}
	var retention time.Duration
	if cfg.Packets != nil {
		retention = cfg.Packets.LedgerRetention
	}
	ledger := b.SettlementLedger(retention)
	// The budget's packets are known from here on: the first announcement comes
	// before the budget is configured, so before its first packet, and every entry
	// settlement ever reads, the first batch's included, is held to the marks.
	if _, err := ledger.KnownSince(ctx); err != nil {
		return 0, err
	}
	if _, err := ledger.AccountsSince(ctx, accountsUpgradeDelay(cfg.Packets)); err != nil {
		return 0, err
	}
	for {
		st, err := ledger.PrepareAnnouncement(ctx, total, time.Now())
		if err != nil {
			return 0, err
		}
		if st.Pending == 0 {
			return st.Total, nil // nothing under way: the total is announced
		}
		body, err := json.Marshal(budgetTotalDelivery{Kind: KindAnnouncement, Source: SourceBudget, Activity: cfg.Source.Ref(),
			ActivityUID: cfg.Source.UID, Amount: st.Pending, Currency: cfg.Source.Currency, At: st.At.Format(rfc3339Milli)})
		if err != nil {
			return 0, fmt.Errorf("encoding the budget: %w", err)
		}
		if err := postBody(ctx, cfg, body, BudgetIdempotencyKeyOf(cfg.Source.UID, st.Pending)); err != nil {
			return st.Total, fmt.Errorf("announcing the budget total %d: %w", st.Pending, err)
		}
		if _, err := ledger.CommitAnnouncement(ctx, st.Pending); err != nil {
			return st.Total, err
		}
	}
}

// BudgetDrained reports whether every entry of every shard of b was settled or
// dead-lettered by the consumer group (DefaultGroup when empty).
func BudgetDrained(ctx context.Context, b *store.Budget, group string) (bool, error) {
	if group == "" {
		group = DefaultGroup
	}
	for i := range b.N() {
		ok, err := b.Stream(i).Drained(ctx, group)
		if err != nil {
			return false, fmt.Errorf("budget shard %d: %w", i, err)
		}
		if !ok {
			return false, nil
		}
	}
	return true, nil
}

// BudgetUnsettled counts the entries of every shard of b that the consumer group
// (DefaultGroup when empty) has not settled or dead-lettered yet (store's
// Shard.Unsettled): what a deleted budget still waits for.
func BudgetUnsettled(ctx context.Context, b *store.Budget, group string) (int64, error) {
	if group == "" {
		group = DefaultGroup
	}
	var n int64
	for i := range b.N() {
		u, err := b.Stream(i).Unsettled(ctx, group)
		if err != nil {
			return 0, fmt.Errorf("budget shard %d: %w", i, err)
		}
		n += u
	}
	return n, nil
}

// splitPacketKey splits an entry's packet id into the packet and the share:
// "<packetId>/<share>" for a grant (a canonical decimal below maxCount),
// "<packetId>/refund" for a refund. It says why when the id is not one of those.
func splitPacketKey(kind, key string, maxCount int64) (packetID, share string, why string) {
	i := strings.LastIndexByte(key, '/')
	if i < 0 {
		return "", "", fmt.Sprintf("packet id %q is not <packetId>/<share>", key)
	}
	packetID, share = key[:i], key[i+1:]
	if msg := checkPacketID(packetID); msg != "" {
		return "", "", msg
	}
	switch kind {
	case store.KindRefund:
		if share != store.RefundShare {
			return "", "", fmt.Sprintf("a refund of %q, not of <packetId>/refund", key)
		}
	default:
		n, err := strconv.ParseInt(share, 10, 64)
		if err != nil || n < 0 || strconv.FormatInt(n, 10) != share {
			return "", "", fmt.Sprintf("a grant of %q, whose share is not a 0-based index", key)
		}
		if n >= maxCount {
			return "", "", fmt.Sprintf("a grant of share %d of packet %q, but a packet has at most %d shares", n, packetID, maxCount)
		}
	}
	return packetID, share, ""
}

// checkPacketID says why id is not a packet id a creation accepts
// ([A-Za-z0-9][A-Za-z0-9._-]{0,63}), or "".
func checkPacketID(id string) string {
	if id == "" || len(id) > store.MaxPacketIDLength {
		return fmt.Sprintf("packet id %q is empty or longer than %d", id, store.MaxPacketIDLength)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '.' && c != '_' && c != '-') {
			return fmt.Sprintf("packet id %q holds %q", id, c)
		}
	}
	return ""
}

// checkPackets checks a budget's entries before delivery and returns why each
// forged one is, by id: fields that are not a grant or refund (ReasonMalformed), a
// packet id that is not a key of a packet (ReasonPacketIDMalformed), an entry older
// than the ledger remembers (ReasonStaleEntry), an entry its packet, still in Redis,
// does not record (ReasonClaimMismatch: store.Budget.VerifyPacketEntries), and then
// the ledger's verdicts on the rest, in one atomic step (store.BudgetLedger.Decide): ReasonDuplicatePacket,
// ReasonOverBudget. A Redis error, or no announced total yet, is returned: the
// entries are checked again, never delivered unchecked.
func (c *packetsCheck) checkPackets(ctx context.Context, entries []store.StreamEntry) (map[string]error, error) {
	forged := map[string]error{}
	staleBefore := c.now().Add(-(c.cfg.LedgerRetention - c.cfg.MaxTTL - maxPacketLedgerMargin))
	var decide []store.StreamEntry
	var credits []store.BudgetCredit
	for _, e := range entries {
		if e.Malformed != nil {
			forged[e.ID] = &ForgedError{Reason: ReasonMalformed, Detail: e.Malformed.Error()}
			continue
		}
		packetID, share, why := splitPacketKey(e.Kind, e.PacketID, c.cfg.MaxCount)
		if e.Kind == store.KindCreate {
			packetID, share, why = e.PacketID, store.OpenShare, checkPacketID(e.PacketID)
			if why == "" && int64(len(e.Shares)) > c.cfg.MaxCount {
				why = fmt.Sprintf("%d shares, but a packet has at most %d", len(e.Shares), c.cfg.MaxCount)
			}
		}
		if why != "" {
			forged[e.ID] = &ForgedError{Reason: ReasonPacketIDMalformed, Detail: fmt.Sprintf("%s of %d for user %q: %s", e.Kind, e.Amount, e.UserID, why)}
			continue
		}
		if e.At.Before(staleBefore) {
			forged[e.ID] = &ForgedError{Reason: ReasonStaleEntry, Detail: fmt.Sprintf(
				"%s %s of %d for user %q was written at %s, before the ledger's memory (%s): check by hand whether it was paid",
				e.Kind, e.PacketID, e.Amount, e.UserID, e.At.Format(time.RFC3339), staleBefore.Format(time.RFC3339))}
			continue
		}
		decide = append(decide, e)
		credits = append(credits, e.Credit(packetID, share))
	}
	// The packets still in Redis say what their scripts wrote; what does not match
	// is not decided in the ledger at all.
	since, err := c.tombstonesSince(ctx)
	if err != nil {
		return nil, err
	}
	mismatch, err := c.budget.VerifyPacketEntries(ctx, credits, since)
	if err != nil {
		return nil, err
	}
	if len(mismatch) > 0 {
		var keepEntries []store.StreamEntry
		var keepCredits []store.BudgetCredit
		for i, e := range decide {
			if why := mismatch[i]; why != nil {
				reason := ReasonClaimMismatch
				if errors.Is(why, store.ErrPacketUnknown) {
					reason = ReasonPacketUnknown
				}
				forged[e.ID] = &ForgedError{Reason: reason, Detail: why.Error()}
				continue
			}
			keepEntries, keepCredits = append(keepEntries, e), append(keepCredits, credits[i])
		}
		decide, credits = keepEntries, keepCredits
	}
	// The announced total is read before the ledger decides, so that a refill
	// acknowledged between the decision and the check below is seen as one.
	before, err := c.ledger.Announcement(ctx)
	if err != nil {
		return nil, err
	}
	verdicts, err := c.ledger.Decide(ctx, credits)
	if err != nil {
		return nil, err
	}
	if err := c.bookLateRecords(ctx, credits, verdicts); err != nil {
		return nil, err
	}
	if err := c.refillUnderWay(ctx, before, verdicts); err != nil {
		return nil, err
	}
	for i, e := range decide {
		if e.Kind == store.KindCreate && verdicts[i].Deliver() {
			forged[e.ID] = errBooked
		}
	}
	recordForged(forged, decide, verdicts, func(v store.LedgerVerdict, e store.StreamEntry) string {
		switch v.Verdict {
		case store.LedgerDuplicatePacket:
			return fmt.Sprintf("%s %s of %d for user %q: the key was credited already, to %q (the same body again would pass)", e.Kind, e.PacketID, e.Amount, e.UserID, v.CreditedTo)
		case store.LedgerOverBudget:
			if e.Kind == store.KindCreate {
				return fmt.Sprintf("creation of packet %s of %d by %q: the packets booked would draw more than the budget total announced to the balance system", e.PacketID, e.Amount, e.UserID)
			}
			return fmt.Sprintf("%s %s of %d for user %q: the credits would exceed the budget total announced to the balance system", e.Kind, e.PacketID, e.Amount, e.UserID)
		case store.LedgerPacketUnknown:
			return fmt.Sprintf("%s %s of %d for user %q: no creation record of the packet was booked", e.Kind, e.PacketID, e.Amount, e.UserID)
		case store.LedgerPacketOutOfRange:
			return fmt.Sprintf("grant %s of %d for user %q: the packet's account has no such share", e.PacketID, e.Amount, e.UserID)
		case store.LedgerAmountMismatch:
			return fmt.Sprintf("grant %s of %d for user %q: the packet's account records another amount for that share", e.PacketID, e.Amount, e.UserID)
		case store.LedgerClaimMismatch:
			return fmt.Sprintf("refund %s of %d to %q: not the packet's sender", e.PacketID, e.Amount, e.UserID)
		case store.LedgerOverPacket:
			return fmt.Sprintf("%s %s of %d for user %q: the credits of the packet would exceed its total", e.Kind, e.PacketID, e.Amount, e.UserID)
		}
		return ""
	})
	return forged, nil
}

// bookLateRecords decides again the credits the ledger found without an account
// (LedgerPacketUnknown) whose packet's creation record is still in its stream
// (store.Budget.CreationRecord), booking the record first: after a worker's crash,
// the group hands out a packet's grants before the record an unfinished read holds,
// until that read is taken over. It replaces their verdicts in place. A packet with
// no record in its stream keeps its verdict.
func (c *packetsCheck) bookLateRecords(ctx context.Context, credits []store.BudgetCredit, verdicts []store.LedgerVerdict) error {
	records := map[string]*store.BudgetCredit{}
	var again []int
	for i, v := range verdicts {
		if v.Verdict != store.LedgerPacketUnknown {
			continue
		}
		id := credits[i].PacketID
		rec, seen := records[id]
		if !seen {
			e, ok, err := c.budget.CreationRecord(ctx, id)
			if err != nil {
				return err
			}
			if ok && e.PacketID == id && int64(len(e.Shares)) <= c.cfg.MaxCount {
				cr := e.Credit(id, store.OpenShare)
				rec = &cr
			}
			records[id] = rec
		}
		if rec != nil {
			again = append(again, i)
		}
	}
	if len(again) == 0 {
		return nil
	}
	var batch []store.BudgetCredit
	var at []int
	for id, rec := range records {
		if rec == nil {
			continue
		}
		batch = append(batch, *rec)
		at = append(at, -1)
		for _, i := range again {
			if credits[i].PacketID == id {
				batch = append(batch, credits[i])
				at = append(at, i)
			}
		}
	}
	got, err := c.ledger.Decide(ctx, batch)
	if err != nil {
		return err
	}
	for k, i := range at {
		if i >= 0 {
			verdicts[i] = got[k]
		}
	}
	return nil
}

// tombstonesSince is the ledger's KnownSince, read once and kept; the first time,
// it also makes sure the ledger holds its accounts_since (BudgetLedger.AccountsSince),
// for a budget announced by a release that did not record it.
func (c *packetsCheck) tombstonesSince(ctx context.Context) (time.Time, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.knownSince.IsZero() {
		if _, err := c.ledger.AccountsSince(ctx, accountsUpgradeDelay(&c.cfg)); err != nil {
			return time.Time{}, err
		}
		since, err := c.ledger.KnownSince(ctx)
		if err != nil {
			return time.Time{}, err
		}
		c.knownSince = since
	}
	return c.knownSince, nil
}

// accountsUpgradeDelay is how long after its first check under this release a
// budget announced by an older one still credits entries of packets without a
// creation record (BudgetLedger.AccountsSince): the longest time to live, and the
// hour the ledger's retention keeps beyond it, for the grab fleet's rollout.
func accountsUpgradeDelay(p *Packets) time.Duration {
	ttl := defaultPacketMaxTTL
	if p != nil && p.MaxTTL > 0 {
		ttl = p.MaxTTL
	}
	return ttl + maxPacketLedgerMargin
}

// BudgetConfigFor is the worker configuration of a budget's settlement workers:
// the budget as "<namespace>/<name>" and its UID in the activity fields, source
// "budget", its currency (DefaultCurrency when empty), the webhook and maxAttempts,
// the operator's signing key, the default group, an HTTP client with
// DefaultHTTPTimeout, and Packets. The caller sets Redis, Consumer and optionally
// Registerer, Logger and OnForged.
func BudgetConfigFor(namespace, name, uid, currency, webhookURL string, maxAttempts int, signingKey []byte, p Packets) Config {
	if currency == "" {
		currency = DefaultCurrency
	}
	return Config{
		Source:      Source{Kind: SourceKindBudget, Namespace: namespace, Name: name, UID: uid, Currency: currency},
		WebhookURL:  webhookURL,
		MaxAttempts: maxAttempts,
		SigningKey:  signingKey,
		Group:       DefaultGroup,
		HTTPClient:  &http.Client{Timeout: DefaultHTTPTimeout},
		Packets:     &p,
	}
}

// ErrRefillNotAnnounced is returned by the check of a batch with an entry over the
// announced total while the ledger holds an announcement of a higher total that the
// balance system has not acknowledged yet: a refill under way. The batch is checked
// again later (what the ledger let through stays recorded and passes again), and
// nothing is dead-lettered for it.
var ErrRefillNotAnnounced = errors.New("a higher budget total is being announced to the balance system")

// refillUnderWay returns ErrRefillNotAnnounced (wrapped) when a verdict is over the
// budget and the ledger holds a pending announcement above the announced total: the
// operator is raising the total and the balance system has not acknowledged it yet
// (or the announcement failed and is retried). It does the same when the announced
// total grew since before, read ahead of the ledger's decision: the refill was
// acknowledged while the verdicts were taken, and they may count the old total
// (TestBudgetGrantsOfARefillWaitForItsAnnouncement). It reads only the operator's ledger,
// never the shards' allotment, which the budget's Redis user can raise with HINCRBY:
// an allotment raised that way makes nothing wait, and an entry beyond the announced
// total is dead-lettered over_budget (TestRaisedAllotmentDoesNotStallSettlement).
func (c *packetsCheck) refillUnderWay(ctx context.Context, before store.BudgetAnnouncement, verdicts []store.LedgerVerdict) error {
	over := false
	for _, v := range verdicts {
		over = over || v.Verdict == store.LedgerOverBudget
	}
	if !over {
		return nil
	}
	st, err := c.ledger.Announcement(ctx)
	if err != nil {
		return err
	}
	if st.Pending > st.Total {
		return fmt.Errorf("%w: %d being announced, %d acknowledged; waiting for the announcement", ErrRefillNotAnnounced, st.Pending, st.Total)
	}
	if st.Total > before.Total {
		return fmt.Errorf("%w: %d acknowledged while the ledger decided against %d; deciding again", ErrRefillNotAnnounced, st.Total, before.Total)
	}
	return nil
}
