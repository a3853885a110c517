package lua

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Library is a set of the embedded scripts loaded as one Redis 7 function library
// (FUNCTION LOAD) and run with FCALL. It is generated from the .lua files, which stay
// the one source: each script's text becomes the body of
//
//	local function <name>(KEYS, ARGV) ... end
//
// registered as the function <library>_<name>. The library's name carries the first
// eight hex digits of the SHA-256 of its code (rpa_<hash8>), so a version of the
// project with other scripts loads a library of another name beside this one: a grab
// pod of the previous version keeps finding its own functions during a rolling
// upgrade. Libraries are never replaced or deleted by the operator; an old one stays
// until someone runs FUNCTION DELETE rpa_<hash8> (operations.md, "Upgrading").
//
// Functions, unlike cached scripts, are loaded only by a user who may run FUNCTION
// LOAD: the operator. An activity's own Redis user may FCALL them and nothing else
// (no EVAL, no SCRIPT, no FUNCTION), so a tenant's credentials run only these
// scripts. A library lost by the server (FUNCTION FLUSH, a restart without
// persistence, a failover to a node that never had it) answers FCALL with "ERR
// Function not found" (IsFunctionMissing) until the operator loads it again; replicas
// get it from their master by replication.
type Library struct {
	name    string
	code    string
	scripts []*Script
}

// newLibrary builds the library of scripts and names each script's function in it.
func newLibrary(scripts ...*Script) *Library {
	body := func(prefix string) string {
		var b strings.Builder
		fmt.Fprintf(&b, "#!lua name=%s\n", prefix)
		for _, s := range scripts {
			fmt.Fprintf(&b, "\nlocal function %s(KEYS, ARGV)\n%s\nend\n", s.name, strings.TrimRight(s.src, "\n"))
			fmt.Fprintf(&b, "redis.register_function('%s_%s', %s)\n", prefix, s.name, s.name)
		}
		return b.String()
	}
	// The hash is of the code with a placeholder name, so that the name it yields can
	// be written into the code without changing it.
	sum := sha256.Sum256([]byte(body("rpa_XXXXXXXX")))
	name := "rpa_" + hex.EncodeToString(sum[:])[:8]
	l := &Library{name: name, code: body(name), scripts: scripts}
	for _, s := range scripts {
		s.function = name + "_" + s.name
	}
	return l
}

// Name is the library's name, rpa_<hash8>.
func (l *Library) Name() string { return l.name }

// Code is the library's Lua text, as FUNCTION LOAD receives it.
func (l *Library) Code() string { return l.code }

// Scripts are the scripts the library holds.
func (l *Library) Scripts() []*Script { return append([]*Script(nil), l.scripts...) }

// Load loads the library on one server unless it holds it already. It reports
// whether this call loaded it. A library of the same name holds the same code (the
// name is its hash), so "already exists" from a racing loader is success.
func (l *Library) Load(ctx context.Context, node redis.Cmdable) (bool, error) {
	has, err := l.LoadedOn(ctx, node)
	if err != nil {
		return false, err
	}
	if has {
		return false, nil
	}
	if err := node.FunctionLoad(ctx, l.code).Err(); err != nil {
		if strings.Contains(err.Error(), "already exists") {
			return false, nil
		}
		return false, fmt.Errorf("loading function library %s: %w", l.name, err)
	}
	return true, nil
}

// LoadedOn reports whether one server holds the library: FUNCTION LIST LIBRARYNAME,
// a reply of one short entry, cheap enough to ask every 100 ms.
func (l *Library) LoadedOn(ctx context.Context, node redis.Cmdable) (bool, error) {
	libs, err := node.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: l.name}).Result()
	if err != nil {
		return false, fmt.Errorf("listing function library %s: %w", l.name, err)
	}
	for _, lib := range libs {
		if lib.Name == l.name {
			return true, nil
		}
	}
	return false, nil
}

// forEachMaster runs fn on the one server of a plain client, or on every master of
// a cluster, with its address.
func forEachMaster(ctx context.Context, c redis.UniversalClient, fn func(ctx context.Context, node redis.Cmdable, addr string) error) error {
	switch cc := c.(type) {
	case *redis.ClusterClient:
		return cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
			return fn(ctx, node, node.Options().Addr)
		})
	case *redis.Client:
		return fn(ctx, cc, cc.Options().Addr)
	default:
		return fn(ctx, c, "Redis")
	}
}

