package main

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// seedGrabScript is the grab script of the seed article 000 (HEXISTS, RPOP, HSET,
// LPUSH, with cjson), transcribed with the user id as ARGV[1] instead of a KEY, so
// that it runs on a cluster slot like ours. It is the reference ours is compared with:
// it has no window, pause or state gate, no counters and no settlement record.
const seedGrabScript = `local userHashKey = KEYS[1]
local redPacketOperatingKey = KEYS[2]
local userAmountKey = KEYS[3]
local userId = ARGV[1]
local result = {}
if redis.call('hexists', userHashKey, userId) == 1 then
  result['code'] = '1'
  return cjson.encode(result)
else
  local redPacket = redis.call('rpop', redPacketOperatingKey)
  if redPacket then
    local data = cjson.decode(redPacket)
    data['userId'] = userId
    redis.call('hset', userHashKey, userId, data['redPacketId'])
    redis.call('lpush', userAmountKey, cjson.encode(data))
    result['redPacketId'] = data['redPacketId']
    result['code'] = '0'
    result['amount'] = data['amount']
    return cjson.encode(result)
  else
    result['code'] = '-1'
    return cjson.encode(result)
  end
end`

// seedScriptRun is ours against the seed's script, each through redis-benchmark
// -P 16 on the same server in the same run: ours called as the seed's is (the user
// id alone), and ours called as the grab service calls it, with a watermark. The
// three are run in turn, round after round, so that a slow spell of the machine
// falls on all of them: each round gives its own ratios, and the median round's is
// the figure.
type seedScriptRun struct {
	rounds               []seedScriptRound
	requests             int
	clients              int
	ours, seed, oursMark latencies // the median round's, for the table
	// stats are INFO commandstats of every round's runs of each script, added up:
	// each command's share of a grab.
	stats [3]map[string]cmdStat // ours, the seed's, ours with a watermark
}

// seedScriptRound is one turn of the three runs.
type seedScriptRound struct {
	ours, seed, oursMark latencies
}

func (r seedScriptRound) ratio() float64     { return ratio(r.ours.Rate(), r.seed.Rate()) }
func (r seedScriptRound) markRatio() float64 { return ratio(r.oursMark.Rate(), r.seed.Rate()) }

// medianBy is the median of f over the rounds (the lower middle of an even count).
func medianBy(rounds []seedScriptRound, f func(seedScriptRound) float64) float64 {
	return f(medianRound(rounds, f))
}

