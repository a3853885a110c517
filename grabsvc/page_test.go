package grabsvc

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/emulation"
	"github.com/chromedp/cdproto/input"
	cdplog "github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc/web"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/wait"
)

// chromiumPath is Debian's chromium, which hack/ensure-chromium.sh installs.
const chromiumPath = "/usr/bin/chromium"

// screenshotsEnv names a folder (relative to the repository's root, or absolute)
// the browser tests copy their screenshots into: RAIN_PAGE_SCREENSHOTS=docs.
const screenshotsEnv = "RAIN_PAGE_SCREENSHOTS"

// TestRainPageFiles checks what the server sends for the page, without a browser:
// the files, their headers, their size, no inline code and no outside address, and
// that --page=false leaves only the JSON 404.
func TestRainPageFiles(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Page = true })
	total := 0
	for _, f := range []struct{ path, file, contentType string }{
		{"/", "index.html", "text/html; charset=utf-8"},
		{"/rain.css", "rain.css", "text/css; charset=utf-8"},
		{"/rain.js", "rain.js", "text/javascript; charset=utf-8"},
	} {
		want, err := web.Files.ReadFile(f.file)
		if err != nil {
			t.Fatal(err)
		}
		embedded := want
		if f.file == "index.html" {
			want = servedHTML(t, want, web.Files, "rain.css", "rain.js")
		}
		for _, method := range []string{http.MethodGet, http.MethodHead} {
			req, _ := http.NewRequest(method, h.http.URL+f.path, nil)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("%s %s: %d %s", method, f.path, resp.StatusCode, body)
			}
			if method == http.MethodGet && string(body) != string(want) {
				t.Fatalf("GET %s: not the embedded %s", f.path, f.file)
			}
			for k, v := range map[string]string{
				"Content-Type":            f.contentType,
				"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
				"X-Content-Type-Options":  "nosniff",
				"Content-Length":          fmt.Sprint(len(want)),
			} {
				if got := resp.Header.Get(k); got != v {
					t.Errorf("%s %s: %s %q, want %q", method, f.path, k, got, v)
				}
			}
		}
		total += len(embedded)
		text := string(embedded)
		for _, bad := range []string{"http://", "https://", "//cdn", "@import", "url(", "eval(", "innerHTML", "document.write"} {
			if strings.Contains(text, bad) {
				t.Errorf("%s contains %q: the page loads nothing from elsewhere and builds no markup from strings", f.file, bad)
			}
		}
		if f.file == "index.html" {
			if m := regexp.MustCompile(`<script(?:\s[^>]*)?>`).FindAllString(text, -1); len(m) != 1 || !strings.Contains(m[0], `src="assets/rain.js"`) {
				t.Errorf("index.html: scripts %q, want only assets/rain.js", m)
			}
			for _, inline := range []string{"<style", " style=", " on"} {
				if regexp.MustCompile(regexp.QuoteMeta(inline)+`[a-z]*=`).MatchString(text) || (inline == "<style" && strings.Contains(text, inline)) {
					t.Errorf("index.html has inline %q", strings.TrimSpace(inline))
				}
			}
		}
	}
	t.Logf("the page is %d bytes (index.html, rain.css, rain.js)", total)
	if total > 30<<10 {
		t.Errorf("the page is %d bytes, over 30 KiB", total)
	}
	// Only / itself is the page; other paths keep the JSON 404, other methods get 405.
	if r := h.do(http.MethodGet, "/index.html", "", nil); r.Status != http.StatusNotFound {
		t.Errorf("GET /index.html: %d", r.Status)
	}
	if r := h.do(http.MethodPost, "/", "", nil); r.Status != http.StatusMethodNotAllowed {
		t.Errorf("POST /: %d", r.Status)
	}

	off := newHarness(t)
	for _, p := range []string{"/", "/rain.js", "/rain.css"} {
		if r := off.do(http.MethodGet, p, "", nil); r.Status != http.StatusNotFound || r.Header.Get("Content-Security-Policy") != "" {
			t.Errorf("page off: GET %s: %d %s", p, r.Status, r.Raw)
		}
	}
}

