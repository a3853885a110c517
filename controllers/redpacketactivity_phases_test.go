package controllers

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// The steps of a reconcile, each run on its own against the fakes: no API server, no
// Redis. Each table says what the step is given (the spec, the status, what Redis
// holds and which call fails) and what it must decide.

var errRedisDown = errors.New("dial tcp 127.0.0.1:6379: connect: connection refused")

func TestRedisConnectionStep(t *testing.T) {
	redisSecret := func(data map[string]string) *corev1.Secret {
		s := &corev1.Secret{}
		s.Name, s.Namespace = "redis-conn", "default"
		s.StringData = nil
		s.Data = map[string][]byte{}
		for k, v := range data {
			s.Data[k] = []byte(v)
		}
		return s
	}
	ownRedis := func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.Redis = &redpacketv1alpha1.RedisConnection{SecretRef: redpacketv1alpha1.SecretReference{Name: "redis-conn"}}
	}
	cases := []struct {
		name         string
		mutate       func(*redpacketv1alpha1.RedPacketActivity)
		objs         []client.Object
		defaultRedis *redisconn.Conn
		fail         map[string]error
		wantBlocker  string
		wantErr      bool
		wantMessage  string
		wantAddrs    []string
		wantCalls    []string
	}{
		{
			name:      "the operator's default Redis answers",
			wantAddrs: []string{"redis.test:6379"},
			wantCalls: []string{"store.Time", "store.Snapshot"},
		},
		{
			name:      "the Secret spec.redis names",
			mutate:    ownRedis,
			objs:      []client.Object{redisSecret(map[string]string{"addresses": "a:1, b:2", "mode": "cluster"})},
			wantAddrs: []string{"a:1", "b:2"},
			wantCalls: []string{"store.Time", "store.Snapshot"},
		},
		{
			name:        "the Secret spec.redis names is missing",
			mutate:      ownRedis,
			wantBlocker: redpacketv1alpha1.ReasonRedisConfigInvalid,
			wantErr:     true,
			wantMessage: "secret redis-conn named by spec.redis.secretRef does not exist",
		},
		{
			name:        "the Secret has no addresses",
			mutate:      ownRedis,
			objs:        []client.Object{redisSecret(map[string]string{"mode": "standalone"})},
			wantBlocker: redpacketv1alpha1.ReasonRedisConfigInvalid,
			wantErr:     true,
			wantMessage: "secret redis-conn",
		},
		{
			name:         "the operator's default Redis is not configured",
			defaultRedis: &redisconn.Conn{},
			wantBlocker:  redpacketv1alpha1.ReasonRedisConfigInvalid,
			wantErr:      true,
			wantMessage:  "the operator's default Redis connection",
		},
		{
			name:        "Redis is unavailable",
			fail:        map[string]error{"Time": errRedisDown},
			wantBlocker: redpacketv1alpha1.ReasonRedisUnavailable,
			wantErr:     true,
			wantMessage: "Redis at redis.test:6379 is unavailable: " + errRedisDown.Error(),
			wantCalls:   []string{"store.Time"},
		},
		{
			name:        "the snapshot cannot be read",
			fail:        map[string]error{"Snapshot": errRedisDown},
			wantBlocker: redpacketv1alpha1.ReasonRedisUnavailable,
			wantErr:     true,
			wantMessage: "reading the activity from Redis at redis.test:6379",
			wantCalls:   []string{"store.Time", "store.Snapshot"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			if tc.mutate != nil {
				tc.mutate(a)
			}
			p := newPhaseTest(t, openSnapshot(), tc.objs...)
			p.r.AllowedHosts = MustParseRedisHosts("a,b") // the hosts the Secrets name
			if tc.defaultRedis != nil {
				p.r.DefaultRedis = *tc.defaultRedis
			}
			p.store.fail = tc.fail
			s := newActivityScope(a, testNow)
			res, err := p.r.reconcileRedisConnection(context.Background(), s)
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v, want error: %t", err, tc.wantErr)
			}
			if got := blockerReason(res); got != tc.wantBlocker {
				t.Errorf("blocker %q, want %q", got, tc.wantBlocker)
			}
			if tc.wantBlocker != "" {
				if !res.halt {
					t.Error("a blocked connection does not halt the chain")
				}
				if !strings.Contains(res.blocker.message, tc.wantMessage) {
					t.Errorf("Ready's message %q, want it to contain %q", res.blocker.message, tc.wantMessage)
				}
				if s.snapshotRead {
					t.Error("snapshotRead is true although Redis was not read")
				}
			} else {
				if !s.snapshotRead || s.snapshot != openSnapshot() || !s.redisNow.Equal(testNow) {
					t.Errorf("scope after the step: read %t, snapshot %+v, clock %s", s.snapshotRead, s.snapshot, s.redisNow)
				}
				if !slices.Equal(s.conn.Addresses, tc.wantAddrs) {
					t.Errorf("connection addresses %q, want %q", s.conn.Addresses, tc.wantAddrs)
				}
			}
			if got := p.log.with("store."); !slices.Equal(got, tc.wantCalls) {
				t.Errorf("store calls %q, want %q", got, tc.wantCalls)
			}
		})
	}
}

