package rpactl_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/internal/rpactl"
	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// packetGrab posts one grab of a runtime packet with a bearer token and returns the
// HTTP status and the outcome (or error code) the service answered.
func packetGrab(t *testing.T, base, packet, user, token string) (int, string) {
	t.Helper()
	return postGrab(t, base+"/v1/packets/"+packet+"/grab", user, token)
}

// kubectl rpa token rpb/NAME USER mints a token that the budget's real packet server
// (grabsvc.PacketServer with the key of spec.grabService.auth, as the budget's grab
// pods run it) takes for that user on every packet of that budget; with --packet the
// token is good for that one packet only. The budget is read from a real API server
// and the packets live in a real redis-server. Tokens for another user, a budget that
// takes no tokens, --packet on an activity and a malformed packet id are refused.
func TestBudgetTokenAgainstThePacketServer(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	b := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "group"},
		Spec: redpacketv1alpha1.RedPacketBudgetSpec{
			Total: 100_000, BudgetShards: 2,
			Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 10_000},
			GrabService: redpacketv1alpha1.BudgetGrabService{Auth: &redpacketv1alpha1.GrabAuth{
				TokenSecretRef: redpacketv1alpha1.SecretReference{Name: "grab-hmac"}}},
		},
	}
	if err := w.cp.Client.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	open := &redpacketv1alpha1.RedPacketBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "open"},
		Spec:       redpacketv1alpha1.RedPacketBudgetSpec{Total: 1000, Packets: redpacketv1alpha1.PacketLimits{MaxTotal: 100}},
	}
	if err := w.cp.Client.Create(ctx, open); err != nil {
		t.Fatal(err)
	}

	// The budget in Redis, and its packet server as its grab pods serve it.
	if _, err := lua.GrabLibrary.Ensure(ctx, w.rdb); err != nil {
		t.Fatal(err)
	}
	if err := store.NewBudget(w.rdb, string(b.UID), 2).Configure(ctx, 100_000, store.BudgetLimits{Currency: "CNY",
		MaxTotal: 10_000, MaxCount: 10, MinShare: 1, Distributions: []string{split.TypeFixed},
		DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	rc, err := w.redis.Conn().NewPipelinedClient(redisconn.GrabClientOptions(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	sender, err := grabsvc.NewSenderCredential([]byte("sender-token"))
	if err != nil {
		t.Fatal(err)
	}
	verifier, err := grabsvc.NewTokenVerifier(tokenKey)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := grabsvc.NewPacketServer(grabsvc.PacketConfig{
		Budget: grabsvc.Budget{Namespace: w.ns, Name: b.Name, UID: b.UID, Shards: 2},
		Redis:  rc.Pipeliner, Ping: rc.Client, Sender: sender, Tokens: verifier, RedisTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(hs.Close)
	packets := rpactl.PacketsClient{BaseURL: hs.URL, HTTP: hs.Client()}
	for _, id := range []string{"order-1", "order-2"} {
		if _, err := packets.Send(ctx, "sender-token", rpactl.SendRequest{ID: id, Sender: "merchant-1", TotalAmount: 500,
			Count: 5, Distribution: split.TypeFixed}); err != nil {
			t.Fatal(err)
		}
	}

	whole := strings.TrimSpace(w.mustRun("token", "rpb/group", "u-1", "--ttl", "10m"))
	one := strings.TrimSpace(w.mustRun("token", "rpb/group", "u-2", "--packet", "order-1"))
	if code, outcome := packetGrab(t, hs.URL, "order-1", "u-1", "nonsense."+whole); code != http.StatusUnauthorized {
		t.Fatalf("a grab with a broken token: %d %s, want 401", code, outcome)
	}
	for _, g := range []struct {
		packet, user, token string
		code                int
		outcome             string
	}{
		{"order-1", "u-1", whole, http.StatusOK, "granted"},
		{"order-2", "u-1", whole, http.StatusOK, "granted"},
		{"order-1", "u-2", one, http.StatusOK, "granted"},
		{"order-2", "u-2", one, http.StatusUnauthorized, "unauthorized"},
		{"order-2", "u-3", whole, http.StatusUnauthorized, "unauthorized"},
	} {
		if code, outcome := packetGrab(t, hs.URL, g.packet, g.user, g.token); code != g.code || outcome != g.outcome {
			t.Errorf("grab of %s by %s: %d %s, want %d %s", g.packet, g.user, code, outcome, g.code, g.outcome)
		}
	}

	// The activity's token is not good for the budget, and the budget's is not good
	// for an activity of the same namespace and name.
	act := &redpacketv1alpha1.RedPacketActivity{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "group", UID: "other"}}
	if err := verifier.Verify("Bearer "+whole, grabsvc.AudienceOf(grabsvc.NewResource(act)), "u-1"); err == nil {
		t.Error("the budget's token verifies for an activity of the same name")
	}

	for _, args := range [][]string{
		{"token", "rpb/open", "u-1"},                          // the budget takes no tokens
		{"token", "rpb/nope", "u-1"},                          // no such budget
		{"token", "quiz", "u-1", "--packet", "order-1"},       // --packet on an activity
		{"token", "rpb/group", "u-1", "--packet", "-order-1"}, // not a packet id
		{"token", "rpb/group", "u-1", "--ttl", "25h"},
	} {
		if out, err := w.run(args...); err == nil || out != "" {
			t.Errorf("kubectl rpa %v: printed %q, error %v; want an error and no token", args, out, err)
		}
	}
}
