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
			req, _ := http.NewRequest(http.MethodPost, h.http.URL+"/v1/packets", bytes.NewReader([]byte(body)))
			req.Header.Set("Authorization", "Bearer "+senderSecret)
			resp, err := c.Do(req)
			if err != nil {
				b.Error(err)
				return
			}
			// Read to the end, so that the connection is kept and reused.
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusCreated {
				b.Errorf("status %d", resp.StatusCode)
				return
			}
		}
	})
}
