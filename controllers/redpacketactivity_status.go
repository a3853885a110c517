package controllers

import (
	"context"
	"errors"
	"fmt"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
)

// controllerConditionTypes are the conditions the controller owns, in the order their
// transitions are reported.
var controllerConditionTypes = []string{
	redpacketv1alpha1.ConditionSeeded,
	redpacketv1alpha1.ConditionReady,
	redpacketv1alpha1.ConditionGrabServiceAvailable,
	redpacketv1alpha1.ConditionSettled,
	redpacketv1alpha1.ConditionStalled,
	redpacketv1alpha1.ConditionSettlementDegraded,
	redpacketv1alpha1.ConditionReconciled,
	redpacketv1alpha1.ConditionExposed,
	redpacketv1alpha1.ConditionPrewarmed,
}

// warningReasons are the condition reasons whose arrival is reported as a Warning event.
var warningReasons = map[string]bool{
	redpacketv1alpha1.ReasonDataLost:           true,
	redpacketv1alpha1.ReasonRedisRolledBack:    true,
	redpacketv1alpha1.ReasonDurabilityNotMet:   true,
	redpacketv1alpha1.ReasonRedisConfigInvalid: true,
	redpacketv1alpha1.ReasonRedisUnavailable:   true,
	redpacketv1alpha1.ReasonInvalidSpec:        true,
	redpacketv1alpha1.ReasonSpecMismatch:       true,
	redpacketv1alpha1.ReasonSeedFailed:         true,
	redpacketv1alpha1.ReasonNotAdopted:         true,
	redpacketv1alpha1.ReasonWorkloadFailed:     true,
	redpacketv1alpha1.ReasonDeadLetters:        true,
	// Deliveries to the webhook fail (settlement_runner.go repeats it while they do).
	redpacketv1alpha1.ReasonDeliveriesFailing: true,
	// A deletion that keeps a fenced or lost activity's keys (redpacketactivity_delete.go).
	redpacketv1alpha1.ReasonDeletionHeld: true,
	// The operator's policy refused what the spec asks (redis_policy.go, redpacketactivity_redis_user.go).
	redpacketv1alpha1.ReasonGrabImageNotAllowed: true,
	redpacketv1alpha1.ReasonRedisNotAllowed:     true,
	redpacketv1alpha1.ReasonRedisACLUnavailable: true,
	// spec.expose cannot be kept (shared_expose.go).
	redpacketv1alpha1.ReasonGatewayAPIMissing: true,
	redpacketv1alpha1.ReasonExposeFailed:      true,
	// startTime came before the prewarmed grab replicas (redpacketactivity_prewarm.go).
	redpacketv1alpha1.ReasonNotPrewarmed: true,
}

// readyPhases are the phases in which the activity serves grabs or finished cleanly.
var readyPhases = map[redpacketv1alpha1.Phase]bool{
	redpacketv1alpha1.PhaseScheduled: true,
	redpacketv1alpha1.PhaseActive:    true,
	redpacketv1alpha1.PhasePaused:    true,
	redpacketv1alpha1.PhaseExhausted: true,
	redpacketv1alpha1.PhaseExpired:   true,
}

// servingPhases are the ready phases in which users are answered by the grab
// service, so Ready also needs GrabServiceAvailable. In Exhausted and Expired there
// is nothing left to serve.
var servingPhases = map[redpacketv1alpha1.Phase]bool{
	redpacketv1alpha1.PhaseScheduled: true,
	redpacketv1alpha1.PhaseActive:    true,
	redpacketv1alpha1.PhasePaused:    true,
}

// controllerStatus returns only the fields of st that the controller applies under
// FieldManager; the counters belong to the grab service (and CountersFieldManager),
// lastAcceptance to AcceptanceFieldManager.
func controllerStatus(st redpacketv1alpha1.RedPacketActivityStatus) redpacketv1alpha1.RedPacketActivityStatus {
	out := redpacketv1alpha1.RedPacketActivityStatus{
		Phase:              st.Phase,
		ObservedGeneration: st.ObservedGeneration,
		ScriptSHA:          st.ScriptSHA,
		Endpoint:           st.Endpoint,
		URL:                st.URL,
	}
	for _, t := range controllerConditionTypes {
		if c := meta.FindStatusCondition(st.Conditions, t); c != nil {
			out.Conditions = append(out.Conditions, *c)
		}
	}
	if st.SplitSeed != nil {
		v := *st.SplitSeed
		out.SplitSeed = &v
	}
	if st.SeededTime != nil {
		out.SeededTime = st.SeededTime.DeepCopy()
	}
	if st.SettlementDelivery != nil {
		out.SettlementDelivery = st.SettlementDelivery.DeepCopy()
	}
	return out
}

