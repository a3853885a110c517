// Package grabsvc is the grab service of one red-packet activity: the HTTP API that
// decides claims through the activity's atomic grab script (claim.go), user tokens
// (auth.go), rate limits (ratelimit.go), the status reporter that writes the
// counters back into the RedPacketActivity (reporter.go), the activity lookup
// (activity.go) and the service's metrics (metrics.go). PacketServer (packets*.go) is
// the same service for a RedPacketBudget: the runtime packet API of its shared grab
// fleet and the packet page.
package grabsvc

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"path"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc/grabapi"
	"redpacket.io/operator/grabsvc/web"
	"redpacket.io/operator/store"
)

// MaxBodyBytes is the largest grab request body accepted.
const MaxBodyBytes = 4 << 10

// DefaultRedisTimeout bounds every Redis call of the grab path.
const DefaultRedisTimeout = grabapi.RedisTimeout

// Config is what a Server needs.
type Config struct {
	// Redis runs the grab and snapshot scripts, always through the activity's handle
	// (store.NewActivity): the auto-pipeliner of the activity's Redis
	// (redisconn.PipelinedClient.Pipeliner), or any client.
	Redis redis.Cmdable
	// Resource returns the current activity, nil until it has been read.
	Resource func() *Resource
	// Ping, when set, is the client /readyz pings Redis on (through the activity's
	// handle); /readyz fails while Redis does not answer. The plain client under the
	// auto-pipeliner (redisconn.PipelinedClient.Client) is the one to use.
	Ping redis.Cmdable
	// Tokens, when set, requires a valid user token on every grab. When nil, an
	// activity whose spec asks for tokens (spec.grabService.auth) is refused every
	// grab with 503 and /readyz fails: the service fails closed.
	Tokens *TokenVerifier
	// UserLimiter and ClientLimiter limit grabs per user id and per client address;
	// nil means no limit.
	UserLimiter, ClientLimiter *KeyedLimiter
	// RedisTimeout bounds every Redis call; 0 means DefaultRedisTimeout.
	RedisTimeout time.Duration
	// Metrics receives the service's measurements; nil means a private registry.
	Metrics *Metrics
	// Gatherer serves /metrics; nil means no /metrics endpoint.
	Gatherer prometheus.Gatherer
	// Log receives unexpected errors; nil means slog.Default().
	Log *slog.Logger
	// Now returns the current time; nil means time.Now.
	Now func() time.Time
	// Page serves the red-packet rain page (package web) at /, /rain.css and
	// /rain.js: a canvas rain whose packets are grabbed through /v1/grab.
	Page bool
	// Guard carries the watermark sent with every grab and why the activity cannot
	// be served; share it with the Reporter. nil means a private one.
	Guard *RollbackGuard
	// Durable is the plain client (never the auto-pipeliner) on which grants wait for
	// replicas when the activity's spec.durability.mode is Replicas, and on which a
	// grab whose call ended without an answer is asked again (ResolveTimeout). nil
	// means Ping.
	Durable redis.Cmdable
	// ResolveTimeout bounds how long a grab whose Redis call timed out or lost its
	// connection may spend asking Redis again what it decided, after RedisTimeout; 0
	// means DefaultResolveTimeout. A request whose client goes away stops sooner.
	ResolveTimeout time.Duration
}

// DefaultResolveTimeout is how long a grab with an unknown outcome is resolved for
// by default: with DefaultRedisTimeout, a grab is answered within 1.5 s.
const DefaultResolveTimeout = grabapi.ResolveTimeout

// Server serves the grab API of one activity.
type Server struct {
	cfg      Config
	timeout  time.Duration
	metrics  *Metrics
	log      *slog.Logger
	now      func() time.Time
	draining atomic.Bool
	mux      *http.ServeMux
	redis    handles // the activity's handle on cfg.Redis
	resolve  handles // the activity's handle on cfg.Durable, for unknown outcomes
	ping     handles // the activity's handle on cfg.Ping
	durable  durableWaiters
}

