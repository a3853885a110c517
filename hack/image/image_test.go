package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/test/pgtest"
)

// newBuilder returns a builder of the module this test runs in, with its own scratch
// directory and the given version.
func newBuilder(t *testing.T, version string) *builder {
	t.Helper()
	root, err := moduleRoot(context.Background(), ".")
	if err != nil {
		t.Fatal(err)
	}
	return &builder{root: root, work: t.TempDir(), version: version, caCerts: hostCACerts, redisServer: hostRedisServer,
		traefikBin: filepath.Join(root, "bin", "traefik")}
}

var (
	operatorOnce    sync.Once
	operatorTarball string
	operatorErr     error
	operatorDir     string
)

// builtOperator builds the operator image with the real binaries once per test run
// and returns the path of its tarball.
func builtOperator(t *testing.T) string {
	t.Helper()
	operatorOnce.Do(func() {
		operatorDir, operatorErr = os.MkdirTemp("", "image-test-")
		if operatorErr != nil {
			return
		}
		root, err := moduleRoot(context.Background(), ".")
		if err != nil {
			operatorErr = err
			return
		}
		b := &builder{root: root, work: operatorDir, version: "test", caCerts: hostCACerts}
		im, err := b.operator(context.Background())
		if err != nil {
			operatorErr = err
			return
		}
		operatorTarball = filepath.Join(operatorDir, im.file)
		_, operatorErr = writeImage(operatorTarball, im)
	})
	if operatorErr != nil {
		t.Fatal(operatorErr)
	}
	return operatorTarball
}

func TestMain(m *testing.M) {
	code := m.Run()
	if operatorDir != "" {
		os.RemoveAll(operatorDir)
	}
	os.Exit(code)
}

// content is what an image tarball holds, read back as a consumer would.
type content struct {
	digest  v1.Hash
	config  v1.Config
	os      string
	arch    string
	tags    []string
	entries map[string]*tar.Header // by absolute path, across all layers
	data    map[string][]byte      // regular files' content, by absolute path
	order   []string               // entry paths in layer order
}

// readTarball reads the single image of the docker-archive tarball at p.
func readTarball(t *testing.T, p string) content {
	t.Helper()
	img, err := tarball.ImageFromPath(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(p) })
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 1 {
		t.Fatalf("%s holds %d images, want 1", p, len(m))
	}
	c := content{tags: m[0].RepoTags, entries: map[string]*tar.Header{}, data: map[string][]byte{}}
	if c.digest, err = img.Digest(); err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	c.config, c.os, c.arch = cf.Config, cf.OS, cf.Architecture
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		for {
			hdr, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			p := path.Clean("/" + hdr.Name)
			c.entries[p] = hdr
			c.order = append(c.order, p)
			if hdr.Typeflag == tar.TypeReg {
				if c.data[p], err = io.ReadAll(tr); err != nil {
					t.Fatal(err)
				}
			}
		}
		rc.Close()
	}
	return c
}

// checkTree checks what every image of this package promises about its layer: each
// parent directory is an entry of its own that comes before its children, every
// entry has the fixed modification time, and files are owned by root.
func checkTree(t *testing.T, c content) {
	t.Helper()
	seen := map[string]bool{"/": true}
	for _, p := range c.order {
		hdr := c.entries[p]
		if !seen[path.Dir(p)] {
			t.Errorf("%s comes before its directory %s", p, path.Dir(p))
		}
		if d, ok := c.entries[path.Dir(p)]; ok && d.Typeflag != tar.TypeDir {
			t.Errorf("%s: parent is not a directory", p)
		}
		seen[p] = true
		if !hdr.ModTime.Equal(layerMtime) {
			t.Errorf("%s: mtime %v, want %v", p, hdr.ModTime, layerMtime)
		}
		if hdr.Typeflag == tar.TypeReg && (hdr.Uid != 0 || hdr.Gid != 0) {
			t.Errorf("%s: owner %d:%d, want 0:0", p, hdr.Uid, hdr.Gid)
		}
		if hdr.Typeflag != tar.TypeReg && hdr.Typeflag != tar.TypeDir {
			t.Errorf("%s: type %q, want a regular file or directory", p, hdr.Typeflag)
		}
	}
}

