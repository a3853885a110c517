package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/balancetest"
	"redpacket.io/operator/test/redistest"

	"redpacket.io/operator/internal/rain"
)

// startRedis starts the demo's redis-server with an append-only file, the default
// user off and an admin user with a random password (redistest.StartProcess), as
// production should run it (see docs/operations.md).
func startRedis(dir string) (*redistest.Server, error) {
	return redistest.StartProcess(dir, "--appendonly", "yes", "--appendfsync", "everysec")
}

// grabRedisEnv waits up to within for the Secret <name>-grab-redis that the operator
// writes for the activity's grab pods in namespace default, and returns the
// environment that logs a grab service in as its pods do: the activity's own Redis
// user and password (REDIS_USERNAME, REDIS_PASSWORD), and the user's name.
func grabRedisEnv(ctx context.Context, c client.Client, name string, within time.Duration) ([]string, string, error) {
	key := client.ObjectKey{Namespace: "default", Name: name + "-grab-redis"}
	deadline := time.Now().Add(within)
	for {
		var s corev1.Secret
		err := c.Get(ctx, key, &s)
		if err == nil {
			conn, err := redisconn.ConnFromSecret(s.Data)
			if err != nil {
				return nil, "", fmt.Errorf("secret %s: %w", key, err)
			}
			return []string{"REDIS_USERNAME=" + conn.Username, "REDIS_PASSWORD=" + conn.Password}, conn.Username, nil
		}
		if !apierrors.IsNotFound(err) {
			return nil, "", fmt.Errorf("reading secret %s: %w", key, err)
		}
		if time.Now().After(deadline) {
			return nil, "", fmt.Errorf("the operator wrote no secret %s within %s", key, within)
		}
		select {
		case <-ctx.Done():
			return nil, "", ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// observed is what the demo read back after the rain: the resource's status, Redis
// itself and the balance receiver.
type observed struct {
	uid      string
	phase    string
	status   redpacketv1alpha1.RedPacketActivityStatus
	waited   time.Duration
	timedOut bool

	redisClaims   int64
	redisPackets  int64 // distinct packet ids in the claims hash
	redisClaimSum int64
	streamLen     int64
	snapshot      store.Snapshot

	ledger ledgerFacts
}

func val(p *int64) int64 {
	if p == nil {
		return -1
	}
	return *p
}

// waitSettled polls the resource, Redis and the balance system until the status
// shows every grant claimed and settled and PostgreSQL holds them all (and, when all
// count packets went, the activity Exhausted), or settleWait passes. c reads the
// activity; Redis is read through conn (the admin user's connection).
func waitSettled(ctx context.Context, c client.Client, conn redisconn.Conn, count int64, settleWait time.Duration,
	name string, rr rain.Result, bs *balanceSystem) (observed, error) {
	rc := conn.NewClient()
	defer rc.Close()
	var obs observed
	start := time.Now()
	deadline := start.Add(settleWait)
	tty := rain.IsTerminal()
	last := ""
	for {
		var a redpacketv1alpha1.RedPacketActivity
		if err := c.Get(ctx, client.ObjectKey{Namespace: "default", Name: name}, &a); err != nil {
			return obs, fmt.Errorf("reading the activity: %w", err)
		}
		obs.uid = string(a.UID)
		obs.status = a.Status
		obs.phase = string(a.Status.Phase)
		src, _, err := bs.Source(ctx, obs.uid)
		if err != nil {
			return obs, err
		}
		st := a.Status
		caughtUp := val(st.ClaimedCount) == rr.Granted && val(st.SettledCount) == rr.Granted &&
			src.Grants.Count == rr.Granted && (rr.Granted < count || (val(st.RemainingCount) == 0 &&
			a.Status.Phase == redpacketv1alpha1.PhaseExhausted))
		line := fmt.Sprintf("    phase %-9s claimed %5d  remaining %5d  settled %5d  in PostgreSQL %5d",
			obs.phase, val(st.ClaimedCount), val(st.RemainingCount), val(st.SettledCount), src.Grants.Count)
		switch {
		case tty:
			fmt.Printf("\r%s  %4.1fs ", line, time.Since(start).Seconds())
		case line != last:
			fmt.Printf("%s  %4.1fs\n", line, time.Since(start).Seconds())
		}
		last = line
		if caughtUp || time.Now().After(deadline) {
			obs.timedOut = !caughtUp
			if tty {
				fmt.Println()
			}
			break
		}
		select {
		case <-ctx.Done():
			if tty {
				fmt.Println()
			}
			return obs, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	obs.waited = time.Since(start)

	act := store.NewActivity(rc, obs.uid, 1)
	claims, err := act.Shard(0).Claims(ctx)
	if err != nil {
		return obs, err
	}
	packets := map[string]bool{}
	for _, c := range claims {
		packets[c.PacketID] = true
		obs.redisClaimSum += c.Amount
	}
	obs.redisClaims = int64(len(claims))
	obs.redisPackets = int64(len(packets))
	if obs.streamLen, err = act.Shard(0).StreamLen(ctx); err != nil {
		return obs, err
	}
	if obs.snapshot, err = act.Snapshot(ctx); err != nil {
		return obs, err
	}
	if obs.ledger, err = readLedger(ctx, bs, obs.uid); err != nil {
		return obs, err
	}
	return obs, nil
}

// ledgerFacts is what the balance system booked for the activity, and what it
// refused of every source.
type ledgerFacts struct {
	source balance.Source
	// usersTwice is how many users were credited two grants of the activity.
	usersTwice int64
	// refusals are the POSTs refused, by error code; alarms those of them that the
	// operator never causes (balancetest.Alarms).
	refusals, alarms map[string]int
}

// readLedger reads the activity's book and its credits from the balance system, and
// the refusals from its log.
func readLedger(ctx context.Context, bs *balanceSystem, uid string) (ledgerFacts, error) {
	var l ledgerFacts
	src, _, err := bs.Source(ctx, uid)
	if err != nil {
		return l, err
	}
	credits, err := bs.Credits(ctx, uid)
	if err != nil {
		return l, err
	}
	refusals, err := bs.Refusals()
	if err != nil {
		return l, err
	}
	return ledgerFacts{source: src, usersTwice: usersCreditedTwice(credits), refusals: refusals,
		alarms: balancetest.Alarms(refusals)}, nil
}

// printSummary prints the summary and its checks, and reports whether all passed.
func printSummary(rr rain.Result, obs observed, total, packets int64, connections int) bool {
	passed := true
	// row prints one line; verdict is "" for facts, else the check's result.
	row := func(label, text string, check ...bool) {
		if len(check) == 0 {
			fmt.Printf("  %-16s %s\n", label, text)
			return
		}
		verdict := "ok"
		for _, ok := range check {
			if !ok {
				verdict, passed = "FAIL", false
			}
		}
		fmt.Printf("  %-16s %-92s %s\n", label, text, verdict)
	}
	st := obs.status
	other := map[string]int64{}
	for o, n := range rr.ByOutcome {
		if o != "granted" && o != "sold_out" && o != "ended" {
			other[o] = n
		}
	}
	otherText := "none"
	if len(other) > 0 {
		otherText = fmt.Sprint(other)
		if rr.FirstError != "" {
			otherText += " (first error: " + rr.FirstError + ")"
		}
	}
	soldAll := rr.Granted == packets
	exhausted := obs.phase == string(redpacketv1alpha1.PhaseExhausted)

	row("users", fmt.Sprintf("%d concurrent (%d asked a second time)", rr.Users, rr.Retries))
	row("requests", fmt.Sprintf("%d in %s (%.0f/s)", rr.Requests, rr.Elapsed.Round(time.Millisecond),
		float64(rr.Requests)/rr.Elapsed.Seconds()))
	// Every user gets a packet while packets last; when all are claimed, the amounts add
	// up to the total to the minor unit.
	row("granted", fmt.Sprintf("%d of %d packets, sum %d of %d", rr.Granted, packets, rr.GrantedSum, total),
		rr.Granted == min(int64(rr.Users), packets), !soldAll || rr.GrantedSum == total)
	row("sold out", fmt.Sprintf("%d sold_out, %d ended", rr.ByOutcome["sold_out"], rr.ByOutcome["ended"]))
	row("other outcomes", otherText)
	row("duplicates", fmt.Sprintf("%d packet ids granted twice; %d of %d retries inconsistent with the first answer",
		rr.DupPackets, rr.RetriesInconsistent, rr.Retries),
		rr.DupPackets == 0, rr.RetriesInconsistent == 0, rr.RetriesSame == rr.Retries)
	row("Redis", fmt.Sprintf("claims: %d users, %d distinct packets, sum %d; stream: %d entries",
		obs.redisClaims, obs.redisPackets, obs.redisClaimSum, obs.streamLen),
		obs.redisClaims == rr.Granted, obs.redisPackets == rr.Granted, obs.redisClaimSum == rr.GrantedSum, obs.streamLen == rr.Granted)
	row("status", fmt.Sprintf("phase %s, claimed %d / %d, remaining %d / %d, refunded %d",
		obs.phase, val(st.ClaimedCount), val(st.ClaimedAmount), val(st.RemainingCount), val(st.RemainingAmount), val(st.RefundedAmount)),
		val(st.ClaimedCount) == rr.Granted, val(st.ClaimedAmount) == rr.GrantedSum,
		val(st.ClaimedAmount)+val(st.RemainingAmount)+max(0, val(st.RefundedAmount)) == total, !soldAll || exhausted)
	row("latency", fmt.Sprintf("users: p50 %s  p99 %s  max %s (%d users queue for %d connections)",
		ms(rr.P50), ms(rr.P99), ms(rr.Max), rr.Users, connections))
	row("", fmt.Sprintf("per request once connected: p50 %s  p99 %s", ms(rr.ServiceP50), ms(rr.ServiceP99)))
	l := obs.ledger
	row("settled", fmt.Sprintf("PostgreSQL booked %d grants, sum %d, %d refunds; status settled %d / %d",
		l.source.Grants.Count, l.source.Grants.Sum, l.source.Refunds.Count, val(st.SettledCount), val(st.SettledAmount)),
		l.source.Grants.Count == rr.Granted, l.source.Grants.Sum == rr.GrantedSum, val(st.SettledCount) == rr.Granted,
		val(st.SettledAmount) == rr.GrantedSum, l.source.Total == total, l.source.Count != nil && *l.source.Count == packets)
	row("balance system", fmt.Sprintf("%d users credited twice; answers other than 2xx, each retried: %s", l.usersTwice, formatCounts(l.refusals)),
		l.usersTwice == 0, len(l.alarms) == 0)
	if obs.timedOut {
		row("", fmt.Sprintf("the reporter or settlement did not catch up within %s", obs.waited.Round(time.Second)))
	}
	if passed {
		fmt.Println("  all checks passed")
	} else {
		fmt.Println("  SOME CHECKS FAILED")
	}
	return passed
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }

// process is one process seen in /proc.
type process struct {
	pid     int
	cmdline string
}

// descendants lists every process below pid.
func descendants(pid int) []process {
	children := map[int][]int{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// The command name is in parentheses and may contain spaces; fields follow it.
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) < 2 {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		children[ppid] = append(children[ppid], p)
	}
	var out []process
	var walk func(int)
	walk = func(p int) {
		for _, c := range children[p] {
			out = append(out, process{pid: c, cmdline: cmdline(c)})
			walk(c)
		}
	}
	walk(pid)
	return out
}

func cmdline(pid int) string {
	b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
	return strings.TrimSpace(strings.ReplaceAll(string(b), "\x00", " "))
}

// stillRunning returns the processes of ps that still run (same pid, same command,
// not a zombie).
func stillRunning(ps []process) []process {
	var left []process
	for _, p := range ps {
		b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(p.pid), "stat"))
		if err != nil {
			continue
		}
		s := string(b)
		if i := strings.LastIndexByte(s, ')'); i >= 0 {
			if f := strings.Fields(s[i+1:]); len(f) > 0 && f[0] == "Z" {
				continue
			}
		}
		if cmdline(p.pid) == p.cmdline {
			left = append(left, p)
		}
	}
	return left
}

func rel(root, path string) string {
	if r, err := filepath.Rel(root, path); err == nil && !strings.HasPrefix(r, "..") {
		return r
	}
	return path
}

func joinArgs(a []string) string { return strings.Join(a, " ") }

func hostOf(addr string) string {
	h, _, _ := net.SplitHostPort(addr)
	return h
}

func portOf(addr string) string {
	_, p, _ := net.SplitHostPort(addr)
	return p
}
