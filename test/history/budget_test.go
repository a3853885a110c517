package history

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"

	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
)

// budgetFaultKinds are the faults a budget run draws from. A controller-restart
// kills everything the operator process runs for the budget (budgetOperator): its
// expiry runner (controllers.BudgetExpiry), function keeper and settlement.
var budgetFaultKinds = []string{faultLatency, faultReset, faultStall, faultClientPause, faultScriptFlush,
	faultWebhookFail, faultWebhookSlow, faultRedisRestart, faultGrabRestart, faultControllerRestart}

// budgetSender is the sender credential of the budget runs' grab servers.
const budgetSender = "history-sender-credential"

// packetRequest is one body a creation of a packet id sends (POST /v1/packets).
type packetRequest struct {
	Sender       string `json:"sender"`
	TotalAmount  int64  `json:"totalAmount"`
	Count        int64  `json:"count"`
	Distribution string `json:"distribution"`
	TTLSeconds   int64  `json:"ttlSeconds"`
}

// packetPlan is one packet id of a budget run: the bodies its creations send (a
// repeat of body 0, and sometimes a conflicting body 1) and when the first creation
// is sent.
type packetPlan struct {
	id    string
	reqs  []packetRequest
	model []PacketBody
	start time.Duration
}

// plannedOp is one call of the run's schedule.
type plannedOp struct {
	at time.Duration
	in BudgetInput
	// svc is the grab server (of the two) the call is sent to.
	svc int
}

// budgetScenario is everything a seed decides for a budget run.
type budgetScenario struct {
	seed     uint64
	uid      string
	shards   int
	clients  int
	deadline time.Duration
	window   time.Duration
	limits   store.BudgetLimits
	total    int64
	packets  []packetPlan
	ops      []plannedOp
	faults   []fault
	// quotas are the budget's quotas (half the runs: a daily quota per sender, of
	// its four, and per recipient, of the forty users), counted on the wall clock's
	// UTC day; oneServer (half of those) has the grab servers count them inside the
	// create and grab functions whatever the shard (PacketConfig.OneServer), else a
	// quota off its home shard is taken and given back.
	quotas    store.Quotas
	oneServer bool
}

// createSpread is how long after an id's first creation its repeats and conflicting
// bodies are sent at the latest; a creation planned later is not sent. With every
// time to live at least two seconds, no creation of an id can reach Redis once its
// packet expired and was forgotten (which would make a new packet of the same id).
const createSpread = 300 * time.Millisecond

