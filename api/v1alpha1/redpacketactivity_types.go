package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// DefaultCurrency is the currency of an activity or a budget whose spec.currency is
// empty. The API server defaults the field to it (the +kubebuilder:default=CNY
// markers of both kinds, which must stay literal); code that meets an empty currency
// uses this constant.
const DefaultCurrency = "CNY"

// DistributionType names the algorithm that splits the total into packets.
// +kubebuilder:validation:Enum=Random;LineCut;Fixed
type DistributionType string

const (
	// DistributionRandom is WeChat's double-average split: each packet is uniform in
	// [min, 2 × remaining average] and the last packet takes the rest.
	DistributionRandom DistributionType = "Random"
	// DistributionLineCut gives every packet the minimum and cuts the rest of the total
	// at count − 1 random points.
	DistributionLineCut DistributionType = "LineCut"
	// DistributionFixed gives equal shares and spreads the remainder one minor unit at a time.
	DistributionFixed DistributionType = "Fixed"
)

// Distribution says how the total amount is split into packets. It is immutable.
type Distribution struct {
	// type is the split algorithm: Random (double-average), LineCut (random cut points)
	// or Fixed (equal shares).
	// +kubebuilder:default=Random
	// +optional
	Type DistributionType `json:"type,omitempty"`

	// minAmount is the smallest packet, in minor units. Defaults to 1.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000000000
	// +optional
	MinAmount int64 `json:"minAmount,omitempty"`

	// maxAmount caps every packet, in minor units. Absent or 0 means no cap.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000000000000000
	// +optional
	MaxAmount int64 `json:"maxAmount,omitempty"`

	// seed makes the split reproducible. Absent means a seed derived from the
	// resource's UID (shown in status.splitSeed).
	// +optional
	Seed *int64 `json:"seed,omitempty"`
}

// SecretReference names a Secret in the activity's namespace.
type SecretReference struct {
	// name of the Secret.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name"`
}

// RedisConnection points at the Redis that holds the activity.
type RedisConnection struct {
	// secretRef names a Secret with keys: addresses (comma-separated host:port),
	// mode (standalone or cluster), username, password and tls ("true").
	SecretRef SecretReference `json:"secretRef"`
}

// DurabilityMode says what must hold a grant before the user is told about it.
type DurabilityMode string

// The durability modes; docs/operations.md says what each promises and costs.
const (
	// DurabilityNone answers a grab as soon as the primary ran it: a crash of the
	// primary's machine (AOF everysec) or a failover can lose the last second of
	// acknowledged grants. The rollback fence keeps them from being granted again.
	DurabilityNone DurabilityMode = "None"
	// DurabilityFsync requires the Redis primary to run with appendonly yes and
	// appendfsync always, so that every grab is on disk before its answer leaves
	// Redis. The controller checks the server's configuration and does not open the
	// activity while it does not hold.
	DurabilityFsync DurabilityMode = "Fsync"
	// DurabilityReplicas answers a grab only once durability.replicas replicas have
	// it (WAIT, batched across grabs); a grab whose WAIT falls short answers 503
	// unavailable, and the packet stays granted to the user, returned by a retry.
	DurabilityReplicas DurabilityMode = "Replicas"
)

// Durability says when a grab may be answered.
// +kubebuilder:validation:XValidation:rule="self.mode != 'Replicas' || self.replicas >= 1",message="durability.replicas must be at least 1 with mode Replicas"
type Durability struct {
	// mode is None (the default), Fsync or Replicas.
	// +kubebuilder:validation:Enum=None;Fsync;Replicas
	// +kubebuilder:default=None
	// +optional
	Mode DurabilityMode `json:"mode,omitempty"`

	// replicas is how many replicas must hold a grant before it is answered, with
	// mode Replicas.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=5
	// +optional
	Replicas int32 `json:"replicas,omitempty"`

	// timeoutMilliseconds bounds the wait for replicas; a grab that waited this long
	// answers 503. Defaults to 200.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=10000
	// +optional
	TimeoutMilliseconds int32 `json:"timeoutMilliseconds,omitempty"`
}