// checkStatic fails unless data is an ELF executable with no interpreter and no
// dynamic section.
func checkStatic(t *testing.T, name string, data []byte) {
	t.Helper()
	f, err := elf.NewFile(bytes.NewReader(data))
	if err != nil {
		t.Errorf("%s: %v", name, err)
		return
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
			t.Errorf("%s is dynamically linked (has %v)", name, p.Type)
		}
	}
}

func TestOperatorImage(t *testing.T) {
	c := readTarball(t, builtOperator(t))
	checkTree(t, c)
	if want := []string{"redpacket-operator:test"}; !reflect.DeepEqual(c.tags, want) {
		t.Errorf("tags %q, want %q", c.tags, want)
	}
	if c.os != "linux" || c.arch == "" {
		t.Errorf("platform %s/%s, want linux/<arch>", c.os, c.arch)
	}
	for _, bin := range []string{"/manager", "/grabsvc"} {
		checkStatic(t, bin, c.data[bin])
	}
	ca, err := os.ReadFile(hostCACerts)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(c.data["/etc/ssl/certs/ca-certificates.crt"], ca) {
		t.Errorf("/etc/ssl/certs/ca-certificates.crt differs from the host's %s", hostCACerts)
	}
}

// TestReproducible builds the operator and pause images a second time, binaries
// included, and wants the same tarballs and digests.
func TestReproducible(t *testing.T) {
	first := builtOperator(t)
	b := newBuilder(t, "test")
	ctx := context.Background()
	op, err := b.operator(ctx)
	if err != nil {
		t.Fatal(err)
	}
	second := filepath.Join(t.TempDir(), op.file)
	if _, err := writeImage(second, op); err != nil {
		t.Fatal(err)
	}
	if d1, d2 := readTarball(t, first).digest, readTarball(t, second).digest; d1 != d2 {
		t.Errorf("operator image digests differ: %s and %s", d1, d2)
	}
	if h1, h2 := fileSum(t, first), fileSum(t, second); h1 != h2 {
		t.Errorf("operator tarballs differ")
	}

	var digests []v1.Hash
	for range 2 {
		pb := newBuilder(t, "test")
		im, err := pb.pause(ctx)
		if err != nil {
			t.Fatal(err)
		}
		d, err := im.img.Digest()
		if err != nil {
			t.Fatal(err)
		}
		digests = append(digests, d)
	}
	if digests[0] != digests[1] {
		t.Errorf("pause image digests differ: %s and %s", digests[0], digests[1])
	}
}

func fileSum(t *testing.T, p string) [sha256.Size]byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

func TestPauseImage(t *testing.T) {
	b := newBuilder(t, "v1.2.3")
	im, err := b.pause(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), im.file)
	if _, err := writeImage(p, im); err != nil {
		t.Fatal(err)
	}
	c := readTarball(t, p)
	checkTree(t, c)
	if want := []string{"redpacket-pause:v1.2.3"}; !reflect.DeepEqual(c.tags, want) {
		t.Errorf("tags %q, want %q", c.tags, want)
	}
	if got := sortedKeys(c.entries); !reflect.DeepEqual(got, []string{"/pause"}) {
		t.Errorf("entries %q, want only /pause", got)
	}
	if m := c.entries["/pause"].Mode; m != 0o755 {
		t.Errorf("/pause mode %o, want 755", m)
	}
	checkStatic(t, "/pause", c.data["/pause"])
	if !reflect.DeepEqual(c.config.Entrypoint, []string{"/pause"}) || c.config.User != "65535:65535" {
		t.Errorf("entrypoint %q user %q, want [/pause] 65535:65535", c.config.Entrypoint, c.config.User)
	}
}

