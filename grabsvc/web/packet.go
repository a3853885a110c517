package web

import "embed"

// PacketFiles are the packet page's files: packet.html, packet.css and packet.js. The
// grab service of a RedPacketBudget serves the page at /p/{id}: open one packet
// created at runtime, grab it, and see who got what. Like the rain page it loads
// nothing from anywhere else and runs under the same Content-Security-Policy.
//
//go:embed packet.html packet.css packet.js
var PacketFiles embed.FS
