package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// receiver is a balance system that records deliveries.
type receiver struct {
	mu  sync.Mutex
	got []settlement.Delivery
	bad []string
	key []byte
	srv *httptest.Server
}

func newReceiver(t *testing.T, key []byte) *receiver {
	r := &receiver{key: key}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		var d settlement.Delivery
		r.mu.Lock()
		defer r.mu.Unlock()
		if err := json.Unmarshal(body, &d); err != nil {
			r.bad = append(r.bad, "not JSON: "+string(body))
		} else if req.Header.Get("X-Signature") != settlement.Sign(r.key, body) {
			r.bad = append(r.bad, "bad signature "+req.Header.Get("X-Signature"))
		} else if req.Header.Get("Idempotency-Key") != d.IdempotencyKey() {
			r.bad = append(r.bad, "bad idempotency key "+req.Header.Get("Idempotency-Key"))
		} else {
			r.got = append(r.got, d)
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *receiver) deliveries() ([]settlement.Delivery, []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]settlement.Delivery(nil), r.got...), append([]string(nil), r.bad...)
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func post(t *testing.T, url, body string, header map[string]string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return resp.StatusCode, m
}

func status(url string) int {
	resp, err := http.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestBinary runs the whole service in-process against a real API server and a
// real Redis: it waits for its activity, serves grabs with tokens, reports the
// counters, delivers nothing to the activity's webhook (the operator settles), and
// shuts down with readiness failing first.
func TestBinary(t *testing.T) {
	cp := controlplane.Start(t)
	ns := cp.Namespace(t)
	rs := redistest.Start(t)
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := cp.Kubeconfig(kubeconfig); err != nil {
		t.Fatal(err)
	}
	webhookKey, tokenKey := []byte("webhook-key"), []byte("token-key")
	if err := os.WriteFile(filepath.Join(dir, "token-key"), tokenKey, 0o600); err != nil {
		t.Fatal(err)
	}
	first := newReceiver(t, webhookKey)

	addr, pprofAddr := freeAddr(t), freeAddr(t)
	base := "http://" + addr
	logs := &syncBuffer{}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{
			"--namespace", ns, "--activity", "quiz", "--listen", addr, "--kubeconfig", kubeconfig,
			"--redis-addresses", rs.Addr, "--redis-username", rs.Username, "--redis-password", rs.Password,
			"--report-interval", "200ms", "--activity-refresh", "200ms",
			"--shutdown-delay", "300ms",
			"--token-key-file", filepath.Join(dir, "token-key"), "--rate-per-user", "100",
			"--pprof-listen", pprofAddr,
		}, logs)
	}()
	defer func() {
		if t.Failed() {
			t.Logf("service log:\n%s", logs.String())
		}
	}()

	// Serving probes, not ready: the activity does not exist yet.
	wait.Until(t, 10*time.Second, "the listener", func() (bool, string) { return status(base+"/healthz") == 200, "" })
	if s := status(base + "/readyz"); s != http.StatusServiceUnavailable {
		t.Fatalf("readyz without the activity: %d", s)
	}
	// Profiles are served on --pprof-listen only, never on the API's listener.
	if s := status("http://" + pprofAddr + "/debug/pprof/"); s != http.StatusOK {
		t.Errorf("GET /debug/pprof/ on --pprof-listen: %d, want 200", s)
	}
	if s := status(base + "/debug/pprof/"); s != http.StatusNotFound {
		t.Errorf("GET /debug/pprof/ on --listen: %d, want 404", s)
	}

	rpa := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "quiz"},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			TotalAmount: 100, Count: 10, Currency: "CNY", Sponsor: "sponsor-1",
			Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionFixed, MinAmount: 1},
			Settlement: &redpacketv1alpha1.Settlement{
				Webhook:     &redpacketv1alpha1.Webhook{URL: first.srv.URL + "/credit"},
				MaxAttempts: 5,
			},
		},
	}
	if err := cp.Client.Create(ctx, rpa); err != nil {
		t.Fatal(err)
	}
	admin := rs.Client(t)
	act := store.NewActivity(admin, string(rpa.UID), 1)
	amounts := make([]int64, 10)
	for i := range amounts {
		amounts[i] = 10
	}
	if _, err := act.Seed(ctx, amounts, store.SeedParams{Count: 10, Total: 100, Sponsor: "sponsor-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := act.Configure(ctx, 0, 0, false, true); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "readiness", func() (bool, string) { return status(base+"/readyz") == 200, "" })

	token := func(user string) map[string]string {
		s, err := grabsvc.SignToken(tokenKey, grabsvc.TokenClaims{UserID: user, Activity: ns + "/quiz", ActivityUID: rpa.UID, Exp: time.Now().Add(time.Minute).Unix()})
		if err != nil {
			t.Fatal(err)
		}
		return map[string]string{"Authorization": "Bearer " + s}
	}
	if code, body := post(t, base+"/v1/grab", `{"userId":"u1"}`, nil); code != http.StatusUnauthorized {
		t.Fatalf("grab without a token: %d %v", code, body)
	}
	code, body := post(t, base+"/v1/grab", `{"userId":"u1"}`, token("u1"))
	if code != 200 || body["outcome"] != "granted" {
		t.Fatalf("grab: %d %v", code, body)
	}
	packet := body["packetId"].(string)

	// The status shows the grant, and the first webhook receives it.
	wait.Until(t, 5*time.Second, "the status report", func() (bool, string) {
		o := &redpacketv1alpha1.RedPacketActivity{}
		if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(rpa), o); err != nil {
			return false, err.Error()
		}
		c := o.Status.ClaimedCount
		return c != nil && *c == 1 && o.Status.LastReportTime != nil, fmt.Sprintf("%+v", o.Status)
	})
	// The grab service settles nothing: after a few refreshes the webhook has seen no
	// delivery, and no consumer group reads the activity's stream.
	time.Sleep(time.Second)
	if got, bad := first.deliveries(); len(got) != 0 || len(bad) != 0 {
		t.Fatalf("the grab service delivered %+v %v; the operator settles, never a grab pod", got, bad)
	}
	if groups, err := admin.XInfoGroups(ctx, "rpa:{"+string(rpa.UID)+"}:stream").Result(); err != nil || len(groups) != 0 {
		t.Fatalf("consumer groups of the stream: %v %v, want none", groups, err)
	}
	_ = packet

	// Shutdown: readiness fails while the listener still serves, then run returns.
	stop()
	wait.Until(t, 2*time.Second, "readiness to fail", func() (bool, string) {
		s := status(base + "/readyz")
		return s == http.StatusServiceUnavailable, fmt.Sprint(s)
	})
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("run did not return after the shutdown")
	}
	if s := status(base + "/healthz"); s != 0 {
		t.Fatalf("the listener still answers after shutdown: %d", s)
	}
}

