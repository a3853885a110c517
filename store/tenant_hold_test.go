package store_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// tenantHoldMaxMemory is the maxmemory of the shared Redis in
// TestTenantCannotHoldTheSharedRedis, the figure docs/operations.md states the
// measured worst single command at.
const tenantHoldMaxMemory = 2 << 30

// Issue 34, case 5: a tenant holds the shared Redis through the functions it may
// call. With its activity's Redis user it writes more than 0.5 GB into the keys its
// ACL lets it write (500 entries of 4,000 field pairs of 220 bytes, the size that
// held Redis for 7-8 s through replay_dead, first tried on its dead-letter stream
// and, refused there, put in its settlement stream; packets of 1 MiB at both ends of
// its list; a meta hash of 64 KiB values; a claim and a transfer mark of 1 MiB), then
// calls every function of the library with its own keys. Meanwhile another
// activity's grab, through the real store as that activity's user, answers every
// time in under 100 ms, nothing answers BUSY (busy-reply-threshold is lowered to 100
// ms, so a function that runs longer shows), and the operator's FUNCTION KILL, sent
// every 50 ms, always answers NOTBUSY (never UNKILLABLE). Each call is refused or
// capped and writes nothing it should not. At the end, with the grabs stopped, it
// measures the worst single command the tenant can still send on its own keys: a
// read of its whole settlement stream.
func TestTenantCannotHoldTheSharedRedis(t *testing.T) {
	ctx := redistest.Context(t)
	srv, op := protectedRedis(t)
	for _, kv := range [][2]string{{"maxmemory", strconv.Itoa(tenantHoldMaxMemory)}, {"busy-reply-threshold", "100"},
		{"slowlog-log-slower-than", "10000"}, {"slowlog-max-len", "1024"}} {
		if err := op.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
			t.Fatalf("CONFIG SET %s %s: %v", kv[0], kv[1], err)
		}
	}
	const own, other, ownPW, otherPW = "act-holder", "act-waiter", "holder-pw-0123456789", "waiter-pw-0123456789"
	k := seedOpen(t, ctx, op, own, splitOrFail(t, split.TypeFixed, 20_000, 1_000))
	seedOpen(t, ctx, op, other, splitOrFail(t, split.TypeFixed, 200_000, 100_000))
	for uid, pw := range map[string]string{own: ownPW, other: otherPW} {
		if _, err := store.NewActivity(op, uid, 1).EnsureUser(ctx, pw); err != nil {
			t.Fatal(err)
		}
	}
	tenant := userConn([]string{srv.Addr}, redisconn.ModeStandalone, own, ownPW).
		NewClient(redisconn.ClientOptions{Timeout: time.Minute})
	t.Cleanup(func() { _ = tenant.Close() })

	// The other activity's grabs, every 2 ms (the tenant's calls take about a second
	// in all, and at least 100 grabs must run beside them), and the operator's
	// FUNCTION KILL, every 50 ms, from start to end.
	waiter, err := userConn([]string{srv.Addr}, redisconn.ModeStandalone, other, otherPW).
		NewPipelinedClient(redisconn.GrabClientOptions(10 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = waiter.Close() })
	grabber := store.NewActivity(waiter.Pipeliner, other, 1)
	var (
		mu       sync.Mutex
		problems []string
		grabs    int
		slowest  time.Duration
	)
	problem := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(problems) < 20 {
			problems = append(problems, fmt.Sprintf(format, args...))
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			start := time.Now()
			res, _, err := grabber.Grab(ctx, "waiter-"+strconv.Itoa(i), nil)
			took := time.Since(start)
			mu.Lock()
			grabs++
			slowest = max(slowest, took)
			mu.Unlock()
			if err != nil || res.Outcome != store.Granted || took >= 100*time.Millisecond {
				problem("grab %d of the other activity: %+v, %v, in %v", i, res, err, took)
			}
		}
	})
	var kills atomic.Int64
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			err := op.Do(ctx, "function", "kill").Err()
			kills.Add(1)
			if err == nil || !strings.HasPrefix(err.Error(), "NOTBUSY") {
				problem("the operator's FUNCTION KILL answered %v; want NOTBUSY", err)
			}
		}
	})
	stopped := false
	stopWaiting := func() {
		if !stopped {
			stopped = true
			close(stop)
			wg.Wait()
		}
	}
	t.Cleanup(stopWaiting)

	before := usedMemory(t, ctx, op.(*redis.Client))
	// The dead letters: 500 entries of 4,000 field pairs of 220 bytes. Its
	// dead-letter stream is read-only to the tenant: refused there, they go to its
	// settlement stream.
	value := strings.Repeat("v", 220)
	pairs := make([]any, 0, 8_000)
	for i := range 4_000 {
		pairs = append(pairs, "f"+strconv.Itoa(i), value)
	}
	target, deadWritable := k.DeadLetters, true
	for i := range 500 {
		err := tenant.XAdd(ctx, &redis.XAddArgs{Stream: target, Values: pairs}).Err()
		if i == 0 && target == k.DeadLetters && isNoPerm(err) {
			target, deadWritable = k.Stream, false
			err = tenant.XAdd(ctx, &redis.XAddArgs{Stream: target, Values: pairs}).Err()
		}
		if err != nil {
			t.Fatalf("entry %d of 4,000 pairs into %s: %v", i, target, err)
		}
	}
	if deadWritable {
		t.Errorf("the tenant wrote 500 entries into its dead-letter stream %s; want NOPERM", k.DeadLetters)
	}
	// Packets of 1 MiB at the head and at the tail of its list, behind and ahead of
	// its 1,000 genuine ones; a meta hash with 64 KiB values; a claim and a transfer
	// mark of 1 MiB.
	mib := strings.Repeat("9", 1<<20)
	for range 16 {
		if err := tenant.LPush(ctx, k.Packets, "h:1@"+mib).Err(); err != nil {
			t.Fatal(err)
		}
		if err := tenant.RPush(ctx, k.Packets, "t:1@"+mib).Err(); err != nil {
			t.Fatal(err)
		}
	}
	kib64 := strings.Repeat("8", 64<<10)
	for i := range 200 {
		if err := tenant.HSet(ctx, k.Meta, "pad"+strconv.Itoa(i), kib64).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := tenant.HSet(ctx, k.Claims, "big-claim", mib).Err(); err != nil {
		t.Fatal(err)
	}
	if err := tenant.HSet(ctx, k.Transfers, "big-mark", mib).Err(); err != nil {
		t.Fatal(err)
	}
	after := usedMemory(t, ctx, op.(*redis.Client))
	t.Logf("the tenant wrote %d MiB into its keys", (after-before)>>20)
	if after-before < 512<<20 {
		t.Fatalf("the tenant wrote %d MiB; want at least 512", (after-before)>>20)
	}
	listed, err := op.LLen(ctx, k.Packets).Result()
	if err != nil {
		t.Fatal(err)
	}

	// Every function of the library, with the tenant's own keys.
	type call struct {
		name string
		s    *lua.Script
		keys []string
		args []any
	}
	// transfer_in's packets are the caller's own arguments, which Redis copies into
	// the function before it runs, as it reads any command's: 1 KiB each.
	bigIn := []any{"x-big", 1000, 1000, 0, 0, 1, 1, 0}
	for i := range 1000 {
		bigIn = append(bigIn, strconv.Itoa(i)+":1:"+strings.Repeat("p", 1<<10))
	}
	pk := "rpa:{" + own + "}:p:x1"
	calls := []call{
		{"replay_dead of 500", lua.ReplayDeadScript, []string{k.Meta, k.Stream, k.DeadLetters, k.Claims}, []any{500}},
		{"replay_dead of its settlement stream", lua.ReplayDeadScript, []string{k.Meta, k.Packets, k.Stream, k.Claims}, []any{500}},
		{"grab of a packet of 1 MiB", lua.GrabScript, []string{k.Meta, k.Packets, k.Claims, k.Stream}, []any{"new-user"}},
		{"grab of a claim of 1 MiB", lua.GrabScript, []string{k.Meta, k.Packets, k.Claims, k.Stream}, []any{"big-claim"}},
		{"snapshot of 13 MiB of meta", lua.SnapshotScript, []string{k.Meta, k.Packets, k.Staging, k.Claims}, nil},
		{"transfer_out of 1,000 packets of 1 MiB", lua.TransferOutScript, []string{k.Meta, k.Packets, k.Transfers}, []any{"x-out", 1, 1000}},
		{"transfer_out of a mark of 1 MiB", lua.TransferOutScript, []string{k.Meta, k.Packets, k.Transfers}, []any{"big-mark", 1, 1000}},
		{"transfer_in of 1,000 packets of 1 KiB", lua.TransferInScript, []string{k.Meta, k.Packets, k.Applied}, bigIn},
		{"transfer_done", lua.TransferDoneScript, []string{k.Meta, k.Transfers}, []any{"no-such-transfer"}},
		{"stock", lua.StockScript, []string{k.Meta, k.Packets, k.Transfers}, nil},
		{"packet_create", lua.PacketCreateScript, []string{k.Meta, pk, "rpa:{" + own + "}:due", "rpa:{" + own + "}:stream"}, []any{"x1", "fp", "s", 1, 1, "fixed", 0, 1}},
		{"packet_grab", lua.PacketGrabScript, []string{k.Meta, pk, k.Stream}, []any{"x1", "u"}},
		{"packet_detail", lua.PacketDetailScript, []string{k.Meta, pk}, []any{"x1"}},
		{"packet_live", lua.PacketLiveScript, []string{k.Meta, "rpa:{" + own + "}:due"}, []any{100}},
		{"budget_lend from 13 MiB of meta", lua.BudgetLendScript, []string{k.Meta}, []any{"1", 1000}},
		{"budget_borrow into 13 MiB of meta", lua.BudgetBorrowScript, []string{k.Meta}, []any{"1", 1, 1}},
		{"budget_lend_done on 13 MiB of meta", lua.BudgetLendDoneScript, []string{k.Meta}, []any{1}},
		{"packet_quota", lua.PacketQuotaScript, []string{k.Meta, "rpa:{" + own + "}:qd:20300101"}, []any{"take", "send", "s", 1, 0, 1, 0, 1, 1}},
	}
	if len(calls) != 2+len(lua.GrabLibrary.Scripts())+1 { // replay_dead and transfer_out twice
		t.Errorf("%d calls for the %d functions of the library", len(calls), len(lua.GrabLibrary.Scripts()))
	}
	streamLen, err := op.XLen(ctx, k.Stream).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range calls {
		start := time.Now()
		v, err := tenant.FCall(ctx, c.s.Function(), c.keys, c.args...).Result()
		took := time.Since(start)
		t.Logf("%s as the tenant: %s in %v", c.name, shortAnswer(v, err), took)
		if err != nil && (strings.HasPrefix(err.Error(), "BUSY") || strings.Contains(err.Error(), "UNKILLABLE")) {
			t.Errorf("%s: %v", c.name, err)
		}
		if c.s == lua.ReplayDeadScript && (err == nil || c.keys[2] == k.DeadLetters && !isNoPerm(err)) {
			t.Errorf("%s as the tenant: %s; want it refused (replay is the operator's)", c.name, shortAnswer(v, err))
		}
		if took > 100*time.Millisecond {
			t.Errorf("%s took %v", c.name, took)
		}
	}
	// Nothing was taken from the list or added to the stream by the refused calls
	// (the one grab of a genuine packet is refused too: the head holds a 1 MiB entry).
	if n, err := op.LLen(ctx, k.Packets).Result(); err != nil || n != listed {
		t.Errorf("the tenant's list holds %d, %v; want %d as before", n, err, listed)
	}
	if n, err := op.XLen(ctx, k.Stream).Result(); err != nil || n != streamLen {
		t.Errorf("the tenant's stream holds %d entries, %v; want %d as before", n, err, streamLen)
	}
	if n, err := op.HLen(ctx, k.Transfers).Result(); err != nil || n != 1 {
		t.Errorf("the tenant's transfer journal holds %d entries, %v; want its one mark", n, err)
	}

	// A budget's tenant, with its budget's Redis user, does the same on a budget
	// shard's keys: a packet of 1 MiB fields in the middle of 100 due packets,
	// a claim of 1 MiB, a packet hash of 5 MiB, and a list of 1 MiB entries under a
	// packet's name, then calls every function with them.
	const buid, bpw = "budget-holder", "budget-holder-pw-0123456789"
	b := store.NewBudget(op, buid, 1)
	if err := b.Configure(ctx, 10_000, store.BudgetLimits{Currency: "CNY", MaxTotal: 1000, MaxCount: 10, MinShare: 1,
		Distributions: []string{"Fixed"}, DefaultTTL: time.Hour, MaxTTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.EnsureUser(ctx, bpw); err != nil {
		t.Fatal(err)
	}
	bt := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: b.UserName(), Password: bpw, ReadTimeout: time.Minute})
	t.Cleanup(func() { _ = bt.Close() })
	bk := b.ShardKeys(0)
	pfx := strings.TrimSuffix(bk.Meta, "meta")
	big, list, fat := pfx+"p:big", pfx+"p:list", pfx+"p:fat"
	if err := bt.HSet(ctx, big, "cnt", 1000, "g", 0, "ex", 1<<50, "snd", mib, "s0", mib, "u:u-big", mib).Err(); err != nil {
		t.Fatal(err)
	}
	for i := range 100 {
		if err := bt.ZAdd(ctx, bk.Due, redis.Z{Score: float64(i), Member: "b" + strconv.Itoa(i)}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := bt.ZAdd(ctx, bk.Due, redis.Z{Score: 50, Member: "big"}).Err(); err != nil {
		t.Fatal(err)
	}
	fatFields := make([]any, 0, 4000)
	for i := range 2000 {
		fatFields = append(fatFields, "u:"+strconv.Itoa(i), strings.Repeat("f", 2500))
	}
	if err := bt.HSet(ctx, fat, fatFields...).Err(); err != nil {
		t.Fatal(err)
	}
	for range 16 {
		if err := bt.LPush(ctx, list, "h:1@"+mib).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// A sender's quota counter of 1 MiB.
	if err := bt.HSet(ctx, pfx+"qd:20300101", "u", mib).Err(); err != nil {
		t.Fatal(err)
	}
	// A move's record and a lender's applied mark of 1 MiB in the shard's meta.
	if err := bt.HSet(ctx, bk.Meta, "lend", mib, "in:1", mib).Err(); err != nil {
		t.Fatal(err)
	}
	if err := bt.XAdd(ctx, &redis.XAddArgs{Stream: bk.Stream, Values: pairs}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := bt.XAdd(ctx, &redis.XAddArgs{Stream: bk.DeadLetters, Values: []any{"a", "b"}}).Err(); !isNoPerm(err) {
		t.Errorf("XADD to the budget's dead letters as its user: %v; want NOPERM", err)
	}
	bcalls := []call{
		{"replay_dead", lua.ReplayDeadScript, []string{bk.Meta, bk.Stream, bk.DeadLetters, pfx + "noclaims"}, []any{500}},
		{"replay_dead of its stream", lua.ReplayDeadScript, []string{bk.Meta, list, bk.Stream, pfx + "noclaims"}, []any{500}},
		{"grab of a list of 1 MiB entries", lua.GrabScript, []string{bk.Meta, list, fat, bk.Stream}, []any{"u"}},
		{"snapshot", lua.SnapshotScript, []string{bk.Meta, list, list, fat}, nil},
		{"transfer_out of 1 MiB entries", lua.TransferOutScript, []string{bk.Meta, list, fat}, []any{"x", 1, 1000}},
		{"transfer_in", lua.TransferInScript, []string{bk.Meta, list, fat}, bigIn},
		{"transfer_done", lua.TransferDoneScript, []string{bk.Meta, fat}, []any{"u:1"}},
		{"stock", lua.StockScript, []string{bk.Meta, list, fat}, nil},
		{"packet_create", lua.PacketCreateScript, []string{bk.Meta, pfx + "p:x1", bk.Due, bk.Stream}, []any{"x1", "fp", "s", 1, 1, "Fixed", 0, 1}},
		{"packet_grab of a share of 1 MiB", lua.PacketGrabScript, []string{bk.Meta, big, bk.Stream}, []any{"big", "u"}},
		{"packet_grab of a claim of 1 MiB", lua.PacketGrabScript, []string{bk.Meta, big, bk.Stream}, []any{"big", "u-big"}},
		{"packet_detail of 5 MiB", lua.PacketDetailScript, []string{bk.Meta, fat}, []any{"fat"}},
		{"packet_live of 1 MiB senders", lua.PacketLiveScript, []string{bk.Meta, bk.Due}, []any{100}},
		{"budget_lend behind a record of 1 MiB", lua.BudgetLendScript, []string{bk.Meta}, []any{"1", 1000}},
		{"budget_borrow behind a mark of 1 MiB", lua.BudgetBorrowScript, []string{bk.Meta}, []any{"1", 1, 1}},
		{"budget_lend_done of a record of 1 MiB", lua.BudgetLendDoneScript, []string{bk.Meta}, []any{1}},
		{"packet_quota of a counter of 1 MiB", lua.PacketQuotaScript, []string{bk.Meta, pfx + "qd:20300101"}, []any{"take", "send", "u", 1, 0, 1, 0, 1, 1}},
	}
	if len(bcalls) != len(lua.GrabLibrary.Scripts())+2 { // replay_dead and packet_grab twice
		t.Errorf("%d calls of the budget's tenant for the %d functions of the library", len(bcalls), len(lua.GrabLibrary.Scripts()))
	}
	bStream, err := op.XLen(ctx, bk.Stream).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range bcalls {
		start := time.Now()
		v, err := bt.FCall(ctx, c.s.Function(), c.keys, c.args...).Result()
		took := time.Since(start)
		t.Logf("%s as the budget's tenant: %s in %v", c.name, shortAnswer(v, err), took)
		if err != nil && (strings.HasPrefix(err.Error(), "BUSY") || strings.Contains(err.Error(), "UNKILLABLE")) {
			t.Errorf("%s: %v", c.name, err)
		}
		if c.s == lua.ReplayDeadScript && err == nil {
			t.Errorf("%s as the budget's tenant: %v; want it refused", c.name, v)
		}
		if took > 100*time.Millisecond {
			t.Errorf("%s took %v", c.name, took)
		}
	}
	if n, err := op.XLen(ctx, bk.Stream).Result(); err != nil || n != bStream+1 {
		t.Errorf("the budget's stream holds %d entries, %v; want %d as before and the creation record of its packet_create", n, err, bStream)
	}
	if n, err := op.LLen(ctx, list).Result(); err != nil || n != 16 {
		t.Errorf("the budget tenant's list holds %d, %v; want its 16 entries", n, err)
	}

	stopWaiting()
	mu.Lock()
	t.Logf("%d grabs of the other activity, the slowest in %v; %d FUNCTION KILLs", grabs, slowest, kills.Load())
	for _, p := range problems {
		t.Error(p)
	}
	mu.Unlock()
	if grabs < 100 {
		t.Errorf("only %d grabs of the other activity ran", grabs)
	}
	logSlowLog(t, ctx, op, "during the calls")

	// The worst single command the tenant can still send on keys it may write: one
	// read of its whole settlement stream.
	if err := op.Do(ctx, "slowlog", "reset").Err(); err != nil {
		t.Fatal(err)
	}
	took, n, err := rawCommand(ctx, srv.Addr, tenant.(*redis.Client).Options(), "XRANGE", k.Stream, "-", "+")
	if err != nil {
		t.Fatalf("XRANGE of the whole stream as the tenant: %v", err)
	}
	t.Logf("worst single command: XRANGE of the tenant's whole stream (%d MiB of reply) at maxmemory %d MiB: %v at the client",
		n>>20, tenantHoldMaxMemory>>20, took)
	logSlowLog(t, ctx, op, "the tenant's XRANGE")
}

// shortAnswer is a reply or an error cut to 120 characters, for the log.
func shortAnswer(v any, err error) string {
	s := fmt.Sprint(v)
	if err != nil {
		s = "error " + err.Error()
	}
	if len(s) > 120 {
		s = s[:120] + "..."
	}
	return s
}

// logSlowLog logs the server's SLOWLOG: every command slower than the threshold the
// test set, with its execution time on the server.
func logSlowLog(t *testing.T, ctx context.Context, c redis.UniversalClient, what string) {
	t.Helper()
	logs, err := c.SlowLogGet(ctx, 1024).Result()
	if err != nil {
		t.Errorf("SLOWLOG GET: %v", err)
		return
	}
	for _, l := range logs {
		args := l.Args
		if len(args) > 3 {
			args = args[:3]
		}
		t.Logf("slowlog %s: %v %v", what, l.Duration, args)
	}
	if len(logs) == 0 {
		t.Logf("slowlog %s: no command over 10 ms", what)
	}
}

// rawCommand logs in as opt's user on a connection of its own, sends one command
// followed by a PING and reads the reply without parsing it, until the PING's
// answer: it returns how long that took and how many bytes came back.
func rawCommand(ctx context.Context, addr string, opt *redis.Options, args ...string) (time.Duration, int64, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return 0, 0, err
	}
	defer func() { _ = conn.Close() }()
	encode := func(args ...string) []byte {
		var b strings.Builder
		fmt.Fprintf(&b, "*%d\r\n", len(args))
		for _, a := range args {
			fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
		}
		return []byte(b.String())
	}
	r := bufio.NewReaderSize(conn, 1<<20)
	if _, err := conn.Write(encode("AUTH", opt.Username, opt.Password)); err != nil {
		return 0, 0, err
	}
	if line, err := r.ReadString('\n'); err != nil || line != "+OK\r\n" {
		return 0, 0, fmt.Errorf("AUTH: %q, %v", line, err)
	}
	start := time.Now()
	if _, err := conn.Write(append(encode(args...), encode("PING")...)); err != nil {
		return 0, 0, err
	}
	var n int64
	tail := make([]byte, 0, 8)
	buf := make([]byte, 1<<20)
	for {
		m, err := r.Read(buf)
		n += int64(m)
		tail = append(tail, buf[:m]...)
		if len(tail) > 7 {
			tail = tail[len(tail)-7:]
		}
		if string(tail) == "+PONG\r\n" {
			return time.Since(start), n, nil
		}
		if err != nil {
			return time.Since(start), n, err
		}
	}
}
