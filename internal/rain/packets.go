package rain

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
)

// GroupSpec is a burst of seed 004's group packets against a RedPacketBudget's grab
// fleet: Packets packets created through POST /v1/packets with the sender
// credential, then each raced by its group through POST /v1/packets/{id}/grab.
type GroupSpec struct {
	// URL is the fleet's base URL, such as http://<ClusterIP>.
	URL string
	// SenderToken is the budget's sender credential (Secret <budget>-sender, key token).
	SenderToken string
	// Packets is how many packets to create, with ids IDPrefix0, IDPrefix1, ...
	Packets  int
	IDPrefix string
	// Total and Shares are each packet's money (minor units) and share count.
	Total  int64
	Shares int
	// Members is the size of packet p's group; the members are friend-0, friend-1, ...
	Members func(p int) int
	// TTLSeconds is each packet's time to live; 0: the budget's default.
	TTLSeconds int
	// Workers is how many requests run at once (64 when 0).
	Workers int
	// TLSConfig and DialAddress reach the fleet through a public edge, as Spec's do.
	TLSConfig   *tls.Config
	DialAddress string
}

// GroupShare is one share a member won.
type GroupShare struct {
	User   string
	Amount int64
}

// GroupResult is what a burst saw.
type GroupResult struct {
	// Created counts the packets answered 201 or 200 (an identical repeat).
	Created int
	// Won holds each packet's granted shares, by packet index.
	Won map[int][]GroupShare
	// Grabs counts the grab requests; SoldOut those answered sold_out.
	Grabs, SoldOut int
	// CreateElapsed and GrabElapsed are the two phases' wall times.
	CreateElapsed, GrabElapsed time.Duration
	// Errors are the answers that were none of the above, at most 20.
	Errors []string
}

// Check reports, for every packet, what is wrong with its winners: more winners
// than shares, a member twice, or (when the group was larger than the shares) not
// every share gone or the amounts not summing to the total. It returns the money
// granted in all.
func (r GroupResult) Check(spec GroupSpec) (int64, error) {
	var claimed int64
	for p := range spec.Packets {
		seen := map[string]bool{}
		var sum int64
		for _, s := range r.Won[p] {
			if seen[s.User] {
				return 0, fmt.Errorf("packet %s%d: %s won twice", spec.IDPrefix, p, s.User)
			}
			seen[s.User] = true
			sum += s.Amount
		}
		want := min(spec.Members(p), spec.Shares)
		if len(r.Won[p]) != want || sum > spec.Total || (want == spec.Shares && sum != spec.Total) {
			return 0, fmt.Errorf("packet %s%d: %d winners summing to %d, want %d of %d shares (all of %d when every share went)",
				spec.IDPrefix, p, len(r.Won[p]), sum, want, spec.Shares, spec.Total)
		}
		claimed += sum
	}
	return claimed, nil
}

// RunGroups creates the packets, then races each with its group. A 503 or a dropped
// connection is asked again (creation and grabs are idempotent), up to 20 times.
func RunGroups(ctx context.Context, spec GroupSpec) GroupResult {
	workers := spec.Workers
	if workers <= 0 {
		workers = 64
	}
	tr := &http.Transport{MaxIdleConnsPerHost: workers}
	edge(tr, spec.TLSConfig, spec.DialAddress, 10*time.Second)
	hc := &http.Client{Timeout: 10 * time.Second, Transport: tr}
	res := GroupResult{Won: make(map[int][]GroupShare, spec.Packets)}
	var mu sync.Mutex
	fail := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(res.Errors) < 20 {
			res.Errors = append(res.Errors, fmt.Sprintf(format, args...))
		}
	}
	post := func(path string, body any, bearer string) (int, map[string]any) {
		raw, _ := json.Marshal(body)
		var last error
		for range 20 {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, spec.URL+path, bytes.NewReader(raw))
			if err != nil {
				return 0, nil
			}
			req.Header.Set("Content-Type", "application/json")
			if bearer != "" {
				req.Header.Set("Authorization", "Bearer "+bearer)
			}
			resp, err := hc.Do(req)
			if err == nil && resp.StatusCode != http.StatusServiceUnavailable {
				data, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				var out map[string]any
				_ = json.Unmarshal(data, &out)
				return resp.StatusCode, out
			}
			if err == nil {
				resp.Body.Close()
				err = fmt.Errorf("HTTP 503")
			}
			last = err
			if ctx.Err() != nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		return 0, map[string]any{"error": fmt.Sprint(last)}
	}
	each := func(n int, f func(i int)) {
		var wg sync.WaitGroup
		next := make(chan int)
		for range workers {
			wg.Go(func() {
				for i := range next {
					f(i)
				}
			})
		}
		for i := range n {
			if ctx.Err() != nil {
				break
			}
			next <- i
		}
		close(next)
		wg.Wait()
	}

	start := time.Now()
	each(spec.Packets, func(p int) {
		body := map[string]any{"id": fmt.Sprintf("%s%d", spec.IDPrefix, p), "sender": fmt.Sprintf("merchant-%d", p%7),
			"totalAmount": spec.Total, "count": spec.Shares, "distribution": "Random"}
		if spec.TTLSeconds > 0 {
			body["ttlSeconds"] = spec.TTLSeconds
		}
		code, out := post("/v1/packets", body, spec.SenderToken)
		if code != http.StatusCreated && code != http.StatusOK {
			fail("creating %s%d: %d %v", spec.IDPrefix, p, code, out)
			return
		}
		mu.Lock()
		res.Created++
		mu.Unlock()
	})
	res.CreateElapsed = time.Since(start)

	start = time.Now()
	each(spec.Packets, func(p int) {
		for u := range spec.Members(p) {
			user := fmt.Sprintf("friend-%d", u)
			code, out := post(fmt.Sprintf("/v1/packets/%s%d/grab", spec.IDPrefix, p), map[string]any{"userId": user}, "")
			mu.Lock()
			res.Grabs++
			switch {
			case code == http.StatusOK && out["outcome"] == "granted":
				amount, _ := out["amount"].(float64)
				res.Won[p] = append(res.Won[p], GroupShare{User: user, Amount: int64(amount)})
			case code == http.StatusConflict && out["outcome"] == "sold_out":
				res.SoldOut++
			default:
				mu.Unlock()
				fail("%s%d, %s: %d %v", spec.IDPrefix, p, user, code, out)
				continue
			}
			mu.Unlock()
		}
	})
	res.GrabElapsed = time.Since(start)
	return res
}
