package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
	"redpacket.io/operator/lua"
)

// An activity's own Redis ACL user is what its grab pods log in as, instead of the
// operator's user: it may touch only the activity's keys (keyRules: rpa:{uid}:meta and
// the others, its dead-letter stream read-only) and run only
// the commands the grab service, its status reporter and the replay-dead-letters
// command need. Settlement runs in the operator, under the operator's user: the
// activity's user may not read the consumer group, acknowledge or dead-letter. The controller creates it (EnsureUser) on the
// operator's default Redis with the operator's own user, which must be allowed to run
// ACL SETUSER, ACL GETUSER and ACL DELUSER, and removes it (DeleteUser) once the
// activity is gone. A Redis keeps ACL users in memory, per node: on a cluster they are
// set on every node, replicas included, so that a replica promoted by a failover
// already knows them.

// ErrACLUnavailable is wrapped by the errors of EnsureUser and DeleteUser when the
// server refuses to manage users: it has no ACL (before Redis 6) or the operator's
// Redis user may not run the ACL commands (NOPERM).
var ErrACLUnavailable = errors.New("the Redis server cannot manage ACL users for the operator " +
	"(it predates Redis 6, or the operator's Redis user may not run ACL SETUSER, GETUSER and DELUSER)")

// activityUserName is the name of the Redis ACL user of the activity with the given
// UID.
func activityUserName(uid string) string { return "rpa-" + uid }

// grabSideScripts are the scripts the grab pods run, as the functions of
// lua.GrabLibrary (lua.GrabSideScripts): the grab, the refill of a sharded activity's
// dry shard (the transfers and the stock reading), the reporter's snapshot and the
// replay of dead letters. Every command they call is granted to the activity's user
// (Redis checks the commands a function calls against the caller's ACL). Seeding,
// configuring, closing, fencing, accepting, purging and settlement (the consumer
// group, the acknowledgement, the dead letters and the ledger) are the operator's,
// under the operator's user.
func grabSideScripts() []*lua.Script { return lua.GrabSideScripts() }

// activityUserDirectCommands are the commands the grab pods send themselves, besides
// what their functions call: FCALL of the library's functions (never EVAL, EVALSHA,
// SCRIPT or FUNCTION: the user runs only the Lua the operator loaded, and cannot
// load, replace, flush or kill any), the readiness ping, WAIT (durability Replicas:
// ReplicaWaiter; WAIT touches no key, and blocks only the connection that sends it,
// at most its timeout, never the server), the reads of the claims and meta hashes and
// of the stream's length, the reading of a sharded activity's transfer journals
// (transfer.go), and what a
// cluster client asks to learn the slot map and the commands' key positions
// (COMMAND, which only describes commands). AUTH and HELLO need no grant. A method
// of Activity that the grab pods call and that sends another command must add it
// here; forbiddenActivityCommands may never be added.
var activityUserDirectCommands = []string{
	"fcall", "ping", "time", "wait",
	"xlen", "hget", "hmget",
	"hgetall", "hexists",
	"cluster|slots", "cluster|shards", "cluster|nodes", "command",
}

// forbiddenActivityCommands are the commands an activity's user must never hold:
// every way to run Lua of one's own (EVAL and its variants, FUNCTION LOAD), to drop
// or kill the operator's scripts and functions (SCRIPT, FUNCTION), and the commands
// that stop or stall the whole server, touch every key or change its configuration.
// Of MEMORY, only USAGE may be granted: the functions read the size of a key the
// tenant may have filled before they read the key (snapshot.lua), and it tells the
// user nothing of any key but its own.
// activityUserCommands refuses to build a list that holds one, and a test checks the
// user Redis holds against it.
var forbiddenActivityCommands = []string{
	"eval", "eval_ro", "evalsha", "evalsha_ro", "script", "function", "debug", "keys",
	"flushall", "flushdb", "config", "shutdown", "monitor", "client", "acl", "save", "bgsave",
	"bgrewriteaof", "replicaof", "slaveof", "sync", "psync", "failover", "swapdb", "select",
	"migrate", "restore", "module", "cluster|reset", "cluster|failover", "blpop", "brpop",
	"blmove", "brpoplpush", "blmpop", "bzpopmin", "bzpopmax", "bzmpop", "subscribe", "psubscribe",
	"ssubscribe", "sort", "sort_ro", "scan", "dbsize", "info", "latency", "slowlog", "memory|doctor",
	"memory|malloc-stats", "memory|purge", "memory|stats", "object", "pfdebug", "lastsave", "role", "sentinel",
}

