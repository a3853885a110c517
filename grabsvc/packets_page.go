package grabsvc

import (
	"net/http"

	"redpacket.io/operator/grabsvc/web"
)

// registerPacketPage serves the packet page's embedded files: packet.html at /p/{id}
// for every well-formed packet id (the page reads the id from its address), and
// packet.css and packet.js as content-hashed assets under /assets/ (and under their
// plain names at the root), where no packet id can shadow them. Every
// response carries the rain page's Content-Security-Policy.
func registerPacketPage(mux *http.ServeMux) error {
	return servePageFiles(mux, "the packet page", web.PacketFiles, []pageFile{
		{path: "/p/{id}", file: "packet.html", contentType: "text/html; charset=utf-8", check: func(r *http.Request) string {
			if msg := CheckPacketID(r.PathValue("id")); msg != "" {
				return "no such packet page: the packet id " + msg
			}
			return ""
		}},
		{path: "/packet.css", file: "packet.css", contentType: "text/css; charset=utf-8", asset: true},
		{path: "/packet.js", file: "packet.js", contentType: "text/javascript; charset=utf-8", asset: true},
	})
}