// computeStatus completes the scope's status with what is derived from it at the end
// of a reconcile (and at a step's mid-way patch): the phase default and the Ready,
// GrabServiceAvailable, Prewarmed and Settled conditions. The observed generation is
// not its business: Reconcile sets it only after a clean reconcile. It also returns
// when the GrabServiceAvailable condition would turn stale by itself (0: never).
//
// Ready is True only when the activity can serve what its phase promises: in
// Scheduled, Active and Paused that includes a grab replica being available
// (GrabServiceAvailable=True), else Ready is False with reason
// GrabServiceUnavailable, and, once startTime has come inside a prewarm window, the
// prewarmed replicas being available, else Ready is False with NotPrewarmed
// (computePrewarmed); Exhausted and Expired are Ready by themselves. So
// kubectl wait --for=condition=Ready returns once grabs can be answered.
func (r *RedPacketActivityReconciler) computeStatus(s *activityScope) (redpacketv1alpha1.RedPacketActivityStatus, time.Duration) {
	if s.status.Phase == "" {
		s.status.Phase = redpacketv1alpha1.PhasePending
	}

	if meta.FindStatusCondition(s.status.Conditions, redpacketv1alpha1.ConditionSeeded) == nil {
		s.setCondition(redpacketv1alpha1.ConditionSeeded, metav1.ConditionFalse, redpacketv1alpha1.ReasonPending, "the packets are not seeded yet")
	}

	staleIn := r.computeGrabServiceAvailable(s)
	notPrewarmed := computePrewarmed(s)

	switch {
	case s.notReady != nil:
		s.setCondition(redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, s.notReady.reason, "%s", s.notReady.message)
	case readyPhases[s.status.Phase]:
		msg := s.phaseMessage
		if msg == "" {
			// The schedule step did not run this time; keep what it said last.
			msg = "the activity is " + string(s.status.Phase)
			if c := meta.FindStatusCondition(s.status.Conditions, redpacketv1alpha1.ConditionReady); c != nil && c.Reason == string(s.status.Phase) {
				msg = c.Message
			}
		}
		grab := meta.FindStatusCondition(s.status.Conditions, redpacketv1alpha1.ConditionGrabServiceAvailable)
		if servingPhases[s.status.Phase] && (grab == nil || grab.Status != metav1.ConditionTrue) {
			why := "not observed yet"
			if grab != nil {
				why = grab.Reason + ": " + grab.Message
			}
			s.setCondition(redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, redpacketv1alpha1.ReasonGrabServiceUnavailable,
				"%s, but no grab replica is available to answer users (%s)", msg, why)
			break
		}
		if notPrewarmed != nil {
			s.setCondition(redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, notPrewarmed.reason, "%s: %s", msg, notPrewarmed.message)
			break
		}
		s.setCondition(redpacketv1alpha1.ConditionReady, metav1.ConditionTrue, string(s.status.Phase), "%s", msg)
	default:
		s.setCondition(redpacketv1alpha1.ConditionReady, metav1.ConditionFalse, string(s.status.Phase), "the activity is %s", s.status.Phase)
	}

	computeSettled(s)
	computeSettlementDegraded(s)
	computeReconciled(s)
	s.stalledCondition()
	return controllerStatus(s.status), staleIn
}

