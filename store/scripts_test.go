package store_test

import (
	"testing"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/lua/split"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/redistest"
)

// SCRIPT FLUSH and FUNCTION FLUSH before every step of an activity's life, with the
// operator's handles (RestoreFunctions): the operator's scripts fall back to EVAL,
// and a grab-side function call that finds the library gone loads it and runs once
// more, on a plain client and through an auto-pipeliner where many callers' FCALLs
// fail inside one pipeline.
func TestScriptAndFunctionFlushBeforeEveryStep(t *testing.T) {
	for _, variant := range []string{"plain", "autopipeline"} {
		t.Run(variant, func(t *testing.T) {
			ctx := redistest.Context(t)
			c := redistest.Start(t).Client(t)
			via := clientOf(t, c, variant)
			flush := func() {
				t.Helper()
				if err := c.ScriptFlush(ctx).Err(); err != nil {
					t.Fatalf("SCRIPT FLUSH: %v", err)
				}
				if err := c.FunctionFlush(ctx).Err(); err != nil {
					t.Fatalf("FUNCTION FLUSH: %v", err)
				}
				if ok, err := c.ScriptExists(ctx, lua.ConfigureScript.SHA()).Result(); err != nil || ok[0] {
					t.Fatalf("the configure script is still cached after SCRIPT FLUSH: %v %v", ok, err)
				}
				if ok, err := lua.GrabLibrary.LoadedOn(ctx, c); err != nil || ok {
					t.Fatalf("the function library is still loaded after FUNCTION FLUSH: %v %v", ok, err)
				}
			}
			if err := lua.LoadAll(ctx, c); err != nil {
				t.Fatal(err)
			}
			amounts := splitOrFail(t, split.TypeRandom, 10_000, 100)
			k := keysOf("flush-" + variant)

			flush()
			res, err := seeding(via, k, store.Seeder{ChunkSize: 30}).Seed(ctx, amounts, store.SeedParams{Count: 100, Total: 10_000, Sponsor: sponsor})
			if err != nil || !res.Committed {
				t.Fatalf("seed after flush: %+v, %v", res, err)
			}
			flush()
			if state, err := handle(via, k).Configure(ctx, 0, 0, false, true); err != nil || state.State != store.StateOpen {
				t.Fatalf("configure after flush: %q, %v", state.State, err)
			}
			flush()
			first, err := shardOf(via, k).Grab(ctx, "first")
			if err != nil || first.Outcome != store.Granted {
				t.Fatalf("grab after flush: %+v, %v", first, err)
			}
			// The operator's handle loaded the library again.
			if ok, err := lua.GrabLibrary.LoadedOn(ctx, c); err != nil || !ok {
				t.Fatalf("function library not loaded again after the grab: %v %v", ok, err)
			}

			// Many concurrent grabs right after a flush.
			flush()
			answers := grabConcurrently(t, ctx, via, k, userIDs("w", 150), 50)
			counts, grants := tally(t, answers)
			if counts[store.Granted] != 99 || counts[store.SoldOut] != 51 {
				t.Fatalf("outcomes %v, want 99 granted and 51 sold_out", counts)
			}
			grants["first"] = first

			flush()
			again, err := shardOf(via, k).Grab(ctx, "first")
			if err != nil || again.Outcome != store.AlreadyClaimed || again.PacketID != first.PacketID {
				t.Fatalf("repeat grab after flush: %+v, %v", again, err)
			}
			flush()
			verify(t, ctx, via, k, amounts, grants)
			flush()
			if cr, err := handle(via, k).Close(ctx, store.CloseExhausted); err != nil || string(cr.Outcome) != "closed" {
				t.Fatalf("close after flush: %+v, %v", cr, err)
			}
			flush()
			if err := shardOf(c, k).EnsureGroup(ctx, "g"); err != nil {
				t.Fatal(err)
			}
			entries, err := shardOf(c, k).ReadNew(ctx, "g", "c", 1, 0)
			if err != nil || len(entries) != 1 {
				t.Fatalf("reading the stream: %v %v", entries, err)
			}
			msg := entries[0]
			if ok, err := shardOf(via, k).Ack(ctx, "g", msg.ID, store.KindGrant, msg.Amount); err != nil || !ok {
				t.Fatalf("ack after flush: %v, %v", ok, err)
			}
			flush()
			if ok, err := shardOf(via, k).DeadLetter(ctx, "g", msg.ID, "boom", nil); err != nil || ok {
				t.Fatalf("dead-letter of an acked entry after flush: %v, %v", ok, err)
			}
		})
	}
}

// A script error that is not NOSCRIPT or a missing function is reported, not
// retried.
func TestScriptErrorsAreReported(t *testing.T) {
	ctx := redistest.Context(t)
	c := redistest.Start(t).Client(t)
	k := keysOf("wrong-type")
	// The meta key holds a string: HGET on it is a WRONGTYPE error inside the script.
	if err := c.Set(ctx, k.Meta, "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	_, err := shardOf(c, k).Grab(ctx, "u")
	if err == nil || lua.IsNoScript(err) {
		t.Fatalf("grab on a wrong-typed key: %v, want a script error", err)
	}
	if _, err := handle(c, k).Snapshot(ctx); err == nil {
		t.Fatal("snapshot on a wrong-typed key: no error")
	}
}
