package redistest

import (
	"context"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// refusesDefaultUser checks that the server at addr lets nobody in as the default
// user: a command without AUTH gets NOAUTH, AUTH as default (with a password, or
// the password alone, which Redis takes as default's) fails and leaves the
// connection as it was, unable to run anything.
func refusesDefaultUser(t *testing.T, ctx context.Context, addr, adminPassword string) {
	t.Helper()
	anon := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer anon.Close()
	if err := anon.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Errorf("%s: PING without AUTH answered %v, want NOAUTH", addr, err)
	}
	conn := anon.Conn()
	defer conn.Close()
	for _, auth := range [][]any{
		{"auth", "default", "anything"},
		{"auth", "default", ""},
		{"auth", adminPassword},
	} {
		if err := conn.Do(ctx, auth...).Err(); err == nil {
			t.Errorf("%s: %v succeeded", addr, auth[:2])
		}
		if err := conn.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
			t.Errorf("%s: PING after a failed %v answered %v, want NOAUTH", addr, auth[:2], err)
		}
	}
}

// Every server the harness starts has the default user off and an admin user that
// the harness's own clients log in as; each server has a password of its own, a
// cluster one for all its nodes.
func TestServersRefuseTheDefaultUser(t *testing.T) {
	ctx := Context(t)
	a, b := Start(t), Start(t)
	if a.Username != AdminUser || a.Password == "" || a.Password == b.Password {
		t.Errorf("admin users %q/%q and %q/%q; want %s with a password of each server's own",
			a.Username, a.Password, b.Username, b.Password, AdminUser)
	}
	refusesDefaultUser(t, ctx, a.Addr, a.Password)
	if who, err := a.Client(t).Do(ctx, "acl", "whoami").Text(); err != nil || who != AdminUser {
		t.Errorf("the harness client is %q (%v), want %s", who, err, AdminUser)
	}
	ac := a.Conn().NewClient()
	defer ac.Close()
	if err := ac.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Errorf("a connection from Conn: %v", err)
	}
	// Another server's password does not open this one.
	other := redis.NewClient(&redis.Options{Addr: a.Addr, Username: AdminUser, Password: b.Password, MaxRetries: -1})
	defer other.Close()
	if err := other.Ping(ctx).Err(); err == nil {
		t.Error("server a accepted server b's admin password")
	}

	c := StartCluster(t, 3)
	for _, addr := range c.Addrs {
		refusesDefaultUser(t, ctx, addr, c.Password)
	}
	cc := c.Client(t)
	for i := range 20 {
		key := "k" + string(rune('a'+i))
		if err := cc.Set(ctx, key, i, 0).Err(); err != nil {
			t.Fatalf("SET %s through the cluster client: %v", key, err)
		}
	}
}

// A server restarted on its append-only file keeps what scripts, functions and
// transactions wrote: Redis replays them as the default user, which is off but
// keeps its permissions (ACLArgs). Without them the restart would drop those
// writes and keep only the plain commands.
func TestRestartKeepsTransactionsWithTheDefaultUserOff(t *testing.T) {
	ctx := Context(t)
	args := []string{"--appendonly", "yes", "--appendfsync", "always"}
	s, err := StartProcess(t.TempDir(), args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Stop() })
	c := redis.NewClient(s.Options())
	defer c.Close()
	if err := c.Set(ctx, "plain", "1", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.Eval(ctx, "redis.call('set', KEYS[1], '1') return redis.call('set', KEYS[2], '1')", []string{"script:a", "script:b"}).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.Set(ctx, "tx:a", "1", 0)
		p.Set(ctx, "tx:b", "1", 0)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := s.Kill(); err != nil {
		t.Fatal(err)
	}
	restarted, err := RestartProcess(s, args...)
	if err != nil {
		t.Fatal(err)
	}
	s = restarted
	rc := redis.NewClient(restarted.Options())
	defer rc.Close()
	for _, k := range []string{"plain", "script:a", "script:b", "tx:a", "tx:b"} {
		if v, err := rc.Get(ctx, k).Result(); err != nil || v != "1" {
			t.Errorf("%s after the restart: %q, %v; want it kept", k, v, err)
		}
	}
	refusesDefaultUser(t, ctx, restarted.Addr, restarted.Password)
}
