package settlement

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"redpacket.io/operator/store"
)

// The events of a RedPacketBudget's packets, delivered to the merchant's events
// webhook (spec.events.webhook; docs/budgets.md, "Events"):
//
//	packet.created    the packet's account was booked from its creation record
//	packet.exhausted  its last share was granted (and credited)
//	packet.expired    its expiry moved the remainder to the sender's refund
//	packet.refunded   the balance system acknowledged that refund
//
// Nothing on the grab path writes them. An EventsWorker per budget shard reads the
// shard's settlement stream through a consumer group of its own (store.EventsGroup),
// waits until the settlement group finished with each entry it read (delivered and
// acknowledged, or dead-lettered), and asks the operator's ledger what the entry
// was: an entry the ledger did not credit (a forgery, a duplicate) makes no event.
// So an event never runs ahead of the money, a tenant's forged entry announces
// nothing, and the events' own deliveries, however slow, hold back neither the
// grabs and creations (which never see them) nor settlement (which never waits for
// them): a stuck events webhook only lets the events group fall behind in a stream
// that keeps its entries anyway.
//
// Each event is POSTed, signed as settlement's deliveries are, with the
// Idempotency-Key "<budget uid>/<packetId>/<type>", retried with backoff until a 2xx,
// at least once. A packet's events go in lifecycle order (created, then exhausted, or
// expired and refunded), one at a time: its account's "ev" field records each one
// delivered (store.BudgetLedger.MarkEvents) before the next is sent, so that none is
// sent again once delivered and none before its predecessors; an event whose
// predecessor was never sent (the webhook was set while the packet lived) brings the
// predecessor first. One failing maxAttempts times is parked in the budget's events
// dead letters with every later event of its packet, so the receiver never sees a
// packet's events out of order. Packets are delivered in parallel lanes; a read of
// entries is acknowledged once all its packets are done.

// The event types.
const (
	EventPacketCreated   = "packet.created"
	EventPacketExhausted = "packet.exhausted"
	EventPacketExpired   = "packet.expired"
	EventPacketRefunded  = "packet.refunded"
)

// lifecycle is every event type in the order a packet's events are delivered, each
// with the letter its account's "ev" field records it by.
var lifecycle = []struct {
	letter byte
	typ    string
}{{'c', EventPacketCreated}, {'x', EventPacketExhausted}, {'e', EventPacketExpired}, {'r', EventPacketRefunded}}

// deadLetter is the "ev" letter of a packet one of whose events was dead-lettered:
// every later event of it is dead-lettered too.
const deadLetter = 'd'

// Defaults of an EventsWorker.
const (
	// DefaultEventsBatch is how many stream entries one read takes.
	DefaultEventsBatch = 512
	// DefaultEventsLanes is how many packets' events are delivered at once.
	DefaultEventsLanes = 32
	// DefaultEventsPoll is how often a read waits for settlement to finish with it.
	DefaultEventsPoll = 100 * time.Millisecond
)

// Event is the body of one POST to a budget's events webhook, in the Standard
// Webhooks shape: the type, when it happened, and the packet.
type Event struct {
	// Type is one of the Event* constants.
	Type string `json:"type"`
	// Timestamp is when it happened, RFC 3339 with milliseconds, by the Redis clock:
	// the creation, the last grant, the expiry, or the record of the refund's
	// acknowledgement.
	Timestamp string `json:"timestamp"`
	// Data is the packet as the operator's ledger booked it.
	Data EventData `json:"data"`
}

// EventData is the packet an event is about.
type EventData struct {
	// Budget is "<namespace>/<name>" of the RedPacketBudget; BudgetUID its UID.
	Budget    string `json:"budget"`
	BudgetUID string `json:"budgetUID"`
	PacketID  string `json:"packetId"`
	Sender    string `json:"sender"`
	Currency  string `json:"currency"`
	// TotalAmount is the packet's money in minor units, in Count shares.
	TotalAmount int64  `json:"totalAmount"`
	Count       int64  `json:"count"`
	CreatedAt   string `json:"createdAt"`
	ExpiresAt   string `json:"expiresAt"`
	// ExhaustedAt is when its last share was granted (packet.exhausted).
	ExhaustedAt string `json:"exhaustedAt,omitempty"`
	// ExpiredAt is when the expiry moved RefundAmount back to the sender
	// (packet.expired, packet.refunded); RefundedAt when the balance system's
	// acknowledgement of it was recorded (packet.refunded).
	ExpiredAt    string `json:"expiredAt,omitempty"`
	RefundAmount *int64 `json:"refundAmount,omitempty"`
	RefundedAt   string `json:"refundedAt,omitempty"`
}

