package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"redpacket.io/operator/controllers"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// refundRun is the settlement of a budget's packets expiring in the same second:
// Packets packets (one share of every fourth grabbed) due at one whole second by the
// Redis clock, expired by the operator's expiry driver (controllers.BudgetExpiry)
// while the budget's settlement workers (settlement.NewBudgetWorkers, the
// production defaults, one per budget shard) run against a benchReceiver.
type refundRun struct {
	Packets, Shards int
	Grabbed         int // shares grabbed before expiry (their grants are settled too)
	// Expired is how long the expiry pass took; Credited is from its start until the
	// receiver credited the last refund.
	Expired, Credited time.Duration
	// Refunded is the money the expiry refunded (store figures); Credited refunds are
	// what the receiver credited as refunds.
	Refunded, CreditedRefunds int64
	Requests, Repeats         int64
	PeakLimit                 float64 // the highest sum of the workers' limits
	DeadLetters               int64
}

// measureRefunds creates o.refundPackets packets of a 16-shard budget due in the same
// second, grabs one share of every fourth, waits for the second, and times the
// expiry and the settlement of every refund. Every refund must be credited exactly
// (the sum credited as refunds equals the sum expiry refunded, which is every
// packet's total less its grabbed share) and the budget's ledger must agree.
//
// With profile set, the process's CPU profile from the expiry's start until the last
// refund is credited is written there.
func measureRefunds(ctx context.Context, o options, redisSrv *redistest.Server, profile string) (refundRun, error) {
	const uid = "bench-refunds"
	shards := o.budgetShards
	run := refundRun{Packets: o.refundPackets, Shards: shards}
	conn := redisSrv.Conn()
	rc := conn.NewClient(redisconn.ClientOptions{PoolSize: 64})
	defer func() { _ = rc.Close() }()
	b := store.NewBudget(rc, uid, shards)
	defer func() { _ = b.Purge(context.WithoutCancel(ctx)) }()
	totalOf := func(p int) int64 { return 5 + int64(p%996) }
	var total int64
	for p := range o.refundPackets {
		total += totalOf(p)
	}
	limits := store.BudgetLimits{Currency: settlement.DefaultCurrency, MaxTotal: 1000, MaxCount: 5, MinShare: 1,
		Distributions: []string{split.TypeRandom}, DefaultTTL: o.refundLead, MaxTTL: 2 * o.refundLead}

	grabs := o.refundPackets / 4
	recv := newBenchReceiver(failureMix{}, o.refundPackets+grabs)
	url, stopRecv, err := recv.serve()
	if err != nil {
		return run, err
	}
	defer stopRecv()
	reg := prometheus.NewRegistry()
	cfg := settlement.BudgetConfigFor("default", uid, uid, settlement.DefaultCurrency, url, 0, nil,
		settlement.Packets{MaxCount: limits.MaxCount, MaxTTL: limits.MaxTTL})
	cfg.Consumer = "bench"
	cfg.Registerer = reg
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg.Redis = rc
	// The budget holds twice what the packets take: its shards' allotments are even
	// shares of it, and the packets' hashes spread them unevenly.
	if _, err := settlement.AnnounceBudgetTotal(ctx, cfg, b, 2*total); err != nil {
		return run, err
	}
	if err := b.Configure(ctx, 2*total, limits); err != nil {
		return run, fmt.Errorf("configuring the budget: %w", err)
	}

	// Every packet is due at the same whole second by the Redis clock (the server
	// runs on this machine's clock), 100 ms into it.
	now, err := rc.Time(ctx).Result()
	if err != nil {
		return run, fmt.Errorf("reading the Redis clock: %w", err)
	}
	due := now.Add(o.refundLead).Truncate(time.Second).Add(time.Second)
	fmt.Printf("(g) refunds: creating %d packets over %d shards, due at %s ... ", o.refundPackets, shards, due.Format("15:04:05"))
	created := time.Now()
	var next, grabbed atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for range 32 {
		wg.Go(func() {
			for ctx.Err() == nil {
				p := int(next.Add(1)) - 1
				if p >= o.refundPackets {
					return
				}
				id := fmt.Sprintf("refund-%06d", p)
				ttl := time.Until(due.Add(100 * time.Millisecond)).Truncate(time.Millisecond)
				_, outcome, err := b.CreatePacket(ctx, store.NewPacket{ID: id, Sender: "merchant-7", Total: totalOf(p), Count: 5,
					Distribution: split.TypeRandom, TTL: ttl})
				if err == nil && outcome != store.CreateCreated {
					err = fmt.Errorf("packet %s: %s", id, outcome)
				}
				if err == nil && p%4 == 0 {
					var g store.PacketGrab
					if g, err = b.GrabPacket(ctx, id, "u:"+id); err == nil && g.Outcome != store.PacketGranted {
						err = fmt.Errorf("grabbing packet %s: %s", id, g.Outcome)
					}
					grabbed.Add(1)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	select {
	case err := <-errs:
		return run, err
	default:
	}
	run.Grabbed = int(grabbed.Load())
	fmt.Printf("%s ... ", time.Since(created).Round(time.Millisecond))
	if time.Now().After(due) {
		return run, fmt.Errorf("creating the packets took past their due second: raise -settlement-refund-lead (%s)", o.refundLead)
	}

	ws, err := settlement.NewBudgetWorkers(cfg, b)
	if err != nil {
		return run, err
	}
	wctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	limitsSeen := sampleGauge(wctx, reg, "redpacket_settlement_concurrency_limit")
	go func() { done <- settlement.RunAll(wctx, ws) }()
	defer func() {
		stop()
		<-done
	}()
	// The expiry driver's pass, once the second is over by the Redis clock.
	if !sleepCtx(ctx, time.Until(due)+1200*time.Millisecond) {
		return run, ctx.Err()
	}
	expiry := controllers.NewBudgetExpiry()
	expiry.Track(uid, b)
	stopProfile, err := startCPUProfile(profile)
	if err != nil {
		return run, err
	}
	defer stopProfile()
	// One pass of a budget stops after PassLimit (the driver's fairness across
	// budgets), so the packets are expired by as many passes as that takes, back to
	// back: the driver itself starts the next one 250 ms after the last ended.
	start := time.Now()
	var n, refunded int64
	for passes := 0; n < int64(o.refundPackets); passes++ {
		got, amount := expiry.ExpireOnce(ctrllog.IntoContext(ctx, logr.Discard()))
		if got == 0 || passes > 100 {
			return run, fmt.Errorf("%d expiry passes expired %d of %d packets", passes+1, n+int64(got), o.refundPackets)
		}
		n, refunded = n+int64(got), refunded+amount
	}
	run.Expired, run.Refunded = time.Since(start), refunded
	deadline := time.NewTimer(o.settleLimit)
	defer deadline.Stop()
	select {
	case <-recv.full:
		run.Credited = time.Since(start)
	case <-deadline.C:
	case <-ctx.Done():
		return run, ctx.Err()
	}
	recv.mu.Lock()
	run.Requests, run.Repeats, run.CreditedRefunds = recv.requests, recv.repeats, recv.refunded
	refunds, sum := recv.refunds, recv.sum
	recv.mu.Unlock()
	run.PeakLimit, _ = limitsSeen()
	for i := range shards {
		if dead, err := b.Stream(i).DeadLetters(ctx); err == nil {
			run.DeadLetters += int64(len(dead))
		}
	}
	if run.Credited == 0 {
		return run, fmt.Errorf("refunds: %d of %d credited within %s (%d dead letters)", refunds, o.refundPackets, o.settleLimit, run.DeadLetters)
	}
	snap, err := b.Snapshot(ctx)
	if err != nil {
		return run, err
	}
	switch {
	case refunds != int64(o.refundPackets) || run.CreditedRefunds != refunded || refunded != snap.Refunded:
		return run, fmt.Errorf("refunds: %d credited for %d, want %d for %d (the budget says %d)",
			refunds, run.CreditedRefunds, o.refundPackets, refunded, snap.Refunded)
	case sum != total || snap.Claimed+snap.Refunded != total:
		return run, fmt.Errorf("refunds: credited %d in all, want the packets' %d (claimed %d + refunded %d)", sum, total, snap.Claimed, snap.Refunded)
	}
	sums, err := b.SettlementLedger(0).Sums(ctx)
	if err != nil {
		return run, err
	}
	if sums.Refunded != refunded || sums.Granted != snap.Claimed {
		return run, fmt.Errorf("refunds: the ledger has %d refunded and %d granted, want %d and %d", sums.Refunded, sums.Granted, refunded, snap.Claimed)
	}
	return run, nil
}

// line is the console line of a refund run.
func (r refundRun) line() string {
	return fmt.Sprintf("expired in %s, every refund credited in %s (%.0f/s) from the expiry's start; %d deliveries (%d repeats), limits peaking at %.0f over %d workers, %d dead letters",
		r.Expired.Round(time.Millisecond), r.Credited.Round(time.Millisecond), float64(r.Packets)/r.Credited.Seconds(),
		r.Requests, r.Repeats, r.PeakLimit, r.Shards, r.DeadLetters)
}

// refundGoal is the budget issue's goal for settling a second's refunds.
const refundGoal = 60 * time.Second

// markdown is the refund run's part of docs/benchmarks.md.
func (r refundRun) markdown() string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	p("### Refunds of %d packets expiring in the same second\n\n", r.Packets)
	p("A budget of %d shards with %d packets due at one whole second by the Redis clock (one share of\n", r.Shards, r.Packets)
	p("every fourth grabbed before), expired by the operator's expiry driver (`controllers.BudgetExpiry`,\n")
	p("one pass, batches of %d), while the budget's settlement workers (`settlement.NewBudgetWorkers`,\n", store.DefaultExpireBatch)
	p("one per shard, the production defaults) deliver to the benchmark's balance system:\n\n")
	p("| packets | expired in | every refund credited in | per second | deliveries | limits' peak (sum) | dead letters |\n")
	p("|---:|---:|---:|---:|---:|---:|---:|\n")
	p("| %d | %s | **%s** | %.0f | %d | %.0f | %d |\n\n", r.Packets, r.Expired.Round(time.Millisecond),
		r.Credited.Round(time.Millisecond), float64(r.Packets)/r.Credited.Seconds(), r.Requests, r.PeakLimit, r.DeadLetters)
	p("Goal: every refund exact and credited within %s of the expiry. The run checks that the refunds\n", refundGoal)
	p("credited add up to what expiry refunded, the grants and refunds to the budget's total, and the\n")
	p("budget's ledger to both.\n\n")
	return b.String()
}