// TestRedisImage builds the Redis image from the host's redis-server, unpacks it and
// runs it chrooted as its user, with the default user off and an admin user as
// config/dev-redis runs it: the binary must find its loader and libraries in the
// image alone, refuse a PING without AUTH and answer the admin user's.
func TestRedisImage(t *testing.T) {
	if _, err := os.Stat(hostRedisServer); err != nil {
		skipOutsideCI(t, "no "+hostRedisServer+" on this host (make redis installs it)")
	}
	b := newBuilder(t, "test")
	ctx := context.Background()
	im, err := b.redis(ctx)
	if err != nil {
		t.Fatal(err)
	}
	version, err := redisVersion(ctx, hostRedisServer)
	if err != nil {
		t.Fatal(err)
	}
	if want := "redpacket-redis:" + version; im.tag.String() != want {
		t.Errorf("tag %s, want %s", im.tag, want)
	}
	p := filepath.Join(t.TempDir(), im.file)
	if _, err := writeImage(p, im); err != nil {
		t.Fatal(err)
	}
	c := readTarball(t, p)
	for _, p := range c.order {
		if hdr := c.entries[p]; hdr.Typeflag == tar.TypeDir && p != "/data" && (hdr.Uid != 0 || hdr.Mode != 0o755) {
			t.Errorf("%s: owner %d mode %o, want 0 and 755", p, hdr.Uid, hdr.Mode)
		}
	}
	checkTree(t, c)
	if d := c.entries["/data"]; d == nil || d.Typeflag != tar.TypeDir || d.Uid != redisUID || d.Gid != redisUID || d.Mode != 0o755 {
		t.Errorf("/data: %+v, want a directory owned by %d, mode 755", d, redisUID)
	}
	cfg := c.config
	if !reflect.DeepEqual(cfg.Entrypoint, []string{hostRedisServer}) || cfg.User != "65532:65532" ||
		cfg.WorkingDir != "/data" || !reflect.DeepEqual(sortedKeys(cfg.ExposedPorts), []string{"6379/tcp"}) {
		t.Errorf("config %+v, want entrypoint %s, user 65532:65532, workdir /data, port 6379/tcp", cfg, hostRedisServer)
	}
	if !strings.Contains(string(c.data["/etc/passwd"]), "redis:x:65532:65532:") {
		t.Errorf("/etc/passwd has no redis user 65532:\n%s", c.data["/etc/passwd"])
	}

	if os.Geteuid() != 0 {
		skipOutsideCI(t, "running the image chrooted needs root")
	}
	rootfs := filepath.Join(t.TempDir(), "rootfs")
	unpack(t, c, rootfs)
	addr := freeLoopbackAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	const user, password = "redpacket-operator", "image-test-password"
	cmd := exec.Command(cfg.Entrypoint[0], "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--user", "default", "off", "~*", "&*", "+@all", "--user", user, "on", ">"+password, "~*", "&*", "+@all")
	cmd.Dir = cfg.WorkingDir
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: rootfs, Credential: &syscall.Credential{Uid: redisUID, Gid: redisUID}}
	proc := startChrooted(t, cmd, "redis-server in the image")
	proc.waitReady(t, 10*time.Second, func() (bool, string) {
		reply, err := ping(addr, user, password)
		return err == nil && reply == "+OK\r\n+PONG\r\n", fmt.Sprintf("no PONG (%q, %v)", reply, err)
	})
	if anon, err := ping(addr, "", ""); err != nil || !strings.HasPrefix(anon, "-NOAUTH") {
		t.Errorf("PING without AUTH: %q (%v), want NOAUTH", anon, err)
	}
}

