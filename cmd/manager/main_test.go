package main

import (
	"slices"
	"testing"
)

// The default Redis user name and password come from their flags, else from
// REDIS_USERNAME and REDIS_PASSWORD; the addresses are trimmed and an unusable
// connection is refused.
func TestDefaultRedisConn(t *testing.T) {
	env := map[string]string{"REDIS_PASSWORD": "from-env"}
	getenv := func(k string) string { return env[k] }

	conn, err := defaultRedisConn(" 10.0.0.1:6379, ,10.0.0.2:6379 ", "cluster", "ops", "", true, getenv)
	if err != nil {
		t.Fatal(err)
	}
	if conn.Password != "from-env" || conn.Username != "ops" || conn.Mode != "cluster" || !conn.TLS ||
		!slices.Equal(conn.Addresses, []string{"10.0.0.1:6379", "10.0.0.2:6379"}) {
		t.Errorf("connection %+v", conn)
	}

	conn, err = defaultRedisConn("127.0.0.1:6379", "standalone", "", "from-flag", false, getenv)
	if err != nil {
		t.Fatal(err)
	}
	if conn.Password != "from-flag" {
		t.Errorf("password %q, want the flag's", conn.Password)
	}

	// The user name: the flag wins over REDIS_USERNAME, which fills an empty flag;
	// without either the connection has none (the default user of a Redis without
	// ACLs).
	env["REDIS_USERNAME"] = "operator-from-env"
	conn, err = defaultRedisConn("127.0.0.1:6379", "standalone", "", "", false, getenv)
	if err != nil {
		t.Fatal(err)
	}
	if conn.Username != "operator-from-env" || conn.Password != "from-env" {
		t.Errorf("user %q, password %q; want both from the environment", conn.Username, conn.Password)
	}
	conn, err = defaultRedisConn("127.0.0.1:6379", "standalone", "operator-from-flag", "from-flag", false, getenv)
	if err != nil {
		t.Fatal(err)
	}
	if conn.Username != "operator-from-flag" || conn.Password != "from-flag" {
		t.Errorf("user %q, password %q; want both from the flags", conn.Username, conn.Password)
	}
	delete(env, "REDIS_USERNAME")
	delete(env, "REDIS_PASSWORD")
	conn, err = defaultRedisConn("127.0.0.1:6379", "standalone", "", "", false, getenv)
	if err != nil {
		t.Fatal(err)
	}
	if conn.Username != "" || conn.Password != "" {
		t.Errorf("user %q, password %q without flags or environment; want none", conn.Username, conn.Password)
	}

	if _, err := defaultRedisConn(" , ", "standalone", "", "", false, getenv); err == nil {
		t.Error("a connection without addresses was accepted")
	}
	if _, err := defaultRedisConn("127.0.0.1:6379", "sentinel", "", "", false, getenv); err == nil {
		t.Error("an unknown mode was accepted")
	}
}
