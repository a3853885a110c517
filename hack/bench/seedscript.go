package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os/exec"
	"strconv"
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
// -P 16 on the same server in the same run.
type seedScriptRun struct {
	ours, seed latencies
	requests   int
	clients    int
}

// measureSeedScript seeds packets for both scripts (ours through seeding, the seed's
// as cjson objects in a list) and runs redis-benchmark of each, ours first.
func measureSeedScript(ctx context.Context, rc redis.UniversalClient, addr string, clients, requests int) (seedScriptRun, error) {
	r := seedScriptRun{requests: requests, clients: clients}
	packets := int64(requests) + int64(requests)/10
	fmt.Printf("    seeding %d packets for each script ... ", packets)
	if _, err := seedActivity(ctx, rc, "bench-ours", packets); err != nil {
		return r, err
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
	if err := lua.NewActivity(rc, "bench-ours").Purge(ctx); err != nil {
		return r, err
	}
	return r, rc.Del(ctx, list, "seed:{bench}:users", "seed:{bench}:consumed").Err()
}

// benchmarkScript runs redis-benchmark -P 16 of EVALSHA sha with keys and a random
// user id.
func benchmarkScript(ctx context.Context, addr, sha string, keys []string, clients, requests int) (latencies, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return latencies{}, err
	}
	args := []string{"-h", host, "-p", port, "-c", strconv.Itoa(clients), "-n", strconv.Itoa(requests),
		"-P", "16", "-r", "1000000000", "--csv", "EVALSHA", sha, strconv.Itoa(len(keys))}
	args = append(args, keys...)
	args = append(args, "u:__rand_int__")
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
	return fmt.Sprintf("(i) ours / seed 000's script (redis-benchmark -P 16, %d clients): %.0f / %.0f = %.2f\n",
		s.clients, s.ours.Rate(), s.seed.Rate(), ratio(s.ours.Rate(), s.seed.Rate()))
}

func (s seedScriptRun) markdown() string {
	return fmt.Sprintf(`## Our grab script and the seed's

redis-benchmark -P 16, %d clients, %d requests each run, on the same server in the same run:
our grab.lua (gates, counters, watermark fence, a settlement stream entry per grant)
against seed article 000's script (HEXISTS, RPOP, HSET, LPUSH with cjson; user id moved to
ARGV), transcribed in hack/bench/seedscript.go.

| script | grabs/s | p50 | p99 |
|---|---:|---:|---:|
| ours | %.0f | %s | %s |
| seed 000 | %.0f | %s | %s |

**ours ÷ seed = %.2f**

`, s.clients, s.requests, s.ours.Rate(), fmtDur(s.ours.P50), fmtDur(s.ours.P99),
		s.seed.Rate(), fmtDur(s.seed.P50), fmtDur(s.seed.P99), ratio(s.ours.Rate(), s.seed.Rate()))
}
