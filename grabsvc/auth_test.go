package grabsvc

import (
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"
	"sigs.k8s.io/yaml"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// A token names the activity by name and UID; it is refused for another UID (an
// activity created again under the same name), without a UID, and with an exp
// beyond the maximum lifetime, which is checked to the second.
func TestTokenBindingAndLifetime(t *testing.T) {
	key := []byte("binding-key")
	v, err := NewTokenVerifier(key)
	if err != nil {
		t.Fatal(err)
	}
	if v.MaxLifetime != DefaultTokenMaxLifetime {
		t.Fatalf("default maximum lifetime %s, want %s", v.MaxLifetime, DefaultTokenMaxLifetime)
	}
	now := time.Unix(1_700_000_000, 0)
	v.Now = func() time.Time { return now }
	v.MaxLifetime = time.Hour
	aud := TokenAudience{Activity: "ns/quiz", UID: "uid-1"}
	bearer := func(c TokenClaims) string {
		s, err := SignToken(key, c)
		if err != nil {
			t.Fatal(err)
		}
		return "Bearer " + s
	}
	claims := func(uid types.UID, exp time.Time) TokenClaims {
		return TokenClaims{UserID: "u", Activity: "ns/quiz", ActivityUID: uid, Exp: exp.Unix()}
	}
	cases := []struct {
		name  string
		token string
		want  error
	}{
		{"bound to this activity", bearer(claims("uid-1", now.Add(time.Minute))), nil},
		{"exactly the maximum lifetime", bearer(claims("uid-1", now.Add(time.Hour))), nil},
		{"one second beyond the maximum lifetime", bearer(claims("uid-1", now.Add(time.Hour+time.Second))), ErrTokenLifetime},
		{"a year ahead", bearer(claims("uid-1", now.AddDate(1, 0, 0))), ErrTokenLifetime},
		{"the same name, another UID", bearer(claims("uid-0", now.Add(time.Minute))), ErrTokenActivityUID},
		{"no UID", bearer(claims("", now.Add(time.Minute))), ErrTokenActivityUID},
		{"expired", bearer(claims("uid-1", now)), ErrTokenExpired},
	}
	for _, c := range cases {
		err := v.Verify(c.token, aud, "u")
		if c.want == nil && err != nil || c.want != nil && !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	// The lifetime refusal names the limit.
	err = v.Verify(bearer(claims("uid-1", now.Add(2*time.Hour))), aud, "u")
	if err == nil || !strings.Contains(err.Error(), "1h0m0s") {
		t.Errorf("lifetime refusal %q does not name the limit", err)
	}
	// Without a maximum, any future exp passes.
	v.MaxLifetime = 0
	if err := v.Verify(bearer(claims("uid-1", now.AddDate(10, 0, 0))), aud, "u"); err != nil {
		t.Errorf("no maximum lifetime: %v", err)
	}
}

// A service without a verification key fails closed: Check refuses the grabs of an
// activity that requires tokens and lets the others through.
func TestCheckWithoutKeyFailsClosed(t *testing.T) {
	var none *TokenVerifier
	open := testActivity("open")
	guarded := authActivity("guarded")
	if err := none.Check("", open, "u"); err != nil {
		t.Errorf("no key, no auth asked: %v", err)
	}
	if err := none.Check("Bearer anything", guarded, "u"); !errors.Is(err, ErrNoTokenKey) {
		t.Errorf("no key, auth asked: %v, want ErrNoTokenKey", err)
	}
	v, err := NewTokenVerifier([]byte("k"))
	if err != nil {
		t.Fatal(err)
	}
	if err := v.Check("", guarded, "u"); !errors.Is(err, ErrTokenMissing) {
		t.Errorf("with a key, no token: %v, want ErrTokenMissing", err)
	}
}

// Over HTTP on a real Redis: a service started without a key answers 503 with a
// clear message to every grab of an activity that requires tokens, claims nothing,
// and still grants for an activity that does not.
func TestGrabWithoutKeyForAnActivityWithAuthIs503(t *testing.T) {
	h := newHarness(t) // no Tokens
	act := authActivity("guarded")
	h.useActivity(act, ones(5), 0, 0, false)
	before := h.state(act)
	for _, header := range []map[string]string{nil, {"Authorization": "Bearer x.y"}} {
		r := h.grab("mallory", header)
		if r.Status != http.StatusServiceUnavailable || r.Outcome != OutcomeUnavailable ||
			!strings.Contains(r.Error, "spec.grabService.auth") || !strings.Contains(r.Error, "--token-key-file") {
			t.Fatalf("grab without a key for an activity with auth: %d %s", r.Status, r.Raw)
		}
	}
	if after := h.state(act); after != before {
		t.Fatalf("a refused grab changed redis: %+v -> %+v", before, after)
	}
	if r := h.do(http.MethodGet, "/readyz", "", nil); r.Status != http.StatusServiceUnavailable {
		t.Fatalf("/readyz of a service that refuses every grab: %d %s, want 503", r.Status, r.Raw)
	}
	open := testActivity("open")
	h.useActivity(open, ones(5), 0, 0, false)
	if r := h.grab("alice", nil); r.Status != http.StatusOK || r.Outcome != OutcomeGranted {
		t.Fatalf("grab for an activity without auth: %d %s", r.Status, r.Raw)
	}
	if r := h.do(http.MethodGet, "/readyz", "", nil); r.Status != http.StatusOK {
		t.Fatalf("/readyz for an activity without auth: %d %s, want 200", r.Status, r.Raw)
	}
}

// Over HTTP: a token minted for an earlier activity of the same name is refused by
// its successor, and one whose exp lies beyond the maximum lifetime is refused,
// both with 401 and no Redis effect.
func TestGrabRefusesTokensOfAnotherUIDOrTooLongLived(t *testing.T) {
	key := []byte("successor-key")
	v, err := NewTokenVerifier(key)
	if err != nil {
		t.Fatal(err)
	}
	v.MaxLifetime = 10 * time.Minute
	h := newHarness(t, func(c *Config) { c.Tokens = v })
	earlier, successor := authActivity("quiz"), authActivity("quiz")
	h.useActivity(successor, ones(5), 0, 0, false)
	sign := func(uid types.UID, ttl time.Duration) map[string]string {
		s, err := SignToken(key, TokenClaims{UserID: "bob", Activity: successor.Ref, ActivityUID: uid, Exp: time.Now().Add(ttl).Unix()})
		if err != nil {
			t.Fatal(err)
		}
		return map[string]string{"Authorization": "Bearer " + s}
	}
	before := h.state(successor)
	if r := h.grab("bob", sign(earlier.Object.UID, time.Minute)); r.Status != http.StatusUnauthorized ||
		r.Outcome != OutcomeUnauthorized || !strings.Contains(r.Error, "activityUID") {
		t.Fatalf("token of the earlier activity: %d %s", r.Status, r.Raw)
	}
	if r := h.grab("bob", sign(successor.Object.UID, time.Hour)); r.Status != http.StatusUnauthorized ||
		!strings.Contains(r.Error, "maximum token lifetime") {
		t.Fatalf("token beyond the maximum lifetime: %d %s", r.Status, r.Raw)
	}
	if after := h.state(successor); after != before {
		t.Fatalf("refused grabs changed redis: %+v -> %+v", before, after)
	}
	if r := h.grab("bob", sign(successor.Object.UID, time.Minute)); r.Status != http.StatusOK || r.Outcome != OutcomeGranted {
		t.Fatalf("a good token: %d %s", r.Status, r.Raw)
	}
}

// authActivity is an in-memory activity with a fresh UID whose spec asks for tokens.
func authActivity(name string) *Resource {
	a := testActivity(name)
	obj := a.Object.DeepCopy()
	obj.UID = types.UID(uuid.NewUUID())
	obj.Spec.GrabService.Auth = &redpacketv1alpha1.GrabAuth{
		TokenSecretRef: redpacketv1alpha1.SecretReference{Name: "grab-hmac"},
	}
	return &Resource{Object: obj, Ref: a.Ref}
}

// The admission policy that narrows the grab ServiceAccount's status writes
// (config/policy) allows exactly the fields the reporter applies: a field the
// reporter gains but the policy lacks would have every report refused, and a field
// the policy allows but the reporter never writes is a hole.
func TestStatusPolicyAllowsExactlyTheReportedFields(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "config", "policy", "grab_status_policy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var policy admissionregistrationv1.ValidatingAdmissionPolicy
	doc, _, _ := strings.Cut(string(data), "\n---\n")
	if err := yaml.UnmarshalStrict([]byte(doc), &policy); err != nil {
		t.Fatalf("decoding the policy: %v", err)
	}
	if policy.Kind != "ValidatingAdmissionPolicy" {
		t.Fatalf("the first document is a %q", policy.Kind)
	}
	var allowed []string
	for _, v := range policy.Spec.Variables {
		if v.Name == "reported" {
			for _, m := range regexp.MustCompile(`'([A-Za-z]+)'`).FindAllStringSubmatch(v.Expression, -1) {
				allowed = append(allowed, m[1])
			}
		}
	}
	act := testActivity("fields")
	// A sharded activity's report, which carries every field the reporter writes.
	applied := statusApply(act.Object, Counters{}, &redpacketv1alpha1.ShardWatermarks{Epoch: 0, ClaimedCounts: []int64{1, 2}}, time.Now())
	status, _ := applied.Object["status"].(map[string]any)
	var reported []string
	for k := range status {
		reported = append(reported, k)
	}
	slices.Sort(allowed)
	slices.Sort(reported)
	if len(reported) == 0 || !slices.Equal(allowed, reported) {
		t.Fatalf("the policy allows %v, the reporter applies %v", allowed, reported)
	}
}