func TestFlags(t *testing.T) {
	t.Setenv("REDIS_ADDRESSES", "a:1,b:2")
	t.Setenv("REDIS_MODE", "cluster")
	t.Setenv("REDIS_TLS", "true\n") // as a Secret written with echo holds it
	t.Setenv("REDIS_PASSWORD", "s3cret")
	var help bytes.Buffer
	if _, err := parseFlags([]string{"--help"}, &help); err == nil || strings.Contains(help.String(), "s3cret") {
		t.Fatalf("--help: %v, shows the password: %v", err, strings.Contains(help.String(), "s3cret"))
	}
	o, err := parseFlags([]string{"--activity", "x"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.redis.Password != "s3cret" {
		t.Fatalf("password from the environment: %q", o.redis.Password)
	}
	if len(o.redis.Addresses) != 2 || o.redis.Mode != redisconn.ModeCluster || !o.redis.TLS || o.listen != ":8080" ||
		o.reportInterval != time.Second || o.redisTimeout != 500*time.Millisecond || o.shutdownDelay != 5*time.Second {
		t.Fatalf("defaults: %+v", o)
	}
	o, err = parseFlags([]string{"--activity", "x", "--redis-addresses", "h:6379", "--redis-mode", "standalone", "--redis-tls=false"}, io.Discard)
	if err != nil || o.redis.Addresses[0] != "h:6379" || o.redis.TLS {
		t.Fatalf("flags over env: %+v %v", o, err)
	}
	for _, args := range [][]string{
		{},
		{"--activity", "x", "--redis-mode", "sentinel"},
		{"--activity", "x", "--rate-per-user", "-1"},
		{"--activity", "x", "extra"},
	} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
}
