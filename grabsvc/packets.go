package grabsvc

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"

	"redpacket.io/operator/grabsvc/grabapi"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
)

// Outcomes of the runtime packet API that the activity's grab API does not have.
const (
	// OutcomeExpired answers a grab of a packet whose time is up.
	OutcomeExpired = string(store.PacketExpired)
	// OutcomeNotFound answers a grab or a read of a packet that does not exist (never
	// created, or forgotten once its refund settled).
	OutcomeNotFound = "not_found"
)

// Budget is the RedPacketBudget a PacketServer serves: how user tokens name it, and
// its Redis keyspace (store.NewBudget).
type Budget struct {
	// Namespace and Name name the budget; user tokens carry "<namespace>/<name>".
	Namespace, Name string
	// UID is the budget's metadata.uid: the tag of its keys and the audience of its
	// user tokens.
	UID types.UID
	// Shards is spec.budgetShards, immutable: which shard holds a packet depends on it.
	Shards int
}

// Ref is "<namespace>/<name>".
func (b Budget) Ref() string { return b.Namespace + "/" + b.Name }

// PacketConfig is what a PacketServer needs.
type PacketConfig struct {
	// Budget is the budget served.
	Budget Budget
	// Redis runs the budget's functions (store.Budget): the auto-pipeliner of the
	// budget's Redis (redisconn.PipelinedClient.Pipeliner), or any client that reaches
	// every shard's slot.
	Redis redis.Cmdable
	// Ping, when set, is the client /readyz pings; the plain client under the
	// auto-pipeliner.
	Ping redis.Cmdable
	// Sender is the credential POST /v1/packets requires. nil refuses every creation
	// with 503 and fails /readyz: the service fails closed.
	Sender *SenderCredential
	// Tokens, when set, requires a user token for the budget (or the packet) on every
	// grab, and on every read of a packet's detail a token for the budget or that
	// packet, or the sender credential; nil grabs and reads without tokens. The
	// operator sets it exactly for a budget with spec.grabService.auth.
	Tokens *TokenVerifier
	// UserLimiter limits grabs per user id, ClientLimiter grabs and reads per client
	// address (creation is the sender's and is not limited per address); nil means
	// no limit.
	UserLimiter, ClientLimiter *KeyedLimiter
	// RedisTimeout bounds every Redis call; 0 means DefaultRedisTimeout.
	RedisTimeout time.Duration
	// Metrics receives the measurements; nil means a private registry.
	Metrics *PacketMetrics
	// Gatherer serves /metrics; nil means no /metrics endpoint.
	Gatherer prometheus.Gatherer
	// Log receives unexpected errors; nil means slog.Default().
	Log *slog.Logger
	// Page serves the packet page (package web) at /p/{id}, /packet.css and /packet.js.
	Page bool
	// ClaimSecret requires each packet's claim secret (ClaimSecretHeader) on its
	// grabs and on reads of it by anyone but the sender (spec.packets.claimSecret);
	// a creation's answer carries it. It needs Sender.
	ClaimSecret bool
	// SendWindows are when new packets may be created (spec.packets.sendWindows);
	// the zero value allows every instant. They are read on Now.
	SendWindows SendWindows
	// Quotas are the budget's per-sender and per-recipient quotas
	// (spec.packets.quotas), counted in Redis on the service's clock (Now) in
	// TimeZone; the zero value counts nothing.
	Quotas store.Quotas
	// TimeZone is the budget's time zone (spec.packets.timeZone), whose calendar
	// day the daily quotas count; nil means UTC.
	TimeZone *time.Location
	// OneServer says every budget shard is on one Redis server (a standalone
	// connection, never a cluster): each quota is then counted inside the create or
	// grab function, in one step, whatever shard holds the person's counters
	// (store.Budget.OnOneServer).
	OneServer bool
	// Now is the service's clock; nil means time.Now.
	Now func() time.Time
}

// PacketServer serves the runtime packet API of one budget: creation by the sender's
// backend, grabs and the detail list by the group, and the packet page. Every check
// that can refuse a request (method, credential, body, ids, tokens, rate limits) runs
// before Redis is touched, so a refused request has no Redis effect; every decision
// is one atomic function call on the packet's budget shard (store.Budget).
type PacketServer struct {
	cfg    PacketConfig
	budget *store.Budget
	// ping is the budget's handle on cfg.Ping (nil without one), for /readyz.
	ping     *store.Budget
	aud      BudgetAudience
	timeout  time.Duration
	metrics  *PacketMetrics
	log      *slog.Logger
	draining atomic.Bool
	mux      *http.ServeMux
}

