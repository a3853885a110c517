package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// A RedPacketBudget is the long-lived source of packets created at runtime, thousands
// a second (seed 004: one small packet per shared order, all day long). Its money is
// spread over spec.budgetShards Redis hash tags; every packet is drawn from one of
// them in one atomic script, and one shared grab Deployment per budget serves the
// runtime API (POST /v1/packets, POST /v1/packets/{id}/grab, GET /v1/packets/{id}).
// docs/budgets.md describes the design.

// MaxPacketTTL is the longest time to live a packet of a budget may have.
const MaxPacketTTL = "168h"

// PacketLimits are what one packet created from the budget may be. The grab service
// refuses a creation outside them with limit_exceeded, and the create script checks
// them again against the limits the operator wrote to Redis.
// +kubebuilder:validation:XValidation:rule="self.maxTotal >= self.minShare",message="packets.maxTotal must be at least packets.minShare"
// +kubebuilder:validation:XValidation:rule="!has(self.defaultTTL) || !has(self.maxTTL) || duration(self.defaultTTL) <= duration(self.maxTTL)",message="packets.defaultTTL must not exceed packets.maxTTL"
// +kubebuilder:validation:XValidation:rule="!has(self.quotas) || !has(self.quotas.perSender) || !has(self.quotas.perSender.amountPerDay) || self.quotas.perSender.amountPerDay >= self.minShare",message="packets.quotas.perSender.amountPerDay must be at least packets.minShare, or no packet could ever be created"
type PacketLimits struct {
	// maxTotal caps one packet's money, in minor units.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000000000
	MaxTotal int64 `json:"maxTotal"`

	// maxCount caps one packet's shares. Defaults to 100.
	// +kubebuilder:default=100
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	// +optional
	MaxCount int32 `json:"maxCount,omitempty"`

	// minShare is the smallest share, in minor units. Defaults to 1.
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000000000
	// +optional
	MinShare int64 `json:"minShare,omitempty"`

	// distributions are the split algorithms a packet may ask for. Defaults to all
	// three.
	// +kubebuilder:default={Random,LineCut,Fixed}
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=3
	// +listType=set
	// +optional
	Distributions []DistributionType `json:"distributions,omitempty"`

	// defaultTTL is a packet's time to live when its creation names none. Defaults
	// to 24h.
	// +kubebuilder:default="24h"
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s')",message="packets.defaultTTL must be at least 1s"
	// +optional
	DefaultTTL *metav1.Duration `json:"defaultTTL,omitempty"`

	// maxTTL caps a packet's time to live; at most 168h (7 days). Defaults to 24h,
	// WeChat's.
	// +kubebuilder:default="24h"
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s') && duration(self) <= duration('168h')",message="packets.maxTTL must be between 1s and 168h (7 days)"
	// +optional
	MaxTTL *metav1.Duration `json:"maxTTL,omitempty"`

	// claimSecret makes each packet a capability: its creation answers a
	// claimSecret, and every grab of it, and every read by anyone but the sender,
	// must carry it (the Claim-Secret header; the packet page takes it from its
	// link's fragment, /p/{id}#<secret>). Without it, an id that cannot be told
	// from one never created. Order ids may then be guessable without exposing
	// packets.
	// +optional
	ClaimSecret bool `json:"claimSecret,omitempty"`

	// sendWindows are the hours of the day when packets may be created, in
	// timeZone, each "HH:MM-HH:MM" (start included, end excluded, "24:00" the end
	// of the day; a window over midnight is written as two). Outside them a
	// creation of a new id answers 403 outside_send_window with Retry-After to the
	// next window; a retry of a packet that exists still answers existing. The grab
	// pods decide by their own clocks. Absent: every hour.
	// +kubebuilder:validation:MaxItems=8
	// +listType=atomic
	// +optional
	SendWindows []SendWindow `json:"sendWindows,omitempty"`

	// timeZone of sendWindows, and whose calendar day the daily quotas count, an
	// IANA name such as "Asia/Shanghai". Defaults to UTC.
	// +kubebuilder:validation:MaxLength=64
	// +kubebuilder:validation:Pattern=`^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+)*$`
	// +optional
	TimeZone string `json:"timeZone,omitempty"`

	// quotas limit what one sender creates and one recipient grabs, per minute and
	// per calendar day in timeZone, counted in Redis in the same atomic step as the
	// creation or the grant. A refusal answers quota_exceeded naming the rule: 429
	// with Retry-After for the per-minute rate, 403 with Retry-After to the next day
	// for a daily quota. Absent: no quota.
	// +optional
	Quotas *PacketQuotas `json:"quotas,omitempty"`
}

