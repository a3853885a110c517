package settlement

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"redpacket.io/operator/store"
)

// NewActivityReconciler returns the reconciler of an activity spread over shards:
// its ledger (store.Ledger) against the balance system's book. cfg is the
// activity's settlement configuration, with its Redis client and Allowance (the
// seeded split, which says each packet's amount).
func NewActivityReconciler(cfg Config, shards int) (*Reconciler, error) {
	return newReconciler(cfg, func(cfg Config) (ledgerSide, error) {
		act := store.NewActivity(cfg.Redis, cfg.Source.UID, max(shards, 1))
		return &activityPaid{cfg: cfg, act: act, ledger: act.Ledger()}, nil
	})
}

// NewBudgetReconciler returns the reconciler of budget b: its ledger
// (store.BudgetLedger) and its packets' accounts against the balance system's book.
// cfg is the budget's settlement configuration (BudgetConfigFor), with its Redis
// client.
func NewBudgetReconciler(cfg Config, b *store.Budget) (*Reconciler, error) {
	if cfg.Packets == nil {
		return nil, errors.New("reconciliation: a budget's needs Packets")
	}
	return newReconciler(cfg, func(cfg Config) (ledgerSide, error) {
		p, err := cfg.Packets.withDefaults()
		if err != nil {
			return nil, fmt.Errorf("reconciliation: %w", err)
		}
		return &budgetPaid{cfg: cfg, packets: p, budget: b, ledger: b.SettlementLedger(p.LedgerRetention)}, nil
	})
}

// deliveryOf is the delivery of a well-formed entry of src: the body every worker
// sends for it, and the one reconciliation sends again.
func deliveryOf(src Source, e store.StreamEntry) Delivery {
	return Delivery{
		Kind:        e.Kind,
		Activity:    src.Ref(),
		ActivityUID: src.UID,
		PacketID:    e.PacketID,
		UserID:      e.UserID,
		Amount:      e.Amount,
		Currency:    src.Currency,
		At:          e.At.UTC().Format(rfc3339Milli),
		Source:      src.wireSource(),
		SourceRef:   SourceRef{Kind: src.kind(), Namespace: src.Namespace, Name: src.Name, UID: src.UID},
	}
}

// activityPaid is an activity's side: its ledger names the user of each packet
// credited ("p:<n>") and the refund; the seeded split says each packet's amount; a
// grant's delivery is rebuilt from the stream entry its claim names, the refund's
// from shard 0's refund entry.
type activityPaid struct {
	cfg    Config
	act    *store.Activity
	ledger *store.Ledger
}

func (p *activityPaid) totals(ctx context.Context) (store.PaidTotals, error) {
	return p.ledger.Totals(ctx)
}

func (p *activityPaid) quiet(ctx context.Context) (bool, error) {
	return allDrained(ctx, p.act.N(), p.act.Stream, p.cfg.Group)
}

func (p *activityPaid) parked(ctx context.Context) (map[string]bool, error) {
	return parkedKeys(ctx, p.cfg.Source.UID, p.act.N(), p.act.Stream)
}

// amount is packet n's seeded amount; ok is false when the split is not at hand or
// n is not one of its packets.
func (p *activityPaid) amount(n string) (int64, bool) {
	i, err := strconv.Atoi(n)
	if err != nil || p.cfg.Allowance == nil || i < 1 || i > len(p.cfg.Allowance.Amounts) {
		return 0, false
	}
	return p.cfg.Allowance.Amounts[i-1], true
}

