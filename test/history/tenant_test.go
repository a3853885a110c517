package history

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/store"
)

// The tenant adversary. A tenant who can read the Secrets of its own namespace holds
// its activity's Redis password (<activity>-grab-redis). Every run of the stand-in
// soak seeds a third activity, "the tenant's", rains on it through its own grab
// service and settles it like the others, while a tenantAdversary logged in as that
// activity's Redis user sends, at random, every command the user's ACL allows, with
// arguments aimed at the activity's keys (now and then at another activity's). What
// must hold, whatever it sends:
//
//   - the balance system is never credited beyond the tenant's activity: its grants
//     number at most the activity's count, and its grants plus its refund sum to at
//     most its total;
//   - no other activity is affected: the run's other two activities pass every check
//     of the run (linearizability, conservation, every acknowledged grant credited),
//     and no command of the adversary on another activity's key succeeds;
//   - Redis keeps answering: a PING from another client is answered within a second
//     throughout, and never with BUSY (a script that does not return).
//
// The tenant's own activity has no such guarantee beyond its total: the adversary may
// misdirect its packets, fence it or break its settlement.

// tenantSpec is the tenant's activity of a run: its UID, its packets and its users.
type tenantSpec struct {
	uid     string
	amounts []int64
	users   int
}

// newTenantSpec draws the tenant's activity from its own stream of the seed, so the
// run's other activities and faults are those the seed gave before the adversary.
func newTenantSpec(seed uint64) *tenantSpec {
	r := rand.New(rand.NewPCG(seed, 0x74656e61))
	spec := &tenantSpec{uid: fmt.Sprintf("hist-%d-tenant", seed), users: 60 + r.IntN(120)}
	for i := 20 + r.IntN(80); i > 0; i-- {
		spec.amounts = append(spec.amounts, int64(1+r.IntN(200)))
	}
	return spec
}

func (s *tenantSpec) total() int64 {
	var t int64
	for _, v := range s.amounts {
		t += v
	}
	return t
}

// adversaryCommand is one command the activity's user may run, as COMMAND INFO
// describes it: its words (a container command and its subcommand are two), arity,
// and where its keys are.
type adversaryCommand struct {
	words               []string
	arity               int
	first, last, stride int
}

// adversaryStats counts what the adversary sent and what Redis did with it.
type adversaryStats struct {
	sent, refused, failed, succeeded int64
	// foreign counts commands on another activity's keys that Redis ran: each is a
	// violation.
	foreign   int64
	byCommand map[string]int64
}

// tenantAdversary plays the tenant with its activity's Redis credential.
type tenantAdversary struct {
	admin    *redis.Client
	act      *store.Activity
	addr     string
	user     string
	password string
	commands []adversaryCommand
	keys     []string
	foreign  []string
	tokens   []string
	r        *rand.Rand

	mu    sync.Mutex
	stats adversaryStats
}

// adversaryKeySuffixes are the suffixes of an activity's keys (store/doc.go), and one
// that no script uses.
var adversaryKeySuffixes = []string{"meta", "staging", "packets", "claims", "stream", "dead", "xout", "xin", "stock", "x"}

