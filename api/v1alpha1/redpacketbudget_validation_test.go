package v1alpha1_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	autoscalingv1 "k8s.io/api/autoscaling/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// budget returns a valid budget to mutate.
func budget(ns, name string) *v1alpha1.RedPacketBudget {
	return &v1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha1.RedPacketBudgetSpec{
			Total:   100_000_000,
			Packets: v1alpha1.PacketLimits{MaxTotal: 20_000},
		},
	}
}

func ttl(s string) *metav1.Duration {
	d, err := time.ParseDuration(s)
	if err != nil {
		panic(err)
	}
	return &metav1.Duration{Duration: d}
}

// The API server refuses a budget that could not run, with a message that says why.
func TestImpossibleBudgetsAreRejected(t *testing.T) {
	needsControlPlane(t)
	ns := cp.Namespace(t)
	for _, tc := range []struct {
		name   string
		mutate func(*v1alpha1.RedPacketBudget)
		msg    string
	}{
		{"total zero", func(b *v1alpha1.RedPacketBudget) { b.Spec.Total = 0 },
			"spec.total in body should be greater than or equal to 1"},
		{"max total zero", func(b *v1alpha1.RedPacketBudget) { b.Spec.Packets.MaxTotal = 0 },
			"spec.packets.maxTotal in body should be greater than or equal to 1"},
		{"max count above 1000", func(b *v1alpha1.RedPacketBudget) { b.Spec.Packets.MaxCount = 1001 },
			"spec.packets.maxCount in body should be less than or equal to 1000"},
		{"min share zero", func(b *v1alpha1.RedPacketBudget) { b.Spec.Packets.MinShare = -1 },
			"spec.packets.minShare in body should be greater than or equal to 1"},
		{"min share above max total", func(b *v1alpha1.RedPacketBudget) { b.Spec.Packets.MinShare = 20_001 },
			"packets.maxTotal must be at least packets.minShare"},
		{"unknown distribution", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.Distributions = []v1alpha1.DistributionType{"Even"}
		}, `Unsupported value: "Even"`},
		{"max TTL above 7 days", func(b *v1alpha1.RedPacketBudget) { b.Spec.Packets.MaxTTL = ttl("169h") },
			"packets.maxTTL must be between 1s and 168h (7 days)"},
		{"default TTL above max TTL", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.DefaultTTL, b.Spec.Packets.MaxTTL = ttl("2h"), ttl("1h")
		}, "packets.defaultTTL must not exceed packets.maxTTL"},
		{"default TTL zero", func(b *v1alpha1.RedPacketBudget) { b.Spec.Packets.DefaultTTL = ttl("0s") },
			"packets.defaultTTL must be at least 1s"},
		{"too many shards", func(b *v1alpha1.RedPacketBudget) { b.Spec.BudgetShards = 257 },
			"spec.budgetShards in body should be less than or equal to 256"},
		{"lower-case currency", func(b *v1alpha1.RedPacketBudget) { b.Spec.Currency = "cny" },
			"spec.currency in body should match"},
		{"webhook without scheme", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Settlement = &v1alpha1.Settlement{Webhook: &v1alpha1.Webhook{URL: "balance/credit"}}
		}, "webhook url must start with http:// or https://"},
		{"events webhook without scheme", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Settlement = &v1alpha1.Settlement{Webhook: &v1alpha1.Webhook{URL: "https://balance.example/credits"}}
			b.Spec.Events = &v1alpha1.BudgetEvents{Webhook: v1alpha1.EventsWebhook{URL: "merchant/events"}}
		}, "events webhook url must start with http:// or https://"},
		{"events without a webhook url", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Events = &v1alpha1.BudgetEvents{}
		}, "spec.events.webhook.url"},
		{"events without settlement", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Settlement = nil
			b.Spec.Events = &v1alpha1.BudgetEvents{Webhook: v1alpha1.EventsWebhook{URL: "https://merchant.example/events"}}
		}, "events follow settlement: spec.events needs spec.settlement.webhook"},
		{"events retried too often", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Settlement = &v1alpha1.Settlement{Webhook: &v1alpha1.Webhook{URL: "https://balance.example/credits"}}
			b.Spec.Events = &v1alpha1.BudgetEvents{Webhook: v1alpha1.EventsWebhook{URL: "https://merchant.example/events"}, MaxAttempts: 1001}
		}, "spec.events.maxAttempts in body should be less than or equal to 1000"},
		{"a name too long for its workload", func(b *v1alpha1.RedPacketBudget) { b.Name = strings.Repeat("b", 59) },
			"metadata.name must be a DNS label of at most 58 characters"},
		{"a send window over midnight", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.SendWindows = []v1alpha1.SendWindow{"20:00-02:00"}
		}, "a send window's start must be before its end"},
		{"a send window of no time", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.SendWindows = []v1alpha1.SendWindow{"08:00-08:00"}
		}, "a send window's start must be before its end"},
		{"a send window that is not HH:MM-HH:MM", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.SendWindows = []v1alpha1.SendWindow{"8:00-24:00"}
		}, "spec.packets.sendWindows[0] in body should match"},
		{"a send window ending after 24:00", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.SendWindows = []v1alpha1.SendWindow{"08:00-24:30"}
		}, "spec.packets.sendWindows[0] in body should match"},
		{"nine send windows", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.SendWindows = []v1alpha1.SendWindow{"00:00-01:00", "01:00-02:00", "02:00-03:00", "03:00-04:00",
				"04:00-05:00", "05:00-06:00", "06:00-07:00", "07:00-08:00", "08:00-09:00"}
		}, "must have at most 8 items"},
		{"a time zone with a space", func(b *v1alpha1.RedPacketBudget) { b.Spec.Packets.TimeZone = "Asia/Shang hai" },
			"spec.packets.timeZone in body should match"},
		{"a per-minute quota above a million", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.Quotas = &v1alpha1.PacketQuotas{PerSender: &v1alpha1.SenderQuotas{PacketsPerMinute: 1_000_001}}
		}, "spec.packets.quotas.perSender.packetsPerMinute in body should be less than or equal to 1000000"},
		{"a negative daily quota", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.Quotas = &v1alpha1.PacketQuotas{PerSender: &v1alpha1.SenderQuotas{PacketsPerDay: -1}}
		}, "spec.packets.quotas.perSender.packetsPerDay in body should be greater than or equal to 1"},
		{"a recipient quota above a million", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.Quotas = &v1alpha1.PacketQuotas{PerRecipient: &v1alpha1.RecipientQuotas{SharesPerDay: 1_000_001}}
		}, "spec.packets.quotas.perRecipient.sharesPerDay in body should be less than or equal to 1000000"},
		{"a money quota below the minimum share", func(b *v1alpha1.RedPacketBudget) {
			b.Spec.Packets.MinShare = 100
			b.Spec.Packets.Quotas = &v1alpha1.PacketQuotas{PerSender: &v1alpha1.SenderQuotas{AmountPerDay: 99}}
		}, "packets.quotas.perSender.amountPerDay must be at least packets.minShare"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := budget(ns, strings.ToLower(strings.ReplaceAll(tc.name, " ", "-")))
			tc.mutate(b)
			expectRejected(t, cp.Client.Create(testCtx(t), b), tc.msg)
		})
	}
}