func TestSplitStep(t *testing.T) {
	seed := int64(42)
	cases := []struct {
		name        string
		mutate      func(*redpacketv1alpha1.RedPacketActivity)
		snap        store.Snapshot
		wantSplit   bool
		wantSeed    int64
		wantBlocker string
	}{
		{name: "a new activity is split with the UID's seed", wantSplit: true, wantSeed: split.SeedFromUID("uid-1")},
		{
			name:      "with the spec's seed",
			mutate:    func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Distribution.Seed = &seed },
			wantSplit: true, wantSeed: 42,
		},
		{name: "Redis holds it already: no split", snap: openSnapshot(), wantSeed: split.SeedFromUID("uid-1")},
		{name: "status says it was seeded: no split", mutate: seededStatus, wantSeed: split.SeedFromUID("uid-1")},
		{
			name: "endTime before startTime",
			mutate: func(a *redpacketv1alpha1.RedPacketActivity) {
				a.Spec.StartTime = &metav1.Time{Time: testNow.Add(time.Hour)}
				a.Spec.EndTime = &metav1.Time{Time: testNow}
			},
			wantSeed: split.SeedFromUID("uid-1"), wantBlocker: redpacketv1alpha1.ReasonInvalidSpec,
		},
		{
			name:     "the total cannot give every packet the minimum",
			mutate:   func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Distribution.MinAmount = 101 },
			wantSeed: split.SeedFromUID("uid-1"), wantBlocker: redpacketv1alpha1.ReasonInvalidSpec,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			if tc.mutate != nil {
				tc.mutate(a)
			}
			p := newPhaseTest(t, tc.snap)
			s := p.scope(a)
			res, err := p.r.reconcileSplit(context.Background(), s)
			if err != nil {
				t.Fatal(err)
			}
			if s.status.SplitSeed == nil || *s.status.SplitSeed != tc.wantSeed {
				t.Errorf("status.splitSeed %v, want %d", s.status.SplitSeed, tc.wantSeed)
			}
			if got := blockerReason(res); got != tc.wantBlocker {
				t.Errorf("blocker %q, want %q", got, tc.wantBlocker)
			}
			if tc.wantBlocker != "" {
				if !res.halt || s.status.Phase != redpacketv1alpha1.PhaseFailed ||
					condition(s.status, redpacketv1alpha1.ConditionSeeded) != "False/"+redpacketv1alpha1.ReasonInvalidSpec {
					t.Errorf("invalid spec: halt %t, %s; want a halt, Failed and Seeded False/InvalidSpec", res.halt, describeStatus(s.status))
				}
				return
			}
			if res.halt {
				t.Error("the step halted")
			}
			if !tc.wantSplit {
				if s.amounts != nil {
					t.Errorf("split %d packets, want none", len(s.amounts))
				}
				return
			}
			var sum int64
			for _, v := range s.amounts {
				sum += v
			}
			if int64(len(s.amounts)) != a.Spec.Count || sum != a.Spec.TotalAmount {
				t.Errorf("split into %d packets summing to %d, want %d summing to %d", len(s.amounts), sum, a.Spec.Count, a.Spec.TotalAmount)
			}
			want, _ := split.Split(splitParams(a))
			if !slices.Equal(s.amounts, want) {
				t.Errorf("split %v, the seed gives %v", s.amounts, want)
			}
		})
	}
}

// Seeding records Seeded on the API server before the gate opens grabbing, and shows
// Seeding while it writes: the status writes and the Redis writes happen in this
// order, through the patcher the seed step receives.
func TestSeedRecordsSeededBeforeTheGateOpens(t *testing.T) {
	a := testActivity()
	p := newPhaseTest(t, store.Snapshot{StagedCount: 3}, a.DeepCopy())
	s := p.scope(a)
	ctx := context.Background()
	if res, err := p.r.reconcileSplit(ctx, s); err != nil || res.halt {
		t.Fatalf("split: %+v %v", res, err)
	}
	res, err := p.r.reconcileSeed(ctx, s, p.r.patchStatusNow)
	if err != nil || res.halt || res.blocker != nil {
		t.Fatalf("seed: %+v %v", res, err)
	}
	if _, err := p.r.reconcileGate(ctx, s); err != nil {
		t.Fatalf("gate: %v", err)
	}

	want := []string{
		"status.apply phase=Seeding",
		"store.Seed",
		"store.Snapshot",
		"status.apply phase=Seeding",
		"store.Configure",
	}
	got := p.log.all()
	if len(got) != len(want) {
		t.Fatalf("calls:\n%s\nwant %d calls starting with %q", p.log, len(want), want)
	}
	for i := range want {
		if !strings.HasPrefix(got[i], want[i]) {
			t.Fatalf("call %d is %q, want %q; calls:\n%s", i, got[i], want[i], p.log)
		}
	}
	showing, recorded := p.status.applied[0], p.status.applied[1]
	if condition(showing, redpacketv1alpha1.ConditionSeeded) != "False/"+redpacketv1alpha1.ReasonSeeding ||
		condition(showing, redpacketv1alpha1.ConditionReady) != "False/"+redpacketv1alpha1.ReasonSeeding {
		t.Errorf("while seeding: %s, want Seeded and Ready False/Seeding", describeStatus(showing))
	}
	if msg := conditionMessage(showing, redpacketv1alpha1.ConditionSeeded); !strings.Contains(msg, "(3 staged)") {
		t.Errorf("Seeded's message while seeding %q does not say how many are staged", msg)
	}
	if condition(recorded, redpacketv1alpha1.ConditionSeeded) != "True/"+redpacketv1alpha1.ReasonCommitted || recorded.SeededTime == nil {
		t.Errorf("before opening: %s, seededTime %v; want Seeded True/Committed with a time", describeStatus(recorded), recorded.SeededTime)
	}
	if recorded.ObservedGeneration != 0 || showing.ObservedGeneration != 0 {
		t.Errorf("a mid-way write observed generation %d/%d: only a clean reconcile does", showing.ObservedGeneration, recorded.ObservedGeneration)
	}
	if s.notReady != nil {
		t.Errorf("the Seeding blocker outlived the write that showed it: %+v", s.notReady)
	}
	if !statusRecordsSeeded(a.Status) || !s.seededRecorded {
		t.Errorf("the scope's activity status does not record Seeded after the write: %s", describeStatus(a.Status))
	}
	if p.store.seedParams.Count != 10 || p.store.seedParams.Total != 1000 || p.store.seedParams.Sponsor != "merchant-001" {
		t.Errorf("seeded with %+v", p.store.seedParams)
	}
	if p.store.snap.State != store.StateOpen {
		t.Errorf("Redis state %q after the gate, want open", p.store.snap.State)
	}
}

