package v1alpha1_test

import (
	"context"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// kubectl runs bin/kubectl against the shared control plane.
type kubectl struct {
	bin, kubeconfig, cacheDir string
}

func newKubectl(t *testing.T) kubectl {
	t.Helper()
	needsControlPlane(t)
	dir := t.TempDir()
	k := kubectl{
		bin:        filepath.Join(cp.BinDir, "kubectl"),
		kubeconfig: filepath.Join(dir, "kubeconfig"),
		cacheDir:   filepath.Join(dir, "cache"),
	}
	if err := cp.Kubeconfig(k.kubeconfig); err != nil {
		t.Fatalf("writing a kubeconfig: %v", err)
	}
	// The API server publishes a new CRD's OpenAPI schema shortly after installing
	// it; wait until kubectl can explain the kind, each try with a fresh cache.
	ctx := testCtx(t)
	for attempt := 0; ; attempt++ {
		probe := k
		probe.cacheDir = filepath.Join(dir, fmt.Sprintf("probe-%d", attempt))
		out, err := probe.run(ctx, "explain", "rpa.spec.totalAmount")
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("kubectl never explained the CRD: %v\n%s", err, out)
		}
		time.Sleep(250 * time.Millisecond)
	}
	return k
}

func (k kubectl) run(ctx context.Context, args ...string) (string, error) {
	args = append([]string{"--kubeconfig", k.kubeconfig, "--cache-dir", k.cacheDir}, args...)
	out, err := exec.CommandContext(ctx, k.bin, args...).CombinedOutput()
	return string(out), err
}

// field is one API field: its dotted path under the kind and its Go doc comment.
type field struct {
	path string
	doc  string
}

// docComments parses the package's Go files and returns, per struct type and Go
// field name, the doc comment without its +markers.
func docComments(t *testing.T) map[string]map[string]string {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	docs := map[string]map[string]string{}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			t.Fatalf("parsing %s: %v", name, err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			ts, ok := n.(*ast.TypeSpec)
			if !ok {
				return true
			}
			st, ok := ts.Type.(*ast.StructType)
			if !ok {
				return true
			}
			fields := map[string]string{}
			for _, fl := range st.Fields.List {
				var lines []string
				if fl.Doc != nil {
					for _, l := range strings.Split(fl.Doc.Text(), "\n") {
						if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "+") {
							lines = append(lines, l)
						}
					}
				}
				for _, id := range fl.Names {
					fields[id.Name] = strings.Join(lines, " ")
				}
			}
			docs[ts.Name.Name] = fields
			return false
		})
	}
	return docs
}

var timeType = reflect.TypeFor[metav1.Time]()

// apiFields walks a Go type by its json tags and lists every field below prefix,
// with its doc comment. metav1.Time is a leaf (a string in the API).
func apiFields(t *testing.T, typ reflect.Type, prefix string, docs map[string]map[string]string) []field {
	t.Helper()
	var out []field
	for i := range typ.NumField() {
		sf := typ.Field(i)
		tag := sf.Tag.Get("json")
		name, _, _ := strings.Cut(tag, ",")
		if name == "" || name == "-" {
			t.Fatalf("%s.%s has no json name", typ.Name(), sf.Name)
		}
		path := prefix + "." + name
		out = append(out, field{path: path, doc: docs[typ.Name()][sf.Name]})
		ft := sf.Type
		for ft.Kind() == reflect.Pointer || ft.Kind() == reflect.Slice {
			ft = ft.Elem()
		}
		if ft.Kind() == reflect.Struct && ft != timeType {
			if ft.PkgPath() != typ.PkgPath() {
				continue // metav1.Condition and friends document themselves
			}
			out = append(out, apiFields(t, ft, path, docs)...)
		}
	}
	return out
}

var fieldLine = regexp.MustCompile(`^( *)([A-Za-z0-9]+)\t<`)

// recursiveFields parses `kubectl explain --recursive` output into dotted paths.
func recursiveFields(out, prefix string) []string {
	var paths, stack []string
	inFields := false
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "FIELDS:") {
			inFields = true
			continue
		}
		m := fieldLine.FindStringSubmatch(line)
		if !inFields || m == nil {
			continue
		}
		depth := len(m[1])/2 - 1
		stack = append(stack[:depth], m[2])
		paths = append(paths, prefix+"."+strings.Join(stack, "."))
	}
	return paths
}

// description returns the DESCRIPTION block of `kubectl explain`, with whitespace
// collapsed.
func description(out string) string {
	_, rest, ok := strings.Cut(out, "DESCRIPTION:")
	if !ok {
		return ""
	}
	rest, _, _ = strings.Cut(rest, "FIELDS:")
	return strings.Join(strings.Fields(rest), " ")
}