func (p *activityPaid) check(ctx context.Context, book []bookCredit) ([]paidVerdict, error) {
	out := make([]paidVerdict, len(book))
	prefix := p.cfg.Source.UID + "/"
	var packets []string
	var at []int
	for i, c := range book {
		rest, ok := strings.CutPrefix(c.Key, prefix)
		switch {
		case !ok:
		case rest == store.KindRefund:
			user, amount, ok, err := p.ledger.Refund(ctx)
			if err != nil {
				return nil, err
			}
			if ok {
				out[i] = paidVerdict{paid: true, credit: paidCredit{Key: c.Key, Kind: store.KindRefund, UserID: user, Amount: amount, amountKnown: true}}
			}
		default:
			packets = append(packets, rest)
			at = append(at, i)
		}
	}
	users, err := p.ledger.GrantedTo(ctx, packets)
	if err != nil {
		return nil, err
	}
	for j, user := range users {
		if user == "" {
			continue
		}
		amount, known := p.amount(packets[j])
		out[at[j]] = paidVerdict{paid: true, credit: paidCredit{Key: book[at[j]].Key, Kind: store.KindGrant, UserID: user,
			Amount: amount, amountKnown: known}}
	}
	return out, nil
}

func (p *activityPaid) scan(ctx context.Context, cursor uint64) ([]paidCredit, uint64, error) {
	var page []paidCredit
	if cursor == 0 {
		user, amount, ok, err := p.ledger.Refund(ctx)
		if err != nil {
			return nil, 0, err
		}
		if ok {
			page = append(page, paidCredit{Key: p.cfg.Source.UID + "/" + store.KindRefund, Kind: store.KindRefund, UserID: user,
				Amount: amount, amountKnown: true})
		}
	}
	granted, next, err := p.ledger.ScanGrants(ctx, cursor)
	if err != nil {
		return nil, 0, err
	}
	for n, user := range granted {
		amount, known := p.amount(n)
		page = append(page, paidCredit{Key: p.cfg.Source.UID + "/" + n, Kind: store.KindGrant, UserID: user, Amount: amount,
			amountKnown: known})
	}
	return page, next, nil
}

func (p *activityPaid) delivery(ctx context.Context, c paidCredit) (Delivery, error) {
	if c.Kind == store.KindRefund {
		e, ok, err := p.act.Stream(0).LatestRefund(ctx)
		if err != nil {
			return Delivery{}, err
		}
		if !ok || e.UserID != c.UserID || e.Amount != c.Amount {
			return Delivery{}, errors.New("the refund's stream entry is not in the stream")
		}
		return deliveryOf(p.cfg.Source, e), nil
	}
	packet := strings.TrimPrefix(c.Key, p.cfg.Source.UID+"/")
	home := p.act.Home(c.UserID)
	claim, ok, err := p.act.Shard(home).ClaimOf(ctx, c.UserID)
	if err != nil {
		return Delivery{}, err
	}
	if !ok || claim.PacketID != packet {
		return Delivery{}, fmt.Errorf("no claim of %q names packet %s", c.UserID, packet)
	}
	e, ok, err := p.act.Stream(home).Entry(ctx, claim.EntryID)
	if err != nil {
		return Delivery{}, err
	}
	if !ok || e.Malformed != nil || e.PacketID != packet || e.UserID != c.UserID {
		return Delivery{}, fmt.Errorf("the stream entry %s that the claim of %q names is not its grant", claim.EntryID, c.UserID)
	}
	return deliveryOf(p.cfg.Source, e), nil
}

// budgetPaid is a budget's side: each packet's account in the ledger records every
// share credited and the refund, with user, amount and time, so a delivery is
// rebuilt from it alone. A packet's account is forgotten after the retention; the
// book's credits of such packets are unverifiable key by key (the sums still
// count them).
type budgetPaid struct {
	cfg     Config
	packets Packets
	budget  *store.Budget
	ledger  *store.BudgetLedger
}

func (p *budgetPaid) totals(ctx context.Context) (store.PaidTotals, error) {
	s, err := p.ledger.Sums(ctx)
	if err != nil {
		return store.PaidTotals{}, err
	}
	return store.PaidTotals{Grants: s.Grants, GrantSum: s.Granted, Refunds: s.Refunds, RefundSum: s.Refunded}, nil
}

func (p *budgetPaid) quiet(ctx context.Context) (bool, error) {
	return allDrained(ctx, p.budget.N(), p.budget.Stream, p.cfg.Group)
}

func (p *budgetPaid) parked(ctx context.Context) (map[string]bool, error) {
	return parkedKeys(ctx, p.cfg.Source.UID, p.budget.N(), p.budget.Stream)
}

