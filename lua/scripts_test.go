package lua_test

import (
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"testing"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
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
	ctx := testCtx(t)
	c := redistest.Start(t).Client(t)
	assertCached(t, c, false)
	if err := lua.LoadAll(ctx, c); err != nil {
		t.Fatalf("LoadAll: %v", err)
	}
	assertCached(t, c, true)
}

// assertCached checks whether every script is in the server's script cache.
func assertCached(t testing.TB, c redis.Scripter, want bool) {
	t.Helper()
	var shas []string
	for _, s := range lua.AllScripts() {
		shas = append(shas, s.SHA())
	}
	got, err := c.ScriptExists(t.Context(), shas...).Result()
	if err != nil {
		t.Fatalf("SCRIPT EXISTS: %v", err)
	}
	for i, ok := range got {
		if ok != want {
			t.Fatalf("script %s cached = %v, want %v", lua.AllScripts()[i].Name(), ok, want)
		}
	}
}

// SCRIPT FLUSH before every step of an activity's life: each call falls back to
// EVAL, on a plain client and through an auto-pipeliner where many callers'
// EVALSHAs fail with NOSCRIPT inside one pipeline.
func TestScriptFlushFallsBackToEval(t *testing.T) {
	for _, variant := range []string{"plain", "autopipeline"} {
		t.Run(variant, func(t *testing.T) {
			ctx := testCtx(t)
			c := redistest.Start(t).Client(t)
			var via redisClient = c
			if variant == "autopipeline" {
				ap, err := c.AutoPipelineWithOptions(lua.GrabPipelineOptions())
				if err != nil {
					t.Fatal(err)
				}
				via = ap
			}
			flush := func() {
				t.Helper()
				if err := c.ScriptFlush(ctx).Err(); err != nil {
					t.Fatalf("SCRIPT FLUSH: %v", err)
				}
				assertCached(t, c, false)
			}
			if err := lua.LoadAll(ctx, c); err != nil {
				t.Fatal(err)
			}
			amounts := splitOrFail(t, split.TypeRandom, 10_000, 100)
			k := lua.KeysFor("flush-" + variant)

			flush()
			res, err := lua.Seeder{ChunkSize: 30}.Seed(ctx, via, k, amounts,
				lua.SeedParams{Count: 100, Total: 10_000, Sponsor: sponsor})
			if err != nil || !res.Committed {
				t.Fatalf("seed after flush: %+v, %v", res, err)
			}
			flush()
			if state, err := lua.Configure(ctx, via, k, 0, 0, false, true); err != nil || state.State != lua.StateOpen {
				t.Fatalf("configure after flush: %q, %v", state.State, err)
			}
			flush()
			first, err := lua.Grab(ctx, via, k, "first")
			if err != nil || first.Outcome != lua.Granted {
				t.Fatalf("grab after flush: %+v, %v", first, err)
			}
			// The fallback EVAL put the grab script back into the cache.
			if ok, err := c.ScriptExists(ctx, lua.GrabScript.SHA()).Result(); err != nil || !ok[0] {
				t.Fatalf("grab script not cached after the EVAL fallback: %v %v", ok, err)
			}

			// Many concurrent grabs right after a flush.
			flush()
			answers := grabConcurrently(t, ctx, via, k, userIDs("w", 150), 50)
			counts, grants := tally(t, answers)
			if counts[lua.Granted] != 99 || counts[lua.SoldOut] != 51 {
				t.Fatalf("outcomes %v, want 99 granted and 51 sold_out", counts)
			}
			grants["first"] = first

			flush()
			again, err := lua.Grab(ctx, via, k, "first")
			if err != nil || again.Outcome != lua.AlreadyClaimed || again.PacketID != first.PacketID {
				t.Fatalf("repeat grab after flush: %+v, %v", again, err)
			}
			flush()
			verify(t, ctx, via, k, amounts, grants)
			flush()
			if cr, err := lua.Close(ctx, via, k, lua.CloseExhausted); err != nil || string(cr.Outcome) != "closed" {
				t.Fatalf("close after flush: %+v, %v", cr, err)
			}
			flush()
			if err := c.XGroupCreate(ctx, k.Stream, "g", "0").Err(); err != nil {
				t.Fatal(err)
			}
			entries, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c", Streams: []string{k.Stream, ">"}, Count: 1}).Result()
			if err != nil || len(entries[0].Messages) != 1 {
				t.Fatalf("reading the stream: %v %v", entries, err)
			}
			msg := entries[0].Messages[0]
			amount := lua.DecodeMessages([]redis.XMessage{msg})[0].Amount
			if ok, err := lua.Ack(ctx, via, k, "g", msg.ID, lua.KindGrant, amount); err != nil || !ok {
				t.Fatalf("ack after flush: %v, %v", ok, err)
			}
			flush()
			if ok, err := lua.DeadLetter(ctx, via, k, "g", msg.ID, "boom", nil); err != nil || ok {
				t.Fatalf("dead-letter of an acked entry after flush: %v, %v", ok, err)
			}
		})
	}
}

// A script error that is not NOSCRIPT is reported, not retried as EVAL.
func TestScriptErrorsAreReported(t *testing.T) {
	ctx := testCtx(t)
	c := redistest.Start(t).Client(t)
	k := lua.KeysFor("wrong-type")
	// The meta key holds a string: HGET on it is a WRONGTYPE error inside the script.
	if err := c.Set(ctx, k.Meta, "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	_, err := lua.Grab(ctx, c, k, "u")
	if err == nil || lua.IsNoScript(err) {
		t.Fatalf("grab on a wrong-typed key: %v, want a script error", err)
	}
	if _, err := lua.ReadSnapshot(ctx, c, k); err == nil {
		t.Fatal("snapshot on a wrong-typed key: no error")
	}
}
