package e2e

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/store"
)

// TestActivityThroughKubectl walks one activity through its life with kubectl and
// HTTP: apply, wait for Ready, grab, watch the printed columns, pause and resume,
// delete, and check that settlement credited everything and Redis is clean.
func TestActivityThroughKubectl(t *testing.T) {
	ns := namespace(t, "e2e-rain")
	bal, balURL := newBalance(t)
	const (
		name    = "rain"
		total   = int64(10000)
		count   = int64(100)
		sponsor = "merchant-e2e"
	)
	spec := fmt.Sprintf(`  totalAmount: %d
  count: %d
  currency: CNY
  distribution:
    type: Random
    minAmount: 1
  sponsor: %s
  settlement:
    webhook:
      url: %s
    maxAttempts: 5
`, total, count, sponsor, balURL)
	path := writeFile(t, "rain.yaml", manifest(ns, name, spec))
	if out := mustKubectl(t, "", "apply", "-f", path); !strings.Contains(out, "created") {
		t.Fatalf("kubectl apply: %q", out)
	}
	// Ready needs a grab replica: the packets first, then the grab service, then Ready.
	mustKubectl(t, "", "wait", "--for=condition=Seeded", "rpa/"+name, "-n", ns, "--timeout=90s")
	base := startGrab(t, ns, name)
	mustKubectl(t, "", "wait", "--for=condition=Ready", "rpa/"+name, "-n", ns, "--timeout=90s")
	if got := mustKubectl(t, "", "get", "rpa", name, "-n", ns, "-o", "jsonpath={.status.scriptSHA}"); got != lua.GrabScript.SHA() {
		t.Fatalf("status.scriptSHA = %q, want %q", got, lua.GrabScript.SHA())
	}
	if got := mustKubectl(t, "", "get", "rpa", name, "-n", ns, "-o", "jsonpath={.status.phase}"); got != "Active" {
		t.Fatalf("phase = %q, want Active", got)
	}
	uid := mustKubectl(t, "", "get", "rpa", name, "-n", ns, "-o", "jsonpath={.metadata.uid}")
	keys := store.NewActivity(env.redis, uid, 1).Shard(0).Keys()

	// Ten users each get a different packet.
	granted := map[string]answer{}
	byPacket := map[string]string{}
	var sum int64
	for i := 1; i <= 10; i++ {
		user := "u-" + strconv.Itoa(i)
		code, a := grab(t, base, user)
		if code != http.StatusOK || a.Outcome != "granted" || a.PacketID == "" || a.Amount < 1 {
			t.Fatalf("grab for %s: HTTP %d %+v, want 200 granted", user, code, a)
		}
		if other, ok := byPacket[a.PacketID]; ok {
			t.Fatalf("packet %s granted to %s and %s", a.PacketID, other, user)
		}
		byPacket[a.PacketID] = user
		granted[user] = a
		sum += a.Amount
	}
	// A retry returns the same packet.
	if code, a := grab(t, base, "u-1"); code != http.StatusOK || a.Outcome != "already_claimed" ||
		a.PacketID != granted["u-1"].PacketID || a.Amount != granted["u-1"].Amount {
		t.Fatalf("retry for u-1: HTTP %d %+v, want 200 already_claimed with %+v", code, a, granted["u-1"])
	}
	// Invalid input is refused without touching Redis.
	if code, a := grabRaw(t, base, `{"userId":""}`); code != http.StatusBadRequest || a.Outcome != "invalid_request" || a.Error == "" {
		t.Fatalf("empty user id: HTTP %d %+v, want 400 invalid_request with an error", code, a)
	}
	if n, err := env.redis.HLen(t.Context(), keys.Claims).Result(); err != nil || n != 10 {
		t.Fatalf("claims hash holds %d users (%v), want 10", n, err)
	}

	// kubectl get shows what the grab service reported.
	eventually(t, 20*time.Second, "kubectl get rpa shows remaining 90 and claimed 10", func() error {
		c := columns(t, "rpa", name, "-n", ns)
		if c["REMAINING"] != "90" || c["CLAIMED"] != "10" || c["TOTAL"] != "10000" || c["COUNT"] != "100" || c["PHASE"] != "Active" {
			return fmt.Errorf("columns %v", c)
		}
		return nil
	})
	if c := columns(t, "rpa", name, "-n", ns, "-o", "wide"); c["CLAIMED-AMOUNT"] != strconv.FormatInt(sum, 10) {
		t.Fatalf("kubectl get -o wide: CLAIMED-AMOUNT %q, want %d (%v)", c["CLAIMED-AMOUNT"], sum, c)
	}

	// Pause: once the status says Paused, grabs answer 409 paused and change nothing.
	mustKubectl(t, "", "patch", "rpa", name, "-n", ns, "--type=merge", "-p", `{"spec":{"paused":true}}`)
	eventually(t, 30*time.Second, "kubectl get rpa shows Paused", func() error {
		if c := columns(t, "rpa", name, "-n", ns); c["PHASE"] != "Paused" {
			return fmt.Errorf("columns %v", c)
		}
		return nil
	})
	if code, a := grab(t, base, "u-late"); code != http.StatusConflict || a.Outcome != "paused" {
		t.Fatalf("grab while paused: HTTP %d %+v, want 409 paused", code, a)
	}
	if n, err := env.redis.HExists(t.Context(), keys.Claims, "u-late").Result(); err != nil || n {
		t.Fatalf("a paused grab left a claim for u-late (%v)", err)
	}

	// Resume: once the status says Active again, the same user is granted.
	mustKubectl(t, "", "patch", "rpa", name, "-n", ns, "--type=merge", "-p", `{"spec":{"paused":false}}`)
	eventually(t, 30*time.Second, "kubectl get rpa shows Active", func() error {
		if c := columns(t, "rpa", name, "-n", ns); c["PHASE"] != "Active" {
			return fmt.Errorf("columns %v", c)
		}
		return nil
	})
	code, a := grab(t, base, "u-late")
	if code != http.StatusOK || a.Outcome != "granted" {
		t.Fatalf("grab after resuming: HTTP %d %+v, want 200 granted", code, a)
	}
	granted["u-late"] = a
	sum += a.Amount
	eventually(t, 20*time.Second, "kubectl get rpa shows 11 claimed", func() error {
		if c := columns(t, "rpa", name, "-n", ns); c["CLAIMED"] != "11" || c["REMAINING"] != "89" {
			return fmt.Errorf("columns %v", c)
		}
		return nil
	})

	// Settlement credits every grant once, keyed by <uid>/<packetId>.
	eventually(t, 30*time.Second, "the balance system credited every grant", func() error {
		if tot := bal.Totals(); tot.Grants != 11 || tot.GrantSum != sum {
			return fmt.Errorf("credited %d grants summing to %d, want 11 and %d", tot.Grants, tot.GrantSum, sum)
		}
		return nil
	})
	for user, a := range granted {
		d, ok := bal.Delivered(uid + "/" + a.PacketID)
		if !ok || d.UserID != user || d.Amount != a.Amount || d.Kind != "grant" || d.Activity != ns+"/"+name {
			t.Fatalf("credit for %s's packet %s: %+v (found %t)", user, a.PacketID, d, ok)
		}
	}

	// Delete: the activity closes, the remainder is refunded to the sponsor, settlement
	// drains, the keys are purged and the finalizer lets the resource go.
	mustKubectl(t, "", "delete", "rpa", name, "-n", ns, "--timeout=90s")
	if _, errOut, err := kubectl(t, "", "get", "rpa", name, "-n", ns); err == nil || !strings.Contains(errOut, "NotFound") {
		t.Fatalf("kubectl get after delete: err %v, stderr %q; want NotFound", err, errOut)
	}
	n, err := env.redis.Exists(t.Context(), keys.All()...).Result()
	if err != nil || n != 0 {
		t.Fatalf("%d of the activity's Redis keys are left after deletion (%v)", n, err)
	}
	tot := bal.Totals()
	grants, grantSum, refunds, refundSum := tot.Grants, tot.GrantSum, tot.Refunds, tot.RefundSum
	if grants != 11 || refunds != 1 || grantSum+refundSum != total || refundSum != total-sum {
		t.Fatalf("credited %d grants (%d) and %d refunds (%d); want 11 grants, 1 refund of %d, together %d",
			grants, grantSum, refunds, refundSum, total-sum, total)
	}
	if d, ok := bal.Delivered(uid + "/refund"); !ok || d.UserID != sponsor || d.Kind != "refund" {
		t.Fatalf("refund delivery %+v (found %t), want one to %s", d, ok, sponsor)
	}
}

