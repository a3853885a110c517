package balance

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"redpacket.io/operator/test/pgtest"
)

// postUntilAnswered posts d until the answer is not 409 (another client's copy of the
// same key in flight), as the operator's retries do, and returns that answer.
func (e *env) postUntilAnswered(d Delivery, body []byte) (answer, int, error) {
	sig := sign(testKey, body)
	for conflicts := 0; ; conflicts++ {
		a, err := e.postRaw(keyOf(d), body, sig)
		if err != nil || a.status != StatusInFlight {
			return a, conflicts, err
		}
		time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
	}
}

// 64 clients post overlapping keys over real HTTP, each key by 4 of them with the
// same body, in random order: every key is booked exactly once (one 201, the other
// posts 200 replays), no answer is a 5xx, and the sources' sums and every user's
// balance are exact to the unit.
func TestConcurrentClientsBookEachKeyOnce(t *testing.T) {
	pg := pgtest.Start(t)
	e := newEnv(t, pg)
	const (
		clients     = 64
		copies      = 4
		actPackets  = 500
		budPackets  = 150
		budShares   = 2
		users       = 40
		actRefund   = 1234
		budRefundOf = "order-7"
	)
	// An activity whose grants and refund use its total exactly, and a budget whose
	// shares and refunds stay within it.
	var deliveries []Delivery
	var actSum, budSum int64
	want := map[string]int64{}
	for i := 1; i <= actPackets; i++ {
		d := grant("act-c", i, fmt.Sprintf("user-%d", i%users), int64(1+i%97))
		deliveries = append(deliveries, d)
		actSum += d.Amount
		want[d.UserID] += d.Amount
	}
	deliveries = append(deliveries, refund("act-c", "sponsor", actRefund))
	want["sponsor"] += actRefund
	for p := range budPackets {
		for s := range budShares {
			d := budgetGrant("bud-c", fmt.Sprintf("order-%d", p), s, fmt.Sprintf("user-%d", (p+s)%users), int64(10+p%13))
			deliveries = append(deliveries, d)
			budSum += d.Amount
			want[d.UserID] += d.Amount
		}
	}
	deliveries = append(deliveries, budgetRefund("bud-c", budRefundOf, "sender", 5))
	want["sender"] += 5
	budSum += 5
	expectBooked(t, e.post(announceActivity("act-c", actSum+actRefund, actPackets)))
	expectBooked(t, e.post(announceBudget("bud-c", budSum+1000)))

	// Each key copies times, shuffled, dealt to the clients.
	type post struct {
		d    Delivery
		body []byte
	}
	var posts []post
	for _, d := range deliveries {
		body := mustJSON(t, d)
		for range copies {
			posts = append(posts, post{d, body})
		}
	}
	rand.Shuffle(len(posts), func(i, j int) { posts[i], posts[j] = posts[j], posts[i] })

	var booked, replayed, conflicts, other atomic.Int64
	bookedBy := sync.Map{} // key -> how many 201s
	var wg sync.WaitGroup
	start := time.Now()
	for c := range clients {
		wg.Go(func() {
			for i := c; i < len(posts); i += clients {
				p := posts[i]
				a, n, err := e.postUntilAnswered(p.d, p.body)
				conflicts.Add(int64(n))
				switch {
				case err != nil:
					t.Errorf("client %d: %v", c, err)
					return
				case a.status == StatusBooked:
					booked.Add(1)
					v, _ := bookedBy.LoadOrStore(keyOf(p.d), new(atomic.Int64))
					v.(*atomic.Int64).Add(1)
				case a.status == StatusReplayed && a.header.Get(ReplayedHeader) == "true":
					replayed.Add(1)
				default:
					other.Add(1)
					t.Errorf("client %d, key %s: %s", c, keyOf(p.d), a)
				}
			}
		})
	}
	wg.Wait()
	took := time.Since(start)
	t.Logf("%d posts of %d keys by %d clients in %v: %d booked, %d replayed, %d in-flight conflicts retried, %d other",
		len(posts), len(deliveries), clients, took.Round(time.Millisecond), booked.Load(), replayed.Load(), conflicts.Load(), other.Load())
	if booked.Load() != int64(len(deliveries)) || replayed.Load() != int64(len(posts)-len(deliveries)) || other.Load() != 0 {
		t.Fatalf("%d booked and %d replayed of %d keys posted %d times each", booked.Load(), replayed.Load(), len(deliveries), copies)
	}
	bookedBy.Range(func(k, v any) bool {
		if n := v.(*atomic.Int64).Load(); n != 1 {
			t.Errorf("key %s answered 201 %d times", k, n)
		}
		return true
	})

	ctx := t.Context()
	var rows, keys int64
	if err := e.pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT idempotency_key) FROM credits").Scan(&rows, &keys); err != nil {
		t.Fatal(err)
	}
	if rows != int64(len(deliveries)) || keys != rows {
		t.Fatalf("%d credit rows of %d keys, want %d", rows, keys, len(deliveries))
	}
	if s := e.source("act-c"); s.Grants != (Tally{Count: actPackets, Sum: actSum}) || s.Refunds != (Tally{Count: 1, Sum: actRefund}) || s.Credited != s.Total {
		t.Fatalf("activity %+v, want grants %d/%d and the refund", s, actPackets, actSum)
	}
	if s := e.source("bud-c"); s.Grants != (Tally{Count: budPackets * budShares, Sum: budSum - 5}) || s.Refunds != (Tally{Count: 1, Sum: 5}) {
		t.Fatalf("budget %+v, want %d credited", s, budSum)
	}
	got := map[string]int64{}
	rs, err := e.pool.Query(ctx, "SELECT user_id, amount FROM balances WHERE currency = 'CNY'")
	if err != nil {
		t.Fatal(err)
	}
	for rs.Next() {
		var u string
		var a int64
		if err := rs.Scan(&u, &a); err != nil {
			t.Fatal(err)
		}
		got[u] = a
	}
	if len(got) != len(want) {
		t.Fatalf("%d users have a balance, want %d", len(got), len(want))
	}
	for u, a := range want {
		if got[u] != a {
			t.Errorf("%s's balance %d, want %d", u, got[u], a)
		}
	}
	// Every balance is the sum of its user's credits.
	var off int64
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM balances b
		WHERE amount <> (SELECT coalesce(sum(amount), 0) FROM credits c WHERE c.user_id = b.user_id AND c.currency = b.currency)
		   OR credits <> (SELECT count(*) FROM credits c WHERE c.user_id = b.user_id AND c.currency = b.currency)`).Scan(&off); err != nil || off != 0 {
		t.Fatalf("%d balances differ from their credits (%v)", off, err)
	}
}

// Many clients race past a source's total with distinct keys: exactly the total is
// credited, never a unit more, and every other credit is refused 403; the same for an
// activity's count of grants.
func TestConcurrentClientsNeverOvershootTheBudget(t *testing.T) {
	pg := pgtest.Start(t)
	e := newEnv(t, pg)
	const (
		clients = 64
		each    = 8
		amount  = 5
		total   = 1000 // 200 of the 512 credits fit
		count   = 50   // 50 of the 512 grants fit
	)
	expectBooked(t, e.post(announceBudget("bud-o", total)))
	expectBooked(t, e.post(announceActivity("act-o", 1<<40, count)))

	race := func(credit func(c, i int) Delivery) (booked, refused int64) {
		var b, r atomic.Int64
		var wg sync.WaitGroup
		for c := range clients {
			wg.Go(func() {
				for i := range each {
					d := credit(c, i)
					a, _, err := e.postUntilAnswered(d, mustJSON(t, d))
					switch {
					case err != nil:
						t.Error(err)
						return
					case a.status == StatusBooked:
						b.Add(1)
					case a.status == StatusOverBudget:
						r.Add(1)
					default:
						t.Errorf("%s: %s", keyOf(d), a)
					}
				}
			})
		}
		wg.Wait()
		return b.Load(), r.Load()
	}

	booked, refused := race(func(c, i int) Delivery {
		if i == each-1 {
			return budgetRefund("bud-o", fmt.Sprintf("c%d", c), "sender", amount)
		}
		return budgetGrant("bud-o", fmt.Sprintf("c%d", c), i, fmt.Sprintf("user-%d", c), amount)
	})
	t.Logf("budget: %d booked, %d refused", booked, refused)
	if booked != total/amount || refused != clients*each-total/amount {
		t.Fatalf("budget: %d booked and %d refused, want %d and %d", booked, refused, total/amount, clients*each-total/amount)
	}
	if s := e.source("bud-o"); s.Credited != total || s.Grants.Count+s.Refunds.Count != total/amount {
		t.Fatalf("budget %+v, want exactly %d credited", s, total)
	}

	booked, refused = race(func(c, i int) Delivery {
		return grant("act-o", c*each+i+1, fmt.Sprintf("user-%d", c), 1)
	})
	t.Logf("activity: %d booked, %d refused", booked, refused)
	if booked != count || refused != clients*each-count {
		t.Fatalf("activity: %d booked and %d refused, want %d and %d", booked, refused, count, clients*each-count)
	}
	if s := e.source("act-o"); s.Grants.Count != count || s.Grants.Sum != count {
		t.Fatalf("activity %+v, want exactly %d grants", s, count)
	}
	var n int64
	if err := e.pool.QueryRow(t.Context(), "SELECT count(*) FROM credits").Scan(&n); err != nil || n != total/amount+count {
		t.Fatalf("%d credit rows (%v), want %d", n, err, total/amount+count)
	}
}
