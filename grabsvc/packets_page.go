package grabsvc

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"time"

	"redpacket.io/operator/grabsvc/web"
)

// registerPacketPage serves the packet page's embedded files: packet.html at /p/{id}
// for every well-formed packet id (the page reads the id from its address), and
// packet.css and packet.js at the root, where no packet id can shadow them. Every
// response carries the rain page's Content-Security-Policy.
func registerPacketPage(mux *http.ServeMux) error {
	for _, f := range []struct{ path, file, contentType string }{
		{"/p/{id}", "packet.html", "text/html; charset=utf-8"},
		{"/packet.css", "packet.css", "text/css; charset=utf-8"},
		{"/packet.js", "packet.js", "text/javascript; charset=utf-8"},
	} {
		body, err := web.PacketFiles.ReadFile(f.file)
		if err != nil {
			return fmt.Errorf("grab server: the packet page: %w", err)
		}
		sum := sha256.Sum256(body)
		etag := `"` + hex.EncodeToString(sum[:8]) + `"`
		mux.HandleFunc(f.path, func(w http.ResponseWriter, r *http.Request) {
			h := w.Header()
			h.Set("Content-Security-Policy", PageContentSecurityPolicy)
			h.Set("X-Content-Type-Options", "nosniff")
			h.Set("Referrer-Policy", "no-referrer")
			if r.Method != http.MethodGet && r.Method != http.MethodHead {
				h.Set("Allow", "GET, HEAD")
				writeJSON(w, http.StatusMethodNotAllowed, errorBody{Error: "use GET on " + r.URL.Path})
				return
			}
			if id := r.PathValue("id"); f.file == "packet.html" && CheckPacketID(id) != "" {
				writeJSON(w, http.StatusNotFound, errorBody{Error: "no such packet page: the packet id " + CheckPacketID(id)})
				return
			}
			h.Set("Content-Type", f.contentType)
			h.Set("Cache-Control", "no-cache")
			h.Set("ETag", etag)
			http.ServeContent(w, r, f.file, time.Time{}, bytes.NewReader(body))
		})
	}
	return nil
}
