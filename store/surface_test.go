package store_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// storePath is the import path of the store.
const storePath = "redpacket.io/operator/store"

// handleConstructors are the store's exported functions that code outside it may
// call: the constructors of the activity's, the budget's and the function library's
// handles. Everything else outside reaches
// Redis through the handle's methods (and the types and constants in their
// signatures), never through a function of the store that takes a client.
var handleConstructors = []string{"NewActivity", "NewBudget", "NewLibrary"}

// No code outside the store calls an exported package-level function of the store
// other than the handle's constructor: every file of the module outside store/, test
// files included, is parsed and each selector store.X is checked.
func TestOnlyTheHandleIsUsedOutsideTheStore(t *testing.T) {
	root := moduleRoot(t)
	forbidden := exportedFuncs(t, filepath.Join(root, "store"))
	for _, name := range handleConstructors {
		if !forbidden[name] {
			t.Fatalf("the handle's constructor %s is not an exported function of the store", name)
		}
		delete(forbidden, name)
	}
	var offences []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			name := d.Name()
			if path != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "node_modules" ||
				path == filepath.Join(root, "store") || path == filepath.Join(root, "bin")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		found, err := storeFuncCalls(rel, src, forbidden)
		if err != nil {
			return err
		}
		offences = append(offences, found...)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(offences) > 0 {
		t.Errorf("code outside the store uses store functions other than the handle's constructor %v; "+
			"go through store.NewActivity and its methods:\n%s", handleConstructors, strings.Join(offences, "\n"))
	}
}

// The check finds a store function used outside, under any import name, and leaves
// alone the handle's constructor, the store's types and constants, and a local
// variable that happens to be called store.
func TestSurfaceCheckFindsOffences(t *testing.T) {
	src := `package p

import (
	"context"

	st "redpacket.io/operator/store"
)

type fake struct{}

func (fake) Grab() {}

func f(ctx context.Context) {
	a := st.NewActivity(nil, "uid", 1)
	_, _ = st.Grab(ctx, nil, st.Keys{}, "u")
	_ = st.KindGrant
	store := fake{}
	store.Grab()
	_ = a
}
`
	got, err := storeFuncCalls("p/p.go", []byte(src), map[string]bool{"Grab": true})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"p/p.go:15: store.Grab"}; !slices.Equal(got, want) {
		t.Fatalf("offences %q, want %q", got, want)
	}
}

// moduleRoot is the directory of go.mod, above the test's working directory.
func moduleRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod above the test's directory")
		}
		dir = parent
	}
}

// exportedFuncs lists the exported package-level functions (no receiver) of the
// non-test files in dir.
func exportedFuncs(t *testing.T, dir string) map[string]bool {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	fset := token.NewFileSet()
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range f.Decls {
			if fn, ok := decl.(*ast.FuncDecl); ok && fn.Recv == nil && fn.Name.IsExported() {
				out[fn.Name.Name] = true
			}
		}
	}
	if len(out) == 0 {
		t.Fatalf("no exported function found in %s", dir)
	}
	return out
}

// storeFuncCalls returns "<file>:<line>: store.<name>" for each selector of a name in
// forbidden on the store's package in the file src. A selector on a local variable
// or parameter of the same name as the import is not the package (the parser
// resolves it to its declaration).
func storeFuncCalls(file string, src []byte, forbidden map[string]bool) ([]string, error) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, file, src, 0)
	if err != nil {
		return nil, err
	}
	local := ""
	for _, imp := range f.Imports {
		if path, _ := strconv.Unquote(imp.Path.Value); path == storePath {
			local = "store"
			if imp.Name != nil {
				local = imp.Name.Name
			}
		}
	}
	if local == "" || local == "_" {
		return nil, nil
	}
	var out []string
	ast.Inspect(f, func(n ast.Node) bool {
		sel, ok := n.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		if x, ok := sel.X.(*ast.Ident); ok && x.Name == local && x.Obj == nil && forbidden[sel.Sel.Name] {
			out = append(out, file+":"+strconv.Itoa(fset.Position(sel.Pos()).Line)+": store."+sel.Sel.Name)
		}
		return true
	})
	return out, nil
}