// needChromium skips the test when chromium is missing, saying why; in CI
// (CI=true) it fails instead, since nothing may skip there.
func needChromium(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(chromiumPath); err == nil {
		return
	}
	why := "no " + chromiumPath + " on this host (hack/ensure-chromium.sh installs it as root)"
	if os.Getenv("CI") == "true" {
		t.Fatal("CI must run this test: " + why)
	}
	t.Skip(why)
}

// pageServer is a grab Server with the rain page on a real redis-server, reading its
// activity from the test API server as the grab service does, on a loopback port.
type pageServer struct {
	h      *harness
	obj    *redpacketv1alpha1.RedPacketActivity
	act    *Resource
	handle *store.Shard
}

func newPageServer(t *testing.T, name string, amounts []int64, start, end time.Time, opts ...harnessOpt) *pageServer {
	t.Helper()
	return newPageServerOf(t, name, amounts, start, end, nil, opts...)
}

// newPageServerOf is newPageServer with the activity's spec changed by mutate
// before it is created.
func newPageServerOf(t *testing.T, name string, amounts []int64, start, end time.Time,
	mutate func(*redpacketv1alpha1.RedPacketActivitySpec), opts ...harnessOpt) *pageServer {
	t.Helper()
	cp := controlPlane(t)
	ns := cp.Namespace(t)
	var total int64
	for _, a := range amounts {
		total += a
	}
	obj := activityForStatus(ns, name, int64(len(amounts)), total)
	obj.Spec.Distribution = redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionRandom, MinAmount: 1}
	obj.Spec.Currency = "CNY"
	obj.Spec.StartTime, obj.Spec.EndTime = &metav1.Time{Time: start}, &metav1.Time{Time: end}
	if mutate != nil {
		mutate(&obj.Spec)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := cp.Client.Create(ctx, obj); err != nil {
		t.Fatal(err)
	}
	src := &ActivitySource{Client: cp.Client, Key: types.NamespacedName{Namespace: ns, Name: name},
		Refresh: time.Second, Retry: 50 * time.Millisecond, Log: slog.New(slog.DiscardHandler)}
	done := make(chan struct{})
	go func() { defer close(done); src.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	wait.Until(t, 5*time.Second, "the activity to be read", func() (bool, string) { return src.Current() != nil, "" })

	opts = append([]harnessOpt{func(c *Config) { c.Page, c.Resource = true, src.Current }}, opts...)
	h := newHarness(t, opts...)
	act := src.Current()
	seed(t, h.admin, act, amounts, start.UnixMilli(), end.UnixMilli(), false)
	return &pageServer{h: h, obj: obj, act: act, handle: handleOf(h.admin, act).Shard(0)}
}

// claim is what Redis says the user holds.
func (ps *pageServer) claim(t *testing.T, user string) store.Claim {
	t.Helper()
	claims, err := ps.handle.Claims(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	c, ok := claims[user]
	if !ok {
		t.Fatalf("redis holds no claim of %s (claims: %v)", user, claims)
	}
	return c
}

// yuan formats minor units of CNY as the page does.
func yuan(minor int64) string { return fmt.Sprintf("¥%d.%02d", minor/100, minor%100) }

// newBrowser starts one headless chromium for the test, with a fresh profile.
func newBrowser(t *testing.T) context.Context {
	t.Helper()
	needChromium(t)
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromiumPath),
		chromedp.Flag("headless", true),
		chromedp.Flag("no-sandbox", true),
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("no-first-run", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
	}
	alloc, cancel := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancel)
	// The browser itself starts with the first tab; closing it ends the process.
	bctx, bcancel := chromedp.NewContext(alloc)
	t.Cleanup(bcancel)
	start := time.Now()
	if err := chromedp.Do(bctx); err != nil {
		t.Fatalf("starting %s: %v", chromiumPath, err)
	}
	t.Logf("chromium started in %s", time.Since(start).Round(time.Millisecond))
	return bctx
}