func newBudgetScenario(seed uint64) budgetScenario {
	r := rand.New(rand.NewPCG(seed, 0x62756467))
	sc := budgetScenario{seed: seed, uid: fmt.Sprintf("hb-%d", seed), shards: 1 + r.IntN(4), clients: 6 + r.IntN(5),
		deadline: time.Duration(80+r.IntN(120)) * time.Millisecond, window: time.Duration(2000+r.IntN(1000)) * time.Millisecond}
	sc.limits = store.BudgetLimits{Currency: "CNY", MaxTotal: 400, MaxCount: 8, MinShare: 1,
		Distributions: []string{split.TypeRandom, split.TypeFixed},
		DefaultTTL:    time.Duration(2000+r.IntN(1000)) * time.Millisecond, MaxTTL: 3 * time.Second}
	var sum int64
	for i := 20 + r.IntN(20); i > 0; i-- {
		p := packetPlan{id: fmt.Sprintf("order-%d", len(sc.packets)), start: time.Duration(r.Int64N(int64(sc.window * 6 / 10)))}
		main := packetRequest{Sender: fmt.Sprintf("merchant-%d", r.IntN(4)), TotalAmount: 10 + r.Int64N(300),
			Count: 1 + r.Int64N(6), Distribution: []string{split.TypeRandom, split.TypeFixed}[r.IntN(2)],
			TTLSeconds: []int64{0, 2, 3}[r.IntN(3)]}
		switch r.IntN(14) { // a body the budget's limits refuse
		case 0:
			main.Count = sc.limits.MaxCount + 1
		case 1:
			main.TotalAmount = sc.limits.MaxTotal + 1 + r.Int64N(100)
		case 2:
			main.TTLSeconds = 4
		}
		p.reqs = append(p.reqs, main)
		if r.IntN(4) == 0 { // another body for the same id: a conflict, or the winner of a race
			other := main
			other.Sender += "-other"
			other.TotalAmount++
			other.Count = main.Count%6 + 1
			other.TTLSeconds = 0
			p.reqs = append(p.reqs, other)
		}
		for _, q := range p.reqs {
			b := PacketBody{Sender: q.Sender, Total: q.TotalAmount, Count: q.Count, TTLMs: q.TTLSeconds * 1000}
			if q.TTLSeconds == 0 {
				b.TTLMs = sc.limits.DefaultTTL.Milliseconds()
			}
			b.OverLimit = q.Count > sc.limits.MaxCount || q.TotalAmount > sc.limits.MaxTotal ||
				time.Duration(b.TTLMs)*time.Millisecond > sc.limits.MaxTTL
			if !b.OverLimit {
				shares, err := split.Split(split.Params{Type: q.Distribution, Total: q.TotalAmount, Count: q.Count,
					Min: sc.limits.MinShare, Seed: split.SeedFromUID(sc.uid + "/" + p.id)})
				if err != nil {
					panic(fmt.Sprintf("splitting %s: %v", p.id, err))
				}
				b.Shares = shares
			}
			p.model = append(p.model, b)
		}
		if !p.model[0].OverLimit {
			sum += main.TotalAmount
		}
		svc := func() int { return r.IntN(2) }
		// The creations: the first, then repeats and the other body within createSpread.
		first := 0
		if len(p.reqs) > 1 && r.IntN(3) == 0 {
			first = 1
		}
		sc.ops = append(sc.ops, plannedOp{at: p.start, in: BudgetInput{Packet: p.id, Op: OpCreate, Body: first}, svc: svc()})
		for k := 1 + r.IntN(3); k > 0; k-- {
			sc.ops = append(sc.ops, plannedOp{at: p.start + time.Duration(r.Int64N(int64(createSpread))),
				in: BudgetInput{Packet: p.id, Op: OpCreate, Body: r.IntN(len(p.reqs))}, svc: svc()})
		}
		// The group races it: more users than shares, some twice, some before the
		// creation lands and some after the packet expired.
		life := time.Duration(p.model[0].TTLMs) * time.Millisecond
		users := int(p.model[0].Count) - 1 + r.IntN(5)
		for u := 0; u < users; u++ {
			user := fmt.Sprintf("u%d", r.IntN(40))
			for k := 1 + r.IntN(3)/2; k > 0; k-- {
				at := p.start - 30*time.Millisecond + time.Duration(r.Int64N(int64(life+700*time.Millisecond)))
				sc.ops = append(sc.ops, plannedOp{at: max(at, 0), in: BudgetInput{Packet: p.id, Op: OpPacketGrab, User: user}, svc: svc()})
			}
		}
		for k := 1 + r.IntN(2); k > 0; k-- {
			at := p.start + time.Duration(r.Int64N(int64(life+time.Second)))
			sc.ops = append(sc.ops, plannedOp{at: at, in: BudgetInput{Packet: p.id, Op: OpDetail}, svc: svc()})
		}
		sc.packets = append(sc.packets, p)
	}
	sort.SliceStable(sc.ops, func(i, j int) bool { return sc.ops[i].at < sc.ops[j].at })
	// Less money than the packets ask for, some runs: creations race for it.
	sc.total = sum * int64(60+r.IntN(90)) / 100
	horizon := sc.window + 3*time.Second
	// aimedRestart restarts the operator's part when a packet falls due: its links
	// hold the expiry runner's and the settlement's traffic from then, the kill comes
	// halfway through the hold, so an expiry call in flight reaches Redis after the
	// kill, and a delivery answered meanwhile is not acknowledged by the killed
	// settlement.
	aimedRestart := func(f *fault) {
		p := sc.packets[r.IntN(len(sc.packets))]
		f.at = p.start + time.Duration(p.model[0].TTLMs)*time.Millisecond
		f.hold = time.Duration(300+r.IntN(200)) * time.Millisecond
	}
	// atDelivery aims a restart at a settlement delivery: from a grab's planned time,
	// the webhook holds the next delivery, the links are held from its arrival, and
	// the kill comes halfway through that hold, before the settlement's HTTP timeout,
	// so the delivery is in flight when the settlement dies and is credited after.
	atDelivery := func(f *fault) {
		var grabs []plannedOp
		for _, op := range sc.ops {
			if op.in.Op == OpPacketGrab {
				grabs = append(grabs, op)
			}
		}
		f.at = grabs[r.IntN(len(grabs))].at
		f.hold = time.Duration(60+r.IntN(240)) * time.Millisecond
		f.target |= restartAtDelivery
	}
	restart := func() fault {
		f := fault{kind: faultControllerRestart, dur: time.Duration(20+r.IntN(180)) * time.Millisecond}
		if r.IntN(2) == 0 {
			f.target = restartCutsSettlement
		}
		return f
	}
	// Every run has two such restarts, one at an expiry and one at a delivery; the
	// schedule may draw more.
	for _, aim := range []func(*fault){aimedRestart, atDelivery} {
		f := restart()
		aim(&f)
		sc.faults = append(sc.faults, f)
	}
	for i := 4 + r.IntN(5); i > 0; i-- {
		f := fault{at: time.Duration(r.Int64N(int64(horizon))), kind: budgetFaultKinds[r.IntN(len(budgetFaultKinds))]}
		switch f.kind {
		case faultLatency:
			f.dur = time.Duration(100+r.IntN(300)) * time.Millisecond
		case faultStall:
			f.dur = sc.deadline + time.Duration(r.IntN(300))*time.Millisecond
		case faultClientPause:
			f.dur = time.Duration(50+r.IntN(300)) * time.Millisecond
		case faultWebhookFail, faultWebhookSlow:
			f.dur = time.Duration(300+r.IntN(1000)) * time.Millisecond
		case faultGrabRestart:
			f.dur = time.Duration(20+r.IntN(130)) * time.Millisecond
			f.target = r.IntN(2)
		case faultControllerRestart:
			f = restart()
			f.at = time.Duration(r.Int64N(int64(horizon)))
			switch r.IntN(3) {
			case 0:
				aimedRestart(&f)
			case 1:
				atDelivery(&f)
			}
		}
		sc.faults = append(sc.faults, f)
	}
	sort.Slice(sc.faults, func(i, j int) bool { return sc.faults[i].at < sc.faults[j].at })
	// The quotas come from a generator of their own, so a seed's workload and faults
	// are what they were before quotas.
	if q := rand.New(rand.NewPCG(seed, 0x71756f74)); q.IntN(2) == 0 {
		sc.quotas = store.Quotas{PacketsPerDay: 2 + q.Int64N(6), SharesPerDay: 1 + q.Int64N(3)}
		sc.oneServer = q.IntN(2) == 0
	}
	return sc
}

