package main

import (
	"bytes"
	"context"
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
)

// The images this command builds, in the order it builds them.
const (
	imageOperator = "operator"
	imagePause    = "pause"
	imageRedis    = "redis"
	imageBalance  = "balance"
	imageTraefik  = "traefik"
)

var allImages = []string{imageOperator, imagePause, imageRedis, imageBalance, imageTraefik}

// defaultEnv is the environment of every image: the PATH that Docker gives an image
// that sets none.
var defaultEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

// Where the images take their inputs from on the build host.
const (
	hostCACerts     = "/etc/ssl/certs/ca-certificates.crt"
	hostRedisServer = "/usr/bin/redis-server"
)

// A builder builds the project's images.
type builder struct {
	root        string // the module's root directory
	work        string // a scratch directory for the binaries it builds
	version     string // the tag of the operator and pause images
	caCerts     string // the CA roots copied into the operator image
	redisServer string // the redis-server binary copied into the Redis image
	traefikBin  string // the Traefik binary (bin/traefik, make traefik) copied into the Traefik image
}

// A built image and where it goes.
type built struct {
	file string // the file name of its tarball in the output directory
	tag  name.Tag
	img  v1.Image
}

// build builds the image called kind (one of allImages).
func (b *builder) build(ctx context.Context, kind string) (built, error) {
	switch kind {
	case imageOperator:
		return b.operator(ctx)
	case imagePause:
		return b.pause(ctx)
	case imageRedis:
		return b.redis(ctx)
	case imageBalance:
		return b.balance(ctx)
	case imageTraefik:
		return b.traefik()
	}
	return built{}, fmt.Errorf("unknown image %q", kind)
}

// operator builds the operator image, redpacket-operator:<version>.
func (b *builder) operator(ctx context.Context) (built, error) {
	tag, err := name.NewTag("redpacket-operator:" + b.version)
	if err != nil {
		return built{}, err
	}
	manager := filepath.Join(b.work, "manager")
	grabsvc := filepath.Join(b.work, "grabsvc")
	if err := goBuild(ctx, b.root, "./cmd/manager", manager, b.version); err != nil {
		return built{}, err
	}
	if err := goBuild(ctx, b.root, "./cmd/grabsvc", grabsvc, b.version); err != nil {
		return built{}, err
	}
	img, err := operatorImage(manager, grabsvc, b.caCerts)
	if err != nil {
		return built{}, err
	}
	return built{file: "redpacket-operator-" + b.version + ".tar", tag: tag, img: img}, nil
}

// pause builds the pod sandbox image, redpacket-pause:<version>, from hack/pause.
func (b *builder) pause(ctx context.Context) (built, error) {
	tag, err := name.NewTag("redpacket-pause:" + b.version)
	if err != nil {
		return built{}, err
	}
	bin := filepath.Join(b.work, "pause")
	if err := goBuild(ctx, b.root, "./hack/pause", bin, b.version); err != nil {
		return built{}, err
	}
	img, err := pauseImage(bin)
	if err != nil {
		return built{}, err
	}
	return built{file: "pause.tar", tag: tag, img: img}, nil
}

// redis builds the Redis image, redpacket-redis:<Redis version>, from the host's
// redis-server.
func (b *builder) redis(ctx context.Context) (built, error) {
	version, err := redisVersion(ctx, b.redisServer)
	if err != nil {
		return built{}, err
	}
	tag, err := name.NewTag("redpacket-redis:" + version)
	if err != nil {
		return built{}, err
	}
	img, err := redisImage(ctx, b.redisServer)
	if err != nil {
		return built{}, err
	}
	return built{file: "redis.tar", tag: tag, img: img}, nil
}

// balance builds the reference balance system's image, redpacket-balance:<version>,
// from cmd/balance.
func (b *builder) balance(ctx context.Context) (built, error) {
	tag, err := name.NewTag("redpacket-balance:" + b.version)
	if err != nil {
		return built{}, err
	}
	bin := filepath.Join(b.work, "balance")
	if err := goBuild(ctx, b.root, "./cmd/balance", bin, b.version); err != nil {
		return built{}, err
	}
	img, err := balanceImage(bin, b.caCerts)
	if err != nil {
		return built{}, err
	}
	return built{file: "redpacket-balance-" + b.version + ".tar", tag: tag, img: img}, nil
}