// newTenantAdversary makes the activity's Redis user as the controller does (its
// password is what the tenant reads from the Secret) and learns what it may run from
// ACL GETUSER and COMMAND INFO.
func newTenantAdversary(ctx context.Context, admin *redis.Client, addr, uid string, foreignUIDs []string, seed uint64) (*tenantAdversary, error) {
	a := &tenantAdversary{admin: admin, act: store.NewActivity(admin, uid, 1), addr: addr, user: "rpa-" + uid,
		password: fmt.Sprintf("tenant-%d", seed), r: rand.New(rand.NewPCG(seed, 0x616476))}
	a.stats.byCommand = map[string]int64{}
	if err := a.ensureUser(ctx); err != nil {
		return nil, err
	}
	info, err := admin.Do(ctx, "ACL", "GETUSER", a.user).Result()
	if err != nil {
		return nil, fmt.Errorf("ACL GETUSER %s: %w", a.user, err)
	}
	fields, ok := info.(map[any]any)
	if !ok {
		return nil, fmt.Errorf("ACL GETUSER %s answered %T", a.user, info)
	}
	rules, _ := fields["commands"].(string)
	for _, rule := range strings.Fields(rules) {
		if !strings.HasPrefix(rule, "+") {
			continue
		}
		name := strings.TrimPrefix(rule, "+")
		c, err := commandInfo(ctx, admin, name)
		if err != nil {
			return nil, err
		}
		a.commands = append(a.commands, c)
	}
	if len(a.commands) == 0 {
		return nil, fmt.Errorf("the user %s may run no command (rules %q)", a.user, rules)
	}
	for _, s := range adversaryKeySuffixes {
		a.keys = append(a.keys, "rpa:{"+uid+"}:"+s)
		for _, f := range foreignUIDs {
			a.foreign = append(a.foreign, "rpa:{"+f+"}:"+s)
		}
	}
	a.tokens = []string{"0", "1", "-1", "2", "100", "1000000", "9223372036854775807", "900000000000000",
		"*", "$", "0-0", "1-0", "+", "-", ">", "COUNT", "100000000", "BLOCK", "0", "LIMIT", "NOMKSTREAM",
		"grant", "refund", "999:900000000000000:0:CNY:mallory", "1:600:0:CNY:mallory",
		"1:600@0:0", "999:900000000000000@0:0", "fenced", "rolled_back", "gate", "state", "open",
		"closed", "paused", "epoch", "activity_total", "activity_count", "refund", "mallory",
		"settlement", "rpa-settle", "u1", "u2", ""}
	return a, nil
}

// ensureUser sets the activity's user with the tenant's password, as the controller
// does at every reconcile (and so again after a restarted Redis lost it).
func (a *tenantAdversary) ensureUser(ctx context.Context) error {
	if _, err := a.act.Shard(0).EnsureUser(ctx, a.password); err != nil {
		return fmt.Errorf("making the activity's Redis user: %w", err)
	}
	return nil
}

// commandInfo reads a command's (or a subcommand's, "xgroup|create") arity and key
// positions.
func commandInfo(ctx context.Context, admin *redis.Client, name string) (adversaryCommand, error) {
	v, err := admin.Do(ctx, "COMMAND", "INFO", name).Slice()
	if err != nil || len(v) != 1 {
		return adversaryCommand{}, fmt.Errorf("COMMAND INFO %s: %v (%d replies)", name, err, len(v))
	}
	row, ok := v[0].([]any)
	if !ok || len(row) < 6 {
		return adversaryCommand{}, fmt.Errorf("COMMAND INFO %s: no such command", name)
	}
	num := func(x any) int { n, _ := x.(int64); return int(n) }
	return adversaryCommand{words: strings.Split(name, "|"), arity: num(row[1]), first: num(row[3]), last: num(row[4]), stride: num(row[5])}, nil
}

// busyScript is the tenant's attempt to stop Redis: a script that writes, so SCRIPT
// KILL cannot end it, and never returns.
const busyScript = "redis.call('HSET', KEYS[1], 'x', 1) while true do end"

// next draws one command and its arguments.
func (a *tenantAdversary) next() (name string, args []any, foreign bool) {
	c := a.commands[a.r.IntN(len(a.commands))]
	name = strings.Join(c.words, "|")
	key := func() string {
		if len(a.foreign) > 0 && a.r.IntN(8) == 0 {
			foreign = true
			return a.foreign[a.r.IntN(len(a.foreign))]
		}
		return a.keys[a.r.IntN(len(a.keys))]
	}
	token := func() string {
		if a.r.IntN(4) == 0 {
			return strconv.Itoa(a.r.IntN(400))
		}
		return a.tokens[a.r.IntN(len(a.tokens))]
	}
	for _, w := range c.words {
		args = append(args, w)
	}
	switch c.words[0] {
	case "eval", "eval_ro":
		return name, append(args, busyScript, 1, key()), foreign
	case "fcall", "fcall_ro", "evalsha", "evalsha_ro":
		// Any function or script name the tenant may know, its keys and arguments.
		args = append(args, token())
		n := 1 + a.r.IntN(4)
		args = append(args, n)
		for i := 0; i < n; i++ {
			args = append(args, key())
		}
		for i := a.r.IntN(6); i > 0; i-- {
			args = append(args, token())
		}
		return name, args, foreign
	}
	argc := c.arity
	if argc < 0 {
		argc = -argc + a.r.IntN(5)
	}
	last := c.last
	if last < 0 {
		last = argc + last
	}
	for i := len(c.words); i < argc; i++ {
		if c.first > 0 && i >= c.first && i <= last && (c.stride <= 1 || (i-c.first)%c.stride == 0) {
			args = append(args, key())
		} else {
			args = append(args, token())
		}
	}
	return name, args, foreign
}