// tab is one page in the browser, watched for console errors, exceptions and
// failed requests.
type tab struct {
	t   *testing.T
	ctx context.Context

	mu       sync.Mutex
	problems []string
	grabs    int          // POST /v1/grab requests sent
	allowed  map[int]bool // statuses of /v1/grab the test expects besides 200
	urls     map[network.RequestID]string
}

type viewport struct {
	width, height int64
	phone         bool
}

var (
	desktop = viewport{width: 1280, height: 800}
	phone   = viewport{width: 390, height: 844, phone: true}
)

// open opens the page at rawURL in a new tab with the viewport; reduced emulates
// prefers-reduced-motion: reduce. allowed are the statuses of /v1/grab the test
// expects besides 200.
func open(t *testing.T, browser context.Context, vp viewport, reduced bool, rawURL string, allowed ...int) *tab {
	t.Helper()
	tb := &tab{t: t, allowed: map[int]bool{}, urls: map[network.RequestID]string{}}
	for _, s := range allowed {
		tb.allowed[s] = true
	}
	// Each tab has a browser context of its own: its own storage, so its own player.
	ctx, cancel := chromedp.NewContext(browser, chromedp.WithNewBrowserContext(), chromedp.WithListener(tb.listen))
	t.Cleanup(cancel)
	tb.ctx = ctx
	// The tab lives as long as the context of its first run, so that one has no timeout.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("opening a tab: %v", err)
	}
	emulate := chromedp.EmulateViewport(vp.width, vp.height)
	if vp.phone {
		emulate = chromedp.EmulateViewport(vp.width, vp.height, chromedp.EmulateScale(2), chromedp.EmulateMobile, chromedp.EmulateTouch)
	}
	motion := "no-preference"
	if reduced {
		motion = "reduce"
	}
	tb.run(chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		if _, err := cdp.Call(ctx, t, network.Enable, network.EnableParams{}); err != nil {
			return err
		}
		if _, err := cdp.Call(ctx, t, cdplog.Enable, cdp.Empty{}); err != nil {
			return err
		}
		_, err := cdp.Call(ctx, t, emulation.SetEmulatedMedia, emulation.SetEmulatedMediaParams{
			Features: []*emulation.MediaFeature{{Name: "prefers-reduced-motion", Value: motion}},
		})
		return err
	}), emulate, chromedp.Navigate(rawURL))
	return tb
}

func (tb *tab) problem(format string, args ...any) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	tb.problems = append(tb.problems, fmt.Sprintf(format, args...))
}

func (tb *tab) listen(ev any) {
	switch ev := ev.(type) {
	case *runtime.EventConsoleAPICalled:
		if ev.Type == runtime.ConsoleAPICalledTypeError || ev.Type == runtime.ConsoleAPICalledTypeWarning ||
			ev.Type == runtime.ConsoleAPICalledTypeAssert {
			var args []string
			for _, a := range ev.Args {
				args = append(args, string(a.Value)+a.Description)
			}
			tb.problem("console.%s: %s", ev.Type, strings.Join(args, " "))
		}
	case *runtime.EventExceptionThrown:
		d := ev.ExceptionDetails
		desc := ""
		if d.Exception != nil {
			desc = d.Exception.Description
		}
		tb.problem("exception: %s %s at %s:%d", d.Text, desc, d.URL, d.LineNumber)
	case *cdplog.EventEntryAdded:
		e := ev.Entry
		if e.Level != cdplog.EntryLevelError && e.Level != cdplog.EntryLevelWarning {
			return
		}
		if e.Source == cdplog.EntrySourceNetwork && isGrab(e.URL) {
			return // judged by its status below
		}
		tb.problem("log %s %s: %s %s", e.Source, e.Level, e.Text, e.URL)
	case *network.EventRequestWillBeSent:
		tb.mu.Lock()
		tb.urls[ev.RequestID] = ev.Request.URL
		if isGrab(ev.Request.URL) && ev.Request.Method == http.MethodPost {
			tb.grabs++
		}
		tb.mu.Unlock()
	case *network.EventResponseReceived:
		s := int(ev.Response.Status)
		tb.mu.Lock()
		ok := s < 400 || isGrab(ev.Response.URL) && tb.allowed[s]
		tb.mu.Unlock()
		if !ok {
			tb.problem("%s answered %d", ev.Response.URL, s)
		}
	case *network.EventLoadingFailed:
		tb.mu.Lock()
		u := tb.urls[ev.RequestID]
		tb.mu.Unlock()
		tb.problem("loading %s failed: %s (canceled %v, blocked %q)", u, ev.ErrorText, ev.Canceled, ev.BlockedReason)
	}
}

