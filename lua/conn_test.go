package lua_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/lua"
	"redpacket.io/operator/test/redistest"
)

func TestKeysShareOneHashTag(t *testing.T) {
	k := lua.KeysFor("abc-123")
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

// One function splits every address list.
func TestParseAddresses(t *testing.T) {
	for in, want := range map[string][]string{
		"":                              nil,
		" , ,":                          nil,
		"127.0.0.1:6379":                {"127.0.0.1:6379"},
		" a:1, b:2 ,,c:3\n":             {"a:1", "b:2", "c:3"},
		"redis-0.redis:6379,redis-1:1 ": {"redis-0.redis:6379", "redis-1:1"},
	} {
		if got := lua.ParseAddresses(in); !slices.Equal(got, want) {
			t.Errorf("ParseAddresses(%q) = %q, want %q", in, got, want)
		}
	}
}

// Client options reach the client: none keeps go-redis's defaults (the controller's
// client), the grab path's bound every wait, retry once and speak RESP2.
func TestClientOptions(t *testing.T) {
	conn := lua.Conn{Addresses: []string{"127.0.0.1:1"}, Mode: lua.ModeStandalone}
	plain := conn.NewClient().(*redis.Client)
	defer plain.Close()
	ref := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer ref.Close()
	if o, d := plain.Options(), ref.Options(); o.Protocol != d.Protocol || o.MaxRetries != d.MaxRetries ||
		o.ContextTimeoutEnabled || o.DialTimeout != d.DialTimeout || o.ReadTimeout != d.ReadTimeout ||
		o.WriteTimeout != d.WriteTimeout || o.PoolTimeout != d.PoolTimeout || o.PoolSize != d.PoolSize {
		t.Fatalf("default options %+v, want go-redis's defaults %+v", o, d)
	}
	grab := conn.NewClient(lua.GrabClientOptions(250 * time.Millisecond)).(*redis.Client)
	defer grab.Close()
	if o := grab.Options(); o.Protocol != 2 || o.MaxRetries != 1 || !o.ContextTimeoutEnabled ||
		o.DialTimeout != 250*time.Millisecond || o.ReadTimeout != 250*time.Millisecond ||
		o.WriteTimeout != 250*time.Millisecond || o.PoolTimeout != 250*time.Millisecond {
		t.Fatalf("grab options: %+v", o)
	}
	sized := conn.NewClient(lua.ClientOptions{PoolSize: 64}).(*redis.Client)
	defer sized.Close()
	if sized.Options().PoolSize != 64 {
		t.Fatalf("pool size %d, want 64", sized.Options().PoolSize)
	}
	cc := lua.Conn{Addresses: []string{"127.0.0.1:1", "127.0.0.1:2"}, Mode: lua.ModeCluster}.
		NewClient(lua.GrabClientOptions(time.Second)).(*redis.ClusterClient)
	defer cc.Close()
	if o := cc.Options(); o.Protocol != 2 || o.MaxRetries != 1 || o.ReadTimeout != time.Second {
		t.Fatalf("cluster grab options: %+v", o)
	}
	if _, err := (lua.Conn{Mode: lua.ModeStandalone}).NewPipelinedClient(lua.ClientOptions{}); err == nil {
		t.Fatal("a pipelined client without addresses was opened")
	}
}

// The grab path's pipelined client reaches a real server through both its plain
// client and its auto-pipeliner.
func TestPipelinedClientReachesRealServer(t *testing.T) {
	ctx := testCtx(t)
	s := redistest.Start(t)
	pc, err := lua.Conn{Addresses: []string{s.Addr}, Mode: lua.ModeStandalone}.NewPipelinedClient(lua.GrabClientOptions(2 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	amounts := []int64{5, 6, 7}
	seedOpen(t, ctx, pc.Client, "pipelined", amounts)
	a := lua.NewActivity(pc.Pipeliner, "pipelined")
	if err := lua.NewActivity(pc.Client, "pipelined").Ping(ctx); err != nil {
		t.Fatalf("ping: %v", err)
	}
	res, err := a.Grab(ctx, "p1")
	if err != nil || res.Outcome != lua.Granted {
		t.Fatalf("grab through the auto-pipeliner: %+v, %v", res, err)
	}
	if snap, err := a.Snapshot(ctx); err != nil || snap.ClaimedCount != 1 {
		t.Fatalf("snapshot through the auto-pipeliner: %+v, %v", snap, err)
	}
	if err := pc.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if _, err := a.Grab(ctx, "p2"); err == nil {
		t.Fatal("a grab went through after the close")
	}
}
