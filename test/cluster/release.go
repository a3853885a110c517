package cluster

import (
	"archive/tar"
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Release is a released version of the project and the commit it was cut from.
type Release struct {
	Version string
	Commit  string
}

// PreviousRelease reads hack/release/previous of the tree at root: the release an
// upgrade to this tree starts from.
func PreviousRelease(root string) (Release, error) {
	p := filepath.Join(root, "hack", "release", "previous")
	f, err := os.Open(p)
	if err != nil {
		return Release{}, fmt.Errorf("reading the previous release: %w", err)
	}
	defer f.Close()
	var r Release
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		key, value, _ := strings.Cut(line, " ")
		switch key {
		case "version":
			r.Version = strings.TrimSpace(value)
		case "commit":
			r.Commit = strings.TrimSpace(value)
		default:
			return Release{}, fmt.Errorf("%s: unknown line %q", p, line)
		}
	}
	if err := sc.Err(); err != nil {
		return Release{}, fmt.Errorf("reading %s: %w", p, err)
	}
	if r.Version == "" || len(r.Commit) != 40 {
		return Release{}, fmt.Errorf("%s names no version and full commit: %+v", p, r)
	}
	return r, nil
}

// CheckOut writes the files of the release's commit, as git archive gives them, into
// dir, which becomes a source tree of that version (without .git). The commit must be
// in the repository at root: a shallow clone that lacks it fails with a message that
// says how to fetch it.
func (r Release) CheckOut(ctx context.Context, root, dir string) error {
	if err := exec.CommandContext(ctx, "git", "-C", root, "cat-file", "-e", r.Commit+"^{commit}").Run(); err != nil {
		return fmt.Errorf("release %s: commit %s is not in the repository at %s (a shallow clone? git fetch --unshallow): %w",
			r.Version, r.Commit, root, err)
	}
	cmd := exec.CommandContext(ctx, "git", "-C", root, "archive", "--format=tar", r.Commit)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("git archive %s: %w", r.Commit, err)
	}
	extractErr := untar(out, dir)
	if extractErr != nil {
		_, _ = io.Copy(io.Discard, out)
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("git archive %s: %w: %s", r.Commit, err, stderr.String())
	}
	if extractErr != nil {
		return fmt.Errorf("release %s: %w", r.Version, extractErr)
	}
	return nil
}

// untar writes the regular files, directories and symbolic links of a tar stream
// under dir, refusing any name that would leave it.
func untar(r io.Reader, dir string) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("reading the archive: %w", err)
		}
		name := filepath.Clean(h.Name)
		if filepath.IsAbs(name) || name == ".." || strings.HasPrefix(name, ".."+string(filepath.Separator)) {
			return fmt.Errorf("archive entry %q leaves the directory", h.Name)
		}
		p := filepath.Join(dir, name)
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return err
			}
			f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, os.FileMode(h.Mode)&0o777)
			if err != nil {
				return err
			}
			_, err = io.Copy(f, tr)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("writing %s: %w", p, err)
			}
		case tar.TypeSymlink:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return err
			}
			if err := os.Symlink(h.Linkname, p); err != nil {
				return err
			}
		}
	}
}