// budgetStats is what one budget run adds to the summary.
type budgetStats struct {
	runStats
	created, exhausted, lostCreates, lostGrants, refunds, expiryCut, operatorRestarts int
	// settleCut are the deliveries the restarts left unfinished (in flight, or
	// answered while the link was held), redelivered those a later settlement sent
	// again, linkCuts the restarts that cut the settlement's link; repeats are
	// deliveries of a key after its first.
	settleCut, redelivered, linkCuts, repeats int
	// midDelivery are the restarts that came with a delivery in flight.
	midDelivery int
	// retriedCreates are creations answered existing by the call that created.
	retriedCreates int
	// adversary is what the budget's tenant adversary sent.
	adversary budgetAdversaryStats
}

func (st *budgetStats) add(o budgetStats) {
	st.runStats.add(o.runStats)
	st.created += o.created
	st.exhausted += o.exhausted
	st.lostCreates += o.lostCreates
	st.lostGrants += o.lostGrants
	st.refunds += o.refunds
	st.expiryCut += o.expiryCut
	st.operatorRestarts += o.operatorRestarts
	st.retriedCreates += o.retriedCreates
	st.settleCut += o.settleCut
	st.redelivered += o.redelivered
	st.linkCuts += o.linkCuts
	st.repeats += o.repeats
	st.midDelivery += o.midDelivery
	st.adversary.sent += o.adversary.sent
	st.adversary.forged += o.adversary.forged
	st.adversary.conflicts += o.adversary.conflicts
	st.adversary.slowest = max(st.adversary.slowest, o.adversary.slowest)
}

var budgetOutcomeKeys = []string{"created", "existing", "conflict", "budget_exhausted", "limit_exceeded",
	"quota_exceeded", "granted", "already_claimed", "sold_out", "expired", "not_found", "detail", "detail_not_found", "503", "no-answer"}

// callPacketAPI makes one call of the runtime packet API and turns the answer into
// the model's output; it returns the key the answer is counted under, and an error
// for an answer the API never gives to these requests.
func callPacketAPI(c *http.Client, base string, plan *packetPlan, in BudgetInput) (BudgetOutput, string, error) {
	var req *http.Request
	var err error
	switch in.Op {
	case OpCreate:
		q := plan.reqs[in.Body]
		body, _ := json.Marshal(struct {
			ID string `json:"id"`
			packetRequest
		}{plan.id, q})
		req, err = http.NewRequest(http.MethodPost, base+"/v1/packets", bytes.NewReader(body))
		if err == nil {
			req.Header.Set("Authorization", "Bearer "+budgetSender)
		}
	case OpPacketGrab:
		body, _ := json.Marshal(map[string]string{"userId": in.User})
		req, err = http.NewRequest(http.MethodPost, base+"/v1/packets/"+plan.id+"/grab", bytes.NewReader(body))
	default:
		req, err = http.NewRequest(http.MethodGet, base+"/v1/packets/"+plan.id, nil)
	}
	if err != nil {
		return BudgetOutput{Unknown: true}, "no-answer", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return BudgetOutput{Unknown: true}, "no-answer", nil
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return BudgetOutput{Unknown: true}, "no-answer", nil
	}
	if resp.StatusCode == http.StatusServiceUnavailable {
		return BudgetOutput{Unknown: true}, "503", nil
	}
	unexpected := fmt.Errorf("%w: %s %d %s", errUnexpectedAnswer, in.Op, resp.StatusCode, raw)
	switch in.Op {
	case OpCreate:
		var v struct {
			grabsvc.PacketView
			Error string `json:"error"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return BudgetOutput{Unknown: true}, "no-answer", unexpected
		}
		switch {
		case resp.StatusCode == http.StatusCreated && v.Outcome == string(store.CreateCreated),
			resp.StatusCode == http.StatusOK && v.Outcome == string(store.CreateExisting):
			ct, err1 := time.Parse(time.RFC3339Nano, v.CreatedAt)
			ex, err2 := time.Parse(time.RFC3339Nano, v.ExpiresAt)
			if err1 != nil || err2 != nil {
				return BudgetOutput{Unknown: true}, "no-answer", unexpected
			}
			return BudgetOutput{Create: store.CreateOutcome(v.Outcome), CreatedMs: ct.UnixMilli(), ExpiresMs: ex.UnixMilli()}, v.Outcome, nil
		case resp.StatusCode == http.StatusConflict && (v.Error == string(store.CreateConflict) || v.Error == string(store.CreateBudgetExhausted)),
			resp.StatusCode == http.StatusUnprocessableEntity && v.Error == string(store.CreateLimitExceeded),
			resp.StatusCode == http.StatusForbidden && v.Error == string(store.CreateQuotaExceeded):
			return BudgetOutput{Create: store.CreateOutcome(v.Error)}, v.Error, nil
		}
	case OpPacketGrab:
		var v struct {
			Outcome string `json:"outcome"`
			Share   *int   `json:"share"`
			Amount  *int64 `json:"amount"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return BudgetOutput{Unknown: true}, "no-answer", unexpected
		}
		switch {
		case resp.StatusCode == http.StatusOK && (v.Outcome == string(store.PacketGranted) || v.Outcome == string(store.PacketAlreadyClaimed)) &&
			v.Share != nil && v.Amount != nil:
			return BudgetOutput{Grab: store.PacketGrabOutcome(v.Outcome), Share: *v.Share, Amount: *v.Amount}, v.Outcome, nil
		case resp.StatusCode == http.StatusConflict && (v.Outcome == string(store.PacketSoldOut) || v.Outcome == string(store.PacketExpired)):
			return BudgetOutput{Grab: store.PacketGrabOutcome(v.Outcome)}, v.Outcome, nil
		case resp.StatusCode == http.StatusNotFound && v.Outcome == grabsvc.OutcomeNotFound:
			return BudgetOutput{Grab: store.PacketMissing}, v.Outcome, nil
		case resp.StatusCode == http.StatusForbidden && v.Outcome == string(store.PacketQuotaExceeded):
			return BudgetOutput{Grab: store.PacketQuotaExceeded}, v.Outcome, nil
		}
	default:
		if resp.StatusCode == http.StatusNotFound {
			return BudgetOutput{}, "detail_not_found", nil
		}
		var v grabsvc.PacketDetailView
		if resp.StatusCode != http.StatusOK || json.Unmarshal(raw, &v) != nil {
			return BudgetOutput{Unknown: true}, "no-answer", unexpected
		}
		ex, err := time.Parse(time.RFC3339Nano, v.ExpiresAt)
		if err != nil {
			return BudgetOutput{Unknown: true}, "no-answer", unexpected
		}
		out := BudgetOutput{Found: true, Sender: v.Sender, Total: v.TotalAmount, Count: v.Count, ExpiresMs: ex.UnixMilli(),
			Expired: v.Expired, Forgotten: v.Forgotten, Grabs: map[string]int{}}
		for _, g := range v.Grabs {
			out.Grabs[g.UserID] = g.Share
		}
		return out, "detail", nil
	}
	return BudgetOutput{Unknown: true}, "no-answer", unexpected
}