// NewPacketServer returns a server for cfg.
func NewPacketServer(cfg PacketConfig) (*PacketServer, error) {
	if cfg.Redis == nil {
		return nil, errors.New("packet server: no redis client")
	}
	if cfg.Budget.UID == "" || cfg.Budget.Name == "" {
		return nil, errors.New("packet server: the budget's name and UID are required")
	}
	if cfg.ClaimSecret && cfg.Sender == nil {
		return nil, errors.New("packet server: claim secrets need the sender credential")
	}
	if cfg.Budget.Shards < 1 || cfg.Budget.Shards > store.MaxBudgetShards {
		return nil, fmt.Errorf("packet server: %d budget shards is outside [1, %d]", cfg.Budget.Shards, store.MaxBudgetShards)
	}
	s := &PacketServer{
		cfg:     cfg,
		budget:  newBudgetHandle(cfg),
		aud:     BudgetAudience{Budget: cfg.Budget.Ref(), UID: cfg.Budget.UID},
		timeout: cfg.RedisTimeout,
		metrics: cfg.Metrics,
		log:     cfg.Log,
	}
	if cfg.Ping != nil {
		s.ping = store.NewBudget(cfg.Ping, string(cfg.Budget.UID), cfg.Budget.Shards)
	}
	if s.timeout <= 0 {
		s.timeout = DefaultRedisTimeout
	}
	if s.metrics == nil {
		s.metrics = NewPacketMetrics(prometheus.NewRegistry())
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	s.mux = http.NewServeMux()
	s.mux.HandleFunc("/v1/packets", s.handleCreate)
	s.mux.HandleFunc("/v1/packets/{id}", s.handleDetail)
	s.mux.HandleFunc("/v1/packets/{id}/grab", s.handleGrab)
	s.mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	s.mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		if ok, why := s.Ready(r.Context()); !ok {
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "not ready", "reason": why})
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
	})
	var page func(*http.ServeMux) error
	if cfg.Page {
		page = registerPacketPage
	}
	if err := finishMux(s.mux, cfg.Gatherer, page); err != nil {
		return nil, err
	}
	return s, nil
}

// newBudgetHandle is the budget's handle on cfg.Redis.
func newBudgetHandle(cfg PacketConfig) *store.Budget {
	b := store.NewBudget(cfg.Redis, string(cfg.Budget.UID), cfg.Budget.Shards)
	if cfg.OneServer {
		b.OnOneServer()
	}
	return b
}

// Handler is the server's HTTP handler.
func (s *PacketServer) Handler() http.Handler { return s.mux }

// Metrics are the server's metrics.
func (s *PacketServer) Metrics() *PacketMetrics { return s.metrics }

// SetDraining makes readiness fail from now on; requests are still served.
func (s *PacketServer) SetDraining() { s.draining.Store(true) }

// Ready reports whether the server should receive traffic: it is not draining, it
// holds a sender credential (else it could create nothing), and Redis answers a ping
// within the Redis deadline.
func (s *PacketServer) Ready(ctx context.Context) (bool, string) {
	if s.draining.Load() {
		return false, "shutting down"
	}
	if s.cfg.Sender == nil {
		return false, "this grab service has no sender credential (--sender-token-file), so it can create no packet"
	}
	if s.ping != nil {
		if _, err := callWithDeadline(ctx, s.timeout, func(ctx context.Context) (struct{}, error) {
			return struct{}{}, s.ping.Ping(ctx)
		}); err != nil {
			return false, "redis does not answer"
		}
	}
	return true, ""
}

// packetStatus is the HTTP status of each creation outcome. budget_exhausted is a
// conflict with the budget's state (a refill, or packets expiring, can change the
// answer); limit_exceeded is a well-formed request the budget's rules refuse.
var packetStatus = map[store.CreateOutcome]int{
	store.CreateCreated:         http.StatusCreated,
	store.CreateExisting:        http.StatusOK,
	store.CreateConflict:        http.StatusConflict,
	store.CreateBudgetExhausted: http.StatusConflict,
	store.CreateLimitExceeded:   http.StatusUnprocessableEntity,
	store.CreateInvalid:         http.StatusBadRequest,
	store.CreateClosed:          http.StatusGone,
}

// createMessages say what a refusal from Redis means.
var createMessages = map[store.CreateOutcome]string{
	store.CreateConflict:        "a packet with this id exists with another body; an id stands for one packet (send the same body to read it back)",
	store.CreateBudgetExhausted: "the budget has not enough money available for this packet; nothing was drawn",
	store.CreateLimitExceeded:   "the packet is outside the budget's limits (spec.packets: maxTotal, maxCount, minShare, distributions, maxTTL); nothing was drawn",
	store.CreateInvalid:         "the packet cannot be split as asked; nothing was drawn",
	store.CreateClosed:          "the budget is being deleted and takes no new packets",
}