// EventKey is the Idempotency-Key of one event: "<budget uid>/<packetId>/<type>".
func EventKey(budgetUID, packetID, typ string) string {
	return budgetUID + "/" + packetID + "/" + typ
}

// EventsWorker delivers the events of one budget shard (see above). Make them with
// NewBudgetEventsWorkers.
type EventsWorker struct {
	cfg         Config
	budget      *store.Budget
	ledger      *store.BudgetLedger
	stream      *store.Stream
	shard       int
	settleGroup string
	batch       int64
	lanes       int
	poll        time.Duration
	m           *eventMetrics
	log         *slog.Logger
	claimCursor string
	// claimedAt is when entries idle under another consumer were last looked for.
	claimedAt time.Time
}

// NewBudgetEventsWorkers returns one events worker per budget shard of b. cfg is the
// events' configuration: WebhookURL the events webhook, the signing keys for its host,
// MaxAttempts before an event is dead-lettered, the backoff from HealthyBackoffBase
// doubling up to BackoffMax, its own HTTPClient (nil: a new one, so a stuck receiver
// holds no connection settlement needs), Group the settlement group whose progress
// the events follow (DefaultGroup when empty), and ClaimIdle, after which entries
// another consumer (an operator before a failover) read and left pending are taken
// over.
func NewBudgetEventsWorkers(cfg Config, b *store.Budget) ([]*EventsWorker, error) {
	if cfg.WebhookURL == "" {
		return nil, errors.New("events config: no webhook URL")
	}
	if cfg.Source.UID != b.UID() {
		return nil, fmt.Errorf("events config: UID %q, but the budget's is %q", cfg.Source.UID, b.UID())
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("events %w", err)
	}
	m, err := newEventMetrics(cfg.Registerer, cfg.Source.Ref())
	if err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	ledger := b.SettlementLedger(0)
	ws := make([]*EventsWorker, b.N())
	for i := range ws {
		ws[i] = &EventsWorker{cfg: cfg, budget: b, ledger: ledger, stream: b.Stream(i), shard: i, settleGroup: cfg.Group,
			batch: DefaultEventsBatch, lanes: DefaultEventsLanes, poll: DefaultEventsPoll, m: m,
			log: log.With("budget", cfg.Source.Ref(), "shard", i, "events", cfg.WebhookURL), claimCursor: "0-0"}
	}
	return ws, nil
}

// EnsureEventsGroups creates the events consumer group of every shard of b
// (store.Stream.EnsureEventsGroup, live): the reconcile of a budget with an events
// webhook calls it before it configures the shards, so that a new budget's events
// group reads its first packet's entries.
func EnsureEventsGroups(ctx context.Context, b *store.Budget) error {
	for i := range b.N() {
		if err := b.Stream(i).EnsureEventsGroup(ctx, store.EventsGroup, true); err != nil {
			return err
		}
	}
	return nil
}

// RunEvents runs the workers until ctx ends.
func RunEvents(ctx context.Context, ws []*EventsWorker) {
	var wg sync.WaitGroup
	for _, w := range ws {
		wg.Go(func() { w.Run(ctx) })
	}
	wg.Wait()
}

// Run delivers the shard's events until ctx ends. Redis and webhook failures are
// retried, never returned; a read whose events were not all delivered or parked stays
// pending in the events group and is taken again.
func (w *EventsWorker) Run(ctx context.Context) {
	for failures := 0; ; failures++ {
		err := w.stream.EnsureEventsGroup(ctx, store.EventsGroup, false)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return
		}
		// A shard not configured yet (ErrMissing) is waited for quietly: the budget's
		// first reconcile starts the workers before it configures the shards.
		if !errors.Is(err, store.ErrMissing) {
			w.log.Error("creating the events consumer group", "err", err)
		}
		if !sleep(ctx, min(retryPause(failures), time.Second)) {
			return
		}
	}
	failures := 0
	for ctx.Err() == nil {
		err := w.step(ctx)
		if err == nil {
			failures = 0
			continue
		}
		if ctx.Err() != nil {
			return
		}
		failures++
		w.log.Warn("delivering the budget's packet events; retrying", "err", err, "failures", failures)
		if !sleep(ctx, retryPause(failures)) {
			return
		}
	}
}

