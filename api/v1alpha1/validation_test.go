package v1alpha1_test

import (
	"context"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1alpha1 "redpacket.io/operator/api/v1alpha1"
)

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// activity returns a valid activity to mutate.
func activity(ns, name string) *v1alpha1.RedPacketActivity {
	return &v1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha1.RedPacketActivitySpec{
			TotalAmount: 200_000,
			Count:       5000,
			Sponsor:     "merchant-001",
		},
	}
}

func at(s string) *metav1.Time {
	tm, err := time.Parse(time.RFC3339, s)
	if err != nil {
		panic(err)
	}
	return &metav1.Time{Time: tm}
}

// expectRejected checks that err is an Invalid error from the API server that
// carries msg.
func expectRejected(t *testing.T, err error, msg string) {
	t.Helper()
	if err == nil {
		t.Fatalf("the API server accepted it; want a rejection with %q", msg)
	}
	if !apierrors.IsInvalid(err) {
		t.Fatalf("error %v is not an Invalid error", err)
	}
	if !strings.Contains(err.Error(), msg) {
		t.Fatalf("error %q does not carry %q", err, msg)
	}
	t.Logf("rejected: %v", err)
}

func TestImpossibleSpecsAreRejected(t *testing.T) {
	needsControlPlane(t)
	ns := cp.Namespace(t)
	for _, tc := range []struct {
		name   string
		mutate func(*v1alpha1.RedPacketActivitySpec)
		msg    string
	}{
		{"count zero", func(s *v1alpha1.RedPacketActivitySpec) { s.Count = 0 },
			"spec.count in body should be greater than or equal to 1"},
		{"count negative", func(s *v1alpha1.RedPacketActivitySpec) { s.Count = -4 },
			"spec.count in body should be greater than or equal to 1"},
		{"total zero", func(s *v1alpha1.RedPacketActivitySpec) { s.TotalAmount = 0 },
			"spec.totalAmount in body should be greater than or equal to 1"},
		{"total below count × default min", func(s *v1alpha1.RedPacketActivitySpec) { s.TotalAmount = 4999 },
			"totalAmount must be at least count × distribution.minAmount"},
		{"total below count × min", func(s *v1alpha1.RedPacketActivitySpec) {
			s.Distribution.MinAmount = 41 // 5000 × 41 = 205000 > 200000
		}, "totalAmount must be at least count × distribution.minAmount"},
		{"max below min", func(s *v1alpha1.RedPacketActivitySpec) {
			s.Distribution.MinAmount, s.Distribution.MaxAmount = 10, 9
		}, "distribution.maxAmount must not be below distribution.minAmount"},
		{"total above count × max", func(s *v1alpha1.RedPacketActivitySpec) {
			s.Distribution.MaxAmount = 39 // 5000 × 39 = 195000 < 200000
		}, "totalAmount must not exceed count × distribution.maxAmount"},
		{"total above count × max by one", func(s *v1alpha1.RedPacketActivitySpec) {
			s.TotalAmount, s.Count, s.Distribution.MaxAmount = 1001, 10, 100
		}, "totalAmount must not exceed count × distribution.maxAmount"},
		{"end before start", func(s *v1alpha1.RedPacketActivitySpec) {
			s.StartTime, s.EndTime = at("2026-12-31T20:10:00Z"), at("2026-12-31T20:00:00Z")
		}, "endTime must be after startTime"},
		{"end equal to start", func(s *v1alpha1.RedPacketActivitySpec) {
			s.StartTime, s.EndTime = at("2026-12-31T20:00:00Z"), at("2026-12-31T20:00:00Z")
		}, "endTime must be after startTime"},
		{"unknown distribution", func(s *v1alpha1.RedPacketActivitySpec) { s.Distribution.Type = "Even" },
			`spec.distribution.type: Unsupported value: "Even"`},
		{"lower-case currency", func(s *v1alpha1.RedPacketActivitySpec) { s.Currency = "cny" },
			"spec.currency in body should match"},
		{"webhook without scheme", func(s *v1alpha1.RedPacketActivitySpec) {
			s.Settlement = &v1alpha1.Settlement{Webhook: &v1alpha1.Webhook{URL: "balance:8080/credit"}}
		}, "webhook url must start with http:// or https://"},
		{"more shards than the maximum", func(s *v1alpha1.RedPacketActivitySpec) { s.Shards = 65 },
			"spec.shards in body should be less than or equal to 64"},
		{"negative shards", func(s *v1alpha1.RedPacketActivitySpec) { s.Shards = -1 },
			"spec.shards in body should be greater than or equal to 1"},
		{"more shards than packets", func(s *v1alpha1.RedPacketActivitySpec) {
			s.Count, s.TotalAmount, s.Shards = 3, 300, 4
			s.Durability = &v1alpha1.Durability{Mode: v1alpha1.DurabilityFsync}
		}, "shards must not exceed count"},
		{"shards without durability", func(s *v1alpha1.RedPacketActivitySpec) { s.Shards = 2 },
			"shards above 1 need durability Fsync or Replicas"},
		{"shards with durability None", func(s *v1alpha1.RedPacketActivitySpec) {
			s.Shards = 2
			s.Durability = &v1alpha1.Durability{Mode: v1alpha1.DurabilityNone}
		}, "shards above 1 need durability Fsync or Replicas"},
		{"webhook without a sponsor", func(s *v1alpha1.RedPacketActivitySpec) {
			s.Sponsor = ""
			s.Settlement = &v1alpha1.Settlement{Webhook: &v1alpha1.Webhook{URL: "http://balance:8080/credit"}}
		}, "sponsor is required with settlement.webhook"},
		{"start spread without a start", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.StartSpread = &metav1.Duration{Duration: 3 * time.Second}
		}, "grabService.startSpread needs startTime"},
		{"start spread as long as the window", func(s *v1alpha1.RedPacketActivitySpec) {
			s.StartTime, s.EndTime = at("2026-12-31T20:00:00Z"), at("2026-12-31T20:00:03Z")
			s.GrabService.StartSpread = &metav1.Duration{Duration: 3 * time.Second}
		}, "grabService.startSpread must end before endTime"},
		{"start spread over ten minutes", func(s *v1alpha1.RedPacketActivitySpec) {
			s.StartTime = at("2026-12-31T20:00:00Z")
			s.GrabService.StartSpread = &metav1.Duration{Duration: 10*time.Minute + time.Millisecond}
		}, "grabService.startSpread must be between 0s and 10m"},
		{"negative start spread", func(s *v1alpha1.RedPacketActivitySpec) {
			s.StartTime = at("2026-12-31T20:00:00Z")
			s.GrabService.StartSpread = &metav1.Duration{Duration: -time.Second}
		}, "grabService.startSpread must be between 0s and 10m"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := activity(ns, strings.ReplaceAll(strings.ReplaceAll(tc.name, " ", "-"), "×", "x"))
			tc.mutate(&a.Spec)
			expectRejected(t, cp.Client.Create(testCtx(t), a), tc.msg)
		})
	}
}