// balanceImage returns the reference balance system's image: the static binary
// balance at /balance (mode 0755) and the CA roots caCerts at
// /etc/ssl/certs/ca-certificates.crt (0644, for a database URL with
// sslmode=verify-full), owned by root, run as 65532:65532 with /balance as the
// entrypoint, serving on 8080. Its configuration comes from the environment:
// DATABASE_URL, BALANCE_SIGNING_KEYS or BALANCE_PUBLIC_KEYS (docs/balance.md).
func balanceImage(balance, caCerts string) (v1.Image, error) {
	t, err := treeOf([]hostFile{
		{caCerts, "/etc/ssl/certs/ca-certificates.crt", 0o644},
		{balance, "/balance", 0o755},
	})
	if err != nil {
		return nil, err
	}
	return newImage(t, v1.Config{
		Entrypoint:   []string{"/balance"},
		User:         "65532:65532",
		Env:          defaultEnv,
		ExposedPorts: map[string]struct{}{"8080/tcp": {}},
	})
}

// traefik builds the Gateway's image, redpacket-traefik:<Traefik's version>, from
// bin/traefik, which hack/build-controlplane.sh traefik builds from the module pinned
// in hack/tools/traefik; the version is the pinned one.
func (b *builder) traefik() (built, error) {
	version, err := traefikVersion(filepath.Join(b.root, "hack", "tools", "traefik", "go.mod"))
	if err != nil {
		return built{}, err
	}
	tag, err := name.NewTag("redpacket-traefik:" + version)
	if err != nil {
		return built{}, err
	}
	if _, err := os.Stat(b.traefikBin); err != nil {
		return built{}, fmt.Errorf("%w: run make traefik (hack/build-controlplane.sh traefik)", err)
	}
	img, err := traefikImage(b.traefikBin, b.caCerts)
	if err != nil {
		return built{}, err
	}
	return built{file: "traefik.tar", tag: tag, img: img}, nil
}

// traefikRequire matches the requirement of Traefik v3 in a go.mod.
var traefikRequire = regexp.MustCompile(`(?m)^\s*(?:require\s+)?github\.com/traefik/traefik/v3\s+(v[0-9][^\s]*)\s*$`)

// traefikVersion is the version of Traefik v3 that the go.mod at path requires.
func traefikVersion(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	m := traefikRequire.FindSubmatch(data)
	if m == nil {
		return "", fmt.Errorf("%s requires no github.com/traefik/traefik/v3", path)
	}
	return string(m[1]), nil
}

// traefikImage returns the Gateway's image: the static binary traefik at /traefik
// (mode 0755) and the CA roots caCerts (0644, for an ACME server or a backend over
// TLS), owned by root, run as 65532:65532 with /traefik as the entrypoint. Its
// configuration is its flags: the providers (kubernetesGateway, kubernetesIngress)
// and the entry points, on unprivileged ports (8000 and 8443 by convention; a
// Service maps 80 and 443 to them).
func traefikImage(traefik, caCerts string) (v1.Image, error) {
	t, err := treeOf([]hostFile{
		{caCerts, "/etc/ssl/certs/ca-certificates.crt", 0o644},
		{traefik, "/traefik", 0o755},
	})
	if err != nil {
		return nil, err
	}
	return newImage(t, v1.Config{
		Entrypoint:   []string{"/traefik"},
		User:         "65532:65532",
		Env:          defaultEnv,
		ExposedPorts: map[string]struct{}{"8000/tcp": {}, "8443/tcp": {}},
	})
}

// hostFile is a file of this host copied into an image: src to dst with mode.
type hostFile struct {
	src, dst string
	mode     os.FileMode
}