func runBudgetScenario(t *testing.T, srv *redisProc, sc budgetScenario) budgetStats {
	t.Helper()
	st := budgetStats{runStats: runStats{faults: map[string]int{}, outcomes: map[string]int{}}}
	ctx := context.Background()
	startedAt := time.Now()
	direct := redis.NewClient(srv.Options())
	defer func() { _ = direct.Close() }()
	admin := redis.NewClient(srv.Options())
	defer func() { _ = admin.Close() }()
	proxy, err := NewProxy(srv.Addr)
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	defer proxy.Close()
	opProxy, err := NewProxy(srv.Addr)
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	defer opProxy.Close()
	settleProxy, err := NewProxy(srv.Addr)
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	defer settleProxy.Close()

	receiver := rain.NewReceiver(nil)
	creditLog := NewCreditLog(receiver, func(key string) bool { _, ok := receiver.Delivered(key); return ok })
	flaky := NewFlakyWebhook(creditLog, 300*time.Millisecond, sc.seed)
	mux := http.NewServeMux()
	mux.Handle("/credit", flaky)
	hook := httptest.NewServer(mux)
	defer hook.Close()

	// The budget, as the reconcile makes it: the library loaded, the total announced
	// to the balance system, then the shards configured.
	budget := store.NewBudget(direct, sc.uid, sc.shards)
	if _, err := lua.GrabLibrary.Ensure(ctx, direct); err != nil {
		t.Fatalf("loading the function library: %v", err)
	}
	wc := redis.NewClient(srv.Options())
	defer func() { _ = wc.Close() }()
	cfg := settlement.BudgetConfigFor("default", "history", sc.uid, "CNY", hook.URL+"/credit", 100000, nil,
		settlement.Packets{MaxCount: sc.limits.MaxCount, MaxTTL: sc.limits.MaxTTL})
	cfg.Redis, cfg.Consumer, cfg.ClaimIdle = wc, "reconcile", time.Second
	cfg.HTTPClient = &http.Client{Timeout: 200 * time.Millisecond}
	cfg.BackoffBase, cfg.BackoffMax, cfg.Block = 10*time.Millisecond, 100*time.Millisecond, 100*time.Millisecond
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	if _, err := settlement.AnnounceBudgetTotal(ctx, cfg, store.NewBudget(wc, sc.uid, sc.shards), sc.total); err != nil {
		t.Fatalf("announcing the budget: %v", err)
	}
	if err := budget.Configure(ctx, sc.total, sc.limits); err != nil {
		t.Fatalf("configuring the budget: %v", err)
	}
	allotted := make([]int64, sc.shards)
	for i := range allotted {
		s, err := budget.ShardSnapshot(ctx, i)
		if err != nil {
			t.Fatalf("snapshot: %v", err)
		}
		allotted[i] = s.Allotted
	}
	opr := startBudgetOperator(opProxy.Addr(), settleProxy, sc.uid, sc.shards, sc.total, cfg)
	defer opr.Stop()
	gb := grabsvc.Budget{Namespace: "default", Name: "history", UID: types.UID(sc.uid), Shards: sc.shards}
	var svcs [2]*grabService
	for i := range svcs {
		if svcs[i], err = newPacketService(gb, []byte(budgetSender), proxy.Addr(), sc.deadline, sc.quotas, sc.oneServer); err != nil {
			t.Fatalf("packet grab server: %v", err)
		}
		defer svcs[i].Close()
	}

	ids := make([]string, len(sc.packets))
	for i, p := range sc.packets {
		ids[i] = p.id
	}
	adv, err := newBudgetAdversary(ctx, admin, srv.Options(), sc.uid, allotted, ids, sc.seed)
	if err != nil {
		t.Fatal(err)
	}
	defer adv.Close()
	advCtx, stopAdversary := context.WithCancel(ctx)
	advDone := make(chan struct{})

	rec := &recorder{base: time.Now()}
	start := rec.base
	go func() { defer close(advDone); adv.run(advCtx) }()
	targets := faultTargets{links: []*Proxy{proxy, opProxy, settleProxy}, admin: admin, srv: srv, flaky: flaky,
		ctrlLinks:   []*Proxy{opProxy, settleProxy},
		restartGrab: func(i int, down time.Duration) error { return svcs[i].Restart(down) },
		restartController: func(f fault, heldUntil time.Time) {
			opr.Restart(f.dur, f.target&restartCutsSettlement != 0, heldUntil)
		}}
	var faultEnd time.Duration
	for _, f := range sc.faults {
		faultEnd = max(faultEnd, f.at+f.dur, f.at+f.hold)
		st.faults[f.kind]++
	}
	faultsDone := make(chan struct{})
	go func() {
		defer close(faultsDone)
		for _, f := range sc.faults {
			time.Sleep(time.Until(start.Add(f.at)))
			if err := targets.inject(ctx, f); err != nil {
				t.Errorf("seed %d: %v", sc.seed, err)
			}
		}
	}()

	// The calls: a dispatcher hands them out at their planned times to the clients.
	plans := map[string]*packetPlan{}
	bodies := map[string][]PacketBody{}
	for i := range sc.packets {
		p := &sc.packets[i]
		plans[p.id], bodies[p.id] = p, p.model
	}
	var (
		firstCreate sync.Map // packet id -> time.Time of its first creation sent
		outMu       sync.Mutex
		skipped     atomic.Int32
	)
	queue := make(chan plannedOp)
	var wg sync.WaitGroup
	for c := 0; c < sc.clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tr := &http.Transport{MaxIdleConnsPerHost: 4}
			defer tr.CloseIdleConnections()
			hc := &http.Client{Transport: tr, Timeout: sc.deadline + 300*time.Millisecond}
			for op := range queue {
				call := time.Now()
				if op.in.Op == OpCreate {
					first, _ := firstCreate.LoadOrStore(op.in.Packet, call)
					if call.Sub(first.(time.Time)) > createSpread {
						skipped.Add(1)
						continue
					}
				}
				out, key, err := callPacketAPI(hc, *svcs[op.svc].url.Load(), plans[op.in.Packet], op.in)
				ret := time.Now()
				if err != nil {
					t.Errorf("seed %d: %v", sc.seed, err)
				}
				in := op.in
				in.NotBeforeMs = call.UnixMilli()
				if !out.Unknown {
					in.NotAfterMs = ret.UnixMilli()
				}
				outMu.Lock()
				st.outcomes[key]++
				outMu.Unlock()
				rec.add(c, in, out, call, ret)
			}
		}()
	}
	for _, op := range sc.ops {
		time.Sleep(time.Until(start.Add(op.at)))
		queue <- op
	}
	close(queue)
	wg.Wait()
	stopAdversary()
	<-advDone
	<-faultsDone
	time.Sleep(time.Until(start.Add(faultEnd)))

	// The end: every packet expires, every grant and refund is settled.
	deadline := time.Now().Add(60 * time.Second)
	for {
		snap, err := budget.Snapshot(ctx)
		drained, derr := settlement.BudgetDrained(ctx, budget, "")
		if err == nil && derr == nil && snap.LivePackets == 0 && drained &&
			snap.SettledCount == snap.GrabbedShares && snap.RefundSettled == snap.Refunded {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("seed %d: the budget did not expire and settle everything: %+v (drained %t, %v, %v)", sc.seed, snap, drained, err, derr)
		}
		time.Sleep(50 * time.Millisecond)
	}
	opr.Stop()
	st.expiryCut, st.operatorRestarts, st.linkCuts, st.midDelivery = opr.cut, opr.restarts, opr.linkCuts, opr.midDelivery
	st.settleCut, st.redelivered = opr.settlementCut()
	for _, err := range opr.Errors() {
		t.Errorf("seed %d: %v", sc.seed, err)
	}

	// What the balance system holds of every packet id.
	evidence := map[string]PacketEvidence{}
	finalBody := map[string]int{}
	final := map[string]map[string]int{}
	credits, _ := receiver.Credited(sc.uid)
	seenGrants := 0
	for _, p := range sc.packets {
		ev := PacketEvidence{Grants: map[int]CreditedShare{}}
		for share := 0; share < int(sc.limits.MaxCount); share++ {
			if d, ok := receiver.Delivered(sc.uid + "/" + p.id + "/" + strconv.Itoa(share)); ok {
				ev.Grants[share] = CreditedShare{User: d.UserID, Amount: d.Amount}
				seenGrants++
				if final[p.id] == nil {
					final[p.id] = map[string]int{}
				}
				if prev, dup := final[p.id][d.UserID]; dup {
					st.violations++
					t.Errorf("seed %d: %s: user %s credited shares %d and %d", sc.seed, p.id, d.UserID, prev, share)
				}
				final[p.id][d.UserID] = share
			}
		}
		if d, ok := receiver.Delivered(sc.uid + "/" + p.id + "/refund"); ok {
			ev.RefundUser, ev.Refund = d.UserID, d.Amount
			st.refunds++
		}
		evidence[p.id] = ev
		fb, ok := FinalBody(p.model, ev)
		if !ok {
			st.violations++
			t.Errorf("seed %d: %s: what was credited (%+v) is no packet its bodies can make", sc.seed, p.id, ev)
		}
		finalBody[p.id] = fb
	}
	if seenGrants != len(credits) {
		st.violations++
		t.Errorf("seed %d: %d grants credited, %d of them for the packets' shares", sc.seed, len(credits), seenGrants)
	}

	history := rec.history()
	var phantoms []string
	history, st.dropped, phantoms = ResolveBudget(history, finalBody, final, bodies)
	if len(phantoms) > 0 {
		st.violations++
		t.Errorf("seed %d: users credited shares no grab of theirs can have taken: %v", sc.seed, phantoms)
	}
	st.ops = len(history)
	for _, op := range rec.history() {
		if o := op.Output.(BudgetOutput); o.Unknown {
			st.unknown++
		}
	}

	var ok bool
	if ok, st.check = checkHistory(t, BudgetModel(bodies), history, sc.seed, sc.faults); !ok {
		st.violations++
	}
	for _, v := range CheckExhaustion(history, bodies, finalBody, func(id string) int { return budget.ShardOf(id) }, allotted) {
		st.violations++
		t.Errorf("seed %d: %s", sc.seed, v)
	}

	// Acknowledged creations and grants.
	for _, op := range history {
		in, o := op.Input.(BudgetInput), op.Output.(BudgetOutput)
		switch {
		case in.Op == OpCreate && !o.Unknown && (o.Create == store.CreateCreated || o.Create == store.CreateExisting):
			if o.Create == store.CreateCreated {
				st.created++
			} else if o.CreatedMs >= in.NotBeforeMs {
				// The call that created the packet, answered existing by the grab
				// path's retry after a lost reply.
				st.retriedCreates++
			}
			if finalBody[in.Packet] != in.Body {
				st.lostCreates++
				t.Errorf("seed %d: %s was acknowledged %s with body %d; the balance system shows body %d",
					sc.seed, in.Packet, o.Create, in.Body, finalBody[in.Packet])
			}
		case in.Op == OpCreate && o.Create == store.CreateBudgetExhausted:
			st.exhausted++
		case in.Op == OpPacketGrab && !o.Unknown && (o.Grab == store.PacketGranted || o.Grab == store.PacketAlreadyClaimed):
			if o.Grab == store.PacketGranted {
				st.granted++
			}
			if c, ok := evidence[in.Packet].Grants[o.Share]; !ok || c.User != in.User || c.Amount != o.Amount {
				st.lostGrants++
				t.Errorf("seed %d: %s share %d was acknowledged to %s (%d); credited %+v (%t)",
					sc.seed, in.Packet, o.Share, in.User, o.Amount, c, ok)
			}
		}
	}
	st.lost = st.lostCreates + st.lostGrants
	for _, v := range checkQuotas(ctx, budget, sc, finalBody, final, startedAt) {
		st.violations++
		t.Errorf("seed %d: %s", sc.seed, v)
	}

	// The budget's money: conserved, every grant and refund credited once, nothing
	// beyond the total.
	snap, err := budget.Snapshot(ctx)
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	var grantSum, refundSum int64
	for _, ev := range evidence {
		for _, c := range ev.Grants {
			grantSum += c.Amount
		}
		refundSum += ev.Refund
	}
	tot := receiver.Totals()

	// Each key credited exactly once at the balance system, however often it was
	// delivered; the ledger's sums are what was credited, within the announced total.
	deliveries, creditCount := creditLog.Counts()
	for key, n := range deliveries {
		if strings.HasPrefix(key, sc.uid+"/budget:") {
			continue // the announcement, which credits nothing
		}
		st.repeats += n - 1
		if creditCount[key] != 1 {
			st.violations++
			t.Errorf("seed %d: %s delivered %d times, credited %d times", sc.seed, key, n, creditCount[key])
		}
	}
	if len(creditCount) != seenGrants+st.refunds {
		st.violations++
		t.Errorf("seed %d: %d keys credited, %d grants and %d refunds held by the balance system", sc.seed, len(creditCount), seenGrants, st.refunds)
	}
	sums, err := budget.SettlementLedger(0).Sums(ctx)
	if err != nil {
		t.Fatalf("reading the ledger: %v", err)
	}
	if sums.Total != sc.total || sums.Credited > sums.Total || sums.Credited != grantSum+refundSum || sums.Granted != grantSum ||
		sums.Refunded != refundSum || sums.Grants != int64(seenGrants) || sums.Refunds != int64(st.refunds) {
		st.violations++
		t.Errorf("seed %d: the ledger records %+v; credited %d grants of %d and %d refunds of %d, of a total of %d",
			sc.seed, sums, seenGrants, grantSum, st.refunds, refundSum, sc.total)
	}
	advProblems, advDead := adv.check(ctx, admin, sc.uid)
	for _, p := range advProblems {
		st.violations++
		t.Errorf("seed %d: the budget's tenant adversary: %s", sc.seed, p)
	}
	st.adversary = adv.stats
	if !snap.Conserved() || snap.Total != sc.total || snap.Live != 0 || snap.Claimed != grantSum || snap.Refunded != refundSum ||
		snap.SettledAmount != grantSum || snap.RefundSettled != refundSum || snap.DeadLetters != advDead ||
		grantSum+refundSum > sc.total || tot.Conflicts != 0 || tot.BadRequests != 0 || tot.OverBudget != 0 {
		st.violations++
		t.Errorf("seed %d: budget %+v; credited grants %d and refunds %d of %d; balance system %+v",
			sc.seed, snap, grantSum, refundSum, sc.total, tot)
	}
	for i := range allotted {
		s, err := budget.ShardSnapshot(ctx, i)
		if err != nil {
			t.Fatalf("snapshot: %v", err)
		}
		if s.Available < 0 || !s.Conserved() {
			st.violations++
			t.Errorf("seed %d: budget shard %d: %+v", sc.seed, i, s)
		}
	}
	if n := skipped.Load(); n > 0 {
		t.Logf("seed %d: %d creations not sent: due more than %v after their id's first", sc.seed, n, createSpread)
	}
	return st
}

