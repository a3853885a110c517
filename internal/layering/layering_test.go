package layering

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const (
	module     = "redpacket.io/operator"
	luaPath    = module + "/lua"
	splitPath  = module + "/lua/split"
	settlePath = module + "/settlement"
	goRedis    = "github.com/redis/go-redis/v9"
)

// guarded are the packages the layering holds for, and the imports each may not
// have besides package lua (lua/split is allowed to all).
var guarded = map[string][]string{
	module + "/controllers": nil,
	module + "/grabsvc":     {settlePath},
}

// clientMethods are the methods of go-redis values the guarded packages may call:
// they manage a client and send no command.
var clientMethods = []string{"Close", "Options"}

// listed is what go list says of one package.
type listed struct {
	ImportPath string
	Dir        string
	GoFiles    []string
	Imports    []string
	Export     string
}

// list runs go list -deps -export -json on pkgs: every package they build on, with
// its export data.
func list(t *testing.T, pkgs ...string) map[string]listed {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list", "-deps", "-export", "-json"}, pkgs...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.String())
	}
	all := map[string]listed{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p listed
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decoding go list: %v", err)
		}
		all[p.ImportPath] = p
	}
	return all
}

// importerOf imports packages from the export data go list reported.
func importerOf(fset *token.FileSet, all map[string]listed) types.Importer {
	return importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		p, ok := all[path]
		if !ok || p.Export == "" {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(p.Export)
	})
}

// redisCalls type-checks files (one package, path) and returns, as "file:line: what",
// every call of a go-redis function or of a method of a go-redis type that sends a
// command: every method but clientMethods.
func redisCalls(fset *token.FileSet, imp types.Importer, path string, files []*ast.File) ([]string, error) {
	info := &types.Info{Selections: map[*ast.SelectorExpr]*types.Selection{}, Uses: map[*ast.Ident]types.Object{}}
	if _, err := (&types.Config{Importer: imp}).Check(path, fset, files, info); err != nil {
		return nil, fmt.Errorf("type-checking %s: %w", path, err)
	}
	var out []string
	add := func(pos token.Pos, what string) {
		p := fset.Position(pos)
		out = append(out, fmt.Sprintf("%s:%d: %s", filepath.Base(p.Filename), p.Line, what))
	}
	for sel, s := range info.Selections {
		f, ok := s.Obj().(*types.Func)
		if !ok || f.Pkg() == nil || f.Pkg().Path() != goRedis || slices.Contains(clientMethods, f.Name()) {
			continue
		}
		add(sel.Sel.Pos(), fmt.Sprintf("%s.%s (a Redis command)", types.TypeString(s.Recv(), (*types.Package).Name), f.Name()))
	}
	for id, obj := range info.Uses {
		f, ok := obj.(*types.Func)
		if !ok || f.Pkg() == nil || f.Pkg().Path() != goRedis || f.Type().(*types.Signature).Recv() != nil {
			continue
		}
		add(id.Pos(), "redis."+f.Name())
	}
	slices.Sort(out)
	return out, nil
}

// importOffences are the imports of p that its layer forbids.
func importOffences(p listed, forbidden []string) []string {
	var out []string
	for _, imp := range p.Imports {
		if imp == luaPath || strings.HasPrefix(imp, luaPath+"/") && imp != splitPath || slices.Contains(forbidden, imp) {
			out = append(out, p.ImportPath+" imports "+imp)
		}
	}
	return out
}

// The reconcilers and the grab service reach Redis only through the store: their
// non-test files import no Lua but the split (the scripts, the library and its
// loading are the store's), the grab service does not import settlement, and no
// non-test file calls a go-redis function or a method of a go-redis value that
// sends a command (they may hold clients, as redis.Cmdable or
// redis.UniversalClient, and close them).
func TestControllersAndGrabServiceReachRedisThroughTheStore(t *testing.T) {
	paths := make([]string, 0, len(guarded))
	for p := range guarded {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	all := list(t, paths...)
	fset := token.NewFileSet()
	imp := importerOf(fset, all)
	var offences []string
	for _, path := range paths {
		p, ok := all[path]
		if !ok {
			t.Fatalf("go list does not know %s", path)
		}
		offences = append(offences, importOffences(p, guarded[path])...)
		var files []*ast.File
		for _, name := range p.GoFiles {
			f, err := parser.ParseFile(fset, filepath.Join(p.Dir, name), nil, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			files = append(files, f)
		}
		calls, err := redisCalls(fset, imp, path, files)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range calls {
			offences = append(offences, path+": "+c)
		}
	}
	if len(offences) > 0 {
		t.Errorf("the controllers and the grab service must reach Redis through the store's handles:\n%s",
			strings.Join(offences, "\n"))
	}
}

// The checks find what they look for: a command sent on a client, a go-redis
// constructor, an import of the scripts and of settlement; and they leave alone a
// client held and closed, and the split.
func TestLayeringChecksFindOffences(t *testing.T) {
	all := list(t, goRedis)
	fset := token.NewFileSet()
	src := `package p

import (
	"context"

	"github.com/redis/go-redis/v9"
)

type holder struct{ c redis.UniversalClient }

func (h holder) stop() error { return h.c.Close() }

func f(ctx context.Context, c redis.Cmdable) {
	_ = c.Ping(ctx)
	_ = redis.NewClient(&redis.Options{})
}
`
	file, err := parser.ParseFile(fset, "p.go", src, 0)
	if err != nil {
		t.Fatal(err)
	}
	got, err := redisCalls(fset, importerOf(fset, all), "p", []*ast.File{file})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"p.go:14: redis.Cmdable.Ping (a Redis command)", "p.go:15: redis.NewClient"}
	if !slices.Equal(got, want) {
		t.Errorf("redis calls %q, want %q", got, want)
	}
	p := listed{ImportPath: "x", Imports: []string{luaPath, splitPath, settlePath, module + "/store"}}
	if got, want := importOffences(p, []string{settlePath}), []string{"x imports " + luaPath, "x imports " + settlePath}; !slices.Equal(got, want) {
		t.Errorf("import offences %q, want %q", got, want)
	}
}