// computeGrabServiceAvailable sets GrabServiceAvailable. Where a Deployment controller
// acts on the grab Deployment (its status has an observedGeneration), the Deployment
// decides: True while it has an available replica, since the grab Service routes only to
// those; a replica that reports before its readiness probe passed does not count. Where
// nothing acts on it (a control plane without kube-controller-manager, grab replicas run
// as host processes), a report within GrabReportTimeout makes it True. False when the
// workload could not be adopted or nothing is up. It returns when a fresh report that
// decided turns stale.
func (r *RedPacketActivityReconciler) computeGrabServiceAvailable(s *activityScope) time.Duration {
	const condType = redpacketv1alpha1.ConditionGrabServiceAvailable
	if !s.workloadChecked {
		if c := meta.FindStatusCondition(s.status.Conditions, condType); c != nil && c.Reason == redpacketv1alpha1.ReasonNotAdopted {
			return 0
		}
	}
	if s.notAdopted != "" {
		s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonNotAdopted, "%s", s.notAdopted)
		return 0
	}
	d := s.deployment
	if d != nil && d.Status.AvailableReplicas > 0 {
		s.setCondition(condType, metav1.ConditionTrue, redpacketv1alpha1.ReasonReplicasAvailable,
			"deployment %s has %d available replicas", d.Name, d.Status.AvailableReplicas)
		return 0
	}
	timeout := r.Options.GrabReportTimeout
	lr := s.activity.Status.LastReportTime
	if d != nil && d.Status.ObservedGeneration > 0 {
		msg := fmt.Sprintf("deployment %s has no available replica of %d", d.Name, d.Status.Replicas)
		if lr != nil {
			msg += fmt.Sprintf(" (last report %s; the grab Service routes only to available replicas)", lr.UTC().Format(time.RFC3339))
		}
		s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonNoReplicas, "%s", msg)
		return 0
	}
	if lr != nil {
		age := s.now.Sub(lr.Time)
		if age < timeout {
			s.setCondition(condType, metav1.ConditionTrue, redpacketv1alpha1.ReasonReporting,
				"a grab replica reported at %s", lr.UTC().Format(time.RFC3339))
			return timeout - age + 100*time.Millisecond
		}
	}
	msg := fmt.Sprintf("no grab replica is available and none reported in the last %s", timeout)
	if lr != nil {
		msg += fmt.Sprintf(" (last report %s)", lr.UTC().Format(time.RFC3339))
	}
	s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonNoReplicas, "%s", msg)
	return 0
}

// computeSettled sets Settled from the Redis snapshot read in this reconcile.
func computeSettled(s *activityScope) {
	const condType = redpacketv1alpha1.ConditionSettled
	snap := s.snapshot
	switch {
	case s.settlementBlocked != "":
		s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonWebhookHostNotAllowed, "%s", s.settlementBlocked)
	case s.activity.Spec.Settlement == nil:
		claims := int64(0)
		if s.snapshotRead {
			claims = snap.ClaimedCount
		}
		s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonNotConfigured,
			"spec.settlement is absent; %d claims wait in the activity's stream until it is configured", claims)
	case !s.snapshotRead:
		// Nothing new is known; keep what the status says.
		if meta.FindStatusCondition(s.status.Conditions, condType) == nil {
			s.setCondition(condType, metav1.ConditionUnknown, redpacketv1alpha1.ReasonPending, "Redis has not been read yet")
		}
	case !snap.Exists():
		reason := redpacketv1alpha1.ReasonPending
		if s.notReady != nil && s.notReady.reason == redpacketv1alpha1.ReasonDataLost {
			reason = redpacketv1alpha1.ReasonDataLost
		}
		s.setCondition(condType, metav1.ConditionUnknown, reason, "Redis holds no data for the activity")
	case snap.DeadCount > 0:
		s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonDeadLetters,
			"%d deliveries were parked in the dead-letter stream after too many failures; %d of %d claims settled",
			snap.DeadCount, snap.SettledCount, snap.ClaimedCount)
	case settled(snap):
		s.setCondition(condType, metav1.ConditionTrue, redpacketv1alpha1.ReasonAllSettled,
			"all %d claims (%d) and the refund (%d) are credited", snap.ClaimedCount, snap.ClaimedAmount, snap.Refunded)
	default:
		msg := fmt.Sprintf("%d of %d claims settled", snap.SettledCount, snap.ClaimedCount)
		if snap.Refunded > 0 {
			msg += fmt.Sprintf("; %d of the %d refund settled", snap.RefundSettled, snap.Refunded)
		}
		s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonSettlementPending, "%s", msg)
	}
}

