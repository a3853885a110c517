package main

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// TestServiceWithoutKeyFailsClosed runs the service twice against one activity
// whose spec asks for user tokens, on a real API server and a real Redis: started
// without --token-key-file it reads the requirement from the activity, says why in
// its log and answers every grab with 503, granting nothing; started with the key
// and --token-max-lifetime it refuses a token that lives longer than that and a
// token of another activity UID, and grants with a good one.
func TestServiceWithoutKeyFailsClosed(t *testing.T) {
	cp := controlplane.Start(t)
	ns := cp.Namespace(t)
	rs := redistest.Start(t)
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := cp.Kubeconfig(kubeconfig); err != nil {
		t.Fatal(err)
	}
	tokenKey := []byte("fail-closed-key")
	keyFile := filepath.Join(dir, "token-key")
	if err := os.WriteFile(keyFile, tokenKey, 0o600); err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	rpa := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "guarded"},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			TotalAmount: 50, Count: 5, Currency: "CNY", Sponsor: "sponsor-1",
			Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionFixed, MinAmount: 1},
			GrabService: redpacketv1alpha1.GrabService{Auth: &redpacketv1alpha1.GrabAuth{
				TokenSecretRef: redpacketv1alpha1.SecretReference{Name: "grab-hmac"},
			}},
		},
	}
	if err := cp.Client.Create(ctx, rpa); err != nil {
		t.Fatal(err)
	}
	admin := rs.Client(t)
	act := store.NewActivity(admin, string(rpa.UID), 1)
	keys := act.Shard(0).Keys()
	if _, err := act.Seed(ctx, []int64{10, 10, 10, 10, 10}, store.SeedParams{Count: 5, Total: 50, Sponsor: "sponsor-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := act.Configure(ctx, 0, 0, false, true); err != nil {
		t.Fatal(err)
	}

	// start runs the service with extra flags until the test ends, and waits until
	// /readyz answers (503 without a key, 200 with one); it returns the base URL and
	// the log.
	start := func(extra ...string) (string, *syncBuffer) {
		addr := freeAddr(t)
		logs := &syncBuffer{}
		sctx, stop := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- run(sctx, append([]string{
				"--namespace", ns, "--activity", "guarded", "--activity-uid", string(rpa.UID), "--listen", addr,
				"--kubeconfig", kubeconfig, "--redis-addresses", rs.Addr, "--activity-refresh", "200ms",
				"--shutdown-delay", "0s",
			}, append(rs.AuthArgs(), extra...)...), logs)
		}()
		t.Cleanup(func() {
			stop()
			select {
			case <-done:
			case <-time.After(15 * time.Second):
				t.Error("the service did not stop")
			}
			if t.Failed() {
				t.Logf("service log:\n%s", logs.String())
			}
		})
		base := "http://" + addr
		// Without a key the service answers, but is never ready: it would refuse
		// every grab, so a Service must not route to it.
		want := 200
		if len(extra) == 0 {
			want = http.StatusServiceUnavailable
		}
		wait.Until(t, 15*time.Second, "/readyz "+strconv.Itoa(want), func() (bool, string) {
			got := status(base + "/readyz")
			return got == want, strconv.Itoa(got)
		})
		return base, logs
	}
	token := func(uid types.UID, ttl time.Duration) map[string]string {
		s, err := grabsvc.SignToken(tokenKey, grabsvc.TokenClaims{UserID: "u1", Activity: ns + "/guarded",
			ActivityUID: uid, Exp: time.Now().Add(ttl).Unix()})
		if err != nil {
			t.Fatal(err)
		}
		return map[string]string{"Authorization": "Bearer " + s}
	}

	open, logs := start()
	// /readyz is 503 from the start without a key, so it cannot say when the service
	// has read the activity; until then a grab is refused for that reason instead.
	wait.Until(t, 15*time.Second, "the activity read", func() (bool, string) {
		_, body := post(t, open+"/v1/grab", `{"userId":"u1"}`, nil)
		msg, _ := body["error"].(string)
		return !strings.Contains(msg, "has not been read"), msg
	})
	for _, header := range []map[string]string{nil, token(rpa.UID, time.Minute)} {
		code, body := post(t, open+"/v1/grab", `{"userId":"u1"}`, header)
		msg, _ := body["error"].(string)
		if code != http.StatusServiceUnavailable || body["outcome"] != grabsvc.OutcomeUnavailable ||
			!strings.Contains(msg, "--token-key-file") {
			t.Fatalf("grab from a service without a key: %d %v", code, body)
		}
	}
	if !strings.Contains(logs.String(), "refusing every grab with 503") || !strings.Contains(logs.String(), "no --token-key-file") {
		t.Fatalf("the log does not say why grabs are refused:\n%s", logs.String())
	}
	if n, err := admin.HLen(ctx, keys.Claims).Result(); err != nil || n != 0 {
		t.Fatalf("claims after refused grabs: %d %v", n, err)
	}

	keyed, _ := start("--token-key-file", keyFile, "--token-max-lifetime", "2m")
	for _, c := range []struct {
		name   string
		header map[string]string
		want   string
	}{
		{"a token living longer than --token-max-lifetime", token(rpa.UID, 10*time.Minute), "maximum token lifetime"},
		{"a token of another activity UID", token("an-earlier-activity", time.Minute), "activityUID"},
	} {
		code, body := post(t, keyed+"/v1/grab", `{"userId":"u1"}`, c.header)
		msg, _ := body["error"].(string)
		if code != http.StatusUnauthorized || !strings.Contains(msg, c.want) {
			t.Fatalf("%s: %d %v", c.name, code, body)
		}
	}
	if code, body := post(t, keyed+"/v1/grab", `{"userId":"u1"}`, token(rpa.UID, time.Minute)); code != 200 || body["outcome"] != "granted" {
		t.Fatalf("a good token: %d %v", code, body)
	}
}

func TestTokenMaxLifetimeFlag(t *testing.T) {
	o, err := parseFlags([]string{"--activity", "x"}, io.Discard)
	if err != nil || o.tokenMaxLifetime != grabsvc.DefaultTokenMaxLifetime {
		t.Fatalf("default --token-max-lifetime: %s %v", o.tokenMaxLifetime, err)
	}
	if o, err := parseFlags([]string{"--activity", "x", "--token-max-lifetime", "90m"}, io.Discard); err != nil || o.tokenMaxLifetime != 90*time.Minute {
		t.Fatalf("--token-max-lifetime 90m: %s %v", o.tokenMaxLifetime, err)
	}
	for _, bad := range []string{"0s", "500ms", "-1h"} {
		if _, err := parseFlags([]string{"--activity", "x", "--token-max-lifetime", bad}, io.Discard); err == nil {
			t.Errorf("--token-max-lifetime %s accepted", bad)
		}
	}
}
