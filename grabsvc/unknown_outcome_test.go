package grabsvc

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// replyFault is a TCP proxy in front of redis-server that, when armed, lets the next
// FCALL through to Redis and then holds (for holdFor) or drops (closing the
// connection) what Redis answers on that connection: the grant is decided and
// written, and its reply does not come back in time, or at all. Replies on other
// connections pass.
type replyFault struct {
	ln       net.Listener
	upstream string
	holdFor  time.Duration
	armed    atomic.Int32 // faultHold or faultDrop for the next FCALL; 0 when disarmed
	// holdEvery, when above 0, holds the reply of that fraction of the FCALLs
	// (grabs and the resolving reads alike), drawn from rng (both under rngMu).
	holdEvery float64
	rngMu     sync.Mutex
	rng       *rand.Rand
	faults    atomic.Int64 // FCALLs whose reply was held or dropped
	mu        sync.Mutex
	conns     []net.Conn
}

const (
	faultHold int32 = 1
	faultDrop int32 = 2
	// faultHoldRequest holds the FCALL itself for holdFor on its way to Redis: it
	// runs after whatever Redis is sent meanwhile.
	faultHoldRequest int32 = 3
)

func startReplyFault(t *testing.T, upstream string, holdFor time.Duration) *replyFault {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &replyFault{ln: ln, upstream: upstream, holdFor: holdFor}
	go f.accept()
	t.Cleanup(f.close)
	return f
}

func (f *replyFault) addr() string { return f.ln.Addr().String() }

// close stops accepting and cuts every connection: Redis is unreachable.
func (f *replyFault) close() {
	_ = f.ln.Close()
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.conns {
		_ = c.Close()
	}
}

func (f *replyFault) accept() {
	for {
		client, err := f.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", f.upstream)
		if err != nil {
			_ = client.Close()
			continue
		}
		f.mu.Lock()
		f.conns = append(f.conns, client, server)
		f.mu.Unlock()
		var holdUntil atomic.Int64 // unix nanos; replies wait until then
		var drop atomic.Bool
		go func() { // client -> Redis
			buf := make([]byte, 64<<10)
			for {
				n, err := client.Read(buf)
				if n > 0 {
					if bytes.Contains(bytes.ToLower(buf[:n]), []byte("fcall")) {
						mode := f.armed.Swap(0)
						if mode == 0 {
							f.rngMu.Lock()
							if f.holdEvery > 0 && f.rng.Float64() < f.holdEvery {
								mode = faultHold
							}
							f.rngMu.Unlock()
						}
						switch mode {
						case faultHold:
							holdUntil.Store(time.Now().Add(f.holdFor).UnixNano())
							f.faults.Add(1)
						case faultDrop:
							drop.Store(true)
							f.faults.Add(1)
						case faultHoldRequest:
							f.faults.Add(1)
							time.Sleep(f.holdFor)
						}
					}
					if _, err := server.Write(buf[:n]); err != nil {
						return
					}
				}
				if err != nil {
					_ = server.Close()
					return
				}
			}
		}()
		go func() { // Redis -> client
			buf := make([]byte, 64<<10)
			for {
				n, err := server.Read(buf)
				if n > 0 {
					if drop.Load() {
						_ = client.Close()
						_ = server.Close()
						return
					}
					if d := time.Until(time.Unix(0, holdUntil.Load())); d > 0 {
						time.Sleep(d)
					}
					if _, err := client.Write(buf[:n]); err != nil {
						return
					}
				}
				if err != nil {
					_ = client.Close()
					return
				}
			}
		}()
	}
}

