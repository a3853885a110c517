package v1alpha1_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"

	v1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// reasonConstants returns every constant of the package (its non-test files) whose
// name starts with "Reason", with its value. Each must be a plain string literal, so
// that the value read here is the one the compiler sees.
func reasonConstants(t *testing.T) map[string]string {
	t.Helper()
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatalf("reading the package directory: %v", err)
	}
	fset := token.NewFileSet()
	out := map[string]string{}
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, e.Name(), nil, 0)
		if err != nil {
			t.Fatalf("parsing %s: %v", e.Name(), err)
		}
		for _, decl := range f.Decls {
			gen, ok := decl.(*ast.GenDecl)
			if !ok || gen.Tok != token.CONST {
				continue
			}
			for _, spec := range gen.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, name := range vs.Names {
					if !strings.HasPrefix(name.Name, "Reason") {
						continue
					}
					if i >= len(vs.Values) {
						t.Fatalf("%s: no value of its own", name.Name)
					}
					lit, ok := vs.Values[i].(*ast.BasicLit)
					if !ok || lit.Kind != token.STRING {
						t.Fatalf("%s at %s is not a string literal: a reason is its own string", name.Name, fset.Position(name.Pos()))
					}
					v, err := strconv.Unquote(lit.Value)
					if err != nil {
						t.Fatalf("%s: %v", name.Name, err)
					}
					out[name.Name] = v
				}
			}
		}
	}
	return out
}

// No two condition reasons share a string: a reason names one situation, whichever
// condition carries it, so scripts and people can rely on it.
func TestReasonsAreDistinct(t *testing.T) {
	reasons := reasonConstants(t)
	if len(reasons) < 20 {
		t.Fatalf("found %d reason constants, want the 20 the controller sets: %v", len(reasons), reasons)
	}
	byValue := map[string]string{}
	for name, v := range reasons {
		if v == "" {
			t.Errorf("%s is empty", name)
		}
		if other, ok := byValue[v]; ok {
			t.Errorf("%s and %s are both %q", name, other, v)
		}
		byValue[v] = name
	}
	// What was parsed is what the package compiles to.
	for name, compiled := range map[string]string{
		"ReasonPending":           v1alpha1.ReasonPending,
		"ReasonSettlementPending": v1alpha1.ReasonSettlementPending,
		"ReasonDataLost":          v1alpha1.ReasonDataLost,
	} {
		if reasons[name] != compiled {
			t.Errorf("parsed %s = %q, compiled %q", name, reasons[name], compiled)
		}
	}
}
