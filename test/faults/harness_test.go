package faults

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/redistest"
)

// needsServers skips under -short: every test here runs several redis-server
// processes. Without -short a missing redis-server fails the test.
func needsServers(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("fault tests run real redis-server processes; run without -short")
	}
}

// quietRedisLog drops go-redis's own log lines: every test here makes Redis
// unreachable on purpose, and the clients' dial failures are expected.
type quietRedisLog struct{}

func (quietRedisLog) Printf(context.Context, string, ...any) {}

func init() { redis.SetLogger(quietRedisLog{}) }

// The size of every rain: users grabbing at once through the grab service.
const (
	rainUsers   = 20000
	rainWorkers = 24
)

// newActivity is an in-memory activity of count packets with a fresh UID, as the
// grab service reads it from the API server, and its packets' amounts (minor units,
// uneven so that a packet's amount identifies it as well as its id).
func newActivity(name string, count int) (*grabsvc.Resource, []int64) {
	amounts := make([]int64, count)
	var total int64
	for i := range amounts {
		amounts[i] = 100 + int64(i*7919%900)
		total += amounts[i]
	}
	act := grabsvc.NewResource(&redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID(uuid.NewUUID()), ResourceVersion: "1"},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			Currency: "CNY", TotalAmount: total, Count: int64(count),
		},
	})
	return act, amounts
}

// seedOpen commits the packets and opens grabbing, as the controller does.
func seedOpen(t *testing.T, c *redis.Client, act *grabsvc.Resource, amounts []int64) {
	t.Helper()
	ctx := context.Background()
	if _, err := handleOf(c, act).Seed(ctx, amounts, store.SeedParams{
		Count: act.Object.Spec.Count, Total: act.Object.Spec.TotalAmount, Sponsor: "sponsor-1", Currency: "CNY",
	}); err != nil {
		t.Fatalf("seeding %s: %v", act.Ref, err)
	}
	if err := handleOf(c, act).LoadScripts(ctx); err != nil {
		t.Fatalf("loading the scripts and the grab-side functions: %v", err)
	}
	if st, err := handleOf(c, act).Configure(ctx, 0, 0, false, true); err != nil || st.State != store.StateOpen {
		t.Fatalf("opening %s: %+v %v", act.Ref, st, err)
	}
}

// startRedis runs a redis-server in a fresh directory for the test, with the default
// user off and an admin user of its own (redistest). The returned pointer is the
// server to stop at cleanup; a test that restarts the server stores the new one there.
func startRedis(t *testing.T, args ...string) **redistest.Server {
	t.Helper()
	s, err := redistest.StartProcess(t.TempDir(), args...)
	if err != nil {
		t.Fatalf("starting redis-server: %v", err)
	}
	return stopAtCleanup(t, s)
}

// startReplica runs a replica of primary, replicating from primaryAddr (primary's own
// address, or a proxy in front of it), with primary's admin user and password, as
// the servers of one deployment have: a client keeps its credentials across a
// failover. The returned pointer is as startRedis's.
func startReplica(t *testing.T, primary *redistest.Server, primaryAddr string, args ...string) **redistest.Server {
	t.Helper()
	s, err := redistest.StartReplicaProcess(t.TempDir(), primary, primaryAddr, args...)
	if err != nil {
		t.Fatalf("starting a replica redis-server: %v", err)
	}
	return stopAtCleanup(t, s)
}

// stopAtCleanup returns a pointer to s that the test's cleanup stops the server of.
func stopAtCleanup(t *testing.T, s *redistest.Server) **redistest.Server {
	cur := &s
	t.Cleanup(func() {
		if *cur != nil {
			(*cur).Stop()
		}
	})
	return cur
}

// adminClient is a plain client of s, as its admin user, for the test's own reads
// and commands.
func adminClient(t *testing.T, s *redistest.Server) *redis.Client {
	opt := s.Options()
	opt.MaxRetries = -1
	c := redis.NewClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// deadAddr is a loopback address nobody listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return addr
}

// copyFile copies src to dst, replacing dst.
func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatalf("reading %s: %v", src, err)
	}
	if err := os.WriteFile(filepath.Clean(dst), b, 0o644); err != nil {
		t.Fatalf("writing %s: %v", dst, err)
	}
}

// grabService is the production grab handler (grabsvc.NewServer) of one activity
// on a Redis address, behind a real HTTP listener, with its own rollback guard.
type grabService struct {
	t      *testing.T
	act    *grabsvc.Resource
	guard  *grabsvc.RollbackGuard
	http   *httptest.Server
	client *http.Client
}

