package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// Moves of money between budget shards. A budget's total is allotted to its shards in
// equal parts, and a packet lives on the shard its id hashes to, so a shard can run
// dry while its siblings hold money. A creation its shard cannot pay then makes the
// shard borrow from its siblings before it is refused: budget_exhausted answers only
// a creation the whole budget cannot pay (TestBudgetNeverRefusesMoneyItHas).
//
// A move takes three steps, each one atomic on one shard, since the shards have
// their own hash tags (slots of a Redis Cluster): budget_lend takes the money out of
// the lender's available and records the move under way on the lender (one at a
// time), budget_borrow adds it to the borrower once (it keeps the last sequence
// number it applied per lender), and budget_lend_done clears the lender's record.
// Every shard keeps allotted + borrowed - lent = available + live + claimed +
// refunded at every instant, and the budget's snapshot counts what was lent and not
// yet borrowed as available. A crash after any step loses nothing: the record on the
// lender says what is in transit, and whoever finds it finishes the move (the next
// borrower that asks that lender, and the operator's expiry driver every pass,
// FinishMoves) with the same two idempotent steps (TestBudgetMoveSurvivesACrash).

// maxMoveAttempts bounds the creations one Create tries on a dry shard: each attempt
// borrows at least the creation's total from the siblings, so only creators racing
// for the same money make more than one.
const maxMoveAttempts = 8

// refill is what refillShard came to.
type refill int

const (
	// refilled: shard i held at least need after the moves.
	refilled refill = iota
	// refillRaced: the shards together held need, but racing borrowers took it
	// from under the moves; reading again may find it.
	refillRaced
	// refillShort: all the shards together hold less than need: the creation is
	// one the whole budget cannot pay.
	refillShort
)

// refillShard moves money to shard i from its siblings, the richest first, until
// shard i holds at least need or no sibling has money left, and says which
// (refilled, refillRaced). When all the shards together hold less than need (as
// read, one pipeline), it moves nothing: refillShort.
func (b *Budget) refillShard(ctx context.Context, i int, need int64) (refill, error) {
	avail, err := b.shardsAvailable(ctx)
	if err != nil {
		return refillShort, err
	}
	// A move under way (lent, not yet borrowed: a racing borrower's, or one cut
	// short) holds money that is in no shard's available, and the shards are read
	// one after another, so a move that completes between the reads of its two
	// shards is missed too. Before the budget is called short, moves under way are
	// landed (FinishMoves is safe beside the movers) and the shards read again, up
	// to refillReads times.
	for range refillReads - 1 {
		if sumAvailable(avail) >= need {
			break
		}
		if _, err := b.FinishMoves(ctx); err != nil {
			return refillShort, err
		}
		if avail, err = b.shardsAvailable(ctx); err != nil {
			return refillShort, err
		}
	}
	order := make([]int, 0, len(avail)-1)
	for j := range avail {
		if j != i && avail[j] > 0 {
			order = append(order, j)
		}
	}
	slices.SortFunc(order, func(x, y int) int { return int(min(max(avail[y]-avail[x], -1), 1)) })
	if sumAvailable(avail) < need {
		return refillShort, nil
	}
	got := avail[i]
	for _, j := range order {
		if got >= need {
			break
		}
		moved, err := b.moveFrom(ctx, j, i, need-got)
		if err != nil {
			return refillShort, err
		}
		got += moved
	}
	if got >= need {
		return refilled, nil
	}
	return refillRaced, nil
}

// refillReads bounds how often refillShard reads the shards before it calls the
// budget short.
const refillReads = 4

// sumAvailable is the money available over the shards, those below zero (only a
// write outside the scripts makes one) counted as none.
func sumAvailable(avail []int64) int64 {
	var sum int64
	for _, a := range avail {
		sum += max(a, 0)
	}
	return sum
}

// shardsAvailable reads every shard's available money, in one pipeline.
func (b *Budget) shardsAvailable(ctx context.Context) ([]int64, error) {
	pipe := b.c.Pipeline()
	cmds := make([]*redis.StringCmd, len(b.keys))
	for j, k := range b.keys {
		cmds[j] = pipe.HGet(ctx, k.Meta, "available")
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("reading the budget shards' available money: %w", err)
	}
	out := make([]int64, len(cmds))
	for j, c := range cmds {
		v, err := c.Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading budget shard %d's available money: %w", j, err)
		}
		if out[j], err = strconv.ParseInt(v, 10, 64); err != nil {
			return nil, fmt.Errorf("budget shard %d's available money %q: %w", j, v, err)
		}
	}
	return out, nil
}