// scriptCall finds the commands a Lua script calls: redis.call('NAME', ...) and
// redis.pcall('NAME', ...) with a literal name, the only form the scripts use, and
// the literal argument after it, which names the subcommand of a container command.
var scriptCall = regexp.MustCompile(`redis\.p?call\(\s*'([A-Za-z]+)'(?:\s*,\s*'([A-Za-z]+)')?`)

// containerCommands are the commands whose subcommands are granted one by one
// (XGROUP CREATE, never XGROUP DESTROY).
var containerCommands = map[string]bool{"xgroup": true, "xinfo": true, "object": true, "memory": true}

// activityUserCommands lists, sorted and in lower case, every command the activity's
// user may run: activityUserDirectCommands and every command grabSideScripts call.
func activityUserCommands() []string {
	return userCommands("activity", activityUserDirectCommands, grabSideScripts())
}

// userCommands lists, sorted and in lower case, every command a tenant's Redis user
// may run: the direct commands its grab pods send and every command the scripts
// call (a container command by its subcommand). It is the one place where the
// activity's and the budget's users get their commands, and it refuses (panics on)
// a command of forbiddenActivityCommands, naming whose user (who) would get it.
func userCommands(who string, direct []string, scripts []*lua.Script) []string {
	set := map[string]bool{}
	for _, c := range direct {
		set[c] = true
	}
	for _, s := range scripts {
		for _, m := range scriptCall.FindAllStringSubmatch(s.Source(), -1) {
			name := strings.ToLower(m[1])
			if containerCommands[name] {
				name += "|" + strings.ToLower(m[2])
			}
			set[name] = true
		}
	}
	out := make([]string, 0, len(set))
	for c := range set {
		name, _, _ := strings.Cut(c, "|")
		if slices.Contains(forbiddenActivityCommands, c) || slices.Contains(forbiddenActivityCommands, name) {
			panic("the " + who + "'s Redis user would be granted the forbidden command " + c)
		}
		out = append(out, c)
	}
	sort.Strings(out)
	return out
}

// keyPatterns are the ACL key patterns of the activity's keys of one name (meta,
// packets, ...): the key with its hash tag, rpa:{uid}:<name>, and the key of each of
// its shards when it is sharded, rpa:{uid.N}:<name> for N of one or two digits
// (MaxShards is 64). ACL glob patterns treat the braces as plain characters.
func (k Keys) keyPatterns(name string) []string {
	base := strings.TrimSuffix(k.Meta, "}:meta")
	return []string{base + "}:" + name, base + ".[0-9]}:" + name, base + ".[0-9][0-9]}:" + name}
}

// tenantWritableKeys are the names of the keys of a shard that the activity's user
// may write: what the grab, the snapshot and the transfers between shards touch. The
// dead-letter stream is not among them: the user may read it (tenantReadOnlyKeys),
// and only the operator parks and replays dead letters, so no entry the tenant wrote
// is ever replayed (issue 34, case 5). No other key of the activity is the user's.
var tenantWritableKeys = []string{"meta", "staging", "packets", "claims", "stream", "xout", "xin"}

// tenantReadOnlyKeys are the names of the keys of a shard that the activity's user
// may read and never write (Redis 7's %R~ key permission).
var tenantReadOnlyKeys = []string{"dead"}

// keyRules are the key patterns as ACL SETUSER rules and as ACL GETUSER lists them:
// ~pattern for each key the user may read and write, %R~pattern for each it may only
// read. An FCALL that declares a read-only key is refused whole (NOPERM) before its
// function runs, since Redis takes every declared key of FCALL as written.
func (k Keys) keyRules() []string {
	var rules []string
	for _, name := range tenantWritableKeys {
		for _, p := range k.keyPatterns(name) {
			rules = append(rules, "~"+p)
		}
	}
	for _, name := range tenantReadOnlyKeys {
		for _, p := range k.keyPatterns(name) {
			rules = append(rules, "%R~"+p)
		}
	}
	return rules
}

