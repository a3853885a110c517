package cluster

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"redpacket.io/operator/test/controlplane"
)

// The previous release named in hack/release/previous is in the repository, and its
// checkout is a source tree the upgrade test can build: its chart, its image builder
// and its two binaries.
func TestPreviousReleaseChecksOut(t *testing.T) {
	root, err := controlplane.Root()
	if err != nil {
		t.Fatal(err)
	}
	r, err := PreviousRelease(root)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := r.CheckOut(t.Context(), root, dir); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"go.mod", "charts/redpacket-operator/Chart.yaml", "hack/image/main.go", "cmd/manager/main.go", "cmd/grabsvc/main.go"} {
		if _, err := os.Stat(filepath.Join(dir, p)); err != nil {
			t.Errorf("release %s lacks %s: %v", r.Version, p, err)
		}
	}
	chart, err := os.ReadFile(filepath.Join(dir, "charts/redpacket-operator/Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if want := "appVersion: \"" + r.Version + "\""; !strings.Contains(string(chart), want) {
		t.Errorf("release %s's chart does not say %s:\n%s", r.Version, want, chart)
	}
	current, err := os.ReadFile(filepath.Join(root, "charts/redpacket-operator/Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(current), "appVersion: \""+r.Version+"\"") {
		t.Errorf("this tree's chart still has the previous release's version %s", r.Version)
	}
}

func TestPreviousReleaseRefusesBadFiles(t *testing.T) {
	for name, text := range map[string]string{
		"no commit":    "version v1.0.0\n",
		"short commit": "version v1.0.0\ncommit 0c2c224\n",
		"unknown line": "version v1.0.0\ncommit 0c2c224f0adf4e635381236f08c46a9af80e820e\nbranch main\n",
		"no version":   "commit 0c2c224f0adf4e635381236f08c46a9af80e820e\n",
	} {
		root := t.TempDir()
		if err := os.MkdirAll(filepath.Join(root, "hack", "release"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, "hack", "release", "previous"), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		if r, err := PreviousRelease(root); err == nil {
			t.Errorf("%s: read %+v, want an error", name, r)
		}
	}
}
