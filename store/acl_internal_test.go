package store

import (
	"slices"
	"testing"
)

// Every command the scripts of the grab pods call is granted, and none of the
// controller's writes nor settlement's (the operator settles). RPUSH is granted for the refill of a sharded activity's dry
// shard (transfer_in.lua), on the activity's own keys only; a packet pushed outside
// a transfer shows as an imbalance of the shard (store.View.Conservation).
func TestActivityUserCommands(t *testing.T) {
	got := activityUserCommands()
	for _, want := range []string{"fcall", "ping", "time", "hget", "hmget", "hset", "hincrby", "hgetall",
		"llen", "lpop", "xadd", "xrange", "xdel", "cluster|slots", "rpush", "hdel", "hexists"} {
		if !slices.Contains(got, want) {
			t.Errorf("%s is not granted: %v", want, got)
		}
	}
	for _, never := range []string{"eval", "evalsha", "eval_ro", "evalsha_ro", "function", "fcall_ro", "del", "unlink", "rename", "flushall", "config", "script", "acl", "keys",
		"scan", "expire", "pexpire", "client", "debug", "xgroup", "xgroup|destroy", "xtrim",
		// Settlement's, which runs in the operator.
		"xgroup|create", "xreadgroup", "xautoclaim", "xpending", "xclaim", "xack"} {
		if slices.Contains(got, never) {
			t.Errorf("%s is granted: %v", never, got)
		}
	}
}
