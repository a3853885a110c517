package store

import (
	"context"
	"errors"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
)

// Library is the handle of the grab-side function library (lua.GrabLibrary) on one
// Redis, a plain or cluster client: the operator loads it through this handle (the
// "load scripts" steps and the manager's function keeper), so FUNCTION LOAD is
// issued by the store alone. Grab pods never load it (their Redis users may only
// FCALL it).
type Library struct {
	c redis.UniversalClient
}

// NewLibrary returns the handle of the function library on the Redis of c.
func NewLibrary(c redis.UniversalClient) *Library { return &Library{c: c} }

// Name is the library's name, which is the hash of its code.
func (l *Library) Name() string { return lua.GrabLibrary.Name() }

// LibraryName is the name of the function library this binary calls and loads,
// rpa_<hash8>: the grab pods of the operator's own image call this one.
var LibraryName = lua.GrabLibrary.Name()

// Ensure loads the library on every master that lacks it (replicas get it by
// replication) and returns on how many servers it loaded it.
func (l *Library) Ensure(ctx context.Context) (int, error) { return ensureLibrary(ctx, l.c) }

// Others lists the grab libraries of other releases loaded on any master
// (rpa_<hash8> names but this one's).
func (l *Library) Others(ctx context.Context) ([]string, error) {
	return lua.GrabLibrary.Others(ctx, l.c)
}

// Delete deletes another release's library from every master; this one's is never
// deleted. A grab pod that still calls it gets "Function not found" (503).
func (l *Library) Delete(ctx context.Context, name string) error {
	return lua.GrabLibrary.Delete(ctx, l.c, name)
}

// GrabScriptSHA is the SHA1 digest of the grab script's source, which an
// activity's status records (status.scriptSHA) as the version of the grab its Redis
// runs. It never changes while the binary runs.
var GrabScriptSHA = lua.GrabScript.SHA()

// ErrFunctionMissing is wrapped by the error of every call of a library function
// that found the library missing on the server ("Function not found"): it was never
// loaded there, or lost (FUNCTION FLUSH, a restart without persistence, a failover
// to a node that never had it). Nothing ran; the operator's function keeper loads
// it again. The error's text is the server's, unchanged.
var ErrFunctionMissing = errors.New("the function library is not loaded")

// functionMissing marks a server's "Function not found" as ErrFunctionMissing and
// keeps its text and its chain (a redis.Error stays reachable by errors.As).
type functionMissing struct{ err error }

func (e functionMissing) Error() string        { return e.err.Error() }
func (e functionMissing) Unwrap() error        { return e.err }
func (e functionMissing) Is(target error) bool { return target == ErrFunctionMissing }

// functionErr is err, marked as ErrFunctionMissing when it says the library is
// missing.
func functionErr(err error) error {
	if err == nil || errors.Is(err, ErrFunctionMissing) || !lua.IsFunctionMissing(err) {
		return err
	}
	return functionMissing{err: err}
}