func TestSeedStep(t *testing.T) {
	cases := []struct {
		name string
		// mutate changes the cached activity; fresh, when set, is the activity
		// on the API server (else the cached one).
		mutate       func(*redpacketv1alpha1.RedPacketActivity)
		fresh        func(*redpacketv1alpha1.RedPacketActivity)
		snap         store.Snapshot
		fail         map[string]error
		writeErr     error
		wantErr      bool
		wantBlocker  string
		wantHalt     bool
		wantRequeue  time.Duration
		wantSeeded   string // Seeded condition, Status/Reason
		wantPhase    redpacketv1alpha1.Phase
		wantRecorded bool
		wantCalls    []string
	}{
		{
			name: "new: seeded, then Seeded recorded", wantSeeded: "True/Committed", wantPhase: redpacketv1alpha1.PhaseSeeding,
			wantRecorded: true,
			wantCalls:    []string{"status.apply", "store.Seed", "store.Snapshot", "status.apply"},
		},
		{
			name: "Redis holds it and status records it: adopted without a write", mutate: seededStatus, snap: openSnapshot(),
			wantSeeded: "True/Committed", wantRecorded: true,
		},
		{
			name: "Redis holds it, status does not say so yet: recorded", snap: openSnapshot(),
			wantSeeded: "True/Committed", wantPhase: redpacketv1alpha1.PhasePending, wantRecorded: true, wantCalls: []string{"status.apply"},
		},
		{
			name: "Redis lost what the cached status says was seeded", mutate: seededStatus,
			wantBlocker: redpacketv1alpha1.ReasonDataLost, wantHalt: true, wantRequeue: dataLostRecheckPeriod,
			wantSeeded: "False/DataLost", wantPhase: redpacketv1alpha1.PhaseFailed,
		},
		{
			name:        "Redis lost what the API server's status says was seeded (the cache is stale)",
			fresh:       seededStatus,
			wantBlocker: redpacketv1alpha1.ReasonDataLost, wantHalt: true, wantRequeue: dataLostRecheckPeriod,
			wantSeeded: "False/DataLost", wantPhase: redpacketv1alpha1.PhaseFailed,
		},
		{
			name: "Redis lost an activity with claims reported",
			mutate: func(a *redpacketv1alpha1.RedPacketActivity) {
				claimed := int64(3)
				a.Status.ClaimedCount = &claimed
			},
			wantBlocker: redpacketv1alpha1.ReasonDataLost, wantHalt: true, wantRequeue: dataLostRecheckPeriod,
			wantSeeded: "False/DataLost", wantPhase: redpacketv1alpha1.PhaseFailed,
		},
		{
			name: "seeding fails", fail: map[string]error{"Seed": errRedisDown},
			wantErr: true, wantBlocker: redpacketv1alpha1.ReasonSeedFailed, wantSeeded: "False/SeedFailed",
			wantPhase: redpacketv1alpha1.PhaseSeeding, wantCalls: []string{"status.apply", "store.Seed"},
		},
		{
			name: "Seeding cannot be shown: nothing is written to Redis", writeErr: errors.New("the API server is down"),
			wantErr: true, wantBlocker: redpacketv1alpha1.ReasonSeeding, wantSeeded: "False/Seeding",
			wantPhase: redpacketv1alpha1.PhaseSeeding, wantCalls: []string{"status.apply"},
		},
		{
			name: "Seeded cannot be recorded: not recorded, so the gate stays shut", snap: openSnapshot(),
			writeErr: errors.New("the API server is down"),
			wantErr:  true, wantSeeded: "True/Committed", wantPhase: redpacketv1alpha1.PhasePending, wantCalls: []string{"status.apply"},
		},
		{
			name: "Redis holds other figures", mutate: seededStatus,
			snap:        store.Snapshot{State: store.StateOpen, Count: 20, Total: 1000, RemainingCount: 20},
			wantBlocker: redpacketv1alpha1.ReasonSpecMismatch, wantHalt: true, wantSeeded: "True/Committed",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			onServer := testActivity()
			if tc.fresh != nil {
				tc.fresh(onServer)
			}
			p := newPhaseTest(t, tc.snap, onServer)
			p.store.fail = tc.fail
			p.status.err = tc.writeErr
			a := testActivity()
			if tc.mutate != nil {
				tc.mutate(a)
			}
			s := p.scope(a)
			if _, err := p.r.reconcileSplit(context.Background(), s); err != nil {
				t.Fatal(err)
			}
			res, err := p.r.reconcileSeed(context.Background(), s, p.r.patchStatusNow)
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v, want error: %t", err, tc.wantErr)
			}
			if got := blockerReason(res); got != tc.wantBlocker {
				t.Errorf("blocker %q, want %q", got, tc.wantBlocker)
			}
			if res.halt != tc.wantHalt || res.requeueAfter != tc.wantRequeue {
				t.Errorf("halt %t requeue %s, want %t %s", res.halt, res.requeueAfter, tc.wantHalt, tc.wantRequeue)
			}
			if got := condition(s.status, redpacketv1alpha1.ConditionSeeded); got != tc.wantSeeded {
				t.Errorf("Seeded %s, want %s", got, tc.wantSeeded)
			}
			if s.status.Phase != tc.wantPhase {
				t.Errorf("phase %q, want %q", s.status.Phase, tc.wantPhase)
			}
			if s.seededRecorded != tc.wantRecorded {
				t.Errorf("seededRecorded %t, want %t", s.seededRecorded, tc.wantRecorded)
			}
			var calls []string
			for _, c := range p.log.all() {
				if strings.HasPrefix(c, "store.") || strings.HasPrefix(c, "status.") {
					name, _, _ := strings.Cut(c, " ")
					calls = append(calls, name)
				}
			}
			if !slices.Equal(calls, tc.wantCalls) {
				t.Errorf("calls %q, want %q", calls, tc.wantCalls)
			}
		})
	}
}

