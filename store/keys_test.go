package store_test

import (
	"strings"
	"testing"
)

func TestKeysShareOneHashTag(t *testing.T) {
	k := keysOf("abc-123")
	all := k.All()
	if len(all) != 8 {
		t.Fatalf("%d keys, want 8", len(all))
	}
	seen := map[string]bool{}
	for _, key := range all {
		if !strings.Contains(key, "{abc-123}") {
			t.Errorf("key %q lacks the hash tag {abc-123}", key)
		}
		// The hash tag is the first {...} of the key, so nothing before it may
		// contain a brace.
		if i := strings.IndexByte(key, '{'); i < 0 || strings.ContainsAny(key[:i], "{}") {
			t.Errorf("key %q: the hash tag is not the first braces", key)
		}
		if seen[key] {
			t.Errorf("key %q appears twice", key)
		}
		seen[key] = true
	}
	if keysOf("a") == keysOf("b") {
		t.Fatal("two activities share keys")
	}
}