// computeSettlementDegraded sets SettlementDegraded and status.settlementDelivery
// from the settlement workers' delivery health read in this reconcile. Without a
// webhook both go; when the workers were not looked at this time (a reconcile that
// stopped before the settlement step) both stay as they were.
func computeSettlementDegraded(s *activityScope) {
	const condType = redpacketv1alpha1.ConditionSettlementDegraded
	if s.activity.Spec.Settlement == nil || s.activity.Spec.Settlement.Webhook == nil {
		meta.RemoveStatusCondition(&s.status.Conditions, condType)
		s.status.SettlementDelivery = nil
		return
	}
	h := s.delivery
	if h == nil {
		return
	}
	st := &redpacketv1alpha1.SettlementDeliveryStatus{Retrying: int64(h.Retrying), LastErrorClass: h.LastErrorClass}
	if !h.LastErrorTime.IsZero() {
		t := metav1.NewTime(h.LastErrorTime.Truncate(time.Second))
		st.LastErrorTime = &t
	}
	if !h.OldestUndelivered.IsZero() {
		t := metav1.NewTime(h.OldestUndelivered.Truncate(time.Second))
		st.OldestUndeliveredTime = &t
	}
	s.status.SettlementDelivery = st
	if !h.Degraded() {
		s.setCondition(condType, metav1.ConditionFalse, redpacketv1alpha1.ReasonDeliveriesHealthy, "no delivery to the webhook is failing")
		return
	}
	s.setCondition(condType, metav1.ConditionTrue, redpacketv1alpha1.ReasonDeliveriesFailing,
		"%d deliveries to the webhook failed and are retried, the last with %s; the oldest undelivered grant is from %s",
		h.Retrying, h.LastErrorClass, st.OldestUndeliveredTime.UTC().Format(time.RFC3339))
}

// computeReconciled sets Reconciled from the reconciliation the settlement step
// read (reconciledCondition); without a webhook it goes, and when the step did not
// read one this time it stays as it was.
func computeReconciled(s *activityScope) {
	if !settlement.HasWebhook(s.activity) {
		meta.RemoveStatusCondition(&s.status.Conditions, redpacketv1alpha1.ConditionReconciled)
		return
	}
	if v := s.reconciliation; v != nil {
		reconciledCondition(&s.status.Conditions, s.activity.Generation, true, v.last, v.err, v.ok)
	}
}

// observeDeployment reads the grab Deployment from the cache when this reconcile has
// not looked at it yet, for GrabServiceAvailable.
func (r *RedPacketActivityReconciler) observeDeployment(ctx context.Context, s *activityScope) {
	if s.deploymentLooked {
		return
	}
	s.deploymentLooked = true
	d := &appsv1.Deployment{}
	if err := r.Client.Get(ctx, client.ObjectKey{Namespace: s.activity.Namespace, Name: specs.GrabName(s.activity)}, d); err != nil {
		return
	}
	if metav1.IsControlledBy(d, s.activity) {
		s.deployment = d
	}
}

// statusWriter is where the controller's status goes. In production that is the API
// server (apiStatusWriter); the phase tests record what would be written.
type statusWriter interface {
	// applyStatus applies the controller's status fields st of activity a with
	// server-side apply on the status subresource under FieldManager, forcing
	// ownership of exactly those fields. The grab service's counters are never part
	// of it, so they are never touched.
	applyStatus(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity, st redpacketv1alpha1.RedPacketActivityStatus) error
}

// apiStatusWriter writes status to the API server through c.
type apiStatusWriter struct {
	c client.Client
}

func (w apiStatusWriter) applyStatus(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity, st redpacketv1alpha1.RedPacketActivityStatus) error {
	fields, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&st)
	if err != nil {
		return fmt.Errorf("converting status: %w", err)
	}
	if err := w.c.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(statusApplyObject(a, fields)),
		client.FieldOwner(FieldManager), client.ForceOwnership); err != nil {
		return fmt.Errorf("applying status: %w", err)
	}
	return nil
}

// statusWriter returns the reconciler's status writer: the API server through Client
// unless another one was set.
func (r *RedPacketActivityReconciler) statusWriter() statusWriter {
	if r.statuses != nil {
		return r.statuses
	}
	return apiStatusWriter{c: r.Client}
}

