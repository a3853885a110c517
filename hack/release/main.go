// Command release assembles a release in one directory (`make release`):
//
//	go run ./hack/release [--out dist] [--version V]
//
// `make release` first writes DIR/install.yaml (make render) and the image tarballs
// with DIR/images.txt (make image). This command then
//
//   - packages the Helm chart in charts/redpacket-operator (with the Helm library, as
//     `helm package` does) as DIR/redpacket-operator-<chart version>.tgz, its appVersion
//     set to V so that it installs the image redpacket-operator:V; the chart version is
//     V when V is a semantic version, else the chart's own version with V as build
//     metadata. Without that directory it says so and packages nothing.
//   - builds the kubectl plugin for linux and darwin on amd64 and arm64
//     (CGO_ENABLED=0, -trimpath, V stamped in) as DIR/kubectl-rpa-<os>-<arch>.
//   - writes FILE.sha256 beside every artifact (install.yaml, the images, the chart,
//     the plugins), in sha256sum's format, so `sha256sum -c FILE.sha256` checks it.
//   - prints the artifacts with their sizes.
//
// V defaults to `git describe --tags --always --dirty`, as the Makefile's VERSION.
package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/Masterminds/semver/v3"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"sigs.k8s.io/yaml"
)

// Platforms are the os/arch pairs the plugin is built for.
var Platforms = []string{"linux/amd64", "linux/arm64", "darwin/amd64", "darwin/arm64"}

// versionVariable is the variable -X stamps the version into.
const versionVariable = "redpacket.io/operator/internal/version.version"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("release", flag.ContinueOnError)
	out := fs.String("out", "dist", "directory that holds install.yaml and the images, and receives the chart, the plugins and the checksums")
	version := fs.String("version", "", "release version (default: git describe --tags --always --dirty)")
	chartDir := fs.String("chart", filepath.Join("charts", "redpacket-operator"), "the Helm chart to package")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *version == "" {
		*version = gitDescribe(ctx)
	}

	install := filepath.Join(*out, "install.yaml")
	if err := checkInstall(install, *version); err != nil {
		return err
	}
	artifacts := []string{install}
	images, err := imageFiles(*out)
	if err != nil {
		return err
	}
	artifacts = append(artifacts, images...)

	switch _, err := os.Stat(*chartDir); {
	case err == nil:
		pkg, err := PackageChart(*chartDir, *out, *version)
		if err != nil {
			return err
		}
		artifacts = append(artifacts, pkg)
	case errors.Is(err, os.ErrNotExist):
		fmt.Fprintf(stdout, "release: no chart at %s; packaging none\n", *chartDir)
	default:
		return err
	}

	for _, p := range Platforms {
		bin, err := BuildPlugin(ctx, *out, p, *version)
		if err != nil {
			return err
		}
		artifacts = append(artifacts, bin)
	}

	w := tabwriter.NewWriter(stdout, 6, 4, 3, ' ', 0)
	fmt.Fprintf(stdout, "release %s in %s:\n", *version, *out)
	fmt.Fprintln(w, "BYTES\tFILE\tSHA-256")
	for _, a := range artifacts {
		sum, err := WriteChecksum(a)
		if err != nil {
			return err
		}
		fi, err := os.Stat(a)
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "%11d\t%s\t%s\n", fi.Size(), filepath.Base(a), sum)
	}
	return w.Flush()
}

// gitDescribe is `git describe --tags --always --dirty`, or "dev" when git cannot tell.
func gitDescribe(ctx context.Context) string {
	out, err := exec.CommandContext(ctx, "git", "describe", "--tags", "--always", "--dirty").Output()
	if v := strings.TrimSpace(string(out)); err == nil && v != "" {
		return v
	}
	return "dev"
}

// checkInstall makes sure the rendered manifests exist and name the release's
// operator image, so that a stale install.yaml is never shipped.
func checkInstall(path, version string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("%w (make render writes it)", err)
	}
	if !strings.Contains(string(data), "redpacket-operator:"+version) {
		return fmt.Errorf("%s does not name the image redpacket-operator:%s; run make render VERSION=%s", path, version, version)
	}
	return nil
}