// NewServer returns a server for cfg.
func NewServer(cfg Config) (*Server, error) {
	if cfg.Redis == nil {
		return nil, errors.New("grab server: no redis client")
	}
	if cfg.Resource == nil {
		return nil, errors.New("grab server: no activity source")
	}
	s := &Server{cfg: cfg, timeout: cfg.RedisTimeout, metrics: cfg.Metrics, log: cfg.Log, now: cfg.Now}
	// A transfer between the shards of an activity with durability Replicas waits for
	// the replicas of both masters, as a grant does (store.Activity.Replicated).
	s.redis.replicated = func(shard int) func(context.Context) error {
		act := s.cfg.Resource()
		if act == nil {
			return nil
		}
		if w := s.durable.of(s.cfg.Durable, act, shard); w != nil {
			return w.Wait
		}
		return nil
	}
	if s.timeout <= 0 {
		s.timeout = DefaultRedisTimeout
	}
	if s.cfg.Guard == nil {
		s.cfg.Guard = &RollbackGuard{}
	}
	// The transfers of a refill send the guard's watermarks and raise them.
	s.redis.marks = func(uid types.UID, n int) store.ShardMarks {
		return guardMarks{g: s.cfg.Guard, uid: uid, n: n, resource: s.cfg.Resource}
	}
	if s.cfg.Durable == nil {
		s.cfg.Durable = s.cfg.Ping
	}
	s.resolve.replicated, s.resolve.marks = s.redis.replicated, s.redis.marks
	if s.cfg.ResolveTimeout <= 0 {
		s.cfg.ResolveTimeout = DefaultResolveTimeout
	}
	if s.metrics == nil {
		s.metrics = NewMetrics(prometheus.NewRegistry())
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.now == nil {
		s.now = time.Now
	}
	s.mux = http.NewServeMux()
	s.mux.HandleFunc("/v1/grab", s.handleGrab)
	s.mux.HandleFunc("/v1/activity", s.handleActivity)
	s.mux.HandleFunc("/healthz", s.handleHealthz)
	s.mux.HandleFunc("/readyz", s.handleReadyz)
	var page func(*http.ServeMux) error
	if cfg.Page {
		page = registerPage
	}
	if err := finishMux(s.mux, cfg.Gatherer, page); err != nil {
		return nil, err
	}
	return s, nil
}

// finishMux adds what both kinds' servers serve besides their API: /metrics when
// gatherer is set, the page when page is set, and a JSON 404 for every other path.
func finishMux(mux *http.ServeMux, gatherer prometheus.Gatherer, page func(*http.ServeMux) error) error {
	if gatherer != nil {
		mux.Handle("/metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	}
	if page != nil {
		if err := page(mux); err != nil {
			return err
		}
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusNotFound, errorBody{Error: "no such endpoint: " + r.URL.Path})
	})
	return nil
}

// Handler is the server's HTTP handler.
func (s *Server) Handler() http.Handler { return s.mux }

// Metrics are the server's metrics.
func (s *Server) Metrics() *Metrics { return s.metrics }

// SetDraining makes readiness fail from now on, so load balancers stop sending
// traffic before the server shuts down. Requests are still served.
func (s *Server) SetDraining() { s.draining.Store(true) }

// Ready reports whether the server should receive traffic: it is not draining, the
// activity has been read, it is neither fenced after a Redis rollback nor missing
// from Redis, it does not require tokens that this service cannot check (every grab
// would be refused), and Redis answers a ping within the Redis deadline.
func (s *Server) Ready(ctx context.Context) (bool, string) {
	if s.draining.Load() {
		return false, "shutting down"
	}
	act := s.cfg.Resource()
	if act == nil {
		return false, "the activity has not been read from the API server yet"
	}
	if why := s.cfg.Guard.Problem(act.Object.UID); why != "" {
		return false, why
	}
	if s.cfg.Tokens == nil && RequiresTokens(act.Object) {
		return false, "the activity requires user tokens and this grab service has no verification key (--token-key-file)"
	}
	if s.cfg.Ping != nil {
		h := s.ping.of(s.cfg.Ping, act)
		if _, err := callWithDeadline(ctx, s.timeout, func(ctx context.Context) (struct{}, error) {
			return struct{}{}, h.Ping(ctx)
		}); err != nil {
			return false, "redis does not answer"
		}
	}
	return true, ""
}

// NewHTTPServer returns an http.Server for h with the grab service's limits:
// small headers, and read, write and idle timeouts.
func NewHTTPServer(addr string, h http.Handler) *http.Server {
	return &http.Server{
		Addr:              addr,
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      15 * time.Second,
		IdleTimeout:       90 * time.Second,
		MaxHeaderBytes:    16 << 10,
	}
}

// PageContentSecurityPolicy is the Content-Security-Policy of the rain page's
// responses: its own script, style and images only, requests only to this service,
// no inline code, no forms, no framing.
const PageContentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
	"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// registerPage serves the rain page's embedded files: index.html at / (exactly),
// and rain.css and rain.js as content-hashed assets (and under their plain names).
func registerPage(mux *http.ServeMux) error {
	return servePageFiles(mux, "the rain page", web.Files, []pageFile{
		{path: "/{$}", file: "index.html", contentType: "text/html; charset=utf-8"},
		{path: "/rain.css", file: "rain.css", contentType: "text/css; charset=utf-8", asset: true},
		{path: "/rain.js", file: "rain.js", contentType: "text/javascript; charset=utf-8", asset: true},
	})
}

// pageFile is one embedded file of a page and the route it is served at. check,
// when set, refuses a request (404) by the message it returns for it. An asset is
// also served at its content-hashed name (AssetPath), which the page's HTML refers
// to.
type pageFile struct {
	path, file, contentType string
	check                   func(r *http.Request) string
	asset                   bool
}

// The Cache-Control of a page's responses. A content-hashed asset never changes
// under its name, so a browser or a CDN may keep it for a year without asking
// again; the HTML, which names the assets of the running version, and the API are
// never stored, so a new version is picked up at once. An asset under its plain name
// (kept for pages loaded before the hashed names) is revalidated by its ETag.
const (
	cacheImmutable   = "public, max-age=31536000, immutable"
	cacheNoStore     = "no-store"
	cacheRevalidated = "no-cache"
)

// AssetPath is the content-hashed path an asset of a page is served at:
// /assets/<name>.<the first 12 hex digits of its SHA-256>.<ext>, e.g.
// /assets/rain.3f1c0a9b2e4d.js.
func AssetPath(file string, body []byte) string {
	sum := sha256.Sum256(body)
	ext := path.Ext(file)
	return "/assets/" + strings.TrimSuffix(file, ext) + "." + hex.EncodeToString(sum[:6]) + ext
}

// servePageFiles serves a page's embedded files, each under the rain page's
// Content-Security-Policy, nosniff and no referrer, to GET and HEAD only. The HTML
// files refer to each asset as "assets/<file>" (relative, so the page works under a
// gateway's path prefix); they are served with those references replaced by the
// asset's AssetPath, and an HTML file that names an asset not served is an error.
func servePageFiles(mux *http.ServeMux, page string, files fs.ReadFileFS, list []pageFile) error {
	hashed := map[string]string{} // file -> its AssetPath
	for _, f := range list {
		if !f.asset {
			continue
		}
		body, err := files.ReadFile(f.file)
		if err != nil {
			return fmt.Errorf("grab server: %s: %w", page, err)
		}
		hashed[f.file] = AssetPath(f.file, body)
		mux.HandleFunc(hashed[f.file], pageHandler(f, body, cacheImmutable))
		mux.HandleFunc(f.path, pageHandler(f, body, cacheRevalidated))
	}
	for _, f := range list {
		if f.asset {
			continue
		}
		body, err := files.ReadFile(f.file)
		if err != nil {
			return fmt.Errorf("grab server: %s: %w", page, err)
		}
		for file, p := range hashed {
			ref := []byte("assets/" + file + `"`)
			if !bytes.Contains(body, ref) {
				return fmt.Errorf("grab server: %s: %s does not refer to its asset as %q", page, f.file, "assets/"+file)
			}
			body = bytes.ReplaceAll(body, ref, []byte(strings.TrimPrefix(p, "/")+`"`))
		}
		mux.HandleFunc(f.path, pageHandler(f, body, cacheNoStore))
	}
	return nil
}

// pageHandler serves body as f, with the page's headers and cacheControl; it
// revalidates by an ETag of the content.
func pageHandler(f pageFile, body []byte, cacheControl string) http.HandlerFunc {
	sum := sha256.Sum256(body)
	etag := `"` + hex.EncodeToString(sum[:8]) + `"`
	return func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", PageContentSecurityPolicy)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			h.Set("Allow", "GET, HEAD")
			writeJSON(w, http.StatusMethodNotAllowed, errorBody{Error: "use GET on " + r.URL.Path})
			return
		}
		if f.check != nil {
			if msg := f.check(r); msg != "" {
				writeJSON(w, http.StatusNotFound, errorBody{Error: msg})
				return
			}
		}
		h.Set("Content-Type", f.contentType)
		h.Set("Cache-Control", cacheControl)
		h.Set("ETag", etag)
		http.ServeContent(w, r, f.file, time.Time{}, bytes.NewReader(body))
	}
}

