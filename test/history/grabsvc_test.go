package history

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// grabService is one activity's grab service (or one pod of a budget's packet grab
// fleet) as clients see it: a real grabsvc.Server (grabsvc.PacketServer) behind a
// real listener, on a redisconn.PipelinedClient dialing Redis
// through the fault proxy, with its own RollbackGuard (so every grab carries a
// watermark). Restart stops the running server mid-flight and starts a fresh one,
// with new Redis clients and a new guard, on the same activity, as a grab pod that
// is killed and replaced; clients always send to the current server's address, as
// they would through a Service.
type grabService struct {
	// handler makes a fresh server's handler on its Redis clients: an activity's
	// grabsvc.Server, or a budget's grabsvc.PacketServer (newPacketService).
	handler func(rc *redisconn.PipelinedClient) (http.Handler, error)
	redis   string // the address the Redis clients dial (the proxy's)
	timeout time.Duration

	mu       sync.Mutex
	cur      *grabInstance
	url      atomic.Pointer[string]
	restarts int
}

// grabInstance is one running server: its Redis clients, its HTTP server and the
// listener it serves on.
type grabInstance struct {
	rc   *redisconn.PipelinedClient
	http *http.Server
	done chan struct{}
}

// newGrabService starts the first grab server for the activity obj (its UID names
// the activity's Redis keys); timeout is the server's Redis deadline
// (Config.RedisTimeout), the grab clients' socket timeout too, as in the grab
// service's command.
func newGrabService(obj *redpacketv1alpha1.RedPacketActivity, redisAddr string, timeout time.Duration) (*grabService, error) {
	act := grabsvc.NewResource(obj)
	return startGrabService(redisAddr, timeout, func(rc *redisconn.PipelinedClient) (http.Handler, error) {
		srv, err := grabsvc.NewServer(grabsvc.Config{
			Redis:        rc.Pipeliner,
			Ping:         rc.Client,
			Resource:     func() *grabsvc.Resource { return act },
			RedisTimeout: timeout,
			Guard:        &grabsvc.RollbackGuard{},
			Log:          slog.New(slog.NewTextHandler(io.Discard, nil)),
		})
		if err != nil {
			return nil, err
		}
		return srv.Handler(), nil
	})
}

// newPacketService starts the first packet grab server of a budget, the handler
// `grabsvc --budget` serves (grabsvc.PacketServer), without user tokens or rate
// limits, creating with the sender credential sender, counting quotas (the zero
// value: none) on the wall clock's UTC day, in one step on the one server with
// oneServer.
func newPacketService(budget grabsvc.Budget, sender []byte, redisAddr string, timeout time.Duration, quotas store.Quotas, oneServer bool) (*grabService, error) {
	cred, err := grabsvc.NewSenderCredential(sender)
	if err != nil {
		return nil, err
	}
	return startGrabService(redisAddr, timeout, func(rc *redisconn.PipelinedClient) (http.Handler, error) {
		srv, err := grabsvc.NewPacketServer(grabsvc.PacketConfig{
			Budget:       budget,
			Redis:        rc.Pipeliner,
			Ping:         rc.Client,
			Sender:       cred,
			RedisTimeout: timeout,
			Log:          slog.New(slog.NewTextHandler(io.Discard, nil)),
			Quotas:       quotas,
			OneServer:    oneServer,
		})
		if err != nil {
			return nil, err
		}
		return srv.Handler(), nil
	})
}

func startGrabService(redisAddr string, timeout time.Duration, handler func(*redisconn.PipelinedClient) (http.Handler, error)) (*grabService, error) {
	g := &grabService{handler: handler, redis: redisAddr, timeout: timeout}
	inst, err := g.start()
	if err != nil {
		return nil, err
	}
	g.cur = inst
	return g, nil
}

func (g *grabService) start() (*grabInstance, error) {
	rc, err := adminConn(g.redis).NewPipelinedClient(redisconn.GrabClientOptions(g.timeout))
	if err != nil {
		return nil, fmt.Errorf("grab server's redis clients: %w", err)
	}
	h, err := g.handler(rc)
	if err != nil {
		_ = rc.Close()
		return nil, fmt.Errorf("grab server: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = rc.Close()
		return nil, fmt.Errorf("grab server's listener: %w", err)
	}
	inst := &grabInstance{rc: rc, http: grabsvc.NewHTTPServer("", h), done: make(chan struct{})}
	go func() {
		defer close(inst.done)
		_ = inst.http.Serve(ln)
	}()
	url := "http://" + ln.Addr().String()
	g.url.Store(&url)
	return inst, nil
}

// stop closes every connection of the instance at once (requests in flight get an
// error, not an answer) and then its Redis clients, as a killed pod does.
func (inst *grabInstance) stop() {
	_ = inst.http.Close()
	<-inst.done
	_ = inst.rc.Close()
}

// Restart stops the running server and, after down (the time a replacement takes to
// become ready), starts a fresh one. Clients sending meanwhile reach the stopped
// server's address and get no answer.
func (g *grabService) Restart(down time.Duration) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.cur.stop()
	time.Sleep(down)
	inst, err := g.start()
	if err != nil {
		g.cur = nil
		return err
	}
	g.cur = inst
	g.restarts++
	return nil
}

// Close stops the running server.
func (g *grabService) Close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.cur != nil {
		g.cur.stop()
		g.cur = nil
	}
}

// grabAnswer is the body of a /v1/grab answer.
type grabAnswer struct {
	Outcome  string `json:"outcome"`
	PacketID string `json:"packetId"`
	Error    string `json:"error"`
}

// errUnexpectedAnswer marks an answer the grab API never gives to a valid request
// on an activity without tokens or rate limits: the run fails on it.
var errUnexpectedAnswer = errors.New("unexpected answer")

// Grab posts one grab for user and turns the answer into the model's output: 200
// and 409 carry the script's outcome; 503 (the packet store did not answer, or
// answered fenced or missing) and a request that got no answer at all are unknown:
// the grab may or may not have taken effect. It also returns the HTTP status (0
// without an answer).
func (g *grabService) Grab(c *http.Client, user string) (Output, int, error) {
	body, _ := json.Marshal(map[string]string{"userId": user})
	resp, err := c.Post(*g.url.Load()+"/v1/grab", "application/json", bytes.NewReader(body))
	if err != nil {
		return Output{Unknown: true}, 0, nil
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return Output{Unknown: true}, resp.StatusCode, nil
	}
	var a grabAnswer
	if resp.StatusCode == http.StatusServiceUnavailable {
		return Output{Unknown: true}, resp.StatusCode, nil
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return Output{Unknown: true}, resp.StatusCode, fmt.Errorf("%w: %d %q is not JSON: %v", errUnexpectedAnswer, resp.StatusCode, raw, err)
	}
	switch out := store.Outcome(a.Outcome); {
	case resp.StatusCode == http.StatusOK && (out == store.Granted || out == store.AlreadyClaimed) && a.PacketID != "":
		return Output{Outcome: out, Packet: a.PacketID}, resp.StatusCode, nil
	case resp.StatusCode == http.StatusConflict && (out == store.SoldOut || out == store.NotStarted || out == store.Ended || out == store.Paused):
		return Output{Outcome: out}, resp.StatusCode, nil
	}
	return Output{Unknown: true}, resp.StatusCode, fmt.Errorf("%w: %d %s", errUnexpectedAnswer, resp.StatusCode, raw)
}
