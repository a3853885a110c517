package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"
)

// The chart takes a semantic release version as its own version; any other release
// (a commit, a dirty tree) becomes build metadata of the chart's version. The
// appVersion, which picks the image tag, is the release version either way.
func TestChartVersions(t *testing.T) {
	for _, tc := range []struct {
		chart, release, version, app string
	}{
		{"0.1.0", "v0.3.0", "0.3.0", "v0.3.0"},
		{"0.1.0", "1.2.3-rc.1", "1.2.3-rc.1", "1.2.3-rc.1"},
		{"0.1.0", "4f57f62-dirty", "0.1.0+4f57f62-dirty", "4f57f62-dirty"},
		{"0.1.0", "v0.3.0-4-g1a2b3c4-dirty", "0.3.0-4-g1a2b3c4-dirty", "v0.3.0-4-g1a2b3c4-dirty"},
		{"0.1.0", "dev", "0.1.0+dev", "dev"},
		{"0.1.0", "a_b/c", "0.1.0+a-b-c", "a_b/c"},
	} {
		v, app, err := ChartVersions(tc.chart, tc.release)
		if err != nil || v != tc.version || app != tc.app {
			t.Errorf("ChartVersions(%q, %q) = %q, %q, %v; want %q, %q", tc.chart, tc.release, v, app, err, tc.version, tc.app)
		}
	}
	if _, _, err := ChartVersions("latest", "dev"); err == nil {
		t.Error("a chart version that is not semver was accepted")
	}
}

// A checksum file is what sha256sum writes, and sha256sum -c accepts it.
func TestWriteChecksum(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "kubectl-rpa-linux-amd64")
	if err := os.WriteFile(file, []byte("hello\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	sum, err := WriteChecksum(file)
	if err != nil {
		t.Fatal(err)
	}
	const want = "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
	got, err := os.ReadFile(file + ".sha256")
	if err != nil {
		t.Fatal(err)
	}
	if sum != want || string(got) != want+"  kubectl-rpa-linux-amd64\n" {
		t.Fatalf("sum %s, file %q", sum, got)
	}
	cmd := exec.Command("sha256sum", "-c", "kubectl-rpa-linux-amd64.sha256")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "OK") {
		t.Fatalf("sha256sum -c: %v\n%s", err, out)
	}
	// A changed file fails the check.
	if err := os.WriteFile(file, []byte("hellO\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd = exec.Command("sha256sum", "-c", "kubectl-rpa-linux-amd64.sha256")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err == nil {
		t.Fatalf("sha256sum -c accepted a changed file:\n%s", out)
	}
}

// The project's chart packages with the release's versions, and the package loads.
func TestPackageChart(t *testing.T) {
	dir := filepath.Join("..", "..", "charts", "redpacket-operator")
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("the chart: %v", err)
	}
	pkg, err := PackageChart(dir, t.TempDir(), "v9.8.7")
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(pkg) != "redpacket-operator-9.8.7.tgz" {
		t.Errorf("package %s", pkg)
	}
	ch, err := loader.LoadFile(pkg)
	if err != nil {
		t.Fatal(err)
	}
	if ch.Metadata.Version != "9.8.7" || ch.Metadata.AppVersion != "v9.8.7" || len(ch.Templates) == 0 {
		t.Errorf("packaged chart %s %s with %d templates", ch.Metadata.Version, ch.Metadata.AppVersion, len(ch.Templates))
	}
}

// The plugin builds for a platform with the version stamped in.
func TestBuildPlugin(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the plugin; run without -short")
	}
	out := t.TempDir()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	// go build runs in the module's top directory, as make release runs it.
	t.Chdir(filepath.Join(wd, "..", ".."))
	bin, err := BuildPlugin(context.Background(), out, runtime.GOOS+"/"+runtime.GOARCH, "v9.8.7-test")
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(bin) != "kubectl-rpa-"+runtime.GOOS+"-"+runtime.GOARCH {
		t.Errorf("binary %s", bin)
	}
	got, err := exec.Command(bin, "--version").Output()
	if err != nil || !strings.HasPrefix(string(got), "kubectl-rpa v9.8.7-test ") {
		t.Fatalf("--version: %q %v", got, err)
	}
	if _, err := BuildPlugin(context.Background(), out, "plan9", "v1"); err == nil {
		t.Error("a platform without an arch was accepted")
	}
}
