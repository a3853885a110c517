package rpactl

import (
	"bytes"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// rows returns the lines of out whose first field is key, split into fields.
func rows(out, key string) [][]string {
	var found [][]string
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) > 0 && f[0] == key {
			found = append(found, f)
		}
	}
	return found
}

// row returns the one line of out whose first field is key, failing otherwise.
func row(t *testing.T, out, key string) []string {
	t.Helper()
	r := rows(out, key)
	if len(r) != 1 {
		t.Fatalf("%d lines start with %q in\n%s", len(r), key, out)
	}
	return r[0]
}

func sameFields(t *testing.T, got []string, want ...string) {
	t.Helper()
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("row %q, want %q", got, want)
	}
}

// PrintStatus prints the money table, the conservation check, settlement progress
// and the conditions as aligned kubectl-style tables.
func TestPrintStatus(t *testing.T) {
	now := time.Date(2026, 12, 31, 20, 5, 0, 0, time.UTC)
	a := activityWith(1200, 52000, 3800, 148000, nil)
	a.Spec.StartTime = &metav1.Time{Time: time.Date(2026, 12, 31, 20, 0, 0, 0, time.UTC)}
	a.Spec.EndTime = &metav1.Time{Time: time.Date(2026, 12, 31, 20, 10, 0, 0, time.UTC)}
	a.Spec.Settlement = &redpacketv1alpha1.Settlement{Webhook: &redpacketv1alpha1.Webhook{URL: "http://balance.default.svc:8080/credit"}}
	a.Status.Phase = redpacketv1alpha1.PhaseActive
	a.Status.Endpoint = "http://quiz-night-grab.default.svc:8080"
	a.Status.LastReportTime = &metav1.Time{Time: now.Add(-3 * time.Second)}
	a.Status.SettledCount, a.Status.SettledAmount, a.Status.DeadLetterCount = ptr(1100), ptr(50000), ptr(2)
	a.Status.SettlementDelivery = &redpacketv1alpha1.SettlementDeliveryStatus{Retrying: 7, LastErrorClass: "http_5xx",
		LastErrorTime:         &metav1.Time{Time: now.Add(-20 * time.Second)},
		OldestUndeliveredTime: &metav1.Time{Time: time.Date(2026, 12, 31, 20, 1, 0, 0, time.UTC)}}
	a.Status.Conditions = []metav1.Condition{
		{Type: "Ready", Status: metav1.ConditionTrue, Reason: "Active", Message: "grabbing is open;\n1200 of 5000 claimed",
			LastTransitionTime: metav1.Time{Time: now.Add(-5 * time.Minute)}},
		{Type: "Settled", Status: metav1.ConditionFalse, Reason: "DeadLetters", Message: "2 deliveries are parked",
			LastTransitionTime: metav1.Time{Time: now.Add(-90 * time.Second)}},
	}
	var b bytes.Buffer
	if err := PrintStatus(&b, a, now); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	t.Log("\n" + out)

	sameFields(t, row(t, out, "Phase:"), "Phase:", "Active")
	sameFields(t, row(t, out, "Window:"), "Window:", "2026-12-31T20:00:00Z", "→", "2026-12-31T20:10:00Z")
	sameFields(t, row(t, out, "Last"), "Last", "report:", "2026-12-31T20:04:57Z", "(3s", "ago)")
	sameFields(t, row(t, out, "MONEY"), "MONEY", "PACKETS", "AMOUNT", "CNY")
	sameFields(t, row(t, out, "total"), "total", "5000", "200000", "2000.00", "CNY")
	sameFields(t, row(t, out, "claimed"), "claimed", "1200", "52000", "520.00", "CNY")
	sameFields(t, row(t, out, "remaining"), "remaining", "3800", "148000", "1480.00", "CNY")
	sameFields(t, row(t, out, "refunded"), "refunded", "0", "0", "0.00", "CNY")
	sameFields(t, row(t, out, "Invariant:"), "Invariant:", "OK:", "claimed", "+", "remaining", "+", "refunded", "=",
		"52000", "+", "148000", "+", "0", "=", "200000,", "total", "200000")
	sameFields(t, row(t, out, "packets"), "packets", "1100", "1200", "91%")
	sameFields(t, row(t, out, "amount"), "amount", "50000", "52000", "96%")
	sameFields(t, row(t, out, "Dead"), "Dead", "letters:", "2")
	sameFields(t, row(t, out, "Pending:"), "Pending:", "100")
	sameFields(t, row(t, out, "Retrying:"), "Retrying:", "7", "(last", "error:", "http_5xx,", "20s", "ago)")
	sameFields(t, row(t, out, "Oldest"), "Oldest", "undelivered:", "2026-12-31T20:01:00Z", "(4m", "ago)")
	sameFields(t, row(t, out, "Ready"), "Ready", "True", "Active", "5m", "grabbing", "is", "open;", "1200", "of", "5000", "claimed")
	sameFields(t, row(t, out, "Settled"), "Settled", "False", "DeadLetters", "90s", "2", "deliveries", "are", "parked")

	// The columns line up: in each table, every cell starts where its header does.
	for header, body := range map[string][]string{
		"MONEY":      {"total", "claimed", "remaining", "refunded"},
		"SETTLEMENT": {"packets", "amount"},
		"TYPE":       {"Ready", "Settled"},
	} {
		want := cellStarts(line(t, out, header))
		for _, r := range body {
			if got := cellStarts(line(t, out, r)); !slices.Equal(got[:len(want)], want) {
				t.Errorf("row %q starts its cells at %v, its header %q at %v", r, got, header, want)
			}
		}
	}
}

