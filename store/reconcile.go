package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// What reconciliation reads of the operator's side: the credits its settlement
// ledgers let through, in bounded pages, and enough of each to deliver it again with
// the very body it was delivered with (the balance system books a key once per body
// digest, so a re-delivery of another body would be refused, never booked twice).
// Nothing here writes.

// PaidTotals is what a settlement ledger let through: the number and sum of the
// grants, and of the refunds.
type PaidTotals struct {
	Grants, GrantSum, Refunds, RefundSum int64
}

// scanPage is how many fields or keys one SCAN or HSCAN call asks for.
const scanPage = 1000

// Totals reads what the activity's ledger let through.
func (l *Ledger) Totals(ctx context.Context) (PaidTotals, error) {
	v, err := l.c.HMGet(ctx, l.key, "grants", "credited", "refund").Result()
	if err != nil {
		return PaidTotals{}, fmt.Errorf("reading %s: %w", l.key, err)
	}
	t := PaidTotals{Grants: hashInt(v[0]), GrantSum: hashInt(v[1]), RefundSum: hashInt(v[2])}
	if v[2] != nil {
		t.Refunds = 1
	}
	return t, nil
}

// ScanGrants reads one page of the packets the activity's ledger credited, from
// cursor (0 to start), as packet id -> user; next is 0 after the last page. A page
// holds about scanPage packets; the whole ledger is read in bounded memory.
func (l *Ledger) ScanGrants(ctx context.Context, cursor uint64) (granted map[string]string, next uint64, err error) {
	kv, next, err := l.c.HScan(ctx, l.key, cursor, "p:*", scanPage).Result()
	if err != nil {
		return nil, 0, fmt.Errorf("scanning %s: %w", l.key, err)
	}
	granted = make(map[string]string, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		granted[strings.TrimPrefix(kv[i], "p:")] = kv[i+1]
	}
	return granted, next, nil
}

// GrantedTo reads to whom the ledger credited each packet ("" when it credited none).
func (l *Ledger) GrantedTo(ctx context.Context, packets []string) ([]string, error) {
	if len(packets) == 0 {
		return nil, nil
	}
	fields := make([]string, len(packets))
	for i, p := range packets {
		fields[i] = "p:" + p
	}
	v, err := l.c.HMGet(ctx, l.key, fields...).Result()
	if err != nil {
		return nil, fmt.Errorf("reading %d packets of %s: %w", len(packets), l.key, err)
	}
	out := make([]string, len(v))
	for i, x := range v {
		out[i], _ = x.(string)
	}
	return out, nil
}

// Refund reads the refund the ledger let through, if any: to whom and how much.
func (l *Ledger) Refund(ctx context.Context) (user string, amount int64, ok bool, err error) {
	v, err := l.c.HMGet(ctx, l.key, "refund_user", "refund").Result()
	if err != nil {
		return "", 0, false, fmt.Errorf("reading the refund in %s: %w", l.key, err)
	}
	if v[0] == nil {
		return "", 0, false, nil
	}
	user, _ = v[0].(string)
	return user, hashInt(v[1]), true, nil
}

// hashInt is a hash field's integer, 0 when absent or not a number.
func hashInt(x any) int64 {
	s, _ := x.(string)
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}

// ClaimOf reads the user's claim on the shard, if any.
func (a *Shard) ClaimOf(ctx context.Context, user string) (Claim, bool, error) {
	v, err := a.c.HGet(ctx, a.keys.Claims, user).Result()
	if errors.Is(err, redis.Nil) {
		return Claim{}, false, nil
	}
	if err != nil {
		return Claim{}, false, fmt.Errorf("reading the claim of %q in %s: %w", user, a.keys.Claims, err)
	}
	c, ok := parseClaim(v)
	if !ok {
		return Claim{}, false, fmt.Errorf("the claim of %q in %s is malformed", user, a.keys.Claims)
	}
	return c, true, nil
}

// Entry reads the settlement stream's entry id, decoded; ok is false when the stream
// has no such entry.
func (s *Stream) Entry(ctx context.Context, id string) (e StreamEntry, ok bool, err error) {
	msgs, err := s.c.XRange(ctx, s.keys.Stream, id, id).Result()
	if err != nil {
		return StreamEntry{}, false, fmt.Errorf("reading entry %s of %s: %w", id, s.keys.Stream, err)
	}
	if len(msgs) == 0 {
		return StreamEntry{}, false, nil
	}
	return decodeMessages(msgs)[0], true, nil
}

