package redisconn_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/store/redisconn"
)

func TestConnFromSecret(t *testing.T) {
	c, err := redisconn.ConnFromSecret(map[string][]byte{
		"addresses": []byte(" 10.0.0.1:6379, 10.0.0.2:6379 ,,10.0.0.3:6379"),
		"mode":      []byte("cluster\n"),
		"username":  []byte("grab"),
		"password":  []byte("s3cret"),
		"tls":       []byte("true"),
	})
	if err != nil {
		t.Fatal(err)
	}
	if c.Mode != redisconn.ModeCluster || len(c.Addresses) != 3 || c.Addresses[1] != "10.0.0.2:6379" ||
		c.Username != "grab" || c.Password != "s3cret" || !c.TLS {
		t.Fatalf("parsed %+v", c)
	}
	if _, ok := c.NewClient().(*redis.ClusterClient); !ok {
		t.Fatal("cluster mode did not give a cluster client")
	}

	c, err = redisconn.ConnFromSecret(map[string][]byte{"addresses": []byte("127.0.0.1:6379")})
	if err != nil || c.Mode != redisconn.ModeStandalone || c.TLS {
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
		if _, err := redisconn.ConnFromSecret(tc.data); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ConnFromSecret(%q) = %v, want an error with %q", tc.data, err, tc.want)
		}
	}
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
		if got := redisconn.ParseAddresses(in); !slices.Equal(got, want) {
			t.Errorf("ParseAddresses(%q) = %q, want %q", in, got, want)
		}
	}
}

// Client options reach the client: none keeps go-redis's defaults (the controller's
// client), the grab path's bound every wait, retry once and speak RESP2.
func TestClientOptions(t *testing.T) {
	conn := redisconn.Conn{Addresses: []string{"127.0.0.1:1"}, Mode: redisconn.ModeStandalone}
	plain := conn.NewClient().(*redis.Client)
	defer plain.Close()
	ref := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer ref.Close()
	if o, d := plain.Options(), ref.Options(); o.Protocol != d.Protocol || o.MaxRetries != d.MaxRetries ||
		o.ContextTimeoutEnabled || o.DialTimeout != d.DialTimeout || o.ReadTimeout != d.ReadTimeout ||
		o.WriteTimeout != d.WriteTimeout || o.PoolTimeout != d.PoolTimeout || o.PoolSize != d.PoolSize {
		t.Fatalf("default options %+v, want go-redis's defaults %+v", o, d)
	}
	grab := conn.NewClient(redisconn.GrabClientOptions(250 * time.Millisecond)).(*redis.Client)
	defer grab.Close()
	if o := grab.Options(); o.Protocol != 2 || o.MaxRetries != 1 || !o.ContextTimeoutEnabled ||
		o.DialTimeout != 250*time.Millisecond || o.ReadTimeout != 250*time.Millisecond ||
		o.WriteTimeout != 250*time.Millisecond || o.PoolTimeout != 250*time.Millisecond {
		t.Fatalf("grab options: %+v", o)
	}
	sized := conn.NewClient(redisconn.ClientOptions{PoolSize: 64}).(*redis.Client)
	defer sized.Close()
	if sized.Options().PoolSize != 64 {
		t.Fatalf("pool size %d, want 64", sized.Options().PoolSize)
	}
	cc := redisconn.Conn{Addresses: []string{"127.0.0.1:1", "127.0.0.1:2"}, Mode: redisconn.ModeCluster}.
		NewClient(redisconn.GrabClientOptions(time.Second)).(*redis.ClusterClient)
	defer cc.Close()
	if o := cc.Options(); o.Protocol != 2 || o.MaxRetries != 1 || o.ReadTimeout != time.Second {
		t.Fatalf("cluster grab options: %+v", o)
	}
	if _, err := (redisconn.Conn{Mode: redisconn.ModeStandalone}).NewPipelinedClient(redisconn.ClientOptions{}); err == nil {
		t.Fatal("a pipelined client without addresses was opened")
	}
}