// TestBalanceImage builds the reference balance system's image, checks its layout,
// then unpacks it and runs /balance chrooted as its user against a real PostgreSQL
// (test/pgtest), configured from the environment alone, as a Deployment would
// configure it: it must migrate the schema and answer /healthz.
func TestBalanceImage(t *testing.T) {
	b := newBuilder(t, "v1.2.3")
	im, err := b.balance(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), im.file)
	if _, err := writeImage(p, im); err != nil {
		t.Fatal(err)
	}
	if im.file != "redpacket-balance-v1.2.3.tar" {
		t.Errorf("file %s, want redpacket-balance-v1.2.3.tar", im.file)
	}
	c := readTarball(t, p)
	checkTree(t, c)
	if want := []string{"redpacket-balance:v1.2.3"}; !reflect.DeepEqual(c.tags, want) {
		t.Errorf("tags %q, want %q", c.tags, want)
	}
	if got, want := sortedKeys(c.entries), []string{"/balance", "/etc", "/etc/ssl", "/etc/ssl/certs", "/etc/ssl/certs/ca-certificates.crt"}; !reflect.DeepEqual(got, want) {
		t.Errorf("entries %q, want %q", got, want)
	}
	if m := c.entries["/balance"].Mode; m != 0o755 {
		t.Errorf("/balance mode %o, want 755", m)
	}
	checkStatic(t, "/balance", c.data["/balance"])
	cfg := c.config
	if !reflect.DeepEqual(cfg.Entrypoint, []string{"/balance"}) || cfg.User != "65532:65532" ||
		!reflect.DeepEqual(sortedKeys(cfg.ExposedPorts), []string{"8080/tcp"}) {
		t.Errorf("config %+v, want entrypoint /balance, user 65532:65532, port 8080/tcp", cfg)
	}

	if os.Geteuid() != 0 {
		skipOutsideCI(t, "running the image chrooted needs root")
	}
	if testing.Short() {
		t.Skip("running the image needs PostgreSQL; run without -short")
	}
	if _, err := pgtest.Bin(); err != nil {
		skipOutsideCI(t, err.Error())
	}
	db := pgtest.Start(t)
	dsn, err := db.NewDatabase(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	rootfs := filepath.Join(t.TempDir(), "rootfs")
	unpack(t, c, rootfs)
	addr := freeLoopbackAddr(t)
	cmd := exec.Command(cfg.Entrypoint[0], "--listen", addr)
	cmd.Dir = "/"
	cmd.Env = append(slices.Clone(cfg.Env), "DATABASE_URL="+dsn, "BALANCE_PUBLIC_KEYS="+webhooksig.FormatPublicKey(pub))
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: rootfs, Credential: &syscall.Credential{Uid: 65532, Gid: 65532}}
	proc := startChrooted(t, cmd, "/balance in the image")
	proc.waitReady(t, 30*time.Second, func() (bool, string) {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err != nil {
			return false, fmt.Sprintf("no 200 from /healthz (%v)", err)
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, fmt.Sprintf("/healthz answered %d", resp.StatusCode)
	})
	logs := proc.output()
	if !strings.Contains(logs, "schema up to date") || !strings.Contains(logs, `version="balance v1.2.3 `) {
		t.Errorf("the balance system's log shows no migration or not its version v1.2.3:\n%s", logs)
	}
}

