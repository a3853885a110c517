package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// scaleRun is one activity on one master of a two-master Redis Cluster (N = 1)
// against the same activity spread over both masters (N = 2), each through
// redis-benchmark -P 16 of the grab script in the same run, in alternating rounds,
// plus the per-call server costs the model of more masters is built from.
type scaleRun struct {
	clients, requests int
	// rounds are the alternating N = 1 and N = 2 runs; the embedded scaleRound is the
	// median round's, by ratio.
	rounds []scaleRound
	scaleRound
	// Server time per call (INFO commandstats usec_per_call of EVALSHA, each script
	// measured alone): the grab, a stock reading, and the three transfer scripts of a
	// refill of batch packets, summed.
	grabUsec, stockUsec, transferUsec float64
	batch                             int
}

// scaleRound is one N = 1 run and then one N = 2 run, a few seconds apart.
type scaleRound struct {
	// one is N = 1: one redis-benchmark against the activity's master.
	one latencies
	// two are N = 2: one redis-benchmark per shard, against its own master, at once.
	two [2]latencies
	// twoElapsed is the wall time of the N = 2 run, from both starts to both ends.
	twoElapsed time.Duration
}

// twoRate is the N = 2 grants per second: both benchmarks' requests over the run.
func (s scaleRound) twoRate() float64 {
	if s.twoElapsed <= 0 {
		return 0
	}
	return float64(s.two[0].Requests+s.two[1].Requests) / s.twoElapsed.Seconds()
}

// ratio is N = 2 against twice N = 1: 1 is perfect scaling.
func (s scaleRound) ratio() float64 { return ratio(s.twoRate(), 2*s.one.Rate()) }

// measureScale starts two cluster-mode redis-servers that share the slots half and
// half, and measures the grab script on one activity with one shard and then two, in
// as many rounds: the machine's speed drifts within minutes, so the ratio is the
// median round's, each round's two runs a few seconds apart.
func measureScale(ctx context.Context, work string, clients, requests, rounds int) (scaleRun, error) {
	r := scaleRun{clients: clients, requests: requests, batch: store.DefaultTransferBatch}
	nodes, err := startTwoMasters(filepath.Join(work, "scale"))
	if err != nil {
		return r, err
	}
	defer func() {
		for _, n := range nodes {
			n.Stop()
		}
	}()
	c := redisconn.Conn{Addresses: []string{nodes[0].Addr, nodes[1].Addr}, Mode: redisconn.ModeCluster,
		Username: nodes[0].Username, Password: nodes[0].Password}.NewClient(redisconn.ClientOptions{Timeout: 10 * time.Second})
	defer func() { _ = c.Close() }()
	if err := lua.LoadAll(ctx, c); err != nil {
		return r, err
	}
	// An activity whose two shards land on different masters, and one whose single
	// shard lands on the first.
	var uid2, uid1 string
	for k := 0; uid2 == "" || uid1 == ""; k++ {
		if k == 10000 {
			return r, fmt.Errorf("no activity UID found whose shards land on both masters")
		}
		uid := "bench-scale-" + strconv.Itoa(k)
		sharded := store.NewActivity(c, uid, 2)
		m0 := masterOf(sharded.Shard(0).Keys().Meta)
		m1 := masterOf(sharded.Shard(1).Keys().Meta)
		switch {
		case uid2 == "" && m0 == 0 && m1 == 1:
			uid2 = uid
		case uid1 == "" && masterOf(store.NewActivity(c, uid, 1).Shard(0).Keys().Meta) == 0:
			uid1 = uid
		}
	}
	sharded := store.NewActivity(c, uid2, 2)
	for _, key := range []string{sharded.Shard(0).Keys().Meta, sharded.Shard(1).Keys().Meta} {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		slot, err := c.ClusterKeySlot(sctx, key).Result()
		cancel()
		if err != nil {
			return r, fmt.Errorf("CLUSTER KEYSLOT %s: %w", key, err)
		}
		if int(slot) != keySlot(key) {
			return r, fmt.Errorf("the cluster puts %s in slot %d, the benchmark computed %d", key, slot, keySlot(key))
		}
	}
	rounds = max(1, rounds)
	packets := int64(rounds) * (int64(requests) + int64(requests)/10)
	fmt.Printf("    seeding %d packets for N = 1 and %d over N = 2 ... ", packets, 2*packets)
	one := store.NewActivity(c, uid1, 1)
	two := store.NewActivity(c, uid2, 2)
	if err := seedOpen(ctx, one, packets); err != nil {
		return r, err
	}
	if err := seedOpen(ctx, two, 2*packets); err != nil {
		return r, err
	}
	fmt.Println("done")

	admin := [2]*redis.Client{redis.NewClient(nodes[0].Options()), redis.NewClient(nodes[1].Options())}
	defer func() { _ = admin[0].Close(); _ = admin[1].Close() }()

	for n := 1; n <= rounds; n++ {
		round, err := scaleRoundOnce(ctx, nodes, admin[0], one, two, n, clients, requests)
		if err != nil {
			return r, err
		}
		if n == 1 {
			// The grab's server time per call, from the first N = 1 run alone.
			if r.grabUsec, err = evalshaUsec(ctx, admin[0]); err != nil {
				return r, err
			}
		}
		r.rounds = append(r.rounds, round)
	}
	r.scaleRound = medianRound(r.rounds, scaleRound.ratio)

	// The refill's server costs: stock readings, and transfers of a full batch back
	// and forth between the two shards.
	if err := admin[0].ConfigResetStat(ctx).Err(); err != nil {
		return r, err
	}
	for range 2000 {
		if err := lua.StockScript.Call(ctx, c, []string{two.Shard(0).Keys().Meta, two.Shard(0).Keys().Packets, two.Shard(0).Keys().Transfers}).Err(); err != nil {
			return r, fmt.Errorf("stock: %w", err)
		}
	}
	if r.stockUsec, err = evalshaUsec(ctx, admin[0]); err != nil {
		return r, err
	}
	for _, a := range admin {
		if err := a.ConfigResetStat(ctx).Err(); err != nil {
			return r, err
		}
	}
	const moves = 200
	for i := range moves {
		if _, err := two.Transfer(ctx, i%2, 1-i%2, int64(r.batch)); err != nil {
			return r, err
		}
	}
	var total float64
	for _, a := range admin {
		calls, usec, err := evalshaStats(ctx, a)
		if err != nil {
			return r, err
		}
		total += usec * float64(calls)
	}
	r.transferUsec = total / moves
	view, err := two.ReadShards(ctx)
	if err != nil {
		return r, err
	}
	if !view.Conservation().Zero() {
		return r, fmt.Errorf("the N = 2 activity is out of balance after the run: %+v", view.Conservation())
	}
	return r, nil
}

