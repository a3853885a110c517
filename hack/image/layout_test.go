package main

import (
	"archive/tar"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// A layout is what an image puts where and how it runs it: what the Dockerfile and
// hack/image must agree on for the operator image.
type layout struct {
	files      map[string]fileMeta // regular files by absolute path
	user       string
	entrypoint []string
	cmd        []string
	ports      []string // sorted, such as "8080/tcp"
	workdir    string
	env        []string // KEY=value
}

// fileMeta is a file's permission bits and owner. A mode of -1 means the Dockerfile
// keeps the source file's mode.
type fileMeta struct {
	mode     int64
	uid, gid int
}

func (m fileMeta) String() string { return fmt.Sprintf("mode %o, owner %d:%d", m.mode, m.uid, m.gid) }

// parseDockerfile returns the layout that the final stage of a Dockerfile builds. It
// knows what a stage on an empty base can do (COPY, ADD, USER, ENTRYPOINT, CMD,
// EXPOSE, WORKDIR, ENV, LABEL, ARG) and refuses a final stage with anything else,
// such as RUN, which hack/image could not mirror.
func parseDockerfile(text string) (layout, error) {
	lines := dockerfileLines(text)
	last := -1
	for i, line := range lines {
		if instr, _, _ := strings.Cut(line, " "); strings.EqualFold(instr, "FROM") {
			last = i
		}
	}
	if last < 0 {
		return layout{}, fmt.Errorf("no FROM")
	}
	l := layout{files: map[string]fileMeta{}, workdir: "/"}
	for _, line := range lines[last+1:] {
		instr, rest, _ := strings.Cut(line, " ")
		rest = strings.TrimSpace(rest)
		switch strings.ToUpper(instr) {
		case "COPY", "ADD":
			if err := l.copy(rest); err != nil {
				return layout{}, fmt.Errorf("%s: %w", line, err)
			}
		case "USER":
			l.user = rest
		case "ENTRYPOINT":
			l.entrypoint = execForm(rest)
		case "CMD":
			l.cmd = execForm(rest)
		case "EXPOSE":
			for _, p := range strings.Fields(rest) {
				if !strings.Contains(p, "/") {
					p += "/tcp"
				}
				l.ports = append(l.ports, strings.ToLower(p))
			}
			slices.Sort(l.ports)
		case "WORKDIR":
			l.workdir = path.Join(l.workdir, rest)
		case "ENV":
			for _, kv := range strings.Fields(rest) {
				if !strings.Contains(kv, "=") {
					return layout{}, fmt.Errorf("%s: only ENV KEY=value is understood", line)
				}
				l.env = append(l.env, kv)
			}
		case "LABEL", "ARG":
		default:
			return layout{}, fmt.Errorf("%s: hack/image cannot mirror %s in the final stage", line, instr)
		}
	}
	return l, nil
}

// dockerfileLines returns the instructions of a Dockerfile, one per element, with
// continuation lines joined and comments and blank lines left out.
func dockerfileLines(text string) []string {
	var lines []string
	var cur strings.Builder
	for _, raw := range strings.Split(text, "\n") {
		line := strings.TrimSpace(raw)
		if strings.HasPrefix(line, "#") || (line == "" && cur.Len() == 0) {
			continue
		}
		if body, ok := strings.CutSuffix(line, `\`); ok {
			cur.WriteString(body + " ")
			continue
		}
		cur.WriteString(line)
		if s := strings.TrimSpace(cur.String()); s != "" {
			lines = append(lines, s)
		}
		cur.Reset()
	}
	if s := strings.TrimSpace(cur.String()); s != "" {
		lines = append(lines, s)
	}
	return lines
}

// execForm returns the argv of an ENTRYPOINT or CMD: its JSON array, or the shell
// form wrapped in /bin/sh -c as Docker does.
func execForm(s string) []string {
	var argv []string
	if json.Unmarshal([]byte(s), &argv) == nil {
		return argv
	}
	return []string{"/bin/sh", "-c", s}
}

// copy adds the files of one COPY or ADD: "[--flag=value...] src... dest".
func (l *layout) copy(args string) error {
	meta := fileMeta{mode: -1}
	var paths []string
	if strings.HasPrefix(args, "[") {
		if err := json.Unmarshal([]byte(args), &paths); err != nil {
			return err
		}
	} else {
		for _, f := range strings.Fields(args) {
			flag, value, _ := strings.Cut(f, "=")
			switch {
			case flag == "--chmod":
				mode, err := strconv.ParseInt(value, 8, 64)
				if err != nil {
					return fmt.Errorf("--chmod: %w", err)
				}
				meta.mode = mode
			case flag == "--chown":
				u, g, hasGroup := strings.Cut(value, ":")
				uid, err := strconv.Atoi(u)
				if err != nil {
					return fmt.Errorf("--chown %s: only numeric ids are understood", value)
				}
				gid := uid
				if hasGroup {
					if gid, err = strconv.Atoi(g); err != nil {
						return fmt.Errorf("--chown %s: only numeric ids are understood", value)
					}
				}
				meta.uid, meta.gid = uid, gid
			case strings.HasPrefix(f, "--"):
				// --from, --link: where the file comes from, not where it goes.
			default:
				paths = append(paths, f)
			}
		}
	}
	if len(paths) < 2 {
		return fmt.Errorf("want sources and a destination")
	}
	srcs, dest := paths[:len(paths)-1], paths[len(paths)-1]
	if !path.IsAbs(dest) {
		dest = path.Join(l.workdir, dest)
	}
	for _, src := range srcs {
		if strings.HasSuffix(src, "/") || strings.ContainsAny(src, "*?[") {
			return fmt.Errorf("source %s: only single files are understood", src)
		}
		p := path.Clean(dest)
		if len(srcs) > 1 || strings.HasSuffix(paths[len(paths)-1], "/") {
			p = path.Join(dest, path.Base(src))
		}
		l.files[p] = meta
	}
	return nil
}

// imageLayout returns the layout of the image content c. Besides its regular files
// c may only hold their parent directories.
func imageLayout(c content) (layout, []string) {
	var problems []string
	l := layout{
		files:      map[string]fileMeta{},
		user:       c.config.User,
		entrypoint: c.config.Entrypoint,
		cmd:        c.config.Cmd,
		ports:      sortedKeys(c.config.ExposedPorts),
		workdir:    c.config.WorkingDir,
		env:        c.config.Env,
	}
	if l.workdir == "" {
		l.workdir = "/"
	}
	parents := map[string]bool{}
	for p, hdr := range c.entries {
		if hdr.Typeflag == tar.TypeReg {
			l.files[p] = fileMeta{mode: hdr.Mode & 0o7777, uid: hdr.Uid, gid: hdr.Gid}
			for d := path.Dir(p); d != "/"; d = path.Dir(d) {
				parents[d] = true
			}
		}
	}
	for p, hdr := range c.entries {
		if hdr.Typeflag == tar.TypeDir && !parents[p] {
			problems = append(problems, fmt.Sprintf("image has directory %s, which the Dockerfile does not create", p))
		}
	}
	return l, problems
}

// diffLayout lists how the image layout got differs from the Dockerfile's, want.
func diffLayout(want, got layout) []string {
	var diffs []string
	for _, p := range sortedKeys(want.files) {
		w := want.files[p]
		g, ok := got.files[p]
		switch {
		case !ok:
			diffs = append(diffs, fmt.Sprintf("image lacks %s", p))
		case w.mode >= 0 && w.mode != g.mode, w.uid != g.uid, w.gid != g.gid:
			diffs = append(diffs, fmt.Sprintf("%s: image has %v, Dockerfile %v", p, g, w))
		}
	}
	for _, p := range sortedKeys(got.files) {
		if _, ok := want.files[p]; !ok {
			diffs = append(diffs, fmt.Sprintf("image has %s, which the Dockerfile does not copy", p))
		}
	}
	if got.user != want.user {
		diffs = append(diffs, fmt.Sprintf("user: image %q, Dockerfile %q", got.user, want.user))
	}
	if !slices.Equal(got.entrypoint, want.entrypoint) {
		diffs = append(diffs, fmt.Sprintf("entrypoint: image %q, Dockerfile %q", got.entrypoint, want.entrypoint))
	}
	if !slices.Equal(got.cmd, want.cmd) {
		diffs = append(diffs, fmt.Sprintf("cmd: image %q, Dockerfile %q", got.cmd, want.cmd))
	}
	if !slices.Equal(got.ports, want.ports) {
		diffs = append(diffs, fmt.Sprintf("exposed ports: image %q, Dockerfile %q", got.ports, want.ports))
	}
	if got.workdir != want.workdir {
		diffs = append(diffs, fmt.Sprintf("working directory: image %q, Dockerfile %q", got.workdir, want.workdir))
	}
	for _, kv := range want.env {
		if !slices.Contains(got.env, kv) {
			diffs = append(diffs, fmt.Sprintf("image env lacks %s", kv))
		}
	}
	return diffs
}

func readDockerfile(t *testing.T) string {
	t.Helper()
	root := newBuilder(t, "test").root
	b, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestDockerfileLayout builds the operator image as `make image` does and compares it
// with what the Dockerfile's final stage builds: the same files at the same paths
// with the same modes and owners, the same user, entrypoint and ports.
func TestDockerfileLayout(t *testing.T) {
	want, err := parseDockerfile(readDockerfile(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(want.files) == 0 || want.user == "" || len(want.entrypoint) == 0 {
		t.Fatalf("Dockerfile's final stage parsed to %+v: no files, user or entrypoint", want)
	}
	got, problems := imageLayout(readTarball(t, builtOperator(t)))
	for _, p := range append(problems, diffLayout(want, got)...) {
		t.Error(p)
	}
}

// TestDiffLayout checks that the comparison of TestDockerfileLayout fails when the
// Dockerfile and the image differ.
func TestDiffLayout(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"manager", "grabsvc"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("stand-in for "+name), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	img, err := operatorImage(filepath.Join(dir, "manager"), filepath.Join(dir, "grabsvc"), hostCACerts)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "operator.tar")
	if _, err := writeImage(p, built{file: "operator.tar", tag: mustTag(t, "redpacket-operator:test"), img: img}); err != nil {
		t.Fatal(err)
	}
	got, problems := imageLayout(readTarball(t, p))
	if len(problems) > 0 {
		t.Fatal(problems)
	}

	dockerfile := readDockerfile(t)
	if want, err := parseDockerfile(dockerfile); err != nil || len(diffLayout(want, got)) > 0 {
		t.Fatalf("the Dockerfile as it is: %v %q", err, diffLayout(want, got))
	}
	for _, tc := range []struct{ name, old, new string }{
		{"missing file", "COPY --from=build --chmod=0755 /out/grabsvc /grabsvc\n", ""},
		{"extra file", "USER ", "COPY --from=build /out/tool /tool\nUSER "},
		{"other path", " /out/grabsvc /grabsvc", " /out/grabsvc /bin/grabsvc"},
		{"other mode", "--chmod=0755 /out/manager", "--chmod=0700 /out/manager"},
		{"other owner", "--chmod=0755 /out/manager", "--chmod=0755 --chown=65532:65532 /out/manager"},
		{"other user", "USER 65532:65532", "USER 1000:1000"},
		{"other entrypoint", `ENTRYPOINT ["/manager"]`, `ENTRYPOINT ["/grabsvc"]`},
		{"other ports", "EXPOSE 8080 8081", "EXPOSE 8080"},
		{"a cmd", `ENTRYPOINT ["/manager"]`, `ENTRYPOINT ["/manager"]` + "\nCMD [\"--leader-elect\"]"},
		{"a workdir", "USER ", "WORKDIR /app\nUSER "},
		{"an env", "USER ", "ENV GODEBUG=x509ignoreCN=0\nUSER "},
	} {
		changed := strings.Replace(dockerfile, tc.old, tc.new, 1)
		if changed == dockerfile {
			t.Errorf("%s: %q is not in the Dockerfile; update this test", tc.name, tc.old)
			continue
		}
		want, err := parseDockerfile(changed)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if diffs := diffLayout(want, got); len(diffs) == 0 {
			t.Errorf("%s: no difference found", tc.name)
		} else {
			t.Logf("%s: %q", tc.name, diffs)
		}
	}
	if _, err := parseDockerfile(dockerfile + "RUN true\n"); err == nil {
		t.Error("a RUN in the final stage was accepted")
	}
}