func isGrab(rawURL string) bool {
	u, err := url.Parse(rawURL)
	return err == nil && u.Path == "/v1/grab"
}

// clean fails the test on anything the tab reported so far.
func (tb *tab) clean() {
	tb.t.Helper()
	tb.mu.Lock()
	defer tb.mu.Unlock()
	for _, p := range tb.problems {
		tb.t.Error(p)
	}
	tb.problems = nil
}

func (tb *tab) grabCount() int {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	return tb.grabs
}

func (tb *tab) run(actions ...chromedp.Action[chromedp.Void]) {
	tb.t.Helper()
	ctx, cancel := context.WithTimeout(tb.ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, actions...); err != nil {
		tb.t.Fatalf("browser: %v", err)
	}
}

// eval evaluates a JavaScript expression in the tab, awaiting a promise.
func eval[T any](tb *tab, js string) T {
	tb.t.Helper()
	ctx, cancel := context.WithTimeout(tb.ctx, 30*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](js, chromedp.EvalAwaitPromise))
	if err != nil {
		tb.t.Fatalf("evaluating %s: %v", js, err)
	}
	return v
}

// text is an element's text.
func (tb *tab) text(id string) string {
	tb.t.Helper()
	return eval[string](tb, fmt.Sprintf(`document.getElementById(%q).textContent`, id))
}

// until waits for an element's text to satisfy ok.
func (tb *tab) until(id, what string, ok func(string) bool) string {
	tb.t.Helper()
	var s string
	wait.Until(tb.t, 10*time.Second, what, func() (bool, string) {
		s = tb.text(id)
		return ok(s), fmt.Sprintf("#%s is %q", id, s)
	})
	return s
}

// card is the result card: the outcome it shows and its texts.
type card struct {
	Outcome, Message, Amount, Detail string
}

func (tb *tab) card() card {
	tb.t.Helper()
	return eval[card](tb, `({Outcome: document.getElementById('card').dataset.outcome || '',
		Message: document.getElementById('message').textContent,
		Amount: document.getElementById('amount').textContent,
		Detail: document.getElementById('detail').textContent})`)
}

// answered waits for the card to show an answer to grab number n.
func (tb *tab) answered(n int) card {
	tb.t.Helper()
	var c card
	wait.Until(tb.t, 10*time.Second, "the answer of the grab", func() (bool, string) {
		c = tb.card()
		return tb.grabCount() >= n && c.Outcome != "" && c.Outcome != "pending", fmt.Sprintf("card %+v", c)
	})
	return c
}

type drop struct{ X, Y, W, H float64 }