// splitKey reads "<uid>/<packetId>/<share>".
func (p *budgetPaid) splitKey(key string) (packet, share string, ok bool) {
	rest, ok := strings.CutPrefix(key, p.cfg.Source.UID+"/")
	if !ok {
		return "", "", false
	}
	i := strings.LastIndexByte(rest, '/')
	if i <= 0 {
		return "", "", false
	}
	return rest[:i], rest[i+1:], true
}

func (p *budgetPaid) check(ctx context.Context, book []bookCredit) ([]paidVerdict, error) {
	out := make([]paidVerdict, len(book))
	var ids []string
	seen := map[string]bool{}
	for _, c := range book {
		if id, _, ok := p.splitKey(c.Key); ok && !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	credits, known, err := p.ledger.PacketCredits(ctx, ids)
	if err != nil {
		return nil, err
	}
	// A packet's account lives the retention after its last credit, and its
	// credits happen within its time to live: a credit older than that may be of a
	// packet the ledger has forgotten.
	forgotten := time.Now().Add(-(p.packets.LedgerRetention - p.packets.MaxTTL))
	for i, c := range book {
		id, share, ok := p.splitKey(c.Key)
		if !ok {
			continue
		}
		if !known[id] {
			if at, err := time.Parse(time.RFC3339Nano, c.At); err == nil && at.Before(forgotten) {
				out[i].unverifiable = true
			}
			continue
		}
		for _, pc := range credits[id] {
			if pc.Share == share {
				out[i] = paidVerdict{paid: true, credit: paidCredit{Key: c.Key, Kind: pc.Kind(), UserID: pc.UserID, Amount: pc.Amount,
					amountKnown: true}}
			}
		}
	}
	return out, nil
}

func (p *budgetPaid) scan(ctx context.Context, cursor uint64) ([]paidCredit, uint64, error) {
	ids, next, err := p.ledger.ScanPackets(ctx, cursor)
	if err != nil {
		return nil, 0, err
	}
	credits, _, err := p.ledger.PacketCredits(ctx, ids)
	if err != nil {
		return nil, 0, err
	}
	var page []paidCredit
	for _, id := range ids {
		for _, pc := range credits[id] {
			page = append(page, paidCredit{Key: p.cfg.Source.UID + "/" + pc.PacketID + "/" + pc.Share, Kind: pc.Kind(),
				UserID: pc.UserID, Amount: pc.Amount, amountKnown: true})
		}
	}
	return page, next, nil
}

func (p *budgetPaid) delivery(ctx context.Context, c paidCredit) (Delivery, error) {
	id, share, ok := p.splitKey(c.Key)
	if !ok {
		return Delivery{}, fmt.Errorf("%s is not a budget's credit key", c.Key)
	}
	credits, _, err := p.ledger.PacketCredits(ctx, []string{id})
	if err != nil {
		return Delivery{}, err
	}
	for _, pc := range credits[id] {
		if pc.Share == share {
			e := store.StreamEntry{Kind: pc.Kind(), PacketID: id + "/" + share, UserID: pc.UserID, Amount: pc.Amount, At: pc.At}
			return deliveryOf(p.cfg.Source, e), nil
		}
	}
	return Delivery{}, fmt.Errorf("the ledger no longer holds %s", c.Key)
}

// allDrained reports whether every one of n shards' streams is drained by group.
func allDrained(ctx context.Context, n int, stream func(int) *store.Stream, group string) (bool, error) {
	for i := range n {
		ok, err := stream(i).Drained(ctx, group)
		if err != nil || !ok {
			return false, err
		}
	}
	return true, nil
}

// parkedKeys is the set of Idempotency-Keys of the entries in n shards' dead
// letters.
func parkedKeys(ctx context.Context, uid string, n int, stream func(int) *store.Stream) (map[string]bool, error) {
	keys := map[string]bool{}
	for i := range n {
		dead, err := stream(i).DeadLetters(ctx)
		if err != nil {
			return nil, err
		}
		for _, e := range dead {
			if e.Malformed == nil {
				keys[uid+"/"+e.PacketID] = true
			}
		}
	}
	return keys, nil
}