// scaleRoundOnce is round n: redis-benchmark -P 16 against the N = 1 activity on the
// first master, then one against each shard of the N = 2 activity at once. It resets
// the first master's command statistics before the N = 1 run, so that run's EVALSHA
// figures can be read after it.
func scaleRoundOnce(ctx context.Context, nodes []*redistest.Server, first *redis.Client, one, two *store.Activity, n, clients, requests int) (scaleRound, error) {
	var r scaleRound
	fmt.Printf("(j) round %d: N = 1, redis-benchmark -P 16 on one master, %d requests ... ", n, requests)
	if err := first.ConfigResetStat(ctx).Err(); err != nil {
		return r, err
	}
	var err error
	if r.one, err = redisBenchmark(ctx, nodes[0], one.Shard(0).Keys(), fmt.Sprintf("n1:%d:", n), 16, clients, requests); err != nil {
		return r, err
	}
	fmt.Println(rateLine(r.one))

	fmt.Printf("(j) round %d: N = 2, redis-benchmark -P 16 on each master at once, %d requests each ... ", n, requests)
	var wg sync.WaitGroup
	var errs [2]error
	start := time.Now()
	for i := range 2 {
		wg.Go(func() {
			r.two[i], errs[i] = redisBenchmark(ctx, nodes[i], two.Shard(i).Keys(), fmt.Sprintf("n2:%d:%d:", n, i), 16, clients, requests)
		})
	}
	wg.Wait()
	r.twoElapsed = time.Since(start)
	for _, err := range errs {
		if err != nil {
			return r, err
		}
	}
	fmt.Printf("%.0f/s (%.0f + %.0f)  ratio %.2f\n", r.twoRate(), r.two[0].Rate(), r.two[1].Rate(), r.ratio())
	return r, nil
}

