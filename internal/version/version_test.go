package version

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// Without a stamp a binary reports "dev" with its platform.
func TestUnstamped(t *testing.T) {
	if Version() != "dev" {
		t.Fatalf("Version() = %q in a test binary, want dev", Version())
	}
	got := String("manager")
	if !strings.HasPrefix(got, "manager dev") || !strings.HasSuffix(got, " "+runtime.Version()+" "+runtime.GOOS+"/"+runtime.GOARCH) {
		t.Errorf("String = %q", got)
	}
}

// Every binary of the project takes the version the build stamps with -X (as make
// build, make image and make release do) and prints it for --version.
func TestBinariesPrintTheStampedVersion(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the operator, the grab service and the plugin; run without -short")
	}
	const stamp = "v9.9.9-stamped"
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for name, pkg := range map[string]string{
		"manager":     "./cmd/manager",
		"grabsvc":     "./cmd/grabsvc",
		"kubectl-rpa": "./cmd/kubectl-rpa",
	} {
		bin := filepath.Join(dir, name)
		build := exec.Command("go", "build", "-ldflags", "-X redpacket.io/operator/internal/version.version="+stamp, "-o", bin, pkg)
		build.Dir = root
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("go build %s: %v\n%s", pkg, err, out)
		}
		out, err := exec.Command(bin, "--version").CombinedOutput()
		want := name + " " + stamp + " " + runtime.Version()
		if err != nil || !strings.HasPrefix(string(out), want) {
			t.Errorf("%s --version: %q, %v; want %q…", name, out, err, want)
		}
	}
}