// GrabAuth turns on signed user tokens for the grab service.
type GrabAuth struct {
	// tokenSecretRef names a Secret whose key "key" is the HMAC-SHA256 key that signs
	// user tokens. With it, every grab needs "Authorization: Bearer <token>".
	TokenSecretRef SecretReference `json:"tokenSecretRef"`
}

// GrabPrewarm holds the grab fleet at a size around the activity's window, so that
// it is up before startTime instead of growing minutes after it (an HPA reacts to
// load it already sees). Over [startTime − lead, endTime + holdAfter] the
// HorizontalPodAutoscaler's minReplicas is replicas; outside it, autoscaling's
// minReplicas.
type GrabPrewarm struct {
	// replicas is the HPA's minReplicas over the window: the fleet the first second
	// of the rain needs. At least autoscaling.minReplicas and at most
	// autoscaling.maxReplicas.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	Replicas int32 `json:"replicas"`

	// lead is how long before startTime the window opens: long enough to schedule,
	// pull and start replicas pods (and for a cluster autoscaler to add nodes).
	// Defaults to 10m; at most 24h.
	// +kubebuilder:default="10m"
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('0s') && duration(self) <= duration('24h')",message="prewarm.lead must be between 0s and 24h"
	// +optional
	Lead *metav1.Duration `json:"lead,omitempty"`

	// holdAfter is how long after endTime the window closes, for the tail of the rain
	// (late grabs, the page's last polls). Defaults to 2m; at most 24h.
	// +kubebuilder:default="2m"
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('0s') && duration(self) <= duration('24h')",message="prewarm.holdAfter must be between 0s and 24h"
	// +optional
	HoldAfter *metav1.Duration `json:"holdAfter,omitempty"`
}

// ActivityGrabAutoscaling has the operator own a HorizontalPodAutoscaler
// (autoscaling/v2) of the activity's grab Deployment, <activity>-grab, scaling on
// the grab pods' CPU, and a PodDisruptionBudget whose minAvailable is the HPA's
// current minimum. The fields are those of a budget's GrabAutoscaling, plus
// prewarm.
// +kubebuilder:validation:XValidation:rule="self.minReplicas <= self.maxReplicas",message="autoscaling.minReplicas must not exceed autoscaling.maxReplicas"
// +kubebuilder:validation:XValidation:rule="!has(self.prewarm) || self.prewarm.replicas <= self.maxReplicas",message="autoscaling.prewarm.replicas must not exceed autoscaling.maxReplicas"
// +kubebuilder:validation:XValidation:rule="!has(self.prewarm) || self.prewarm.replicas >= self.minReplicas",message="autoscaling.prewarm.replicas must be at least autoscaling.minReplicas"
type ActivityGrabAutoscaling struct {
	// minReplicas is the HPA's minimum outside the prewarm window. Defaults to 1.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	// +optional
	MinReplicas int32 `json:"minReplicas,omitempty"`

	// maxReplicas is the HPA's maximum.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	MaxReplicas int32 `json:"maxReplicas"`

	// targetCPUUtilizationPercentage is the grab pods' average CPU use the HPA aims
	// at, in percent of their CPU request (100m). Defaults to 70.
	// +kubebuilder:default=70
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=400
	// +optional
	TargetCPUUtilizationPercentage int32 `json:"targetCPUUtilizationPercentage,omitempty"`

	// prewarm holds the HPA's minimum at prewarm.replicas around the activity's
	// window. It needs startTime and endTime.
	// +optional
	Prewarm *GrabPrewarm `json:"prewarm,omitempty"`
}

