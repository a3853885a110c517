package store_test

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// Seed 004 at its volume: group packets created at runtime from one budget, each
// raced by its group. 10,000 packets of 5 shares are created concurrently, then
// 100 users race each one (1,000,000 grab attempts, many goroutines over the
// client's pool through the grab service's auto-pipeliner), on one server and on a cluster of three masters. Every packet
// must have exactly 5 winners, distinct, whose amounts sum to its total, and a
// sampler checks throughout that the budget is conserved.
func TestSeed004AtVolume(t *testing.T) {
	t.Run("standalone", func(t *testing.T) {
		s := redistest.Start(t)
		c := redis.NewClient(&redis.Options{Addr: s.Addr, Username: s.Username, Password: s.Password, PoolSize: 64})
		t.Cleanup(func() { _ = c.Close() })
		ap, err := c.AutoPipelineWithOptions(redisconn.GrabPipelineOptions())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ap.Close() })
		runSeed004AtVolume(t, c, ap)
	})
	t.Run("cluster", func(t *testing.T) {
		cl := redistest.StartCluster(t, 3)
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs, Username: cl.Username, Password: cl.Password, PoolSize: 32})
		t.Cleanup(func() { _ = c.Close() })
		ap, err := c.AutoPipelineWithOptions(redisconn.GrabPipelineOptions())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ap.Close() })
		runSeed004AtVolume(t, c, ap)
		// The shards, and so the packets, spread over every master.
		masters := map[string]int{}
		b := store.NewBudget(c, "seed-004-volume", 16)
		for i := range b.N() {
			node, err := c.MasterForKey(redistest.Context(t), b.ShardKeys(i).Meta)
			if err != nil {
				t.Fatal(err)
			}
			masters[node.Options().Addr]++
		}
		if len(masters) != 3 {
			t.Fatalf("the 16 shards are on %d masters: %v", len(masters), masters)
		}
		t.Logf("shards per master: %v", masters)
	})
}

// grabAnswer is one grab attempt's answer, kept compact: a million of them.
type grabAnswer struct {
	outcome store.PacketGrabOutcome
	share   int32
	amount  int64
}

