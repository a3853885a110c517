package history

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
)

// The budget's tenant adversary. Whoever reads the Secrets of a budget's namespace
// holds the budget's Redis login (<budget>-grab-redis), whose ACL allows FCALL of the
// grab library and the data commands its functions call, on the budget's own keys.
// Every budget run has a budgetAdversary logged in as that user send, at random
// through the run, the writes that login allows and that the operator must not pay
// for or be slowed by:
//
//   - forged settlement entries: grants of packets that were never created, grants of
//     real packets' shares with amounts no share has, refunds of real packets to
//     another user than their sender;
//   - HINCRBY of a shard meta's allotted, raised and later lowered by the same
//     amount (a raised allotment once read as a refill under way);
//   - floods of a shard's due index with ids of no packet;
//   - creations of a real packet's id with another body (FCALL packet_create), which
//     must answer conflict and change nothing.
//
// What must hold, whatever it sends (checked by runBudgetScenario with the rest of
// the run's checks): every forged entry is dead-lettered, once, and nothing else is;
// nothing it forged is credited; every genuine share and refund is credited once to
// its user, within the announced total; the money is conserved; and no command it
// sends waits over a second.
//
// What the login can do that is not played here, because the operator does not
// prevent it (docs/budgets.md says so and names the tests that show it detected): a
// forged creation record with its grant, a grant of a real share for its recorded
// amount before the real winner, money written into a shard's available.
type budgetAdversary struct {
	c      *redis.Client
	admin  *store.Budget // the same budget through the admin's client, adminC
	adminC *redis.Client
	budget *store.Budget
	shards int
	r      *rand.Rand
	// ids are the run's packet ids; created says which exist in Redis.
	ids []string

	mu sync.Mutex
	// forged are the ids of the entries it appended, by shard.
	forged map[int]map[string]bool
	// raised is what it added to each shard's allotted and has not taken back yet;
	// allotted is each shard's allotment before the run, which the run's end puts
	// back (a fault may cut the answer of a raise that Redis applied).
	raised   map[int]int64
	allotted []int64
	stats    budgetAdversaryStats
}

// budgetAdversaryStats counts what the adversary sent.
type budgetAdversaryStats struct {
	sent, forged, conflicts int
	byKind                  map[string]int
	slowest                 time.Duration
	// errors are answers Redis should not give (NOPERM on the budget's own keys, a
	// created packet from a conflicting body).
	errors []string
}

// newBudgetAdversary logs in as the budget's Redis user (made with password through
// admin, as the operator makes it).
func newBudgetAdversary(ctx context.Context, admin *redis.Client, opts *redis.Options, uid string, allotted []int64, ids []string, seed uint64) (*budgetAdversary, error) {
	shards := len(allotted)
	b := store.NewBudget(admin, uid, shards)
	if _, err := b.EnsureUser(ctx, adversaryPassword); err != nil {
		return nil, fmt.Errorf("making the budget's Redis user: %w", err)
	}
	o := *opts
	o.Username, o.Password = b.UserName(), adversaryPassword
	o.MaxRetries = -1
	c := redis.NewClient(&o)
	return &budgetAdversary{c: c, admin: b, adminC: admin, budget: store.NewBudget(c, uid, shards), shards: shards, ids: ids, allotted: allotted,
		r:      rand.New(rand.NewPCG(seed, 0x61647672)),
		forged: map[int]map[string]bool{}, raised: map[int]int64{},
		stats: budgetAdversaryStats{byKind: map[string]int{}}}, nil
}

// adversaryPassword is the budget user's password in the runs.
const adversaryPassword = "tenant-password-of-the-history-run"

