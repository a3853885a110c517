// Command image builds the project's container images as docker-archive tarballs,
// without Docker and without pulling a base image:
//
//	go run ./hack/image [--out dist] [--version V] [--images operator,pause,redis,balance,traefik]
//
// writes
//
//	DIR/redpacket-operator-V.tar  redpacket-operator:V   /manager and /grabsvc, static, as in the Dockerfile
//	DIR/pause.tar                 redpacket-pause:V      the pod sandbox image, from hack/pause
//	DIR/redis.tar                 redpacket-redis:R      the host's redis-server (version R) and its libraries
//	DIR/redpacket-balance-V.tar   redpacket-balance:V    /balance, static: the reference balance system, cmd/balance
//	DIR/traefik.tar               redpacket-traefik:T    /traefik, static: the Gateway (bin/traefik, make traefik; version T pinned in hack/tools/traefik)
//	DIR/images.txt                "file<TAB>tag" for every image this run wrote, file relative to DIR
//
// Every image is one layer with fixed timestamps and owners and no creation time, so
// the same inputs give the same image digest. Load a tarball with
// `ctr -n k8s.io images import FILE` on a containerd node or `docker load -i FILE`.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	out := fs.String("out", "dist", "directory to write the image tarballs and images.txt to")
	version := fs.String("version", "", "tag of the operator, pause and balance images (default: git describe --tags --always --dirty, or dev)")
	list := fs.String("images", strings.Join(allImages, ","), "comma-separated images to build, of "+strings.Join(allImages, ","))
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	kinds, err := parseImages(*list)
	if err != nil {
		return err
	}

	root, err := moduleRoot(ctx, ".")
	if err != nil {
		return err
	}
	if *version == "" {
		*version = gitVersion(ctx, root)
	}
	if _, err := name.NewTag("redpacket-operator:" + *version); err != nil {
		return fmt.Errorf("--version %q is not a valid image tag: %w", *version, err)
	}
	work, err := os.MkdirTemp("", "redpacket-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}

	b := &builder{root: root, work: work, version: *version, caCerts: hostCACerts, redisServer: hostRedisServer,
		traefikBin: filepath.Join(root, "bin", "traefik")}
	var index strings.Builder
	for _, kind := range kinds {
		im, err := b.build(ctx, kind)
		if err != nil {
			return fmt.Errorf("%s image: %w", kind, err)
		}
		p := filepath.Join(*out, im.file)
		size, err := writeImage(p, im)
		if err != nil {
			return fmt.Errorf("%s image: %w", kind, err)
		}
		fmt.Fprintf(stdout, "wrote %s (tag %s, %d bytes)\n", p, im.tag, size)
		fmt.Fprintf(&index, "%s\t%s\n", im.file, im.tag)
	}
	p := filepath.Join(*out, "images.txt")
	if err := writeFileAtomic(p, []byte(index.String())); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s\n", p)
	return nil
}

// parseImages returns the images named in the comma-separated list, each once, in
// the order of allImages.
func parseImages(list string) ([]string, error) {
	want := map[string]bool{}
	for _, s := range strings.Split(list, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if !slices.Contains(allImages, s) {
			return nil, fmt.Errorf("--images: unknown image %q (want some of %s)", s, strings.Join(allImages, ","))
		}
		want[s] = true
	}
	var kinds []string
	for _, s := range allImages {
		if want[s] {
			kinds = append(kinds, s)
		}
	}
	if len(kinds) == 0 {
		return nil, errors.New("--images: no image named")
	}
	return kinds, nil
}

// writeImage writes im as a docker-archive tarball tagged im.tag to the file p and
// returns the file's size. The tarball replaces p only once it is complete.
func writeImage(p string, im built) (int64, error) {
	f, err := os.CreateTemp(filepath.Dir(p), "."+filepath.Base(p)+".*")
	if err != nil {
		return 0, err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if err := f.Close(); err != nil {
		return 0, err
	}
	if err := tarball.WriteToFile(tmp, im.tag, im.img); err != nil {
		return 0, err
	}
	if err := os.Chmod(tmp, 0o644); err != nil {
		return 0, err
	}
	st, err := os.Stat(tmp)
	if err != nil {
		return 0, err
	}
	return st.Size(), os.Rename(tmp, p)
}

// writeFileAtomic writes data to the file p (mode 0644) through a temporary file that
// replaces p only once it is complete.
func writeFileAtomic(p string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(p), "."+filepath.Base(p)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), p)
}