// libraryNamePattern matches the names of this project's grab libraries, of any
// release: rpa_ and 8 hex digits.
var libraryNamePattern = regexp.MustCompile(`^rpa_[0-9a-f]{8}$`)

// Others lists the libraries of other releases loaded on any master: every library
// named rpa_<8 hex digits> but this one. A library of another name is never listed.
func (l *Library) Others(ctx context.Context, c redis.UniversalClient) ([]string, error) {
	var mu sync.Mutex
	seen := map[string]bool{}
	err := forEachMaster(ctx, c, func(ctx context.Context, node redis.Cmdable, addr string) error {
		libs, err := node.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: "rpa_*"}).Result()
		if err != nil {
			return fmt.Errorf("%s: listing the function libraries: %w", addr, err)
		}
		mu.Lock()
		defer mu.Unlock()
		for _, lib := range libs {
			if lib.Name != l.name && libraryNamePattern.MatchString(lib.Name) {
				seen[lib.Name] = true
			}
		}
		return nil
	})
	return slices.Sorted(maps.Keys(seen)), err
}

// Delete deletes the library name of another release from every master (FUNCTION
// DELETE; a master without it is no error). This library is never deleted.
func (l *Library) Delete(ctx context.Context, c redis.UniversalClient, name string) error {
	if name == l.name || !libraryNamePattern.MatchString(name) {
		return fmt.Errorf("deleting function library %q: only another release's rpa_<hash8> library is deleted", name)
	}
	return forEachMaster(ctx, c, func(ctx context.Context, node redis.Cmdable, addr string) error {
		if err := node.FunctionDelete(ctx, name).Err(); err != nil && !strings.Contains(err.Error(), "not exist") &&
			!strings.Contains(err.Error(), "not found") {
			return fmt.Errorf("%s: deleting function library %s: %w", addr, name, err)
		}
		return nil
	})
}

// Ensure loads the library on every master that lacks it: the one server of a plain
// client, or every master of a cluster (replicas get it by replication). It returns
// on how many servers it loaded it.
func (l *Library) Ensure(ctx context.Context, c redis.UniversalClient) (int, error) {
	var (
		mu     sync.Mutex
		loaded int
	)
	load := func(ctx context.Context, node redis.Cmdable, addr string) error {
		did, err := l.Load(ctx, node)
		if err != nil {
			return fmt.Errorf("%s: %w", addr, err)
		}
		if did {
			mu.Lock()
			loaded++
			mu.Unlock()
		}
		return nil
	}
	var err error
	switch cc := c.(type) {
	case *redis.ClusterClient:
		err = cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
			return load(ctx, node, node.Options().Addr)
		})
	case *redis.Client:
		err = load(ctx, cc, cc.Options().Addr)
	default:
		err = load(ctx, c, "Redis")
	}
	return loaded, err
}

// IsFunctionMissing reports whether err, or an error it wraps (a client with safe
// error texts keeps the server's reply behind its own), is the server saying it
// holds no such function: the library is not loaded there (yet, or any more).
func IsFunctionMissing(err error) bool {
	if err == nil {
		return false
	}
	if strings.Contains(err.Error(), "Function not found") {
		return true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return IsFunctionMissing(u.Unwrap())
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if IsFunctionMissing(e) {
				return true
			}
		}
	}
	return false
}

// GrabLibrary holds the grab-side scripts, which an activity's own Redis user runs
// (GrabSideScripts), and those of runtime packets, which a budget's grab fleet runs
// (PacketSideScripts).
var GrabLibrary = newLibrary(append(GrabSideScripts(), PacketSideScripts()...)...)

// GrabSideScripts are the scripts the grab pods run: the grab, the refill of a
// sharded activity's dry shard (the transfers and the stock reading), the reporter's
// snapshot and the replay of dead letters. They are the functions of GrabLibrary,
// called with FCALL (Script.Call) by everyone, the operator included; seeding,
// configuring, closing, fencing, accepting, refunding and settlement (the consumer
// group, the acknowledgement, the dead letters and the ledger) are the operator's
// alone and stay cached scripts run with EVALSHA (Script.Run) under its own user.
func GrabSideScripts() []*Script {
	return []*Script{GrabScript, SnapshotScript, ReplayDeadScript, TransferOutScript, TransferInScript,
		TransferDoneScript, StockScript}
}