// measureSeedScript seeds packets for the scripts (ours through seeding, the seed's
// as cjson objects in a list) and runs redis-benchmark of ours, the seed's, and ours
// with a watermark, in that order, rounds times.
func measureSeedScript(ctx context.Context, rc redis.UniversalClient, srv *redistest.Server, clients, requests, rounds int) (seedScriptRun, error) {
	r := seedScriptRun{requests: requests, clients: clients}
	for i := range r.stats {
		r.stats[i] = map[string]cmdStat{}
	}
	packets := int64(requests)*int64(rounds) + int64(requests)/10
	fmt.Printf("    seeding %d packets for each script ... ", packets)
	for _, uid := range []string{"bench-ours", "bench-ours-mark"} {
		if _, err := seedActivity(ctx, rc, uid, packets); err != nil {
			return r, err
		}
	}
	// The watermark run checks every call against a claimed count of 1 in epoch 0,
	// as the grab service does once it has seen a grant: one grant makes it true.
	if g, err := store.NewActivity(rc, "bench-ours-mark", 1).Shard(0).Grab(ctx, "bench-first"); err != nil || g.Outcome != store.Granted {
		return r, fmt.Errorf("the first grant of bench-ours-mark: %+v, %v", g, err)
	}
	const list = "seed:{bench}:operating"
	batch := make([]any, 0, 10_000)
	for i := int64(0); i < packets; i++ {
		batch = append(batch, fmt.Sprintf(`{"redPacketId":"%d","amount":%d}`, i+1, 1+i%200))
		if len(batch) == cap(batch) || i == packets-1 {
			if err := rc.RPush(ctx, list, batch...).Err(); err != nil {
				return r, fmt.Errorf("seeding the seed script's list: %w", err)
			}
			batch = batch[:0]
		}
	}
	fmt.Println("done")
	sha, err := rc.ScriptLoad(ctx, seedGrabScript).Result()
	if err != nil {
		return r, fmt.Errorf("loading the seed's script: %w", err)
	}
	oursAct, markedAct := store.NewActivity(rc, "bench-ours", 1), store.NewActivity(rc, "bench-ours-mark", 1)
	ours, marked := oursAct.Shard(0).Keys(), markedAct.Shard(0).Keys()
	for i := range rounds {
		var round seedScriptRound
		// Each run has user ids of its own (redis-benchmark's random numbers may
		// repeat another run's), and must grant nearly every call: a run of repeats
		// would measure the already_claimed answer instead.
		users := func(what string) string { return fmt.Sprintf("u:%d:%s:", i, what) }
		fmt.Printf("(i) round %d of %d, redis-benchmark -P 16, %d requests each: ours ... ", i+1, rounds, requests)
		if round.ours, err = benchmarkGrants(ctx, rc, "ours", ours.Claims, r.stats[0], func() (latencies, error) {
			return benchmarkScript(ctx, srv, grabCall(), []string{ours.Meta, ours.Packets, ours.Claims, ours.Stream}, users("ours"), 16, clients, requests)
		}); err != nil {
			return r, err
		}
		fmt.Printf("%.0f/s, the seed's ... ", round.ours.Rate())
		if round.seed, err = benchmarkGrants(ctx, rc, "seed", "seed:{bench}:users", r.stats[1], func() (latencies, error) {
			return benchmarkScript(ctx, srv, evalsha(sha), []string{"seed:{bench}:users", list, "seed:{bench}:consumed"}, users("seed"), 16, clients, requests)
		}); err != nil {
			return r, err
		}
		fmt.Printf("%.0f/s, ours with a watermark ... ", round.seed.Rate())
		if round.oursMark, err = benchmarkGrants(ctx, rc, "ours with a watermark", marked.Claims, r.stats[2], func() (latencies, error) {
			return benchmarkScript(ctx, srv, grabCall(), []string{marked.Meta, marked.Packets, marked.Claims, marked.Stream}, users("mark"), 16, clients, requests, "1", "0")
		}); err != nil {
			return r, err
		}
		fmt.Printf("%.0f/s: %.2f, %.2f\n", round.oursMark.Rate(), round.ratio(), round.markRatio())
		r.rounds = append(r.rounds, round)
	}
	mid := medianBy(r.rounds, seedScriptRound.ratio)
	for _, round := range r.rounds {
		if round.ratio() == mid {
			r.ours, r.seed, r.oursMark = round.ours, round.seed, round.oursMark
			break
		}
	}
	// Every call of ours was a grant: a fenced or sold-out run would be measuring
	// something else.
	for _, act := range []*store.Activity{oursAct, markedAct} {
		snap, err := act.Snapshot(ctx)
		if err != nil {
			return r, err
		}
		if snap.Fenced != "" || snap.RemainingCount == 0 {
			return r, fmt.Errorf("%s after the runs: fenced %q, %d left", act.UID(), snap.Fenced, snap.RemainingCount)
		}
	}
	for _, act := range []*store.Activity{oursAct, markedAct} {
		if err := act.Purge(ctx); err != nil {
			return r, err
		}
	}
	return r, rc.Del(ctx, list, "seed:{bench}:users", "seed:{bench}:consumed").Err()
}

// benchmarkGrants runs one benchmark and checks that at least 99 % of its calls
// wrote a claim into the hash claims (what): the figure is then one of grants. It
// adds the run's INFO commandstats to stats (reset before the run).
func benchmarkGrants(ctx context.Context, rc redis.UniversalClient, what, claims string, stats map[string]cmdStat, run func() (latencies, error)) (latencies, error) {
	before, err := rc.HLen(ctx, claims).Result()
	if err != nil {
		return latencies{}, err
	}
	if err := rc.ConfigResetStat(ctx).Err(); err != nil {
		return latencies{}, fmt.Errorf("CONFIG RESETSTAT: %w", err)
	}
	l, err := run()
	if err != nil {
		return l, err
	}
	got, err := commandStats(ctx, rc)
	if err != nil {
		return l, err
	}
	for name, st := range got {
		// The benchmark's own CONFIG GETs, the reset and this INFO are not the script's.
		if strings.HasPrefix(name, "config|") || name == "info" {
			continue
		}
		sum := stats[name]
		sum.calls += st.calls
		sum.usec += st.usec
		stats[name] = sum
	}
	after, err := rc.HLen(ctx, claims).Result()
	if err != nil {
		return l, err
	}
	if granted := after - before; granted < l.Requests*99/100 {
		return l, fmt.Errorf("%s: %d of %d calls granted", what, granted, l.Requests)
	}
	return l, nil
}

func (s seedScriptRun) summary() string {
	return fmt.Sprintf("(i) ours / seed 000's script (redis-benchmark -P 16, %d clients, median of %d rounds): %.2f; with a watermark %.2f\n",
		s.clients, len(s.rounds), medianBy(s.rounds, seedScriptRound.ratio), medianBy(s.rounds, seedScriptRound.markRatio))
}

