package controllers_test

import (
	"context"
	"strings"
	"testing"
	"time"

	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// A time zone that passes the API server's pattern but is in no time-zone database
// is the budget's to report, not only the grab pods': Ready False InvalidTimeZone,
// naming the zone and what it stops, and a Warning event; the grab workload is still
// applied (grabs go on). Corrected, the reason goes.
func TestBudgetWithAnUnknownTimeZone(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startBudgetController(e.recordingSettlement())

	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "mars"},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{
			Total: 100_000,
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 1000,
				SendWindows: []redpacketv1alpha1.SendWindow{"08:00-24:00"}, TimeZone: "Mars/Olympus_Mons"},
		},
	}
	if err := e.c.Create(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	ready := func(b *redpacketv1alpha1.RedPacketBudget) *metav1.Condition {
		return meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReady)
	}
	got := e.waitRedPacketBudget("mars", "Ready False InvalidTimeZone", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := ready(b)
		return c != nil && c.Status == metav1.ConditionFalse && c.Reason == redpacketv1alpha1.ReasonInvalidTimeZone
	})
	if msg := ready(got).Message; !strings.Contains(msg, `"Mars/Olympus_Mons"`) || !strings.Contains(msg, "creations are refused") {
		t.Errorf("Ready's message %q does not name the zone and what it stops", msg)
	}
	if got.Status.Endpoint == "" {
		t.Error("no endpoint: the grab workload was not applied")
	}
	e.waitEvent("mars", "Warning", redpacketv1alpha1.ReasonInvalidTimeZone)
	// Reconciles while the zone stays wrong (two changes of the replicas) raise no
	// second Warning: a repeat would make the event a series.
	for n := range int32(2) {
		e.patchBudget("mars", func(b *redpacketv1alpha1.RedPacketBudget) { b.Spec.GrabService.Replicas = ptr(2 + n) })
	}
	e.waitRedPacketBudget("mars", "the changes reconciled", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		return b.Status.ObservedGeneration == b.Generation && b.Spec.GrabService.Replicas != nil && *b.Spec.GrabService.Replicas == 3
	})
	time.Sleep(time.Second) // the recorder writes in the background
	list := &eventsv1.EventList{}
	if err := e.c.List(context.Background(), list, client.InNamespace(e.ns)); err != nil {
		t.Fatal(err)
	}
	for _, ev := range list.Items {
		if ev.Regarding.Name == "mars" && ev.Reason == redpacketv1alpha1.ReasonInvalidTimeZone && ev.Series != nil {
			t.Errorf("the InvalidTimeZone Warning was raised %d times, want once", ev.Series.Count)
		}
	}

	e.patchBudget("mars", func(b *redpacketv1alpha1.RedPacketBudget) { b.Spec.Packets.TimeZone = "Asia/Shanghai" })
	e.waitRedPacketBudget("mars", "Ready's reason no longer InvalidTimeZone", 20*time.Second, func(b *redpacketv1alpha1.RedPacketBudget) bool {
		c := ready(b)
		return c != nil && c.Reason != redpacketv1alpha1.ReasonInvalidTimeZone
	})
}
