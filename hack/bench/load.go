package main

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"redpacket.io/operator/grabsvc"
)

// latencies summarises one measured run.
type latencies struct {
	// Requests is how many operations completed (successfully or not).
	Requests int64
	// Errors counts transport errors and unexpected statuses.
	Errors int64
	// Elapsed is the measured wall time.
	Elapsed time.Duration
	// P50, P99 and Max are per-operation latencies.
	P50, P99, Max time.Duration
	// ByStatus counts HTTP statuses or outcomes.
	ByStatus map[string]int64
	// CPU is, per meter of the run, the CPU time spent per operation.
	CPU map[string]time.Duration
}

// cpuMeter reads one process's CPU time so far (user and system).
type cpuMeter struct {
	name string
	read func() (time.Duration, error)
}

// procCPU meters the process pid from /proc/<pid>/stat (utime and stime, in clock
// ticks of 1/100 s as Linux reports them to user space).
func procCPU(name string, pid int) cpuMeter {
	return cpuMeter{name: name, read: func() (time.Duration, error) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return 0, err
		}
		// The command name, field 2, is in parentheses and may hold spaces and
		// parentheses itself, so the fields are read after the last ')'.
		i := strings.LastIndexByte(string(b), ')')
		f := strings.Fields(string(b[i+1:]))
		if i < 0 || len(f) < 13 {
			return 0, fmt.Errorf("/proc/%d/stat: %q", pid, b)
		}
		var ticks int64
		for _, v := range f[11:13] { // utime and stime, fields 14 and 15
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
			}
			ticks += n
		}
		return time.Duration(ticks) * 10 * time.Millisecond, nil
	}}
}

// loadGenerator names the benchmark's own process in a run's CPU figures.
const loadGenerator = "load generator"

// selfCPU meters this process: during a load run, the load generator.
func selfCPU() cpuMeter {
	return cpuMeter{name: loadGenerator, read: func() (time.Duration, error) {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			return 0, err
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
	}}
}

// metered runs f and returns its latencies with l.CPU filled from meters: each
// meter's CPU time during f over the operations f counted.
func metered(meters []cpuMeter, f func() (latencies, error)) (latencies, error) {
	before := make([]time.Duration, len(meters))
	for i, m := range meters {
		v, err := m.read()
		if err != nil {
			return latencies{}, fmt.Errorf("reading the CPU time of %s: %w", m.name, err)
		}
		before[i] = v
	}
	l, err := f()
	if err != nil || l.Requests == 0 {
		return l, err
	}
	l.CPU = map[string]time.Duration{}
	for i, m := range meters {
		v, err := m.read()
		if err != nil {
			return l, fmt.Errorf("reading the CPU time of %s: %w", m.name, err)
		}
		l.CPU[m.name] = (v - before[i]) / time.Duration(l.Requests)
	}
	return l, nil
}

// Rate is operations per second.
func (l latencies) Rate() float64 {
	if l.Elapsed <= 0 {
		return 0
	}
	return float64(l.Requests) / l.Elapsed.Seconds()
}

// medianRound is the round whose key is the median (of an even number of rounds, the
// lower of the middle two; of none, the zero round). Every comparison the benchmark
// makes in rounds reports its median round.
func medianRound[T any](rounds []T, key func(T) float64) T {
	if len(rounds) == 0 {
		var zero T
		return zero
	}
	sorted := slices.Clone(rounds)
	slices.SortFunc(sorted, func(a, b T) int { return cmp.Compare(key(a), key(b)) })
	return sorted[(len(sorted)-1)/2]
}

// summarise sorts the samples and fills the percentiles.
func summarise(samples []time.Duration, elapsed time.Duration, errs int64, by map[string]int64) latencies {
	slices.Sort(samples)
	l := latencies{Requests: int64(len(samples)), Errors: errs, Elapsed: elapsed, ByStatus: by}
	if n := len(samples); n > 0 {
		l.P50 = samples[n*50/100]
		l.P99 = samples[min(n-1, n*99/100)]
		l.Max = samples[n-1]
	}
	return l
}

// errCutOff is what a closedLoop call returns when the end of the run cut it short:
// its worker stops without counting it.
var errCutOff = errors.New("cut off by the end of the run")

