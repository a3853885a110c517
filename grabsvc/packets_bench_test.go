package grabsvc

import (
	"bytes"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
)

// BenchmarkPacketCreate is POST /v1/packets of 5-share packets through HTTP on a real
// redis-server, from parallel keep-alive clients: the create path's cost per packet.
func BenchmarkPacketCreate(b *testing.B) {
	h := newPacketHarness(b, 1_000_000_000_000, 16)
	var next atomic.Int64
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	b.SetParallelism(32) // 64 requests in flight on 2 cores, as hack/bench's 64 clients
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			i := next.Add(1)
			body := `{"id":"o-` + strconv.FormatInt(i, 10) + `","sender":"m","totalAmount":500,"count":5,"distribution":"Fixed"}`
			if !createForBench(b, c, h.http.URL, body) {
				return
			}
		}
	})
}

// createForBench posts a packet creation with the sender credential and reads the
// answer to its end, so that the connection is kept and reused; false (with the
// benchmark failed) unless it was created.
func createForBench(b *testing.B, c *http.Client, base, body string) bool {
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/packets", bytes.NewReader([]byte(body)))
	req.Header.Set("Authorization", "Bearer "+senderSecret)
	resp, err := c.Do(req)
	if err != nil {
		b.Error(err)
		return false
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		b.Errorf("status %d", resp.StatusCode)
		return false
	}
	return true
}
