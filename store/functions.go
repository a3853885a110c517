package store

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// The grab-side scripts (lua.GrabSideScripts) run as the functions of one library,
// lua.GrabLibrary, with FCALL: an activity's own Redis user may call them and may not
// load, replace or delete them, nor run any Lua of its own (acl.go). The operator
// loads the library (Activity.LoadScripts, on every master) and keeps it loaded (the
// manager's function keeper). A call that finds it missing ("Function not found")
// fails, and the grab service answers 503 unavailable: nothing ran, so nothing is
// half done. A handle of the operator's (RestoreFunctions) loads it and retries once.

// RestoreFunctions makes the handle load the grab-side function library on the
// activity's Redis when a call finds it missing, and retry that call once. Only the
// operator's handles do this: its Redis user may run FUNCTION LOAD, an activity's
// own user may not (its calls return the error until the operator restored the
// library). Call it before the handle is used; it returns the handle.
func (s *Activity) RestoreFunctions() *Activity {
	for _, a := range s.shards {
		a.restores, a.Stream.restores = true, true
	}
	s.base.restores, s.base.Stream.restores = true, true
	return s
}

// call runs a grab-side script as its library function on the shard's client
// (callFunction), restoring a missing library on the operator's handles.
func (a *Shard) call(ctx context.Context, s *lua.Script, keys []string, args ...any) *redis.Cmd {
	return callFunction(ctx, a.c, a.restores, s, keys, args...)
}

// call runs a library function (the replay of dead letters) on the stream's client
// (callFunction), restoring a missing library on the operator's handles.
func (s *Stream) call(ctx context.Context, f *lua.Script, keys []string, args ...any) *redis.Cmd {
	return callFunction(ctx, s.c, s.restores, f, keys, args...)
}

// callFunction runs a grab-side script as its library function (FCALL) on c. When
// restores is set (a handle of the operator's) and the call finds the library
// missing, it loads the library (ensureLibrary) and calls once more; otherwise, or
// when the load fails, the call's error stands, marked ErrFunctionMissing when the
// library was missing (functionErr). It is the one way the store calls a
// function of the library, for activities and budgets alike.
func callFunction(ctx context.Context, c redis.Cmdable, restores bool, s *lua.Script, keys []string, args ...any) *redis.Cmd {
	cmd := s.Call(ctx, c, keys, args...)
	if !restores || !lua.IsFunctionMissing(cmd.Err()) {
		cmd.SetErr(functionErr(cmd.Err()))
		return cmd
	}
	if _, err := ensureLibrary(ctx, c); err != nil {
		failed := redis.NewCmd(ctx)
		failed.SetErr(functionErr(fmt.Errorf("%w (restoring it: %w)", cmd.Err(), err)))
		return failed
	}
	cmd = s.Call(ctx, c, keys, args...)
	cmd.SetErr(functionErr(cmd.Err()))
	return cmd
}

// ensureLibrary loads the grab-side library where it is missing: on every master of
// a plain or cluster client, or, on a pipeliner, on the server it reaches. It returns
// on how many servers it loaded it.
func ensureLibrary(ctx context.Context, c redis.Cmdable) (int, error) {
	if u, ok := c.(redis.UniversalClient); ok {
		return lua.GrabLibrary.Ensure(ctx, u)
	}
	loaded, err := lua.GrabLibrary.Load(ctx, c)
	if loaded {
		return 1, err
	}
	return 0, err
}