// closedLoop runs workers goroutines that each make one call at a time, back to
// back, for dur or until limit calls were started (0: no limit), and times every
// call. call gets the measuring context and the call's number (1, 2, ... across
// all workers) and returns the label counted in ByStatus; a failed call counts as
// an error under "error", except errCutOff. It returns the summary, the first
// failed call's error (l.Errors counts them all) and ctx's error if ctx ended.
func closedLoop(ctx context.Context, workers int, dur time.Duration, limit int64, call func(mctx context.Context, i int64) (string, error)) (l latencies, firstErr, err error) {
	mctx, cancel := context.WithTimeout(ctx, dur)
	defer cancel()
	var next atomic.Int64
	type result struct {
		samples  []time.Duration
		errs     int64
		by       map[string]int64
		firstErr error
	}
	results := make([]result, workers)
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Go(func() {
			r := result{by: map[string]int64{}}
			for mctx.Err() == nil {
				i := next.Add(1)
				if limit > 0 && i > limit {
					break
				}
				t0 := time.Now()
				label, err := call(mctx, i)
				d := time.Since(t0)
				if errors.Is(err, errCutOff) {
					break
				}
				if err != nil {
					r.errs++
					r.by["error"]++
					if r.firstErr == nil {
						r.firstErr = err
					}
					continue
				}
				r.samples = append(r.samples, d)
				r.by[label]++
			}
			results[w] = r
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := ctx.Err(); err != nil {
		return latencies{}, nil, err
	}
	var all []time.Duration
	var errs int64
	by := map[string]int64{}
	for _, r := range results {
		all = append(all, r.samples...)
		errs += r.errs
		for k, v := range r.by {
			by[k] += v
		}
		if firstErr == nil {
			firstErr = r.firstErr
		}
	}
	return summarise(all, elapsed, errs, by), firstErr, nil
}

// loadSpec is one closed-loop load: Clients workers each send one request at a time
// over a kept-alive connection, for Duration or until Max requests were sent, after
// Warmup of unmeasured traffic.
type loadSpec struct {
	URL      string
	Clients  int
	Duration time.Duration
	Warmup   time.Duration
	Max      int64
	// Body returns the body of request number i (unique across workers).
	Body func(i int64) []byte
	// URLOf, when set, returns the URL of request number i instead of URL.
	URLOf func(i int64) string
	// Header is set on every request besides Content-Type.
	Header map[string]string
	// Meters are read before and after the measured part.
	Meters []cpuMeter
}

// runHTTPLoad is the Go load generator: keep-alive HTTP/1.1 clients in a closed loop,
// latencies recorded per request.
func runHTTPLoad(ctx context.Context, spec loadSpec) (latencies, error) {
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConns:        spec.Clients,
		MaxIdleConnsPerHost: spec.Clients,
		MaxConnsPerHost:     spec.Clients,
		DisableCompression:  true,
		IdleConnTimeout:     30 * time.Second,
	}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}

	var next atomic.Int64
	send := func(ctx context.Context) (int, error) {
		i := next.Add(1)
		url := spec.URL
		if spec.URLOf != nil {
			url = spec.URLOf(i)
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(spec.Body(i)))
		if err != nil {
			return 0, fmt.Errorf("building request: %w", err)
		}
		req.Header.Set("Content-Type", "application/json")
		for k, v := range spec.Header {
			req.Header.Set(k, v)
		}
		resp, err := hc.Do(req)
		if err != nil {
			return 0, err
		}
		_, err = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode, err
	}

	// Warm up: open the connections and let both sides reach steady state.
	if spec.Warmup > 0 {
		wctx, cancel := context.WithTimeout(ctx, spec.Warmup)
		var wg sync.WaitGroup
		for w := 0; w < spec.Clients; w++ {
			wg.Go(func() {
				for wctx.Err() == nil {
					if _, err := send(wctx); err != nil && wctx.Err() == nil {
						return
					}
				}
			})
		}
		wg.Wait()
		cancel()
		if err := ctx.Err(); err != nil {
			return latencies{}, err
		}
	}

	return metered(spec.Meters, func() (latencies, error) {
		l, _, err := closedLoop(ctx, spec.Clients, spec.Duration, spec.Max, func(mctx context.Context, _ int64) (string, error) {
			code, err := send(mctx)
			if err != nil {
				if mctx.Err() != nil {
					return "", errCutOff // cut off by the end of the run, not a failure
				}
				return "", err
			}
			return strconv.Itoa(code), nil
		})
		return l, err
	})
}

// noopResponse is what the no-op handler answers: the size of a granted answer.
var noopResponse = []byte(`{"outcome":"granted","packetId":"1234567","amount":100}` + "\n")

// noopHandler does what any JSON handler must do and nothing else: read the body and
// write a small JSON answer, with the headers of the grab service's grant.
func noopHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 4096))
		h := w.Header()
		h.Set("Content-Type", "application/json")
		h.Set("Cache-Control", "no-store")
		_, _ = w.Write(noopResponse)
	})
}

// serveNoop runs the no-op handler on a free loopback port until ctx ends.
func serveNoop(ctx context.Context, addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", addr, err)
	}
	// The grab service's own server settings (its header, read, write and idle
	// timeouts, which set socket deadlines on every request), so c/d compares the
	// handlers and not the servers' configuration.
	srv := grabsvc.NewHTTPServer(addr, noopHandler())
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serving the no-op handler: %w", err)
	}
	return nil
}