// A budget gets its defaults; its total may be raised but never lowered, and its
// shards never change.
func TestBudgetDefaultsAndTransitions(t *testing.T) {
	needsControlPlane(t)
	ctx := testCtx(t)
	ns := cp.Namespace(t)
	b := budget(ns, "refill")
	if err := cp.Client.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	p := b.Spec.Packets
	if b.Spec.Currency != "CNY" || b.Spec.BudgetShards != 16 || p.MaxCount != 100 || p.MinShare != 1 ||
		len(p.Distributions) != 3 || p.DefaultTTL == nil || p.DefaultTTL.Duration != 24*time.Hour ||
		p.MaxTTL == nil || p.MaxTTL.Duration != 24*time.Hour {
		t.Errorf("defaults %+v", b.Spec)
	}

	b.Spec.Total = 150_000_000
	if err := cp.Client.Update(ctx, b); err != nil {
		t.Fatalf("a refill was refused: %v", err)
	}
	// Events, added later beside settlement, with maxAttempts defaulted.
	b.Spec.Settlement = &v1alpha1.Settlement{Webhook: &v1alpha1.Webhook{URL: "https://balance.example/credits"}}
	b.Spec.Events = &v1alpha1.BudgetEvents{Webhook: v1alpha1.EventsWebhook{URL: "https://merchant.example/events"}}
	if err := cp.Client.Update(ctx, b); err != nil || b.Spec.Events.MaxAttempts != 20 {
		t.Fatalf("events: %v, maxAttempts %d; want accepted with 20", err, b.Spec.Events.MaxAttempts)
	}
	lowered := b.DeepCopy()
	lowered.Spec.Total = 149_999_999
	expectRejected(t, cp.Client.Update(ctx, lowered), "total may only grow")
	reshard := b.DeepCopy()
	reshard.Spec.BudgetShards = 32
	expectRejected(t, cp.Client.Update(ctx, reshard), "budgetShards is immutable")
}