func TestScriptsStep(t *testing.T) {
	for _, fail := range []error{nil, errRedisDown} {
		p := newPhaseTest(t, openSnapshot())
		p.store.fail = map[string]error{"LoadScripts": fail}
		s := p.scope(testActivity())
		res, err := p.r.reconcileScripts(context.Background(), s)
		if fail == nil {
			if err != nil || res.blocker != nil || s.status.ScriptSHA != lua.GrabScript.SHA() {
				t.Errorf("scripts loaded: %+v %v, scriptSHA %q", res, err, s.status.ScriptSHA)
			}
			continue
		}
		if err == nil || blockerReason(res) != redpacketv1alpha1.ReasonRedisUnavailable || s.status.ScriptSHA != "" {
			t.Errorf("scripts not loaded: %+v %v, scriptSHA %q", res, err, s.status.ScriptSHA)
		}
	}
}

func TestGateStep(t *testing.T) {
	start, end := testNow.Add(time.Hour), testNow.Add(2*time.Hour)
	window := func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.StartTime, a.Spec.EndTime = &metav1.Time{Time: start}, &metav1.Time{Time: end}
	}
	paused := func(a *redpacketv1alpha1.RedPacketActivity) { a.Spec.Paused = true }
	ready := store.Snapshot{State: store.StateReady, Count: 10, Total: 1000, RemainingCount: 10}
	closed := store.Snapshot{State: store.StateClosed, Count: 10, Total: 1000, CloseReason: store.CloseExpired, Refunded: 1000}
	cases := []struct {
		name         string
		mutate       []func(*redpacketv1alpha1.RedPacketActivity)
		snap         store.Snapshot
		notRecorded  bool
		fail         error
		wantErr      error // errors.Is; nil with wantAnyErr for any error
		wantAnyErr   bool
		wantBlocker  string
		wantConfig   string
		wantState    store.State
		wantSnapshot func(store.Snapshot) bool
	}{
		{
			name: "a ready activity is opened with the spec's window", mutate: []func(*redpacketv1alpha1.RedPacketActivity){window},
			snap: ready, wantConfig: "store.Configure start=" + strconv.FormatInt(start.UnixMilli(), 10) + " end=" + strconv.FormatInt(end.UnixMilli(), 10) + " paused=false open=true",
			wantState: store.StateOpen,
			wantSnapshot: func(s store.Snapshot) bool {
				return s.StartMs == start.UnixMilli() && s.EndMs == end.UnixMilli()
			},
		},
		{name: "open and as the spec says: nothing to write", snap: openSnapshot(), wantState: store.StateOpen},
		{
			name: "paused in the spec, open in Redis", mutate: []func(*redpacketv1alpha1.RedPacketActivity){paused},
			snap: openSnapshot(), wantConfig: "store.Configure start=0 end=0 paused=true open=true", wantState: store.StateOpen,
			wantSnapshot: func(s store.Snapshot) bool { return s.Paused },
		},
		{name: "closed stays closed", mutate: []func(*redpacketv1alpha1.RedPacketActivity){paused}, snap: closed, wantState: store.StateClosed},
		{name: "never opened before Seeded is recorded", snap: ready, notRecorded: true, wantAnyErr: true, wantState: store.StateReady},
		{
			name: "Redis lost it between the steps", snap: ready, wantErr: store.ErrMissing,
			wantConfig: "store.Configure", wantState: store.StateReady,
		},
		{
			name: "Redis fails", snap: ready, fail: errRedisDown, wantErr: errRedisDown, wantBlocker: redpacketv1alpha1.ReasonRedisUnavailable,
			wantConfig: "store.Configure", wantState: store.StateReady,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity(tc.mutate...)
			storeSnap := tc.snap
			if tc.wantErr == store.ErrMissing {
				storeSnap = store.Snapshot{}
			}
			p := newPhaseTest(t, storeSnap)
			p.store.fail = map[string]error{"Configure": tc.fail}
			s := p.scope(a)
			s.snapshot = tc.snap
			s.seededRecorded = !tc.notRecorded
			res, err := p.r.reconcileGate(context.Background(), s)
			switch {
			case tc.wantErr != nil && !errors.Is(err, tc.wantErr):
				t.Fatalf("error %v, want %v", err, tc.wantErr)
			case tc.wantErr == nil && (err != nil) != tc.wantAnyErr:
				t.Fatalf("error %v, want error: %t", err, tc.wantAnyErr)
			}
			if got := blockerReason(res); got != tc.wantBlocker {
				t.Errorf("blocker %q, want %q", got, tc.wantBlocker)
			}
			calls := p.log.with("store.Configure")
			switch {
			case tc.wantConfig == "" && len(calls) > 0:
				t.Errorf("configured: %q, want no Redis write", calls)
			case tc.wantConfig != "" && (len(calls) != 1 || !strings.HasPrefix(calls[0], tc.wantConfig)):
				t.Errorf("configure calls %q, want one %q", calls, tc.wantConfig)
			}
			if s.snapshot.State != tc.wantState {
				t.Errorf("scope's Redis state %q, want %q", s.snapshot.State, tc.wantState)
			}
			if tc.wantSnapshot != nil && !tc.wantSnapshot(s.snapshot) {
				t.Errorf("scope's snapshot %+v does not hold what was configured", s.snapshot)
			}
		})
	}
}