// userName is the activity's ACL user name, read back from its hash tag.
func (k Keys) userName() string {
	_, rest, _ := strings.Cut(k.Meta, "{")
	uid, _, _ := strings.Cut(rest, "}")
	return activityUserName(uid)
}

// passwordHash is how Redis lists a password: the hex SHA-256 of it. EnsureUser sends
// only the hash (ACL SETUSER #<hash>), never the password itself.
func passwordHash(password string) string {
	sum := sha256.Sum256([]byte(password))
	return hex.EncodeToString(sum[:])
}

// aclUser is the activity's ACL user as EnsureUser sets it.
func (k Keys) aclUser() aclUserSpec {
	return aclUserSpec{name: k.userName(), keyRules: k.keyRules(), commands: activityUserCommands()}
}

// aclUserSpec is a Redis ACL user the operator makes for a tenant's grab pods: an
// activity's (Keys.aclUser) or a budget's (budgetACLUser). Only its name, its key
// patterns and its commands differ; everything else about it is the same.
type aclUserSpec struct {
	name     string
	keyRules []string
	commands []string
}

// rules are the ACL SETUSER rules of the user with the given password hash:
// everything reset first, so that the rules are exactly these whatever the user held
// before; on; the one password; its keys; no Pub/Sub channel; and its commands only.
func (u aclUserSpec) rules(hash string) []any {
	rules := []any{"reset", "on", "#" + hash}
	for _, p := range u.keyRules {
		rules = append(rules, p)
	}
	rules = append(rules, "resetchannels", "-@all")
	for _, c := range u.commands {
		rules = append(rules, "+"+c)
	}
	return rules
}

// UserChange says what EnsureUser did.
type UserChange struct {
	// Nodes is how many Redis nodes were checked: one standalone server, or every
	// master and replica of a cluster.
	Nodes int
	// Set is how many of them were given the user or had its rules corrected.
	Set int
	// Rotated is how many of them held the user with another password: there the
	// user was deleted first, which closes every connection logged in with the old
	// password, and set again.
	Rotated int
}

// EnsureUser makes sure every node of the activity's Redis holds the activity's ACL
// user (activityUserName) with exactly the given password and rules (aclUserSpec.rules). A
// node that holds them already is left alone, so calling it at every reconcile costs
// one ACL GETUSER per node. A node that holds the user with another password is a
// rotation: the user is deleted (ACL DELUSER closes its connections, so nobody stays
// logged in with the old password) and set again. The handle's client must be a plain
// or cluster client; on a cluster every master and every replica is set, because
// Redis does not replicate ACL changes. Errors wrap ErrACLUnavailable when the server
// refuses to manage users.
func (a *Shard) EnsureUser(ctx context.Context, password string) (UserChange, error) {
	if password == "" {
		return UserChange{}, errors.New("ensuring the activity's Redis user: empty password")
	}
	return ensureUser(ctx, a.c, a.keys.aclUser(), password)
}