// PacketQuotas are a budget's per-sender and per-recipient quotas; every field is
// optional, and one left out is no limit.
type PacketQuotas struct {
	// perSender limits each sender (the creation's sender field).
	// +optional
	PerSender *SenderQuotas `json:"perSender,omitempty"`

	// perRecipient limits each user who grabs, across every packet of the budget.
	// +optional
	PerRecipient *RecipientQuotas `json:"perRecipient,omitempty"`
}

// SenderQuotas limit one sender's creations. A retry of a packet that exists is
// answered as before and counts nothing.
type SenderQuotas struct {
	// packetsPerMinute caps the packets a sender creates in one calendar minute of
	// the grab service's clock (WeChat Pay's merchants: 1800).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000
	// +optional
	PacketsPerMinute int64 `json:"packetsPerMinute,omitempty"`

	// packetsPerDay caps the packets a sender creates in one day.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000
	// +optional
	PacketsPerDay int64 `json:"packetsPerDay,omitempty"`

	// amountPerDay caps the money of the packets a sender creates in one day, in
	// minor units.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000000000
	// +optional
	AmountPerDay int64 `json:"amountPerDay,omitempty"`
}

// RecipientQuotas limit one user's grabs.
type RecipientQuotas struct {
	// sharesPerDay caps the shares one user is granted in one day, across every
	// packet of the budget (WeChat Pay: 10 a day to the same user). A repeated
	// grab answers already_claimed and counts nothing.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000
	// +optional
	SharesPerDay int64 `json:"sharesPerDay,omitempty"`
}

// SendWindow is "HH:MM-HH:MM" with the start before the end, 00:00 to 24:00.
// +kubebuilder:validation:MaxLength=11
// +kubebuilder:validation:Pattern=`^([01][0-9]|2[0-3]):[0-5][0-9]-(([01][0-9]|2[0-3]):[0-5][0-9]|24:00)$`
// +kubebuilder:validation:XValidation:rule="self.split('-')[0] < self.split('-')[1]",message="a send window's start must be before its end (a window over midnight is written as two)"
type SendWindow string

// GrabAutoscaling has the operator own a HorizontalPodAutoscaler (autoscaling/v2)
// of a budget's grab Deployment, <budget>-grab, scaling on the grab pods' CPU, and a
// PodDisruptionBudget whose minAvailable is minReplicas. A budget has no window, so
// there is no prewarm (an activity's ActivityGrabAutoscaling has one).
// +kubebuilder:validation:XValidation:rule="self.minReplicas <= self.maxReplicas",message="autoscaling.minReplicas must not exceed autoscaling.maxReplicas"
type GrabAutoscaling struct {
	// minReplicas is the HPA's minimum. Defaults to 1.
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
	// at, in percent of their CPU request. Defaults to 70.
	// +kubebuilder:default=70
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=400
	// +optional
	TargetCPUUtilizationPercentage int32 `json:"targetCPUUtilizationPercentage,omitempty"`
}

