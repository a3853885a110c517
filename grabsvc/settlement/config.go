package settlement

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// Defaults of the optional Config fields.
const (
	DefaultGroup       = "settlement"
	DefaultMaxAttempts = 10
	DefaultClaimIdle   = 30 * time.Second
	DefaultHTTPTimeout = 10 * time.Second
	DefaultBackoffBase = time.Second
	DefaultBackoffMax  = 5 * time.Minute
	DefaultBatchSize   = 64
	DefaultConcurrency = 8
	DefaultMaxHeld     = 1024
	DefaultBlock       = time.Second
)

// Config configures one settlement worker of one activity.
type Config struct {
	// Redis is the connection holding the activity: a plain or cluster client of its
	// own (its reads block), never the grab path's auto-pipeliner. The worker makes
	// every Redis call through the activity's handle on it,
	// lua.NewActivity(Redis, ActivityUID).
	Redis redis.UniversalClient
	// Keys are the activity's keys, lua.KeysFor(ActivityUID); other keys are refused.
	Keys lua.Keys
	// Activity is "<namespace>/<name>", sent in every delivery.
	Activity string
	// ActivityUID is the resource's UID, sent in every delivery and part of the
	// idempotency key.
	ActivityUID string
	// Currency is sent in every delivery.
	Currency string
	// WebhookURL is where deliveries are POSTed. Empty: the worker idles and claims
	// wait in the stream.
	WebhookURL string
	// SigningKey signs each delivery body (X-Signature); nil sends no signature.
	SigningKey []byte
	// MaxAttempts is how many deliveries an entry gets before it is dead-lettered;
	// 0 means DefaultMaxAttempts.
	MaxAttempts int
	// Consumer is this worker's consumer name in the group; it must be stable across
	// restarts of the same worker so it re-reads its own pending entries.
	Consumer string
	// Group is the consumer group; "" means DefaultGroup.
	Group string
	// ClaimIdle is how long an entry must sit idle in another consumer's pending list
	// before this worker takes it over; 0 means DefaultClaimIdle. Entries a live
	// worker holds (also while it backs off) are kept fresh, so only dead workers'
	// entries go idle this long.
	ClaimIdle time.Duration
	// HTTPClient sends the deliveries; nil means a client with DefaultHTTPTimeout.
	// Unless it sets CheckRedirect itself, the worker uses a copy that follows no
	// redirect: a 3xx answer is a failed delivery, since a followed 301, 302 or 303
	// turns the POST into a GET without the body, whose 2xx would settle a claim the
	// balance system never saw.
	HTTPClient *http.Client
	// Registerer receives the worker's metrics; nil leaves them unregistered.
	Registerer prometheus.Registerer

	// BackoffBase is the delay before the first retry; it doubles with every failed
	// delivery up to BackoffMax, with jitter. 0 means DefaultBackoffBase.
	BackoffBase time.Duration
	// BackoffMax caps the retry delay; 0 means DefaultBackoffMax.
	BackoffMax time.Duration
	// BatchSize is how many entries one read or claim takes; 0 means DefaultBatchSize.
	BatchSize int
	// Concurrency is how many deliveries run at once; 0 means DefaultConcurrency.
	Concurrency int
	// MaxHeld caps the entries this worker holds (delivering or waiting to retry);
	// 0 means DefaultMaxHeld.
	MaxHeld int
	// Block is how long one read waits for new entries; 0 means DefaultBlock. Keep it
	// short: it bounds how fast the worker notices cancellation.
	Block time.Duration
	// ClaimInterval is how often the worker looks for idle entries to take over;
	// 0 means ClaimIdle/2.
	ClaimInterval time.Duration
	// Logger receives the worker's log lines; nil means slog.Default().
	Logger *slog.Logger
}

// withDefaults validates cfg and fills in the defaults.
func (cfg Config) withDefaults() (Config, error) {
	if cfg.Redis == nil {
		return cfg, errors.New("settlement config: no Redis client")
	}
	if cfg.Keys.Stream == "" || cfg.Keys.Meta == "" || cfg.Keys.DeadLetters == "" {
		return cfg, errors.New("settlement config: activity keys not set")
	}
	if cfg.ActivityUID == "" {
		return cfg, errors.New("settlement config: no activity UID")
	}
	if cfg.Keys != lua.KeysFor(cfg.ActivityUID) {
		return cfg, fmt.Errorf("settlement config: keys (stream %s) are not the keys of activity %s", cfg.Keys.Stream, cfg.ActivityUID)
	}
	if cfg.Consumer == "" {
		return cfg, errors.New("settlement config: no consumer name")
	}
	if cfg.WebhookURL != "" {
		u, err := url.Parse(cfg.WebhookURL)
		if err != nil {
			return cfg, fmt.Errorf("settlement config: webhook URL: %w", err)
		}
		if u.Scheme != "http" && u.Scheme != "https" || u.Host == "" {
			return cfg, fmt.Errorf("settlement config: webhook URL %q is not an absolute http(s) URL", cfg.WebhookURL)
		}
	}
	if cfg.MaxAttempts < 0 {
		return cfg, fmt.Errorf("settlement config: max attempts %d is negative", cfg.MaxAttempts)
	}
	if cfg.MaxAttempts == 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	if cfg.Group == "" {
		cfg.Group = DefaultGroup
	}
	if cfg.ClaimIdle <= 0 {
		cfg.ClaimIdle = DefaultClaimIdle
	}
	if cfg.ClaimIdle < 10*time.Millisecond {
		return cfg, fmt.Errorf("settlement config: claim idle %s is below 10ms", cfg.ClaimIdle)
	}
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = &http.Client{Timeout: DefaultHTTPTimeout}
	}
	if cfg.HTTPClient.CheckRedirect == nil {
		c := *cfg.HTTPClient
		c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
		cfg.HTTPClient = &c
	}
	if cfg.BackoffBase <= 0 {
		cfg.BackoffBase = DefaultBackoffBase
	}
	if cfg.BackoffMax <= 0 {
		cfg.BackoffMax = DefaultBackoffMax
	}
	if cfg.BackoffMax < cfg.BackoffBase {
		cfg.BackoffMax = cfg.BackoffBase
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = DefaultBatchSize
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.MaxHeld <= 0 {
		cfg.MaxHeld = DefaultMaxHeld
	}
	if cfg.Block <= 0 {
		cfg.Block = DefaultBlock
	}
	if cfg.Block < time.Millisecond {
		cfg.Block = time.Millisecond
	}
	if cfg.ClaimInterval <= 0 {
		cfg.ClaimInterval = cfg.ClaimIdle / 2
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return cfg, nil
}
