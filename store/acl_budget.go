package store

import (
	"context"
	"errors"

	"redpacket.io/operator/lua"
)

// A budget on the operator's default Redis gets a Redis ACL user of its own, as an
// activity does (acl.go): its grab pods log in as it. It may touch only the budget's
// keys, rpb:{<uid>.*, its dead letters read-only (budgetKeyRules), never the
// operator's ledger (rpl:{<uid>}:…), and it may run
// FCALL of the operator's function library and what a client needs to find its way
// (PING, TIME, the cluster's slot map), nothing else of its own. Redis checks the
// commands a function calls against the caller's rules, so the user holds the
// commands the library's functions call too, but it can only run them through the
// functions.

// budgetUserName is the name of the Redis ACL user of the budget with the given UID.
func budgetUserName(uid string) string { return "rpb-" + uid }

// budgetUserDirectCommands are the commands a budget's grab pods send themselves:
// FCALL (never EVAL, SCRIPT or FUNCTION), the readiness ping, the clock, WAIT for
// durability Replicas, and what a cluster client asks to learn the slot map.
var budgetUserDirectCommands = []string{
	"fcall", "ping", "time", "wait",
	"cluster|slots", "cluster|shards", "cluster|nodes", "command",
}

// budgetUserCommands lists, sorted and in lower case, every command the budget's
// user may run: budgetUserDirectCommands and every command the function library's
// functions call. It refuses (panics on) a forbidden command, as the activity's does.
func budgetUserCommands() []string {
	return userCommands("budget", budgetUserDirectCommands, lua.GrabLibrary.Scripts())
}

// BudgetKeyPattern is the ACL key pattern of every key of the budget uid: each of its
// shards' tags starts with "{<uid>." (ACL globs treat the braces as plain characters).
func BudgetKeyPattern(uid string) string { return "rpb:{" + uid + ".*" }

// budgetKeyRules are the budget user's key rules: every key of the budget's shards
// (BudgetKeyPattern) but their dead-letter streams, which it may only read (%R~):
// only the operator parks and replays dead letters, as for an activity (acl.go).
// Each shard's keys are rpb:{<uid>.N}:meta, :due, :stream, :dead and :p:<id>, and
// the quota counters :qd:<day> and :qr:<day> (packet_quota.lua).
func budgetKeyRules(uid string) []string {
	tag := BudgetKeyPattern(uid) + "}:"
	return []string{"~" + tag + "meta", "~" + tag + "due", "~" + tag + "stream", "~" + tag + "p:*",
		"~" + tag + "qd:*", "~" + tag + "qr:*", "%R~" + tag + "dead"}
}

// aclUser is the budget's ACL user as EnsureUser sets it.
func (b *Budget) aclUser() aclUserSpec {
	return aclUserSpec{name: budgetUserName(b.uid), keyRules: budgetKeyRules(b.uid), commands: budgetUserCommands()}
}

// UserName is the name of the budget's Redis ACL user.
func (b *Budget) UserName() string { return budgetUserName(b.uid) }

// EnsureUser makes every node of the budget's Redis hold the budget's ACL user with
// exactly the given password and rules, as Shard.EnsureUser does for an activity:
// a node that holds them already is left alone, another password is a rotation.
func (b *Budget) EnsureUser(ctx context.Context, password string) (UserChange, error) {
	if password == "" {
		return UserChange{}, errors.New("ensuring the budget's Redis user: empty password")
	}
	return ensureUser(ctx, b.c, b.aclUser(), password)
}

// DeleteUser removes the budget's ACL user from every node, which closes its
// connections; it returns on how many nodes the user existed.
func (b *Budget) DeleteUser(ctx context.Context) (int, error) {
	return deleteUser(ctx, b.c, budgetUserName(b.uid))
}
