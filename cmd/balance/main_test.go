package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/test/pgtest"
)

var signingKey = []byte("crash-test-key")

// process is cmd/balance running as a real subprocess.
type process struct {
	t    *testing.T
	bin  string
	args []string
	env  []string
	log  string
	cmd  *exec.Cmd
	url  string
}

// buildBinary builds cmd/balance into the test's temporary directory.
func buildBinary(t *testing.T) string {
	t.Helper()
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go is not on the PATH: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "balance")
	out, err := exec.Command(gobin, "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v: %s", err, out)
	}
	return bin
}

// start runs the binary and waits until /healthz answers 200.
func (p *process) start() {
	p.t.Helper()
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		p.t.Fatal(err)
	}
	defer logf.Close()
	p.cmd = exec.Command(p.bin, p.args...)
	p.cmd.Env = append(os.Environ(), p.env...)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	if err := p.cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		resp, err := http.Get(p.url + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("cmd/balance does not answer /healthz: %v; log:\n%s", err, p.logText())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill ends the process with SIGKILL and reaps it.
func (p *process) kill() {
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	_ = p.cmd.Wait()
	p.cmd = nil
}

func (p *process) logText() string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// delivery is one credit the test posts, and what it learnt of it.
type delivery struct {
	d     balance.Delivery
	key   string
	body  []byte
	acked atomic.Bool // a 2xx came back at least once
}

func newDelivery(t *testing.T, d balance.Delivery, key string) *delivery {
	b, err := json.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	return &delivery{d: d, key: key, body: b}
}

// sign sets the signature headers of one attempt, as the operator does: the
// Standard Webhooks headers (v1, the attempt's time) and X-Signature.
func sign(h http.Header, key string, body []byte) {
	id, now := webhooksig.MessageID(key), time.Now().Unix()
	h.Set(webhooksig.HeaderID, id)
	h.Set(webhooksig.HeaderTimestamp, strconv.FormatInt(now, 10))
	h.Set(webhooksig.HeaderSignature, webhooksig.Sign(webhooksig.Keys{HMAC: [][]byte{signingKey}}, id, now, body))
	h.Set(webhooksig.XSignatureHeader, webhooksig.XSignature(signingKey, body))
}

// post sends one delivery once and returns the status (0: no answer).
func post(client *http.Client, url string, d *delivery) int {
	req, err := http.NewRequest(http.MethodPost, url+"/v1/credits", bytes.NewReader(d.body))
	if err != nil {
		return 0
	}
	req.Header.Set("Idempotency-Key", d.key)
	sign(req.Header, d.key, d.body)
	resp, err := client.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode/100 == 2 {
		d.acked.Store(true)
	}
	return resp.StatusCode
}

// burst posts every delivery once from clients goroutines and calls crash, once,
// as soon as crashAfter of them were acknowledged: the crash lands while posts are
// in flight. It returns how many posts got a 2xx, and how many got a 5xx or nothing.
func burst(t *testing.T, url string, ds []*delivery, clients, crashAfter int, crash func()) (acked, failed int64) {
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	var ok, bad atomic.Int64
	var once sync.Once
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := c; i < len(ds); i += clients {
				switch s := post(client, url, ds[i]); {
				case s/100 == 2:
					if ok.Add(1) >= int64(crashAfter) {
						once.Do(crash)
					}
				case s == 0 || s >= 500:
					bad.Add(1)
				default:
					t.Errorf("%s: status %d", ds[i].key, s)
				}
			}
		})
	}
	wg.Wait()
	once.Do(crash)
	return ok.Load(), bad.Load()
}

