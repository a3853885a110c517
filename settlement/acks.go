package settlement

import (
	"context"
	"fmt"
	"strings"

	"redpacket.io/operator/store"
)

// Acknowledgements go to Redis in batches. A job whose delivery got a 2xx hands its
// entry to the worker's acknowledger (runAcks) and waits for the answer; the
// acknowledger takes every entry waiting at that moment, up to maxAckBatch, and
// acknowledges them in one round trip (store.Shard.AckMany: one settle_ack.lua call
// per entry, pipelined, each counting its entry once), after forgetting, in one
// round trip too, the packets of the budget refunds among them
// (store.Budget.ForgetPackets). It never waits for more entries to come, so a lone
// acknowledgement goes out at once; under load the entries that finished while the
// last round trip ran go out together. Profiles of the settlement benchmark showed
// one round trip per acknowledgement (and one more per refund) costing the worker
// more CPU than the webhook POSTs.

// maxAckBatch is the most entries one acknowledging round trip carries.
const maxAckBatch = 256

// ackCall is one job's delivered entry to acknowledge.
type ackCall struct {
	id    string
	entry store.StreamEntry
	done  chan ackAnswer // buffered: the acknowledger never waits for the job
}

// ackAnswer is what became of an ackCall: forgetErr when the refund's packet could not
// be forgotten (the entry was not acknowledged), else the acknowledgement's result.
type ackAnswer struct {
	settled   bool
	err       error
	forgetErr error
}

// acknowledge has the acknowledger forget the packet of a refund entry (a budget's)
// and acknowledge the entry, and returns what became of it; an answer that does not
// come before ctx ends is an error (the entry is acknowledged again later, which
// counts nothing twice).
func (w *Worker) acknowledge(ctx context.Context, id string, e store.StreamEntry) ackAnswer {
	call := ackCall{id: id, entry: e, done: make(chan ackAnswer, 1)}
	select {
	case w.acks <- call:
	case <-ctx.Done():
		return ackAnswer{err: fmt.Errorf("acknowledging %s: %w", id, ctx.Err())}
	}
	select {
	case a := <-call.done:
		return a
	case <-ctx.Done():
		return ackAnswer{err: fmt.Errorf("acknowledging %s: %w", id, ctx.Err())}
	}
}

// runAcks serves the ackCalls in batches until ctx is done. Run stops it only after
// every job has ended, so no job waits for it in vain.
func (w *Worker) runAcks(ctx context.Context) {
	batch := make([]ackCall, 0, maxAckBatch)
	for {
		select {
		case <-ctx.Done():
			return
		case c := <-w.acks:
			batch = append(batch[:0], c)
		}
	more:
		for len(batch) < maxAckBatch {
			select {
			case c := <-w.acks:
				batch = append(batch, c)
			default:
				break more
			}
		}
		w.ackBatch(ctx, batch)
	}
}

// ackBatch forgets the packets of the refunds among calls (a budget's workers), then
// acknowledges, in one round trip, every entry whose packet was forgotten or needed
// no forgetting, and answers each call.
func (w *Worker) ackBatch(ctx context.Context, calls []ackCall) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), redisOpTimeout)
	defer cancel()
	answers := make([]ackAnswer, len(calls))
	if w.packets != nil {
		var ids []string
		var at []int
		for i, c := range calls {
			if id, ok := refundedPacket(c.entry); ok {
				ids = append(ids, id)
				at = append(at, i)
			}
		}
		if len(ids) > 0 {
			for k, err := range w.packets.forget(actx, ids) {
				if err != nil {
					answers[at[k]].forgetErr = fmt.Errorf("forgetting packet %q after its refund was delivered: %w", ids[k], err)
				}
			}
		}
	}
	reqs := make([]store.AckRequest, 0, len(calls))
	at := make([]int, 0, len(calls))
	for i, c := range calls {
		if answers[i].forgetErr == nil {
			reqs = append(reqs, store.AckRequest{EntryID: c.id, Kind: c.entry.Kind, Amount: c.entry.Amount})
			at = append(at, i)
		}
	}
	if len(reqs) > 0 {
		for k, r := range w.redis.AckMany(actx, w.cfg.Group, reqs) {
			answers[at[k]].settled, answers[at[k]].err = r.Settled, r.Err
		}
	}
	for i, c := range calls {
		c.done <- answers[i]
	}
}

// refundedPacket is the packet id of a budget's refund entry ("<packetId>/refund"),
// whose packet is forgotten once the refund is delivered.
func refundedPacket(e store.StreamEntry) (string, bool) {
	if e.Kind != store.KindRefund {
		return "", false
	}
	return strings.CutSuffix(e.PacketID, "/"+store.RefundShare)
}