// startTwoMasters runs two cluster-mode redis-servers, with the default user off and
// one admin user and password for both, and makes them one cluster (redis-cli
// --cluster create wants three masters). The slots are split on bit 12,
// not bit 13 (halves): CRC16 is linear, so the slots of {uid.0} and {uid.1} always
// differ by 0x1021, which flips bit 12 and never bit 13; split in halves, the two
// shards of every activity would share a master. See "Where the shards land" in
// docs/architecture.md.
func startTwoMasters(dir string) ([]*redistest.Server, error) {
	var nodes []*redistest.Server
	password, err := redistest.NewPassword()
	if err != nil {
		return nil, err
	}
	fail := func(err error) ([]*redistest.Server, error) {
		for _, n := range nodes {
			n.Stop()
		}
		return nil, err
	}
	for i := range 2 {
		sub := filepath.Join(dir, "node-"+strconv.Itoa(i))
		if err := os.MkdirAll(sub, 0o755); err != nil {
			return fail(err)
		}
		s, err := redistest.StartProcessAs(sub, redistest.AdminUser, password, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
		if err != nil {
			return fail(err)
		}
		nodes = append(nodes, s)
	}
	ctx := context.Background()
	for i, ranges := range [][]any{{0, 4095, 8192, 12287}, {4096, 8191, 12288, 16383}} {
		c := redis.NewClient(nodes[i].Options())
		err := c.Do(ctx, append([]any{"cluster", "addslotsrange"}, ranges...)...).Err()
		_ = c.Close()
		if err != nil {
			return fail(fmt.Errorf("CLUSTER ADDSLOTSRANGE on %s: %w", nodes[i].Addr, err))
		}
	}
	host, port, _ := strings.Cut(nodes[1].Addr, ":")
	c := redis.NewClient(nodes[0].Options())
	err = c.Do(ctx, "cluster", "meet", host, port).Err()
	_ = c.Close()
	if err != nil {
		return fail(fmt.Errorf("CLUSTER MEET: %w", err))
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, n := range nodes {
		c := redis.NewClient(n.Options())
		for {
			info, err := c.ClusterInfo(ctx).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") && strings.Contains(info, "cluster_known_nodes:2") {
				break
			}
			if time.Now().After(deadline) {
				_ = c.Close()
				return fail(fmt.Errorf("the two-master cluster is not ok on %s: %v %s", n.Addr, err, info))
			}
			time.Sleep(100 * time.Millisecond)
		}
		_ = c.Close()
	}
	return nodes, nil
}

// masterOf is the master of key's slot in the cluster startTwoMasters makes: 0 when
// bit 12 of the slot is clear, 1 when it is set.
func masterOf(key string) int {
	return keySlot(key) >> 12 & 1
}

// keySlot is Redis Cluster's slot of key: CRC16 (XMODEM) of its hash tag, the part
// between the first '{' and the next '}' when that is not empty, modulo 16384.
func keySlot(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var crc uint16
	for i := 0; i < len(key); i++ {
		crc ^= uint16(key[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % 16384
}

// seedOpen seeds count packets of packetAmount over the activity's shards and opens it.
func seedOpen(ctx context.Context, a *store.Activity, count int64) error {
	amounts := make([]int64, count)
	for i := range amounts {
		amounts[i] = packetAmount
	}
	if _, err := a.Seed(ctx, amounts, store.SeedParams{Count: count, Total: count * packetAmount, Sponsor: "bench"}); err != nil {
		return fmt.Errorf("seeding %s: %w", a.UID(), err)
	}
	if r, err := a.ConfigureWith(ctx, store.Settings{Open: true}); err != nil || r.State != store.StateOpen {
		return fmt.Errorf("opening %s: %+v %v", a.UID(), r, err)
	}
	return nil
}

// evalshaUsec is INFO commandstats' usec_per_call of EVALSHA.
func evalshaUsec(ctx context.Context, c *redis.Client) (float64, error) {
	_, usec, err := evalshaStats(ctx, c)
	return usec, err
}

// evalshaStats is INFO commandstats' calls and usec_per_call of the scripts' calls:
// FCALL (the grab side's functions) and EVALSHA together.
func evalshaStats(ctx context.Context, c redis.Cmdable) (int64, float64, error) {
	stats, err := commandStats(ctx, c)
	if err != nil {
		return 0, 0, err
	}
	fc, ev := stats["fcall"], stats["evalsha"]
	calls, usec := fc.calls+ev.calls, fc.usec+ev.usec
	if calls == 0 {
		return 0, 0, fmt.Errorf("INFO commandstats has no FCALL or EVALSHA line")
	}
	return calls, usec / float64(calls), nil
}

// cmdStat is one command's line of INFO commandstats: how often it ran and its
// server time in all, commands called from scripts included.
type cmdStat struct {
	calls int64
	usec  float64
}

func (s cmdStat) usecPerCall() float64 {
	if s.calls == 0 {
		return 0
	}
	return s.usec / float64(s.calls)
}

// commandStats reads INFO commandstats, by lower-case command name.
func commandStats(ctx context.Context, c redis.Cmdable) (map[string]cmdStat, error) {
	info, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		return nil, fmt.Errorf("INFO commandstats: %w", err)
	}
	stats := map[string]cmdStat{}
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		name, isCmd := strings.CutPrefix(name, "cmdstat_")
		if !ok || !isCmd {
			continue
		}
		var st cmdStat
		for _, f := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(f, "=")
			switch k {
			case "calls":
				st.calls, _ = strconv.ParseInt(v, 10, 64)
			case "usec":
				st.usec, _ = strconv.ParseFloat(v, 64)
			}
		}
		stats[name] = st
	}
	return stats, nil
}

// projected is the model's grants per second with n masters: n × the measured
// one-master rate, less the refills' share. Assumptions: each master has a core of
// its own (so the two-master ratio measured here, where four processes share two
// cores, does not apply), the load generators and the network are not the limit,
// users hash evenly so a refill is needed only for the fraction moved of the
// packets, and a refill costs three stock readings of every shard plus the three
// transfer scripts, per batch.
func (s scaleRun) projected(n int, moved float64) float64 {
	perGrab := s.grabUsec
	if perGrab <= 0 {
		return 0
	}
	refill := (3*float64(n)*s.stockUsec + s.transferUsec) / float64(s.batch)
	return float64(n) * s.one.Rate() * perGrab / (perGrab + moved*refill)
}

func (s scaleRun) summary() string {
	return fmt.Sprintf("(j) N = 2 over two masters / 2 × N = 1 (redis-benchmark -P 16, %d clients each, median of %d rounds): %.0f / (2 × %.0f) = %.2f\n",
		s.clients, len(s.rounds), s.twoRate(), s.one.Rate(), s.ratio())
}

// roundRows are the rounds' rows of the markdown table.
func (s scaleRun) roundRows() string {
	var b strings.Builder
	for i, r := range s.rounds {
		fmt.Fprintf(&b, "| %d | %.0f | %.0f (%.0f + %.0f) | %.2f |\n", i+1, r.one.Rate(), r.twoRate(), r.two[0].Rate(), r.two[1].Rate(), r.ratio())
	}
	return b.String()
}

func (s scaleRun) markdown() string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	p(`## One activity over two masters

A Redis Cluster of two masters (two redis-server processes in cluster mode, each holding
half the slots, split on bit 12 of the slot number so that the two shards of an activity
land on different masters; see "Where the shards land" in docs/architecture.md). N = 1: one activity on the first master, redis-benchmark -P 16 with %d
clients and %d requests against it. N = 2: one activity with `+"`spec.shards: 2`"+`, one shard
on each master, and one such redis-benchmark against each shard's master at the same time
(the grab service routes each user to their home shard the same way). The two alternate in
%d rounds, each N = 1 and then N = 2 a few seconds apart:

| round | N = 1 grabs/s | N = 2 grabs/s (shard 0 + shard 1) | N = 2 ÷ (2 × N = 1) |
|---:|---:|---:|---:|
%s
The median round:

| | grabs/s | p50 | p99 |
|---|---:|---:|---:|
| N = 1 | %.0f | %s | %s |
| N = 2, shard 0 | %.0f | %s | %s |
| N = 2, shard 1 | %.0f | %s | %s |
| N = 2, together | %.0f | | |

**N = 2 ÷ (2 × N = 1) = %.2f**, the median of the rounds (goal ≥ 0.7 where cores allow). During N = 2 two
redis-servers and two redis-benchmarks share this machine's 2 CPUs, so each master has
about half a core: the ratio is bounded by the machine, not by the sharding.

Server time per call (INFO commandstats, each script alone): a grab %.2f µs, a stock
reading %.2f µs, the three scripts of one transfer of %d packets %.1f µs in all.

### A model of more masters

Projected grants/s = n × (one master's measured rate) × t_grab / (t_grab + f × (3n ×
t_stock + t_transfer) / batch), where f is the fraction of packets that must move between
shards. Assumptions: one core per master; the load generators and the network are not the
limit; users hash evenly; a refill reads every shard's stock three times and moves up to
%d packets. With uneven hashing, f is at most the share of packets whose home shard has
fewer users than packets.

| masters | f = 0.05 | f = 0.25 | f = 0.5 |
|---:|---:|---:|---:|
`, s.clients, s.requests, len(s.rounds), s.roundRows(), s.one.Rate(), fmtDur(s.one.P50), fmtDur(s.one.P99),
		s.two[0].Rate(), fmtDur(s.two[0].P50), fmtDur(s.two[0].P99),
		s.two[1].Rate(), fmtDur(s.two[1].P50), fmtDur(s.two[1].P99),
		s.twoRate(), s.ratio(), s.grabUsec, s.stockUsec, s.batch, s.transferUsec, s.batch)
	for _, n := range []int{1, 2, 8, 32} {
		p("| %d | %.0f | %.0f | %.0f |\n", n, s.projected(n, 0.05), s.projected(n, 0.25), s.projected(n, 0.5))
	}
	p("\n")
	return b.String()
}