// fencedMessage is the 503 message of a creation or grab on a fenced budget
// (store.ErrBudgetFenced): the fence's reason and what did not happen.
func fencedMessage(err error, nothing string) string {
	reason := "fenced"
	if fe := (*store.FencedError)(nil); errors.As(err, &fe) {
		reason = fe.Reason
	}
	return fmt.Sprintf("the budget's Redis lost or rolled back its data (%s), and the operator fenced it: %s, and nothing will be until the platform team decides", reason, nothing)
}

// handleCreate is POST /v1/packets: the sender's credential, then the body, then one
// atomic creation on the packet's shard.
func (s *PacketServer) handleCreate(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet {
		s.handleList(w, r)
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", "GET, POST")
		s.refuseCreate(w, http.StatusMethodNotAllowed, OutcomeInvalidRequest, "use POST on /v1/packets to create, GET to list")
		return
	}
	if s.cfg.Sender == nil {
		s.refuseCreate(w, http.StatusServiceUnavailable, OutcomeUnavailable,
			"this grab service has no sender credential (--sender-token-file); it creates nothing until restarted with one")
		return
	}
	if err := s.cfg.Sender.Check(r.Header.Get("Authorization")); err != nil {
		w.Header().Set("WWW-Authenticate", `Bearer realm="packets"`)
		s.refuseCreate(w, http.StatusUnauthorized, OutcomeUnauthorized, err.Error())
		return
	}
	body, status, msg := readLimitedBody(w, r)
	if msg != "" {
		s.refuseCreate(w, status, OutcomeInvalidRequest, msg)
		return
	}
	p, msg := ParseCreatePacket(body)
	if msg != "" {
		s.refuseCreate(w, http.StatusBadRequest, OutcomeInvalidRequest, msg)
		return
	}
	if !s.insideSendWindow(w, r, p.ID) {
		return
	}
	var quotaAt store.QuotaTime
	if s.cfg.Quotas.Sender() {
		quotaAt = s.budget.QuotaTimeAt(s.now(), s.cfg.TimeZone)
		p.Quota = &store.QuotaCheck{Limits: s.cfg.Quotas, At: quotaAt}
	}
	start := time.Now()
	res, err := callWithDeadline(r.Context(), s.timeout, func(ctx context.Context) (store.CreateResult, error) {
		return s.budget.Create(ctx, p)
	})
	s.metrics.RedisDuration.WithLabelValues("create").Observe(time.Since(start).Seconds())
	if err != nil {
		s.metrics.RedisErrors.WithLabelValues("create").Inc()
		if errors.Is(err, store.ErrBudgetClosed) {
			s.refuseCreate(w, http.StatusGone, string(store.CreateClosed), createMessages[store.CreateClosed])
			return
		}
		if errors.Is(err, store.ErrBudgetFenced) {
			s.refuseCreate(w, http.StatusServiceUnavailable, OutcomeUnavailable, fencedMessage(err, "nothing was created"))
			return
		}
		s.refuseCreate(w, http.StatusServiceUnavailable, OutcomeUnavailable, unavailableMessage(err,
			"nothing was created unless a retry with the same id and body answers 200"))
		return
	}
	if res.Outcome == store.CreateQuotaExceeded && res.Quota != nil {
		s.refuseQuota(w, res.Quota, quotaAt, nil)
		return
	}
	code, known := packetStatus[res.Outcome]
	if !known {
		s.log.Error("the create function returned an unknown outcome", "outcome", string(res.Outcome), "packet", p.ID)
		s.refuseCreate(w, http.StatusServiceUnavailable, OutcomeUnavailable, "the packet store gave an unexpected answer")
		return
	}
	s.metrics.countCreate(string(res.Outcome))
	if res.Outcome != store.CreateCreated && res.Outcome != store.CreateExisting {
		msg := createMessages[res.Outcome]
		if res.Reason != "" {
			msg += ": " + res.Reason
		}
		writeJSON(w, code, apiError{Error: string(res.Outcome), Message: msg})
		return
	}
	if res.Outcome == store.CreateCreated {
		s.metrics.CreatedAmount.Add(float64(p.Total))
	}
	v := NewPacketView(res.Packet, time.Now())
	v.Outcome = string(res.Outcome)
	if s.cfg.ClaimSecret {
		v.ClaimSecret = s.cfg.Sender.ClaimSecret(string(s.cfg.Budget.UID), p.ID)
	}
	writeJSON(w, code, v)
}

// OutcomeOutsideSendWindow refuses a creation outside the budget's send windows.
const OutcomeOutsideSendWindow = "outside_send_window"