// patchStatus computes the scope's status (computeStatus) and writes the controller's
// fields through the status writer. Nothing is sent when they are unchanged. Every
// condition transition is reported as an event. On success the scope's view of the
// status is updated. It also returns when GrabServiceAvailable would turn stale by
// itself (0: never).
//
// Reconcile calls it once, on the way out, whatever happened; a step that must make
// its progress durable before it goes on calls it through the statusPatcher it
// receives (patchStatusNow).
func (r *RedPacketActivityReconciler) patchStatus(ctx context.Context, s *activityScope) (time.Duration, error) {
	r.observeDeployment(ctx, s)
	desired, staleIn := r.computeStatus(s)
	current := controllerStatus(s.activity.Status)
	if equality.Semantic.DeepEqual(current, desired) {
		return staleIn, nil
	}
	if err := r.statusWriter().applyStatus(ctx, s.activity, desired); err != nil {
		return 0, err
	}
	r.emitTransitionEvents(s.activity, current, desired)
	mergeControllerStatus(&s.activity.Status, desired)
	return staleIn, nil
}

// patchStatusNow is the statusPatcher of the steps: patchStatus with Ready False for
// progress meanwhile (nil: as the scope says).
func (r *RedPacketActivityReconciler) patchStatusNow(ctx context.Context, s *activityScope, progress *readyBlocker) error {
	if progress != nil {
		saved := s.notReady
		s.notReady = progress
		defer func() { s.notReady = saved }()
	}
	_, err := r.patchStatus(ctx, s)
	return err
}

// statusApplyObject builds a status apply object of an activity: apiVersion, kind,
// name, namespace and the given status fields, nothing else.
func statusApplyObject(a *redpacketv1alpha1.RedPacketActivity, fields map[string]any) *unstructured.Unstructured {
	return statusApplyObjectOf("RedPacketActivity", a, fields)
}

// statusApplyObjectOf builds a status apply object of obj, of the redpacket.io kind
// kind: apiVersion, kind, name, namespace and the given status fields, nothing else.
func statusApplyObjectOf(kind string, obj client.Object, fields map[string]any) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{"status": fields}}
	u.SetAPIVersion(redpacketv1alpha1.GroupVersion.String())
	u.SetKind(kind)
	u.SetNamespace(obj.GetNamespace())
	u.SetName(obj.GetName())
	return u
}

// mergeControllerStatus writes the controller's fields of src into dst, keeping the
// grab service's.
func mergeControllerStatus(dst *redpacketv1alpha1.RedPacketActivityStatus, src redpacketv1alpha1.RedPacketActivityStatus) {
	dst.Phase = src.Phase
	dst.ObservedGeneration = src.ObservedGeneration
	dst.ScriptSHA = src.ScriptSHA
	dst.Endpoint = src.Endpoint
	dst.SplitSeed = src.SplitSeed
	dst.SeededTime = src.SeededTime
	for _, c := range src.Conditions {
		meta.SetStatusCondition(&dst.Conditions, c)
	}
}

// emitTransitionEvents reports every condition whose status or reason changed, once
// per reason. Settled's routine back-and-forth while claims flow is not reported; its
// dead letters are, and so is full settlement of a closed activity.
func (r *RedPacketActivityReconciler) emitTransitionEvents(a *redpacketv1alpha1.RedPacketActivity, before, after redpacketv1alpha1.RedPacketActivityStatus) {
	if r.Recorder == nil {
		return
	}
	reported := map[string]bool{}
	for _, t := range controllerConditionTypes {
		now := meta.FindStatusCondition(after.Conditions, t)
		if now == nil {
			continue
		}
		was := meta.FindStatusCondition(before.Conditions, t)
		if was != nil && was.Status == now.Status && was.Reason == now.Reason {
			continue
		}
		if t == redpacketv1alpha1.ConditionSettled {
			closed := after.Phase == redpacketv1alpha1.PhaseExhausted || after.Phase == redpacketv1alpha1.PhaseExpired
			if now.Reason != redpacketv1alpha1.ReasonDeadLetters && !(now.Status == metav1.ConditionTrue && closed) {
				continue
			}
		}
		if t == redpacketv1alpha1.ConditionSettlementDegraded && now.Status == metav1.ConditionTrue {
			continue // warnFailingDeliveries says it, and repeats it while it lasts
		}
		if reported[now.Reason] {
			continue
		}
		reported[now.Reason] = true
		eventType := corev1.EventTypeNormal
		if warningReasons[now.Reason] {
			eventType = corev1.EventTypeWarning
		}
		r.Recorder.Eventf(a, nil, eventType, now.Reason, t, "%s is %s: %s", t, now.Status, now.Message)
	}
}

