package lua_test

import (
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/test/redistest"
)

func TestKeysShareOneHashTag(t *testing.T) {
	k := lua.KeysFor("abc-123")
	all := k.All()
	if len(all) != 6 {
		t.Fatalf("%d keys, want 6", len(all))
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
	if lua.KeysFor("a") == lua.KeysFor("b") {
		t.Fatal("two activities share keys")
	}
}

func TestConnFromSecret(t *testing.T) {
	c, err := lua.ConnFromSecret(map[string][]byte{
		"addresses": []byte(" 10.0.0.1:6379, 10.0.0.2:6379 ,,10.0.0.3:6379"),
		"mode":      []byte("cluster\n"),
		"username":  []byte("grab"),
		"password":  []byte("s3cret"),
		"tls":       []byte("true"),
	})
	if err != nil {
		t.Fatal(err)
	}
	if c.Mode != lua.ModeCluster || len(c.Addresses) != 3 || c.Addresses[1] != "10.0.0.2:6379" ||
		c.Username != "grab" || c.Password != "s3cret" || !c.TLS {
		t.Fatalf("parsed %+v", c)
	}
	if _, ok := c.NewClient().(*redis.ClusterClient); !ok {
		t.Fatal("cluster mode did not give a cluster client")
	}

	c, err = lua.ConnFromSecret(map[string][]byte{"addresses": []byte("127.0.0.1:6379")})
	if err != nil || c.Mode != lua.ModeStandalone || c.TLS {
		t.Fatalf("defaults: %+v, %v", c, err)
	}
	if _, ok := c.NewClient().(*redis.Client); !ok {
		t.Fatal("standalone mode did not give a plain client")
	}
	other := c
	other.Password = "x"
	if c.Key() == other.Key() {
		t.Fatal("connections with different passwords share a cache key")
	}

	for _, tc := range []struct {
		data map[string][]byte
		want string
	}{
		{map[string][]byte{}, "no addresses"},
		{map[string][]byte{"addresses": []byte(" , ")}, "no addresses"},
		{map[string][]byte{"addresses": []byte("a:1,b:2")}, "standalone mode takes one address"},
		{map[string][]byte{"addresses": []byte("a:1"), "mode": []byte("sentinel")}, `mode "sentinel"`},
	} {
		if _, err := lua.ConnFromSecret(tc.data); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ConnFromSecret(%q) = %v, want an error with %q", tc.data, err, tc.want)
		}
	}
}

func TestConnReachesRealServer(t *testing.T) {
	ctx := testCtx(t)
	s := redistest.Start(t)
	c := lua.Conn{Addresses: []string{s.Addr}, Mode: lua.ModeStandalone}.NewClient()
	defer c.Close()
	if err := lua.LoadAll(ctx, c); err != nil {
		t.Fatalf("LoadAll through a standalone connection: %v", err)
	}
	amounts := []int64{5, 6, 7}
	k := seedOpen(t, ctx, c, "conn-standalone", amounts)
	_, grants := tally(t, grabConcurrently(t, ctx, c, k, userIDs("q", 5), 5))
	verify(t, ctx, c, k, amounts, grants)
}
