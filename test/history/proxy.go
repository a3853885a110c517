package history

import (
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy is a TCP fault proxy between a client and one upstream address. It adds
// latency to every chunk it forwards, stalls all traffic for a while (calls time out
// and the held bytes arrive late, so a command the client gave up on may still run),
// and resets every open connection at once (both sides closed with SO_LINGER 0, a
// reply in flight is lost after the command ran). Retarget moves it to another
// upstream, as a failover moves a service address to the promoted server.
//
// Under 200 lines are enough here, and a toxiproxy process is not needed: the
// harness needs exactly three faults on one loopback hop, switched by the test's own
// fault goroutine from a seeded schedule, in-process so a run is one `go test` with
// nothing else to install, start, or reach over an admin API. Bandwidth limits,
// slicers and per-direction toxics would not make the histories any richer: the Redis
// protocol's requests and replies are small, and what matters to the checker is only
// whether a command ran, ran late, or ran without its reply reaching the caller.
type Proxy struct {
	upstream atomic.Pointer[string]
	ln       net.Listener

	latency    atomic.Int64 // nanoseconds added per forwarded chunk
	stallUntil atomic.Int64 // unix nanoseconds; forwarding waits until then

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// NewProxy listens on a free loopback port and forwards to upstream.
func NewProxy(upstream string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, conns: map[net.Conn]struct{}{}}
	p.upstream.Store(&upstream)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the address clients dial instead of the upstream.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// SetLatency delays every forwarded chunk by d (0: none).
func (p *Proxy) SetLatency(d time.Duration) { p.latency.Store(int64(d)) }

// Stall holds all traffic for d from now.
func (p *Proxy) Stall(d time.Duration) { p.stallUntil.Store(time.Now().Add(d).UnixNano()) }

// Reset closes every open connection, both sides, mid-flight; it returns how many.
func (p *Proxy) Reset() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.resetLocked()
}

func (p *Proxy) resetLocked() int {
	n := 0
	for c := range p.conns {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		_ = c.Close()
		delete(p.conns, c)
		n++
	}
	return n / 2
}

// Retarget sends every later connection to upstream instead, and resets every open
// one, as a failover that moves a virtual address to another server does: a
// connection opened afterwards never reaches the old upstream. An upstream nobody listens on cuts the link:
// every connection attempt is then accepted and closed at once.
func (p *Proxy) Retarget(upstream string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.upstream.Store(&upstream)
	p.resetLocked()
}

// Close stops listening, resets every connection and waits for the forwarders.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	_ = p.ln.Close()
	p.Reset()
	p.wg.Wait()
}

// track registers a connection pair dialed to upstream; it refuses the pair when
// the proxy is closed or was retargeted since the dial.
func (p *Proxy) track(upstream string, cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || *p.upstream.Load() != upstream {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *Proxy) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	_ = c.Close()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		down, err := p.ln.Accept()
		if err != nil {
			return
		}
		target := *p.upstream.Load()
		up, err := net.DialTimeout("tcp", target, 2*time.Second)
		if err != nil {
			_ = down.Close()
			continue
		}
		if !p.track(target, down, up) {
			_ = down.Close()
			_ = up.Close()
			if p.isClosed() {
				return
			}
			continue
		}
		p.wg.Add(2)
		go p.pipe(up, down)
		go p.pipe(down, up)
	}
}

// pipe forwards src to dst chunk by chunk, applying the stall and the latency, and
// closes both when either side ends.
func (p *Proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	defer p.untrack(dst)
	defer p.untrack(src)
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			for {
				wait := time.Until(time.Unix(0, p.stallUntil.Load()))
				if wait <= 0 {
					break
				}
				time.Sleep(min(wait, 20*time.Millisecond))
			}
			if d := time.Duration(p.latency.Load()); d > 0 {
				time.Sleep(d)
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
