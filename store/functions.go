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
		a.restores = true
	}
	s.base.restores = true
	return s
}

// call runs a grab-side script as its library function (FCALL); a handle that
// restores functions loads a missing library and calls once more.
func (a *Shard) call(ctx context.Context, s *lua.Script, keys []string, args ...any) *redis.Cmd {
	cmd := s.Call(ctx, a.c, keys, args...)
	if !a.restores || !lua.IsFunctionMissing(cmd.Err()) {
		return cmd
	}
	if err := a.restoreLibrary(ctx); err != nil {
		failed := redis.NewCmd(ctx)
		failed.SetErr(fmt.Errorf("%w (restoring it: %w)", cmd.Err(), err))
		return failed
	}
	return s.Call(ctx, a.c, keys, args...)
}

// restoreLibrary loads the grab-side library on every master of the handle's client,
// or, on a pipeliner, on the server it reaches.
func (a *Shard) restoreLibrary(ctx context.Context) error {
	if u, ok := a.c.(redis.UniversalClient); ok {
		_, err := lua.GrabLibrary.Ensure(ctx, u)
		return err
	}
	_, err := lua.GrabLibrary.Load(ctx, a.c)
	return err
}