// step reads entries (its own pending first, then those idle under another consumer,
// then new ones), waits until settlement finished with them, delivers their events
// and acknowledges them.
func (w *EventsWorker) step(ctx context.Context) error {
	entries, err := w.stream.ReadOwnPending(ctx, store.EventsGroup, w.cfg.Consumer, "0", w.batch)
	if err != nil {
		return err
	}
	// Entries left by another consumer are looked for a third of the claim idle time
	// apart, not at every read.
	if len(entries) == 0 && time.Since(w.claimedAt) >= w.cfg.ClaimIdle/3 {
		var next string
		entries, next, err = w.stream.ClaimIdle(ctx, store.EventsGroup, w.cfg.Consumer, w.cfg.ClaimIdle, w.claimCursor, w.batch)
		if err != nil {
			return err
		}
		w.claimCursor, w.claimedAt = next, time.Now()
	}
	if len(entries) == 0 {
		entries, err = w.stream.ReadNew(ctx, store.EventsGroup, w.cfg.Consumer, w.batch, DefaultBlock)
		if err != nil {
			return err
		}
	}
	if len(entries) == 0 {
		return nil
	}
	ids := make([]string, len(entries))
	for i, e := range entries {
		ids[i] = e.ID
	}
	if err := w.waitForSettlement(ctx, ids); err != nil {
		return err
	}
	if err := w.deliver(ctx, entries); err != nil {
		return err
	}
	return w.stream.AckGroup(ctx, store.EventsGroup, ids)
}

// waitForSettlement returns once the settlement group finished with every id: its
// credits are decided in the ledger, its refund delivered or dead-lettered.
func (w *EventsWorker) waitForSettlement(ctx context.Context, ids []string) error {
	for {
		unfinished, err := w.stream.Unfinished(ctx, w.settleGroup, ids)
		if err != nil && !errors.Is(err, store.ErrNoGroup) {
			return err
		}
		if err == nil && len(unfinished) == 0 {
			return nil
		}
		if !sleep(ctx, w.poll) {
			return ctx.Err()
		}
	}
}

// packetEvents are the events one read asks of one packet.
type packetEvents struct {
	id string
	// want are the lifecycle letters the entries ask for.
	want map[byte]bool
}

