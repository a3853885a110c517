// Package version is the release version stamped into every binary of the project
// (the operator, the grab service and the kubectl-rpa plugin), printed by their
// --version flag.
//
// The build sets it with
//
//	-ldflags "-X redpacket.io/operator/internal/version.version=$(git describe --tags --always --dirty)"
//
// as `make build`, `make image` and `make release` do. A binary built without the
// flag (go run, go test, a plain go build) reports "dev", followed by the commit that
// the Go toolchain recorded, when it recorded one.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// version is set at link time; see the package comment.
var version = "dev"

// Version is the stamped release version, such as "v0.3.0" or "v0.3.0-4-g1a2b3c4-dirty",
// or "dev" for an unstamped build.
func Version() string {
	return version
}

// String is the line a binary prints for --version: its name, the version, the commit
// of an unstamped build when the toolchain recorded it, the Go version and the
// platform, such as "kubectl-rpa v0.3.0 go1.26.8 linux/amd64".
func String(binary string) string {
	v := version
	if v == "dev" {
		if rev := vcsRevision(); rev != "" {
			v += " (" + rev + ")"
		}
	}
	return fmt.Sprintf("%s %s %s %s/%s", binary, v, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

// vcsRevision is the short commit the Go toolchain stamped into the binary, with
// "-dirty" when the work tree had changes, or "" when it stamped none (go run, go
// test, -buildvcs=false, or a build outside a repository).
func vcsRevision() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	var rev string
	var dirty bool
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if rev != "" && dirty {
		rev += "-dirty"
	}
	return rev
}