// tapPacket taps a falling packet where it is, with the mouse or a finger, until the
// page sends a grab, and returns the answer shown.
func (tb *tab) tapPacket(touch bool) card {
	tb.t.Helper()
	before := tb.grabCount()
	vp := eval[struct{ W, H float64 }](tb, `({W: innerWidth, H: innerHeight})`)
	for attempt := 0; attempt < 20 && tb.grabCount() == before; attempt++ {
		drops := eval[[]drop](tb, `window.redPacketRain.drops()`)
		// The largest packet well inside the screen, clear of the player field.
		var best *drop
		for i, d := range drops {
			if d.X > d.W && d.X < vp.W-d.W && d.Y > vp.H*0.25 && d.Y < vp.H*0.65 && (best == nil || d.W > best.W) {
				best = &drops[i]
			}
		}
		if best == nil {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if touch {
			tb.run(chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
				if _, err := cdp.Call(ctx, t, input.DispatchTouchEvent, input.DispatchTouchEventParams{
					Type: input.DispatchTouchEventTypeTouchStart, TouchPoints: []*input.TouchPoint{{X: best.X, Y: best.Y}},
				}); err != nil {
					return err
				}
				_, err := cdp.Call(ctx, t, input.DispatchTouchEvent, input.DispatchTouchEventParams{
					Type: input.DispatchTouchEventTypeTouchEnd, TouchPoints: []*input.TouchPoint{},
				})
				return err
			}))
		} else {
			tb.run(chromedp.MouseClickXY(best.X, best.Y))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if tb.grabCount() == before {
		tb.t.Fatal("no tap on a packet sent a grab")
	}
	return tb.answered(before + 1)
}

// screenshot saves the viewport as name in the test's folder, and once more into
// $RAIN_PAGE_SCREENSHOTS when it is set.
func (tb *tab) screenshot(name string) {
	tb.t.Helper()
	png, err := chromedp.Run(tb.ctx, chromedp.CaptureScreenshot())
	if err != nil {
		tb.t.Fatal(err)
	}
	p := filepath.Join(tb.t.TempDir(), name)
	if err := os.WriteFile(p, png, 0o644); err != nil {
		tb.t.Fatal(err)
	}
	tb.t.Logf("screenshot %s (%d bytes)", p, len(png))
	dir := os.Getenv(screenshotsEnv)
	if dir == "" {
		return
	}
	if !filepath.IsAbs(dir) {
		root, err := controlplane.Root()
		if err != nil {
			tb.t.Fatal(err)
		}
		dir = filepath.Join(root, dir)
	}
	if err := os.WriteFile(filepath.Join(dir, name), png, 0o644); err != nil {
		tb.t.Fatal(err)
	}
	tb.t.Logf("copied to %s", filepath.Join(dir, name))
}

// loaded waits for the page to show the activity.
func (tb *tab) loaded(name string, left string) {
	tb.t.Helper()
	tb.until("name", "the activity's name", func(s string) bool { return s == name })
	tb.until("left", "the packets left", func(s string) bool { return s == left })
}

// TestRainPageInBrowser plays the rain page in headless chromium against a real grab
// server: a mouse click, the keyboard and a finger each grab a packet whose amount
// is the one Redis holds, a second tap finds it already claimed, and once the
// packets run out the page says sold out. It also takes the screenshots and
// measures the frame rate with 50 packets falling.
func TestRainPageInBrowser(t *testing.T) {
	browser := newBrowser(t)
	amounts := []int64{52, 188, 7, 99, 1314, 66}
	start, end := time.Now().Add(-time.Minute), time.Now().Add(9*time.Minute+30*time.Second)
	ps := newPageServer(t, "quiz-night", amounts, start, end)
	base := ps.h.http.URL
	count := len(amounts)

	t.Run("mouse", func(t *testing.T) {
		tb := open(t, browser, desktop, false, base+"/?user=desk-1")
		tb.loaded("quiz-night", fmt.Sprintf("%d / %d", count, count))
		if got := tb.text("phase"); got != "Live" {
			t.Errorf("phase %q, want Live", got)
		}
		if got := tb.text("clock"); !regexp.MustCompile(`^0?9:[0-5]\d$`).MatchString(got) {
			t.Errorf("time left %q, want about 09:30", got)
		}
		c := tb.tapPacket(false)
		held := ps.claim(t, "desk-1")
		if c.Outcome != OutcomeGranted || c.Amount != yuan(held.Amount) || !strings.Contains(c.Detail, "#"+held.PacketID) {
			t.Fatalf("after a click the card shows %+v; redis holds packet %s of %s", c, held.PacketID, yuan(held.Amount))
		}
		t.Logf("granted: %q %q %q", c.Message, c.Amount, c.Detail)
		tb.until("left", "the counter to go down", func(s string) bool { return s == fmt.Sprintf("%d / %d", count-1, count) })
		time.Sleep(300 * time.Millisecond) // the amount rises from the packet
		tb.screenshot("rain-page-desktop.png")

		c = tb.tapPacket(false)
		if c.Outcome != OutcomeAlreadyClaimed || c.Amount != yuan(held.Amount) || !strings.Contains(c.Detail, "#"+held.PacketID) ||
			!strings.Contains(c.Message, "Already claimed") {
			t.Fatalf("second click: card %+v, want already claimed packet %s of %s", c, held.PacketID, yuan(held.Amount))
		}
		tb.clean()
	})

	t.Run("keyboard", func(t *testing.T) {
		tb := open(t, browser, desktop, false, base+"/?user=keys-1")
		tb.loaded("quiz-night", fmt.Sprintf("%d / %d", count-1, count))
		tb.run(chromedp.KeyEvent(kb.Tab))
		focused := eval[string](tb, `document.activeElement.id`)
		label := eval[string](tb, `document.activeElement.textContent`)
		if focused != "grab" || label != "Grab a packet" {
			t.Fatalf("Tab focuses #%s %q, want the Grab a packet button", focused, label)
		}
		tb.run(chromedp.KeyEvent(kb.Enter))
		c := tb.answered(1)
		held := ps.claim(t, "keys-1")
		if c.Outcome != OutcomeGranted || c.Amount != yuan(held.Amount) || !strings.Contains(c.Detail, "#"+held.PacketID) {
			t.Fatalf("after Enter the card shows %+v; redis holds packet %s of %s", c, held.PacketID, yuan(held.Amount))
		}
		live := eval[string](tb, `document.getElementById('card').closest('[aria-live]').getAttribute('aria-live')`)
		if live != "polite" {
			t.Errorf("the answer is not in an aria-live region (%q)", live)
		}
		tb.run(chromedp.KeyEvent(" "))
		if c := tb.answered(2); c.Outcome != OutcomeAlreadyClaimed || c.Amount != yuan(held.Amount) {
			t.Fatalf("Space: card %+v, want already claimed", c)
		}
		tb.clean()
	})

	t.Run("touch", func(t *testing.T) {
		// A generated player id, kept in localStorage; reduced motion slows the rain.
		tb := open(t, browser, phone, true, base+"/")
		tb.loaded("quiz-night", fmt.Sprintf("%d / %d", count-2, count))
		user := eval[string](tb, `document.getElementById('user').value`)
		stored := eval[string](tb, `localStorage.getItem('redpacket.userId')`)
		if !strings.HasPrefix(user, "guest-") || stored != user {
			t.Fatalf("player %q, stored %q: want a generated guest id kept in localStorage", user, stored)
		}
		c := tb.tapPacket(true)
		held := ps.claim(t, user)
		if c.Outcome != OutcomeGranted || c.Amount != yuan(held.Amount) || !strings.Contains(c.Detail, "#"+held.PacketID) {
			t.Fatalf("after a tap the card shows %+v; redis holds packet %s of %s", c, held.PacketID, yuan(held.Amount))
		}
		tb.until("left", "the counter to go down", func(s string) bool { return s == fmt.Sprintf("%d / %d", count-3, count) })
		tb.screenshot("rain-page-phone.png")
		// The same browser keeps the same player.
		tb.run(chromedp.Reload())
		tb.loaded("quiz-night", fmt.Sprintf("%d / %d", count-3, count))
		if c := tb.tapPacket(true); c.Outcome != OutcomeAlreadyClaimed || c.Amount != yuan(held.Amount) {
			t.Fatalf("after a reload: card %+v, want already claimed", c)
		}
		tb.clean()
	})

	t.Run("sold out", func(t *testing.T) {
		for i := 0; ; i++ {
			r := ps.h.grab(fmt.Sprintf("crowd-%d", i), nil)
			if r.Outcome == OutcomeSoldOut {
				break
			}
			if r.Outcome != OutcomeGranted || i > count {
				t.Fatalf("grab: %s", r.Raw)
			}
		}
		tb := open(t, browser, desktop, false, base+"/?user=late-1", http.StatusConflict)
		tb.loaded("quiz-night", fmt.Sprintf("0 / %d", count))
		tb.until("phase", "the sold-out phase", func(s string) bool { return s == "Sold out" })
		c := tb.tapPacket(false)
		if c.Outcome != OutcomeSoldOut || !strings.Contains(c.Message, "Sold out") || c.Amount != "" {
			t.Fatalf("card %+v, want sold out", c)
		}
		tb.clean()
	})

	t.Run("frame rate", func(t *testing.T) {
		tb := open(t, browser, desktop, false, base+"/?user=fps-1&drops=50")
		tb.loaded("quiz-night", fmt.Sprintf("0 / %d", count))
		drops := eval[string](tb, `document.getElementById('rain').dataset.drops`)
		if drops != "50" {
			t.Fatalf("%s packets falling, want 50", drops)
		}
		m := eval[struct{ Frames, Ms float64 }](tb, `new Promise(function (done) {
			var n = 0, t0 = 0;
			function f(t) {
				if (!t0) { t0 = t; }
				if (t - t0 < 2000) { n++; requestAnimationFrame(f); } else { done({Frames: n, Ms: t - t0}); }
			}
			requestAnimationFrame(f);
		})`)
		fps := m.Frames / m.Ms * 1000
		t.Logf("headless chromium, 1280x800, 50 packets falling: %.0f frames in %.0f ms, %.1f frames/s", m.Frames, m.Ms, fps)
		if fps < 20 {
			t.Errorf("%.1f frames/s with 50 packets", fps)
		}
		tb.clean()
	})
}

// TestRainPageTokens: with tokens on, a token in the fragment grabs, and a forged
// one shows the unauthorized message.
func TestRainPageTokens(t *testing.T) {
	browser := newBrowser(t)
	key := []byte("page-token-key")
	v, err := NewTokenVerifier(key)
	if err != nil {
		t.Fatal(err)
	}
	start, end := time.Now().Add(-time.Minute), time.Now().Add(time.Hour)
	ps := newPageServer(t, "auth-night", []int64{30, 40, 50}, start, end, func(c *Config) { c.Tokens = v })
	ref := ps.obj.Namespace + "/" + ps.obj.Name

	good, err := SignToken(key, TokenClaims{UserID: "tok-1", Activity: ref, ActivityUID: ps.obj.UID, Exp: time.Now().Add(5 * time.Minute).Unix()})
	if err != nil {
		t.Fatal(err)
	}
	tb := open(t, browser, desktop, false, ps.h.http.URL+"/?user=tok-1#token="+url.QueryEscape(good))
	tb.loaded("auth-night", "3 / 3")
	c := tb.tapPacket(false)
	held := ps.claim(t, "tok-1")
	if c.Outcome != OutcomeGranted || c.Amount != yuan(held.Amount) || !strings.Contains(c.Detail, "#"+held.PacketID) {
		t.Fatalf("with a valid token: card %+v; redis holds packet %s of %s", c, held.PacketID, yuan(held.Amount))
	}
	tb.clean()

	forged, err := SignToken([]byte("not-the-key"), TokenClaims{UserID: "tok-2", Activity: ref, ActivityUID: ps.obj.UID, Exp: time.Now().Add(5 * time.Minute).Unix()})
	if err != nil {
		t.Fatal(err)
	}
	tb = open(t, browser, desktop, false, ps.h.http.URL+"/?user=tok-2#token="+url.QueryEscape(forged), http.StatusUnauthorized)
	tb.loaded("auth-night", "2 / 3")
	c = tb.tapPacket(false)
	if c.Outcome != OutcomeUnauthorized || !strings.Contains(c.Message, "sign-in link is not valid") ||
		!strings.Contains(c.Detail, ErrTokenSignature.Error()) {
		t.Fatalf("with a forged token: card %+v", c)
	}
	if claims, _ := ps.handle.Claims(context.Background()); len(claims) != 1 {
		t.Fatalf("claims after the forged token: %v", claims)
	}
	tb.clean()
}

// TestRainPageCountdown: before the start the page counts down to it, and a tap
// says the activity has not started.
func TestRainPageCountdown(t *testing.T) {
	browser := newBrowser(t)
	start := time.Now().Add(2 * time.Hour)
	ps := newPageServer(t, "new-year", []int64{10, 20}, start, start.Add(10*time.Minute))
	tb := open(t, browser, phone, false, ps.h.http.URL+"/?user=early-1", http.StatusConflict)
	tb.loaded("new-year", "2 / 2")
	if got := tb.text("phase"); got != "Starting soon" {
		t.Errorf("phase %q, want Starting soon", got)
	}
	if label, clock := tb.text("clock-label"), tb.text("clock"); label != "Starts in" || !regexp.MustCompile(`^(01:59:[0-5]\d|02:00:00)$`).MatchString(clock) {
		t.Errorf("clock %q %q, want Starts in about 02:00:00", label, clock)
	}
	c := tb.tapPacket(true)
	if c.Outcome != OutcomeNotStarted || !strings.Contains(c.Message, "Not started yet") || c.Amount != "" {
		t.Fatalf("card %+v, want not started", c)
	}
	tb.clean()
}

// TestRainPageCountsDownToTheUsersInstant: with a start spread, the page counts down
// to the player's own opening instant (startTime plus the player's offset), not to
// startTime, and a tap before it says not started.
func TestRainPageCountsDownToTheUsersInstant(t *testing.T) {
	browser := newBrowser(t)
	start := time.Now().Add(2 * time.Hour).Truncate(time.Second)
	const spread = 10 * time.Minute
	ps := newPageServerOf(t, "spread-night", []int64{10, 20}, start, start.Add(time.Hour), func(s *redpacketv1alpha1.RedPacketActivitySpec) {
		s.GrabService.StartSpread = &metav1.Duration{Duration: spread}
	})
	// A player placed late in the spread, so the countdown cannot be startTime's.
	user := ""
	for i := range 100 {
		if u := fmt.Sprintf("late-%d", i); SpreadOffset(string(ps.act.Object.UID), u, spread) > 7*time.Minute {
			user = u
			break
		}
	}
	off := SpreadOffset(string(ps.act.Object.UID), user, spread)
	tb := open(t, browser, phone, false, ps.h.http.URL+"/?user="+user, http.StatusConflict)
	tb.loaded("spread-night", "2 / 2")
	left := func() time.Duration { return time.Until(start.Add(off)) }
	clock := tb.until("clock", "the countdown to the player's instant", func(v string) bool {
		// Within two seconds of the time left, as h:mm:ss.
		for _, d := range []time.Duration{left() - time.Second, left(), left() + time.Second} {
			s := int(d.Round(time.Second) / time.Second)
			if v == fmt.Sprintf("%02d:%02d:%02d", s/3600, s/60%60, s%60) {
				return true
			}
		}
		return false
	})
	if label := tb.text("clock-label"); label != "Starts in" {
		t.Errorf("clock label %q, want Starts in", label)
	}
	t.Logf("%s opens %v after startTime; the page counts down %s", user, off, clock)
	c := tb.tapPacket(true)
	if c.Outcome != OutcomeNotStarted || !strings.Contains(c.Message, "Not started yet") || c.Amount != "" {
		t.Fatalf("card %+v, want not started", c)
	}
	tb.clean()
}
