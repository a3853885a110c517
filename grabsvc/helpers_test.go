package grabsvc

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/redistest"
)

var (
	sharedCPOnce sync.Once
	sharedCP     *controlplane.ControlPlane
	sharedCPErr  error
)

// controlPlane starts one API server for the whole package on first use.
func controlPlane(t *testing.T) *controlplane.ControlPlane {
	t.Helper()
	sharedCPOnce.Do(func() { sharedCP, sharedCPErr = controlplane.New() })
	if sharedCPErr != nil {
		t.Fatalf("control plane: %v", sharedCPErr)
	}
	return sharedCP
}

func TestMain(m *testing.M) {
	if os.Getenv(spreadChildEnv) == "1" {
		printSpreadOffsets()
		os.Exit(0)
	}
	code := m.Run()
	if sharedCP != nil {
		_ = sharedCP.Stop()
	}
	os.Exit(code)
}

// testActivity is an in-memory activity with a fresh UID (no API server needed).
func testActivity(name string) *Resource {
	return NewResource(&redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID(uuid.NewUUID()),
			ResourceVersion: "1"},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{Currency: "CNY"},
	})
}

// handleOf is the handle of act's activity on c.
func handleOf(c redis.Cmdable, act *Resource) *store.Activity {
	return store.NewActivity(c, string(act.Object.UID), act.Object.Spec.ShardCount())
}

// keysOf is the keys of act's activity, of one shard.
func keysOf(act *Resource) store.Keys { return handleOf(nil, act).Shard(0).Keys() }

// seed commits amounts as the activity's packets and opens it with the window.
func seed(t testing.TB, c redis.Cmdable, act *Resource, amounts []int64, startMs, endMs int64, paused bool) {
	t.Helper()
	var total int64
	for _, a := range amounts {
		total += a
	}
	ctx := context.Background()
	if _, err := handleOf(c, act).Seed(ctx, amounts, store.SeedParams{
		Count: int64(len(amounts)), Total: total, StartMs: startMs, EndMs: endMs, Paused: paused, Sponsor: "sponsor-1",
	}); err != nil {
		t.Fatalf("seeding: %v", err)
	}
	if st, err := handleOf(c, act).Configure(ctx, startMs, endMs, paused, true); err != nil || st.State != store.StateOpen {
		t.Fatalf("opening: state %q, err %v", st.State, err)
	}
}

func ones(n int) []int64 {
	a := make([]int64, n)
	for i := range a {
		a[i] = int64(i%7 + 1)
	}
	return a
}

// harness is a grab server on a real redis-server behind an httptest listener.
type harness struct {
	t       *testing.T
	redis   *redistest.Server
	rc      *redisconn.PipelinedClient
	admin   *redis.Client
	act     atomic.Pointer[Resource]
	srv     *Server
	http    *httptest.Server
	metrics *Metrics
	reg     *prometheus.Registry
}

type harnessOpt func(*Config)

func newHarness(t *testing.T, opts ...harnessOpt) *harness {
	t.Helper()
	h := &harness{t: t, redis: redistest.Start(t)}
	h.admin = h.redis.Client(t)
	rc, err := h.redis.Conn().NewPipelinedClient(redisconn.GrabClientOptions(2 * time.Second))
	if err != nil {
		t.Fatalf("redis clients: %v", err)
	}
	h.rc = rc
	t.Cleanup(func() { _ = rc.Close() })
	h.reg = prometheus.NewRegistry()
	h.metrics = NewMetrics(h.reg)
	cfg := Config{
		Redis:        rc.Pipeliner,
		Resource:     h.act.Load,
		Ping:         rc.Client,
		RedisTimeout: 2 * time.Second,
		Metrics:      h.metrics,
		Gatherer:     h.reg,
	}
	for _, o := range opts {
		o(&cfg)
	}
	srv, err := NewServer(cfg)
	if err != nil {
		t.Fatalf("server: %v", err)
	}
	h.srv = srv
	h.http = httptest.NewServer(srv.Handler())
	t.Cleanup(h.http.Close)
	return h
}

// useActivity makes act the served activity and seeds it.
func (h *harness) useActivity(act *Resource, amounts []int64, startMs, endMs int64, paused bool) {
	h.t.Helper()
	if amounts != nil {
		seed(h.t, h.admin, act, amounts, startMs, endMs, paused)
	}
	h.act.Store(act)
}

type reply struct {
	Status     int         `json:"-"`
	Header     http.Header `json:"-"`
	Outcome    string      `json:"outcome"`
	PacketID   string      `json:"packetId"`
	Amount     *int64      `json:"amount"`
	Error      string      `json:"error"`
	Raw        string      `json:"-"`
	RetryAfter string      `json:"-"`
}

func (h *harness) do(method, path, body string, header map[string]string) reply {
	h.t.Helper()
	req, err := http.NewRequest(method, h.http.URL+path, strings.NewReader(body))
	if err != nil {
		h.t.Fatalf("request: %v", err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	return send(h.t, h.http.Client(), req)
}

func send(t *testing.T, c *http.Client, req *http.Request) reply {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.URL.Path, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading body: %v", err)
	}
	r := reply{Status: resp.StatusCode, Header: resp.Header, Raw: string(raw), RetryAfter: resp.Header.Get("Retry-After")}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" && !strings.HasPrefix(req.URL.Path, "/metrics") {
		t.Fatalf("%s %s: Content-Type %q, body %s", req.Method, req.URL.Path, ct, raw)
	}
	if !strings.HasPrefix(req.URL.Path, "/metrics") {
		if err := json.Unmarshal(raw, &r); err != nil {
			t.Fatalf("%s %s: body %q is not JSON: %v", req.Method, req.URL.Path, raw, err)
		}
	}
	return r
}

func (h *harness) grab(userID string, header map[string]string) reply {
	h.t.Helper()
	return h.do(http.MethodPost, "/v1/grab", fmt.Sprintf(`{"userId":%q}`, userID), header)
}

// redisState is everything a request could have changed in Redis.
type redisState struct {
	DBSize    int64
	Snapshot  store.Snapshot
	StreamLen int64
	Claims    int64
	Scripts   string
}

func (h *harness) state(act *Resource) redisState {
	h.t.Helper()
	ctx := context.Background()
	var s redisState
	var err error
	if s.DBSize, err = h.admin.DBSize(ctx).Result(); err != nil {
		h.t.Fatalf("dbsize: %v", err)
	}
	if s.Snapshot, err = handleOf(h.admin, act).Snapshot(ctx); err != nil {
		h.t.Fatalf("snapshot: %v", err)
	}
	if s.StreamLen, err = h.admin.XLen(ctx, keysOf(act).Stream).Result(); err != nil {
		h.t.Fatalf("xlen: %v", err)
	}
	if s.Claims, err = h.admin.HLen(ctx, keysOf(act).Claims).Result(); err != nil {
		h.t.Fatalf("hlen: %v", err)
	}
	return s
}

// scriptCalls is how many EVALSHA and EVAL calls the server has run so far.
func scriptCalls(t testing.TB, c *redis.Client) int64 {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatalf("info commandstats: %v", err)
	}
	var n int64
	for _, line := range strings.Split(info, "\n") {
		line = strings.TrimSpace(line)
		for _, name := range []string{"cmdstat_evalsha:", "cmdstat_eval:", "cmdstat_fcall:"} {
			if rest, ok := strings.CutPrefix(line, name); ok {
				var calls int64
				if _, err := fmt.Sscanf(rest, "calls=%d", &calls); err != nil {
					t.Fatalf("parsing %q: %v", line, err)
				}
				n += calls
			}
		}
	}
	return n
}