// repostAll posts every delivery until it gets a 2xx, as the operator's retries do,
// and returns how many of those 2xx were replays.
func repostAll(t *testing.T, url string, ds []*delivery) (replays int64) {
	client := &http.Client{Timeout: 10 * time.Second}
	var n atomic.Int64
	var wg sync.WaitGroup
	const clients = 16
	for c := range clients {
		wg.Go(func() {
			for i := c; i < len(ds); i += clients {
				for attempt := 0; ; attempt++ {
					s := post(client, url, ds[i])
					if s == balance.StatusReplayed {
						n.Add(1)
					}
					if s/100 == 2 {
						break
					}
					if attempt == 100 {
						t.Errorf("%s: still %d after 100 posts", ds[i].key, s)
						return
					}
					time.Sleep(20 * time.Millisecond)
				}
			}
		})
	}
	wg.Wait()
	return n.Load()
}

// checkAcknowledgedBooked checks that every delivery that got a 2xx is in the book,
// as it was posted.
func checkAcknowledgedBooked(t *testing.T, pool *pgxpool.Pool, ds []*delivery) int {
	t.Helper()
	n := 0
	for _, d := range ds {
		if !d.acked.Load() {
			continue
		}
		n++
		var user string
		var amount int64
		err := pool.QueryRow(t.Context(), "SELECT user_id, amount FROM credits WHERE idempotency_key = $1", d.key).Scan(&user, &amount)
		if err != nil || user != d.d.UserID || amount != d.d.Amount {
			t.Errorf("%s got a 2xx, but the book has %q %d (%v)", d.key, user, amount, err)
		}
	}
	return n
}

// checkExact checks that the book holds each delivery exactly once, and that the
// sources' sums and the balances are exact.
func checkExact(t *testing.T, pool *pgxpool.Pool, ds []*delivery) {
	t.Helper()
	ctx := t.Context()
	var rows, keys, sum int64
	if err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT idempotency_key), coalesce(sum(amount), 0) FROM credits").Scan(&rows, &keys, &sum); err != nil {
		t.Fatal(err)
	}
	var want int64
	users := map[string]int64{}
	for _, d := range ds {
		want += d.d.Amount
		users[d.d.UserID] += d.d.Amount
	}
	if rows != int64(len(ds)) || keys != rows || sum != want {
		t.Fatalf("%d credit rows of %d keys summing to %d, want %d keys summing to %d", rows, keys, sum, len(ds), want)
	}
	var sources int64
	if err := pool.QueryRow(ctx, "SELECT coalesce(sum(grant_sum + refund_sum), 0) FROM sources").Scan(&sources); err != nil || sources != want {
		t.Fatalf("the sources' sums add up to %d (%v), want %d", sources, err, want)
	}
	for u, a := range users {
		var got int64
		if err := pool.QueryRow(ctx, "SELECT amount FROM balances WHERE user_id = $1", u).Scan(&got); err != nil || got != a {
			t.Errorf("%s's balance %d (%v), want %d", u, got, err, a)
		}
	}
}