// imageFiles lists the image tarballs that images.txt in dir names ("file<TAB>tag"
// per line, file relative to dir).
func imageFiles(dir string) ([]string, error) {
	f, err := os.Open(filepath.Join(dir, "images.txt"))
	if err != nil {
		return nil, fmt.Errorf("%w (make image writes it)", err)
	}
	defer f.Close()
	var files []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		file, _, ok := strings.Cut(strings.TrimSpace(sc.Text()), "\t")
		if !ok {
			continue
		}
		path := filepath.Join(dir, filepath.Base(file))
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("image listed in images.txt: %w", err)
		}
		files = append(files, path)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("%s lists no image", filepath.Join(dir, "images.txt"))
	}
	return files, nil
}

// ChartVersions are the chart version and appVersion a release gives the chart
// whose own version is chartVersion: the release version as the chart version when
// it is a semantic version (without a leading "v"), else chartVersion with the release
// version as build metadata (so "0.1.0+4f57f62-dirty"); the appVersion is the release
// version, the tag of the operator image the chart installs by default.
func ChartVersions(chartVersion, release string) (version, appVersion string, err error) {
	if v, err := semver.StrictNewVersion(strings.TrimPrefix(release, "v")); err == nil {
		return v.String(), release, nil
	}
	base, err := semver.StrictNewVersion(chartVersion)
	if err != nil {
		return "", "", fmt.Errorf("chart version %q is not a semantic version: %w", chartVersion, err)
	}
	meta := strings.Map(func(r rune) rune {
		if r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r == '-' || r == '.' {
			return r
		}
		return '-'
	}, release)
	v, err := base.SetMetadata(meta)
	if err != nil {
		return "", "", fmt.Errorf("release %q as build metadata of chart version %s: %w", release, chartVersion, err)
	}
	return v.String(), release, nil
}

// PackageChart packages the chart in dir into out as helm package does (loaded and
// validated by the Helm library, written as <name>-<version>.tgz), with the versions
// of ChartVersions, and returns the package's path.
func PackageChart(dir, out, release string) (string, error) {
	ch, err := loader.LoadDir(dir)
	if err != nil {
		return "", fmt.Errorf("loading the chart in %s: %w", dir, err)
	}
	v, app, err := ChartVersions(ch.Metadata.Version, release)
	if err != nil {
		return "", err
	}
	ch.Metadata.Version, ch.Metadata.AppVersion = v, app
	if err := ch.Validate(); err != nil {
		return "", fmt.Errorf("chart %s: %w", dir, err)
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return "", err
	}
	pkg, err := chartutil.Save(ch, out)
	if err != nil {
		return "", fmt.Errorf("packaging the chart: %w", err)
	}
	// The packaged Chart.yaml is the one the Helm library wrote; read it back to be
	// sure the versions went in.
	packaged, err := loader.LoadFile(pkg)
	if err != nil {
		return "", fmt.Errorf("reading back %s: %w", pkg, err)
	}
	if packaged.Metadata.Version != v || packaged.Metadata.AppVersion != app {
		meta, _ := yaml.Marshal(packaged.Metadata)
		return "", fmt.Errorf("%s holds\n%s\nwant version %s, appVersion %s", pkg, meta, v, app)
	}
	return pkg, nil
}

// BuildPlugin builds the kubectl plugin for platform ("os/arch") into
// out/kubectl-rpa-<os>-<arch>: static (CGO_ENABLED=0), -trimpath, without symbol
// table and DWARF, with version stamped in.
func BuildPlugin(ctx context.Context, out, platform, version string) (string, error) {
	goos, goarch, ok := strings.Cut(platform, "/")
	if !ok || goos == "" || goarch == "" {
		return "", fmt.Errorf("platform %q is not os/arch", platform)
	}
	bin, err := filepath.Abs(filepath.Join(out, "kubectl-rpa-"+goos+"-"+goarch))
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath",
		"-ldflags", "-s -w -X "+versionVariable+"="+version, "-o", bin, "./cmd/kubectl-rpa")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+goos, "GOARCH="+goarch)
	if outb, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building kubectl-rpa for %s: %w\n%s", platform, err, outb)
	}
	return bin, nil
}

// WriteChecksum writes path.sha256 in sha256sum's format ("<hex>  <file name>\n",
// the name relative to the file's directory) and returns the hex digest.
func WriteChecksum(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("hashing %s: %w", path, err)
	}
	sum := hex.EncodeToString(h.Sum(nil))
	line := sum + "  " + filepath.Base(path) + "\n"
	if err := os.WriteFile(path+".sha256", []byte(line), 0o644); err != nil {
		return "", err
	}
	return sum, nil
}
