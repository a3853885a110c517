package store_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// quotaAt is the quota time of a wall-clock instant in Asia/Shanghai.
func quotaAt(t testing.TB, wall string) store.QuotaTime {
	t.Helper()
	loc, err := time.LoadLocation("Asia/Shanghai")
	if err != nil {
		t.Fatal(err)
	}
	at, err := time.ParseInLocation("2006-01-02 15:04:05", wall, loc)
	if err != nil {
		t.Fatal(err)
	}
	return store.NewBudget(nil, "any", 1).QuotaTimeAt(at, loc)
}

// idsOnOrOff returns n packet ids that hash to shard home of b when on, to another
// shard when not.
func idsOnOrOff(b *store.Budget, prefix string, home int, on bool, n int) []string {
	var ids []string
	for j := 0; len(ids) < n; j++ {
		id := fmt.Sprintf("%s%d", prefix, j)
		if (b.ShardOf(id) == home) == on {
			ids = append(ids, id)
		}
	}
	return ids
}

func createQuota(t testing.TB, ctx context.Context, b *store.Budget, id, sender string, total int64, q store.QuotaCheck) store.CreateResult {
	t.Helper()
	r, err := b.Create(ctx, store.NewPacket{ID: id, Sender: sender, Total: total, Count: 2, Distribution: split.TypeFixed, Quota: &q})
	if err != nil {
		t.Fatalf("creating %s: %v", id, err)
	}
	return r
}

func wantCreate(t testing.TB, r store.CreateResult, want store.CreateOutcome, rule string) {
	t.Helper()
	if r.Outcome != want {
		t.Fatalf("creation: %s (%s, %+v), want %s", r.Outcome, r.Reason, r.Quota, want)
	}
	if rule != "" && (r.Quota == nil || r.Quota.Rule != rule) {
		t.Fatalf("refusal names %+v, want rule %s", r.Quota, rule)
	}
}