// TestImpossibleSpecsAreRefused applies specs the API server must refuse and checks
// kubectl prints each one's validation message and nothing is created.
func TestImpossibleSpecsAreRefused(t *testing.T) {
	ns := namespace(t, "e2e-refused")
	cases := []struct {
		name, spec, message string
	}{
		{"too-little-money", "  totalAmount: 5\n  count: 10\n",
			"totalAmount must be at least count × distribution.minAmount"},
		{"min-above-max", "  totalAmount: 1000\n  count: 10\n  distribution:\n    minAmount: 50\n    maxAmount: 20\n",
			"distribution.maxAmount must not be below distribution.minAmount"},
		{"too-much-money", "  totalAmount: 1000\n  count: 10\n  distribution:\n    maxAmount: 50\n",
			"totalAmount must not exceed count × distribution.maxAmount"},
		{"end-before-start", "  totalAmount: 1000\n  count: 10\n  startTime: \"2030-01-01T20:10:00Z\"\n  endTime: \"2030-01-01T20:00:00Z\"\n",
			"endTime must be after startTime"},
		{"no-packets", "  totalAmount: 1000\n  count: 0\n",
			"spec.count: Invalid value: 0: spec.count in body should be greater than or equal to 1"},
	}
	for _, c := range cases {
		path := writeFile(t, c.name+".yaml", manifest(ns, c.name, c.spec))
		out, errOut, err := kubectl(t, "", "apply", "-f", path)
		if err == nil {
			t.Errorf("%s: kubectl apply succeeded: %s", c.name, out)
			continue
		}
		if !strings.Contains(errOut, c.message) {
			t.Errorf("%s: kubectl apply said %q, want it to contain %q", c.name, errOut, c.message)
		}
		if _, errOut, err := kubectl(t, "", "get", "rpa", c.name, "-n", ns); err == nil || !strings.Contains(errOut, "NotFound") {
			t.Errorf("%s: the refused activity exists (err %v, %q)", c.name, err, errOut)
		}
	}

	// The money of an accepted activity cannot change afterwards.
	path := writeFile(t, "fixed.yaml", manifest(ns, "fixed", "  totalAmount: 1000\n  count: 10\n  paused: true\n"))
	mustKubectl(t, "", "apply", "-f", path)
	for field, patch := range map[string]string{
		"totalAmount is immutable":  `{"spec":{"totalAmount":2000}}`,
		"count is immutable":        `{"spec":{"count":20}}`,
		"distribution is immutable": `{"spec":{"distribution":{"type":"Fixed"}}}`,
	} {
		_, errOut, err := kubectl(t, "", "patch", "rpa", "fixed", "-n", ns, "--type=merge", "-p", patch)
		if err == nil || !strings.Contains(errOut, field) {
			t.Errorf("patch %s: err %v, stderr %q; want it refused with %q", patch, err, errOut, field)
		}
	}
	if got := mustKubectl(t, "", "get", "rpa", "fixed", "-n", ns, "-o", "jsonpath={.spec.totalAmount}/{.spec.count}"); got != "1000/10" {
		t.Fatalf("spec after refused patches: %s, want 1000/10", got)
	}
}

