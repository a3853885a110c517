package node

import (
	"fmt"
	"testing"
	"time"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// TestPrewarmOnTheNode: capacity warmed for a known start on the real node, by the
// real HorizontalPodAutoscaler controller. An activity starts 90 s after it is
// applied, with autoscaling 1→8 and prewarm.replicas 4 over [start − 60 s, end +
// 20 s): its HPA's minimum goes to 4 when the window opens, 4 grab pods are
// Available and Prewarmed is True before startTime, and the minimum is back at 1
// holdAfter after endTime (the HPA then free to scale down). A second activity with
// the same start asks for 30 prewarmed pods, more than the node's CPU can hold (each
// grab pod requests 100m of its 2 CPUs): before startTime it is Prewarmed False
// Warming with how many are available, and at startTime Prewarmed False and Ready
// False with NotPrewarmed, with a Warning event. The timestamps are logged.
func TestPrewarmOnTheNode(t *testing.T) {
	requireNode(t)
	ns := namespace(t, "e2e-prewarm")
	applied := time.Now()
	start := applied.Add(90 * time.Second).Truncate(time.Second)
	end := start.Add(30 * time.Second)
	kubectl(t, prewarmedManifest(ns, "warm", start, end, 4)+"---\n"+prewarmedManifest(ns, "short", start, end, 30), "apply", "-f", "-")
	since := func(at time.Time) string { return fmt.Sprintf("%+.1fs", at.Sub(start).Seconds()) }

	hpaMin := func(name string) int32 {
		h := &autoscalingv2.HorizontalPodAutoscaler{}
		if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name + "-grab"}, h); err != nil || h.Spec.MinReplicas == nil {
			return 0
		}
		return *h.Spec.MinReplicas
	}
	prewarmed := func(name string) *metav1.Condition {
		return meta.FindStatusCondition(activity(t, ns, name).Status.Conditions, redpacketv1alpha1.ConditionPrewarmed)
	}

	// The window opens 60 s before the start: the minimum goes to 4.
	eventually(t, 2*time.Minute, "warm's HPA minimum at 4", func() error {
		if m := hpaMin("warm"); m != 4 {
			return fmt.Errorf("minReplicas %d", m)
		}
		return nil
	})
	raised := time.Now()
	if raised.Before(start.Add(-61 * time.Second)) {
		t.Errorf("the minimum was raised at %s, before the window opened (-60s)", since(raised))
	}
	eventually(t, time.Until(start), "warm: 4 grab pods Available and Prewarmed=True before startTime", func() error {
		d := deployment(t, ns, "warm-grab")
		c := prewarmed("warm")
		if d.Status.AvailableReplicas < 4 || c == nil || c.Status != metav1.ConditionTrue {
			return fmt.Errorf("%d available, Prewarmed %v", d.Status.AvailableReplicas, c)
		}
		return nil
	})
	warmed := time.Now()
	t.Logf("warm: HPA minimum 4 at %s, 4 pods Available and Prewarmed=True at %s (startTime %s)",
		since(raised), since(warmed), start.Format(time.RFC3339))

	// Before startTime the short one says it is still warming, and how far it got.
	if c := prewarmed("short"); c == nil || c.Status != metav1.ConditionFalse || c.Reason != redpacketv1alpha1.ReasonWarming {
		t.Errorf("short before startTime: Prewarmed %v, want False Warming", c)
	} else {
		t.Logf("short at %s: Prewarmed=False Warming: %s", since(time.Now()), c.Message)
	}

	// At startTime the short one has not got its 30.
	eventually(t, time.Until(start)+time.Minute, "short: Prewarmed=False NotPrewarmed and Ready=False NotPrewarmed", func() error {
		a := activity(t, ns, "short")
		c := meta.FindStatusCondition(a.Status.Conditions, redpacketv1alpha1.ConditionPrewarmed)
		r := meta.FindStatusCondition(a.Status.Conditions, redpacketv1alpha1.ConditionReady)
		if c == nil || c.Reason != redpacketv1alpha1.ReasonNotPrewarmed || r == nil || r.Status != metav1.ConditionFalse ||
			r.Reason != redpacketv1alpha1.ReasonNotPrewarmed {
			return fmt.Errorf("Prewarmed %v, Ready %v", c, r)
		}
		return nil
	})
	short := time.Now()
	if short.Before(start) {
		t.Errorf("short was NotPrewarmed at %s, before startTime", since(short))
	}
	var warning string
	eventually(t, 30*time.Second, "short's Warning NotPrewarmed", func() error {
		list := &corev1.EventList{}
		if err := env.client.List(t.Context(), list, client.InNamespace(ns)); err != nil {
			return err
		}
		for _, e := range list.Items {
			if e.InvolvedObject.Name == "short" && e.Type == corev1.EventTypeWarning && e.Reason == redpacketv1alpha1.ReasonNotPrewarmed {
				warning = e.Message
				return nil
			}
		}
		return fmt.Errorf("no such event among %d", len(list.Items))
	})
	c := prewarmed("short")
	t.Logf("short: NotPrewarmed at %s: %s; Warning: %s", since(short), c.Message, warning)
	// The impossible fleet is given up now, so that its pending pods do not weigh on the rest.
	kubectl(t, "", "-n", ns, "delete", "rpa", "short", "--timeout=120s")

	// The window closes 20 s after endTime: the minimum goes back to 1.
	eventually(t, time.Until(end)+2*time.Minute, "warm's HPA minimum back at 1", func() error {
		if m := hpaMin("warm"); m != 1 {
			return fmt.Errorf("minReplicas %d", m)
		}
		return nil
	})
	released := time.Now()
	if released.Before(end.Add(20 * time.Second)) {
		t.Errorf("the minimum was released at %s, before endTime + holdAfter", since(released))
	}
	// The condition is written by the same reconcile, after the HPA: its status apply
	// can come a moment later than the minimum.
	eventually(t, 15*time.Second, "warm's Prewarmed PrewarmReleased", func() error {
		if c := prewarmed("warm"); c == nil || c.Reason != redpacketv1alpha1.ReasonPrewarmReleased {
			return fmt.Errorf("warm's Prewarmed after the window: %v, want PrewarmReleased", c)
		}
		return nil
	})
	t.Logf("warm: minimum back at 1 at %s (endTime %s, holdAfter 20s); HPA %d..8, free to scale down",
		since(released), since(end), hpaMin("warm"))
	kubectl(t, "", "-n", ns, "delete", "rpa", "warm", "--timeout=120s")
}

// prewarmedManifest is an activity between start and end, autoscaled 1..max(8,
// replicas) with prewarm.replicas, a 60 s lead and a 20 s holdAfter.
func prewarmedManifest(ns, name string, start, end time.Time, replicas int) string {
	return fmt.Sprintf(`apiVersion: redpacket.io/v1alpha1
kind: RedPacketActivity
metadata:
  name: %s
  namespace: %s
spec:
  totalAmount: 10000
  count: 100
  currency: CNY
  distribution: {type: Random, minAmount: 1}
  sponsor: merchant-e2e
  startTime: %s
  endTime: %s
  grabService:
    autoscaling:
      minReplicas: 1
      maxReplicas: %d
      prewarm: {replicas: %d, lead: 60s, holdAfter: 20s}
    auth:
      tokenSecretRef: {name: grab-hmac}
  settlement:
    webhook:
      url: %s
      secretRef: {name: balance-hmac}
`, name, ns, start.UTC().Format(time.RFC3339), end.UTC().Format(time.RFC3339), max(8, replicas), replicas, env.balance.WebhookURL())
}
