// Package rain makes it rain red packets on a grab service and plays the balance
// system that settlement credits: the demo and the end-to-end tests share it, so the
// checks they print and assert are computed one way.
package rain

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Answer is the grab service's JSON answer.
type Answer struct {
	Outcome  string `json:"outcome"`
	PacketID string `json:"packetId"`
	Amount   int64  `json:"amount"`
	Error    string `json:"error"`
	// OpensAt is the user's own opening instant on a not_started answer of an
	// activity with a start spread.
	OpensAt string `json:"opensAt"`
}

// Result is everything the rain observed on the client side.
type Result struct {
	Users    int
	Requests int64
	Elapsed  time.Duration
	// ByOutcome counts each user's final first answer by outcome ("error" when the
	// user got no answer at all within the spec's Timeout).
	ByOutcome map[string]int64
	// Retries are second attempts by the same user. RetriesSame were consistent with
	// the first answer (a grant's retry got the same packet back as already_claimed);
	// RetriesInconsistent were not.
	Retries, RetriesSame, RetriesInconsistent int64
	// Unavailable counts 503 answers, and TransportErrors requests that got no HTTP
	// answer; with RetryUnavailable both are asked again.
	Unavailable, TransportErrors int64
	// FirstDropped is the error of the first request that got no HTTP answer.
	FirstDropped string
	// Failed counts answers that are neither a grab outcome of the API nor a 503:
	// other 5xx, or a body that is not the API's JSON.
	Failed     int64
	Granted    int64
	GrantedSum int64
	// Recovered counts users whose first answer is already_claimed with a packet: an
	// attempt whose answer was lost was granted, and asking again returned the
	// packet. They are in Granted and Grants.
	Recovered int64
	// DupPackets counts packet ids granted to more than one user.
	DupPackets int64
	// Grants maps each granted user to its packet.
	Grants map[string]Answer
	// P50, P99 and Max are what the users saw, waiting for one of the shared
	// connections included; ServiceP50 and ServiceP99 start once the request has a
	// connection.
	P50, P99, Max          time.Duration
	ServiceP50, ServiceP99 time.Duration
	FirstError             string
}

// Spec shapes the red-packet rain.
type Spec struct {
	URL         string
	Users       int
	Connections int
	// UserPrefix and FirstUser name the users: UserPrefix-00001 on (defaults "user", 1).
	UserPrefix string
	FirstUser  int
	// RetryEvery makes every n-th user ask again after its answer (0: none).
	RetryEvery int
	// Timeout bounds one request.
	Timeout time.Duration
	// RetryUnavailable asks again, after a short pause, when the answer is 503 or no
	// answer came (a pod going away); the grab is idempotent per user, so this is what
	// a real client does. Each user gives up after Timeout × 10.
	RetryUnavailable bool
	// WaitForOpening asks again, at the instant the answer names, when a grab is
	// answered not_started with the user's own opensAt (an activity with a start
	// spread), as the rain page counts down to it. At most 5 times per user.
	WaitForOpening bool
	// Token returns the bearer token of a user; nil sends none.
	Token func(user string) string
	// Rate paces the users: this many start per second (0: all at once).
	Rate int
	// Progress receives a progress line every second; nil prints none.
	Progress io.Writer
	// TLSConfig is the client's TLS configuration for an https URL (nil: Go's
	// defaults, the system's roots).
	TLSConfig *tls.Config
	// DialAddress, when set, is the host:port every connection goes to, whatever the
	// URL's host: a Gateway's address for a public name no resolver here knows, the
	// name still sent as the Host header and the TLS server name.
	DialAddress string
}

// edge points tr at a public edge: tlsConf for an https URL (nil: Go's defaults) and,
// when dialAddress is set, every connection to that host:port whatever the URL's host.
func edge(tr *http.Transport, tlsConf *tls.Config, dialAddress string, timeout time.Duration) {
	tr.TLSClientConfig = tlsConf
	if dialAddress != "" {
		d := &net.Dialer{Timeout: timeout}
		tr.DialContext = func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, dialAddress)
		}
	}
}

// UserName is the name of the i-th user (from 0) of the spec.
func (s Spec) UserName(i int) string {
	prefix := s.UserPrefix
	if prefix == "" {
		prefix = "user"
	}
	first := s.FirstUser
	if first == 0 {
		first = 1
	}
	return fmt.Sprintf("%s-%05d", prefix, first+i)
}

// Errors of one request that a client retries: the grab is idempotent per user.
var (
	errUnavailable = errors.New("HTTP 503 unavailable")
	errTransport   = errors.New("no answer")
)

