package grabsvc

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"redpacket.io/operator/grabsvc/web"
)

// servedHTML is an HTML file of a page as the server sends it: each of its
// "assets/<file>" references replaced by the asset's content-hashed path.
func servedHTML(t *testing.T, html []byte, files fs.ReadFileFS, assets ...string) []byte {
	t.Helper()
	for _, a := range assets {
		body, err := files.ReadFile(a)
		if err != nil {
			t.Fatal(err)
		}
		html = bytes.ReplaceAll(html, []byte("assets/"+a+`"`), []byte(strings.TrimPrefix(AssetPath(a, body), "/")+`"`))
	}
	return html
}

// assetRefs are the stylesheet and script references of an HTML page.
var assetRefs = regexp.MustCompile(`(?:href|src)="([^"]*assets/[^"]+)"`)

// getPage fetches u and returns its body and headers, failing on anything but 200.
func getPage(t *testing.T, u string) ([]byte, http.Header) {
	t.Helper()
	resp, err := http.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %s", u, resp.StatusCode, body)
	}
	return body, resp.Header
}

// Behind a public host and a CDN: the pages' assets are served under names that
// carry their content's hash, with a year-long immutable Cache-Control; the HTML
// that names them and the API are never stored. Every response of a page keeps the
// Content-Security-Policy. Checked over real HTTP against a grab server on a real
// Redis, for the rain page (an activity's) and the packet page (a budget's); the
// HTML's references resolve relative to the page, so they work under a prefix too.
func TestPageAssetsAreHashedAndCachedTheAPIIsNot(t *testing.T) {
	rain := newHarness(t, func(c *Config) { c.Page = true })
	packet := newPacketHarness(t, 1000, 1)
	for _, tc := range []struct {
		name, base, page string
		files            fs.ReadFileFS
		assets           []string
		api              string
	}{
		{"rain page", rain.http.URL, "/", web.Files, []string{"rain.css", "rain.js"}, "/v1/activity"},
		{"packet page", packet.http.URL, "/p/order-1", web.PacketFiles, []string{"packet.css", "packet.js"}, "/v1/packets/order-1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			html, h := getPage(t, tc.base+tc.page)
			if got := h.Get("Cache-Control"); got != "no-store" {
				t.Errorf("the HTML's Cache-Control %q, want no-store", got)
			}
			if h.Get("Content-Security-Policy") != PageContentSecurityPolicy {
				t.Errorf("the HTML's CSP %q", h.Get("Content-Security-Policy"))
			}
			refs := assetRefs.FindAllStringSubmatch(string(html), -1)
			if len(refs) != len(tc.assets) {
				t.Fatalf("asset references %q, want %d", refs, len(tc.assets))
			}
			pageURL, _ := url.Parse(tc.base + tc.page)
			for i, ref := range refs {
				u, _ := pageURL.Parse(ref[1])
				body, h := getPage(t, u.String())
				want, _ := tc.files.ReadFile(tc.assets[i])
				if !bytes.Equal(body, want) {
					t.Errorf("%s: not the embedded %s", u.Path, tc.assets[i])
				}
				sum := sha256.Sum256(want)
				if !strings.HasPrefix(u.Path, "/assets/") || !strings.Contains(u.Path, "."+hex.EncodeToString(sum[:6])+".") {
					t.Errorf("%s does not carry the hash of %s's content", u.Path, tc.assets[i])
				}
				if got := h.Get("Cache-Control"); got != "public, max-age=31536000, immutable" {
					t.Errorf("%s: Cache-Control %q, want a year, immutable", u.Path, got)
				}
				if h.Get("Content-Security-Policy") != PageContentSecurityPolicy || h.Get("X-Content-Type-Options") != "nosniff" {
					t.Errorf("%s: CSP %q, nosniff %q", u.Path, h.Get("Content-Security-Policy"), h.Get("X-Content-Type-Options"))
				}
			}
			resp, err := http.Get(tc.base + tc.api)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if got := resp.Header.Get("Cache-Control"); got != "no-store" {
				t.Errorf("GET %s: %d, Cache-Control %q, want no-store", tc.api, resp.StatusCode, got)
			}
		})
	}
}
