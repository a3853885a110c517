package lua_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/test/redistest"
)

// The grab-side scripts are one function library, named by a hash of its code, with
// one function per script, generated from the .lua files; the operator's scripts
// are not in it.
func TestGrabLibraryHoldsTheGrabSideScripts(t *testing.T) {
	lib := lua.GrabLibrary
	if !regexp.MustCompile(`^rpa_[0-9a-f]{8}$`).MatchString(lib.Name()) {
		t.Fatalf("library name %q, want rpa_<8 hex digits>", lib.Name())
	}
	if !strings.HasPrefix(lib.Code(), "#!lua name="+lib.Name()+"\n") {
		t.Fatalf("library code does not start with its shebang: %.60q", lib.Code())
	}
	for _, s := range lib.Scripts() {
		if s.Function() != lib.Name()+"_"+s.Name() {
			t.Errorf("script %s: function %q, want %s_%s", s.Name(), s.Function(), lib.Name(), s.Name())
		}
		// A shebang or a global would break once the text is a function's body.
		if strings.Contains(s.Source(), "#!") {
			t.Errorf("script %s holds a shebang", s.Name())
		}
		if !strings.Contains(lib.Code(), s.Source()) {
			t.Errorf("script %s's text is not in the library verbatim", s.Name())
		}
	}
	for _, s := range []*lua.Script{lua.SeedStageScript, lua.SeedCommitScript, lua.ConfigureScript, lua.CloseScript,
		lua.FenceScript, lua.AcceptScript, lua.RefundActivityScript} {
		if s.Function() != "" || slices.Contains(lib.Scripts(), s) {
			t.Errorf("the operator's script %s is in the grab-side library", s.Name())
		}
	}
	if want := 7 + len(lua.PacketSideScripts()); len(lib.Scripts()) != want {
		t.Errorf("%d scripts in the library, want the 7 grab-side ones and the packets' (%d)", len(lib.Scripts()), want)
	}
}

// FUNCTION LOAD accepts the generated library; LoadAll and Ensure load it once, and
// again after FUNCTION FLUSH; every function is listed under its name.
func TestGrabLibraryLoadsAndIsRestored(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	if err := c.FunctionFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if ok, err := lua.GrabLibrary.LoadedOn(ctx, c); err != nil || ok {
		t.Fatalf("library loaded on a fresh server: %v, %v", ok, err)
	}
	if err := lua.LoadAll(ctx, c); err != nil {
		t.Fatalf("LoadAll: %v", err)
	}
	libs, err := c.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: lua.GrabLibrary.Name()}).Result()
	if err != nil || len(libs) != 1 {
		t.Fatalf("FUNCTION LIST: %v, %v", libs, err)
	}
	var names []string
	for _, f := range libs[0].Functions {
		names = append(names, f.Name)
	}
	for _, s := range lua.GrabLibrary.Scripts() {
		if !slices.Contains(names, s.Function()) {
			t.Errorf("function %s not listed: %v", s.Function(), names)
		}
	}
	if n, err := lua.GrabLibrary.Ensure(ctx, c); err != nil || n != 0 {
		t.Fatalf("Ensure on a server that holds it: loaded %d, %v", n, err)
	}
	if err := c.FunctionFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := lua.StockScript.Call(ctx, c, []string{"rpa:{x}:meta", "rpa:{x}:packets", "rpa:{x}:xout"}).Err(); !lua.IsFunctionMissing(err) {
		t.Fatalf("FCALL after FUNCTION FLUSH: %v, want Function not found", err)
	}
	if n, err := lua.GrabLibrary.Ensure(ctx, c); err != nil || n != 1 {
		t.Fatalf("Ensure after FUNCTION FLUSH: loaded %d, %v", n, err)
	}
	v, err := lua.StockScript.Call(ctx, c, []string{"rpa:{x}:meta", "rpa:{x}:packets", "rpa:{x}:xout"}).Slice()
	if err != nil || len(v) != 5 {
		t.Fatalf("FCALL of stock after the restore: %v, %v", v, err)
	}
	if err := lua.ConfigureScript.Call(ctx, c, []string{"rpa:{x}:meta"}).Err(); err == nil {
		t.Fatal("Call of an operator's script: no error")
	}
}

// On a cluster the library is loaded on every master, and FCALL is routed by its
// first key.
func TestGrabLibraryOnCluster(t *testing.T) {
	ctx := redistest.Context(t)
	cl := redistest.StartCluster(t, 3)
	cc := cl.Client(t)
	if err := cc.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error {
		return n.FunctionFlush(ctx).Err()
	}); err != nil {
		t.Fatal(err)
	}
	if n, err := lua.GrabLibrary.Ensure(ctx, cc); err != nil || n != 3 {
		t.Fatalf("Ensure on 3 masters: loaded %d, %v", n, err)
	}
	for i := range 50 {
		tag := "rpa:{c" + strings.Repeat("x", i) + "}"
		if err := lua.StockScript.Call(ctx, cc, []string{tag + ":meta", tag + ":packets", tag + ":xout"}).Err(); err != nil {
			t.Fatalf("FCALL on %s: %v", tag, err)
		}
	}
}

// A missing function is recognised behind wrapping, as a client with safe error
// texts reports it.
func TestIsFunctionMissing(t *testing.T) {
	missing := errors.New("ERR Function not found")
	if !lua.IsFunctionMissing(missing) || !lua.IsFunctionMissing(fmt.Errorf("snapshot: %w", &opaque{missing})) ||
		!lua.IsFunctionMissing(errors.Join(errors.New("x"), &opaque{missing})) {
		t.Fatal("a wrapped Function not found is not recognised")
	}
	if lua.IsFunctionMissing(nil) || lua.IsFunctionMissing(errors.New("ERR something")) {
		t.Fatal("an unrelated error is taken for a missing function")
	}
}

// opaque hides the text of the error it wraps, as redisconn.SafeError does.
type opaque struct{ err error }

func (o *opaque) Error() string { return "ERR Redis answered with an error" }
func (o *opaque) Unwrap() error { return o.err }
