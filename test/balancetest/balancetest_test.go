package balancetest

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/pgtest"
)

// TestBooksSignedCreditsAndLeavesNothingBehind runs cmd/balance, built from this
// tree, on its own PostgreSQL with only an Ed25519 public key: an announcement and
// two grants signed v1a are booked and read back through the read API, a grant
// signed with another key is refused and counted as an alarm, and Stop removes the
// database cluster's directory.
func TestBooksSignedCreditsAndLeavesNothingBehind(t *testing.T) {
	pgtest.Require(t)
	root, err := controlplane.Root()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "balance")
	if err := Build(t.Context(), root, bin); err != nil {
		t.Fatal(err)
	}
	pub, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	s, err := Start(t.Context(), Options{Binary: bin, Host: "127.0.0.1", Dir: dir, PublicKeys: []ed25519.PublicKey{pub}})
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = s.Stop()
		}
	})

	const uid = "2f0c6a51-0d7e-4d36-9d0e-activity0001"
	at := time.Now().UTC().Format(time.RFC3339)
	post := func(k ed25519.PrivateKey, key string, d balance.Delivery) int {
		t.Helper()
		body, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		req, err := http.NewRequest(http.MethodPost, s.WebhookURL(), bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		id, now := webhooksig.MessageID(key), time.Now().Unix()
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set(webhooksig.HeaderID, id)
		req.Header.Set(webhooksig.HeaderTimestamp, strconv.FormatInt(now, 10))
		req.Header.Set(webhooksig.HeaderSignature, webhooksig.Sign(webhooksig.Keys{Ed25519: []ed25519.PrivateKey{k}}, id, now, body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := post(key, uid+"/budget", balance.Delivery{Kind: "budget", Activity: "default/demo", ActivityUID: uid,
		Amount: 1000, Count: 3, Currency: "CNY", At: at}); got != http.StatusCreated {
		t.Fatalf("the announcement: HTTP %d, want 201", got)
	}
	for i, amount := range []int64{300, 450} {
		packet := strconv.Itoa(i + 1)
		if got := post(key, uid+"/"+packet, balance.Delivery{Kind: "grant", Activity: "default/demo", ActivityUID: uid,
			PacketID: packet, UserID: "user-" + packet, Amount: amount, Currency: "CNY", At: at}); got != http.StatusCreated {
			t.Fatalf("grant %s: HTTP %d, want 201", packet, got)
		}
	}
	_, otherKey, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	if got := post(otherKey, uid+"/3", balance.Delivery{Kind: "grant", Activity: "default/demo", ActivityUID: uid,
		PacketID: "3", UserID: "user-3", Amount: 1, Currency: "CNY", At: at}); got != http.StatusUnauthorized {
		t.Fatalf("a grant signed with another key: HTTP %d, want 401", got)
	}

	src, ok, err := s.Source(t.Context(), uid)
	if err != nil || !ok {
		t.Fatalf("the source: %+v, %v, %v", src, ok, err)
	}
	if src.Total != 1000 || src.Grants != (balance.Tally{Count: 2, Sum: 750}) || src.Refunds != (balance.Tally{}) {
		t.Errorf("the source's book: %+v, want a total of 1000, 2 grants summing to 750, no refund", src)
	}
	credits, err := s.Credits(t.Context(), uid)
	if err != nil {
		t.Fatal(err)
	}
	if len(credits) != 2 || credits[0].UserID != "user-1" || credits[1].Amount != 450 {
		t.Errorf("the credits: %+v", credits)
	}
	if _, ok, err := s.Source(t.Context(), "never-announced"); ok || err != nil {
		t.Errorf("a source never announced: %v, %v; want not found", ok, err)
	}
	refusals, err := s.Refusals()
	if err != nil {
		t.Fatal(err)
	}
	if alarms := Alarms(refusals); len(alarms) != 1 || alarms[balance.CodeBadSignature] != 1 {
		t.Errorf("alarms %v (refusals %v), want one bad_signature", alarms, refusals)
	}

	dbDir := s.DB.Dir
	stopped = true
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dbDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s is still there after Stop: %v", dbDir, err)
	}
}