// The schedule step decides the phase from Redis and Redis's clock, through
// store.Snapshot.Phase, and closes the activity when that phase says it is over.
func TestScheduleStep(t *testing.T) {
	ms := func(d time.Duration) int64 { return testNow.Add(d).UnixMilli() }
	open := func(mutate func(*store.Snapshot)) store.Snapshot {
		s := openSnapshot()
		if mutate != nil {
			mutate(&s)
		}
		return s
	}
	closedAs := func(reason store.CloseReason, mutate func(*store.Snapshot)) store.Snapshot {
		s := store.Snapshot{State: store.StateClosed, CloseReason: reason, Count: 10, Total: 1000, ClaimedCount: 10, ClaimedAmount: 1000}
		if reason == store.CloseExpired {
			s.ClaimedCount, s.ClaimedAmount, s.Refunded = 4, 300, 700
		}
		if mutate != nil {
			mutate(&s)
		}
		return s
	}
	resync := 5 * time.Second
	cases := []struct {
		name        string
		webhook     bool
		snap        store.Snapshot
		fail        error
		wantPhase   redpacketv1alpha1.Phase
		wantRequeue time.Duration
		wantClose   string
		wantRefund  *int64
		wantMessage string
		wantErr     bool
		wantBlocker string
	}{
		{
			name:      "before startTime: Scheduled, back at startTime",
			snap:      open(func(s *store.Snapshot) { s.StartMs, s.EndMs = ms(time.Minute), ms(time.Hour) }),
			wantPhase: redpacketv1alpha1.PhaseScheduled, wantRequeue: time.Minute,
			wantMessage: "10 packets are seeded; grabbing opens at 2026-12-31T20:01:00Z",
		},
		{
			name: "in the window: Active, back at the resync", snap: open(func(s *store.Snapshot) { s.StartMs, s.EndMs = ms(-time.Minute), ms(time.Hour) }),
			wantPhase: redpacketv1alpha1.PhaseActive, wantRequeue: resync, wantMessage: "grabbing is open with 10 of 10 packets left",
		},
		{
			name: "Active one second before endTime: back at endTime", snap: open(func(s *store.Snapshot) { s.EndMs = ms(time.Second) }),
			wantPhase: redpacketv1alpha1.PhaseActive, wantRequeue: time.Second,
		},
		{
			name: "paused: Paused, back at endTime only", snap: open(func(s *store.Snapshot) { s.Paused, s.RemainingCount, s.EndMs = true, 4, ms(time.Hour) }),
			wantPhase: redpacketv1alpha1.PhasePaused, wantRequeue: time.Hour, wantMessage: "grabbing is paused with 4 of 10 packets left",
		},
		{
			name: "paused without endTime: nothing to come back for", snap: open(func(s *store.Snapshot) { s.Paused = true }),
			wantPhase: redpacketv1alpha1.PhasePaused,
		},
		{
			name:      "endTime passed: closed as expired, the rest refunded",
			snap:      open(func(s *store.Snapshot) { s.EndMs, s.RemainingCount, s.ClaimedCount, s.ClaimedAmount = ms(0), 6, 4, 300 }),
			wantPhase: redpacketv1alpha1.PhaseExpired, wantClose: "store.Close expired", wantRefund: ptrTo[int64](700),
			wantMessage: "grabbing closed at endTime; 4 of 10 packets were claimed and 700 was refunded to the sponsor",
		},
		{
			name:      "endTime passed while paused: closed as expired",
			snap:      open(func(s *store.Snapshot) { s.Paused, s.EndMs = true, ms(-time.Second) }),
			wantPhase: redpacketv1alpha1.PhaseExpired, wantClose: "store.Close expired", wantRefund: ptrTo[int64](1000),
		},
		{
			name:      "no packet left: closed as exhausted",
			snap:      open(func(s *store.Snapshot) { s.RemainingCount, s.ClaimedCount, s.ClaimedAmount = 0, 10, 1000 }),
			wantPhase: redpacketv1alpha1.PhaseExhausted, wantClose: "store.Close exhausted", wantRefund: ptrTo[int64](0),
			wantMessage: "all 10 packets were claimed",
		},
		{
			name: "closed and settlement pending: back at the resync", webhook: true,
			snap:      closedAs(store.CloseExpired, func(s *store.Snapshot) { s.SettledCount = 1 }),
			wantPhase: redpacketv1alpha1.PhaseExpired, wantRequeue: resync, wantRefund: ptrTo[int64](700),
		},
		{
			name: "closed with dead letters: back six resyncs later", webhook: true,
			snap:      closedAs(store.CloseExhausted, func(s *store.Snapshot) { s.DeadCount = 1 }),
			wantPhase: redpacketv1alpha1.PhaseExhausted, wantRequeue: 6 * resync, wantRefund: ptrTo[int64](0),
		},
		{
			name: "closed and settled: nothing to come back for", webhook: true,
			snap:      closedAs(store.CloseExpired, func(s *store.Snapshot) { s.SettledCount, s.SettledAmount, s.RefundSettled = 4, 300, 700 }),
			wantPhase: redpacketv1alpha1.PhaseExpired, wantRefund: ptrTo[int64](700),
		},
		{
			name: "closed without settlement: nothing can move", snap: closedAs(store.CloseExpired, nil),
			wantPhase: redpacketv1alpha1.PhaseExpired, wantRefund: ptrTo[int64](700),
		},
		{
			name: "closing fails", snap: open(func(s *store.Snapshot) { s.EndMs = ms(-time.Second) }), fail: errRedisDown,
			wantClose: "store.Close expired", wantErr: true, wantBlocker: redpacketv1alpha1.ReasonRedisUnavailable,
		},
		{
			name: "never opened: no phase follows", snap: store.Snapshot{State: store.StateReady, Count: 10, Total: 1000},
			wantErr: true,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			if tc.webhook {
				withWebhook(a)
			}
			p := newPhaseTest(t, tc.snap)
			p.r.Options.ActiveResyncPeriod = resync
			p.store.fail = map[string]error{"Close": tc.fail}
			s := p.scope(a)
			res, err := p.r.reconcileSchedule(context.Background(), s)
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v, want error: %t", err, tc.wantErr)
			}
			if got := blockerReason(res); got != tc.wantBlocker {
				t.Errorf("blocker %q, want %q", got, tc.wantBlocker)
			}
			closes := p.log.with("store.Close")
			if tc.wantClose == "" && len(closes) > 0 || tc.wantClose != "" && !slices.Equal(closes, []string{tc.wantClose}) {
				t.Errorf("close calls %q, want %q", closes, tc.wantClose)
			}
			if tc.wantErr {
				return
			}
			if s.status.Phase != tc.wantPhase {
				t.Errorf("phase %q, want %q", s.status.Phase, tc.wantPhase)
			}
			// The controller's phase is the one Redis and its clock say, as the grab
			// service decides it.
			if phase, ok := s.snapshot.Phase(s.redisNow); !ok || phase != s.status.Phase {
				t.Errorf("phase %q, but store.Snapshot.Phase says %q (%t)", s.status.Phase, phase, ok)
			}
			if res.requeueAfter != tc.wantRequeue {
				t.Errorf("requeue after %s, want %s", res.requeueAfter, tc.wantRequeue)
			}
			switch {
			case s.status.RefundedAmount != nil:
				t.Errorf("refundedAmount %d in the controller's status: it travels with the other money counters", *s.status.RefundedAmount)
			case tc.wantRefund == nil && s.snapshot.Refunded != 0:
				t.Errorf("refund %d of an open activity", s.snapshot.Refunded)
			case tc.wantRefund != nil && s.snapshot.Refunded != *tc.wantRefund:
				t.Errorf("refund %d, want %d", s.snapshot.Refunded, *tc.wantRefund)
			}
			if tc.wantMessage != "" && s.phaseMessage != tc.wantMessage {
				t.Errorf("phase message %q, want %q", s.phaseMessage, tc.wantMessage)
			}
			if tc.wantClose != "" && p.store.snap.State != store.StateClosed {
				t.Errorf("Redis state %q after closing", p.store.snap.State)
			}
		})
	}
}

