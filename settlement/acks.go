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

// ackAnswer is what became of an ackCall: beforeErr when the source's step before
// the acknowledgement failed (Verifier.BeforeAck: a budget's refund whose packet could
// not be forgotten; the entry was not acknowledged), else the acknowledgement's result.
type ackAnswer struct {
	settled   bool
	err       error
	beforeErr error
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

// ackBatch runs the source's step before the acknowledgement on calls
// (Verifier.BeforeAck: a budget's workers forget the packets of the refunds among
// them), then acknowledges, in one round trip, every entry whose step went through,
// and answers each call.
func (w *Worker) ackBatch(ctx context.Context, calls []ackCall) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), redisOpTimeout)
	defer cancel()
	answers := make([]ackAnswer, len(calls))
	entries := make([]store.StreamEntry, len(calls))
	for i, c := range calls {
		entries[i] = c.entry
	}
	for i, err := range w.verifier.BeforeAck(actx, entries) {
		answers[i].beforeErr = err
	}
	reqs := make([]store.AckRequest, 0, len(calls))
	at := make([]int, 0, len(calls))
	for i, c := range calls {
		if answers[i].beforeErr == nil {
			reqs = append(reqs, store.AckRequest{EntryID: c.id, Kind: c.entry.Kind, Amount: c.entry.Amount})
			at = append(at, i)
		}
	}
	if len(reqs) > 0 {
		for k, r := range w.stream.AckMany(actx, w.cfg.Group, reqs) {
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