// insideSendWindow answers a creation outside the budget's send windows, 403
// outside_send_window with Retry-After to the next window, and reports whether the
// creation may go on. Outside a window it asks Redis only whether the id already
// names a packet: a merchant's retry of a packet created inside the window, or a
// tombstone's id, goes on to the create function, which answers existing or
// conflict and creates nothing; an id that names no packet is refused without
// touching Redis further. The window is read on the service's clock (Now).
func (s *PacketServer) insideSendWindow(w http.ResponseWriter, r *http.Request, id string) bool {
	now := s.now()
	ok, opens := s.cfg.SendWindows.Allows(now)
	if ok {
		return true
	}
	exists, err := callWithDeadline(r.Context(), s.timeout, func(ctx context.Context) (bool, error) {
		_, found, err := s.budget.Packet(ctx, id)
		return found, err
	})
	switch {
	case err != nil:
		s.metrics.RedisErrors.WithLabelValues("create").Inc()
		s.refuseCreate(w, http.StatusServiceUnavailable, OutcomeUnavailable, unavailableMessage(err, "nothing was created"))
		return false
	case exists:
		return true
	}
	if broken := s.cfg.SendWindows.broken; broken != nil {
		s.refuseCreate(w, http.StatusServiceUnavailable, OutcomeUnavailable, fmt.Sprintf(
			"the budget's send windows cannot be read (%v): nothing is created until spec.packets is fixed", broken))
		return false
	}
	s.metrics.countCreate(OutcomeOutsideSendWindow)
	w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds(opens.Sub(now))))
	writeJSON(w, http.StatusForbidden, apiError{Error: OutcomeOutsideSendWindow, Message: fmt.Sprintf(
		"rule sendWindows: packets are created %s; the next window opens at %s; nothing was created",
		s.cfg.SendWindows, opens.Format(time.RFC3339))})
	return false
}

// OutcomeQuotaExceeded refuses a creation or a grab that one of the budget's
// quotas (spec.packets.quotas) does not allow; the body's rule names it.
const OutcomeQuotaExceeded = string(store.CreateQuotaExceeded)

// quotaRules are the spec's names of the quota rules, as a refusal's rule field
// gives them.
var quotaRules = map[string]string{
	store.RulePacketsPerMinute: "perSender.packetsPerMinute",
	store.RulePacketsPerDay:    "perSender.packetsPerDay",
	store.RuleAmountPerDay:     "perSender.amountPerDay",
	store.RuleSharesPerDay:     "perRecipient.sharesPerDay",
}

// refuseQuota answers a creation (packetID nil) or a grab of packetID that the
// quota q refused at the quota time at: 429 for the per-minute rate, with
// Retry-After to the next minute, and 403 for a daily quota, with Retry-After to
// the next day in the budget's time zone. The body is the refusal's usual one with
// the rule named, error (or outcome) quota_exceeded. Nothing was written.
func (s *PacketServer) refuseQuota(w http.ResponseWriter, q *store.QuotaRefusal, at store.QuotaTime, packetID *string) {
	rule := quotaRules[q.Rule]
	if rule == "" {
		rule = q.Rule
	}
	status, until, per := http.StatusForbidden, at.DayEnd, "today"
	if q.Rule == store.RulePacketsPerMinute {
		status, until, per = http.StatusTooManyRequests, at.MinuteEnd(), "this minute"
	}
	w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds(until.Sub(s.now()))))
	if packetID != nil {
		s.metrics.countGrab(OutcomeQuotaExceeded)
		writeJSON(w, status, packetGrabResponse{Outcome: OutcomeQuotaExceeded, PacketID: *packetID, Rule: rule, Error: fmt.Sprintf(
			"rule quotas.%s: this user was granted the budget's limit of %d shares %s; it resets at %s; nothing was granted",
			rule, q.Limit, per, until.Format(time.RFC3339))})
		return
	}
	what := map[string]string{store.RulePacketsPerMinute: "packets", store.RulePacketsPerDay: "packets",
		store.RuleAmountPerDay: "minor units of money in packets"}[q.Rule]
	s.metrics.countCreate(OutcomeQuotaExceeded)
	writeJSON(w, status, apiError{Error: OutcomeQuotaExceeded, Rule: rule, Message: fmt.Sprintf(
		"rule quotas.%s: this sender reached the budget's limit of %d %s %s; it resets at %s; nothing was created",
		rule, q.Limit, what, per, until.In(at.DayEnd.Location()).Format(time.RFC3339))})
}

// now is the service's clock.
func (s *PacketServer) now() time.Time {
	if s.cfg.Now != nil {
		return s.cfg.Now()
	}
	return time.Now()
}

// MaxListedPackets is the most live packets one GET /v1/packets lists.
const MaxListedPackets = 100

