package settlement

import (
	"crypto/ed25519"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/pkg/webhooksig"
)

// Defaults of the optional Config fields.
const (
	DefaultGroup       = "settlement"
	DefaultMaxAttempts = 20
	DefaultClaimIdle   = 30 * time.Second
	DefaultHTTPTimeout = 10 * time.Second
	DefaultBackoffBase = time.Second
	DefaultBackoffMax  = 5 * time.Minute
	DefaultBatchSize   = 64
	DefaultConcurrency = 8
	// DefaultMinConcurrency and DefaultMaxConcurrency are the bounds of the adaptive
	// limit on first deliveries in flight (see limit.go).
	DefaultMinConcurrency = 2
	DefaultMaxConcurrency = 64
	DefaultMaxHeld        = 1024
	DefaultBlock          = time.Second

	DefaultRetryConcurrency   = 8
	DefaultHedgeAfter         = 500 * time.Millisecond
	DefaultHealthyBackoffBase = 100 * time.Millisecond
	DefaultHealthyBackoffMax  = time.Second
)

// Source is the resource whose entries a worker delivers: a RedPacketActivity or a
// RedPacketBudget. Deliveries carry it twice: in the fields every balance system
// reads ("activity" is "<namespace>/<name>", "activityUID" the UID, whatever the
// kind, and "source" is "budget" for a budget's), and as the "sourceRef" object,
// which names the kind (SourceRef).
type Source struct {
	// Kind is SourceKindActivity or SourceKindBudget; "" is an activity.
	Kind string
	// Namespace and Name are the resource's.
	Namespace, Name string
	// UID is the resource's UID, part of every Idempotency-Key.
	UID string
	// Currency is sent in every delivery.
	Currency string
}

// The kinds of a Source.
const (
	SourceKindActivity = "RedPacketActivity"
	SourceKindBudget   = "RedPacketBudget"
)

// Ref is "<namespace>/<name>" ("" when both are empty): the deliveries' "activity",
// and the metrics' and logs' label.
func (s Source) Ref() string {
	if s.Namespace == "" && s.Name == "" {
		return ""
	}
	return s.Namespace + "/" + s.Name
}

// kind is the source's kind, SourceKindActivity when empty.
func (s Source) kind() string {
	if s.Kind == "" {
		return SourceKindActivity
	}
	return s.Kind
}

// wireSource is the deliveries' "source" field: SourceBudget for a budget's, ""
// (absent) for an activity's.
func (s Source) wireSource() string {
	if s.kind() == SourceKindBudget {
		return SourceBudget
	}
	return ""
}