// treeOf is a tree holding the host's files, each at its place, owned by root.
func treeOf(files []hostFile) (*tree, error) {
	t := newTree()
	for _, f := range files {
		data, err := os.ReadFile(f.src)
		if err != nil {
			return nil, err
		}
		if err := t.addFile(f.dst, data, f.mode); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// operatorImage returns the operator image: the static binaries manager and grabsvc
// at /manager and /grabsvc (mode 0755), the CA roots caCerts at
// /etc/ssl/certs/ca-certificates.crt (0644), all owned by root, run as 65532:65532
// with /manager as the entrypoint. The Dockerfile builds the same layout.
func operatorImage(manager, grabsvc, caCerts string) (v1.Image, error) {
	t, err := treeOf([]hostFile{
		{caCerts, "/etc/ssl/certs/ca-certificates.crt", 0o644},
		{manager, "/manager", 0o755},
		{grabsvc, "/grabsvc", 0o755},
	})
	if err != nil {
		return nil, err
	}
	return newImage(t, v1.Config{
		Entrypoint:   []string{"/manager"},
		User:         "65532:65532",
		Env:          defaultEnv,
		ExposedPorts: map[string]struct{}{"8080/tcp": {}, "8081/tcp": {}},
	})
}

// pauseImage returns the pod sandbox image: the static binary pause at /pause, run
// as 65535:65535.
func pauseImage(pause string) (v1.Image, error) {
	data, err := os.ReadFile(pause)
	if err != nil {
		return nil, err
	}
	t := newTree()
	if err := t.addFile("/pause", data, 0o755); err != nil {
		return nil, err
	}
	return newImage(t, v1.Config{
		Entrypoint: []string{"/pause"},
		User:       "65535:65535",
		Env:        defaultEnv,
	})
}

// The Redis image's user and its account files.
const (
	redisUID    = 65532
	redisPasswd = "root:x:0:0:root:/root:/usr/sbin/nologin\nredis:x:65532:65532:redis:/data:/usr/sbin/nologin\n"
	redisGroup  = "root:x:0:\nredis:x:65532:\n"
)

// redisImage returns a Redis image made from the dynamically linked redis-server at
// server: the binary at the same path, every shared library it loads and the
// dynamic loader at their absolute paths on the host, /etc/passwd and /etc/group
// with a redis user 65532, and /data owned by it as the working directory.
func redisImage(ctx context.Context, server string) (v1.Image, error) {
	libs, err := sharedLibraries(ctx, server)
	if err != nil {
		return nil, err
	}
	t := newTree()
	for _, p := range append([]string{server}, libs...) {
		st, err := os.Stat(p)
		if err != nil {
			return nil, err
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		if err := t.addFile(p, data, st.Mode().Perm()); err != nil {
			return nil, err
		}
	}
	if err := t.addFile("/etc/passwd", []byte(redisPasswd), 0o644); err != nil {
		return nil, err
	}
	if err := t.addFile("/etc/group", []byte(redisGroup), 0o644); err != nil {
		return nil, err
	}
	if err := t.addDir("/data", 0o755, redisUID, redisUID); err != nil {
		return nil, err
	}
	return newImage(t, v1.Config{
		Entrypoint:   []string{server},
		WorkingDir:   "/data",
		User:         fmt.Sprintf("%d:%d", redisUID, redisUID),
		Env:          defaultEnv,
		ExposedPorts: map[string]struct{}{"6379/tcp": {}},
	})
}

var redisVersionRE = regexp.MustCompile(`\bv=([0-9][0-9A-Za-z._-]*)`)

// redisVersion returns the version that `server --version` reports, such as 7.0.15.
func redisVersion(ctx context.Context, server string) (string, error) {
	out, err := exec.CommandContext(ctx, server, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("%s --version: %w", server, err)
	}
	m := redisVersionRE.FindSubmatch(out)
	if m == nil {
		return "", fmt.Errorf("%s --version: no version in %q", server, out)
	}
	return string(m[1]), nil
}

// sharedLibraries returns the absolute paths of the shared libraries that ldd lists
// for the binary bin, and of its dynamic loader (ELF interpreter).
func sharedLibraries(ctx context.Context, bin string) ([]string, error) {
	out, err := exec.CommandContext(ctx, "ldd", bin).Output()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w", bin, err)
	}
	libs, err := parseLdd(out)
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w", bin, err)
	}
	interp, err := interpreter(bin)
	if err != nil {
		return nil, err
	}
	if interp != "" && !slices.Contains(libs, interp) {
		libs = append(libs, interp)
	}
	return libs, nil
}

// parseLdd returns the absolute paths in ldd's output: "name => /path (addr)" and
// "/path (addr)" lines. Virtual objects such as linux-vdso.so.1 have no path and are
// left out; a library that was not found is an error.
func parseLdd(out []byte) ([]string, error) {
	var libs []string
	for _, line := range strings.Split(string(out), "\n") {
		line = strings.TrimSpace(line)
		if strings.Contains(line, "not found") {
			return nil, fmt.Errorf("missing library: %s", line)
		}
		if _, after, ok := strings.Cut(line, "=>"); ok {
			line = strings.TrimSpace(after)
		}
		p, _, _ := strings.Cut(line, " ")
		if !path.IsAbs(p) {
			continue
		}
		p = path.Clean(p)
		if !slices.Contains(libs, p) {
			libs = append(libs, p)
		}
	}
	return libs, nil
}

// interpreter returns the ELF interpreter that bin names, or "" for a static binary.
func interpreter(bin string) (string, error) {
	f, err := elf.Open(bin)
	if err != nil {
		return "", err
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type != elf.PT_INTERP {
			continue
		}
		b := make([]byte, p.Filesz)
		if _, err := p.ReadAt(b, 0); err != nil {
			return "", fmt.Errorf("%s: interpreter: %w", bin, err)
		}
		return path.Clean(string(bytes.TrimRight(b, "\x00"))), nil
	}
	return "", nil
}

// newImage returns an image of the single layer t, with the config cfg, for Linux on
// the host's architecture. It has no creation time, so it depends on its inputs only.
func newImage(t *tree, cfg v1.Config) (v1.Image, error) {
	layer, err := t.layer()
	if err != nil {
		return nil, err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return nil, err
	}
	if img, err = mutate.Config(img, cfg); err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf.OS = "linux"
	cf.Architecture = runtime.GOARCH
	return mutate.ConfigFile(img, cf)
}