// handleList is GET /v1/packets?limit=N: at most N (1..100, default 20) live packets,
// soonest expiry first, for the budget's operators (kubectl rpa packets). It needs
// the sender credential: the list names every live packet and its sender, which a
// group member who knows one packet's id has no business reading. It asks each
// budget shard for its N soonest, so one call costs N shards' bounded reads.
func (s *PacketServer) handleList(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Sender == nil {
		s.refuseDetail(w, http.StatusServiceUnavailable, OutcomeUnavailable,
			"this grab service has no sender credential (--sender-token-file); it lists nothing until restarted with one")
		return
	}
	if err := s.cfg.Sender.Check(r.Header.Get("Authorization")); err != nil {
		w.Header().Set("WWW-Authenticate", `Bearer realm="packets"`)
		s.refuseDetail(w, http.StatusUnauthorized, OutcomeUnauthorized, err.Error())
		return
	}
	limit := 20
	if v := r.URL.Query().Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > MaxListedPackets {
			s.refuseDetail(w, http.StatusBadRequest, OutcomeInvalidRequest,
				fmt.Sprintf("limit must be an integer from 1 to %d", MaxListedPackets))
			return
		}
		limit = n
	}
	start := time.Now()
	live, err := callWithDeadline(r.Context(), s.timeout, func(ctx context.Context) ([]store.PacketDetail, error) {
		var all []store.PacketDetail
		for i := range s.budget.N() {
			l, err := s.budget.LivePackets(ctx, i, limit)
			if err != nil {
				return nil, err
			}
			all = append(all, l...)
		}
		return all, nil
	})
	s.metrics.RedisDuration.WithLabelValues("list").Observe(time.Since(start).Seconds())
	if err != nil {
		s.metrics.RedisErrors.WithLabelValues("list").Inc()
		s.refuseDetail(w, http.StatusServiceUnavailable, OutcomeUnavailable, unavailableMessage(err, "retry later"))
		return
	}
	slices.SortFunc(live, func(a, b store.PacketDetail) int {
		if c := a.ExpiresAt.Compare(b.ExpiresAt); c != 0 {
			return c
		}
		return strings.Compare(a.ID, b.ID)
	})
	out := struct {
		Packets []PacketView `json:"packets"`
	}{Packets: []PacketView{}}
	for _, d := range live[:min(limit, len(live))] {
		out.Packets = append(out.Packets, NewPacketView(d, start))
	}
	writeJSON(w, http.StatusOK, out)
}

// handleGrab is POST /v1/packets/{id}/grab: one user's grab of one packet, with the
// shape of POST /v1/grab's answers plus the share (the 0-based grab order).
func (s *PacketServer) handleGrab(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		s.refuseGrab(w, http.StatusMethodNotAllowed, OutcomeInvalidRequest, "use POST on /v1/packets/{id}/grab")
		return
	}
	now := time.Now()
	if ok, wait := s.cfg.ClientLimiter.Allow(clientAddr(r), now); !ok {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds(wait)))
		s.refuseGrab(w, http.StatusTooManyRequests, OutcomeRateLimited, "too many requests from this client; retry later")
		return
	}
	packetID := r.PathValue("id")
	if msg := CheckPacketID(packetID); msg != "" {
		s.refuseGrab(w, http.StatusBadRequest, OutcomeInvalidRequest, "the packet id in the path: "+msg)
		return
	}
	userID, status, msg := readGrabRequest(w, r)
	if msg != "" {
		s.refuseGrab(w, status, OutcomeInvalidRequest, msg)
		return
	}
	if !s.claimSecretPresented(r, packetID) {
		// The answer of a packet that does not exist, decided before Redis: a wrong
		// secret tells nothing of the id.
		s.metrics.countGrab(OutcomeNotFound)
		writeJSON(w, http.StatusNotFound, packetGrabResponse{Outcome: OutcomeNotFound, PacketID: packetID,
			Error: "no packet with this id: never created, or expired and settled"})
		return
	}
	if s.cfg.Tokens != nil {
		if err := s.cfg.Tokens.VerifyPacket(r.Header.Get("Authorization"), s.aud, packetID, userID); err != nil {
			w.Header().Set("WWW-Authenticate", `Bearer realm="grab"`)
			s.refuseGrab(w, http.StatusUnauthorized, OutcomeUnauthorized, err.Error())
			return
		}
	}
	if ok, wait := s.cfg.UserLimiter.Allow(userID, now); !ok {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds(wait)))
		s.refuseGrab(w, http.StatusTooManyRequests, OutcomeRateLimited, "too many grabs for this user; retry later")
		return
	}
	var quota *store.QuotaCheck
	if s.cfg.Quotas.SharesPerDay > 0 {
		quota = &store.QuotaCheck{Limits: s.cfg.Quotas, At: s.budget.QuotaTimeAt(s.now(), s.cfg.TimeZone)}
	}
	start := time.Now()
	g, err := callWithDeadline(r.Context(), s.timeout, func(ctx context.Context) (store.PacketGrab, error) {
		return s.budget.GrabPacketWithin(ctx, packetID, userID, quota)
	})
	s.metrics.RedisDuration.WithLabelValues("grab").Observe(time.Since(start).Seconds())
	if err != nil {
		if errors.Is(err, store.ErrBudgetFenced) {
			s.refuseGrab(w, http.StatusServiceUnavailable, OutcomeUnavailable, fencedMessage(err, "nothing was granted"))
			return
		}
		s.metrics.RedisErrors.WithLabelValues("grab").Inc()
		s.refuseGrab(w, http.StatusServiceUnavailable, OutcomeUnavailable, unavailableMessage(err,
			"nothing was granted unless a retry says already_claimed"))
		return
	}
	switch g.Outcome {
	case store.PacketGranted, store.PacketAlreadyClaimed:
		s.metrics.countGrab(string(g.Outcome))
		if g.Outcome == store.PacketGranted {
			s.metrics.GrantedAmount.Add(float64(g.Amount))
		}
		share, amount := g.Share, g.Amount
		writeJSON(w, http.StatusOK, packetGrabResponse{Outcome: string(g.Outcome), PacketID: packetID, Share: &share, Amount: &amount})
	case store.PacketSoldOut, store.PacketExpired:
		s.metrics.countGrab(string(g.Outcome))
		writeJSON(w, http.StatusConflict, packetGrabResponse{Outcome: string(g.Outcome), PacketID: packetID})
	case store.PacketQuotaExceeded:
		if g.Quota == nil || quota == nil {
			s.refuseGrab(w, http.StatusServiceUnavailable, OutcomeUnavailable, "the packet store gave an unexpected answer")
			return
		}
		s.refuseQuota(w, g.Quota, quota.At, &packetID)
	case store.PacketMissing:
		s.metrics.countGrab(OutcomeNotFound)
		writeJSON(w, http.StatusNotFound, packetGrabResponse{Outcome: OutcomeNotFound, PacketID: packetID,
			Error: "no packet with this id: never created, or expired and settled"})
	default:
		s.log.Error("the grab function returned an unknown outcome", "outcome", string(g.Outcome), "packet", packetID)
		s.refuseGrab(w, http.StatusServiceUnavailable, OutcomeUnavailable, "the packet store gave an unexpected answer")
	}
}