// Config configures one settlement worker of one activity or budget.
type Config struct {
	// Redis is the connection holding the activity: a plain or cluster client of its
	// own (its reads block), never the grab path's auto-pipeliner. The worker makes
	// every Redis call through the activity's handle on it,
	// store.NewActivity(Redis, ActivityUID, n).
	Redis redis.UniversalClient
	// Source is the resource the entries credit money from, an activity or a
	// budget: its kind, namespace and name, UID (part of every Idempotency-Key) and
	// currency, sent in every delivery (Delivery).
	Source Source
	// WebhookURL is where deliveries are POSTed. Empty: the worker idles and claims
	// wait in the stream.
	WebhookURL string
	// SigningKey is the balance system's current HMAC key: it signs each request's
	// X-Signature and its v1 Standard Webhooks signature (webhook-signature). nil:
	// neither is sent.
	SigningKey []byte
	// PreviousSigningKey is the HMAC key being rotated out: while it is set, every
	// webhook-signature carries a second v1 signature made with it (X-Signature
	// stays with SigningKey alone).
	PreviousSigningKey []byte
	// Ed25519Key is the operator's Ed25519 private key for the balance system: every
	// webhook-signature carries a v1a signature made with it, which the balance
	// system verifies with the public key alone. nil: no v1a.
	Ed25519Key ed25519.PrivateKey
	// PreviousEd25519Key is the Ed25519 key being rotated out: while it is set, every
	// webhook-signature carries a second v1a signature made with it.
	PreviousEd25519Key ed25519.PrivateKey
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
	// Without a Transport of its own, the worker's copy gets one that keeps an idle
	// connection for every delivery that may be in flight and dials a host name as
	// fully qualified (with a trailing dot: no resolver search domain applies, so
	// the name dialled is the name the operator's allowlist allowed). Unless it sets
	// CheckRedirect itself, the worker uses a copy that follows no
	// redirect: a 3xx answer is a failed delivery, since a followed 301, 302 or 303
	// turns the POST into a GET without the body, whose 2xx would settle a claim the
	// balance system never saw.
	HTTPClient *http.Client
	// Registerer receives the worker's metrics; nil leaves them unregistered.
	Registerer prometheus.Registerer

	// BackoffBase is the delay before the first retry while the balance system fails
	// most deliveries (it is down or overloaded: more than half of the last 32
	// deliveries failed); it doubles with every failed delivery of the entry up to
	// BackoffMax, with jitter. 0 means DefaultBackoffBase.
	BackoffBase time.Duration
	// BackoffMax caps that retry delay; 0 means DefaultBackoffMax.
	BackoffMax time.Duration
	// HealthyBackoffBase is the delay before the first retry while the balance system
	// answers most deliveries with a 2xx, so a failure is the entry's bad luck and a
	// retry soon is likely to pass; it doubles up to HealthyBackoffMax, with jitter.
	// 0 means the smaller of DefaultHealthyBackoffBase and BackoffBase.
	HealthyBackoffBase time.Duration
	// HealthyBackoffMax caps that retry delay; 0 means the smaller of
	// DefaultHealthyBackoffMax and BackoffMax.
	HealthyBackoffMax time.Duration
	// BatchSize is how many entries one read or claim takes; 0 means DefaultBatchSize.
	BatchSize int
	// Concurrency is how many first deliveries of entries run at once when the
	// worker starts; 0 means DefaultConcurrency. From there the limit adapts to the
	// balance system (AIMD, limit.go): it grows while deliveries are answered with a
	// 2xx promptly and all slots are used, and is cut when most of the latest
	// deliveries fail (an error answer or a timeout), or when answers come
	// markedly slower than at the balance system's best, always within
	// [MinConcurrency, MaxConcurrency]: a start outside them starts at the nearer one.
	Concurrency int
	// MinConcurrency is the floor of that limit; 0 means the smaller of
	// DefaultMinConcurrency and MaxConcurrency.
	MinConcurrency int
	// MaxConcurrency is the ceiling of that limit; 0 means DefaultMaxConcurrency.
	// Setting MinConcurrency, Concurrency and MaxConcurrency equal fixes the limit.
	MaxConcurrency int
	// RetryConcurrency is how many retries (deliveries of entries delivered before,
	// by this worker or another, hedges included, and the retried acknowledgements
	// and dead-letterings) run at once when the worker starts, in parallel with the
	// first deliveries: a retry never waits for a first delivery's slot, nor a first
	// delivery for a retry's. The retry lane's bound follows the adaptive limit in
	// the ratio RetryConcurrency : Concurrency (rounded up), so at most
	// MaxConcurrency × (1 + RetryConcurrency/Concurrency) deliveries are in flight
	// (maxInFlight). 0 means DefaultRetryConcurrency.
	RetryConcurrency int
	// MaxHeld caps the entries this worker holds (delivering or waiting to retry);
	// 0 means DefaultMaxHeld.
	MaxHeld int
	// HedgeAfter is how long a delivery may go unanswered before the worker sends the
	// entry again (a hedge, in the retry lane, with the same body and
	// Idempotency-Key), so a delivery the balance system holds costs about this long
	// rather than the HTTP timeout: whichever answer comes first with a 2xx settles
	// the entry and the other request is cancelled. With the retry lane full, the
	// unanswered delivery is cancelled and the entry goes first in that lane's
	// queue instead. The worker waits at least four times the usual latency of
	// answered deliveries, does not hedge while most of the deliveries it started
	// last were left unanswered this long (a balance system slow for every
	// delivery), and never spends the entry's last allowed attempt on a hedge. Each
	// hedge counts as a delivery towards MaxAttempts. 0 means DefaultHedgeAfter; negative: never hedge.
	HedgeAfter time.Duration
	// Block is how long one read waits for new entries; 0 means DefaultBlock. Keep it
	// short: it bounds how fast the worker notices cancellation.
	Block time.Duration
	// ClaimInterval is how often the worker looks for idle entries to take over;
	// 0 means ClaimIdle/2.
	ClaimInterval time.Duration
	// Logger receives the worker's log lines; nil means slog.Default().
	Logger *slog.Logger

	// Allowance, when set, is what the operator seeded: every entry is then checked
	// against it before delivery (the packet's id and seeded amount, whether it is
	// still listed) and decided in the activity's ledger (each packet credited at
	// most once, the credits and the refund never above the total), besides the
	// check against the claims (store.Shard.VerifyEntries). The operator's workers
	// always set it; only tests of the delivery mechanics leave it nil.
	Allowance *Allowance
	// OnForged, when set, is called once for every entry the worker dead-lettered as
	// forged (the operator raises a Warning event with it). It must not block.
	OnForged func(ForgedEntry)
	// Packets, when set, makes the workers those of a RedPacketBudget's runtime
	// packets (NewBudgetWorkers): every entry is decided in the budget's ledger
	// before delivery instead of checked against a seeded split and claims, and a
	// delivered refund's packet is forgotten (packets.go). It excludes Allowance.
	Packets *Packets
	// Health, when set, records the failing deliveries for the activity's status
	// (the operator's SettlementDegraded condition); all shard workers share it.
	Health *DeliveryHealth
}