// GrabService configures the per-activity grab Deployment.
type GrabService struct {
	// replicas of the grab Deployment. Absent means the operator's default. Changing it
	// later is left to kubectl scale or an autoscaler. With autoscaling it is not
	// applied at all: the operator's HPA owns the count (a new Deployment starts at
	// the HPA's current minimum).
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000
	// +optional
	Replicas *int32 `json:"replicas,omitempty"`

	// autoscaling, when set, has the operator own a HorizontalPodAutoscaler and a
	// PodDisruptionBudget for the grab Deployment. Absent, the replica count is
	// replicas, kubectl scale's or a HorizontalPodAutoscaler of your own; removing it
	// deletes the operator's HPA and leaves the Deployment at its last count.
	// +optional
	Autoscaling *ActivityGrabAutoscaling `json:"autoscaling,omitempty"`

	// image of the grab service. Empty means the operator's grab image.
	// +kubebuilder:validation:MaxLength=512
	// +optional
	Image string `json:"image,omitempty"`

	// auth, when set, requires HMAC-signed user tokens on every grab.
	// +optional
	Auth *GrabAuth `json:"auth,omitempty"`

	// startSpread spreads the opening over a window after startTime, so that the
	// wave of a rain's start does not land in one second: each user's grabs open
	// at startTime plus an offset in [0, startSpread), the same for the same
	// activity UID and user id in every process (a hash of both, uniform over the
	// window). A grab before the user's instant answers not_started with
	// Retry-After and touches nothing; GET /v1/activity?userId= tells the instant.
	// Needs startTime, and must be shorter than the window. Absent or 0: everyone
	// opens at startTime.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('0s') && duration(self) <= duration('10m')",message="grabService.startSpread must be between 0s and 10m"
	// +optional
	StartSpread *metav1.Duration `json:"startSpread,omitempty"`
}

// Webhook is the balance system's endpoint that credits users.
type Webhook struct {
	// url receives one POST per claim or refund (and the budget, once, first); any
	// 2xx acknowledges it. The operator delivers only to a host and port that a key of
	// its settlement keys Secret (--settlement-keys-secret, in the operator's namespace)
	// allows ("<host>_<port>", or "<host>" for the scheme's default port; names fully
	// qualified), and signs with that key; any other host or port, and a URL with
	// userinfo, gets nothing (Settled False, WebhookHostNotAllowed).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="self.startsWith('http://') || self.startsWith('https://')",message="webhook url must start with http:// or https://"
	URL string `json:"url"`

	// secretRef is deprecated and ignored: deliveries are signed with the key the
	// operator's own namespace holds for the webhook's host, never with a Secret of
	// the activity's namespace, which the tenant can read. Kept so existing manifests
	// still apply.
	// +optional
	SecretRef *SecretReference `json:"secretRef,omitempty"`
}

// Settlement configures how claims are credited to the balance system.
type Settlement struct {
	// webhook that credits each grant to its user and each refund to the sponsor.
	// +optional
	Webhook *Webhook `json:"webhook,omitempty"`

	// maxAttempts is how many deliveries a claim gets before it is parked in the
	// dead-letter stream. Defaults to 20: a balance system failing a third of its
	// deliveries at random fails one claim twenty times in a row about once in
	// 3.5 billion, where ten times in a row happens once in 59,000.
	// +kubebuilder:default=20
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	// +optional
	MaxAttempts int32 `json:"maxAttempts,omitempty"`
}

// RedisStateAcceptance records who lifted a rollback fence, and when.
type RedisStateAcceptance struct {
	// epoch is the Redis epoch whose state was accepted (the annotation's value); the
	// new epoch, epoch + 1, is in status.redisEpoch.
	Epoch int64 `json:"epoch"`

	// by is the user who set the accept annotation (redpacket.io/accepted-by), as the
	// admission policy admitted it and a SubjectAccessReview confirmed it.
	// +kubebuilder:validation:MaxLength=512
	By string `json:"by"`

	// at is when the controller acted on the acceptance.
	At metav1.Time `json:"at"`
}