// ensureUser makes every node c reaches hold user with exactly password and its
// rules (Shard.EnsureUser says how).
func ensureUser(ctx context.Context, c redis.Cmdable, user aclUserSpec, password string) (UserChange, error) {
	name := user.name
	hash := passwordHash(password)
	rules := user.rules(hash)
	want := wantUser{hash: hash, keys: strings.Join(user.keyRules, " "), commands: commandTokens(rules)}
	var (
		mu     sync.Mutex
		change UserChange
	)
	err := forEachNode(ctx, c, func(ctx context.Context, node *redis.Client) error {
		have, exists, err := getUser(ctx, node, name)
		if err != nil {
			return err
		}
		set, rotated := !exists || !want.matches(have), exists && !slices.Equal(have.passwords, []string{hash})
		if rotated {
			if err := node.Do(ctx, "acl", "deluser", name).Err(); err != nil {
				return aclErr("ACL DELUSER "+name, err)
			}
		}
		if set {
			args := append([]any{"acl", "setuser", name}, rules...)
			if err := node.Do(ctx, args...).Err(); err != nil {
				return aclErr("ACL SETUSER "+name, err)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		change.Nodes++
		if set {
			change.Set++
		}
		if rotated {
			change.Rotated++
		}
		return nil
	})
	if err != nil {
		return change, fmt.Errorf("ensuring Redis user %s: %w", name, err)
	}
	return change, nil
}

// DeleteUser removes the activity's ACL user from every node (every master and
// replica of a cluster), which closes the connections logged in as it. It returns on
// how many nodes the user existed; a user that exists nowhere is no error.
func (a *Shard) DeleteUser(ctx context.Context) (int, error) {
	return deleteUser(ctx, a.c, a.keys.userName())
}

// deleteUser removes the user name from every node c reaches.
func deleteUser(ctx context.Context, c redis.Cmdable, name string) (int, error) {
	var (
		mu      sync.Mutex
		deleted int
	)
	err := forEachNode(ctx, c, func(ctx context.Context, node *redis.Client) error {
		n, err := node.Do(ctx, "acl", "deluser", name).Int()
		if err != nil {
			return aclErr("ACL DELUSER "+name, err)
		}
		mu.Lock()
		deleted += n
		mu.Unlock()
		return nil
	})
	if err != nil {
		return deleted, fmt.Errorf("deleting Redis user %s: %w", name, err)
	}
	return deleted, nil
}

// forEachNode runs fn on the standalone server c, or concurrently on every master and
// replica of the cluster c (forEachClusterNode).
func forEachNode(ctx context.Context, c redis.Cmdable, fn func(ctx context.Context, node *redis.Client) error) error {
	switch c := c.(type) {
	case *redis.ClusterClient:
		return forEachClusterNode(ctx, c, fn)
	case *redis.Client:
		return fn(ctx, c)
	default:
		return fmt.Errorf("managing Redis users needs a plain or cluster client, not %T", c)
	}
}

// forEachClusterNode runs fn concurrently on every node of the cluster: every node of
// the slot map (CLUSTER SLOTS), through the client's own connection pools, and every
// other node that CLUSTER NODES lists and does not mark as failed, through a client
// of its own opened with the cluster's options. The slot map leaves out a replica
// until it holds data, and a demoted master while it resyncs after a failover;
// CLUSTER NODES lists them.
func forEachClusterNode(ctx context.Context, cc *redis.ClusterClient, fn func(ctx context.Context, node *redis.Client) error) error {
	listing, err := cc.ClusterNodes(ctx).Result()
	if err != nil {
		return fmt.Errorf("listing the cluster's nodes: %w", err)
	}
	var (
		mu      sync.Mutex
		visited = map[string]bool{}
	)
	err = cc.ForEachShard(ctx, func(ctx context.Context, node *redis.Client) error {
		mu.Lock()
		visited[node.Options().Addr] = true
		mu.Unlock()
		return fn(ctx, node)
	})
	if err != nil {
		return err
	}
	opt := cc.Options()
	var others []string
	for _, addr := range clusterNodeAddrs(listing) {
		if !visited[addr] {
			others = append(others, addr)
		}
	}
	errs := make([]error, len(others))
	var wg sync.WaitGroup
	for i, addr := range others {
		wg.Go(func() {
			node := opt.NewClient(&redis.Options{
				Addr: addr, Username: opt.Username, Password: opt.Password, TLSConfig: opt.TLSConfig,
				Dialer: opt.Dialer, DialTimeout: opt.DialTimeout, ReadTimeout: opt.ReadTimeout,
				WriteTimeout: opt.WriteTimeout, ContextTimeoutEnabled: opt.ContextTimeoutEnabled,
				Protocol: opt.Protocol, MaxRetries: opt.MaxRetries, PoolSize: 1,
			})
			defer func() { _ = node.Close() }()
			errs[i] = fn(ctx, node)
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// clusterNodeAddrs are the host:port addresses of the nodes a CLUSTER NODES listing
// holds, leaving out those marked failed ("fail"), without an address ("noaddr") or
// still in the handshake.
func clusterNodeAddrs(listing string) []string {
	var out []string
	for _, line := range strings.Split(listing, "\n") {
		f := strings.Fields(line)
		if len(f) < 3 {
			continue
		}
		flags := strings.Split(f[2], ",")
		if slices.Contains(flags, "fail") || slices.Contains(flags, "noaddr") || slices.Contains(flags, "handshake") {
			continue
		}
		addr, _, _ := strings.Cut(f[1], "@")
		if addr != "" && !strings.HasSuffix(addr, ":0") {
			out = append(out, addr)
		}
	}
	return out
}

// aclErr wraps the error of an ACL command, with ErrACLUnavailable when the server
// has no such command or the operator's user may not run it.
func aclErr(what string, err error) error {
	var re redis.Error
	if errors.As(err, &re) {
		msg := re.Error()
		if strings.HasPrefix(msg, "NOPERM") || strings.HasPrefix(msg, "ERR unknown command") ||
			strings.HasPrefix(msg, "ERR unknown subcommand") {
			return fmt.Errorf("%s: %w: %w", what, ErrACLUnavailable, err)
		}
	}
	return fmt.Errorf("%s: %w", what, err)
}

// aclUser is what ACL GETUSER says of a user.
type aclUser struct {
	flags     []string
	passwords []string
	commands  string
	keys      string
	channels  string
	selectors int
}

// wantUser is the state EnsureUser wants a node to hold.
type wantUser struct {
	hash     string
	keys     string
	commands map[string]bool
}

// matches reports whether the user as a node holds it is exactly what is wanted:
// enabled, the one password, the activity's keys only, no channel, no selector and
// the same commands (Redis lists them in an order of its own).
func (w wantUser) matches(u aclUser) bool {
	return slices.Contains(u.flags, "on") && !slices.Contains(u.flags, "nopass") &&
		slices.Equal(u.passwords, []string{w.hash}) && u.keys == w.keys && u.channels == "" &&
		u.selectors == 0 && maps.Equal(commandTokens(strings.Fields(u.commands)), w.commands)
}

// commandTokens are the command rules (-@all, +name) among rules, as a set.
func commandTokens[T any](rules []T) map[string]bool {
	out := map[string]bool{}
	for _, r := range rules {
		s, ok := any(r).(string)
		if ok && (strings.HasPrefix(s, "+") || strings.HasPrefix(s, "-")) {
			out[strings.ToLower(s)] = true
		}
	}
	return out
}

// getUser reads a user with ACL GETUSER; exists is false when there is none. It
// reads both the RESP3 map and the RESP2 list form of the answer.
func getUser(ctx context.Context, node *redis.Client, name string) (aclUser, bool, error) {
	v, err := node.Do(ctx, "acl", "getuser", name).Result()
	if errors.Is(err, redis.Nil) {
		return aclUser{}, false, nil
	}
	if err != nil {
		return aclUser{}, false, aclErr("ACL GETUSER "+name, err)
	}
	fields := map[string]any{}
	switch m := v.(type) {
	case map[any]any:
		for k, val := range m {
			if ks, ok := k.(string); ok {
				fields[ks] = val
			}
		}
	case []any:
		for i := 0; i+1 < len(m); i += 2 {
			if ks, ok := m[i].(string); ok {
				fields[ks] = m[i+1]
			}
		}
	default:
		return aclUser{}, false, fmt.Errorf("ACL GETUSER %s: unexpected reply of type %T", name, v)
	}
	var u aclUser
	u.flags = stringList(fields["flags"])
	u.passwords = stringList(fields["passwords"])
	u.commands, _ = fields["commands"].(string)
	// Redis 7 lists keys and channels as one string; Redis 6 as lists of patterns.
	if s, ok := fields["keys"].(string); ok {
		u.keys = s
	} else {
		u.keys = "~" + strings.Join(stringList(fields["keys"]), " ~")
	}
	if s, ok := fields["channels"].(string); ok {
		u.channels = s
	} else if ch := stringList(fields["channels"]); len(ch) > 0 {
		u.channels = "&" + strings.Join(ch, " &")
	}
	if sel, ok := fields["selectors"].([]any); ok {
		u.selectors = len(sel)
	}
	return u, true, nil
}

// stringList reads a list of strings out of a reply; anything else gives nil.
func stringList(v any) []string {
	list, ok := v.([]any)
	if !ok {
		return nil
	}
	out := make([]string, 0, len(list))
	for _, e := range list {
		if s, ok := e.(string); ok {
			out = append(out, s)
		}
	}
	return out
}
