package main

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"io/fs"
	"path"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// layerMtime is the modification time of every entry of every layer. It is fixed so
// that the same inputs always give the same layer digest.
var layerMtime = time.Unix(0, 0).UTC()

// A tree is the content of one image layer: regular files and directories at
// absolute paths, each with its mode and numeric owner.
type tree struct {
	entries map[string]treeEntry // by path without the leading slash
}

type treeEntry struct {
	dir      bool
	data     []byte
	mode     fs.FileMode // permission bits only
	uid, gid int
}

func newTree() *tree {
	return &tree{entries: map[string]treeEntry{}}
}

// addFile adds a regular file at the absolute path p, owned by root. Missing parent
// directories are added when the layer is written.
func (t *tree) addFile(p string, data []byte, mode fs.FileMode) error {
	return t.add(p, treeEntry{data: data, mode: mode})
}

// addDir adds a directory at the absolute path p with the given mode and owner.
func (t *tree) addDir(p string, mode fs.FileMode, uid, gid int) error {
	return t.add(p, treeEntry{dir: true, mode: mode, uid: uid, gid: gid})
}

func (t *tree) add(p string, e treeEntry) error {
	if !path.IsAbs(p) || path.Clean(p) != p || p == "/" {
		return fmt.Errorf("layer path %q: want a clean absolute path below /", p)
	}
	if e.mode&^fs.ModePerm != 0 {
		return fmt.Errorf("layer path %q: mode %v has more than permission bits", p, e.mode)
	}
	key := strings.TrimPrefix(p, "/")
	if _, ok := t.entries[key]; ok {
		return fmt.Errorf("layer path %q added twice", p)
	}
	t.entries[key] = e
	return nil
}

// tar returns the tree as a tar stream: every parent directory as its own entry
// (mode 0755, root, unless added otherwise), entries sorted by path, names without
// a leading slash, directories with a trailing one, and the fixed layerMtime.
func (t *tree) tar() ([]byte, error) {
	all := make(map[string]treeEntry, len(t.entries))
	for key, e := range t.entries {
		all[key] = e
		for dir := path.Dir(key); dir != "."; dir = path.Dir(dir) {
			if d, ok := t.entries[dir]; !ok {
				all[dir] = treeEntry{dir: true, mode: 0o755}
			} else if !d.dir {
				return nil, fmt.Errorf("layer path /%s is a file and a parent directory", dir)
			}
		}
	}
	keys := make([]string, 0, len(all))
	for key := range all {
		keys = append(keys, key)
	}
	sort.Strings(keys)

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, key := range keys {
		e := all[key]
		hdr := &tar.Header{
			Name:    key,
			Mode:    int64(e.mode),
			Uid:     e.uid,
			Gid:     e.gid,
			ModTime: layerMtime,
		}
		if e.dir {
			hdr.Typeflag = tar.TypeDir
			hdr.Name += "/"
		} else {
			hdr.Typeflag = tar.TypeReg
			hdr.Size = int64(len(e.data))
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// layer returns the tree as a gzip-compressed image layer.
func (t *tree) layer() (v1.Layer, error) {
	b, err := t.tar()
	if err != nil {
		return nil, err
	}
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(b)), nil
	})
}