// ShardWatermarks are the shards' claimed counts and transfer sequences within one
// Redis epoch.
type ShardWatermarks struct {
	// epoch is the Redis epoch the counts were read in (status.redisEpoch then).
	Epoch int64 `json:"epoch"`

	// claimedCounts are the shards' claimed counts, shard 0 first.
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=64
	ClaimedCounts []int64 `json:"claimedCounts"`

	// transferSeqs are the shards' transfer sequences, shard 0 first: how many
	// transfer steps (a transfer out, in, or its end) each shard had taken. A shard
	// below its figure came back from before a transfer (a failover to a lagging
	// replica) and may list again packets that left it; it is fenced. Absent in a
	// status written before the figure existed.
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=64
	// +optional
	TransferSeqs []int64 `json:"transferSeqs,omitempty"`
}

// ShardCount is the number of shards of the activity: spec.shards, 1 when unset.
func (s *RedPacketActivitySpec) ShardCount() int {
	if s.Shards < 1 {
		return 1
	}
	return int(s.Shards)
}

// RedPacketActivitySpec declares one red-packet activity. Every amount is an integer
// in the currency's minor unit (fen, cents).
// +kubebuilder:validation:XValidation:rule="self.count < 1 || self.totalAmount / self.count >= self.distribution.minAmount",message="totalAmount must be at least count × distribution.minAmount"
// +kubebuilder:validation:XValidation:rule="!has(self.distribution.maxAmount) || self.distribution.maxAmount == 0 || self.distribution.maxAmount >= self.distribution.minAmount",message="distribution.maxAmount must not be below distribution.minAmount"
// +kubebuilder:validation:XValidation:rule="self.count < 1 || !has(self.distribution.maxAmount) || self.distribution.maxAmount == 0 || (self.totalAmount + self.count - 1) / self.count <= self.distribution.maxAmount",message="totalAmount must not exceed count × distribution.maxAmount"
// +kubebuilder:validation:XValidation:rule="!has(self.startTime) || !has(self.endTime) || timestamp(self.endTime) > timestamp(self.startTime)",message="endTime must be after startTime"
// +kubebuilder:validation:XValidation:rule="!has(self.grabService) || !has(self.grabService.startSpread) || duration(self.grabService.startSpread) == duration('0s') || has(self.startTime)",message="grabService.startSpread needs startTime: the spread is counted from it"
// +kubebuilder:validation:XValidation:rule="!has(self.grabService) || !has(self.grabService.startSpread) || !has(self.startTime) || !has(self.endTime) || timestamp(self.startTime) + duration(self.grabService.startSpread) < timestamp(self.endTime)",message="grabService.startSpread must end before endTime: every user must get a moment to grab"
// +kubebuilder:validation:XValidation:rule="!has(self.settlement) || !has(self.settlement.webhook) || has(self.sponsor)",message="sponsor is required with settlement.webhook: refunds of unclaimed money are credited to it"
// +kubebuilder:validation:XValidation:rule="!has(self.shards) || self.shards <= self.count",message="shards must not exceed count: every shard starts with at least one packet"
// +kubebuilder:validation:XValidation:rule="!has(self.grabService) || !has(self.grabService.autoscaling) || !has(self.grabService.autoscaling.prewarm) || (has(self.startTime) && has(self.endTime))",message="grabService.autoscaling.prewarm needs startTime and endTime: its window is [startTime - lead, endTime + holdAfter]"
// +kubebuilder:validation:XValidation:rule="!has(self.shards) || self.shards <= 1 || (has(self.durability) && self.durability.mode != 'None')",message="shards above 1 need durability Fsync or Replicas: a master that forgot a transfer between shards after a crash or failover would hand its packets out twice"
type RedPacketActivitySpec struct {
	// totalAmount is the money split into packets, in minor units. Immutable.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000000000
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="totalAmount is immutable"
	TotalAmount int64 `json:"totalAmount"`

	// count is the number of packets, at least 1. Immutable.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=10000000
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="count is immutable"
	Count int64 `json:"count"`

	// currency is shown to people only; amounts are always minor units. Defaults to CNY.
	// +kubebuilder:default=CNY
	// +kubebuilder:validation:Pattern=`^[A-Z]{3}$`
	// +optional
	Currency string `json:"currency,omitempty"`

	// distribution says how the total is split. Immutable.
	// +kubebuilder:default={}
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="distribution is immutable"
	// +optional
	Distribution Distribution `json:"distribution"`

	// startTime opens grabbing. Absent means open as soon as the packets are seeded.
	// +optional
	StartTime *metav1.Time `json:"startTime,omitempty"`

	// endTime closes grabbing atomically; the unclaimed remainder is refunded to the
	// sponsor. Absent means the activity runs until every packet is claimed.
	// +optional
	EndTime *metav1.Time `json:"endTime,omitempty"`

	// paused stops grabbing without losing anything while true.
	// +optional
	Paused bool `json:"paused,omitempty"`

	// sponsor is the account credited with refunds of unclaimed money. Required when
	// settlement.webhook is set.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=128
	// +optional
	Sponsor string `json:"sponsor,omitempty"`

	// durability says what must hold a grant before the user is told about it.
	// Absent means None.
	// +optional
	Durability *Durability `json:"durability,omitempty"`

	// shards spreads the activity over this many Redis hash tags, so that a Redis
	// Cluster can serve one hot activity from several masters. Each user is decided
	// by one home shard (a stable hash of the user id); a shard that runs dry refills
	// from the others in journalled transfers, so no packet is stranded while users
	// wait. Default 1 (one hash tag, as an unsharded activity). Immutable: changing it
	// would move users to other home shards. At most count. Above 1 it needs
	// durability Fsync or Replicas (Replicas when the masters have replicas that may
	// be promoted: transfers then wait for them too).
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=64
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="shards is immutable"
	// +optional
	Shards int32 `json:"shards,omitempty"`

	// redis names the Redis that holds the activity. Absent means the operator's
	// default connection.
	// +optional
	Redis *RedisConnection `json:"redis,omitempty"`

	// grabService configures the Deployment that serves grabs.
	// +optional
	GrabService GrabService `json:"grabService,omitempty"`

	// settlement configures crediting. Absent means claims wait in the activity's
	// stream until it is configured.
	// +optional
	Settlement *Settlement `json:"settlement,omitempty"`

	// expose publishes the grab service outside the cluster through a Gateway API
	// HTTPRoute or an Ingress. Absent means the in-cluster Service only.
	// +optional
	Expose *Expose `json:"expose,omitempty"`
}