// A grab whose FCALL reply is held past the Redis deadline, or lost with its
// connection, is answered with what Redis decided: 200 with the packet, never 503
// for a grant that was written; so are the grabs queued behind the held reply on
// the same connection. When Redis cannot be reached at all, the answer is 503 and
// nothing was claimed.
func TestGrabResolvesAnUnknownOutcome(t *testing.T) {
	t.Parallel()
	const redisTimeout = 300 * time.Millisecond
	admin, fault, act, grab := faultedGrabServer(t, "unknown-outcome", ones(100), false, redisTimeout)
	// Warm up the connections, so the armed FCALL is a grab's.
	if r := grab("warm-up"); r.Status != http.StatusOK {
		t.Fatalf("warm-up grab: %d %s", r.Status, r.Raw)
	}

	check := func(what string, users []string, answers []reply) {
		t.Helper()
		for i, r := range answers {
			if r.Status != http.StatusOK || r.PacketID == "" {
				t.Errorf("%s: %s got %d %s, want 200 with the packet", what, users[i], r.Status, r.Raw)
				continue
			}
			// Redis holds exactly that claim: the repeat answers the same packet.
			again := grab(users[i])
			if again.Outcome != "already_claimed" || again.PacketID != r.PacketID {
				t.Errorf("%s: %s was answered packet %s, Redis holds %s (%s)", what, users[i], r.PacketID, again.PacketID, again.Raw)
			}
		}
	}

	// A held reply, and 20 grabs queued behind it on the auto-pipeliner's connection.
	fault.armed.Store(faultHold)
	users := make([]string, 21)
	answers := make([]reply, len(users))
	var wg sync.WaitGroup
	for i := range users {
		users[i] = fmt.Sprintf("held-%02d", i)
		wg.Go(func() {
			if i > 0 {
				time.Sleep(20 * time.Millisecond) // behind the first one's FCALL
			}
			answers[i] = grab(users[i])
		})
	}
	wg.Wait()
	if fault.faults.Load() != 1 {
		t.Fatalf("the proxy held %d replies, want 1: the test proves nothing", fault.faults.Load())
	}
	outcomes := map[string]int{}
	for _, r := range answers {
		outcomes[fmt.Sprintf("%d %s", r.Status, r.Outcome)]++
	}
	t.Logf("held reply: %v", outcomes)
	check("held reply", users, answers)

	// A reply lost with its connection.
	time.Sleep(fault.holdFor)
	fault.armed.Store(faultDrop)
	dropped := grab("dropped")
	if fault.faults.Load() != 2 {
		t.Fatalf("the proxy dropped no reply: the test proves nothing")
	}
	t.Logf("dropped reply: %d %s", dropped.Status, dropped.Raw)
	check("dropped reply", []string{"dropped"}, []reply{dropped})

	snap, err := handleOf(admin, act).Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(len(users) + 2); snap.ClaimedCount != want {
		t.Errorf("Redis holds %d claims, want %d (warm-up, held, dropped)", snap.ClaimedCount, want)
	}

	// Redis unreachable: 503, and nothing was claimed.
	fault.close()
	r := grab("unreachable")
	if r.Status != http.StatusServiceUnavailable || r.Outcome != OutcomeUnavailable || !strings.Contains(r.Error, "retry") {
		t.Errorf("with Redis unreachable: %d %s, want 503 unavailable saying to retry", r.Status, r.Raw)
	}
	if n, err := admin.Exists(t.Context(), keysOf(act).Claims).Result(); err != nil || n == 0 {
		t.Fatalf("claims key: %d, %v", n, err)
	}
	if held, err := admin.HExists(t.Context(), keysOf(act).Claims, "unreachable").Result(); err != nil || held {
		t.Errorf("the unreachable grab left a claim (%v, %v)", held, err)
	}
}

// A grab whose FCALL is held on its way to Redis past the deadline while the activity
// is paused: the resolving repeat finds the activity paused, the activity is resumed,
// and then the held call reaches Redis and grants. The grab is answered 503 (nothing
// known), never "paused": that refusal was the repeat's and the first call took it
// back, and a retry answers already_claimed with the packet. Before, the user was told
// paused while Redis held a packet for them (the phantom claims TestRandomizedHistories
// found under CLIENT PAUSE).
func TestHeldGrabIsNotAnsweredWithARefusalThatPasses(t *testing.T) {
	t.Parallel()
	const redisTimeout = 300 * time.Millisecond
	admin, fault, act, grab := faultedGrabServer(t, "held-request", ones(10), true, redisTimeout)
	if r := grab("warm-up"); r.Outcome != "paused" {
		t.Fatalf("warm-up grab: %d %s; want paused", r.Status, r.Raw)
	}
	fault.armed.Store(faultHoldRequest)
	answered := make(chan reply, 1)
	go func() { answered <- grab("carol") }()
	// The first call is held; the repeat runs (paused) within the deadline plus its
	// own round trip; then the activity is resumed, before the held call goes on.
	time.Sleep(redisTimeout + 200*time.Millisecond)
	if st, err := handleOf(admin, act).Configure(context.Background(), 0, 0, false, true); err != nil || st.State != store.StateOpen {
		t.Fatalf("resuming: %q, %v", st.State, err)
	}
	r := <-answered
	if fault.faults.Load() != 1 {
		t.Fatalf("%d FCALLs held, want 1", fault.faults.Load())
	}
	time.Sleep(4*redisTimeout + 100*time.Millisecond) // the held call has run by now
	again := grab("carol")
	if again.Outcome != "already_claimed" || again.PacketID == "" {
		t.Fatalf("carol's retry: %d %s; want already_claimed: the held call granted", again.Status, again.Raw)
	}
	if r.Status != http.StatusServiceUnavailable {
		t.Errorf("carol's grab: %d %s; want 503: the held call granted %s after it", r.Status, r.Raw, again.PacketID)
	}
}