// runSeed004AtVolume runs the scenario with the operator's handle on c (configure,
// snapshots, checks) and the grab fleet's on via (creations and grabs): the grab
// service's auto-pipeliner over c's pool.
func runSeed004AtVolume(t *testing.T, c redis.UniversalClient, via redis.Cmdable) {
	ctx := redistest.Context(t)
	const (
		packets  = 10_000
		users    = 100
		shares   = 5
		maxTotal = 20_000
		total    = packets * maxTotal
	)
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: maxTotal, MaxCount: 100, MinShare: 1,
		Distributions: []string{split.TypeRandom, split.TypeLineCut, split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}
	b := configuredBudget(t, ctx, c, "seed-004-volume", 16, total, limits)
	fleet := store.NewBudget(via, "seed-004-volume", 16)
	start := time.Now()

	// The sampler: the budget adds up at every instant it reads.
	var (
		samples, bad atomic.Int64
		stop         = make(chan struct{})
		sampled      sync.WaitGroup
		firstBad     atomic.Value
	)
	sampled.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			s, err := b.Snapshot(ctx)
			if err != nil {
				firstBad.CompareAndSwap(nil, err.Error())
				bad.Add(1)
				continue
			}
			samples.Add(1)
			if !s.Conserved() || s.Total != total {
				firstBad.CompareAndSwap(nil, fmt.Sprintf("%+v", s))
				bad.Add(1)
			}
		}
	})

	id := func(p int) string { return fmt.Sprintf("order-%05d", p) }
	totalOf := func(p int) int64 { return shares + int64(p*7919)%(maxTotal-shares+1) }
	dists := []string{split.TypeRandom, split.TypeLineCut, split.TypeFixed}

	// Creation: several goroutines, each taking the next packet.
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for range 16 {
		wg.Go(func() {
			for {
				p := int(next.Add(1)) - 1
				if p >= packets {
					return
				}
				r, err := fleet.Create(ctx, store.NewPacket{ID: id(p), Sender: fmt.Sprintf("sharer-%d", p%97),
					Total: totalOf(p), Count: shares, Distribution: dists[p%3]})
				if err == nil && r.Outcome != store.CreateCreated {
					err = fmt.Errorf("packet %d: %s (%s)", p, r.Outcome, r.Reason)
				}
				if err != nil {
					select {
					case errs <- err:
					default:
					}
					return
				}
			}
		})
	}
	progress := func(what string, total int) func() {
		done := make(chan struct{})
		go func() {
			for {
				select {
				case <-done:
					return
				case <-time.After(10 * time.Second):
					t.Logf("%s: %d of %d after %v", what, min(int(next.Load()), total), total, time.Since(start).Round(time.Second))
				}
			}
		}()
		return func() { close(done) }
	}
	stopProgress := progress("created", packets)
	wg.Wait()
	stopProgress()
	created := time.Since(start)
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}

	// The race: consecutive attempts are the same packet's, so many goroutines race
	// each packet at once.
	answers := make([]grabAnswer, packets*users)
	next.Store(0)
	grabStart := time.Now()
	for range 256 {
		wg.Go(func() {
			for {
				a := int(next.Add(1)) - 1
				if a >= len(answers) {
					return
				}
				g, err := fleet.GrabPacket(ctx, id(a/users), fmt.Sprintf("user-%03d", a%users))
				if err != nil {
					select {
					case errs <- err:
					default:
					}
					return
				}
				answers[a] = grabAnswer{outcome: g.Outcome, share: int32(g.Share), amount: g.Amount}
			}
		})
	}
	stopProgress = progress("grab attempts", len(answers))
	wg.Wait()
	stopProgress()
	grabbed := time.Since(grabStart)
	close(stop)
	sampled.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}

	// Every packet exact: 5 winners, distinct, summing to its total, in the detail
	// list in grab order, and the rest sold out.
	var claimed int64
	for p := range packets {
		var sum int64
		var winners []string
		seen := map[int32]bool{}
		for u := range users {
			a := answers[p*users+u]
			switch a.outcome {
			case store.PacketGranted:
				if seen[a.share] || a.share < 0 || a.share >= shares {
					t.Fatalf("packet %d: share %d granted twice or out of range", p, a.share)
				}
				seen[a.share] = true
				sum += a.amount
				winners = append(winners, fmt.Sprintf("user-%03d", u))
			case store.PacketSoldOut:
			default:
				t.Fatalf("packet %d, user %d: %s", p, u, a.outcome)
			}
		}
		if len(winners) != shares || sum != totalOf(p) {
			t.Fatalf("packet %d: %d winners summing to %d, want %d summing to %d", p, len(winners), sum, shares, totalOf(p))
		}
		claimed += sum
		if p%10 == 0 { // the detail of one packet in ten
			d, ok, err := b.Packet(ctx, id(p))
			if err != nil || !ok || len(d.Grabs) != shares || d.RemainingAmount != 0 || d.RemainingCount != 0 {
				t.Fatalf("detail of packet %d: %+v, %v, %v", p, d, ok, err)
			}
			var inDetail []string
			for i, g := range d.Grabs {
				if g.Share != i {
					t.Fatalf("packet %d: detail out of grab order: %+v", p, d.Grabs)
				}
				inDetail = append(inDetail, g.UserID)
			}
			slices.Sort(inDetail)
			if !slices.Equal(inDetail, winners) {
				t.Fatalf("packet %d: detail's users %v, winners %v", p, inDetail, winners)
			}
		}
	}
	// The streams hold one creation record per packet, before its grants, and one
	// grant per winner, none twice for a user in a packet.
	grants := 0
	perPacket := map[string]map[string]bool{}
	records := map[string]bool{}
	for i := range b.N() {
		entries, err := b.Stream(i).Entries(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if e.Malformed == nil && e.Kind == store.KindCreate && !records[e.PacketID] && perPacket[e.PacketID] == nil {
				records[e.PacketID] = true
				continue
			}
			if e.Malformed != nil || e.Kind != store.KindGrant || !records[e.PacketID[:len("order-00000")]] {
				t.Fatalf("shard %d entry %+v (a grant after its packet's creation record)", i, e)
			}
			pid := e.PacketID[:len("order-00000")]
			if perPacket[pid] == nil {
				perPacket[pid] = map[string]bool{}
			}
			if perPacket[pid][e.UserID] {
				t.Fatalf("user %s has two grants in packet %s", e.UserID, pid)
			}
			perPacket[pid][e.UserID] = true
			grants++
		}
	}
	if grants != packets*shares || len(perPacket) != packets || len(records) != packets {
		t.Fatalf("%d grant entries over %d packets and %d creation records, want %d over %d", grants, len(perPacket), len(records), packets*shares, packets)
	}
	s := conserved(t, ctx, b)
	if s.Claimed != claimed || s.Live != 0 || s.Available != total-claimed || s.GrabbedShares != packets*shares ||
		s.CreatedPackets != packets || s.LivePackets != packets {
		t.Fatalf("final snapshot %+v, claimed %d", s, claimed)
	}
	if bad.Load() != 0 {
		t.Fatalf("%d of %d samples were not conserved; first: %v", bad.Load(), samples.Load()+bad.Load(), firstBad.Load())
	}
	if samples.Load() < 10 {
		t.Fatalf("only %d samples", samples.Load())
	}
	t.Logf("%d packets created in %v (%.0f/s); %d grab attempts in %v (%.0f/s); %d grants; %d conservation samples, all conserved; total %v",
		packets, created.Round(time.Millisecond), float64(packets)/created.Seconds(), len(answers), grabbed.Round(time.Millisecond),
		float64(len(answers))/grabbed.Seconds(), grants, samples.Load(), time.Since(start).Round(time.Millisecond))
}