// handleDetail is GET /v1/packets/{id}: the packet, its remaining count and amount,
// and who got what in grab order, read in one step. With user tokens on, the read
// needs a credential (authorizeRead), checked before Redis is touched: an
// unauthorized read of a packet that exists and of one that never did get the same
// 401, so ids cannot be probed.
func (s *PacketServer) handleDetail(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		s.refuseDetail(w, http.StatusMethodNotAllowed, OutcomeInvalidRequest, "use GET on /v1/packets/{id}")
		return
	}
	if ok, wait := s.cfg.ClientLimiter.Allow(clientAddr(r), time.Now()); !ok {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds(wait)))
		s.refuseDetail(w, http.StatusTooManyRequests, OutcomeRateLimited, "too many requests from this client; retry later")
		return
	}
	packetID := r.PathValue("id")
	if msg := CheckPacketID(packetID); msg != "" {
		s.refuseDetail(w, http.StatusBadRequest, OutcomeInvalidRequest, "the packet id in the path: "+msg)
		return
	}
	if err := s.authorizeRead(r.Header.Get("Authorization"), packetID); err != nil {
		w.Header().Set("WWW-Authenticate", `Bearer realm="packets"`)
		s.refuseDetail(w, http.StatusUnauthorized, OutcomeUnauthorized, err.Error())
		return
	}
	if !s.claimSecretPresented(r, packetID) && (s.cfg.Sender == nil || s.cfg.Sender.Check(r.Header.Get("Authorization")) != nil) {
		s.refuseDetail(w, http.StatusNotFound, OutcomeNotFound, "no packet with this id: never created, or expired and settled")
		return
	}
	type found struct {
		d  store.PacketDetail
		ok bool
	}
	start := time.Now()
	res, err := callWithDeadline(r.Context(), s.timeout, func(ctx context.Context) (found, error) {
		d, ok, err := s.budget.Packet(ctx, packetID)
		return found{d, ok}, err
	})
	s.metrics.RedisDuration.WithLabelValues("detail").Observe(time.Since(start).Seconds())
	if err != nil {
		s.metrics.RedisErrors.WithLabelValues("detail").Inc()
		s.refuseDetail(w, http.StatusServiceUnavailable, OutcomeUnavailable, unavailableMessage(err, "retry later"))
		return
	}
	if !res.ok {
		s.refuseDetail(w, http.StatusNotFound, OutcomeNotFound, "no packet with this id: never created, or expired and settled")
		return
	}
	s.metrics.countDetail("ok")
	writeJSON(w, http.StatusOK, NewPacketDetailView(res.d, time.Now()))
}