// Run releases the users (all at once, or paced by Rate), each grabbing once (and
// some twice), over at most Connections keep-alive connections.
func Run(ctx context.Context, spec Spec) Result {
	tr := &http.Transport{MaxIdleConns: spec.Connections, MaxIdleConnsPerHost: spec.Connections,
		MaxConnsPerHost: spec.Connections, DisableCompression: true}
	edge(tr, spec.TLSConfig, spec.DialAddress, spec.Timeout)
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: spec.Timeout}

	type userResult struct {
		first, second *Answer
		latency       []time.Duration
		service       []time.Duration
		err           string
	}
	results := make([]userResult, spec.Users)
	var done, granted, soldOut, requests, unavailable, transportErrs, failed atomic.Int64
	var firstDropped atomic.Pointer[string]
	dropped := func(err error) error {
		transportErrs.Add(1)
		msg := err.Error()
		firstDropped.CompareAndSwap(nil, &msg)
		return fmt.Errorf("%w: %w", errTransport, err)
	}

	// askOnce sends one grab and returns the answer, the user's latency and the
	// latency from the moment the request had a connection.
	askOnce := func(user string) (*Answer, time.Duration, time.Duration, error) {
		body := []byte(`{"userId":"` + user + `"}`)
		var gotConn time.Time
		tctx := httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
			GotConn: func(httptrace.GotConnInfo) { gotConn = time.Now() },
		})
		req, err := http.NewRequestWithContext(tctx, http.MethodPost, spec.URL, bytes.NewReader(body))
		if err != nil {
			return nil, 0, 0, err
		}
		req.Header.Set("Content-Type", "application/json")
		// A grab is idempotent per user; saying so lets the transport resend it on a
		// connection the server closed before answering.
		req.Header.Set("Idempotency-Key", user)
		if spec.Token != nil {
			req.Header.Set("Authorization", "Bearer "+spec.Token(user))
		}
		t0 := time.Now()
		resp, err := hc.Do(req)
		if err != nil {
			return nil, time.Since(t0), 0, dropped(err)
		}
		b, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
		_ = resp.Body.Close()
		end := time.Now()
		d := end.Sub(t0)
		requests.Add(1)
		if err != nil {
			return nil, d, 0, dropped(err)
		}
		if resp.StatusCode == http.StatusServiceUnavailable {
			unavailable.Add(1)
			return nil, d, 0, errUnavailable
		}
		var a Answer
		if err := json.Unmarshal(b, &a); err != nil || a.Outcome == "" {
			failed.Add(1)
			return nil, d, 0, fmt.Errorf("HTTP %d, body %q: not an answer of the grab API", resp.StatusCode, b)
		}
		if resp.StatusCode >= 500 {
			failed.Add(1)
			return nil, d, 0, fmt.Errorf("HTTP %d: %s", resp.StatusCode, b)
		}
		return &a, d, end.Sub(gotConn), nil
	}
	// askRetrying asks again after a 503 or no answer, with RetryUnavailable.
	askRetrying := func(user string) (*Answer, time.Duration, time.Duration, error) {
		giveUp := time.Now().Add(10 * spec.Timeout)
		pause := 50 * time.Millisecond
		for {
			a, d, sd, err := askOnce(user)
			retryable := errors.Is(err, errUnavailable) || errors.Is(err, errTransport)
			if !retryable || !spec.RetryUnavailable || time.Now().After(giveUp) || ctx.Err() != nil {
				return a, d, sd, err
			}
			time.Sleep(pause)
			pause = min(2*pause, time.Second)
		}
	}
	// ask is one user's grab as a phone makes it: retried after a 503 (it may hold
	// a packet, and the retry returns it), and, with WaitForOpening, asked again at
	// the user's own instant of a start spread.
	ask := func(user string) (*Answer, time.Duration, time.Duration, error) {
		a, d, sd, err := askRetrying(user)
		for n := 0; n < 5 && err == nil && spec.WaitForOpening && a.Outcome == "not_started" && a.OpensAt != ""; n++ {
			opens, perr := time.Parse(time.RFC3339Nano, a.OpensAt)
			if perr != nil {
				break
			}
			select {
			case <-time.After(time.Until(opens) + time.Millisecond):
			case <-ctx.Done():
				return a, d, sd, err
			}
			a, d, sd, err = askRetrying(user)
		}
		return a, d, sd, err
	}

	gate := make(chan struct{})
	var wg sync.WaitGroup
	start := time.Now()
	for i := range spec.Users {
		wg.Go(func() {
			defer done.Add(1)
			<-gate
			if spec.Rate > 0 {
				at := start.Add(time.Duration(i) * time.Second / time.Duration(spec.Rate))
				select {
				case <-time.After(time.Until(at)):
				case <-ctx.Done():
				}
			}
			user := spec.UserName(i)
			r := &results[i]
			a, d, sd, err := ask(user)
			if err != nil {
				r.err = err.Error()
				return
			}
			r.first = a
			r.latency = append(r.latency, d)
			r.service = append(r.service, sd)
			switch a.Outcome {
			case "granted":
				granted.Add(1)
			case "sold_out":
				soldOut.Add(1)
			}
			if spec.RetryEvery > 0 && (i+1)%spec.RetryEvery == 0 {
				b, d, sd, err := ask(user)
				if err != nil {
					r.err = err.Error()
					return
				}
				r.second = b
				r.latency = append(r.latency, d)
				r.service = append(r.service, sd)
			}
		})
	}

	start = time.Now()
	close(gate)
	stopProgress := make(chan struct{})
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		if spec.Progress == nil {
			<-stopProgress
			return
		}
		// On a terminal the line is redrawn in place; in a log, one line a second.
		every, prefix, suffix := 200*time.Millisecond, "\r", " "
		tty := spec.Progress == os.Stdout && IsTerminal()
		if !tty {
			every, prefix, suffix = time.Second, "", "\n"
		}
		t := time.NewTicker(every)
		defer t.Stop()
		line := func() {
			el := time.Since(start).Seconds()
			fmt.Fprintf(spec.Progress, "%s  rain: %6d/%d users answered  granted %5d  sold out %6d  %7.0f req/s  %5.1fs%s", prefix,
				done.Load(), spec.Users, granted.Load(), soldOut.Load(), float64(requests.Load())/max(el, 0.001), el, suffix)
		}
		for {
			select {
			case <-t.C:
				line()
			case <-stopProgress:
				line()
				if tty {
					fmt.Fprintln(spec.Progress)
				}
				return
			}
		}
	}()
	wg.Wait()
	elapsed := time.Since(start)
	close(stopProgress)
	<-progressDone

	res := Result{Users: spec.Users, Requests: requests.Load(), Elapsed: elapsed, ByOutcome: map[string]int64{},
		Unavailable: unavailable.Load(), TransportErrors: transportErrs.Load(), Failed: failed.Load(),
		Grants: map[string]Answer{}}
	if p := firstDropped.Load(); p != nil {
		res.FirstDropped = *p
	}
	byPacket := map[string]string{}
	var lat, svc []time.Duration
	for i, r := range results {
		lat = append(lat, r.latency...)
		svc = append(svc, r.service...)
		if r.first == nil {
			res.ByOutcome["error"]++
			if res.FirstError == "" {
				res.FirstError = r.err
			}
			continue
		}
		res.ByOutcome[r.first.Outcome]++
		user := spec.UserName(i)
		// A user asks once; a first answer of already_claimed with a packet means an
		// attempt whose answer was lost (a dropped connection, asked again) was
		// granted: the packet is the user's all the same.
		recovered := r.first.Outcome == "already_claimed" && r.first.PacketID != ""
		if recovered {
			res.Recovered++
		}
		if r.first.Outcome == "granted" || recovered {
			res.Granted++
			res.GrantedSum += r.first.Amount
			res.Grants[user] = *r.first
			if other, ok := byPacket[r.first.PacketID]; ok && other != user {
				res.DupPackets++
			}
			byPacket[r.first.PacketID] = user
		}
		if r.second != nil {
			res.Retries++
			switch {
			case r.first.Outcome == "granted" || recovered:
				// A retry of a grant must return the very same packet.
				if r.second.Outcome == "already_claimed" && r.second.PacketID == r.first.PacketID && r.second.Amount == r.first.Amount {
					res.RetriesSame++
				} else {
					res.RetriesInconsistent++
				}
			case r.first.Outcome == "sold_out" && r.second.Outcome == "granted":
				// Packets never come back after sold out.
				res.RetriesInconsistent++
			default:
				res.RetriesSame++
			}
		} else if r.err != "" && res.FirstError == "" {
			res.FirstError = r.err
		}
	}
	slices.Sort(lat)
	if n := len(lat); n > 0 {
		res.P50, res.P99, res.Max = lat[n*50/100], lat[min(n-1, n*99/100)], lat[n-1]
	}
	slices.Sort(svc)
	if n := len(svc); n > 0 {
		res.ServiceP50, res.ServiceP99 = svc[n*50/100], svc[min(n-1, n*99/100)]
	}
	return res
}

// IsTerminal reports whether standard output is a terminal.
func IsTerminal() bool {
	fi, err := os.Stdout.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