// BudgetGrabService configures the budget's one shared grab Deployment.
// +kubebuilder:validation:XValidation:rule="!has(self.autoscaling) || !has(self.resources) || (has(self.resources.requests) && 'cpu' in self.resources.requests)",message="grabService.autoscaling scales on CPU use relative to the CPU request: resources must then request cpu"
type BudgetGrabService struct {
	// replicas of the grab Deployment. Absent means the operator's default at
	// creation, and then whatever kubectl scale or an autoscaler sets: the
	// budget's scale subresource reads and writes this field, so a
	// HorizontalPodAutoscaler can target the budget itself. With autoscaling it is
	// not applied: the operator's HPA owns the Deployment's count, and replicas
	// (and the scale subresource that writes it) only says what applies again
	// once autoscaling is removed.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000
	// +optional
	Replicas *int32 `json:"replicas,omitempty"`

	// image of the grab service. Empty means the operator's grab image.
	// +kubebuilder:validation:MaxLength=512
	// +optional
	Image string `json:"image,omitempty"`

	// resources of the grab container. Absent means requests of 100m CPU and 64Mi
	// and a memory limit of 256Mi. A memory limit left out is 256Mi, or the memory
	// request when that is higher.
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`

	// auth, when set, requires HMAC-signed user tokens on every grab, bound to the
	// budget or to one packet.
	// +optional
	Auth *GrabAuth `json:"auth,omitempty"`

	// autoscaling, when set, has the operator own a HorizontalPodAutoscaler and a
	// PodDisruptionBudget for the grab Deployment. Absent, the replica count is
	// replicas (the scale subresource's, or your own HPA's on the budget); removing
	// it deletes the operator's HPA.
	// +optional
	Autoscaling *GrabAutoscaling `json:"autoscaling,omitempty"`
}

// RedPacketBudgetSpec declares a budget. Every amount is an integer in the
// currency's minor unit (fen, cents).
// +kubebuilder:validation:XValidation:rule="!has(self.events) || (has(self.settlement) && has(self.settlement.webhook))",message="events follow settlement: spec.events needs spec.settlement.webhook"
type RedPacketBudgetSpec struct {
	// total is the budget's money, in minor units. It may be raised (a refill),
	// never lowered.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000000000
	// +kubebuilder:validation:XValidation:rule="self >= oldSelf",message="total may only grow: raise it to refill the budget, it cannot be lowered"
	Total int64 `json:"total"`

	// currency is shown to people and recorded in settlement entries; amounts are
	// always minor units. Defaults to CNY.
	// +kubebuilder:default=CNY
	// +kubebuilder:validation:Pattern=`^[A-Z]{3}$`
	// +optional
	Currency string `json:"currency,omitempty"`

	// packets are the limits of one packet.
	Packets PacketLimits `json:"packets"`

	// redis names the Redis that holds the budget. Absent means the operator's
	// default connection.
	// +optional
	Redis *RedisConnection `json:"redis,omitempty"`

	// durability says what must hold a grant before the user is told about it.
	// Absent means None.
	// +optional
	Durability *Durability `json:"durability,omitempty"`

	// budgetShards spreads the budget's money over this many Redis hash tags, so
	// that creation is not bound by one key and packets spread over every master
	// of a Redis Cluster (at least 4 × masters is the advice). Immutable: a
	// packet's shard is a hash of its id modulo this number.
	// +kubebuilder:default=16
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=256
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="budgetShards is immutable: every packet's shard is a hash of its id modulo budgetShards"
	// +optional
	BudgetShards int32 `json:"budgetShards,omitempty"`

	// grabService configures the budget's shared grab Deployment.
	// +kubebuilder:default={}
	// +optional
	GrabService BudgetGrabService `json:"grabService,omitempty"`

	// settlement configures crediting: each grant to its user and each expired
	// packet's remainder to its sender. Absent means entries wait in the budget's
	// streams until it is configured.
	// +optional
	Settlement *Settlement `json:"settlement,omitempty"`

	// events tells the merchant what happens to each packet, through a webhook:
	// packet.created, packet.exhausted, packet.expired and packet.refunded. Absent
	// means no events; the merchant can read a packet with GET /v1/packets/{id}.
	// +optional
	Events *BudgetEvents `json:"events,omitempty"`

	// expose publishes the budget's grab service outside the cluster through a
	// Gateway API HTTPRoute or an Ingress. Absent means the in-cluster Service only.
	// +optional
	Expose *Expose `json:"expose,omitempty"`
}

// BudgetEvents configures the events of a budget's packets (docs/budgets.md#events).
type BudgetEvents struct {
	// webhook receives one POST per event of a packet, in lifecycle order per packet
	// (packet.created; then packet.exhausted, or packet.expired and
	// packet.refunded), at least once, each with the Idempotency-Key
	// "<budget uid>/<packetId>/<type>" and signed as settlement's deliveries are, with
	// the operator's key for its host and port: the settlement keys Secret must allow
	// it, or no event is sent (a Warning EventsWebhookHostNotAllowed). Events follow
	// settlement: each is sent once settlement has finished with the entries it is
	// derived from, and spec.events needs spec.settlement.webhook. A slow or failing
	// receiver delays only its own events.
	Webhook EventsWebhook `json:"webhook"`

	// maxAttempts is how many deliveries an event gets before it is parked, with the
	// later events of its packet, in the budget's events dead letters. Defaults to 20.
	// +kubebuilder:default=20
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	// +optional
	MaxAttempts int32 `json:"maxAttempts,omitempty"`
}

// EventsWebhook is where a budget's events go.
type EventsWebhook struct {
	// url receives the events; any 2xx acknowledges one.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="self.startsWith('http://') || self.startsWith('https://')",message="events webhook url must start with http:// or https://"
	URL string `json:"url"`
}

// ShardCount is the number of budget shards: spec.budgetShards, 16 when unset.
func (s *RedPacketBudgetSpec) ShardCount() int {
	if s.BudgetShards < 1 {
		return 16
	}
	return int(s.BudgetShards)
}

// Condition reasons of a budget, besides the activity's that apply as they are
// (RedisConfigInvalid, RedisUnavailable, RedisNotAllowed, RedisACLUnavailable,
// WorkloadFailed, GrabImageNotAllowed, Deleting, NotAdopted).
const (
	// ReasonBudgetReady: the budget is configured in Redis and its grab Deployment
	// has an available replica (Ready True).
	ReasonBudgetReady = "BudgetReady"
	// ReasonConfiguring: the budget's shards are being configured (Ready False).
	ReasonConfiguring = "Configuring"
	// ReasonTotalNotAnnounced: spec.total (a new budget's, or a raised one) is being
	// announced to the balance system, which has not acknowledged it yet; the shards
	// are not allotted beyond what it acknowledged until it does (Ready False).
	ReasonTotalNotAnnounced = "TotalNotAnnounced"
	// ReasonInvalidTimeZone: spec.packets.timeZone passes the API server's pattern
	// but names no zone of the time-zone database (Ready False, a Warning event):
	// the grab pods refuse creations (503) until it is corrected; grabs go on.
	ReasonInvalidTimeZone = "InvalidTimeZone"
	// ReasonConfigureRefused: Redis refused the budget's configuration, e.g. a
	// total below what the shards already hold (Ready False, Stalled True).
	ReasonConfigureRefused = "ConfigureRefused"
	// ReasonConservationBroken: the budget's money does not add up in Redis:
	// total ≠ available + inPackets + claimed + refunded (Ready False, Stalled
	// True, a Warning event).
	ReasonConservationBroken = "ConservationBroken"
)

// BudgetStateAcceptance is an acceptance of a budget's rolled-back Redis state.
type BudgetStateAcceptance struct {
	// fencedAt is when the fence that was lifted began (the Stalled condition's
	// lastTransitionTime); the accept annotation named it in Unix seconds.
	FencedAt metav1.Time `json:"fencedAt"`

	// by is the user who set the accept annotation (redpacket.io/accepted-by), as the
	// admission policy admitted it and a SubjectAccessReview confirmed it.
	// +kubebuilder:validation:MaxLength=512
	By string `json:"by"`

	// at is when the controller acted on the acceptance.
	At metav1.Time `json:"at"`
}

// RedPacketBudgetStatus is what the controller observed. Every money figure is read
// from one snapshot of the budget's shards, each read at one instant, so
// total = available + inPackets + claimed + refunded in every status written.
type RedPacketBudgetStatus struct {
	// observedGeneration is the spec generation the controller last acted on.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// conditions: Ready, Stalled while the budget cannot go on without a
	// person, and Exposed with spec.expose. kstatus and the Argo CD health check read them.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// lastAcceptance records the platform team's last acceptance of a rolled-back
	// Redis state of the budget: the fence it lifted, who accepted and when.
	// +optional
	LastAcceptance *BudgetStateAcceptance `json:"lastAcceptance,omitempty"`

	// total is the money allotted to the budget's shards, in minor units: the
	// spec's total once configured.
	// +optional
	Total *int64 `json:"total,omitempty"`

	// available may still be drawn by new packets.
	// +optional
	Available *int64 `json:"available,omitempty"`

	// inPackets is the money still in live packets: not grabbed, not refunded.
	// +optional
	InPackets *int64 `json:"inPackets,omitempty"`

	// claimed is the money granted to users.
	// +optional
	Claimed *int64 `json:"claimed,omitempty"`

	// refunded is the money of expired packets returned to their senders.
	// +optional
	Refunded *int64 `json:"refunded,omitempty"`

	// livePackets is the number of packets not yet expired.
	// +optional
	LivePackets *int64 `json:"livePackets,omitempty"`

	// createdPackets is the number of packets ever created.
	// +optional
	CreatedPackets *int64 `json:"createdPackets,omitempty"`

	// epoch is the reconcile epoch the operator last wrote into every budget shard
	// (the lowest a shard held after it): each reconcile of a configured budget adds
	// one to it in Redis, and nothing else writes it. A shard that holds less came
	// back from before that reconcile, and the budget is fenced RedisRolledBack.
	// +optional
	Epoch *int64 `json:"epoch,omitempty"`

	// expiredPackets is the number of packets expired.
	// +optional
	ExpiredPackets *int64 `json:"expiredPackets,omitempty"`

	// grabbedShares is the number of shares granted to users.
	// +optional
	GrabbedShares *int64 `json:"grabbedShares,omitempty"`

	// createdPerSecond is packets created per second between the last two
	// snapshots, rounded.
	// +optional
	CreatedPerSecond *int64 `json:"createdPerSecond,omitempty"`

	// grabbedPerSecond is shares granted per second between the last two
	// snapshots, rounded.
	// +optional
	GrabbedPerSecond *int64 `json:"grabbedPerSecond,omitempty"`

	// settledCount is the number of settlement entries (grants and refunds)
	// credited by the balance system.
	// +optional
	SettledCount *int64 `json:"settledCount,omitempty"`

	// deadLetters is the number of deliveries parked after too many failures.
	// +optional
	DeadLetters *int64 `json:"deadLetters,omitempty"`

	// snapshotTime is when the figures above were read.
	// +optional
	SnapshotTime *metav1.Time `json:"snapshotTime,omitempty"`

	// senderSecretName names the Secret, in the budget's namespace, whose key
	// "token" is the sender credential: the merchant's backend sends it as
	// "Authorization: Bearer <token>" to create packets. The operator mints it
	// once and never overwrites it; deleting the Secret rotates it.
	// +optional
	SenderSecretName string `json:"senderSecretName,omitempty"`

	// endpoint is the grab service's in-cluster URL.
	// +optional
	Endpoint string `json:"endpoint,omitempty"`

	// url is the public URL of spec.expose, as an activity's status.url.
	// +optional
	URL string `json:"url,omitempty"`

	// replicas is the grab Deployment's current replica count (the scale
	// subresource's status).
	// +optional
	Replicas int32 `json:"replicas,omitempty"`

	// selector selects the grab pods, for the scale subresource (an HPA reads the
	// pods' metrics through it).
	// +optional
	Selector string `json:"selector,omitempty"`
}

// RedPacketBudget is a long-lived source of red packets created at runtime: money
// set aside, the rules each packet must follow, who may spend it, and one shared grab
// fleet that serves the packets.
//
// Its name must be a DNS label of at most 58 characters, so that <name>-grab and
// <name>-sender are valid names.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.grabService.replicas,statuspath=.status.replicas,selectorpath=.status.selector
// +kubebuilder:resource:shortName=rpb,categories=redpacket
// +kubebuilder:validation:XValidation:rule="size(self.metadata.name) <= 58 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",message="metadata.name must be a DNS label of at most 58 characters (lower-case letters, digits and '-'), so that <name>-grab names the grab workload"
// +kubebuilder:printcolumn:name="Total",type=integer,JSONPath=`.status.total`
// +kubebuilder:printcolumn:name="Available",type=integer,JSONPath=`.status.available`
// +kubebuilder:printcolumn:name="In-Packets",type=integer,JSONPath=`.status.inPackets`
// +kubebuilder:printcolumn:name="Claimed",type=integer,JSONPath=`.status.claimed`
// +kubebuilder:printcolumn:name="Refunded",type=integer,JSONPath=`.status.refunded`
// +kubebuilder:printcolumn:name="Live",type=integer,JSONPath=`.status.livePackets`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="Created",type=integer,JSONPath=`.status.createdPackets`,priority=1
// +kubebuilder:printcolumn:name="Expired",type=integer,JSONPath=`.status.expiredPackets`,priority=1
// +kubebuilder:printcolumn:name="Created/s",type=integer,JSONPath=`.status.createdPerSecond`,priority=1
// +kubebuilder:printcolumn:name="Grabbed/s",type=integer,JSONPath=`.status.grabbedPerSecond`,priority=1
// +kubebuilder:printcolumn:name="Currency",type=string,JSONPath=`.spec.currency`,priority=1
// +kubebuilder:printcolumn:name="Endpoint",type=string,JSONPath=`.status.endpoint`,priority=1
// +kubebuilder:printcolumn:name="URL",type=string,JSONPath=`.status.url`,priority=1
type RedPacketBudget struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec declares the budget.
	Spec RedPacketBudgetSpec `json:"spec"`

	// status is what the operator observed.
	// +optional
	Status RedPacketBudgetStatus `json:"status,omitempty"`
}

// RedPacketBudgetList is a list of RedPacketBudget.
// +kubebuilder:object:root=true
type RedPacketBudgetList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []RedPacketBudget `json:"items"`
}

func init() {
	SchemeBuilder.Register(&RedPacketBudget{}, &RedPacketBudgetList{})
}