// deliver derives the events of entries from the ledger and delivers them, a lane
// per packet.
func (w *EventsWorker) deliver(ctx context.Context, entries []store.StreamEntry) error {
	var order []*packetEvents
	byID := map[string]*packetEvents{}
	asked := map[string][]string{}
	var refunds []string
	for _, e := range entries {
		if e.Malformed != nil {
			continue
		}
		id, share := e.PacketID, store.OpenShare
		if e.Kind != store.KindCreate {
			var why string
			id, share, why = splitPacketKey(e.Kind, e.PacketID, defaultMaxShareIndex)
			if why != "" {
				continue
			}
		}
		p := byID[id]
		if p == nil {
			p = &packetEvents{id: id, want: map[byte]bool{}}
			byID[id] = p
			order = append(order, p)
			asked[id] = nil
		}
		switch e.Kind {
		case store.KindCreate:
			p.want['c'] = true
		case store.KindRefund:
			asked[id] = append(asked[id], store.RefundShare)
			refunds = append(refunds, id)
			p.want['e'] = true
		default:
			asked[id] = append(asked[id], share)
			p.want['x'] = true
		}
	}
	if len(order) == 0 {
		return nil
	}
	accounts, err := w.ledger.PacketAccounts(ctx, asked)
	if err != nil {
		return err
	}
	forgotten, err := w.budget.ForgottenAt(ctx, refunds)
	if err != nil {
		return err
	}
	sem := make(chan struct{}, w.lanes)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for _, p := range order {
		events := w.eventsOf(p, accounts[p.id], forgotten)
		if len(events) == 0 {
			continue
		}
		sent := accounts[p.id].Sent
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			return ctx.Err()
		}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := w.deliverPacket(ctx, p.id, sent, events); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// letteredEvent is one event to deliver, with its account letter.
type letteredEvent struct {
	letter byte
	key    string
	body   []byte
}

// eventsOf is the events of p not delivered yet, in lifecycle order, as the ledger's
// account a says they happened: created once the account is booked; exhausted once
// the last share is credited; expired once the refund is credited, and refunded once
// the packet was forgotten after its delivery. An event the entries ask for brings
// its predecessors that were never sent.
func (w *EventsWorker) eventsOf(p *packetEvents, a store.PacketAccount, forgotten map[string]time.Time) []letteredEvent {
	if !a.Known {
		return nil
	}
	base := EventData{Budget: w.cfg.Source.Ref(), BudgetUID: w.cfg.Source.UID, PacketID: p.id, Sender: a.Sender,
		Currency: w.cfg.Source.Currency, TotalAmount: a.Total, Count: a.Count,
		CreatedAt: a.CreatedAt.Format(rfc3339Milli), ExpiresAt: a.ExpiresAt.Format(rfc3339Milli)}
	// Each event's data is what was known when it happened, so that every attempt of
	// one key carries the same body.
	happened := map[byte]time.Time{'c': a.CreatedAt}
	data := map[byte]EventData{'c': base}
	last := strconv.FormatInt(a.Count-1, 10)
	if c, ok := a.Credits[last]; ok && p.want['x'] {
		d := base
		d.ExhaustedAt = c.At.UTC().Format(rfc3339Milli)
		happened['x'], data['x'] = c.At, d
	}
	if c, ok := a.Credits[store.RefundShare]; ok && p.want['e'] {
		d := base
		amount := c.Amount
		d.RefundAmount, d.ExpiredAt = &amount, c.At.UTC().Format(rfc3339Milli)
		happened['e'], data['e'] = c.At, d
		if at, ok := forgotten[p.id]; ok {
			d.RefundedAt = at.Format(rfc3339Milli)
			happened['r'], data['r'] = at, d
		}
	}
	var out []letteredEvent
	for _, l := range lifecycle {
		at, ok := happened[l.letter]
		if !ok || strings.IndexByte(a.Sent, l.letter) >= 0 {
			continue
		}
		body, err := json.Marshal(Event{Type: l.typ, Timestamp: at.UTC().Format(rfc3339Milli), Data: data[l.letter]})
		if err != nil {
			continue // a struct of strings and integers always encodes
		}
		out = append(out, letteredEvent{letter: l.letter, key: EventKey(w.cfg.Source.UID, p.id, l.typ), body: body})
	}
	return out
}

// deliverPacket delivers one packet's events in order, each retried with backoff
// until a 2xx or MaxAttempts; an event that runs out of attempts is dead-lettered with
// every later one. Each outcome is recorded in the account before the next event.
func (w *EventsWorker) deliverPacket(ctx context.Context, id, sent string, events []letteredEvent) error {
	dead := strings.IndexByte(sent, deadLetter) >= 0
	for _, ev := range events {
		if !dead {
			err := w.post(ctx, ev)
			if err == nil {
				if err := w.ledger.MarkEvents(ctx, id, string(ev.letter)); err != nil {
					return err
				}
				continue
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			dead = true
			w.log.Warn("an event was not delivered; it and the packet's later events are parked in the events dead letters",
				"packet", id, "key", ev.key, "err", err)
			if err := w.ledger.DeadLetterEvent(ctx, ev.key, string(ev.body), err.Error()); err != nil {
				return err
			}
		} else if err := w.ledger.DeadLetterEvent(ctx, ev.key, string(ev.body), "an earlier event of the packet was dead-lettered"); err != nil {
			return err
		}
		w.m.deadLetters.Inc()
		if err := w.ledger.MarkEvents(ctx, id, string([]byte{ev.letter, deadLetter})); err != nil {
			return err
		}
	}
	return nil
}

// post delivers one event, retrying until a 2xx, MaxAttempts, or ctx's end.
func (w *EventsWorker) post(ctx context.Context, ev letteredEvent) error {
	var err error
	for attempt := 1; attempt <= w.cfg.MaxAttempts; attempt++ {
		err = postBody(ctx, w.cfg, ev.body, ev.key)
		if err == nil {
			w.m.deliveries.WithLabelValues(ResultSettled).Inc()
			return nil
		}
		if ctx.Err() != nil {
			return err
		}
		w.m.deliveries.WithLabelValues(failedResult(err)).Inc()
		// HealthyBackoffBase doubled per attempt up to BackoffMax, with equal jitter.
		pause := jitteredBackoff(w.cfg.HealthyBackoffBase, w.cfg.BackoffMax, int64(attempt))
		if attempt == w.cfg.MaxAttempts || !sleep(ctx, pause) {
			break
		}
	}
	return err
}

// eventMetrics are the events' counters, shared by a budget's workers.
type eventMetrics struct {
	deliveries  *prometheus.CounterVec
	deadLetters prometheus.Counter
}

func newEventMetrics(reg prometheus.Registerer, budget string) (*eventMetrics, error) {
	labels := prometheus.Labels{"activity": budget}
	m := &eventMetrics{
		deliveries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "redpacket", Subsystem: "events", Name: "deliveries_total", ConstLabels: labels,
			Help: "Attempts to deliver a packet event to the budget's events webhook, by result (settled: a 2xx; rejected; no_answer).",
		}, []string{"result"}),
		deadLetters: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "redpacket", Subsystem: "events", Name: "dead_letters_total", ConstLabels: labels,
			Help: "Packet events parked in the budget's events dead letters, never delivered.",
		}),
	}
	if reg == nil {
		return m, nil
	}
	var err error
	if m.deliveries, err = register(reg, m.deliveries); err != nil {
		return nil, err
	}
	if m.deadLetters, err = register(reg, m.deadLetters); err != nil {
		return nil, err
	}
	return m, nil
}