// Phase is where an activity is in its life.
// +kubebuilder:validation:Enum=Pending;Seeding;Scheduled;Active;Paused;Exhausted;Expired;Failed
type Phase string

// The phases of an activity.
const (
	PhasePending   Phase = "Pending"
	PhaseSeeding   Phase = "Seeding"
	PhaseScheduled Phase = "Scheduled"
	PhaseActive    Phase = "Active"
	PhasePaused    Phase = "Paused"
	PhaseExhausted Phase = "Exhausted"
	PhaseExpired   Phase = "Expired"
	PhaseFailed    Phase = "Failed"
)

// RedPacketActivityStatus is what the controller and the grab service observed.
// The controller and the grab service's reporter write disjoint fields with
// server-side apply under their own field managers.
type RedPacketActivityStatus struct {
	// phase is where the activity is in its life.
	// +optional
	Phase Phase `json:"phase,omitempty"`

	// observedGeneration is the spec generation the controller last acted on.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// conditions: Ready, Seeded, GrabServiceAvailable and Settled; Exposed with
	// spec.expose.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// scriptSHA is the SHA1 of the grab script loaded into Redis.
	// +optional
	ScriptSHA string `json:"scriptSHA,omitempty"`

	// endpoint is the grab service's in-cluster URL.
	// +optional
	Endpoint string `json:"endpoint,omitempty"`

	// url is the public URL of spec.expose: the scheme, the route's first hostname
	// (or the Ingress's host) and the path prefix. An HTTPRoute's URL is https unless
	// the parent Gateway can be read and none of its listeners the route attaches to
	// is HTTPS; without a hostname it names the Gateway's listener hostname, or is
	// left empty. An Ingress's is https with tlsSecretName, else http.
	// +optional
	URL string `json:"url,omitempty"`

	// splitSeed is the seed the packets were split with.
	// +optional
	SplitSeed *int64 `json:"splitSeed,omitempty"`

	// seededTime is when the packets were committed to Redis.
	// +optional
	SeededTime *metav1.Time `json:"seededTime,omitempty"`

	// redisEpoch counts the Redis rollbacks that a person accepted for this activity
	// (see the redpacket.io/accept-redis-state annotation); absent means 0. A Redis
	// whose epoch is below it was restored from before an accept, and is fenced.
	// +optional
	RedisEpoch *int64 `json:"redisEpoch,omitempty"`

	// lastAcceptance records the last time a person accepted a rolled-back Redis
	// state (redpacket.io/accept-redis-state): which epoch, who, and when.
	// +optional
	LastAcceptance *RedisStateAcceptance `json:"lastAcceptance,omitempty"`

	// settlementDelivery is how the operator's deliveries to the webhook fare, as
	// its settlement workers know it (see the SettlementDegraded condition). Absent
	// while no worker runs for the activity.
	// +optional
	SettlementDelivery *SettlementDeliveryStatus `json:"settlementDelivery,omitempty"`

	// shardWatermarks are the claimed counts and transfer sequences of each shard of
	// a sharded activity (spec.shards > 1) as the grab service last read them, never
	// lowered within an epoch. The counters above are sums over the shards, so a
	// shard that came back behind while the others went on granting could hide in
	// them, and a shard that came back from before a transfer out holds every claim
	// it held; a grab service and the controller compare each shard with its own
	// figures here, and fence the activity when one is behind.
	// +optional
	ShardWatermarks *ShardWatermarks `json:"shardWatermarks,omitempty"`

	// remainingCount is the number of packets not yet claimed. The money counters
	// (remainingCount, remainingAmount, claimedCount, claimedAmount, refundedAmount,
	// settledCount, settledAmount, deadLetterCount) are always written together from
	// one Redis snapshot, so claimedAmount + remainingAmount + refundedAmount equals
	// totalAmount in every status anyone reads. The controller writes them when the
	// activity becomes Ready (all zero but remaining) and when no grab replica
	// reports; the grab service's reports write them otherwise. None of the
	// cumulative counters is ever lowered: a Redis behind them has rolled back.
	// +optional
	RemainingCount *int64 `json:"remainingCount,omitempty"`

	// remainingAmount is the money not yet claimed or refunded, in minor units.
	// +optional
	RemainingAmount *int64 `json:"remainingAmount,omitempty"`

	// claimedCount is the number of packets granted to users.
	// +optional
	ClaimedCount *int64 `json:"claimedCount,omitempty"`

	// claimedAmount is the money granted to users, in minor units.
	// +optional
	ClaimedAmount *int64 `json:"claimedAmount,omitempty"`

	// settledCount is the number of grants credited by the balance system.
	// +optional
	SettledCount *int64 `json:"settledCount,omitempty"`

	// settledAmount is the money credited to users, in minor units.
	// +optional
	SettledAmount *int64 `json:"settledAmount,omitempty"`

	// refundedAmount is the unclaimed remainder returned to the sponsor when the
	// activity closed, in minor units; 0 until it closes.
	// +optional
	RefundedAmount *int64 `json:"refundedAmount,omitempty"`

	// deadLetterCount is the number of deliveries parked after too many failures.
	// +optional
	DeadLetterCount *int64 `json:"deadLetterCount,omitempty"`

	// lastReportTime is when a grab replica last reported the counters.
	// +optional
	LastReportTime *metav1.Time `json:"lastReportTime,omitempty"`
}