// isNotFoundOrGone reports errors that mean the activity no longer exists.
func isNotFoundOrGone(err error) bool {
	return apierrors.IsNotFound(err) || apierrors.IsGone(err)
}

// snapshotDescribe is a short description of a snapshot for events and logs.
func snapshotDescribe(snap store.Snapshot) string {
	return fmt.Sprintf("state %q, %d of %d claimed, %d settled, refund %d (%d settled), %d dead letters",
		snap.State, snap.ClaimedCount, snap.Count, snap.SettledCount, snap.Refunded, snap.RefundSettled, snap.DeadCount)
}

// reconcileCounters writes the money counters from this reconcile's Redis snapshot
// (one instant, so claimedAmount + remainingAmount + refundedAmount == totalAmount
// holds in what it writes) when the grab service's reports cannot be relied on to:
//
//   - once Seeded is recorded and status has no counters yet, so that they read 0,
//     not blank, from the moment the activity is Ready, and kubectl get shows
//     REMAINING and CLAIMED before the first report;
//   - once the activity is closed in Redis and status differs from the snapshot, so
//     that the refund and the final figures arrive with the close and not with the
//     next report;
//   - while no grab replica reported within GrabReportTimeout and status differs,
//     so that the figures stay true with the grab Deployment scaled to 0 or failing.
//
// The counters writer never writes a snapshot that is behind the live status (the
// fence step has ruled out a rollback, so that only means a report got there first)
// and uses the live resourceVersion as a precondition; either way the write is just
// skipped and the next reconcile looks again. A failure here only delays the figures:
// it is logged, without holding up the rest.
func (r *RedPacketActivityReconciler) reconcileCounters(ctx context.Context, s *activityScope) (stepResult, error) {
	if !s.seededRecorded || !s.snapshotRead || !s.snapshot.Exists() || s.snapshot.Fenced != "" {
		return stepResult{}, nil
	}
	c := s.snapshot.Counters()
	recorded, any := redpacketv1alpha1.RecordedCounters(&s.activity.Status)
	switch {
	case !any:
	case recorded == c:
		return stepResult{}, nil
	case s.snapshot.State == store.StateClosed:
	case !r.grabReportRecent(s):
	default:
		return stepResult{}, nil
	}
	r.writeSnapshotCounters(ctx, s)
	return stepResult{}, nil
}

// writeSnapshotCounters writes the snapshot's money counters through the counters
// writer, never lower than the live status; a status that moved meanwhile, or is
// ahead, is left as it is. Failures are logged: they only delay the figures.
func (r *RedPacketActivityReconciler) writeSnapshotCounters(ctx context.Context, s *activityScope) {
	c := s.snapshot.Counters()
	var epoch int64
	if s.activity.Status.RedisEpoch != nil {
		epoch = *s.activity.Status.RedisEpoch
	}
	err := r.counterWriter().applyCounters(ctx, s.activity, c, epoch, false)
	switch {
	case err == nil:
		redpacketv1alpha1.SetCounters(&s.activity.Status, c)
	case errors.Is(err, errCountersStale), apierrors.IsConflict(err):
		r.logger(ctx).V(1).Info("the status moved since the snapshot; not writing the counters this time")
	case !isNotFoundOrGone(err):
		r.logger(ctx).Error(err, "writing the counters failed; retrying at the next reconcile")
	}
}

// grabReportRecent reports whether a grab replica reported within GrabReportTimeout.
func (r *RedPacketActivityReconciler) grabReportRecent(s *activityScope) bool {
	last := s.activity.Status.LastReportTime
	return last != nil && s.now.Sub(last.Time) < r.Options.GrabReportTimeout
}