func TestExplainDocumentsEveryField(t *testing.T) {
	ctx := testCtx(t)
	k := newKubectl(t)
	docs := docComments(t)
	typ := reflect.TypeFor[v1alpha1.RedPacketActivity]()
	spec, _ := typ.FieldByName("Spec")
	status, _ := typ.FieldByName("Status")

	for _, part := range []struct {
		name string
		typ  reflect.Type
	}{{"spec", spec.Type}, {"status", status.Type}} {
		want := apiFields(t, part.typ, "rpa."+part.name, docs)
		if len(want) < 10 {
			t.Fatalf("only %d %s fields found by reflection", len(want), part.name)
		}

		// Every Go field is in the recursive explanation, and nothing else is.
		out, err := k.run(ctx, "explain", "redpacketactivities."+part.name, "--recursive")
		if err != nil {
			t.Fatalf("kubectl explain redpacketactivities.%s --recursive: %v\n%s", part.name, err, out)
		}
		got := recursiveFields(out, "rpa."+part.name)
		var wantPaths []string
		for _, f := range want {
			if !strings.HasPrefix(f.path, "rpa.status.conditions.") {
				wantPaths = append(wantPaths, f.path)
			}
		}
		var gotPaths []string
		for _, p := range got {
			if !strings.HasPrefix(p, "rpa.status.conditions.") {
				gotPaths = append(gotPaths, p)
			}
		}
		slices.Sort(wantPaths)
		slices.Sort(gotPaths)
		if !slices.Equal(wantPaths, gotPaths) {
			t.Errorf("%s fields differ between the Go types and kubectl explain:\n go: %v\n explain: %v",
				part.name, wantPaths, gotPaths)
		}

		// Every field explains itself with its doc comment.
		var wg sync.WaitGroup
		jobs := make(chan field)
		var mu sync.Mutex
		var problems []string
		report := func(s string) {
			mu.Lock()
			problems = append(problems, s)
			mu.Unlock()
		}
		for range 4 {
			wg.Go(func() {
				for f := range jobs {
					if f.doc == "" {
						report(f.path + ": the Go field has no doc comment")
						continue
					}
					out, err := k.run(ctx, "explain", f.path)
					if err != nil {
						report(f.path + ": kubectl explain failed: " + err.Error() + "\n" + out)
						continue
					}
					desc := description(out)
					if desc == "" {
						report(f.path + ": kubectl explain shows no description")
						continue
					}
					if !strings.Contains(desc, strings.Join(strings.Fields(f.doc), " ")) {
						report(fmt.Sprintf("%s: description %q does not carry the doc comment %q", f.path, desc, f.doc))
					}
				}
			})
		}
		for _, f := range want {
			jobs <- f
		}
		close(jobs)
		wg.Wait()
		slices.Sort(problems)
		for _, p := range problems {
			t.Error(p)
		}
	}

	// The short name and a nested object list the nested fields with their docs.
	out, err := k.run(ctx, "explain", "rpa.spec.distribution")
	if err != nil {
		t.Fatalf("kubectl explain rpa.spec.distribution: %v\n%s", err, out)
	}
	for _, s := range []string{"type", "minAmount", "maxAmount", "seed", "minAmount is the smallest packet", "enum: Random, LineCut, Fixed"} {
		if !strings.Contains(out, s) {
			t.Errorf("kubectl explain rpa.spec.distribution lacks %q:\n%s", s, out)
		}
	}
	out, err = k.run(ctx, "explain", "rpa")
	if err != nil || !strings.Contains(out, "KIND:       RedPacketActivity") || !strings.Contains(out, "red-packet activity") {
		t.Errorf("kubectl explain rpa: %v\n%s", err, out)
	}
}

func TestKubectlGetColumns(t *testing.T) {
	ctx := testCtx(t)
	k := newKubectl(t)
	ns := cp.Namespace(t)
	a := activity(ns, "columns")
	if err := cp.Client.Create(ctx, a); err != nil {
		t.Fatal(err)
	}
	out, err := k.run(ctx, "get", "rpa", "-n", ns)
	if err != nil {
		t.Fatalf("kubectl get rpa: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 {
		t.Fatalf("kubectl get rpa printed %d lines:\n%s", len(lines), out)
	}
	if got := strings.Fields(lines[0]); !slices.Equal(got, []string{"NAME", "TOTAL", "COUNT", "REMAINING", "CLAIMED", "PHASE", "AGE"}) {
		t.Errorf("columns %v", got)
	}
	if got := strings.Fields(lines[1]); len(got) < 4 || got[0] != "columns" || got[1] != "200000" || got[2] != "5000" {
		t.Errorf("row %v", got)
	}
	out, err = k.run(ctx, "get", "rpa", "-n", ns, "-o", "wide")
	if err != nil {
		t.Fatalf("kubectl get rpa -o wide: %v\n%s", err, out)
	}
	for _, col := range []string{"CLAIMED-AMOUNT", "SETTLED", "REFUNDED", "START", "END", "ENDPOINT"} {
		if !strings.Contains(strings.SplitN(out, "\n", 2)[0], col) {
			t.Errorf("-o wide lacks column %s:\n%s", col, out)
		}
	}
	out, err = k.run(ctx, "get", "redpacket", "-n", ns, "-o", "name")
	if err != nil || strings.TrimSpace(out) != "redpacketactivity.redpacket.io/columns" {
		t.Errorf("kubectl get of the redpacket category: %v\n%s", err, out)
	}
}