// LatestRefund finds the stream's latest refund entry, reading from the end in pages
// of 500 (an activity writes its one refund at its close, after its last grant).
func (s *Stream) LatestRefund(ctx context.Context) (e StreamEntry, ok bool, err error) {
	end := "+"
	for {
		msgs, err := s.c.XRevRangeN(ctx, s.keys.Stream, end, "-", 500).Result()
		if err != nil {
			return StreamEntry{}, false, fmt.Errorf("reading %s: %w", s.keys.Stream, err)
		}
		for _, e := range decodeMessages(msgs) {
			if e.Kind == KindRefund && e.Malformed == nil {
				return e, true, nil
			}
		}
		if len(msgs) < 500 {
			return StreamEntry{}, false, nil
		}
		end = "(" + msgs[len(msgs)-1].ID
	}
}

// PacketCredit is one credit a budget's packet ledger let through: a share's grant,
// or the refund (Share RefundShare).
type PacketCredit struct {
	PacketID, Share, UserID string
	Amount                  int64
	At                      time.Time
}

// Kind is the credit's kind, KindGrant or KindRefund.
func (c PacketCredit) Kind() string {
	if c.Share == RefundShare {
		return KindRefund
	}
	return KindGrant
}

// ScanPackets reads one page of the ids of the packets the budget's ledger holds an
// account of, from cursor (0 to start); next is 0 after the last page. It scans the
// keyspace of the node that holds the ledger (on a Redis Cluster, the node of the
// budget's hash tag), about scanPage keys a call.
func (l *BudgetLedger) ScanPackets(ctx context.Context, cursor uint64) (ids []string, next uint64, err error) {
	c := l.c
	if cc, ok := l.c.(interface {
		MasterForKey(context.Context, string) (*redis.Client, error)
	}); ok {
		node, err := cc.MasterForKey(ctx, l.key)
		if err != nil {
			return nil, 0, fmt.Errorf("finding the node of %s: %w", l.key, err)
		}
		c = node
	}
	prefix := l.PacketKey("")
	keys, next, err := c.Scan(ctx, cursor, escapeGlob(prefix)+"*", scanPage).Result()
	if err != nil {
		return nil, 0, fmt.Errorf("scanning the packet ledgers %s*: %w", prefix, err)
	}
	ids = make([]string, 0, len(keys))
	for _, k := range keys {
		ids = append(ids, strings.TrimPrefix(k, prefix))
	}
	return ids, next, nil
}

// escapeGlob escapes the characters SCAN's MATCH reads as a pattern.
func escapeGlob(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// PacketCredits reads what the ledger credited against each packet: its shares'
// grants and its refund, and whether it holds the packet's account at all (a packet
// forgotten after the retention has none). One pipelined HGETALL per packet.
func (l *BudgetLedger) PacketCredits(ctx context.Context, ids []string) (credits map[string][]PacketCredit, known map[string]bool, err error) {
	credits, known = map[string][]PacketCredit{}, map[string]bool{}
	if len(ids) == 0 {
		return credits, known, nil
	}
	cmds := make([]*redis.MapStringStringCmd, len(ids))
	pipe := l.c.Pipeline()
	for i, id := range ids {
		cmds[i] = pipe.HGetAll(ctx, l.PacketKey(id))
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, nil, fmt.Errorf("reading %d packet ledgers of %s: %w", len(ids), l.key, err)
	}
	for i, id := range ids {
		fields := cmds[i].Val()
		if len(fields) == 0 {
			continue
		}
		known[id] = true
		for share, record := range fields {
			if share == OpenShare || share == "sh" || share == "paid" || share == "ev" {
				continue
			}
			c, err := parsePacketCredit(id, share, record)
			if err != nil {
				return nil, nil, fmt.Errorf("the ledger of packet %q: %w", id, err)
			}
			credits[id] = append(credits[id], c)
		}
	}
	return credits, known, nil
}

// parsePacketCredit reads a packet ledger's record of a credited share or refund,
// "<amount>:<at ms>:<user>".
func parsePacketCredit(packetID, share, record string) (PacketCredit, error) {
	parts := strings.SplitN(record, ":", 3)
	if len(parts) != 3 {
		return PacketCredit{}, fmt.Errorf("share %s holds %q, not <amount>:<at>:<user>", share, record)
	}
	amount, err1 := strconv.ParseInt(parts[0], 10, 64)
	at, err2 := strconv.ParseInt(parts[1], 10, 64)
	if err1 != nil || err2 != nil {
		return PacketCredit{}, fmt.Errorf("share %s holds %q, not <amount>:<at>:<user>", share, record)
	}
	return PacketCredit{PacketID: packetID, Share: share, UserID: parts[2], Amount: amount, At: time.UnixMilli(at)}, nil
}
