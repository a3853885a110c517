package cluster

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"redpacket.io/operator/test/controlplane"
)

// Image is an image tarball and the reference it is tagged with.
type Image struct {
	File string
	Tag  string
}

// BuildImages builds the project's images (hack/image: "operator", "pause",
// "redis") with the given version into dir and returns them by name.
func BuildImages(ctx context.Context, dir, version string, names ...string) (map[string]Image, error) {
	root, err := controlplane.Root()
	if err != nil {
		return nil, err
	}
	return BuildImagesFrom(ctx, root, dir, version, names...)
}

// BuildImagesFrom builds images as BuildImages does, with the hack/image of the
// source tree at root: another version of the project, such as the previous release.
func BuildImagesFrom(ctx context.Context, root, dir, version string, names ...string) (map[string]Image, error) {
	args := []string{"run", "./hack/image", "--out", dir, "--version", version}
	if len(names) > 0 {
		args = append(args, "--images", strings.Join(names, ","))
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("go run ./hack/image: %v\n%s", err, out)
	}
	return ReadImageList(dir)
}

// ReadImageList reads the images.txt that hack/image writes beside the tarballs
// (file, tab, tag per line), keyed by the image's short name: "operator" for
// redpacket-operator, else the repository name without "redpacket-".
func ReadImageList(dir string) (map[string]Image, error) {
	f, err := os.Open(filepath.Join(dir, "images.txt"))
	if err != nil {
		return nil, fmt.Errorf("reading the image list: %w", err)
	}
	defer f.Close()
	images := map[string]Image{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		file, tag, ok := strings.Cut(strings.TrimSpace(sc.Text()), "\t")
		if !ok {
			continue
		}
		if !filepath.IsAbs(file) {
			if _, err := os.Stat(file); err != nil {
				file = filepath.Join(dir, filepath.Base(file))
			}
		}
		repo, _, _ := strings.Cut(tag, ":")
		name := strings.TrimPrefix(repo[strings.LastIndexByte(repo, '/')+1:], "redpacket-")
		images[name] = Image{File: file, Tag: tag}
	}
	return images, sc.Err()
}
