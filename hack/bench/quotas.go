package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// quotaRun is what BenchmarkPacketQuotas (grabsvc) reported for one number of
// budget shards: packets created per second through HTTP with every quota on and
// with none, alternately in one run, and the bytes of quota state per sender and per
// recipient.
type quotaRun struct {
	shards, iterations int
	// twoStep: the quota taken on the home shard before the create, as on a
	// cluster; else counted inside the create on the one server.
	twoStep              bool
	on, off              float64
	perSender, perRecip  float64
	load1Before, load1At string
}

func (q quotaRun) ratio() float64 { return ratio(q.on, q.off) }

// quotaIterations is -benchtime of BenchmarkPacketQuotas: each iteration creates
// 2,000 packets with quotas and 2,000 without.
const quotaIterations = 10

// measureQuotas runs BenchmarkPacketQuotas in a child go test with shards budget
// shards counted in one step on the one server, then taken and given back as on a
// cluster, then with one budget shard, and reads its metrics.
func measureQuotas(ctx context.Context, root string, shards int) ([]quotaRun, error) {
	var out []quotaRun
	for _, r := range []quotaRun{{shards: shards}, {shards: shards, twoStep: true}, {shards: 1}} {
		n := r.shards
		r.iterations, r.load1Before = quotaIterations, load1()
		fmt.Printf("(l) quotas on and off, %d budget shards, two steps %v: go test -bench BenchmarkPacketQuotas ./grabsvc ... ", n, r.twoStep)
		cmd := exec.CommandContext(ctx, "go", "test", "-run", "^$", "-bench", "^BenchmarkPacketQuotas$",
			"-benchtime", fmt.Sprintf("%dx", quotaIterations), "-count", "1", "./grabsvc")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "QUOTA_BENCH_SHARDS="+strconv.Itoa(n))
		if r.twoStep {
			cmd.Env = append(cmd.Env, "QUOTA_BENCH_TWO_STEP=1")
		}
		cmd.Stderr = os.Stderr
		b, err := cmd.Output()
		if err != nil {
			return out, fmt.Errorf("BenchmarkPacketQuotas: %w\n%s", err, b)
		}
		r.load1At = load1()
		m := benchMetrics(b, "BenchmarkPacketQuotas")
		r.on, r.off, r.perSender, r.perRecip = m["created/s-quotas-on"], m["created/s-quotas-off"], m["B/sender"], m["B/recipient"]
		if r.on == 0 || r.off == 0 || r.perSender == 0 || r.perRecip == 0 {
			return out, fmt.Errorf("BenchmarkPacketQuotas printed no figures:\n%s", b)
		}
		fmt.Printf("%.0f created/s with quotas, %.0f without: ratio %.2f; %.0f B per sender, %.0f B per recipient\n",
			r.on, r.off, r.ratio(), r.perSender, r.perRecip)
		out = append(out, r)
	}
	return out, nil
}

// load1 is the one-minute load average (loadAverage's first figure).
func load1() string { return strings.Fields(loadAverage() + " ?")[0] }

// quotasMarkdown is the quotas' part of section (l).
func quotasMarkdown(runs []quotaRun) string {
	if len(runs) == 0 {
		return ""
	}
	var s strings.Builder
	s.WriteString("\n### Quotas\n\n")
	fmt.Fprintf(&s, "`BenchmarkPacketQuotas` (grabsvc): one budget on a real redis-server with two packet servers "+
		"over HTTP, one with every quota of `spec.packets.quotas` on (limits nobody reaches, so every rule is "+
		"counted and none refuses) and one with none; each of %d iterations creates 2,000 packets of 5 shares "+
		"through each, in turn, from 64 keep-alive clients, for 1,000 senders. With N budget shards all but one "+
		"in N of the packets land off their sender's home shard: on one server the create counts the quota all the same, "+
		"in two steps (as on a cluster) the quota is a function call of its own on the home shard first "+
		"([budgets.md](budgets.md#quotas)). Then 10,000 new senders create a packet each and 10,000 new users "+
		"are granted a share each: the bytes are the MEMORY USAGE of the day's hashes of quota counters, divided "+
		"by the people.\n\n", runs[0].iterations)
	s.WriteString("| budget shards | quota counted | created/s, quotas on | created/s, quotas off | on ÷ off (goal ≥ 0.8) | bytes per sender | bytes per recipient | load average |\n")
	s.WriteString("|---:|---|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range runs {
		how := "in the create"
		if r.twoStep {
			how = "take, then create"
		}
		fmt.Fprintf(&s, "| %d | %s | %.0f | %.0f | **%.2f** | %.0f | %.0f | %s to %s |\n", r.shards, how, r.on, r.off, r.ratio(),
			r.perSender, r.perRecip, r.load1Before, r.load1At)
	}
	return s.String()
}