// TestTraefikImage builds the Gateway's image from bin/traefik, checks its layout and
// its tag (the version pinned in hack/tools/traefik), then unpacks it and runs
// /traefik chrooted as its user with an entry point and its ping endpoint, as the
// real-node Gateway runs it: /ping must answer OK.
func TestTraefikImage(t *testing.T) {
	if testing.Short() {
		t.Skip("needs bin/traefik (make traefik); run without -short")
	}
	b := newBuilder(t, "v1.2.3")
	if _, err := os.Stat(b.traefikBin); err != nil {
		skipOutsideCI(t, err.Error()+": run make traefik")
	}
	im, err := b.traefik()
	if err != nil {
		t.Fatal(err)
	}
	pinned, err := traefikVersion(filepath.Join(b.root, "hack", "tools", "traefik", "go.mod"))
	if err != nil || !strings.HasPrefix(pinned, "v3.") {
		t.Fatalf("pinned Traefik version %q (%v), want v3.x", pinned, err)
	}
	p := filepath.Join(t.TempDir(), im.file)
	if _, err := writeImage(p, im); err != nil {
		t.Fatal(err)
	}
	c := readTarball(t, p)
	checkTree(t, c)
	if want := []string{"redpacket-traefik:" + pinned}; !reflect.DeepEqual(c.tags, want) {
		t.Errorf("tags %q, want %q", c.tags, want)
	}
	if got, want := sortedKeys(c.entries), []string{"/etc", "/etc/ssl", "/etc/ssl/certs", "/etc/ssl/certs/ca-certificates.crt", "/traefik"}; !reflect.DeepEqual(got, want) {
		t.Errorf("entries %q, want %q", got, want)
	}
	checkStatic(t, "/traefik", c.data["/traefik"])
	cfg := c.config
	if !reflect.DeepEqual(cfg.Entrypoint, []string{"/traefik"}) || cfg.User != "65532:65532" ||
		!reflect.DeepEqual(sortedKeys(cfg.ExposedPorts), []string{"8000/tcp", "8443/tcp"}) {
		t.Errorf("config %+v, want entrypoint /traefik, user 65532:65532, ports 8000/tcp and 8443/tcp", cfg)
	}

	if os.Geteuid() != 0 {
		skipOutsideCI(t, "running the image chrooted needs root")
	}
	rootfs := filepath.Join(t.TempDir(), "rootfs")
	unpack(t, c, rootfs)
	addr := freeLoopbackAddr(t)
	cmd := exec.Command(cfg.Entrypoint[0], "--global.checkNewVersion=false", "--global.sendAnonymousUsage=false",
		"--entryPoints.web.address="+addr, "--ping=true", "--ping.entryPoint=web")
	cmd.Dir = "/"
	cmd.Env = slices.Clone(cfg.Env)
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: rootfs, Credential: &syscall.Credential{Uid: 65532, Gid: 65532}}
	proc := startChrooted(t, cmd, "/traefik in the image")
	proc.waitReady(t, 30*time.Second, func() (bool, string) {
		resp, err := http.Get("http://" + addr + "/ping")
		if err != nil {
			return false, fmt.Sprintf("no answer from /ping (%v)", err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK && strings.TrimSpace(string(body)) == "OK",
			fmt.Sprintf("/ping answered %d %q", resp.StatusCode, body)
	})
}

// chrooted is a program of an unpacked image running in its root, killed and reaped
// when the test ends.
type chrooted struct {
	what string
	mu   sync.Mutex
	logs bytes.Buffer
	done chan error
}

// Write keeps the program's output.
func (c *chrooted) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.logs.Write(p)
}

func (c *chrooted) output() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.logs.String()
}

// startChrooted starts cmd (what names it in failures), its output kept.
func startChrooted(t *testing.T, cmd *exec.Cmd, what string) *chrooted {
	t.Helper()
	c := &chrooted{what: what, done: make(chan error, 1)}
	cmd.Stdout, cmd.Stderr = c, c
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { c.done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-c.done
	})
	return c
}

// waitReady polls ready every 50 ms until it holds; it fails the test when the
// program exits first or within passes, with ready's last word and the output.
func (c *chrooted) waitReady(t *testing.T, within time.Duration, ready func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, why := ready()
		if ok {
			return
		}
		select {
		case err := <-c.done:
			c.done <- err
			t.Fatalf("%s exited: %v\n%s", c.what, err, c.output())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s after %s\n%s", c.what, why, within, c.output())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// freeLoopbackAddr is a loopback host:port nothing listens on, for a program the
// test starts.
func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// skipOutsideCI skips the test, saying why; in CI (CI=true) it fails instead, since
// nothing may skip there.
func skipOutsideCI(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatal("CI must run this test: " + why)
	}
	t.Skip(why)
}

// ping sends PING, after AUTH user password when user is set, and returns the
// server's replies, one line each.
func ping(addr, user, password string) (string, error) {
	conn, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(time.Second))
	cmds, replies := "PING\r\n", 1
	if user != "" {
		cmds, replies = "AUTH "+user+" "+password+"\r\n"+cmds, 2
	}
	if _, err := conn.Write([]byte(cmds)); err != nil {
		return "", err
	}
	r := bufio.NewReader(conn)
	var out strings.Builder
	for range replies {
		line, err := r.ReadString('\n')
		out.WriteString(line)
		if err != nil {
			return out.String(), err
		}
	}
	return out.String(), nil
}

