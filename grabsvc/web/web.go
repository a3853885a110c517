// Package web is the red-packet rain page the grab service serves at / (and
// /rain.css, /rain.js): packets fall on a canvas, and tapping one is a real
// POST /v1/grab. The files are embedded in the binary; the page loads nothing from
// anywhere else, and runs under the strict Content-Security-Policy the server sets.
// docs/rain-page.md describes it.
package web

import "embed"

// Files are the page's files: index.html, rain.css and rain.js.
//
//go:embed index.html rain.css rain.js
var Files embed.FS
