package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// grabAnswer is the grab service's JSON answer.
type grabAnswer struct {
	Outcome  string `json:"outcome"`
	PacketID string `json:"packetId"`
	Amount   int64  `json:"amount"`
	Error    string `json:"error"`
}

// rainResult is everything the rain observed on the client side.
type rainResult struct {
	Users     int
	Requests  int64
	Elapsed   time.Duration
	ByOutcome map[string]int64 // first attempts, by outcome ("error" for transport failures)
	// Retries are second attempts by the same user. RetriesSame were consistent with
	// the first answer (a grant's retry got the same packet back as already_claimed);
	// RetriesInconsistent were not.
	Retries, RetriesSame, RetriesInconsistent int64
	Granted                                   int64
	GrantedSum                                int64
	// DupPackets counts packet ids granted to more than one user.
	DupPackets int64
	// P50, P99 and Max are what the users saw, waiting for one of the shared
	// connections included; ServiceP50 and ServiceP99 start once the request has a
	// connection.
	P50, P99, Max          time.Duration
	ServiceP50, ServiceP99 time.Duration
	FirstError             string
}

// rainSpec shapes the red-packet rain.
type rainSpec struct {
	URL         string
	Users       int
	Connections int
	RetryEvery  int // every n-th user asks again after its answer (0: none)
	Timeout     time.Duration
}

// rain releases Users goroutines at once, each a user grabbing once (and some twice),
// over at most Connections keep-alive connections, with a one-line progress display.
func rain(ctx context.Context, spec rainSpec) rainResult {
	tr := &http.Transport{MaxIdleConns: spec.Connections, MaxIdleConnsPerHost: spec.Connections,
		MaxConnsPerHost: spec.Connections, DisableCompression: true}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: spec.Timeout}

	type userResult struct {
		first, second *grabAnswer
		latency       []time.Duration
		service       []time.Duration
		err           string
	}
	results := make([]userResult, spec.Users)
	var done, granted, soldOut, requests atomic.Int64

	// ask sends one grab and returns the answer, the user's latency and the latency
	// from the moment the request had a connection.
	ask := func(user string) (*grabAnswer, time.Duration, time.Duration, error) {
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
		t0 := time.Now()
		resp, err := hc.Do(req)
		if err != nil {
			return nil, time.Since(t0), 0, err
		}
		b, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
		_ = resp.Body.Close()
		end := time.Now()
		d := end.Sub(t0)
		requests.Add(1)
		if err != nil {
			return nil, d, 0, err
		}
		var a grabAnswer
		if err := json.Unmarshal(b, &a); err != nil {
			return nil, d, 0, fmt.Errorf("HTTP %d, body %q: %w", resp.StatusCode, b, err)
		}
		return &a, d, end.Sub(gotConn), nil
	}

	gate := make(chan struct{})
	var wg sync.WaitGroup
	for i := range spec.Users {
		wg.Go(func() {
			defer done.Add(1)
			<-gate
			user := fmt.Sprintf("user-%05d", i+1)
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

	start := time.Now()
	close(gate)
	stopProgress := make(chan struct{})
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		// On a terminal the line is redrawn in place; in a log, one line a second.
		every, prefix, suffix := 200*time.Millisecond, "\r", " "
		if !isTerminal() {
			every, prefix, suffix = time.Second, "", "\n"
		}
		t := time.NewTicker(every)
		defer t.Stop()
		line := func() {
			el := time.Since(start).Seconds()
			fmt.Printf("%s  rain: %6d/%d users answered  granted %5d  sold out %6d  %7.0f req/s  %5.1fs%s", prefix,
				done.Load(), spec.Users, granted.Load(), soldOut.Load(), float64(requests.Load())/max(el, 0.001), el, suffix)
		}
		for {
			select {
			case <-t.C:
				line()
			case <-stopProgress:
				line()
				if isTerminal() {
					fmt.Println()
				}
				return
			}
		}
	}()
	wg.Wait()
	elapsed := time.Since(start)
	close(stopProgress)
	<-progressDone

	res := rainResult{Users: spec.Users, Requests: requests.Load(), Elapsed: elapsed, ByOutcome: map[string]int64{}}
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
		user := fmt.Sprintf("user-%05d", i+1)
		if r.first.Outcome == "granted" {
			res.Granted++
			res.GrantedSum += r.first.Amount
			if other, ok := byPacket[r.first.PacketID]; ok && other != user {
				res.DupPackets++
			}
			byPacket[r.first.PacketID] = user
		}
		if r.second != nil {
			res.Retries++
			switch {
			case r.first.Outcome == "granted":
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

// isTerminal reports whether standard output is a terminal.
func isTerminal() bool {
	fi, err := os.Stdout.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