// The counters step writes every money counter together, from one snapshot, when the
// grab service's reports cannot be relied on; otherwise it leaves them to the reports.
func TestCountersStep(t *testing.T) {
	conflict := apierrors.NewConflict(schema.GroupResource{Group: "redpacket.io", Resource: "redpacketactivities"}, "quiz", errors.New("conflict"))
	at := func(d time.Duration) *metav1.Time { t := metav1.NewTime(testNow.Add(d)); return &t }
	// The snapshot of every case but the closed ones: 3 of 10 claimed, 250 of 1000.
	claimed := func(s store.Snapshot) store.Snapshot {
		s.ClaimedCount, s.ClaimedAmount, s.RemainingCount = 3, 250, 7
		return s
	}
	closedSnap := claimed(openSnapshot())
	closedSnap.State, closedSnap.CloseReason, closedSnap.Refunded, closedSnap.RemainingCount = store.StateClosed, store.CloseExpired, 750, 0
	fenced := claimed(openSnapshot())
	fenced.Fenced = "rolled_back"
	cases := []struct {
		name       string
		recorded   bool
		snap       store.Snapshot
		status     func(*redpacketv1alpha1.RedPacketActivityStatus)
		err        error
		wantWrite  bool
		wantStatus bool
	}{
		{name: "seeded, recorded, no counters yet: all of them, zeros included", recorded: true, snap: claimed(openSnapshot()), wantWrite: true, wantStatus: true},
		{name: "not recorded yet: nothing", snap: claimed(openSnapshot())},
		{name: "Redis holds nothing: nothing", recorded: true},
		{name: "fenced: nothing", recorded: true, snap: fenced},
		{name: "a replica reports: left to it", recorded: true, snap: claimed(openSnapshot()),
			status: func(st *redpacketv1alpha1.RedPacketActivityStatus) {
				redpacketv1alpha1.SetCounters(st, redpacketv1alpha1.Counters{RemainingCount: 8, RemainingAmount: 900, ClaimedCount: 2, ClaimedAmount: 100})
				st.LastReportTime = at(-2 * time.Second)
			}},
		{name: "no replica reported lately: written", recorded: true, snap: claimed(openSnapshot()), wantWrite: true, wantStatus: true,
			status: func(st *redpacketv1alpha1.RedPacketActivityStatus) {
				redpacketv1alpha1.SetCounters(st, redpacketv1alpha1.Counters{RemainingCount: 8, RemainingAmount: 900, ClaimedCount: 2, ClaimedAmount: 100})
				st.LastReportTime = at(-time.Hour)
			}},
		{name: "closed: the refund arrives with the close, whoever reports", recorded: true, snap: closedSnap, wantWrite: true, wantStatus: true,
			status: func(st *redpacketv1alpha1.RedPacketActivityStatus) {
				redpacketv1alpha1.SetCounters(st, redpacketv1alpha1.Counters{RemainingCount: 7, RemainingAmount: 750, ClaimedCount: 3, ClaimedAmount: 250})
				st.LastReportTime = at(-time.Second)
			}},
		{name: "unchanged: nothing", recorded: true, snap: claimed(openSnapshot()),
			status: func(st *redpacketv1alpha1.RedPacketActivityStatus) {
				redpacketv1alpha1.SetCounters(st, redpacketv1alpha1.Counters{RemainingCount: 7, RemainingAmount: 750, ClaimedCount: 3, ClaimedAmount: 250})
			}},
		{name: "the status moved meanwhile: skipped without error", recorded: true, snap: claimed(openSnapshot()), err: conflict, wantWrite: true},
		{name: "the status is ahead: skipped without error", recorded: true, snap: claimed(openSnapshot()), err: errCountersStale, wantWrite: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			if tc.status != nil {
				tc.status(&a.Status)
			}
			before := a.Status.DeepCopy()
			p := newPhaseTest(t, tc.snap)
			p.status.countersErr = tc.err
			s := p.scope(a)
			s.seededRecorded = tc.recorded
			res, err := p.r.reconcileCounters(context.Background(), s)
			if err != nil || res.halt || res.blocker != nil {
				t.Fatalf("a counters failure must not hold anything up: %+v %v", res, err)
			}
			writes := p.log.with("status.counters")
			if (len(writes) == 1) != tc.wantWrite || len(writes) > 1 {
				t.Fatalf("counter writes %q, want one: %t", writes, tc.wantWrite)
			}
			if tc.wantWrite && tc.err == nil {
				got := p.status.counters[0]
				if got != tc.snap.Counters() {
					t.Errorf("counters %+v, want the snapshot's %+v", got, tc.snap.Counters())
				}
				if got.ClaimedAmount+got.RemainingAmount+got.RefundedAmount != a.Spec.TotalAmount {
					t.Errorf("counters %+v do not add up to the total %d", got, a.Spec.TotalAmount)
				}
			}
			switch {
			case tc.wantStatus:
				if c, _ := redpacketv1alpha1.RecordedCounters(&a.Status); c != tc.snap.Counters() || a.Status.RefundedAmount == nil || a.Status.SettledCount == nil {
					t.Errorf("scope's activity status counters %+v, want every one of %+v", c, tc.snap.Counters())
				}
			case !equality.Semantic.DeepEqual(before, &a.Status):
				t.Errorf("the scope's activity status changed although nothing was written")
			}
		})
	}
}