// SettlementDeliveryStatus is how the operator's deliveries to the balance system's
// webhook fare.
type SettlementDeliveryStatus struct {
	// retrying counts the grants and refunds whose last delivery failed and that
	// wait for another one (neither credited nor dead-lettered yet).
	Retrying int64 `json:"retrying"`

	// lastErrorClass is the class of the last failed delivery: http_4xx, http_5xx,
	// http_other, timeout, connection_refused, connection_reset, tls, dns or
	// network. Never text the balance system sent.
	// +optional
	LastErrorClass string `json:"lastErrorClass,omitempty"`

	// lastErrorTime is when the last delivery failed.
	// +optional
	LastErrorTime *metav1.Time `json:"lastErrorTime,omitempty"`

	// oldestUndeliveredTime is when the oldest of the retrying grants (or the
	// refund) happened: its age is how long the balance system has owed it.
	// +optional
	OldestUndeliveredTime *metav1.Time `json:"oldestUndeliveredTime,omitempty"`
}

// The Start and End printer columns are strings, so they print the RFC 3339 time: a
// date column prints an age, which kubectl shows as <invalid> for a time in the future.

// RedPacketActivity is one red-packet activity: a total split into packets that users
// grab once each, served from Redis by atomic scripts.
//
// Its name must be a DNS label of at most 58 characters, so that the grab workload's
// name, <name>-grab, is a valid DNS label and label value: otherwise the grab
// Deployment could never be created, and the API server refuses the activity instead.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=rpa,categories=redpacket
// +kubebuilder:validation:XValidation:rule="size(self.metadata.name) <= 58 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",message="metadata.name must be a DNS label of at most 58 characters (lower-case letters, digits and '-'), so that <name>-grab names the grab workload"
// +kubebuilder:printcolumn:name="Total",type=integer,JSONPath=`.spec.totalAmount`
// +kubebuilder:printcolumn:name="Count",type=integer,JSONPath=`.spec.count`
// +kubebuilder:printcolumn:name="Remaining",type=integer,JSONPath=`.status.remainingCount`
// +kubebuilder:printcolumn:name="Claimed",type=integer,JSONPath=`.status.claimedCount`
// +kubebuilder:printcolumn:name="Phase",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="Claimed-Amount",type=integer,JSONPath=`.status.claimedAmount`,priority=1
// +kubebuilder:printcolumn:name="Settled",type=integer,JSONPath=`.status.settledCount`,priority=1
// +kubebuilder:printcolumn:name="Refunded",type=integer,JSONPath=`.status.refundedAmount`,priority=1
// +kubebuilder:printcolumn:name="Start",type=string,JSONPath=`.spec.startTime`,priority=1
// +kubebuilder:printcolumn:name="End",type=string,JSONPath=`.spec.endTime`,priority=1
// +kubebuilder:printcolumn:name="Endpoint",type=string,JSONPath=`.status.endpoint`,priority=1
// +kubebuilder:printcolumn:name="URL",type=string,JSONPath=`.status.url`,priority=1
type RedPacketActivity struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec declares the activity.
	Spec RedPacketActivitySpec `json:"spec"`

	// status is what the operator and the grab service observed.
	// +optional
	Status RedPacketActivityStatus `json:"status,omitempty"`
}

// RedPacketActivityList is a list of RedPacketActivity.
// +kubebuilder:object:root=true
type RedPacketActivityList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []RedPacketActivity `json:"items"`
}

func init() {
	SchemeBuilder.Register(&RedPacketActivity{}, &RedPacketActivityList{})
}
