package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
)

// goCommand is the go tool the images' binaries are built with.
const goCommand = "go"

// moduleRoot returns the directory of the main module that dir belongs to.
func moduleRoot(ctx context.Context, dir string) (string, error) {
	cmd := exec.CommandContext(ctx, goCommand, "env", "GOMOD")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("%s is not inside a Go module", dir)
	}
	return filepath.Dir(gomod), nil
}

// versionVariable is the variable that holds a binary's version (internal/version).
const versionVariable = "redpacket.io/operator/internal/version.version"

// goBuild builds the main package pkg of the module at root into the file out as a
// static Linux binary for the host's architecture: CGO_ENABLED=0, -trimpath, no
// symbol table or DWARF (-ldflags="-s -w"), and version stamped in for --version.
// The same sources and version give the same bytes.
func goBuild(ctx context.Context, root, pkg, out, version string) error {
	cmd := exec.CommandContext(ctx, goCommand, "build", "-trimpath",
		"-ldflags=-s -w -X "+versionVariable+"="+version, "-o", out, pkg)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+runtime.GOARCH)
	var stderr bytes.Buffer
	cmd.Stdout = &stderr
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build %s: %w\n%s", pkg, err, stderr.Bytes())
	}
	return nil
}

// gitVersion returns `git describe --tags --always --dirty` of the work tree at dir,
// or "dev" when git cannot tell.
func gitVersion(ctx context.Context, dir string) string {
	cmd := exec.CommandContext(ctx, "git", "describe", "--tags", "--always", "--dirty")
	cmd.Dir = dir
	out, err := cmd.Output()
	if v := strings.TrimSpace(string(out)); err == nil && v != "" {
		return v
	}
	return "dev"
}