// withDefaults validates cfg and fills in the defaults.
func (cfg Config) withDefaults() (Config, error) {
	if cfg.Redis == nil {
		return cfg, errors.New("settlement config: no Redis client")
	}
	if cfg.Source.UID == "" {
		return cfg, errors.New("settlement config: no source UID")
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
	for _, k := range []ed25519.PrivateKey{cfg.Ed25519Key, cfg.PreviousEd25519Key} {
		if k != nil && len(k) != ed25519.PrivateKeySize {
			return cfg, fmt.Errorf("settlement config: an Ed25519 key of %d bytes, not %d", len(k), ed25519.PrivateKeySize)
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
	if cfg.BackoffBase <= 0 {
		cfg.BackoffBase = DefaultBackoffBase
	}
	if cfg.BackoffMax <= 0 {
		cfg.BackoffMax = DefaultBackoffMax
	}
	if cfg.BackoffMax < cfg.BackoffBase {
		cfg.BackoffMax = cfg.BackoffBase
	}
	if cfg.HealthyBackoffBase <= 0 {
		cfg.HealthyBackoffBase = min(DefaultHealthyBackoffBase, cfg.BackoffBase)
	}
	if cfg.HealthyBackoffMax <= 0 {
		cfg.HealthyBackoffMax = min(DefaultHealthyBackoffMax, cfg.BackoffMax)
	}
	if cfg.HealthyBackoffMax < cfg.HealthyBackoffBase {
		cfg.HealthyBackoffMax = cfg.HealthyBackoffBase
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = DefaultBatchSize
	}
	if cfg.MinConcurrency < 0 || cfg.MaxConcurrency < 0 {
		return cfg, fmt.Errorf("settlement config: concurrency bounds %d..%d are negative", cfg.MinConcurrency, cfg.MaxConcurrency)
	}
	if cfg.MaxConcurrency == 0 {
		cfg.MaxConcurrency = DefaultMaxConcurrency
	}
	if cfg.MinConcurrency == 0 {
		cfg.MinConcurrency = min(DefaultMinConcurrency, cfg.MaxConcurrency)
	}
	if cfg.MinConcurrency > cfg.MaxConcurrency {
		return cfg, fmt.Errorf("settlement config: minimum concurrency %d above the maximum %d", cfg.MinConcurrency, cfg.MaxConcurrency)
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.RetryConcurrency <= 0 {
		cfg.RetryConcurrency = DefaultRetryConcurrency
	}
	if cfg.HedgeAfter == 0 {
		cfg.HedgeAfter = DefaultHedgeAfter
	}
	if cfg.HTTPClient.CheckRedirect == nil || cfg.HTTPClient.Transport == nil {
		c := *cfg.HTTPClient
		if c.CheckRedirect == nil {
			c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
		}
		if c.Transport == nil {
			// http.DefaultTransport keeps two idle connections per host: every
			// delivery beyond two in flight would open a new one.
			t := http.DefaultTransport.(*http.Transport).Clone()
			t.MaxIdleConnsPerHost = cfg.maxInFlight()
			// The webhook's host is dialled as the fully qualified name the
			// operator's allowlist allowed, never through search domains.
			t.DialContext = dialFullyQualified(t.DialContext)
			c.Transport = t
		}
		cfg.HTTPClient = &c
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
	if cfg.Allowance != nil && cfg.Packets != nil {
		return cfg, errors.New("settlement config: an activity's Allowance and a budget's Packets exclude each other")
	}
	if cfg.Allowance != nil {
		if err := cfg.Allowance.check(); err != nil {
			return cfg, fmt.Errorf("settlement config: %w", err)
		}
	}
	return cfg, nil
}

// signingKeys are the keys of the webhook-signature header: the current HMAC key,
// then the previous one, then the current and the previous Ed25519 keys.
func (cfg Config) signingKeys() webhooksig.Keys {
	var k webhooksig.Keys
	for _, key := range [][]byte{cfg.SigningKey, cfg.PreviousSigningKey} {
		if len(key) > 0 {
			k.HMAC = append(k.HMAC, key)
		}
	}
	for _, key := range []ed25519.PrivateKey{cfg.Ed25519Key, cfg.PreviousEd25519Key} {
		if len(key) == ed25519.PrivateKeySize {
			k.Ed25519 = append(k.Ed25519, key)
		}
	}
	return k
}

// retryBound is the retry lane's bound when the first deliveries' limit is limit:
// limit × RetryConcurrency / Concurrency, rounded up, at least 1.
func (cfg Config) retryBound(limit int) int {
	return max(1, (limit*cfg.RetryConcurrency+cfg.Concurrency-1)/cfg.Concurrency)
}

// maxInFlight is the most deliveries a worker of cfg (with its defaults) has in
// flight: both lanes at the ceiling.
func (cfg Config) maxInFlight() int {
	return cfg.MaxConcurrency + cfg.retryBound(cfg.MaxConcurrency)
}