// startGrabService opens the grab path's clients on redisAddr (the server's address,
// or a proxy in front of it) as the admin user of srv (the auto-pipeliner for grabs,
// the plain client for /readyz and replica waits) exactly as the grab service's main
// does, and serves act.
func startGrabService(t *testing.T, redisSrv *redistest.Server, redisAddr string, act *grabsvc.Resource) *grabService {
	t.Helper()
	conn := redisSrv.Conn()
	conn.Addresses = []string{redisAddr}
	rc, err := conn.NewPipelinedClient(redisconn.GrabClientOptions(time.Second))
	if err != nil {
		t.Fatalf("grab service's redis clients: %v", err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	g := &grabService{t: t, act: act, guard: &grabsvc.RollbackGuard{}}
	srv, err := grabsvc.NewServer(grabsvc.Config{
		Redis:        rc.Pipeliner,
		Ping:         rc.Client,
		Resource:     func() *grabsvc.Resource { return act },
		RedisTimeout: time.Second,
		Guard:        g.guard,
		Log:          slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatalf("grab server: %v", err)
	}
	g.http = httptest.NewServer(srv.Handler())
	t.Cleanup(g.http.Close)
	g.client = &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{MaxIdleConnsPerHost: 2 * rainWorkers, MaxIdleConns: 4 * rainWorkers},
	}
	t.Cleanup(g.client.CloseIdleConnections)
	return g
}

// answer is what a client saw for one grab: the HTTP status and body, or Err when
// no HTTP answer came back.
type answer struct {
	Status   int
	Outcome  string `json:"outcome"`
	PacketID string `json:"packetId"`
	Amount   int64  `json:"amount"`
	Error    string `json:"error"`
	Err      error  `json:"-"`
}

// holdsPacket says the answer tells the user a packet is theirs.
func (a answer) holdsPacket() bool {
	return a.Status == http.StatusOK && (a.Outcome == string(store.Granted) || a.Outcome == string(store.AlreadyClaimed))
}

// final says the user need not ask again: a packet, or a 409 (sold out, ended...).
func (a answer) final() bool {
	return a.Err == nil && (a.Status == http.StatusOK || a.Status == http.StatusConflict)
}

func (a answer) String() string {
	if a.Err != nil {
		return "transport error: " + a.Err.Error()
	}
	return fmt.Sprintf("%d %s %s:%d %s", a.Status, a.Outcome, a.PacketID, a.Amount, a.Error)
}

// grab posts one grab for user.
func (g *grabService) grab(user string) answer {
	resp, err := g.client.Post(g.http.URL+"/v1/grab", "application/json", strings.NewReader(`{"userId":"`+user+`"}`))
	if err != nil {
		return answer{Err: err}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{Err: fmt.Errorf("reading the answer: %w", err)}
	}
	a := answer{Status: resp.StatusCode}
	if err := json.Unmarshal(raw, &a); err != nil {
		return answer{Status: resp.StatusCode, Err: fmt.Errorf("answer %q is not JSON: %w", raw, err)}
	}
	return a
}

// readyz is the status /readyz answers.
func (g *grabService) readyz() int {
	resp, err := g.client.Get(g.http.URL + "/readyz")
	if err != nil {
		g.t.Fatalf("GET /readyz: %v", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode
}

// tally counts the answers of one phase of a rain, by the phase its request started in.
type tally struct {
	Attempts, Granted, AlreadyClaimed, Closed, Unavailable, Transport, Other int
}

// ledger is what the clients were told, user by user: the money they were promised.
type ledger struct {
	mu sync.Mutex
	// acks is the packet each user was told is theirs (first 200 answer).
	acks map[string]store.Claim
	// owner is the user each acknowledged packet went to.
	owner map[string]string
	// regrants describe answers that contradict an earlier one: a second packet for
	// a user, or a packet acknowledged to a second user.
	regrants []string
	// recovered counts users whose first acknowledgement was already_claimed: their
	// grant went through but its answer was lost to the fault, and a retry returned it.
	recovered int
	// unexpected describes answers that are neither a grab outcome nor a 503.
	unexpected []string
	phases     [4]tally
}

func newLedger() *ledger {
	return &ledger{acks: map[string]store.Claim{}, owner: map[string]string{}}
}

func (l *ledger) record(user string, phase int, a answer) {
	l.mu.Lock()
	defer l.mu.Unlock()
	p := &l.phases[phase]
	p.Attempts++
	switch {
	case a.Err != nil && a.Status == 0:
		p.Transport++
	case a.Err != nil:
		p.Other++
		l.unexpected = append(l.unexpected, user+": "+a.String())
	case a.holdsPacket():
		if a.Outcome == string(store.Granted) {
			p.Granted++
		} else {
			p.AlreadyClaimed++
		}
		got := store.Claim{PacketID: a.PacketID, Amount: a.Amount}
		prev, had := l.acks[user]
		switch {
		case !had:
			l.acks[user] = got
			if a.Outcome == string(store.AlreadyClaimed) {
				l.recovered++
			}
		case prev != got:
			l.regrants = append(l.regrants, fmt.Sprintf("user %s told packet %s:%d, then %s:%d", user, prev.PacketID, prev.Amount, got.PacketID, got.Amount))
		}
		if o, ok := l.owner[got.PacketID]; ok && o != user {
			l.regrants = append(l.regrants, fmt.Sprintf("packet %s told to %s and to %s", got.PacketID, o, user))
		} else if !ok {
			l.owner[got.PacketID] = user
		}
	case a.Status == http.StatusConflict:
		p.Closed++
	case a.Status == http.StatusServiceUnavailable && a.Outcome == grabsvc.OutcomeUnavailable:
		p.Unavailable++
	default:
		p.Other++
		l.unexpected = append(l.unexpected, user+": "+a.String())
	}
}

// acknowledged is how many users were told a packet is theirs so far.
func (l *ledger) acknowledged() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.acks)
}

// summary is every phase's tally, for failure messages and logs.
func (l *ledger) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	for i, p := range l.phases {
		if p.Attempts > 0 {
			fmt.Fprintf(&b, "[%d: %+v] ", i, p)
		}
	}
	return strings.TrimSpace(b.String())
}

func (l *ledger) phase(i int) tally {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.phases[i]
}

// rain is users grabbing through a grab service from many clients at once. Each
// user asks until the answer is final (a packet or a 409); after a 503 or a
// connection error the same user asks again, as a client retrying a grab does.
type rain struct {
	svc    *grabService
	prefix string
	users  int
	led    *ledger
	// phase is stamped on every request as it starts; the test moves it at each fault.
	phase atomic.Int32

	// started counts requests by the phase they started in; a phase is settled when
	// the ledger holds an answer for each.
	started [4]atomic.Int64

	next    atomic.Int64
	mu      sync.Mutex
	pending []string // users still without a final answer when the rain stopped
	stopped atomic.Bool
	wg      sync.WaitGroup
}

func newRain(svc *grabService, prefix string, users int) *rain {
	return &rain{svc: svc, prefix: prefix, users: users, led: newLedger()}
}

func (r *rain) user(i int64) string { return fmt.Sprintf("%s-%05d", r.prefix, i) }

// start runs workers clients until every user has a final answer or stop.
func (r *rain) start(workers int) {
	r.stopped.Store(false)
	for range workers {
		r.wg.Add(1)
		go r.client()
	}
}

// stop ends the rain between requests; users still asking are kept for the next start.
func (r *rain) stop() {
	r.stopped.Store(true)
	r.wg.Wait()
}

// wait waits until every user has a final answer, at most within.
func (r *rain) wait(t *testing.T, within time.Duration) {
	t.Helper()
	done := make(chan struct{})
	go func() { r.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(within):
		r.stop()
		t.Fatalf("the rain did not end within %s: %d of %d users acknowledged; answers by phase %s", within, r.led.acknowledged(), r.users, r.led.summary())
	}
}

func (r *rain) take() (string, bool) {
	r.mu.Lock()
	if n := len(r.pending); n > 0 {
		u := r.pending[n-1]
		r.pending = r.pending[:n-1]
		r.mu.Unlock()
		return u, true
	}
	r.mu.Unlock()
	i := r.next.Add(1)
	if i > int64(r.users) {
		return "", false
	}
	return r.user(i), true
}

func (r *rain) client() {
	defer r.wg.Done()
	for !r.stopped.Load() {
		user, ok := r.take()
		if !ok {
			return
		}
		for {
			if r.stopped.Load() {
				r.mu.Lock()
				r.pending = append(r.pending, user)
				r.mu.Unlock()
				return
			}
			phase := int(r.phase.Load())
			r.started[phase].Add(1)
			a := r.svc.grab(user)
			r.led.record(user, phase, a)
			if a.final() {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// settle waits until every request started in phase has its answer, so that none
// of them reaches what the test does next.
func (r *rain) settle(t *testing.T, phase int) {
	t.Helper()
	waitFor(t, 10*time.Second, fmt.Sprintf("the answers of phase %d", phase), func() bool {
		return int64(r.led.phase(phase).Attempts) == r.started[phase].Load()
	})
}

// waitFor polls cond until it holds, failing the test after within.
func waitFor(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", within, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// redisView is what one Redis holds of an activity, read after the fact.
type redisView struct {
	snap   store.Snapshot
	claims map[string]store.Claim
	// grants are the stream's grant entries by user; dupUsers and dupPackets list
	// users and packets that appear in more than one.
	grants     map[string]store.Claim
	entries    int
	dupUsers   []string
	dupPackets []string
	// unclaimed are the packets still in the packets list, by id.
	unclaimed map[string]int64
}

// handleOf is the handle of act's activity on c.
func handleOf(c redis.Cmdable, act *grabsvc.Resource) *store.Activity {
	return store.NewActivity(c, string(act.Object.UID), act.Object.Spec.ShardCount())
}

func readRedis(t *testing.T, c *redis.Client, act *grabsvc.Resource) redisView {
	t.Helper()
	ctx := context.Background()
	h := handleOf(c, act)
	v := redisView{grants: map[string]store.Claim{}, unclaimed: map[string]int64{}}
	var err error
	if v.snap, err = h.Snapshot(ctx); err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	if v.claims, err = h.Shard(0).Claims(ctx); err != nil {
		t.Fatalf("claims: %v", err)
	}
	entries, err := h.Shard(0).Entries(ctx)
	if err != nil {
		t.Fatalf("reading the stream: %v", err)
	}
	byPacket := map[string]string{}
	for _, e := range entries {
		if e.Malformed != nil {
			t.Fatalf("stream entry %s %v: %v", e.ID, e.Fields, e.Malformed)
		}
		if e.Kind != store.KindGrant {
			continue
		}
		v.entries++
		user, packet, amount := e.UserID, e.PacketID, e.Amount
		if _, ok := v.grants[user]; ok {
			v.dupUsers = append(v.dupUsers, user)
		}
		v.grants[user] = store.Claim{PacketID: packet, Amount: amount, EntryID: e.ID}
		if _, ok := byPacket[packet]; ok {
			v.dupPackets = append(v.dupPackets, packet)
		}
		byPacket[packet] = user
	}
	left, err := h.Shard(0).Listed(ctx)
	if err != nil {
		t.Fatalf("reading the packets list: %v", err)
	}
	for _, packet := range left {
		v.unclaimed[packet.ID] = packet.Amount
	}
	return v
}

// figures are the money invariants of a run, counted from outside.
type figures struct {
	// Acknowledged is how many users were told a packet is theirs.
	Acknowledged int
	// Lost counts acknowledged grants that Redis does not hold (claims hash and
	// stream, same packet).
	Lost int
	// Regranted counts contradictions: in the answers (ledger.regrants), and in Redis
	// (a packet in two grant entries or claims, a user in two grant entries, claims
	// and stream disagreeing, a claim of a packet acknowledged to somebody else).
	Regranted int
	// Relisted counts acknowledged packets that are back in the unclaimed list: a
	// grab from this Redis would hand them out again.
	Relisted int
	// Recovered counts grants whose answer was lost to the fault and came back as
	// already_claimed on a retry.
	Recovered int
}

// check compares what the clients were told with what Redis holds, and checks the
// activity's books in Redis: claims, stream entries and the packets list account for
// every packet and every minor unit once. Violations of the books fail the test;
// lost, relisted and regranted grants are returned for the test to judge.
func check(t *testing.T, l *ledger, v redisView, act *grabsvc.Resource) figures {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, u := range l.unexpected[:min(len(l.unexpected), 5)] {
		t.Errorf("unexpected answer: %s", u)
	}
	f := figures{Acknowledged: len(l.acks), Regranted: len(l.regrants), Recovered: l.recovered}
	for _, r := range l.regrants[:min(len(l.regrants), 5)] {
		t.Errorf("regrant in the answers: %s", r)
	}
	var lostExamples []string
	for user, got := range l.acks {
		if c, ok := v.claims[user]; !ok || !samePacket(c, got) || !samePacket(v.grants[user], got) {
			f.Lost++
			if len(lostExamples) < 3 {
				lostExamples = append(lostExamples, fmt.Sprintf("%s told %s, claims hold %s, stream holds %s",
					user, claimText(got, true), claimText(c, ok), claimText(v.grants[user], v.grants[user] != store.Claim{})))
			}
		}
		if _, ok := v.unclaimed[got.PacketID]; ok {
			f.Relisted++
		}
	}
	if f.Lost > 0 {
		t.Logf("acknowledged grants this Redis does not hold, e.g. %s", strings.Join(lostExamples, "; "))
	}
	// Redis's own regrants.
	f.Regranted += len(v.dupUsers) + len(v.dupPackets)
	claimedBy := map[string]string{}
	var claimedSum int64
	for user, c := range v.claims {
		claimedSum += c.Amount
		if o, ok := claimedBy[c.PacketID]; ok {
			f.Regranted++
			t.Errorf("packet %s is claimed by %s and %s", c.PacketID, o, user)
		}
		claimedBy[c.PacketID] = user
		if g, ok := v.grants[user]; !ok || g != c {
			f.Regranted++
			t.Errorf("user %s holds %+v in claims, %+v in the stream", user, c, g)
		}
		if o, ok := l.owner[c.PacketID]; ok && o != user {
			f.Regranted++
			t.Errorf("packet %s was acknowledged to %s, Redis gives it to %s", c.PacketID, o, user)
		}
		if _, ok := v.unclaimed[c.PacketID]; ok {
			t.Errorf("packet %s is claimed by %s and still in the unclaimed list", c.PacketID, user)
		}
	}
	if len(v.dupUsers)+len(v.dupPackets) > 0 {
		t.Errorf("the stream grants twice: users %v, packets %v", first(v.dupUsers), first(v.dupPackets))
	}
	// The books: every packet and every minor unit is claimed or unclaimed, once.
	var unclaimedSum int64
	for _, a := range v.unclaimed {
		unclaimedSum += a
	}
	s := v.snap
	if s.ClaimedCount != int64(len(v.claims)) || s.ClaimedCount != int64(v.entries) || s.ClaimedAmount != claimedSum {
		t.Errorf("Redis counts %d claims of %d, the claims hash holds %d of %d, the stream %d grants",
			s.ClaimedCount, s.ClaimedAmount, len(v.claims), claimedSum, v.entries)
	}
	if s.ClaimedCount+int64(len(v.unclaimed)) != act.Object.Spec.Count || s.RemainingCount != int64(len(v.unclaimed)) {
		t.Errorf("packets: %d claimed + %d unclaimed (remaining_count %d), want %d in all",
			s.ClaimedCount, len(v.unclaimed), s.RemainingCount, act.Object.Spec.Count)
	}
	if claimedSum+unclaimedSum+s.Refunded != act.Object.Spec.TotalAmount || s.Total != act.Object.Spec.TotalAmount {
		t.Errorf("money: %d claimed + %d unclaimed + %d refunded, want the total %d (Redis total %d)",
			claimedSum, unclaimedSum, s.Refunded, act.Object.Spec.TotalAmount, s.Total)
	}
	return f
}

// claimText is "<packetId>:<amount>", or "nothing".
func claimText(c store.Claim, ok bool) string {
	if !ok {
		return "nothing"
	}
	return fmt.Sprintf("%s:%d", c.PacketID, c.Amount)
}

func first(s []string) []string { return s[:min(len(s), 3)] }

// infoField reads one field of INFO section on c.
func infoField(t *testing.T, c *redis.Client, section, field string) string {
	t.Helper()
	info, err := c.Info(context.Background(), section).Result()
	if err != nil {
		t.Fatalf("INFO %s on %s: %v", section, c.Options().Addr, err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

// readSnapshot reads the activity's counters on c.
func readSnapshot(c *redis.Client, act *grabsvc.Resource) (store.Snapshot, error) {
	snap, err := handleOf(c, act).Snapshot(context.Background())
	if err != nil {
		return store.Snapshot{}, fmt.Errorf("snapshot on %s: %w", c.Options().Addr, err)
	}
	return snap, nil
}

// samePacket reports whether two claims name the same packet and amount (a client
// is told no stream entry id).
func samePacket(a, b store.Claim) bool { return a.PacketID == b.PacketID && a.Amount == b.Amount }