// checkQuotas checks the run's quotas against what exists at the end, which the
// balance system shows (finalBody, final): per sender, the packets created with its
// bodies, and per user, the shares granted, are at most the daily quota, and the
// counter on its home shard is at least that many (a count is never behind what it
// counted; a take whose creation or grant did not happen may leave it ahead) and,
// with one budget shard or on one server, where the count and the creation or grant
// are one step, exactly that many. A run that crossed a UTC midnight is not checked. It returns one
// sentence per fault.
func checkQuotas(ctx context.Context, budget *store.Budget, sc budgetScenario, finalBody map[string]int,
	final map[string]map[string]int, startedAt time.Time) []string {
	q := sc.quotas
	start := budget.QuotaTimeAt(startedAt, time.UTC)
	if q.PacketsPerDay == 0 && q.SharesPerDay == 0 || budget.QuotaTimeAt(time.Now(), time.UTC).Day != start.Day {
		return nil
	}
	packets, shares := map[string]int64{}, map[string]int64{}
	for _, p := range sc.packets {
		if fb := finalBody[p.id]; fb >= 0 {
			packets[p.reqs[fb].Sender]++
		}
		for user := range final[p.id] {
			shares[user]++
		}
	}
	var out []string
	check := func(who, what string, n, counted, limit int64) {
		switch {
		case n > limit:
			out = append(out, fmt.Sprintf("%s %s: %d %s, above the daily quota of %d", what, who, n, what, limit))
		case counted < n:
			out = append(out, fmt.Sprintf("%s %s: %d %s, its counter says %d", what, who, n, what, counted))
		case (sc.shards == 1 || sc.oneServer) && counted != n:
			out = append(out, fmt.Sprintf("%s %s: %d %s, its counter says %d, counted in the same step", what, who, n, what, counted))
		}
	}
	for _, p := range sc.packets {
		for _, req := range p.reqs {
			if _, seen := packets[req.Sender]; !seen {
				packets[req.Sender] = 0
			}
		}
	}
	for who, n := range packets {
		if q.PacketsPerDay == 0 {
			break
		}
		u, err := budget.QuotaUsed(ctx, who, start)
		if err != nil {
			return append(out, err.Error())
		}
		check(who, "packets of sender", n, u.Packets, q.PacketsPerDay)
	}
	for who, n := range shares {
		if q.SharesPerDay == 0 {
			break
		}
		u, err := budget.QuotaUsed(ctx, who, start)
		if err != nil {
			return append(out, err.Error())
		}
		check(who, "shares of user", n, u.Shares, q.SharesPerDay)
	}
	return out
}