// grabResponse is the body of every /v1/grab answer.
type grabResponse = grabapi.GrabResponse

type errorBody struct {
	Error string `json:"error"`
}

// ActivityView is the body of GET /v1/activity.
type ActivityView struct {
	Namespace       string `json:"namespace"`
	Name            string `json:"name"`
	Phase           string `json:"phase"`
	TotalAmount     int64  `json:"totalAmount"`
	Count           int64  `json:"count"`
	RemainingCount  int64  `json:"remainingCount"`
	RemainingAmount int64  `json:"remainingAmount"`
	ClaimedCount    int64  `json:"claimedCount"`
	ClaimedAmount   int64  `json:"claimedAmount"`
	RefundedAmount  int64  `json:"refundedAmount"`
	Paused          bool   `json:"paused"`
	// StartTime and EndTime are RFC 3339, null when the activity has none.
	StartTime *string `json:"startTime"`
	EndTime   *string `json:"endTime"`
	Currency  string  `json:"currency"`
	// StartSpread is spec.grabService.startSpread in milliseconds, absent without
	// one. OpensAt is, for GET /v1/activity?userId=, that user's opening instant
	// (startTime plus the user's offset, RFC 3339 with milliseconds); absent
	// without a spread or a userId.
	StartSpreadMillis int64  `json:"startSpreadMillis,omitempty"`
	OpensAt           string `json:"opensAt,omitempty"`
}