func TestBoundariesAreAccepted(t *testing.T) {
	needsControlPlane(t)
	ns := cp.Namespace(t)
	for _, tc := range []struct {
		name   string
		mutate func(*v1alpha1.RedPacketActivitySpec)
	}{
		{"total equals count × min", func(s *v1alpha1.RedPacketActivitySpec) { s.Distribution.MinAmount = 40 }},
		{"total equals count × max", func(s *v1alpha1.RedPacketActivitySpec) { s.Distribution.MaxAmount = 40 }},
		{"max equals min", func(s *v1alpha1.RedPacketActivitySpec) {
			s.Distribution.MinAmount, s.Distribution.MaxAmount = 40, 40
		}},
		{"max zero means no cap", func(s *v1alpha1.RedPacketActivitySpec) { s.Distribution.MaxAmount = 0 }},
		{"one packet", func(s *v1alpha1.RedPacketActivitySpec) { s.Count = 1 }},
		{"largest total", func(s *v1alpha1.RedPacketActivitySpec) {
			s.TotalAmount, s.Count = 1_000_000_000_000_000, 10_000_000
		}},
		{"end one second after start", func(s *v1alpha1.RedPacketActivitySpec) {
			s.StartTime, s.EndTime = at("2026-12-31T20:00:00Z"), at("2026-12-31T20:00:01Z")
		}},
		{"only an end", func(s *v1alpha1.RedPacketActivitySpec) { s.EndTime = at("2026-12-31T20:00:01Z") }},
		{"most shards", func(s *v1alpha1.RedPacketActivitySpec) {
			s.Shards = 64
			s.Durability = &v1alpha1.Durability{Mode: v1alpha1.DurabilityFsync}
		}},
		{"as many shards as packets", func(s *v1alpha1.RedPacketActivitySpec) {
			s.Count, s.TotalAmount, s.Shards = 4, 400, 4
			s.Durability = &v1alpha1.Durability{Mode: v1alpha1.DurabilityReplicas, Replicas: 1}
		}},
		{"start spread of ten minutes a second inside the window", func(s *v1alpha1.RedPacketActivitySpec) {
			s.StartTime, s.EndTime = at("2026-12-31T20:00:00Z"), at("2026-12-31T20:10:01Z")
			s.GrabService.StartSpread = &metav1.Duration{Duration: 10 * time.Minute}
		}},
		{"start spread without an end", func(s *v1alpha1.RedPacketActivitySpec) {
			s.StartTime = at("2026-12-31T20:00:00Z")
			s.GrabService.StartSpread = &metav1.Duration{Duration: 3 * time.Second}
		}},
		{"zero start spread without a start", func(s *v1alpha1.RedPacketActivitySpec) {
			s.GrabService.StartSpread = &metav1.Duration{}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := activity(ns, strings.ReplaceAll(strings.ReplaceAll(tc.name, " ", "-"), "×", "x"))
			tc.mutate(&a.Spec)
			if err := cp.Client.Create(testCtx(t), a); err != nil {
				t.Fatalf("a valid spec was rejected: %v", err)
			}
		})
	}
}