// unpack writes the image content c into the directory dir, with modes and owners.
func unpack(t *testing.T, c content, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range c.order {
		hdr := c.entries[p]
		dst := filepath.Join(dir, p)
		var err error
		switch hdr.Typeflag {
		case tar.TypeDir:
			err = os.Mkdir(dst, 0o700)
		case tar.TypeReg:
			err = os.WriteFile(dst, c.data[p], 0o600)
		}
		if err == nil {
			err = os.Chown(dst, hdr.Uid, hdr.Gid)
		}
		if err == nil {
			err = os.Chmod(dst, os.FileMode(hdr.Mode).Perm())
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func TestParseLdd(t *testing.T) {
	out := `	linux-vdso.so.1 (0x00007ffd1a9f2000)
	libjemalloc.so.2 => /lib/x86_64-linux-gnu/libjemalloc.so.2 (0x00007f8225600000)
	libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f82252a5000)
	/lib64/ld-linux-x86-64.so.2 (0x00007f8225d0c000)
	libm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x00007f8225920000)
	libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f82252a5000)
`
	got, err := parseLdd([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"/lib/x86_64-linux-gnu/libjemalloc.so.2",
		"/lib/x86_64-linux-gnu/libc.so.6",
		"/lib64/ld-linux-x86-64.so.2",
		"/lib/x86_64-linux-gnu/libm.so.6",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("parseLdd = %q, want %q", got, want)
	}
	if _, err := parseLdd([]byte("\tlibfoo.so.1 => not found\n")); err == nil {
		t.Error("parseLdd accepted a missing library")
	}
	if got, err := parseLdd([]byte("\tnot a dynamic executable\n")); err != nil || len(got) != 0 {
		t.Errorf("parseLdd of a static binary = %q, %v; want nothing", got, err)
	}
}

func TestParseImages(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{"operator,pause,redis,balance,traefik", allImages},
		{"traefik,pause", []string{"pause", "traefik"}},
		{"balance,operator", []string{"operator", "balance"}},
		{"redis, operator,redis", []string{"operator", "redis"}},
		{"pause", []string{"pause"}},
		{"", nil},
		{",", nil},
		{"operator,busybox", nil},
	} {
		got, err := parseImages(tc.in)
		if tc.want == nil {
			if err == nil {
				t.Errorf("parseImages(%q) = %q, want an error", tc.in, got)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("parseImages(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}

// TestRun runs the command as `make image` does, for the pause image alone, and
// checks its output, the tarball and images.txt.
func TestRun(t *testing.T) {
	out := t.TempDir()
	var stdout bytes.Buffer
	if err := run(context.Background(), []string{"--out", out, "--version", "v9.9.9", "--images", "pause"}, &stdout); err != nil {
		t.Fatal(err)
	}
	tarPath := filepath.Join(out, "pause.tar")
	st, err := os.Stat(tarPath)
	if err != nil {
		t.Fatal(err)
	}
	wantOut := "wrote " + tarPath + " (tag redpacket-pause:v9.9.9, " + itoa(st.Size()) + " bytes)\n" +
		"wrote " + filepath.Join(out, "images.txt") + "\n"
	if stdout.String() != wantOut {
		t.Errorf("stdout:\n%s\nwant:\n%s", stdout.String(), wantOut)
	}
	index, err := os.ReadFile(filepath.Join(out, "images.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if string(index) != "pause.tar\tredpacket-pause:v9.9.9\n" {
		t.Errorf("images.txt = %q", index)
	}
	if err := run(context.Background(), []string{"--out", out, "--version", "bad/tag"}, io.Discard); err == nil {
		t.Error("run accepted an invalid --version")
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

func mustTag(t *testing.T, s string) name.Tag {
	t.Helper()
	tag, err := name.NewTag(s)
	if err != nil {
		t.Fatal(err)
	}
	return tag
}

func TestTree(t *testing.T) {
	tr := newTree()
	if err := tr.addFile("/a/b", []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := tr.addFile("/a/b", []byte("y"), 0o644); err == nil {
		t.Error("a path was added twice")
	}
	for _, p := range []string{"a", "/", "/a/../b", "/a/"} {
		if err := tr.addFile(p, nil, 0o644); err == nil {
			t.Errorf("path %q was accepted", p)
		}
	}
	if err := tr.addFile("/c", nil, 0o4755); err == nil {
		t.Error("a setuid mode was accepted")
	}
	if err := tr.addFile("/a/b/c", nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := tr.tar(); err == nil {
		t.Error("a file under a file was written")
	}
}