// CheckExhaustion checks each budget_exhausted answer against the money of the whole
// budget, since a dry shard borrows from its siblings (store/budget_moves.go): the
// shards' allotments together less what the creations that may have run before the
// answer drew (every packet whose first creation was called before the answer
// returned, on any shard; refunds, which give money back, are left out, so the bound
// is generous) must be below the refused total. It returns one sentence per answer
// the money cannot explain.
func CheckExhaustion(history []porcupine.Operation, bodies map[string][]PacketBody, finalBody map[string]int,
	shardOf func(string) int, allotted []int64) []string {
	firstCall := map[string]int64{} // packet id -> the earliest call of a creation with its final body
	for _, op := range history {
		in := op.Input.(BudgetInput)
		if in.Op != OpCreate || finalBody[in.Packet] != in.Body {
			continue
		}
		if c, ok := firstCall[in.Packet]; !ok || op.Call < c {
			firstCall[in.Packet] = op.Call
		}
	}
	var out []string
	for _, op := range history {
		in, o := op.Input.(BudgetInput), op.Output.(BudgetOutput)
		if in.Op != OpCreate || o.Unknown || o.Create != store.CreateBudgetExhausted {
			continue
		}
		var total, drawn int64
		for _, a := range allotted {
			total += a
		}
		for id, c := range firstCall {
			if id != in.Packet && c < op.Return {
				drawn += bodies[id][finalBody[id]].Total
			}
		}
		want := bodies[in.Packet][in.Body].Total
		if total-drawn >= want {
			out = append(out, fmt.Sprintf("%s (total %d, shard %d) answered budget_exhausted, but the budget had %d allotted and at most %d drawn",
				in.Packet, want, shardOf(in.Packet), total, drawn))
		}
	}
	return out
}