func TestDefaultsAreApplied(t *testing.T) {
	needsControlPlane(t)
	ctx := testCtx(t)
	ns := cp.Namespace(t)
	a := activity(ns, "defaults")
	a.Spec.Settlement = &v1alpha1.Settlement{Webhook: &v1alpha1.Webhook{URL: "http://balance.default.svc:8080/credit"}}
	if err := cp.Client.Create(ctx, a); err != nil {
		t.Fatalf("creating a good activity: %v", err)
	}
	got := &v1alpha1.RedPacketActivity{}
	if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(a), got); err != nil {
		t.Fatal(err)
	}
	s := got.Spec
	if s.Currency != "CNY" {
		t.Errorf("currency %q, want the default CNY", s.Currency)
	}
	if s.Distribution.Type != v1alpha1.DistributionRandom {
		t.Errorf("distribution.type %q, want the default Random", s.Distribution.Type)
	}
	if s.Distribution.MinAmount != 1 {
		t.Errorf("distribution.minAmount %d, want the default 1", s.Distribution.MinAmount)
	}
	if s.Distribution.MaxAmount != 0 || s.Distribution.Seed != nil {
		t.Errorf("distribution %+v: maxAmount and seed must stay unset", s.Distribution)
	}
	if s.Settlement == nil || s.Settlement.MaxAttempts != 20 {
		t.Errorf("settlement %+v, want maxAttempts defaulted to 20", s.Settlement)
	}
	if s.TotalAmount != 200_000 || s.Count != 5000 || s.Sponsor != "merchant-001" {
		t.Errorf("spec %+v does not keep what was sent", s)
	}
	if s.Shards != 1 {
		t.Errorf("shards %d, want the default 1", s.Shards)
	}
	if s.StartTime != nil || s.EndTime != nil || s.Paused || s.Redis != nil || s.GrabService.Replicas != nil {
		t.Errorf("spec %+v gained values nobody set", s)
	}

	// Without settlement nothing is defaulted into it.
	b := activity(ns, "no-settlement")
	if err := cp.Client.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(b), got); err != nil {
		t.Fatal(err)
	}
	if got.Spec.Settlement != nil {
		t.Errorf("settlement %+v appeared although it was not set", got.Spec.Settlement)
	}

	// Values the user gives are kept, not replaced by defaults.
	c := activity(ns, "explicit")
	c.Spec.Currency = "USD"
	c.Spec.Distribution = v1alpha1.Distribution{Type: v1alpha1.DistributionLineCut, MinAmount: 7, MaxAmount: 100, Seed: ptr.To[int64](-42)}
	c.Spec.Settlement = &v1alpha1.Settlement{MaxAttempts: 3}
	if err := cp.Client.Create(ctx, c); err != nil {
		t.Fatal(err)
	}
	if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(c), got); err != nil {
		t.Fatal(err)
	}
	d := got.Spec.Distribution
	if got.Spec.Currency != "USD" || d.Type != v1alpha1.DistributionLineCut || d.MinAmount != 7 || d.MaxAmount != 100 ||
		d.Seed == nil || *d.Seed != -42 || got.Spec.Settlement.MaxAttempts != 3 {
		t.Errorf("explicit spec came back as %+v", got.Spec)
	}
}

