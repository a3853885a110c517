package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
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
// id alone), and ours called as the grab service calls it, with a watermark.
type seedScriptRun struct {
	ours, seed, oursMark latencies
	requests             int
	clients              int
}

// measureSeedScript seeds packets for the scripts (ours through seeding, the seed's
// as cjson objects in a list) and runs redis-benchmark of ours, the seed's, and ours
// with a watermark, in that order.
func measureSeedScript(ctx context.Context, rc redis.UniversalClient, addr string, clients, requests int) (seedScriptRun, error) {
	r := seedScriptRun{requests: requests, clients: clients}
	packets := int64(requests) + int64(requests)/10
	fmt.Printf("    seeding %d packets for each script ... ", packets)
	for _, uid := range []string{"bench-ours", "bench-ours-mark"} {
		if _, err := seedActivity(ctx, rc, uid, packets); err != nil {
			return r, err
		}
	}
	// The watermark run checks every call against a claimed count of 1 in epoch 0,
	// as the grab service does once it has seen a grant: one grant makes it true.
	if g, err := lua.NewActivity(rc, "bench-ours-mark").Grab(ctx, "bench-first"); err != nil || g.Outcome != lua.Granted {
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
	ours := lua.KeysFor("bench-ours")
	fmt.Printf("(i) redis-benchmark -P 16, our grab.lua, %d requests ... ", requests)
	if r.ours, err = benchmarkScript(ctx, addr, lua.GrabScript.SHA(), []string{ours.Meta, ours.Packets, ours.Claims, ours.Stream}, clients, requests); err != nil {
		return r, err
	}
	fmt.Println(rateLine(r.ours))
	fmt.Printf("(i) redis-benchmark -P 16, the seed's script, %d requests ... ", requests)
	if r.seed, err = benchmarkScript(ctx, addr, sha, []string{"seed:{bench}:users", list, "seed:{bench}:consumed"}, clients, requests); err != nil {
		return r, err
	}
	fmt.Println(rateLine(r.seed))
	marked := lua.KeysFor("bench-ours-mark")
	fmt.Printf("(i) redis-benchmark -P 16, our grab.lua with a watermark, %d requests ... ", requests)
	if r.oursMark, err = benchmarkScript(ctx, addr, lua.GrabScript.SHA(), []string{marked.Meta, marked.Packets, marked.Claims, marked.Stream}, clients, requests, "1", "0"); err != nil {
		return r, err
	}
	fmt.Println(rateLine(r.oursMark))
	for _, uid := range []string{"bench-ours", "bench-ours-mark"} {
		if err := lua.NewActivity(rc, uid).Purge(ctx); err != nil {
			return r, err
		}
	}
	return r, rc.Del(ctx, list, "seed:{bench}:users", "seed:{bench}:consumed").Err()
}

// benchmarkScript runs redis-benchmark -P 16 of EVALSHA sha with keys, a random user
// id and then extra arguments.
func benchmarkScript(ctx context.Context, addr, sha string, keys []string, clients, requests int, extra ...string) (latencies, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return latencies{}, err
	}
	args := []string{"-h", host, "-p", port, "-c", strconv.Itoa(clients), "-n", strconv.Itoa(requests),
		"-P", "16", "-r", "1000000000", "--csv", "EVALSHA", sha, strconv.Itoa(len(keys))}
	args = append(args, keys...)
	args = append(args, "u:__rand_int__")
	args = append(args, extra...)
	cmd := exec.CommandContext(ctx, "redis-benchmark", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	start := time.Now()
	out, err := cmd.Output()
	if err != nil {
		return latencies{}, fmt.Errorf("redis-benchmark: %w: %s", err, stderr.String())
	}
	return parseBenchmarkCSV(out, int64(requests), time.Since(start))
}

func (s seedScriptRun) summary() string {
	return fmt.Sprintf("(i) ours / seed 000's script (redis-benchmark -P 16, %d clients): %.0f / %.0f = %.2f; with a watermark %.0f / %.0f = %.2f\n",
		s.clients, s.ours.Rate(), s.seed.Rate(), ratio(s.ours.Rate(), s.seed.Rate()),
		s.oursMark.Rate(), s.seed.Rate(), ratio(s.oursMark.Rate(), s.seed.Rate()))
}

func (s seedScriptRun) markdown() string {
	var b strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	p("## Our grab script and the seed's\n\n")
	p("redis-benchmark -P 16, %d clients, %d requests each run, on the same server in the same run:\n", s.clients, s.requests)
	p("our grab.lua against seed article 000's script (HEXISTS, RPOP, HSET, LPUSH with cjson; user\n")
	p("id moved to ARGV), transcribed in hack/bench/seedscript.go. Both are called with the user id\n")
	p("alone; ours is also called as the grab service calls it, with a watermark (claimed count 1,\n")
	p("epoch 0), which adds the rollback check to every call.\n\n")
	p("Ours keeps every guarantee the seed's lacks: the gates (missing, fenced, closed, not started,\n")
	p("paused, the window on the Redis clock), the rollback fence, the exact claimed amount, the\n")
	p("claimed count (the length of the claims hash) for the caller's watermark, and a settlement\n")
	p("stream entry per grant that the claim names. A grant of an open activity is seven commands:\n")
	p("`HGET` of the user's claim, `HGET` of the meta hash's gate (one field that says the activity\n")
	p("is open, with its window, epoch and currency; `TIME` only with a window), `HLEN` of the\n")
	p("claims, `LPOP`, `XADD` of one packed field, `HSET` of the claim and `HINCRBY` of the claimed\n")
	p("amount; the grant is answered as one string. The seed's is four commands and cjson.\n\n")
	p("| script | grabs/s | p50 | p99 |\n|---|---:|---:|---:|\n")
	for _, row := range []struct {
		name string
		l    latencies
	}{{"ours", s.ours}, {"seed 000", s.seed}, {"ours, with a watermark", s.oursMark}} {
		p("| %s | %.0f | %s | %s |\n", row.name, row.l.Rate(), fmtDur(row.l.P50), fmtDur(row.l.P99))
	}
	p("\n**ours ÷ seed = %.2f** (goal ≥ 1.0); with a watermark %.2f.\n\n",
		ratio(s.ours.Rate(), s.seed.Rate()), ratio(s.oursMark.Rate(), s.seed.Rate()))
	return b.String()
}