// ErrPacketRead answers a read of a packet, with user tokens on, that carries neither
// the sender credential nor a user token good for a grab of this packet; the token's
// own fault follows it in the message.
var ErrPacketRead = errors.New("reading a packet of this budget needs a bearer token: a user token for the budget " +
	"or for this packet (any user's), or the budget's sender credential")

// authorizeRead decides whether the Authorization header value authorization may read
// the packet packetID. Without user tokens (the budget has no spec.grabService.auth)
// every read may, as before. With them, the sender credential may (the sender's
// backend and kubectl rpa read what they created), and so may any user token that
// VerifyPacketRead accepts: the token that grabs the packet also reads it. It decides
// without Redis, so the answer cannot depend on whether the packet exists.
func (s *PacketServer) authorizeRead(authorization, packetID string) error {
	if s.cfg.Tokens == nil {
		return nil
	}
	if s.cfg.Sender != nil && s.cfg.Sender.Check(authorization) == nil {
		return nil
	}
	if err := s.cfg.Tokens.VerifyPacketRead(authorization, s.aud, packetID); err != nil {
		return fmt.Errorf("%w: %w", ErrPacketRead, err)
	}
	return nil
}

// claimSecretPresented reports whether the request may touch packetID as far as
// claim secrets go: always without ClaimSecret, else when it carries the packet's
// secret (compared in constant time).
func (s *PacketServer) claimSecretPresented(r *http.Request, packetID string) bool {
	if !s.cfg.ClaimSecret {
		return true
	}
	return s.cfg.Sender != nil && s.cfg.Sender.checkClaimSecret(string(s.cfg.Budget.UID), packetID, r.Header.Get(ClaimSecretHeader))
}

// unavailableMessage says why Redis could not decide, and what a retry does.
func unavailableMessage(err error, retry string) string {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return "the packet store did not answer in time; " + retry
	case errors.Is(err, store.ErrFunctionMissing):
		return "the packet store lost its functions and the operator is loading them again; " + retry
	default:
		return "the packet store is unavailable; " + retry
	}
}

// apiError is the body of every refusal of POST /v1/packets and GET /v1/packets/{id}:
// a code programs switch on, and a sentence for people.
type apiError struct {
	Error string `json:"error"`
	// Rule names the budget's rule that refused (quota_exceeded).
	Rule    string `json:"rule,omitempty"`
	Message string `json:"message"`
}

func (s *PacketServer) refuseCreate(w http.ResponseWriter, status int, code, msg string) {
	s.metrics.countCreate(code)
	writeJSON(w, status, apiError{Error: code, Message: msg})
}

func (s *PacketServer) refuseDetail(w http.ResponseWriter, status int, code, msg string) {
	s.metrics.countDetail(code)
	writeJSON(w, status, apiError{Error: code, Message: msg})
}

func (s *PacketServer) refuseGrab(w http.ResponseWriter, status int, outcome, msg string) {
	s.metrics.countGrab(outcome)
	writeJSON(w, status, packetGrabResponse{Outcome: outcome, Error: msg})
}

// packetGrabResponse is the body of every POST /v1/packets/{id}/grab answer.
type packetGrabResponse struct {
	Outcome  string `json:"outcome"`
	PacketID string `json:"packetId,omitempty"`
	// Share is the 0-based grab order of the user's share in the packet.
	Share  *int   `json:"share,omitempty"`
	Amount *int64 `json:"amount,omitempty"`
	// Rule names the budget's rule that refused (quota_exceeded).
	Rule  string `json:"rule,omitempty"`
	Error string `json:"error,omitempty"`
}

// PacketView is a packet as POST /v1/packets answers it (grabapi.PacketView).
type PacketView = grabapi.PacketView

// PacketShareView is one granted share, in grab order.
type PacketShareView = grabapi.PacketShareView

// PacketDetailView is GET /v1/packets/{id}: the packet and its detail list.
type PacketDetailView = grabapi.PacketDetailView

// timeMillis is RFC 3339 in UTC with milliseconds.
const timeMillis = "2006-01-02T15:04:05.000Z07:00"

func formatPacketTime(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(timeMillis)
}