func (s *Server) handleActivity(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeJSON(w, http.StatusMethodNotAllowed, errorBody{Error: "use GET on /v1/activity"})
		return
	}
	if ok, wait := s.cfg.ClientLimiter.Allow(clientAddr(r), s.now()); !ok {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds(wait)))
		writeJSON(w, http.StatusTooManyRequests, errorBody{Error: "too many requests from this client; retry later"})
		return
	}
	act := s.cfg.Resource()
	if act == nil {
		writeJSON(w, http.StatusServiceUnavailable, errorBody{Error: "the activity has not been read from the API server yet"})
		return
	}
	h := s.redis.of(s.cfg.Redis, act)
	snap, err := callWithDeadline(r.Context(), s.timeout, h.Snapshot)
	if err != nil {
		s.metrics.RedisErrors.WithLabelValues("snapshot").Inc()
		writeJSON(w, http.StatusServiceUnavailable, errorBody{Error: "the packet store is unavailable; retry later"})
		return
	}
	v := BuildActivityView(act, snap, s.now())
	if start, spread := startSpreadOf(act.Object); spread > 0 {
		v.StartSpreadMillis = spread.Milliseconds()
		if userID := r.URL.Query().Get("userId"); userID != "" {
			if msg := CheckUserID(userID); msg != "" {
				writeJSON(w, http.StatusBadRequest, errorBody{Error: msg})
				return
			}
			v.OpensAt = OpensAt(string(act.Object.UID), userID, start, spread).UTC().Format(timeMillis)
		}
	}
	writeJSON(w, http.StatusOK, v)
}

