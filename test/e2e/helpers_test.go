package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/test/printed"
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
	p, err := proc.Start("grab service", logPath, env.redisEnv, env.grabsvc, args...)
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
	cells, err := printed.FirstRow(out)
	if err != nil {
		t.Fatalf("kubectl get %s: %v", strings.Join(args, " "), err)
	}
	return cells
}

// newBalance starts a balance system (an unsigned rain.Receiver) on loopback for the
// test, allows its host and port in the operator's settlement keys Secret (keyed
// "127.0.0.1_<port>"), and returns it with its webhook URL.
func newBalance(t *testing.T) (*rain.Receiver, string) {
	t.Helper()
	b := rain.NewReceiver(nil)
	url, stop, err := b.Serve(t.Context(), "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	key := strings.Replace(strings.TrimPrefix(url, "http://"), ":", "_", 1)
	mustKubectl(t, "", "-n", operatorNamespace, "patch", "secret", "redpacket-settlement-keys", "--type=merge",
		"-p", `{"stringData":{"`+key+`":"e2e-operator-signing-key"}}`)
	return b, url + "/credit"
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
