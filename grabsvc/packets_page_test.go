package grabsvc

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"redpacket.io/operator/grabsvc/web"
)

// TestPacketPageFiles checks what the server sends for the packet page, without a
// browser: the files and their headers (the rain page's CSP), no inline code and no
// outside address, the page at /p/{id} for a well-formed id only.
func TestPacketPageFiles(t *testing.T) {
	h := newPacketHarness(t, 1000, 1)
	for _, f := range []struct{ path, file, contentType string }{
		{"/p/order-1", "packet.html", "text/html; charset=utf-8"},
		{"/p/never.created_yet", "packet.html", "text/html; charset=utf-8"},
		{"/packet.css", "packet.css", "text/css; charset=utf-8"},
		{"/packet.js", "packet.js", "text/javascript; charset=utf-8"},
	} {
		embedded, err := web.PacketFiles.ReadFile(f.file)
		if err != nil {
			t.Fatal(err)
		}
		want := embedded
		if f.file == "packet.html" {
			want = servedHTML(t, embedded, web.PacketFiles, "packet.css", "packet.js")
		}
		resp, err := http.Get(h.http.URL + f.path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(body) != string(want) {
			t.Fatalf("GET %s: %d, the embedded %s: %v", f.path, resp.StatusCode, f.file, string(body) == string(want))
		}
		for k, v := range map[string]string{
			"Content-Type":            f.contentType,
			"Content-Security-Policy": PageContentSecurityPolicy,
			"X-Content-Type-Options":  "nosniff",
		} {
			if got := resp.Header.Get(k); got != v {
				t.Errorf("GET %s: %s %q, want %q", f.path, k, got, v)
			}
		}
		text := string(embedded)
		for _, bad := range []string{"http://", "https://", "//cdn", "@import", "url(", "eval(", "innerHTML", "document.write"} {
			if strings.Contains(text, bad) {
				t.Errorf("%s contains %q: the page loads nothing from elsewhere and builds no markup from strings", f.file, bad)
			}
		}
		if f.file == "packet.html" {
			if m := regexp.MustCompile(`<script(?:\s[^>]*)?>`).FindAllString(text, -1); len(m) != 1 || !strings.Contains(m[0], `src="../assets/packet.js"`) {
				t.Errorf("packet.html: scripts %q, want only ../assets/packet.js", m)
			}
			if strings.Contains(text, "<style") || regexp.MustCompile(` (style|on[a-z]+)=`).MatchString(text) {
				t.Error("packet.html has inline style or handlers")
			}
		}
	}
	for _, p := range []string{"/p/-bad", "/p/" + strings.Repeat("x", 65)} {
		if a := h.do(http.MethodGet, p, "", nil); a.Status != http.StatusNotFound {
			t.Errorf("GET %s: %d %s", p, a.Status, a.Raw)
		}
	}
	if a := h.do(http.MethodPost, "/p/order-1", "", nil); a.Status != http.StatusMethodNotAllowed {
		t.Errorf("POST /p/order-1: %d", a.Status)
	}
	off := newPacketHarness(t, 1000, 1, func(c *PacketConfig) { c.Page = false })
	if a := off.do(http.MethodGet, "/p/order-1", "", nil); a.Status != http.StatusNotFound {
		t.Errorf("page off: GET /p/order-1: %d", a.Status)
	}
}

// shareOf is what the detail list says user got, read through the API with the
// sender credential (which reads with user tokens on or off).
func (h *packetHarness) shareOf(t *testing.T, id, user string) PacketShareView {
	t.Helper()
	a := h.do(http.MethodGet, "/v1/packets/"+id, "", asSender)
	var d PacketDetailView
	if err := json.Unmarshal([]byte(a.Raw), &d); err != nil {
		t.Fatal(err)
	}
	for _, g := range d.Grabs {
		if g.UserID == user {
			return g
		}
	}
	t.Fatalf("%s holds no share of %s: %s", user, id, a.Raw)
	return PacketShareView{}
}

// clickOpen clicks the Open button where it is, as a person would.
func (tb *tab) clickOpen() {
	tb.t.Helper()
	r := eval[struct{ X, Y float64 }](tb, `(function () { var r = document.getElementById('open').getBoundingClientRect();
		return {X: r.x + r.width / 2, Y: r.y + r.height / 2}; })()`)
	tb.run(chromedp.MouseClickXY(r.X, r.Y))
}

// listed is the users of the page's detail list, in order.
func (tb *tab) listed() []string {
	tb.t.Helper()
	return eval[[]string](tb, `Array.prototype.map.call(document.querySelectorAll('#grabs li'), function (li) { return li.dataset.user; })`)
}

// TestPacketPageInBrowser opens a group packet in headless chromium against a real
// packet server: the page shows the sender, the money and the detail list; Open
// grabs a share whose amount is the one Redis holds; a second Open says already
// opened with the same amount; a phone opens another share; once every share is
// taken a latecomer reads "Too late". It saves the desktop and phone screenshots.
func TestPacketPageInBrowser(t *testing.T) {
	browser := newBrowser(t)
	h := newPacketHarness(t, 100_000, 4)
	if a := h.create(`{"id":"order-2024","sender":"Lin's tea shop","totalAmount":1888,"count":5,"ttlSeconds":3600}`); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	for _, u := range []string{"alice", "bob"} {
		if a := h.grab("order-2024", u, nil); a.str("outcome") != "granted" {
			t.Fatalf("grab: %s", a.Raw)
		}
	}
	base := h.http.URL + "/p/order-2024"

	t.Run("desktop", func(t *testing.T) {
		tb := open(t, browser, desktop, false, base+"?user=desk-1")
		tb.until("from", "the sender", func(s string) bool { return s == "From Lin's tea shop" })
		tb.until("left", "the shares left", func(s string) bool { return s == "· 3 of 5 left" })
		if got := tb.text("summary"); got != yuan(1888)+" in 5 shares" {
			t.Errorf("summary %q", got)
		}
		if got := tb.listed(); fmt.Sprint(got) != "[alice bob]" {
			t.Fatalf("detail list %v, want [alice bob]", got)
		}
		tb.clickOpen()
		c := tb.answered(0)
		held := h.shareOf(t, "order-2024", "desk-1")
		if c.Outcome != OutcomeGranted || c.Amount != yuan(held.Amount) || !strings.Contains(c.Detail, "Share 3 of 5") {
			t.Fatalf("after Open the card shows %+v; redis holds share %d of %s", c, held.Share, yuan(held.Amount))
		}
		tb.until("left", "the list to follow", func(s string) bool { return s == "· 2 of 5 left" })
		if got := tb.listed(); fmt.Sprint(got) != "[alice bob desk-1]" {
			t.Fatalf("detail list %v", got)
		}
		if me := eval[string](tb, `document.querySelector('#grabs li[data-me="true"] .much').textContent`); me != yuan(held.Amount) {
			t.Errorf("the list shows the player's amount as %q, want %s", me, yuan(held.Amount))
		}
		time.Sleep(200 * time.Millisecond)
		tb.screenshot("packet-page-desktop.png")
		tb.clickOpen()
		wait := func() card {
			var c card
			for range 50 {
				if c = tb.card(); c.Outcome == OutcomeAlreadyClaimed {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			return c
		}
		if c := wait(); c.Outcome != OutcomeAlreadyClaimed || c.Amount != yuan(held.Amount) || !strings.Contains(c.Message, "Already opened") {
			t.Fatalf("second Open: card %+v, want already opened with %s", c, yuan(held.Amount))
		}
		tb.clean()
	})

	t.Run("phone", func(t *testing.T) {
		tb := open(t, browser, phone, false, base)
		tb.until("left", "the shares left", func(s string) bool { return s == "· 2 of 5 left" })
		user := eval[string](tb, `document.getElementById('user').value`)
		if !strings.HasPrefix(user, "guest-") {
			t.Fatalf("player %q: want a generated guest id", user)
		}
		tb.clickOpen()
		c := tb.answered(0)
		held := h.shareOf(t, "order-2024", user)
		if c.Outcome != OutcomeGranted || c.Amount != yuan(held.Amount) {
			t.Fatalf("after Open the card shows %+v; redis holds %s", c, yuan(held.Amount))
		}
		tb.until("left", "the list to follow", func(s string) bool { return s == "· 1 of 5 left" })
		time.Sleep(200 * time.Millisecond)
		tb.screenshot("packet-page-phone.png")
		tb.clean()
	})

	t.Run("too late", func(t *testing.T) {
		if a := h.grab("order-2024", "carol", nil); a.str("outcome") != "granted" {
			t.Fatalf("grab: %s", a.Raw)
		}
		tb := open(t, browser, desktop, false, base+"?user=late-1", http.StatusConflict)
		tb.until("state", "all opened", func(s string) bool { return s == "All opened" })
		tb.clickOpen()
		var c card
		for range 50 {
			if c = tb.card(); c.Outcome == OutcomeSoldOut {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if c.Outcome != OutcomeSoldOut || !strings.Contains(c.Message, "Too late") || c.Amount != "" {
			t.Fatalf("card %+v, want too late", c)
		}
		if best := eval[int](tb, `document.querySelectorAll('#grabs li[data-best="true"]').length`); best != 1 {
			t.Errorf("%d shares marked the luckiest, want 1", best)
		}
	})
}

// TestPacketPageTokens opens a packet of a budget with user tokens in headless
// chromium. With a budget's token in the link's fragment the page shows the sender
// and who got what, Open grabs, and every read and grab answers 2xx, so the token
// went with each; no request's address carries it. Without a token the page shows
// neither sender nor list, says the link is not valid, and stops asking.
func TestPacketPageTokens(t *testing.T) {
	browser := newBrowser(t)
	key := []byte("packet-page-token-key")
	v, err := NewTokenVerifier(key)
	if err != nil {
		t.Fatal(err)
	}
	h := newPacketHarness(t, 100_000, 4, func(c *PacketConfig) { c.Tokens = v })
	if a := h.create(`{"id":"order-88","sender":"Lin's tea shop","totalAmount":900,"count":3,"ttlSeconds":3600}`); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	ref, exp := h.budget.Ref(), time.Now().Add(5*time.Minute).Unix()
	token := func(user string) string {
		tok, err := SignToken(key, TokenClaims{UserID: user, Budget: ref, BudgetUID: h.budget.UID, Exp: exp})
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	if a := h.grab("order-88", "alice", map[string]string{"Authorization": "Bearer " + token("alice")}); a.str("outcome") != OutcomeGranted {
		t.Fatalf("grab: %s", a.Raw)
	}
	base := h.http.URL + "/p/order-88"

	good := token("tok-1")
	tb := open(t, browser, desktop, false, base+"?user=tok-1#token="+good)
	tb.until("from", "the sender", func(s string) bool { return s == "From Lin's tea shop" })
	if got := tb.listed(); fmt.Sprint(got) != "[alice]" {
		t.Fatalf("detail list %v, want [alice]", got)
	}
	tb.clickOpen()
	c := tb.answered(0)
	held := h.shareOf(t, "order-88", "tok-1")
	if c.Outcome != OutcomeGranted || c.Amount != yuan(held.Amount) {
		t.Fatalf("after Open the card shows %+v; redis holds %s", c, yuan(held.Amount))
	}
	tb.until("left", "the list to follow", func(s string) bool { return s == "· 1 of 3 left" })
	tb.clean() // every read and the grab answered below 400
	tb.mu.Lock()
	for _, u := range tb.urls {
		if strings.Contains(u, good) {
			t.Errorf("a request's address carries the token: %s", u)
		}
	}
	tb.mu.Unlock()

	tb = open(t, browser, desktop, false, base+"?user=anon-1")
	tb.until("state", "the refusal", func(s string) bool { return s == "sign-in needed" })
	if c := tb.card(); c.Outcome != OutcomeUnauthorized || !strings.Contains(c.Message, "sign-in link is not valid") {
		t.Errorf("without a token: card %+v", c)
	}
	if from, list := tb.text("from"), tb.listed(); strings.Contains(from, "Lin") || len(list) != 0 {
		t.Errorf("without a token the page shows %q and %v", from, list)
	}
}

// TestPacketPageLifecycle: the packet page shows what the service says of a
// packet's life: open, expired, the refund going back to the sender, and refunded,
// with the amount the detail reports.
func TestPacketPageLifecycle(t *testing.T) {
	browser := newBrowser(t)
	h := newPacketHarness(t, 100_000, 1)
	if a := h.create(`{"id":"order-life","sender":"Lin's tea shop","totalAmount":500,"count":5,"ttlSeconds":2}`); a.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", a.Status, a.Raw)
	}
	got := h.grab("order-life", "alice", nil)
	left := yuan(500 - got.num("amount"))
	tb := open(t, browser, desktop, false, h.http.URL+"/p/order-life?user=bob", http.StatusConflict)
	tb.until("state", "open", func(s string) bool { return s == "Open" })
	tb.until("state", "expired once its time is up", func(s string) bool { return s == "Expired" })
	if n, _, err := h.handle.ExpireDue(context.Background(), 0, 10); err != nil || n != 1 {
		t.Fatalf("expiry: %d, %v", n, err)
	}
	tb.until("state", "the refund under way", func(s string) bool { return s == "Expired · "+left+" going back to the sender" })
	if errs := h.handle.ForgetPackets(context.Background(), []string{"order-life"}, time.Hour); errs[0] != nil {
		t.Fatal(errs[0])
	}
	tb.until("state", "refunded", func(s string) bool { return s == "Expired · "+left+" refunded to the sender" })
	tb.clean()
}