// BuildActivityView combines the resource and a Redis snapshot into the
// /v1/activity answer. When Redis lacks the activity the counters are the
// resource's last reported status.
func BuildActivityView(act *Resource, snap store.Snapshot, now time.Time) ActivityView {
	o := act.Object
	v := ActivityView{
		Namespace: o.Namespace,
		Name:      o.Name,
		Phase:     string(DerivePhase(o, snap, now)),
		Currency:  o.Spec.Currency,
		Paused:    o.Spec.Paused,
	}
	if v.Currency == "" {
		v.Currency = redpacketv1alpha1.DefaultCurrency
	}
	if o.Spec.StartTime != nil {
		v.StartTime = rfc3339(o.Spec.StartTime.Time)
	}
	if o.Spec.EndTime != nil {
		v.EndTime = rfc3339(o.Spec.EndTime.Time)
	}
	if snap.Exists() {
		v.TotalAmount, v.Count = snap.Total, snap.Count
		v.RemainingCount, v.RemainingAmount = snap.RemainingCount, snap.RemainingAmount()
		v.ClaimedCount, v.ClaimedAmount = snap.ClaimedCount, snap.ClaimedAmount
		v.RefundedAmount, v.Paused = snap.Refunded, snap.Paused
		// Redis holds the window grabs are decided by.
		v.StartTime, v.EndTime = nil, nil
		if snap.StartMs > 0 {
			v.StartTime = rfc3339(time.UnixMilli(snap.StartMs))
		}
		if snap.EndMs > 0 {
			v.EndTime = rfc3339(time.UnixMilli(snap.EndMs))
		}
		return v
	}
	st := o.Status
	v.TotalAmount, v.Count = o.Spec.TotalAmount, o.Spec.Count
	v.RemainingCount, v.RemainingAmount = deref(st.RemainingCount), deref(st.RemainingAmount)
	v.ClaimedCount, v.ClaimedAmount = deref(st.ClaimedCount), deref(st.ClaimedAmount)
	v.RefundedAmount = deref(st.RefundedAmount)
	return v
}

// DerivePhase is the activity's phase as a grab would see it now: what Redis says
// (store.Snapshot.Phase) while Redis holds the open or closed activity, else the
// resource's status.phase, and without one Scheduled for a committed activity and
// Pending for one Redis does not hold.
func DerivePhase(o *redpacketv1alpha1.RedPacketActivity, snap store.Snapshot, now time.Time) redpacketv1alpha1.Phase {
	if p, ok := snap.Phase(now); ok {
		return p
	}
	switch {
	case o.Status.Phase != "":
		return o.Status.Phase
	case snap.State == store.StateReady:
		return redpacketv1alpha1.PhaseScheduled
	default:
		return redpacketv1alpha1.PhasePending
	}
}

func (s *Server) handleHealthz(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (s *Server) handleReadyz(w http.ResponseWriter, r *http.Request) {
	if ok, why := s.Ready(r.Context()); !ok {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "not ready", "reason": why})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
}

// callWithDeadline runs f and stops waiting for it after d, or when ctx is done,
// even when f does not return: the auto-pipeliner does not honor a command's context
// once the command is queued. f keeps running in the background until its own
// socket timeouts end it.
func callWithDeadline[T any](ctx context.Context, d time.Duration, f func(context.Context) (T, error)) (T, error) {
	type reply struct {
		v   T
		err error
	}
	ch := make(chan reply, 1)
	go func() {
		v, err := f(ctx)
		ch <- reply{v, err}
	}()
	t := time.NewTimer(d)
	defer t.Stop()
	var err error
	select {
	case r := <-ch:
		return r.v, r.err
	case <-t.C:
		err = context.DeadlineExceeded
	case <-ctx.Done():
		err = ctx.Err()
	}
	select {
	case r := <-ch:
		return r.v, r.err
	default:
	}
	var zero T
	return zero, fmt.Errorf("redis call: %w", err)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		status = http.StatusInternalServerError
		body = []byte(`{"error":"encoding the answer failed"}`)
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(body)+1))
	w.WriteHeader(status)
	body = append(body, '\n')
	_, _ = w.Write(body)
}

// clientAddr is the client's IP address, the key of the per-client rate limit.
func clientAddr(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

func rfc3339(t time.Time) *string {
	s := t.UTC().Format(time.RFC3339)
	return &s
}

func deref(p *int64) int64 {
	if p == nil {
		return 0
	}
	return *p
}