// line returns the line of out whose first field is key.
func line(t *testing.T, out, key string) string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[0] == key {
			return l
		}
	}
	t.Fatalf("no line starts with %q", key)
	return ""
}

// cellStarts returns where the cells of a table line start: after a run of two or
// more spaces, as kubectl's tables pad their columns.
func cellStarts(l string) []int {
	starts := []int{0}
	for i := 2; i < len(l); i++ {
		if l[i] != ' ' && l[i-1] == ' ' && l[i-2] == ' ' {
			starts = append(starts, i)
		}
	}
	return starts
}

// Before seeding, the status has no counters: the table says <none> and the check
// says UNKNOWN instead of inventing zeros.
func TestPrintStatusBeforeTheFirstReport(t *testing.T) {
	a := &redpacketv1alpha1.RedPacketActivity{}
	a.Name, a.Namespace = "later", "promo"
	a.Spec.TotalAmount, a.Spec.Count, a.Spec.Currency = 1500, 3, "JPY"
	a.Status.Phase = redpacketv1alpha1.PhaseSeeding
	var b bytes.Buffer
	if err := PrintStatus(&b, a, time.Now()); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	t.Log("\n" + out)
	sameFields(t, row(t, out, "total"), "total", "3", "1500", "1500", "JPY")
	sameFields(t, row(t, out, "claimed"), "claimed", "<none>", "<none>")
	sameFields(t, row(t, out, "Invariant:"), "Invariant:", "UNKNOWN:", "no", "counters", "reported", "yet")
	sameFields(t, row(t, out, "Last"), "Last", "report:", "<none>")
	sameFields(t, row(t, out, "Window:"), "Window:", "as", "soon", "as", "seeded", "→", "until", "every", "packet", "is", "claimed")
	sameFields(t, row(t, out, "Webhook:"), "Webhook:", "<none>", "(claims", "wait", "in", "the", "stream)")
	if !strings.Contains(out, "CONDITIONS\n<none>") {
		t.Errorf("no conditions are not shown as <none>:\n%s", out)
	}
}

// A violated invariant is shown as VIOLATED with what does not add up.
func TestPrintStatusViolated(t *testing.T) {
	a := activityWith(1200, 52000, 3800, 148000, ptr(148000))
	a.Status.Phase = redpacketv1alpha1.PhaseExpired
	var b bytes.Buffer
	if err := PrintStatus(&b, a, time.Now()); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	if inv := row(t, out, "Invariant:"); inv[1] != "VIOLATED:" {
		t.Errorf("invariant row %q, want VIOLATED", inv)
	}
	if !strings.Contains(out, "- claimed + remaining + refunded = 348000, total is 200000 (off by +148000)") {
		t.Errorf("the violation is not explained:\n%s", out)
	}
}