func TestMoneyFieldsAreImmutable(t *testing.T) {
	needsControlPlane(t)
	ctx := testCtx(t)
	ns := cp.Namespace(t)
	a := activity(ns, "immutable")
	a.Spec.Distribution.Seed = ptr.To[int64](7)
	if err := cp.Client.Create(ctx, a); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		mutate func(*v1alpha1.RedPacketActivitySpec)
		msg    string
	}{
		{"total", func(s *v1alpha1.RedPacketActivitySpec) { s.TotalAmount = 300_000 }, "totalAmount is immutable"},
		{"count", func(s *v1alpha1.RedPacketActivitySpec) { s.Count = 4000 }, "count is immutable"},
		{"distribution type", func(s *v1alpha1.RedPacketActivitySpec) { s.Distribution.Type = v1alpha1.DistributionFixed },
			"distribution is immutable"},
		{"distribution min", func(s *v1alpha1.RedPacketActivitySpec) { s.Distribution.MinAmount = 2 }, "distribution is immutable"},
		{"distribution max", func(s *v1alpha1.RedPacketActivitySpec) { s.Distribution.MaxAmount = 1000 }, "distribution is immutable"},
		{"distribution seed", func(s *v1alpha1.RedPacketActivitySpec) { s.Distribution.Seed = ptr.To[int64](8) }, "distribution is immutable"},
		{"distribution seed removed", func(s *v1alpha1.RedPacketActivitySpec) { s.Distribution.Seed = nil }, "distribution is immutable"},
		{"shards", func(s *v1alpha1.RedPacketActivitySpec) { s.Shards = 2 }, "shards is immutable"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cur := &v1alpha1.RedPacketActivity{}
			if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(a), cur); err != nil {
				t.Fatal(err)
			}
			tc.mutate(&cur.Spec)
			expectRejected(t, cp.Client.Update(ctx, cur), tc.msg)
		})
	}

	// Everything else may change: the schedule, the pause flag, the sponsor.
	cur := &v1alpha1.RedPacketActivity{}
	if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(a), cur); err != nil {
		t.Fatal(err)
	}
	cur.Spec.Paused = true
	cur.Spec.EndTime = at("2027-01-01T00:00:00Z")
	cur.Spec.Sponsor = "merchant-002"
	if err := cp.Client.Update(ctx, cur); err != nil {
		t.Fatalf("updating mutable fields: %v", err)
	}
	if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(a), cur); err != nil {
		t.Fatal(err)
	}
	if !cur.Spec.Paused || cur.Spec.TotalAmount != 200_000 || *cur.Spec.Distribution.Seed != 7 {
		t.Fatalf("after the update: %+v", cur.Spec)
	}
	// A merge patch of the total is refused the same way.
	patch := client.RawPatch("application/merge-patch+json", []byte(`{"spec":{"totalAmount":1}}`))
	expectRejected(t, cp.Client.Patch(ctx, cur, patch), "totalAmount is immutable")
}

func TestStatusIsASubresource(t *testing.T) {
	needsControlPlane(t)
	ctx := testCtx(t)
	ns := cp.Namespace(t)
	a := activity(ns, "status")
	if err := cp.Client.Create(ctx, a); err != nil {
		t.Fatal(err)
	}
	// Status written with the main resource is ignored...
	a.Status.Phase = v1alpha1.PhaseActive
	a.Spec.Paused = true
	if err := cp.Client.Update(ctx, a); err != nil {
		t.Fatal(err)
	}
	got := &v1alpha1.RedPacketActivity{}
	if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(a), got); err != nil {
		t.Fatal(err)
	}
	if got.Status.Phase != "" || !got.Spec.Paused {
		t.Fatalf("phase %q paused %v: status must not change through the main resource", got.Status.Phase, got.Spec.Paused)
	}
	// ...and taken through the status subresource, where the phase enum is enforced.
	got.Status.Phase = v1alpha1.PhaseActive
	got.Status.RemainingCount = ptr.To[int64](5000)
	if err := cp.Client.Status().Update(ctx, got); err != nil {
		t.Fatalf("status update: %v", err)
	}
	got.Status.Phase = "Running"
	expectRejected(t, cp.Client.Status().Update(ctx, got), `status.phase: Unsupported value: "Running"`)
}
