package main

import (
	"slices"
	"testing"
)

// The default Redis password comes from the flag, else from REDIS_PASSWORD; the
// addresses are trimmed and an unusable connection is refused.
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

	if _, err := defaultRedisConn(" , ", "standalone", "", "", false, getenv); err == nil {
		t.Error("a connection without addresses was accepted")
	}
	if _, err := defaultRedisConn("127.0.0.1:6379", "sentinel", "", "", false, getenv); err == nil {
		t.Error("an unknown mode was accepted")
	}
}
