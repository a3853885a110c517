package lua_test

import (
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"testing"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/test/redistest"
)

func TestScriptsAreDistinctAndHashed(t *testing.T) {
	seen := map[string]string{}
	for _, s := range lua.AllScripts() {
		sum := sha1.Sum([]byte(s.Source()))
		if got := hex.EncodeToString(sum[:]); got != s.SHA() {
			t.Errorf("script %s: SHA %s, want the SHA1 of its source %s", s.Name(), s.SHA(), got)
		}
		if s.Source() == "" || s.Name() == "" {
			t.Errorf("script %q has no source or name", s.Name())
		}
		if prev, ok := seen[s.SHA()]; ok {
			t.Errorf("scripts %s and %s share a SHA", prev, s.Name())
		}
		seen[s.SHA()] = s.Name()
	}
	if len(seen) < 8 {
		t.Fatalf("%d scripts, want at least the 8 of an activity's life", len(seen))
	}
}

func TestIsNoScript(t *testing.T) {
	if lua.IsNoScript(nil) || lua.IsNoScript(errors.New("ERR something")) {
		t.Fatal("IsNoScript is true for an unrelated error")
	}
	if !lua.IsNoScript(errors.New("NOSCRIPT No matching script. Please use EVAL.")) {
		t.Fatal("IsNoScript is false for a NOSCRIPT error")
	}
}

func TestLoadAllStandalone(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	if err := c.FunctionFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	assertCached(t, c, false)
	if err := lua.LoadAll(ctx, c); err != nil {
		t.Fatalf("LoadAll: %v", err)
	}
	assertCached(t, c, true)
	if ok, err := lua.GrabLibrary.LoadedOn(ctx, c); err != nil || !ok {
		t.Fatalf("function library %s loaded: %v, %v", lua.GrabLibrary.Name(), ok, err)
	}
}

// assertCached checks whether every script run with EVALSHA (those not in the
// function library) is in the server's script cache.
func assertCached(t testing.TB, c redis.Scripter, want bool) {
	t.Helper()
	var (
		shas    []string
		scripts []*lua.Script
	)
	for _, s := range lua.AllScripts() {
		if s.Function() == "" {
			shas = append(shas, s.SHA())
			scripts = append(scripts, s)
		}
	}
	got, err := c.ScriptExists(t.Context(), shas...).Result()
	if err != nil {
		t.Fatalf("SCRIPT EXISTS: %v", err)
	}
	for i, ok := range got {
		if ok != want {
			t.Fatalf("script %s cached = %v, want %v", scripts[i].Name(), ok, want)
		}
	}
}
