package rain

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"redpacket.io/operator/pkg/webhooksig"
)

// signedPost POSTs d to url as the operator does: its Idempotency-Key, the Standard
// Webhooks headers signed with keys at the time at, and, with xKey, X-Signature.
func signedPost(t *testing.T, url string, d Delivery, keys webhooksig.Keys, at time.Time, xKey []byte) int {
	t.Helper()
	body, err := json.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	key := d.ActivityUID + "/" + d.PacketID
	if d.Kind == "budget" {
		key = d.ActivityUID + "/budget"
	}
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", key)
	if !keys.Empty() {
		id := webhooksig.MessageID(key)
		req.Header.Set(webhooksig.HeaderID, id)
		req.Header.Set(webhooksig.HeaderTimestamp, strconv.FormatInt(at.Unix(), 10))
		req.Header.Set(webhooksig.HeaderSignature, webhooksig.Sign(keys, id, at.Unix(), body))
	}
	if xKey != nil {
		req.Header.Set(webhooksig.XSignatureHeader, webhooksig.XSignature(xKey, body))
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// The in-memory receiver verifies Standard Webhooks signatures: v1 under its key and
// v1a under the operator's public key are credited; a signature by another key, a
// webhook-timestamp beyond the tolerance of its clock (a captured request replayed
// later), and X-Signature alone are refused 401 and credit nothing. X-Signature alone
// passes only with AcceptXSignature, as an operator of an earlier release sends it.
func TestReceiverVerifiesStandardWebhooks(t *testing.T) {
	key := []byte("the-host-key")
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	_, stranger, _ := ed25519.GenerateKey(rand.Reader)
	rc := NewReceiver(key)
	rc.PublicKeys = []ed25519.PublicKey{pub}
	now := time.Now()
	var late atomic.Int64 // how far the receiver's clock is ahead
	rc.Now = func() time.Time { return now.Add(time.Duration(late.Load())) }
	srv := httptest.NewServer(rc)
	defer srv.Close()
	grant := func(n int) Delivery {
		return Delivery{Kind: "grant", Activity: "default/a", ActivityUID: "uid-a", PacketID: fmt.Sprint(n), UserID: fmt.Sprint("u", n),
			Amount: 10, Currency: "CNY", At: "2026-12-04T10:00:00.000Z"}
	}
	v1 := webhooksig.Keys{HMAC: [][]byte{key}}
	v1a := webhooksig.Keys{Ed25519: []ed25519.PrivateKey{priv}}
	for _, c := range []struct {
		name string
		d    Delivery
		keys webhooksig.Keys
		at   time.Time
		xKey []byte
		want int
	}{
		{"v1", grant(1), v1, now, nil, http.StatusOK},
		{"v1a", grant(2), v1a, now, nil, http.StatusOK},
		{"v1 by another key", grant(3), webhooksig.Keys{HMAC: [][]byte{[]byte("stranger")}}, now, nil, http.StatusUnauthorized},
		{"v1a by another key", grant(4), webhooksig.Keys{Ed25519: []ed25519.PrivateKey{stranger}}, now, nil, http.StatusUnauthorized},
		{"signed 6 minutes ago", grant(5), v1, now.Add(-6 * time.Minute), nil, http.StatusUnauthorized},
		{"signed 6 minutes ahead", grant(6), v1a, now.Add(6 * time.Minute), nil, http.StatusUnauthorized},
		{"X-Signature alone", grant(7), webhooksig.Keys{}, now, key, http.StatusUnauthorized},
		{"unsigned", grant(8), webhooksig.Keys{}, now, nil, http.StatusUnauthorized},
	} {
		if got := signedPost(t, srv.URL, c.d, c.keys, c.at, c.xKey); got != c.want {
			t.Errorf("%s: %d, want %d", c.name, got, c.want)
		}
	}
	if tot := rc.Totals(); tot.Grants != 2 || tot.GrantSum != 20 || tot.BadRequests != 6 {
		t.Errorf("totals %+v: want the v1 and the v1a grant credited, 6 refused", tot)
	}

	// A captured request replayed after the tolerance: the same bytes, refused.
	body, _ := json.Marshal(grant(9))
	req, _ := http.NewRequest(http.MethodPost, srv.URL, bytes.NewReader(body))
	req.Header.Set("Idempotency-Key", "uid-a/9")
	id := webhooksig.MessageID("uid-a/9")
	req.Header.Set(webhooksig.HeaderID, id)
	req.Header.Set(webhooksig.HeaderTimestamp, strconv.FormatInt(now.Unix(), 10))
	req.Header.Set(webhooksig.HeaderSignature, webhooksig.Sign(v1, id, now.Unix(), body))
	captured := req.Header.Clone()
	late.Store(int64(5*time.Minute + time.Second))
	req2, _ := http.NewRequest(http.MethodPost, srv.URL, bytes.NewReader(body))
	req2.Header = captured
	resp, err := http.DefaultClient.Do(req2)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("a capture replayed after the tolerance: %d", resp.StatusCode)
	}
	if _, ok := rc.Delivered("uid-a/9"); ok {
		t.Error("the replay was credited")
	}

	// An operator of an earlier release, with AcceptXSignature.
	old := NewReceiver(key)
	old.AcceptXSignature = true
	srvOld := httptest.NewServer(old)
	defer srvOld.Close()
	if got := signedPost(t, srvOld.URL, grant(1), webhooksig.Keys{}, time.Now(), key); got != http.StatusOK {
		t.Errorf("X-Signature alone, accepted: %d", got)
	}
	if got := signedPost(t, srvOld.URL, grant(2), webhooksig.Keys{}, time.Now(), []byte("stranger")); got != http.StatusUnauthorized {
		t.Errorf("X-Signature by another key: %d", got)
	}
}