// run sends commands until ctx ends. A refused command (NOPERM, a wrong number of
// arguments, a wrong type) is what most attempts get; a connection that a command
// blocked (WAIT, XREADGROUP BLOCK) is given up after its read timeout, which blocks
// only this client.
func (a *tenantAdversary) run(ctx context.Context) {
	c := redis.NewClient(&redis.Options{Addr: a.addr, Username: a.user, Password: a.password,
		ReadTimeout: 1500 * time.Millisecond, WriteTimeout: time.Second, MaxRetries: -1, PoolSize: 2})
	defer func() { _ = c.Close() }()
	for ctx.Err() == nil {
		name, args, foreign := a.next()
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := c.Do(cctx, args...).Err()
		cancel()
		a.mu.Lock()
		a.stats.sent++
		a.stats.byCommand[name]++
		switch {
		case err == nil || errors.Is(err, redis.Nil):
			a.stats.succeeded++
			if foreign {
				a.stats.foreign++
			}
		case strings.HasPrefix(err.Error(), "NOPERM"):
			a.stats.refused++
		default:
			a.stats.failed++
		}
		a.mu.Unlock()
		if err != nil && strings.Contains(err.Error(), "WRONGPASS") {
			// A restarted Redis forgot the user; the controller sets it again.
			_ = a.ensureUser(ctx)
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// pinger asks Redis for PING on its own connection every 20 ms and keeps the slowest
// answer and every BUSY reply, outside the windows in which a fault restarted or
// paused Redis on purpose.
type pinger struct {
	slowest  atomic.Int64 // nanoseconds
	busy     atomic.Int64
	excusedU atomic.Int64 // unix nanoseconds until which a slow answer is a fault's
}

func (p *pinger) excuse(d time.Duration) {
	until := time.Now().Add(d).UnixNano()
	for {
		cur := p.excusedU.Load()
		if cur >= until || p.excusedU.CompareAndSwap(cur, until) {
			return
		}
	}
}

func (p *pinger) run(ctx context.Context, addr string) {
	opt := adminOptions(addr)
	opt.ReadTimeout, opt.MaxRetries = 5*time.Second, -1
	c := redis.NewClient(opt)
	defer func() { _ = c.Close() }()
	for ctx.Err() == nil {
		begin := time.Now()
		err := c.Ping(ctx).Err()
		took := time.Since(begin)
		if time.Now().UnixNano() > p.excusedU.Load() && begin.UnixNano() > p.excusedU.Load() {
			if err != nil && strings.HasPrefix(err.Error(), "BUSY") {
				p.busy.Add(1)
			}
			if err == nil && took.Nanoseconds() > p.slowest.Load() {
				p.slowest.Store(took.Nanoseconds())
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// tenantRun is the tenant's activity of one run while it rains: its grab service, its
// real users' grabs, its settlement, the adversary and the pinger.
type tenantRun struct {
	spec   *tenantSpec
	adv    *tenantAdversary
	ping   *pinger
	svc    *grabService
	stop   context.CancelFunc
	done   sync.WaitGroup
	grants atomic.Int64
}

// startTenant seeds and opens the tenant's activity on a direct client (the
// stand-in's way), starts its grab service on the faulted link, its users' rain over
// window, and the adversary and the pinger, which run until stopAttack.
func startTenant(t *testing.T, ctx context.Context, srv *redisProc, direct *redis.Client, grabAddr string, spec *tenantSpec,
	foreign []string, deadline, window time.Duration, seed uint64) *tenantRun {
	t.Helper()
	act := store.NewActivity(direct, spec.uid, 1)
	if _, err := act.Seed(ctx, spec.amounts, store.SeedParams{Count: int64(len(spec.amounts)), Total: spec.total(),
		Sponsor: "sponsor-" + spec.uid}); err != nil {
		t.Fatalf("seeding the tenant's activity: %v", err)
	}
	if _, err := act.Configure(ctx, 0, 0, false, true); err != nil {
		t.Fatalf("opening the tenant's activity: %v", err)
	}
	adv, err := newTenantAdversary(ctx, direct, srv.Addr, spec.uid, foreign, seed)
	if err != nil {
		t.Fatalf("tenant adversary: %v", err)
	}
	svc, err := newGrabService(fakeActivity(spec.uid), grabAddr, deadline)
	if err != nil {
		t.Fatalf("grab service of the tenant's activity: %v", err)
	}
	tr := &tenantRun{spec: spec, adv: adv, ping: &pinger{}, svc: svc}
	actx, cancel := context.WithCancel(ctx)
	tr.stop = cancel
	tr.done.Add(3)
	go func() { defer tr.done.Done(); adv.run(actx) }()
	go func() { defer tr.done.Done(); tr.ping.run(actx, srv.Addr) }()
	go func() {
		defer tr.done.Done()
		hc := &http.Client{Timeout: deadline + 300*time.Millisecond}
		pace := window / time.Duration(spec.users)
		for i := 0; i < spec.users && actx.Err() == nil; i++ {
			out, _, err := svc.Grab(hc, fmt.Sprintf("t-u%d", i))
			if err == nil && out.Outcome == store.Granted {
				tr.grants.Add(1)
			}
			time.Sleep(pace)
		}
	}()
	return tr
}

// end stops the attack and the rain, closes the activity (which refunds whatever its
// data says is left: the adversary may have made that anything) and stops its grab
// service.
func (tr *tenantRun) end(ctx context.Context, direct *redis.Client) {
	tr.stop()
	tr.done.Wait()
	tr.svc.Close()
	act := store.NewActivity(direct, tr.spec.uid, 1)
	for try := 0; try < 5; try++ {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := act.Close(cctx, store.CloseExpired)
		cancel()
		if err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// check holds the tenant's run to what the adversary must not achieve, and returns
// the number of violations.
func (tr *tenantRun) check(t *testing.T, seed uint64, receiver *rain.Receiver) int {
	t.Helper()
	violations := 0
	credited, refund := receiver.Credited(tr.spec.uid)
	var sum int64
	for _, d := range credited {
		sum += d.Amount
	}
	if len(credited) > len(tr.spec.amounts) || sum+refund > tr.spec.total() {
		violations++
		t.Errorf("seed %d: the tenant's activity (%d packets, %d in total) was credited %d grants of %d and a refund of %d",
			seed, len(tr.spec.amounts), tr.spec.total(), len(credited), sum, refund)
	}
	st := tr.adv.snapshot()
	if st.foreign > 0 {
		violations++
		t.Errorf("seed %d: %d commands of the tenant's Redis user on another activity's keys succeeded", seed, st.foreign)
	}
	if b := tr.ping.busy.Load(); b > 0 {
		violations++
		t.Errorf("seed %d: Redis answered BUSY %d times while the tenant attacked", seed, b)
	}
	if s := time.Duration(tr.ping.slowest.Load()); s > time.Second {
		violations++
		t.Errorf("seed %d: a PING took %v while the tenant attacked (at most 1s)", seed, s)
	}
	if st.sent == 0 {
		violations++
		t.Errorf("seed %d: the adversary sent nothing", seed)
	}
	return violations
}

func (a *tenantAdversary) snapshot() adversaryStats {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := a.stats
	st.byCommand = nil
	return st
}

func (st adversaryStats) String() string {
	return fmt.Sprintf("sent %d (ran %d, refused %d, failed %d, on another activity %d)", st.sent, st.succeeded, st.refused, st.failed, st.foreign)
}