func used(t testing.TB, ctx context.Context, b *store.Budget, who string, at store.QuotaTime) store.QuotaUse {
	t.Helper()
	u, err := b.QuotaUsed(ctx, who, at)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// Every sender quota refuses past its limit with its rule and writes nothing, a
// retry of a packet that exists still answers existing, a creation refused for
// another reason gives its count back, and the next minute or day starts again;
// with one budget shard (the create counts the quota itself) and with four, for
// packets on the sender's home shard and on the others (taken there, then given
// back unless created).
func TestBudgetSenderQuotas(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	for _, tc := range []struct {
		n                 int
		onHome, oneServer bool
	}{{1, true, false}, {4, true, false}, {4, false, false}, {4, false, true}} {
		n, onHome := tc.n, tc.onHome
		t.Run(fmt.Sprintf("%d shards, packets on the home shard %v, one server %v", n, onHome, tc.oneServer), func(t *testing.T) {
			uid := fmt.Sprintf("sender-quotas-%d-%v-%v", n, onHome, tc.oneServer)
			b := configuredBudget(t, ctx, c, uid, n, 1_000_000, testLimits())
			if tc.oneServer {
				b.OnOneServer()
			}
			sender := "merchant-1"
			ids := idsOnOrOff(b, "order-", b.QuotaShardOf(sender), onHome, 12)
			limits := store.Quotas{PacketsPerMinute: 3, PacketsPerDay: 5, AmountPerDay: 10_000}
			at := quotaAt(t, "2030-06-14 23:58:10")
			q := store.QuotaCheck{Limits: limits, At: at}

			for _, id := range ids[:3] {
				wantCreate(t, createQuota(t, ctx, b, id, sender, 100, q), store.CreateCreated, "")
			}
			unchanged(t, ctx, c, "a fourth packet in the minute", func() {
				wantCreate(t, createQuota(t, ctx, b, ids[3], sender, 100, q), store.CreateQuotaExceeded, store.RulePacketsPerMinute)
			})
			unchanged(t, ctx, c, "a retry of a packet created", func() {
				wantCreate(t, createQuota(t, ctx, b, ids[0], sender, 100, q), store.CreateExisting, "")
			})
			if u := used(t, ctx, b, sender, at); u.Minute != 3 || u.Packets != 3 || u.Amount != 300 {
				t.Fatalf("used %+v after 3 packets of 100", u)
			}

			// The next minute: two more reach the day's five.
			q.At = quotaAt(t, "2030-06-14 23:59:00")
			// A creation refused for another reason (a distribution the budget does
			// not allow) counts nothing.
			r, err := b.Create(ctx, store.NewPacket{ID: ids[3], Sender: sender, Total: 100, Count: 2, Distribution: split.TypeLineCut, Quota: &q})
			if err != nil {
				t.Fatal(err)
			}
			wantCreate(t, r, store.CreateLimitExceeded, "")
			if u := used(t, ctx, b, sender, q.At); u.Minute != 0 || u.Packets != 3 {
				t.Fatalf("used %+v after a refused creation", u)
			}
			wantCreate(t, createQuota(t, ctx, b, ids[3], sender, 100, q), store.CreateCreated, "")
			wantCreate(t, createQuota(t, ctx, b, ids[4], sender, 100, q), store.CreateCreated, "")
			unchanged(t, ctx, c, "a sixth packet in the day", func() {
				wantCreate(t, createQuota(t, ctx, b, ids[5], sender, 100, q), store.CreateQuotaExceeded, store.RulePacketsPerDay)
			})
			unchanged(t, ctx, c, "a retry of a packet created, at the daily quota", func() {
				wantCreate(t, createQuota(t, ctx, b, ids[1], sender, 100, q), store.CreateExisting, "")
			})
			// Another sender has quotas of its own.
			wantCreate(t, createQuota(t, ctx, b, ids[5], "merchant-2", 100, q), store.CreateCreated, "")

			// Midnight in Shanghai (16:00 UTC): a new day.
			q.At = quotaAt(t, "2030-06-15 00:00:00")
			if q.At.Day != "20300615" {
				t.Fatalf("day %s", q.At.Day)
			}
			wantCreate(t, createQuota(t, ctx, b, ids[6], sender, 9_000, q), store.CreateCreated, "")
			unchanged(t, ctx, c, "money past the day's", func() {
				wantCreate(t, createQuota(t, ctx, b, ids[7], sender, 1_001, q), store.CreateQuotaExceeded, store.RuleAmountPerDay)
			})
			wantCreate(t, createQuota(t, ctx, b, ids[7], sender, 1_000, q), store.CreateCreated, "")
			if u := used(t, ctx, b, sender, q.At); u.Packets != 2 || u.Amount != 10_000 {
				t.Fatalf("used %+v on the new day", u)
			}
			conserved(t, ctx, b)

			// The counters expire on their own, an hour after the day's end.
			key := b.ShardKeys(b.QuotaShardOf(sender)).QuotaDay(q.At.Day)
			if got, err := c.Do(ctx, "PEXPIRETIME", key).Int64(); err != nil || got != q.At.DayEnd.Add(time.Hour).UnixMilli() {
				t.Fatalf("PEXPIRETIME %s = %d (%v), want %d", key, got, err, q.At.DayEnd.Add(time.Hour).UnixMilli())
			}
		})
	}
}

// The recipient quota counts grants across the budget's packets and nothing else:
// a repeat answers already_claimed at the quota, a sold-out grab gives its count
// back, a refusal writes nothing, and the next day starts again.
func TestBudgetRecipientQuota(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	for _, tc := range []struct {
		n         int
		oneServer bool
	}{{1, false}, {4, false}, {4, true}} {
		n := tc.n
		t.Run(fmt.Sprintf("%d shards, one server %v", n, tc.oneServer), func(t *testing.T) {
			b := configuredBudget(t, ctx, c, fmt.Sprintf("recipient-quota-%d-%v", n, tc.oneServer), n, 1_000_000, testLimits())
			if tc.oneServer {
				b.OnOneServer()
			}
			user := "member-1"
			// Packets on the user's home shard and on others alike.
			ids := append(idsOnOrOff(b, "p-", b.QuotaShardOf(user), true, 3), idsOnOrOff(b, "q-", b.QuotaShardOf(user), n == 1, 3)...)
			for _, id := range ids {
				createOrFail(t, ctx, b, store.NewPacket{ID: id, Sender: "m", Total: 10, Count: 1, Distribution: split.TypeFixed}, store.CreateCreated)
			}
			q := store.QuotaCheck{Limits: store.Quotas{SharesPerDay: 2}, At: quotaAt(t, "2030-06-14 12:00:00")}
			grab := func(id, who string, want store.PacketGrabOutcome) {
				t.Helper()
				g, err := b.GrabPacketWithin(ctx, id, who, &q)
				if err != nil || g.Outcome != want {
					t.Fatalf("grab of %s by %s: %+v, %v; want %s", id, who, g, err, want)
				}
				if want == store.PacketQuotaExceeded && (g.Quota == nil || g.Quota.Rule != store.RuleSharesPerDay || g.Quota.Limit != 2) {
					t.Fatalf("refusal %+v", g.Quota)
				}
			}
			grab(ids[0], user, store.PacketGranted)
			grab(ids[3], "member-2", store.PacketGranted) // one share: sold out now
			grab(ids[3], user, store.PacketSoldOut)
			if u := used(t, ctx, b, user, q.At); u.Shares != 1 {
				t.Fatalf("used %+v after one grant and a sold-out grab", u)
			}
			grab(ids[4], user, store.PacketGranted)
			unchanged(t, ctx, c, "a third share in the day", func() { grab(ids[1], user, store.PacketQuotaExceeded) })
			unchanged(t, ctx, c, "a repeat at the quota", func() { grab(ids[4], user, store.PacketAlreadyClaimed) })
			q.At = quotaAt(t, "2030-06-15 00:00:01")
			grab(ids[1], user, store.PacketGranted)
			conserved(t, ctx, b)
		})
	}
}

// 64 clients create packets as one sender at once, past the daily quota: exactly
// the quota is created, on one shard and across eight, on one server and on a
// cluster of three masters.
func TestBudgetSenderQuotaConcurrent(t *testing.T) {
	ctx := redistest.Context(t)
	servers := map[string]redis.Cmdable{
		"standalone": redistest.Start(t).Client(t),
		"cluster":    redistest.StartCluster(t, 3).Client(t),
	}
	for name, c := range servers {
		for _, n := range []int{1, 8, -8} { // -8: eight shards, counted in one step on one server
			if n < 0 && name == "cluster" {
				continue
			}
			t.Run(fmt.Sprintf("%s, %d shards", name, n), func(t *testing.T) {
				b := configuredBudget(t, ctx, c, fmt.Sprintf("concurrent-quota-%s-%d", name, n), max(n, -n), 10_000_000, testLimits())
				if n < 0 {
					b.OnOneServer()
				}
				const quota, clients, each = 50, 64, 3
				q := store.QuotaCheck{Limits: store.Quotas{PacketsPerDay: quota}, At: quotaAt(t, "2030-06-14 23:59:59")}
				var created, refused atomic.Int64
				var wg sync.WaitGroup
				errs := make(chan error, clients)
				for i := range clients {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for j := range each {
							r, err := b.Create(ctx, store.NewPacket{ID: fmt.Sprintf("c%d-%d", i, j), Sender: "hot-sender", Total: 10,
								Count: 1, Distribution: split.TypeFixed, Quota: &q})
							if err != nil {
								errs <- err
								return
							}
							switch r.Outcome {
							case store.CreateCreated:
								created.Add(1)
							case store.CreateQuotaExceeded:
								refused.Add(1)
							default:
								errs <- fmt.Errorf("outcome %s", r.Outcome)
								return
							}
						}
					}()
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					t.Fatal(err)
				}
				s := conserved(t, ctx, b)
				if created.Load() != quota || refused.Load() != clients*each-quota || s.CreatedPackets != quota {
					t.Fatalf("created %d, refused %d, the budget counts %d packets; want %d created", created.Load(),
						refused.Load(), s.CreatedPackets, quota)
				}
				if u := used(t, ctx, b, "hot-sender", q.At); u.Packets != quota || u.Amount != quota*10 {
					t.Fatalf("used %+v", u)
				}
			})
		}
	}
}

