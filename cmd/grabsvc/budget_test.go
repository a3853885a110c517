package main

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// TestBudgetFlags: budget mode needs its UID, shard count and sender credential, and
// excludes --activity and its flags.
func TestBudgetFlags(t *testing.T) {
	t.Setenv("REDIS_ADDRESSES", "a:1")
	ok := []string{"--budget", "b", "--budget-uid", "u", "--budget-shards", "16", "--sender-token-file", "/t"}
	o, err := parseFlags(ok, io.Discard)
	if err != nil || o.budget != "b" || o.budgetUID != "u" || o.budgetShards != 16 || o.senderTokenFile != "/t" {
		t.Fatalf("%v: %+v %v", ok, o, err)
	}
	for _, args := range [][]string{
		{"--budget", "b", "--activity", "a", "--budget-uid", "u", "--budget-shards", "16", "--sender-token-file", "/t"},
		{"--budget", "b", "--budget-shards", "16", "--sender-token-file", "/t"},
		{"--budget", "b", "--budget-uid", "u", "--sender-token-file", "/t"},
		{"--budget", "b", "--budget-uid", "u", "--budget-shards", "257", "--sender-token-file", "/t"},
		{"--budget", "b", "--budget-uid", "u", "--budget-shards", "16"},
		{"--budget", "b", "--budget-uid", "u", "--budget-shards", "16", "--sender-token-file", "/t", "--activity-uid", "x"},
		{"--activity", "a", "--budget-uid", "u"},
		{"--activity", "a", "--sender-token-file", "/t"},
	} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
}

// TestBudgetMode runs the service in budget mode as the controller starts it, on a
// real redis-server, with no API server: it becomes ready, creates a packet with the
// mounted sender credential (and refuses one without), serves a grab and the packet
// page, and picks up a rotated credential.
func TestBudgetMode(t *testing.T) {
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := store.NewBudget(admin, "budget-uid-1", 8)
	if err := b.Configure(ctx, 100_000, store.BudgetLimits{Currency: "CNY", MaxTotal: 10_000, MaxCount: 100, MinShare: 1,
		Distributions: []string{split.TypeRandom}, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte("first-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--namespace", "shop", "--budget", "group-packets", "--budget-uid", "budget-uid-1",
			"--budget-shards", "8", "--listen", addr, "--sender-token-file", tokenFile, "--redis-addresses", srv.Addr,
			"--activity-refresh", "100ms", "--shutdown-delay", "0",
			"--redis-username", srv.Username, "--redis-password", srv.Password}, io.Discard)
	}()
	base := "http://" + addr
	wait.Until(t, 10*time.Second, "the budget-mode service to be ready", func() (bool, string) {
		resp, err := http.Get(base + "/readyz")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		return resp.StatusCode == 200, resp.Status
	})
	body := `{"id":"order-1","sender":"m-1","totalAmount":500,"count":5}`
	if code, _ := post(t, base+"/v1/packets", body, nil); code != http.StatusUnauthorized {
		t.Fatalf("creation without the credential: %d", code)
	}
	if code, got := post(t, base+"/v1/packets", body, map[string]string{"Authorization": "Bearer first-token"}); code != http.StatusCreated || got["id"] != "order-1" {
		t.Fatalf("creation: %d %v", code, got)
	}
	if code, got := post(t, base+"/v1/packets/order-1/grab", `{"userId":"u-1"}`, nil); code != http.StatusOK || got["outcome"] != "granted" {
		t.Fatalf("grab: %d %v", code, got)
	}
	resp, err := http.Get(base + "/p/order-1")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(page), "../assets/packet.") {
		t.Fatalf("packet page: %d", resp.StatusCode)
	}
	if err := os.WriteFile(tokenFile, []byte("second-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 5*time.Second, "the rotated credential", func() (bool, string) {
		code, _ := post(t, base+"/v1/packets", `{"id":"order-2","sender":"m-1","totalAmount":500,"count":5}`,
			map[string]string{"Authorization": "Bearer second-token"})
		return code == http.StatusCreated, http.StatusText(code)
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the service did not stop")
	}
}