func (s seedScriptRun) markdown() string {
	var b strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	p("## Our grab script and the seed's\n\n")
	p("redis-benchmark -P 16, %d clients, %d requests each run, on the same server in the same run:\n", s.clients, s.requests)
	p("our grab.lua against seed article 000's script (HEXISTS, RPOP, HSET, LPUSH with cjson; user\n")
	p("id moved to ARGV), transcribed in hack/bench/seedscript.go. Both are called with the user id\n")
	p("alone; ours is also called as the grab service calls it, with a watermark (claimed count 1,\n")
	p("epoch 0), which adds the rollback check to every call. The three runs take turns, %d rounds\n", len(s.rounds))
	p("of them, so that a slow spell of the machine falls on all three; each round has its own\n")
	p("ratios, and the figure is the median round's.\n\n")
	p("Ours keeps every guarantee the seed's lacks: the gates (missing, fenced, closed, not started,\n")
	p("paused, the window on the Redis clock), the rollback fence, the exact claimed count and amount,\n")
	p("and a settlement stream entry per grant that the claim names. A grant of an open activity is\n")
	p("five commands: `HGET` of the user's claim, `HGET` of the meta hash's gate (one field that says\n")
	p("the activity is open, with its window, epoch and currency; `TIME` only with a window), `LPOP`,\n")
	p("`XADD` of one packed field and `HSET` of the claim. No counter is read or raised: each listed\n")
	p("packet carries the count and the amount claimed from its list before it, and the grant is\n")
	p("answered as one string with no number written as text. The seed's is four commands and cjson.\n\n")
	p("| round | ours | seed 000 | ours, with a watermark | ours ÷ seed | with a watermark ÷ seed |\n|---|---:|---:|---:|---:|---:|\n")
	for i, r := range s.rounds {
		p("| %d | %.0f | %.0f | %.0f | %.3f | %.3f |\n", i+1, r.ours.Rate(), r.seed.Rate(), r.oursMark.Rate(), r.ratio(), r.markRatio())
	}
	p("\nThe median round's latencies:\n\n| script | grabs/s | p50 | p99 |\n|---|---:|---:|---:|\n")
	for _, row := range []struct {
		name string
		l    latencies
	}{{"ours", s.ours}, {"seed 000", s.seed}, {"ours, with a watermark", s.oursMark}} {
		p("| %s | %.0f | %s | %s |\n", row.name, row.l.Rate(), fmtDur(row.l.P50), fmtDur(row.l.P99))
	}
	p("\n**ours ÷ seed = %.2f** (goal ≥ 1.0, median of %d rounds); with a watermark %.2f.\n\n",
		medianBy(s.rounds, seedScriptRound.ratio), len(s.rounds), medianBy(s.rounds, seedScriptRound.markRatio))
	b.WriteString(s.sharesMarkdown())
	return b.String()
}

// sharesMarkdown is each command's share of a grab, from INFO commandstats of every
// round: the commands each script called per call (ours an FCALL, the seed's an
// EVALSHA) and their server time, and what is left of the call's time for Lua itself
// (its calls into Redis, its string work, the reply).
func (s seedScriptRun) sharesMarkdown() string {
	var b strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	p("### Each command's share\n\n")
	p("INFO commandstats of every round's runs of each script (reset before each run), per call\n")
	p("(ours: FCALL of the grab function, as the grab service calls it; the seed's: EVALSHA):\n")
	p("the commands the script called and their server time, and the call's time less theirs,\n")
	p("which is Lua's: the calls into Redis, the script's string work and its reply.\n\n")
	p("| script | command | calls per grab | µs per call | µs per grab |\n|---|---|---:|---:|---:|\n")
	for i, name := range []string{"ours", "seed 000", "ours, with a watermark"} {
		stats := s.stats[i]
		top := "fcall"
		if stats[top].calls == 0 {
			top = "evalsha"
		}
		eval := stats[top]
		if eval.calls == 0 {
			continue
		}
		names := make([]string, 0, len(stats))
		for n := range stats {
			if n != top {
				names = append(names, n)
			}
		}
		sort.Strings(names)
		var inside float64
		for _, n := range names {
			st := stats[n]
			perGrab := st.usec / float64(eval.calls)
			inside += perGrab
			p("| %s | `%s` | %.2f | %.2f | %.2f |\n", name, strings.ToUpper(n), float64(st.calls)/float64(eval.calls), st.usecPerCall(), perGrab)
		}
		p("| %s | Lua and the calls into Redis | | | %.2f |\n", name, eval.usecPerCall()-inside)
		p("| %s | **%s in all** | 1 | | **%.2f** |\n", name, strings.ToUpper(top), eval.usecPerCall())
	}
	p("\n")
	return b.String()
}
