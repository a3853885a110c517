package settlement

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// A delivery dials a host name as fully qualified: a trailing dot is added (so no
// resolver search domain applies), IP literals and absolute names are kept; the
// request's Host header stays as the URL spells it.
func TestDeliveriesDialHostNamesFullyQualified(t *testing.T) {
	for addr, want := range map[string]string{
		"balance.payments.svc.cluster.local:8080":  "balance.payments.svc.cluster.local.:8080",
		"balance.payments.svc.cluster.local.:8080": "balance.payments.svc.cluster.local.:8080",
		"balance:80":      "balance.:80",
		"127.0.0.1:38080": "127.0.0.1:38080",
		"[::1]:443":       "[::1]:443",
	} {
		if got := fullyQualifiedAddr(addr); got != want {
			t.Errorf("fullyQualifiedAddr(%q) = %q, want %q", addr, got, want)
		}
	}

	srvAddr := ""
	var dialled []string
	dial := dialFullyQualified(func(ctx context.Context, network, addr string) (net.Conn, error) {
		// The name stands for the test server: this dial resolves it itself.
		dialled = append(dialled, addr)
		return (&net.Dialer{}).DialContext(ctx, network, srvAddr)
	})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte(r.Host))
	}))
	t.Cleanup(srv.Close)
	srvAddr = strings.TrimPrefix(srv.URL, "http://")
	_, port, _ := net.SplitHostPort(srvAddr)
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.DialContext = dial
	t.Cleanup(tr.CloseIdleConnections)
	resp, err := (&http.Client{Transport: tr}).Get("http://balance.payments.svc.cluster.local:" + port + "/")
	if err != nil {
		t.Fatalf("a delivery: %v", err)
	}
	host, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if want := "balance.payments.svc.cluster.local.:" + port; len(dialled) != 1 || dialled[0] != want {
		t.Errorf("dialled %v, want %s", dialled, want)
	}
	if want := "balance.payments.svc.cluster.local:" + port; string(host) != want {
		t.Errorf("Host header %q, want %q", host, want)
	}
}
