package v1alpha1

// Condition types set on an activity. The controller owns all of them; the grab
// service's reporter sets none.
const (
	// ConditionReady is true while the activity can serve grabs, or has finished
	// cleanly. In the phases in which the grab service serves users (Scheduled,
	// Active, Paused) that needs GrabServiceAvailable to be true as well; otherwise
	// Ready is false with reason GrabServiceUnavailable. Exhausted and Expired are
	// Ready without a grab replica: there is nothing left to serve.
	ConditionReady = "Ready"
	// ConditionSeeded is true once the packets are committed to Redis.
	ConditionSeeded = "Seeded"
	// ConditionGrabServiceAvailable is true when a grab replica reports or is available.
	ConditionGrabServiceAvailable = "GrabServiceAvailable"
	// ConditionSettled is true when every claim and refund has been credited.
	ConditionSettled = "Settled"
	// ConditionStalled is true, with the reason, while the activity cannot go on
	// without a person: its data was lost (DataLost) or its Redis rolled back
	// (RedisRolledBack). kstatus, which Flux and kpt use, reports such an object
	// Failed. It is absent otherwise.
	ConditionStalled = "Stalled"
	// ConditionSettlementDegraded is true while deliveries to the balance system's
	// webhook fail and wait for a retry (reason DeliveriesFailing; the message and
	// status.settlementDelivery name the last error's class and when the oldest
	// undelivered grant happened), false once none is failing (DeliveriesHealthy).
	// It is absent while the operator runs no settlement worker for the activity (no
	// webhook, or not seeded yet), and reflects the elected operator's workers since
	// it started.
	ConditionSettlementDegraded = "SettlementDegraded"
	// ConditionReconciled says whether the balance system's book holds exactly what
	// the operator paid, as of the last reconciliation (对账): True (BooksAgree), False
	// with the difference named (BooksDiffer), Unknown while settlement is still
	// delivering (SettlementInFlight), before the first comparison
	// (ReconciliationPending), after a failed one (ReconciliationFailed), or when the
	// balance system has no read endpoint (ReconciliationUnsupported). Absent without
	// a webhook.
	ConditionReconciled = "Reconciled"
	// ConditionPrewarmed says whether the grab fleet is at its prewarm size
	// (spec.grabService.autoscaling.prewarm): inside the window
	// [startTime − lead, endTime + holdAfter], True (Warmed) once the grab Deployment
	// has prewarm.replicas available, else False with Warming before startTime and
	// NotPrewarmed from startTime on (Ready is then False with NotPrewarmed too, and
	// a Warning event says so). Outside the window it is False with PrewarmPending
	// (before) or PrewarmReleased (after). Absent without prewarm.
	ConditionPrewarmed = "Prewarmed"
)

// Reasons of ConditionPrewarmed.
const (
	// ReasonWarmed: the grab Deployment has at least prewarm.replicas available
	// inside the window (Prewarmed True).
	ReasonWarmed = "Warmed"
	// ReasonWarming: inside the window, before startTime, fewer than
	// prewarm.replicas are available yet (Prewarmed False).
	ReasonWarming = "Warming"
	// ReasonNotPrewarmed: startTime has come and fewer than prewarm.replicas are
	// available (Prewarmed False, Ready False, a Warning event).
	ReasonNotPrewarmed = "NotPrewarmed"
	// ReasonPrewarmPending: the window has not opened yet; the HPA's minimum is
	// autoscaling.minReplicas (Prewarmed False).
	ReasonPrewarmPending = "PrewarmPending"
	// ReasonPrewarmReleased: the window has closed; the HPA's minimum is back at
	// autoscaling.minReplicas (Prewarmed False).
	ReasonPrewarmReleased = "PrewarmReleased"
)

// Reasons of ConditionReconciled.
const (
	ReasonBooksAgree                = "BooksAgree"
	ReasonBooksDiffer               = "BooksDiffer"
	ReasonSettlementInFlight        = "SettlementInFlight"
	ReasonReconciliationPending     = "ReconciliationPending"
	ReasonReconciliationFailed      = "ReconciliationFailed"
	ReasonReconciliationUnsupported = "ReconciliationUnsupported"
	// ReasonNotReconciled is Ready's reason while a deleted activity or budget waits
	// for its books to agree before its keys go.
	ReasonNotReconciled = "NotReconciled"
)

// AnnotationAcceptRedisState is how a person lifts the fence of an activity whose
// Redis rolled back, after reconciling the balances: its value is the epoch shown in
// status.redisEpoch (0 before any accept). The controller then takes the Redis state
// as it is, starts a new epoch and lets the activity go on. A value that is not the
// current epoch does nothing, so the annotation can stay.
//
// Setting or changing it is a platform decision: the admission policy of
// config/policy (redpacket-platform-annotations) admits it only from a user allowed
// the custom verb VerbAcceptRedisState on the activity (the redpacket-platform
// ClusterRole; the edit and admin roles do not grant it), who also sets
// AnnotationAcceptedBy to their own user name (and may set AnnotationAcceptedByGroups
// to their groups). The controller checks that permission again for the recorded
// user with a SubjectAccessReview before it acts, and records who and when in
// status.lastAcceptance and in an event.
const AnnotationAcceptRedisState = "redpacket.io/accept-redis-state"