// With the packet off its sender's home shard, a retry that finds the packet after
// the quota was taken keeps the count when the packet is younger than
// QuotaClockMargin (it may be the call's own creation, its reply lost) and gives it
// back when older: a merchant's retry a while later counts nothing.
func TestBudgetQuotaRetryAfterTake(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "quota-retry", 4, 1_000_000, testLimits())
	sender := "merchant-1"
	id := idsOnOrOff(b, "order-", b.QuotaShardOf(sender), false, 1)[0]
	q := store.QuotaCheck{Limits: store.Quotas{PacketsPerDay: 10}, At: quotaAt(t, "2030-06-14 12:00:00")}
	wantCreate(t, createQuota(t, ctx, b, id, sender, 100, q), store.CreateCreated, "")
	wantCreate(t, createQuota(t, ctx, b, id, sender, 100, q), store.CreateExisting, "")
	if u := used(t, ctx, b, sender, q.At); u.Packets != 2 {
		t.Fatalf("used %+v after a retry at once: want the take kept (2)", u)
	}
	time.Sleep(store.QuotaClockMargin + 100*time.Millisecond)
	wantCreate(t, createQuota(t, ctx, b, id, sender, 100, q), store.CreateExisting, "")
	if u := used(t, ctx, b, sender, q.At); u.Packets != 2 {
		t.Fatalf("used %+v after a retry %v later: want it given back (2)", u, store.QuotaClockMargin)
	}
}

// On one server the quota of a packet off its sender's home shard is counted by the
// create itself: a retry at once counts nothing.
func TestBudgetQuotaOnOneServer(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	b := configuredBudget(t, ctx, c, "quota-one-server", 4, 1_000_000, testLimits()).OnOneServer()
	sender := "merchant-1"
	id := idsOnOrOff(b, "order-", b.QuotaShardOf(sender), false, 1)[0]
	q := store.QuotaCheck{Limits: store.Quotas{PacketsPerDay: 10}, At: quotaAt(t, "2030-06-14 12:00:00")}
	wantCreate(t, createQuota(t, ctx, b, id, sender, 100, q), store.CreateCreated, "")
	unchanged(t, ctx, c, "a retry at once", func() {
		wantCreate(t, createQuota(t, ctx, b, id, sender, 100, q), store.CreateExisting, "")
	})
	if u := used(t, ctx, b, sender, q.At); u.Packets != 1 {
		t.Fatalf("used %+v: want 1", u)
	}
}