// A kill -9 of the balance system during a burst, then one of PostgreSQL during
// another, each followed by a restart and a re-post of everything (acknowledged or
// not, as the operator re-posts what it could not record as acknowledged): every
// key that got a 2xx is in the book after the crash, nothing is booked twice, and
// the sums and balances are exact.
func TestCrashesLoseNothingAcknowledgedAndBookNothingTwice(t *testing.T) {
	pg := pgtest.Start(t)
	dsn, err := pg.NewDatabase(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	bin := buildBinary(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	p := &process{t: t, bin: bin, url: "http://" + addr, log: filepath.Join(t.TempDir(), "balance.log"),
		args: []string{"--listen", addr, "--max-conns", "16"},
		env:  []string{"DATABASE_URL=" + dsn, "BALANCE_SIGNING_KEYS=" + string(signingKey)}}
	p.start()
	t.Cleanup(p.kill)
	defer func() {
		if t.Failed() {
			t.Logf("cmd/balance's log:\n%s", p.logText())
		}
	}()
	pool, err := pgxpool.New(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	const perPhase = 600
	at := "2026-12-04T10:00:00.000Z"
	announce := []*delivery{
		newDelivery(t, balance.Delivery{Kind: balance.KindBudget, Activity: "default/rain", ActivityUID: "act-crash",
			Amount: 1 << 40, Count: 2 * perPhase, Currency: "CNY", At: at}, "act-crash/budget"),
		newDelivery(t, balance.Delivery{Kind: balance.KindBudget, Source: balance.SourceBudget, Activity: "default/group",
			ActivityUID: "bud-crash", Amount: 1 << 40, Currency: "CNY", At: at}, "bud-crash/budget:"+strconv.Itoa(1<<40)),
	}
	if replays := repostAll(t, p.url, announce); replays != 0 {
		t.Fatalf("%d announcements replayed on a fresh book", replays)
	}
	phase := func(from int) []*delivery {
		var ds []*delivery
		for i := from; i < from+perPhase; i++ {
			user := fmt.Sprintf("user-%d", i%50)
			if i%2 == 0 {
				ds = append(ds, newDelivery(t, balance.Delivery{Kind: balance.KindGrant, Activity: "default/rain", ActivityUID: "act-crash",
					PacketID: strconv.Itoa(i + 1), UserID: user, Amount: int64(1 + i%89), Currency: "CNY", At: at}, fmt.Sprintf("act-crash/%d", i+1)))
				continue
			}
			pid := fmt.Sprintf("order-%d/%d", i/4, i%4)
			ds = append(ds, newDelivery(t, balance.Delivery{Kind: balance.KindGrant, Source: balance.SourceBudget, Activity: "default/group",
				ActivityUID: "bud-crash", PacketID: pid, UserID: user, Amount: int64(1 + i%61), Currency: "CNY", At: at}, "bud-crash/"+pid))
		}
		return ds
	}

	// 1. kill -9 of the balance system mid-burst.
	first := phase(0)
	acked, failed := burst(t, p.url, first, 16, perPhase/3, p.kill)
	t.Logf("balance system killed mid-burst: %d acknowledged, %d failed or unanswered", acked, failed)
	if failed == 0 {
		t.Fatal("the kill failed no post: it did not land mid-burst")
	}
	n := checkAcknowledgedBooked(t, pool, first)
	p.start()
	replays := repostAll(t, p.url, first)
	t.Logf("after the restart: every one of %d acknowledged keys booked; re-posting all %d: %d replays", n, len(first), replays)
	if replays < int64(n) {
		t.Errorf("%d replays for %d acknowledged keys", replays, n)
	}
	checkExact(t, pool, first)

	// 2. kill -9 of PostgreSQL mid-burst, while the balance system runs on.
	second := phase(perPhase)
	pool.Reset()
	acked, failed = burst(t, p.url, second, 16, perPhase/3, func() {
		if err := pg.Kill(); err != nil {
			t.Error(err)
		}
	})
	t.Logf("PostgreSQL killed mid-burst: %d acknowledged, %d failed or unanswered", acked, failed)
	if failed == 0 {
		t.Fatal("the kill failed no post: it did not land mid-burst")
	}
	if err := pg.Restart(); err != nil {
		t.Fatal(err)
	}
	pool.Reset()
	n = checkAcknowledgedBooked(t, pool, second)
	all := append(append([]*delivery{}, first...), second...)
	replays = repostAll(t, p.url, all)
	t.Logf("after PostgreSQL's restart: every one of %d acknowledged keys booked; re-posting all %d: %d replays", n, len(all), replays)
	if replays < int64(len(first)+n) {
		t.Errorf("%d replays for %d acknowledged keys", replays, len(first)+n)
	}
	checkExact(t, pool, all)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	var badSources int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM sources s WHERE grant_sum <> (SELECT coalesce(sum(amount), 0) FROM credits c
		WHERE c.source_uid = s.uid AND c.kind = 'grant') OR grants <> (SELECT count(*) FROM credits c WHERE c.source_uid = s.uid AND c.kind = 'grant')`).Scan(&badSources); err != nil || badSources != 0 {
		t.Fatalf("%d sources whose sums differ from their credits (%v)", badSources, err)
	}
}