// faultedGrabServer seeds the activity name with amounts (paused or open) on a real
// redis-server and serves its grabs from a grab server whose Redis connection, as the
// server's admin user, goes through a replyFault that holds for 4 × redisTimeout. It
// returns the admin client, the fault, the activity and a grab of a user.
func faultedGrabServer(t *testing.T, name string, amounts []int64, paused bool, redisTimeout time.Duration) (
	*redis.Client, *replyFault, *Resource, func(user string) reply) {
	t.Helper()
	return faultedGrabServerWith(t, name, amounts, paused, redisTimeout, 4*redisTimeout, 2*time.Second, nil)
}

// faultedGrabServerWith is faultedGrabServer with the fault's hold, the server's
// ResolveTimeout, and arm, which sets up the fault before the server connects.
func faultedGrabServerWith(t *testing.T, name string, amounts []int64, paused bool, redisTimeout, holdFor, resolveTimeout time.Duration,
	arm func(*replyFault)) (*redis.Client, *replyFault, *Resource, func(user string) reply) {
	t.Helper()
	admin, fault, act, web := faultedGrabServerAt(t, name, amounts, paused, redisTimeout, holdFor, resolveTimeout, arm)
	return admin, fault, act, grabAt(t, web.URL, web.Client())
}

// grabAt is a grab of user sent to the grab API at base with c.
func grabAt(t *testing.T, base string, c *http.Client) func(user string) reply {
	return func(user string) reply {
		req, err := http.NewRequest(http.MethodPost, base+"/v1/grab", strings.NewReader(fmt.Sprintf(`{"userId":%q}`, user)))
		if err != nil {
			t.Error(err)
			return reply{}
		}
		return send(t, c, req)
	}
}

// faultedGrabServerAt is faultedGrabServerWith's server itself, for a test that
// reaches it another way (through a gateway).
func faultedGrabServerAt(t *testing.T, name string, amounts []int64, paused bool, redisTimeout, holdFor, resolveTimeout time.Duration,
	arm func(*replyFault)) (*redis.Client, *replyFault, *Resource, *httptest.Server) {
	t.Helper()
	srv := redistest.Start(t)
	admin := srv.Client(t)
	fault := startReplyFault(t, srv.Addr, holdFor)
	if arm != nil {
		arm(fault)
	}
	conn := srv.Conn()
	conn.Addresses = []string{fault.addr()}
	rc, err := conn.NewPipelinedClient(redisconn.GrabClientOptions(redisTimeout))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	act := testActivity(name)
	seed(t, admin, act, amounts, 0, 0, paused)
	var current atomic.Pointer[Resource]
	current.Store(act)
	s, err := NewServer(Config{Redis: rc.Pipeliner, Ping: rc.Client, Resource: current.Load,
		RedisTimeout: redisTimeout, ResolveTimeout: resolveTimeout, Metrics: NewMetrics(prometheus.NewRegistry())})
	if err != nil {
		t.Fatal(err)
	}
	web := httptest.NewServer(s.Handler())
	t.Cleanup(web.Close)
	return admin, fault, act, web
}