// A budget's quotas, each optional, are stored as written.
func TestBudgetQuotasAccepted(t *testing.T) {
	needsControlPlane(t)
	ctx := testCtx(t)
	b := budget(cp.Namespace(t), "quotas")
	b.Spec.Packets.TimeZone = "Asia/Shanghai"
	b.Spec.Packets.Quotas = &v1alpha1.PacketQuotas{
		PerSender:    &v1alpha1.SenderQuotas{PacketsPerMinute: 1800, PacketsPerDay: 10_000, AmountPerDay: 5_000_000},
		PerRecipient: &v1alpha1.RecipientQuotas{SharesPerDay: 10},
	}
	if err := cp.Client.Create(ctx, b); err != nil {
		t.Fatalf("a budget with quotas was refused: %v", err)
	}
	got := &v1alpha1.RedPacketBudget{}
	if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(b), got); err != nil {
		t.Fatal(err)
	}
	if q := got.Spec.Packets.Quotas; q == nil || *q.PerSender != *b.Spec.Packets.Quotas.PerSender || *q.PerRecipient != *b.Spec.Packets.Quotas.PerRecipient {
		t.Fatalf("quotas stored as %+v", q)
	}
}

// The scale subresource reads and writes spec.grabService.replicas, so kubectl scale
// and an HPA can drive the grab fleet through the budget.
func TestBudgetScaleSubresource(t *testing.T) {
	needsControlPlane(t)
	ctx := testCtx(t)
	ns := cp.Namespace(t)
	b := budget(ns, "scaled")
	b.Spec.GrabService.Replicas = new(int32(2))
	if err := cp.Client.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	scale := &autoscalingv1.Scale{}
	if err := cp.Client.SubResource("scale").Get(ctx, b, scale); err != nil {
		t.Fatalf("reading the scale subresource: %v", err)
	}
	if scale.Spec.Replicas != 2 {
		t.Errorf("scale replicas %d, want 2", scale.Spec.Replicas)
	}
	scale.Spec.Replicas = 5
	if err := cp.Client.SubResource("scale").Update(ctx, b, client.WithSubResourceBody(scale)); err != nil {
		t.Fatalf("scaling: %v", err)
	}
	got := &v1alpha1.RedPacketBudget{}
	if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(b), got); err != nil {
		t.Fatal(err)
	}
	if got.Spec.GrabService.Replicas == nil || *got.Spec.GrabService.Replicas != 5 {
		t.Errorf("spec.grabService.replicas %v after scaling to 5", got.Spec.GrabService.Replicas)
	}
}

// `kubectl get rpb` shows the money columns, and -o wide the rates.
func TestKubectlGetBudgetColumns(t *testing.T) {
	ctx := testCtx(t)
	k := newKubectl(t)
	ns := cp.Namespace(t)
	b := budget(ns, "columns")
	if err := cp.Client.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	b.Status = v1alpha1.RedPacketBudgetStatus{
		Total: new(int64(100_000_000)), Available: new(int64(99_990_000)), InPackets: new(int64(6000)),
		Claimed: new(int64(3000)), Refunded: new(int64(1000)), LivePackets: new(int64(12)),
		CreatedPerSecond: new(int64(5100)), GrabbedPerSecond: new(int64(9800)),
		Conditions: []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonBudgetReady,
			Message: "ready", LastTransitionTime: metav1.Now()}},
	}
	if err := cp.Client.Status().Update(ctx, b); err != nil {
		t.Fatal(err)
	}
	out, err := k.run(ctx, "get", "rpb", "-n", ns)
	if err != nil {
		t.Fatalf("kubectl get rpb: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 {
		t.Fatalf("kubectl get rpb printed %d lines:\n%s", len(lines), out)
	}
	if got := strings.Fields(lines[0]); !slices.Equal(got, []string{"NAME", "TOTAL", "AVAILABLE", "IN-PACKETS", "CLAIMED", "REFUNDED", "LIVE", "READY", "AGE"}) {
		t.Errorf("columns %v", got)
	}
	if got := strings.Fields(lines[1]); len(got) != 9 || !slices.Equal(got[:8], []string{"columns", "100000000", "99990000", "6000", "3000", "1000", "12", "True"}) {
		t.Errorf("row %v", got)
	}
	out, err = k.run(ctx, "get", "rpb", "-n", ns, "-o", "wide")
	if err != nil {
		t.Fatalf("kubectl get rpb -o wide: %v\n%s", err, out)
	}
	for _, want := range []string{"CREATED/S", "GRABBED/S", "5100", "9800"} {
		if !strings.Contains(out, want) {
			t.Errorf("-o wide lacks %s:\n%s", want, out)
		}
	}
}