// TestBudgetHistories runs seeded runs of a budget's runtime packets (seed 004:
// packets created over HTTP, raced by their group, expired with refunds) under
// faults and checks every history (HISTORY_BUDGET_RUNS runs, default 3;
// HISTORY_SEED replays one seed): a real redis-server with the AOF fsynced on every
// write, two real packet grab servers over HTTP through the fault proxy, and what the
// operator process runs for the budget (budgetOperator: the expiry runner and
// function keeper on one faulted link, the settlement workers on another, delivering
// to the balance system behind the flaky webhook), all of it killed and restarted by
// an operator restart. It ends with the summary of all runs.
func TestBudgetHistories(t *testing.T) {
	srv := startRedis(t)
	var sum budgetStats
	done := 0
	begin := time.Now()
	for _, seed := range seeds(t, envInt("HISTORY_BUDGET_RUNS", 3)) {
		sc := newBudgetScenario(seed)
		runStart := time.Now()
		st := runBudgetScenario(t, srv, sc)
		done++
		t.Logf("seed %d: %d shards, quotas %+v (one step on one server %v), %d packets, %d clients, %d ops (%d created, %d budget_exhausted, %d granted, %d refunds; %d unknown, %d changed nothing; answers %s), operator restarts %d (expiry calls cut %d, settlement deliveries cut %d, %d of them redelivered, link cut %d times; %d repeated deliveries), faults %v: %d violations, %d lost (%v, check %v)",
			sc.seed, sc.shards, sc.quotas, sc.oneServer, len(sc.packets), sc.clients, st.ops, st.created, st.exhausted, st.granted, st.refunds, st.unknown, st.dropped,
			formatCounts(st.outcomes, budgetOutcomeKeys), st.operatorRestarts, st.expiryCut, st.settleCut, st.redelivered, st.linkCuts, st.repeats, sc.faults, st.violations, st.lost,
			time.Since(runStart).Round(time.Millisecond), st.check.Round(time.Millisecond))
		sum.add(st)
		if t.Failed() {
			t.Logf("stopping after seed %d; replay with HISTORY_SEED=%d go test -run '^TestBudgetHistories$' ./test/history/", sc.seed, sc.seed)
			break
		}
	}
	// The runs that lose their data (budget_loss_test.go), with the real controller.
	var losses []budgetLossRun
	if !t.Failed() {
		for _, seed := range lossSeeds(t, envInt("HISTORY_BUDGET_LOSS_RUNS", 2)) {
			runStart := time.Now()
			lr := runBudgetLoss(t, seed)
			losses = append(losses, lr)
			t.Logf("seed %d: data loss by %s, %d shards: fenced %v after the loss; %d calls, %d answered 2xx between the loss and the fence, %d answered 503 after it; balance system: %d refused over the total, %d repeats, %d conflicts (%v)",
				seed, lr.kind, lr.shards, lr.detect.Round(time.Millisecond), lr.calls, lr.window, lr.fenced503, lr.refusedOver, lr.repeat, lr.conflicts,
				time.Since(runStart).Round(time.Millisecond))
			if t.Failed() {
				t.Logf("stopping after seed %d; replay with HISTORY_LOSS_SEED=%d HISTORY_BUDGET_RUNS=0 go test -run '^TestBudgetHistories$' ./test/history/", seed, seed)
				break
			}
		}
	}
	nFaults := 0
	for _, n := range sum.faults {
		nFaults += n
	}
	t.Logf("\n%-5s %-11s %-7s %-11s %-14s %-11s\n%-5d %-11d %-7d %-11d %-14d %-11d\n"+
		"faults by kind:   %s\n"+
		"answers:          %s\n"+
		"created %d (and %d answered existing by the call that created), budget_exhausted %d, granted %d, refunds %d; unknown outcomes %d (%d changed nothing); operator restarts %d (%d with a delivery in flight), expiry calls cut %d, settlement deliveries cut %d (%d redelivered by the next operator), settlement link cut %d times; repeated deliveries %d\n"+
		"tenant adversary: %d commands (%d forged entries, each dead-lettered; %d conflicting creations of a used id), the slowest answered in %v\n"+
		"data lost: %s\n"+
		"(%v; slowest check %v)",
		"runs", "operations", "faults", "violations", "creates-lost", "grants-lost",
		done, sum.ops, nFaults, sum.violations, sum.lostCreates, sum.lostGrants,
		formatCounts(sum.faults, budgetFaultKinds), formatCounts(sum.outcomes, budgetOutcomeKeys),
		sum.created, sum.retriedCreates, sum.exhausted, sum.granted, sum.refunds, sum.unknown, sum.dropped, sum.operatorRestarts, sum.midDelivery, sum.expiryCut, sum.settleCut, sum.redelivered, sum.linkCuts, sum.repeats,
		sum.adversary.sent, sum.adversary.forged, sum.adversary.conflicts, sum.adversary.slowest.Round(time.Millisecond),
		describeLosses(losses), time.Since(begin).Round(time.Millisecond), sum.check.Round(time.Millisecond))
}