// NewPacketView is the view of d without its grabs, its state as of now.
func NewPacketView(d store.PacketDetail, now time.Time) PacketView {
	v := PacketView{
		ID: d.ID, Sender: d.Sender, Currency: d.Currency, Distribution: d.Distribution,
		TotalAmount: d.Total, Count: d.Count, RemainingAmount: d.RemainingAmount, RemainingCount: d.RemainingCount,
		CreatedAt: formatPacketTime(d.CreatedAt), ExpiresAt: formatPacketTime(d.ExpiresAt), Expired: d.Expired,
		Forgotten: d.Forgotten, State: PacketState(d, now),
	}
	switch v.State {
	case grabapi.PacketExhausted:
		if n := len(d.Grabs); n > 0 && int64(n) == d.Count {
			v.ExhaustedAt = formatPacketTime(d.Grabs[n-1].At)
		}
	case grabapi.PacketExpired, grabapi.PacketRefunding, grabapi.PacketRefunded:
		refund := d.RemainingAmount
		v.RefundAmount = &refund
		if v.State == grabapi.PacketRefunded {
			v.RefundedAt = formatPacketTime(d.ForgottenAt)
		}
	}
	return v
}

// PacketState is d's lifecycle state as of now (grabapi.Packet*), from what its
// hash or tombstone records:
//
//   - refunded: forgotten with money refunded (settlement forgets a packet once the
//     balance system acknowledged its refund);
//   - exhausted: every share grabbed, nothing to refund (also once forgotten);
//   - refunding: the operator's expiry moved the remainder to the refund, which
//     settlement is delivering;
//   - expired: its expiry time passed (by the clock of the caller of now) and the
//     operator's expiry has not moved the remainder yet; no grab is granted;
//   - live: shares left and time left.
func PacketState(d store.PacketDetail, now time.Time) string {
	switch {
	case d.RemainingAmount == 0: // every share grabbed: a share is at least 1

		return grabapi.PacketExhausted
	case d.Forgotten:
		return grabapi.PacketRefunded
	case d.Expired:
		return grabapi.PacketRefunding
	case !now.Before(d.ExpiresAt):
		return grabapi.PacketExpired
	}
	return grabapi.PacketLive
}

// NewPacketDetailView is the view of d with its grabs, its state as of now.
func NewPacketDetailView(d store.PacketDetail, now time.Time) PacketDetailView {
	v := PacketDetailView{PacketView: NewPacketView(d, now), Grabs: make([]PacketShareView, 0, len(d.Grabs))}
	for _, g := range d.Grabs {
		v.Grabs = append(v.Grabs, PacketShareView{Share: g.Share, UserID: g.UserID, Amount: g.Amount, At: formatPacketTime(g.At)})
	}
	if i := BestLuck(d); i >= 0 {
		v.Grabs[i].BestLuck = true
	}
	return v
}

// BestLuck is the index in d.Grabs of the packet's best luck (手气最佳), or -1: the
// largest share, once the packet is done (every share grabbed, or expired), and the
// earliest grab of the largest when several are equal. The grabs are in share
// order, which is grab order: a packet's shares are handed out one after another.
// A live packet has none yet (a larger share may still come), a Fixed packet none
// (its shares are equal by design), and a packet with fewer than two grabs none.
func BestLuck(d store.PacketDetail) int {
	done := d.Expired || int64(len(d.Grabs)) == d.Count
	if !done || d.Distribution == split.TypeFixed || len(d.Grabs) < 2 {
		return -1
	}
	best := 0
	for i, g := range d.Grabs {
		if g.Amount > d.Grabs[best].Amount {
			best = i
		}
	}
	return best
}

// SenderCredential is the bearer token the sender's backend presents to create
// packets. It can be replaced while requests are served (a rotated Secret).
type SenderCredential struct {
	// digest is SHA-256 of the token: comparing digests takes the same time whatever
	// the presented token's length or content.
	digest atomic.Pointer[[sha256.Size]byte]
}

// ErrSenderCredential answers a creation without the sender's credential or with
// another one.
var ErrSenderCredential = errors.New("creating packets needs the budget's sender credential as a bearer token (Authorization: Bearer followed by the token)")

// NewSenderCredential returns a credential for token, which must not be empty.
func NewSenderCredential(token []byte) (*SenderCredential, error) {
	c := &SenderCredential{}
	if err := c.Set(token); err != nil {
		return nil, err
	}
	return c, nil
}

// Set replaces the token.
func (c *SenderCredential) Set(token []byte) error {
	if len(token) == 0 {
		return errors.New("the sender credential is empty")
	}
	d := sha256.Sum256(token)
	c.digest.Store(&d)
	return nil
}

// Check returns nil when the Authorization header value is "Bearer <the token>",
// comparing in constant time; ErrSenderCredential otherwise.
func (c *SenderCredential) Check(authorization string) error {
	const prefix = "Bearer "
	if len(authorization) <= len(prefix) || !strings.EqualFold(authorization[:len(prefix)], prefix) {
		return ErrSenderCredential
	}
	got := sha256.Sum256([]byte(strings.TrimSpace(authorization[len(prefix):])))
	want := c.digest.Load()
	if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
		return ErrSenderCredential
	}
	return nil
}
