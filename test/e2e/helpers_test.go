package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"redpacket.io/operator/test/proc"
)

// namespace creates a namespace for the test with kubectl.
func namespace(t *testing.T, name string) string {
	t.Helper()
	mustKubectl(t, "", "create", "namespace", name)
	return name
}

// startGrab runs the grab service binary for one activity until the test ends and
// returns its base URL.
func startGrab(t *testing.T, ns, name string) string {
	t.Helper()
	return startGrabWith(t, ns, name)
}

// startGrabWith is startGrab with extra flags.
func startGrabWith(t *testing.T, ns, name string, extra ...string) string {
	t.Helper()
	addr, err := proc.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(t.TempDir(), "grabsvc.log")
	args := append([]string{"--namespace", ns, "--activity", name, "--listen", addr,
		"--kubeconfig", env.kubeconfig, "--redis-addresses", env.redisAddr, "--report-interval", "500ms",
		"--shutdown-delay", "0s"}, extra...)
	p, err := proc.Start("grab service", logPath, nil, env.grabsvc, args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Stop(stopGrace)
		if t.Failed() {
			t.Logf("grab service log:\n%s", proc.Tail(logPath, tailBytes))
		}
	})
	if err := proc.WaitHTTP(t.Context(), p, "http://"+addr+"/readyz", 60*time.Second); err != nil {
		t.Fatalf("grab service: %v\n%s", err, proc.Tail(logPath, tailBytes))
	}
	return "http://" + addr
}

// answer is the grab service's JSON answer.
type answer struct {
	Outcome  string `json:"outcome"`
	PacketID string `json:"packetId"`
	Amount   int64  `json:"amount"`
	Error    string `json:"error"`
}

// grab posts body to /v1/grab and returns the HTTP status and the answer.
func grabRaw(t *testing.T, base, body string) (int, answer) {
	t.Helper()
	resp, err := http.Post(base+"/v1/grab", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("POST /v1/grab: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	var a answer
	if err := json.Unmarshal(b, &a); err != nil {
		t.Fatalf("answer %q (HTTP %d) is not JSON: %v", b, resp.StatusCode, err)
	}
	return resp.StatusCode, a
}

// grab claims a packet for user.
func grab(t *testing.T, base, user string) (int, answer) {
	t.Helper()
	return grabRaw(t, base, `{"userId":"`+user+`"}`)
}

// columns runs kubectl get with args and returns the first row as a map from the
// printed column headers to the cells.
func columns(t *testing.T, args ...string) map[string]string {
	t.Helper()
	out := mustKubectl(t, "", append([]string{"get"}, args...)...)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) < 2 {
		t.Fatalf("kubectl get %s printed no row:\n%s", strings.Join(args, " "), out)
	}
	header := lines[0]
	row := lines[1]
	// Columns are left-aligned under their headers; cut the row at the headers' starts.
	type col struct {
		name  string
		start int
	}
	var cols []col
	for i := 0; i < len(header); {
		for i < len(header) && header[i] == ' ' {
			i++
		}
		if i >= len(header) {
			break
		}
		j := i
		for j < len(header) && header[j] != ' ' {
			j++
		}
		cols = append(cols, col{name: header[i:j], start: i})
		i = j
	}
	cells := map[string]string{}
	for k, c := range cols {
		end := len(row)
		if k+1 < len(cols) {
			end = min(cols[k+1].start, len(row))
		}
		if c.start >= len(row) {
			cells[c.name] = ""
			continue
		}
		cells[c.name] = strings.TrimSpace(row[c.start:end])
	}
	return cells
}

// delivery is one settlement webhook call as the balance system sees it.
type delivery struct {
	Kind        string `json:"kind"`
	Activity    string `json:"activity"`
	ActivityUID string `json:"activityUID"`
	PacketID    string `json:"packetId"`
	UserID      string `json:"userId"`
	Amount      int64  `json:"amount"`
	Currency    string `json:"currency"`
	At          string `json:"at"`
}

// balance is a balance system that credits each Idempotency-Key once.
type balance struct {
	srv      *httptest.Server
	mu       sync.Mutex
	credited map[string]delivery
	repeats  int
}

func newBalance(t *testing.T) *balance {
	b := &balance{credited: map[string]delivery{}}
	b.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var d delivery
		if err := json.NewDecoder(bytes.NewReader(body)).Decode(&d); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		key := r.Header.Get("Idempotency-Key")
		if key == "" {
			http.Error(w, "no Idempotency-Key", http.StatusBadRequest)
			return
		}
		b.mu.Lock()
		defer b.mu.Unlock()
		if _, ok := b.credited[key]; ok {
			b.repeats++
		} else {
			b.credited[key] = d
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(b.srv.Close)
	return b
}

// URL is the webhook's address.
func (b *balance) URL() string { return b.srv.URL + "/credit" }

// sums returns the credited grants (count, amount) and refunds (count, amount).
func (b *balance) sums() (grants, grantSum, refunds, refundSum int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, d := range b.credited {
		switch d.Kind {
		case "grant":
			grants++
			grantSum += d.Amount
		case "refund":
			refunds++
			refundSum += d.Amount
		}
	}
	return
}

// get returns the delivery credited under key.
func (b *balance) get(key string) (delivery, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	d, ok := b.credited[key]
	return d, ok
}

// manifest renders an activity manifest.
func manifest(ns, name string, spec string) string {
	return fmt.Sprintf("apiVersion: redpacket.io/v1alpha1\nkind: RedPacketActivity\nmetadata:\n  name: %s\n  namespace: %s\nspec:\n%s", name, ns, spec)
}

// writeFile writes content into the test's temporary directory.
func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}