// AnnotationAcceptedBy names the user who set AnnotationAcceptRedisState; the
// admission policy admits only the requesting user's own name.
const AnnotationAcceptedBy = "redpacket.io/accepted-by"

// AnnotationAcceptedByGroups optionally lists, comma-separated and in the order the
// API server reports them, the groups of the user who set AnnotationAcceptRedisState;
// the admission policy admits only the requesting user's own groups. The
// controller's SubjectAccessReview includes them, so a permission granted to a group
// counts.
const AnnotationAcceptedByGroups = "redpacket.io/accepted-by-groups"

// AnnotationAbandon lets a deletion that holds a fenced (RedisRolledBack) or
// DataLost activity, or a deleted budget waiting on settlement (SettlementPending),
// go without a refund: its value must be the activity's UID, so it
// cannot take effect on another object it was copied to. The activity's Redis keys
// (claims, streams, meta) are then purged, and a Warning event names the amount
// abandoned and who abandoned it. Like AnnotationAcceptRedisState it is a platform
// decision: the admission policy admits it only from a user allowed the custom verb
// VerbAbandon, who also sets AnnotationAbandonedBy (and may set
// AnnotationAbandonedByGroups), and the controller checks that permission again.
// Without a deletion it does nothing.
const AnnotationAbandon = "redpacket.io/abandon"

// AnnotationAbandonedBy names the user who set AnnotationAbandon.
const AnnotationAbandonedBy = "redpacket.io/abandoned-by"

// AnnotationAbandonedByGroups optionally lists the groups of the user who set
// AnnotationAbandon (see AnnotationAcceptedByGroups).
const AnnotationAbandonedByGroups = "redpacket.io/abandoned-by-groups"

// The custom verbs on redpacketactivities that the platform decisions need. No
// built-in role grants them except cluster-admin's "*"; config/rbac ships the
// redpacket-platform ClusterRole with both.
const (
	// VerbAcceptRedisState allows setting AnnotationAcceptRedisState.
	VerbAcceptRedisState = "accept-redis-state"
	// VerbAbandon allows setting AnnotationAbandon.
	VerbAbandon = "abandon"
)