// The chain of steps: a blocker makes Ready False, a halt or an error stops the
// chain, the soonest requeue wins, and only a chain that ran to its end is clean.
func TestRunSteps(t *testing.T) {
	step := func(name string, res stepResult, err error) reconcileStep {
		return reconcileStep{name: name, run: func(_ context.Context, s *activityScope) (stepResult, error) {
			s.phaseMessage += name
			return res, err
		}}
	}
	cases := []struct {
		name        string
		steps       []reconcileStep
		wantRan     string
		wantRequeue time.Duration
		wantErr     string
		wantHalted  bool
		wantBlocker string
	}{
		{
			name:    "every step runs; the soonest requeue wins",
			steps:   []reconcileStep{step("a", stepResult{requeueAfter: time.Minute}, nil), step("b", stepResult{}, nil), step("c", stepResult{requeueAfter: time.Second}, nil)},
			wantRan: "abc", wantRequeue: time.Second,
		},
		{
			name: "a halt stops the chain, with its blocker and requeue",
			steps: []reconcileStep{
				step("a", stepResult{requeueAfter: time.Hour}, nil),
				step("b", stepResult{halt: true, requeueAfter: time.Minute, blocker: notReady("DataLost", "gone")}, nil),
				step("c", stepResult{}, nil),
			},
			wantRan: "ab", wantRequeue: time.Minute, wantHalted: true, wantBlocker: "DataLost",
		},
		{
			name: "a keepGoing step's error does not stop the chain; it is returned at the end",
			steps: []reconcileStep{
				step("a", stepResult{}, nil),
				{name: "b", keepGoing: true, run: func(_ context.Context, s *activityScope) (stepResult, error) {
					s.phaseMessage += "b"
					return stepResult{blocker: notReady("WorkloadFailed", "quota")}, errRedisDown
				}},
				step("c", stepResult{requeueAfter: time.Second}, nil),
			},
			wantRan: "abc", wantErr: "b: " + errRedisDown.Error(), wantBlocker: "WorkloadFailed",
		},
		{
			name: "a keepGoing step's halt does not stop the chain; the reconcile is not clean",
			steps: []reconcileStep{
				{name: "a", keepGoing: true, run: func(_ context.Context, s *activityScope) (stepResult, error) {
					s.phaseMessage += "a"
					return blocked("GrabImageNotAllowed", "no"), nil
				}},
				step("b", stepResult{requeueAfter: time.Second}, nil),
			},
			wantRan: "ab", wantRequeue: time.Second, wantHalted: true, wantBlocker: "GrabImageNotAllowed",
		},
		{
			name:    "an error stops the chain, named by its step; the blocker still counts",
			steps:   []reconcileStep{step("a", stepResult{}, nil), step("b", stepResult{blocker: notReady("RedisUnavailable", "down")}, errRedisDown), step("c", stepResult{}, nil)},
			wantRan: "ab", wantErr: "b: " + errRedisDown.Error(), wantBlocker: "RedisUnavailable",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newActivityScope(testActivity(), testNow)
			res, err := runSteps(context.Background(), s, tc.steps)
			if tc.wantErr != "" {
				if err == nil || err.Error() != tc.wantErr {
					t.Errorf("error %v, want %q", err, tc.wantErr)
				}
			} else if err != nil || res.RequeueAfter != tc.wantRequeue {
				t.Errorf("result %+v %v, want requeue %s", res, err, tc.wantRequeue)
			}
			if s.phaseMessage != tc.wantRan {
				t.Errorf("steps run %q, want %q", s.phaseMessage, tc.wantRan)
			}
			if s.halted != tc.wantHalted {
				t.Errorf("halted %t, want %t", s.halted, tc.wantHalted)
			}
			if got := ""; s.notReady != nil {
				got = s.notReady.reason
				if got != tc.wantBlocker {
					t.Errorf("blocker %q, want %q", got, tc.wantBlocker)
				}
			} else if tc.wantBlocker != "" {
				t.Errorf("no blocker, want %q", tc.wantBlocker)
			}
		})
	}
}

// The steps of a normal reconcile are in the order the seeding guarantee needs: the
// gate only after the seed step, the schedule after the gate.
func TestNormalStepsOrder(t *testing.T) {
	p := newPhaseTest(t, store.Snapshot{})
	var names []string
	for _, s := range p.r.normalSteps(p.r.patchStatusNow) {
		names = append(names, s.name)
	}
	want := []string{"redis connection", "rollback fence", "validate and split", "seed", "load scripts", "durability", "open and configure",
		"grab workload ownership", "redis user", "grab workload", "grab autoscaler", "expose", "schedule and close", "counters", "settlement", "conservation"}
	if !slices.Equal(names, want) {
		t.Errorf("steps %q, want %q", names, want)
	}
}