// run sends a write every few milliseconds until ctx ends; then the run's end puts
// the allotments back as they were (through the admin's client: the adversary's
// last answers may have been cut).
func (a *budgetAdversary) run(ctx context.Context) {
	for ctx.Err() == nil {
		a.once(context.Background())
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(5+a.r.IntN(40)) * time.Millisecond):
		}
	}
	for i, k := range a.allotted {
		for attempt := 0; ; attempt++ {
			err := a.adminC.HSet(context.Background(), a.budget.ShardKeys(i).Meta, "allotted", k).Err()
			if err == nil || attempt == 20 {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// once sends one write, drawn at random.
func (a *budgetAdversary) once(ctx context.Context) {
	id := a.ids[a.r.IntN(len(a.ids))]
	switch a.r.IntN(7) {
	case 0: // a grant of a packet that was never created
		ghost := fmt.Sprintf("ghost-%d", a.r.IntN(1000))
		a.forge("ghost", ghost, "grant", fmt.Sprintf("%s/%d:%d:0:CNY:mallory", ghost, a.r.IntN(4), 1+a.r.IntN(9000)))
	case 1, 2: // a grant of a real packet's share, of an amount no share has (above maxTotal)
		a.forge("wrong-amount", id, "grant", fmt.Sprintf("%s/%d:%d:0:CNY:mallory", id, a.r.IntN(8), 10_000+a.r.IntN(1000)))
	case 3: // a refund of a real packet to someone else than its sender
		i := a.budget.ShardOf(id)
		a.send("refund", func(c context.Context) error {
			eid, err := a.c.XAdd(c, &redis.XAddArgs{Stream: a.budget.ShardKeys(i).Stream, Values: []string{
				"kind", "refund", "packet", id + "/refund", "user", "mallory", "amount", "1", "currency", "CNY",
				"at", fmt.Sprint(time.Now().UnixMilli()), adversaryMark, "1"}}).Result()
			if err == nil {
				a.record(i, eid)
			}
			return err
		})
	case 4: // raise a shard's allotment, or take back what was raised
		i := a.r.IntN(a.shards)
		k := int64(1 + a.r.IntN(100_000))
		a.mu.Lock()
		if prev, ok := a.raised[i]; ok {
			k = -prev
			delete(a.raised, i)
		} else {
			a.raised[i] = k
		}
		a.mu.Unlock()
		a.send("allotted", func(c context.Context) error {
			return a.c.HIncrBy(c, a.budget.ShardKeys(i).Meta, "allotted", k).Err()
		})
	case 5: // flood a shard's due index with ids of no packet, due long ago
		if a.r.IntN(8) != 0 {
			return // about one flood of 1,000 a second: the run's own packets expire on time
		}
		i := a.r.IntN(a.shards)
		zs := make([]redis.Z, 1000)
		for j := range zs {
			zs[j] = redis.Z{Score: 0, Member: fmt.Sprintf("flood-%d-%d", a.r.IntN(1<<30), j)}
		}
		a.send("due-flood", func(c context.Context) error { return a.c.ZAdd(c, a.budget.ShardKeys(i).Due, zs...).Err() })
	case 6: // the creation of an existing packet's id with another body
		k := a.budget.ShardKeys(a.budget.ShardOf(id))
		exists, err := a.c.HExists(ctx, k.Packet(id), "fp").Result()
		if err != nil || !exists {
			return
		}
		a.send("reused-id", func(c context.Context) error {
			v, err := lua.PacketCreateScript.Call(c, a.c, []string{k.Meta, k.Packet(id), k.Due, k.Stream},
				id, "adversary-fingerprint", "mallory", 1, 1, "Fixed", 0, 1).StringSlice()
			if err != nil {
				return err
			}
			a.mu.Lock()
			defer a.mu.Unlock()
			if len(v) == 0 || v[0] != "conflict" {
				a.stats.errors = append(a.stats.errors, fmt.Sprintf("creating %s again with another body answered %v, not conflict", id, v))
			}
			a.stats.conflicts++
			return nil
		})
	}
}

// adversaryMark is a field of every entry the adversary appends, which settlement
// ignores and a dead letter keeps: an entry whose XADD answer a fault cut is still
// known for the adversary's.
const adversaryMark = "adversary"

// forge appends one entry of field=value to the stream of packet's shard.
func (a *budgetAdversary) forge(kind, packet, field, value string) {
	i := a.budget.ShardOf(packet)
	a.send(kind, func(c context.Context) error {
		eid, err := a.c.XAdd(c, &redis.XAddArgs{Stream: a.budget.ShardKeys(i).Stream, Values: []string{field, value, adversaryMark, "1"}}).Result()
		if err == nil {
			a.record(i, eid)
		}
		return err
	})
}

func (a *budgetAdversary) record(shard int, id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.forged[shard] == nil {
		a.forged[shard] = map[string]bool{}
	}
	a.forged[shard][id] = true
	a.stats.forged++
}

// send runs one command, timed. The faults of the run may cut it (an error); an
// answer that says the login may not do it is an error of the run.
func (a *budgetAdversary) send(kind string, do func(context.Context) error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	err := do(ctx)
	took := time.Since(start)
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stats.sent++
	a.stats.byKind[kind]++
	a.stats.slowest = max(a.stats.slowest, took)
	if err != nil && (strings.Contains(err.Error(), "NOPERM") || strings.Contains(err.Error(), "BUSY")) {
		a.stats.errors = append(a.stats.errors, fmt.Sprintf("%s: %v", kind, err))
	}
	if err != nil && strings.Contains(err.Error(), "WRONGPASS") {
		// A restarted Redis forgot the ACL user; the operator makes it again at its
		// next reconcile, as this does.
		_, _ = a.admin.EnsureUser(ctx, adversaryPassword)
	}
}

// check compares the budget's dead letters with the entries the adversary forged:
// each forged entry dead-lettered once, and nothing but its entries (those whose
// answer a fault cut are known by their mark). It returns the problems.
// It also returns how many dead letters the shards hold.
func (a *budgetAdversary) check(ctx context.Context, admin *redis.Client, uid string) (problems []string, dead int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	b := store.NewBudget(admin, uid, a.shards)
	for i := range a.shards {
		letters, err := b.Stream(i).DeadLetters(ctx)
		if err != nil {
			return append(problems, fmt.Sprintf("reading shard %d's dead letters: %v", i, err)), dead
		}
		dead += int64(len(letters))
		seen := map[string]int{}
		marked := map[string]bool{}
		for _, d := range letters {
			seen[d.Fields["entry"]]++
			marked[d.Fields["entry"]] = d.Fields[adversaryMark] == "1"
		}
		var missing, extra []string
		for id := range a.forged[i] {
			if seen[id] != 1 {
				missing = append(missing, fmt.Sprintf("%s (%d times)", id, seen[id]))
			}
		}
		for id := range seen {
			if !a.forged[i][id] && !marked[id] {
				extra = append(extra, id)
			}
		}
		sort.Strings(missing)
		sort.Strings(extra)
		if len(missing) > 0 {
			problems = append(problems, fmt.Sprintf("shard %d: forged entries not dead-lettered once: %v", i, missing))
		}
		if len(extra) > 0 {
			problems = append(problems, fmt.Sprintf("shard %d: entries dead-lettered that the adversary did not forge: %v", i, extra))
		}
	}
	if a.stats.slowest > time.Second {
		problems = append(problems, fmt.Sprintf("a command of the adversary waited %v", a.stats.slowest))
	}
	return append(problems, a.stats.errors...), dead
}

func (a *budgetAdversary) Close() error { return a.c.Close() }