// Condition reasons that scripts and people may rely on. Every reason has its own
// string, so a reason names one situation whatever condition carries it. Besides
// these, Ready's reason is the phase's name (Pending, Seeding, Scheduled, Active,
// Paused, Exhausted, Expired, Failed) when nothing more specific is wrong.
const (
	// ReasonPending: nothing is known yet. Seeded is False with it until seeding
	// starts; Settled is Unknown with it until Redis is read or while Redis holds no
	// data for the activity.
	ReasonPending = "Pending"

	// ReasonSeeding: the packets are being written into Redis (Seeded False, Ready
	// False).
	ReasonSeeding = "Seeding"
	// ReasonCommitted: the packets are committed to Redis (Seeded True).
	ReasonCommitted = "Committed"
	// ReasonSeedFailed: seeding stopped with an error; it resumes where it stood
	// (Seeded False, Ready False).
	ReasonSeedFailed = "SeedFailed"
	// ReasonInvalidSpec: the spec cannot be split into packets; the activity is
	// Failed until the spec changes (Seeded False, Ready False).
	ReasonInvalidSpec = "InvalidSpec"
	// ReasonSpecMismatch: Redis holds other figures for the activity than the spec
	// declares (Ready False).
	ReasonSpecMismatch = "SpecMismatch"
	// ReasonDataLost means Redis no longer holds an activity that had been seeded. It
	// is never seeded again; the activity is Failed (Seeded False, Ready False,
	// Settled Unknown).
	ReasonDataLost = "DataLost"

	// ReasonRedisRolledBack means Redis came back older than what the resource
	// records (fewer claims or settlements, an earlier epoch, an open activity that
	// status records as closed): a failover to a lagging replica, an AOF everysec
	// crash or a restored backup. The activity is fenced in Redis and grants
	// nothing, is never reopened or closed from those counters, and is Failed (Ready
	// False, Stalled True) until AnnotationAcceptRedisState accepts the state.
	ReasonRedisRolledBack = "RedisRolledBack"
	// ReasonRedisStateAccepted is the event reason when a person accepted the Redis
	// state of a fenced activity.
	ReasonRedisStateAccepted = "RedisStateAccepted"

	// ReasonAcceptNotAllowed is the Warning event reason when the user recorded in
	// AnnotationAcceptedBy (or nobody) may not accept the Redis state: the activity
	// stays fenced, nothing changes.
	ReasonAcceptNotAllowed = "AcceptNotAllowed"

	// ReasonDeletionHeld: the activity is deleted while fenced (RedisRolledBack) or
	// DataLost. Its finalizer and every Redis key (claims, streams, meta) are kept,
	// nothing is refunded or purged, until a person accepts the Redis state (then the
	// deletion closes, refunds and drains as usual) or abandons it with
	// AnnotationAbandon (Ready False; a Warning event names the amount not refunded).
	ReasonDeletionHeld = "DeletionHeld"
	// ReasonAbandoned is the Warning event reason when a held deletion was abandoned:
	// the keys were purged without a refund.
	ReasonAbandoned = "Abandoned"
	// ReasonAbandonNotAllowed is the Warning event reason when the user recorded in
	// AnnotationAbandonedBy (or nobody) may not abandon the activity, or the
	// annotation does not carry the activity's UID: the deletion stays held.
	ReasonAbandonNotAllowed = "AbandonNotAllowed"

	// ReasonDurabilityNotMet: the activity's Redis does not give the durability
	// spec.durability asks for (AOF appendfsync always, or enough replicas); a
	// ready activity is not opened (Ready False).
	ReasonDurabilityNotMet = "DurabilityNotMet"

	// ReasonRedisConfigInvalid: the activity's Redis connection is missing or
	// unusable (Ready False).
	ReasonRedisConfigInvalid = "RedisConfigInvalid"
	// ReasonRedisUnavailable: Redis does not answer, or a script failed (Ready False).
	ReasonRedisUnavailable = "RedisUnavailable"

	// ReasonNotAdopted: an object of the grab workload's name exists and is not
	// controlled by the activity; it is left alone (GrabServiceAvailable False).
	ReasonNotAdopted = "NotAdopted"
	// ReasonWorkloadFailed: the grab workload could not be applied (Ready False).
	ReasonWorkloadFailed = "WorkloadFailed"
	// ReasonReporting: a grab replica reported recently (GrabServiceAvailable True).
	ReasonReporting = "Reporting"
	// ReasonReplicasAvailable: the grab Deployment has available replicas
	// (GrabServiceAvailable True).
	ReasonReplicasAvailable = "ReplicasAvailable"
	// ReasonNoReplicas: no grab replica is available and none reported recently
	// (GrabServiceAvailable False).
	ReasonNoReplicas = "NoReplicaAvailable"
	// ReasonGrabServiceUnavailable is Ready's reason while the packets are seeded (and
	// grabbing is scheduled, open or paused) but no grab replica is available to
	// answer users.
	ReasonGrabServiceUnavailable = "GrabServiceUnavailable"

	// ReasonNotConfigured: spec.settlement is absent; claims wait in the activity's
	// stream (Settled False).
	ReasonNotConfigured = "NotConfigured"
	// ReasonSettlementPending: some claims or the refund are not credited yet
	// (Settled False). For a deleted budget: its live packets are expired and it
	// waits for the balance system to take the grants and refunds still in its
	// streams before its keys go (Ready False, with the count; Stalled True too once
	// the cleanup grace period has passed, with a Warning event). The platform team
	// may let it go with AnnotationAbandon (the budget's UID) and
	// AnnotationAbandonedBy: the unsettled credits are purged, never made.
	ReasonSettlementPending = "SettlementPending"
	// ReasonDeadLetters: deliveries were parked in the dead-letter stream after too
	// many failures (Settled False).
	ReasonDeadLetters = "DeadLetters"
	// ReasonWebhookHostNotAllowed (Settled False): no key of the operator's settlement
	// keys Secret allows the webhook's host and port (or its URL carries userinfo), so
	// nothing is delivered to it.
	ReasonWebhookHostNotAllowed = "WebhookHostNotAllowed"
	// ReasonDeliveriesFailing (SettlementDegraded True): deliveries fail and are
	// retried; a Warning event says so when it starts and again while it lasts.
	ReasonDeliveriesFailing = "DeliveriesFailing"
	// ReasonDeliveriesHealthy (SettlementDegraded False): no delivery is failing.
	ReasonDeliveriesHealthy = "DeliveriesHealthy"
	// ReasonAllSettled: every claim and the refund are credited (Settled True).
	ReasonAllSettled = "AllSettled"

	// ReasonDeleting: the activity is deleted and waits for settlement to drain, or
	// for Redis, before its keys are removed (Ready False).
	ReasonDeleting = "Deleting"

	// ReasonGrabImageNotAllowed: spec.grabService.image names an image other than
	// the operator's, and the operator does not allow that
	// (--allow-grab-image-override); the grab workload is left as it is (Ready False).
	ReasonGrabImageNotAllowed = "GrabImageNotAllowed"
	// ReasonRedisNotAllowed: spec.redis names an address that is neither the
	// operator's default Redis nor among the hosts it allows (--allowed-redis-hosts);
	// nothing connects to it (Ready False).
	ReasonRedisNotAllowed = "RedisNotAllowed"
	// ReasonRedisACLUnavailable: the activity uses the operator's default Redis, which
	// cannot give it a Redis ACL user of its own (no ACL before Redis 6, or the
	// operator's Redis user may not manage users). The grab workload is not deployed,
	// so the operator's own credentials never reach the activity's namespace (Ready
	// False).
	ReasonRedisACLUnavailable = "RedisACLUnavailable"
)