// The 503 contract under held replies: with 30 % of the FCALLs' replies (grabs and
// resolving reads alike) held 2 s, past --redis-timeout (500 ms) and
// --resolve-timeout (1 s), 2,000 users grab 1,500 packets. A grab whose reply and
// whose resolving read were both held is answered 503 while Redis may hold its
// packet: docs/grab-api.md says so ("not known, may hold a packet: retry"). What
// must hold is the rest of the contract: no answer other than 503 disagrees with
// Redis, every user who holds a packet gets it back from a retry as
// already_claimed with the same packet and amount, and the money adds up.
func TestA503MayHoldAPacketAndTheRetryReturnsIt(t *testing.T) {
	amounts := ones(1500)
	admin, fault, act, grab := faultedGrabServerWith(t, "held-rain", amounts, false, 500*time.Millisecond, 2*time.Second,
		DefaultResolveTimeout, func(f *replyFault) { f.holdEvery, f.rng = 0.3, rand.New(rand.NewPCG(36, 503)) })
	heldRain(t, admin, fault, act, amounts, grab)
}

// heldRain plays 2,000 users grabbing the packets of amounts with the fault armed,
// each first answer checked against Redis, every 503's retry checked to return what
// Redis holds, and the money added up; grab reaches the grab service directly or
// through a gateway. It returns how many users were answered 503 first, and how
// many of those held a packet.
func heldRain(t *testing.T, admin *redis.Client, fault *replyFault, act *Resource, amounts []int64, grab func(user string) reply) (unavailable, holding int64) {
	t.Helper()
	const users = 2000
	first := make([]reply, users)
	var wg sync.WaitGroup
	next := atomic.Int64{}
	for range 64 {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < users; i = int(next.Add(1) - 1) {
				first[i] = grab(fmt.Sprintf("held-%04d", i))
			}
		})
	}
	wg.Wait()
	time.Sleep(fault.holdFor + 500*time.Millisecond) // every held call has run
	fault.rngMu.Lock()
	fault.holdEvery = 0
	fault.rngMu.Unlock()

	claims, err := handleOf(admin, act).Shard(0).Claims(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var claimedSum int64
	for i, r := range first {
		user := fmt.Sprintf("held-%04d", i)
		c, holds := claims[user]
		if holds {
			claimedSum += c.Amount
		}
		switch {
		case r.Status == http.StatusServiceUnavailable:
			unavailable++
			if holds {
				holding++
			}
			// The retry tells the truth, whatever the 503 hid.
			again := grab(user)
			switch {
			case holds && (again.Outcome != "already_claimed" || again.PacketID != c.PacketID || again.Amount == nil || *again.Amount != c.Amount):
				t.Fatalf("%s holds packet %s of %d; its retry after a 503 answered %d %s", user, c.PacketID, c.Amount, again.Status, again.Raw)
			case !holds && again.Outcome != "granted" && again.Outcome != "sold_out":
				t.Fatalf("%s holds nothing; its retry after a 503 answered %d %s", user, again.Status, again.Raw)
			case !holds && again.Outcome == "granted":
				claims[user] = store.Claim{PacketID: again.PacketID, Amount: *again.Amount}
				claimedSum += *again.Amount
			}
		case r.Outcome == "granted" || r.Outcome == "already_claimed":
			if !holds || c.PacketID != r.PacketID || r.Amount == nil || *r.Amount != c.Amount {
				t.Fatalf("%s was answered %s, Redis holds %+v (holds: %v)", user, r.Raw, c, holds)
			}
		case r.Outcome == "sold_out":
			if holds {
				t.Fatalf("%s was answered sold_out while Redis holds its packet %s", user, c.PacketID)
			}
		default:
			t.Fatalf("%s: %d %s", user, r.Status, r.Raw)
		}
	}
	snap, err := handleOf(admin, act).Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, a := range amounts {
		total += a
	}
	if snap.ClaimedCount != int64(len(claims)) || snap.ClaimedAmount != claimedSum || snap.ClaimedAmount+snap.RemainingAmount() != total {
		t.Fatalf("Redis: %d claimed (%d), %d remaining of %d; the users hold %d packets (%d)",
			snap.ClaimedCount, snap.ClaimedAmount, snap.RemainingAmount(), total, len(claims), claimedSum)
	}
	t.Logf("%d FCALL replies held 2 s; %d of %d users answered 503 first, %d of them while Redis held their packet; every retry returned it",
		fault.faults.Load(), unavailable, users, holding)
	if fault.faults.Load() == 0 {
		t.Fatal("no reply was held: the test proves nothing")
	}
	return unavailable, holding
}
