package store_test

import (
	"math"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// A budget's overdue age is how long its oldest due entry has waited by the Redis
// clock, over every shard: 0 with nothing due (empty, or due later, or +inf), the
// age of an entry past its score, and a forged -inf reads as due since the epoch,
// a valid duration.
func TestBudgetOverdueAge(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	limits := store.BudgetLimits{Currency: "CNY", MaxTotal: 1000, MaxCount: 5, MinShare: 1,
		Distributions: []string{split.TypeFixed}, DefaultTTL: time.Hour, MaxTTL: time.Hour}
	b := configuredBudget(t, ctx, c, "overdue", 2, 10_000, limits)
	age := func(want string) time.Duration {
		t.Helper()
		a, err := b.OverdueAge(ctx)
		if err != nil {
			t.Fatalf("%s: %v", want, err)
		}
		return a
	}
	if a := age("empty"); a != 0 {
		t.Errorf("empty indexes: %v, want 0", a)
	}
	now, err := c.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	add := func(i int, score float64, id string) {
		t.Helper()
		if err := c.ZAdd(ctx, b.ShardKeys(i).Due, redis.Z{Score: score, Member: id}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	add(0, float64(now.Add(time.Hour).UnixMilli()), "later")
	add(1, math.Inf(1), "never")
	if a := age("later"); a != 0 {
		t.Errorf("nothing due: %v, want 0", a)
	}
	add(1, float64(now.Add(-3*time.Second).UnixMilli()), "late")
	if a := age("late"); a < 3*time.Second || a > 13*time.Second {
		t.Errorf("an entry due 3 s ago: %v", a)
	}
	add(0, math.Inf(-1), "forged")
	if a := age("forged"); a < time.Duration(now.UnixMilli()-1000)*time.Millisecond {
		t.Errorf("a forged -inf entry: %v, want the time since the epoch", a)
	}
}