// moveFrom moves money from shard j to shard i, at least need unless j holds less,
// and returns how much. A move of j still under way is finished first.
func (b *Budget) moveFrom(ctx context.Context, j, i int, need int64) (int64, error) {
	for range 3 {
		reply, err := b.call(ctx, lua.BudgetLendScript, []string{b.keys[j].Meta}, i, need).StringSlice()
		if err != nil {
			return 0, fmt.Errorf("lending from budget shard %d to %d: %w", j, i, err)
		}
		switch {
		case len(reply) == 3 && reply[0] == "lent":
			seq, err1 := strconv.ParseInt(reply[1], 10, 64)
			amount, err2 := strconv.ParseInt(reply[2], 10, 64)
			if err := errors.Join(err1, err2); err != nil {
				return 0, fmt.Errorf("lending from budget shard %d: reply %q: %w", j, reply, err)
			}
			if err := b.finishMove(ctx, j, move{seq: seq, to: i, amount: amount}); err != nil {
				return 0, err
			}
			return amount, nil
		case len(reply) == 2 && reply[0] == "busy":
			m, err := b.parseMove(reply[1])
			if err != nil {
				return 0, fmt.Errorf("budget shard %d's move under way: %w", j, err)
			}
			if err := b.finishMove(ctx, j, m); err != nil {
				return 0, err
			}
		case len(reply) >= 1 && (reply[0] == "dry" || reply[0] == "closed"):
			return 0, nil
		default:
			return 0, fmt.Errorf("lending from budget shard %d: reply %q", j, reply)
		}
	}
	return 0, nil // the lender's moves kept being taken by others: try the next one
}

// move is a move of money between two shards as the lender records it.
type move struct {
	seq    int64
	to     int
	amount int64
}

// parseMove reads a lender's record of its move under way, "<seq>:<to>:<amount>".
func (b *Budget) parseMove(rec string) (move, error) {
	parts := strings.Split(rec, ":")
	if len(parts) != 3 {
		return move{}, fmt.Errorf("record %q is not <seq>:<to>:<amount>", rec)
	}
	seq, err1 := strconv.ParseInt(parts[0], 10, 64)
	to, err2 := strconv.Atoi(parts[1])
	amount, err3 := strconv.ParseInt(parts[2], 10, 64)
	if err := errors.Join(err1, err2, err3); err != nil || seq < 1 || to < 0 || to >= len(b.keys) || amount < 1 {
		return move{}, fmt.Errorf("record %q is not <seq>:<to>:<amount> of this budget", rec)
	}
	return move{seq: seq, to: to, amount: amount}, nil
}

// finishMove runs the last two steps of lender j's move m: the borrower takes the
// money (once, whoever asks), then the lender clears its record.
func (b *Budget) finishMove(ctx context.Context, j int, m move) error {
	if err := b.call(ctx, lua.BudgetBorrowScript, []string{b.keys[m.to].Meta}, j, m.seq, m.amount).Err(); err != nil {
		return fmt.Errorf("moving %d from budget shard %d to %d: %w", m.amount, j, m.to, err)
	}
	if err := b.call(ctx, lua.BudgetLendDoneScript, []string{b.keys[j].Meta}, m.seq).Err(); err != nil {
		return fmt.Errorf("closing the move of %d from budget shard %d to %d: %w", m.amount, j, m.to, err)
	}
	return nil
}

// FinishMoves finishes every move between the budget's shards still under way (a
// borrower that crashed between the steps) and reports how many it finished. The
// operator's expiry driver calls it every pass; it is safe beside borrowers at work.
func (b *Budget) FinishMoves(ctx context.Context) (int, error) {
	if len(b.keys) < 2 {
		return 0, nil
	}
	pipe := b.c.Pipeline()
	cmds := make([]*redis.StringCmd, len(b.keys))
	for j, k := range b.keys {
		cmds[j] = pipe.HGet(ctx, k.Meta, "lend")
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return 0, fmt.Errorf("reading the budget shards' moves under way: %w", err)
	}
	n := 0
	for j, c := range cmds {
		rec, err := c.Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			return n, fmt.Errorf("reading budget shard %d's move under way: %w", j, err)
		}
		m, err := b.parseMove(rec)
		if err != nil {
			return n, fmt.Errorf("budget shard %d's move under way: %w", j, err)
		}
		if err := b.finishMove(ctx, j, m); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}