// TestSampleBecomesReady applies config/samples as a user would, waits for Ready, and
// grabs from the sample through a grab service until kubectl get shows the claim.
func TestSampleBecomesReady(t *testing.T) {
	out := mustKubectl(t, "", "apply", "-f", env.root+"/config/samples")
	if !strings.Contains(out, "redpacketactivity.redpacket.io/quiz-night") {
		t.Fatalf("kubectl apply -f config/samples: %q", out)
	}
	mustKubectl(t, "", "wait", "--for=condition=Seeded", "rpa/quiz-night", "-n", "default", "--timeout=90s")
	// The sample's webhook host has no key in the operator's Secret: nothing is delivered.
	base := startGrabWith(t, "default", "quiz-night")
	mustKubectl(t, "", "wait", "--for=condition=Ready", "rpa/quiz-night", "-n", "default", "--timeout=90s")
	c := columns(t, "rpa", "quiz-night", "-n", "default")
	if c["TOTAL"] != "200000" || c["COUNT"] != "5000" || c["PHASE"] != "Active" {
		t.Fatalf("kubectl get rpa quiz-night: %v", c)
	}
	code, a := grab(t, base, "sample-user")
	if code != http.StatusOK || a.Outcome != "granted" {
		t.Fatalf("grab from the sample: HTTP %d %+v", code, a)
	}
	eventually(t, 20*time.Second, "kubectl get rpa quiz-night shows the claim", func() error {
		if c := columns(t, "rpa", "quiz-night", "-n", "default"); c["REMAINING"] != "4999" || c["CLAIMED"] != "1" {
			return fmt.Errorf("columns %v", c)
		}
		return nil
	})
	wide := columns(t, "rpa", "quiz-night", "-n", "default", "-o", "wide")
	if wide["CLAIMED-AMOUNT"] != strconv.FormatInt(a.Amount, 10) || wide["ENDPOINT"] != "http://quiz-night-grab.default.svc:8080" {
		t.Fatalf("kubectl get rpa quiz-night -o wide: %v, want CLAIMED-AMOUNT %d", wide, a.Amount)
	}
}
