package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Keys come from every line of every --signing-key-file and of BALANCE_SIGNING_KEYS.
func TestLoadKeys(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "keys")
	if err := os.WriteFile(f, []byte("old\r\n\nnew\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	keys, err := loadKeys([]string{f}, "env-key\n")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, k := range keys {
		got = append(got, string(k))
	}
	if strings.Join(got, ",") != "old,new,env-key" {
		t.Fatalf("keys %q", got)
	}
	if _, err := loadKeys([]string{filepath.Join(dir, "missing")}, ""); err == nil {
		t.Fatal("a missing key file is no error")
	}
}

// It does not start without a database, nor without a key unless told to.
func TestRunRefusesToStartUnconfigured(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	t.Setenv("BALANCE_SIGNING_KEYS", "")
	if err := run(t.Context(), nil); err == nil || !strings.Contains(err.Error(), "no database") {
		t.Fatalf("without a database: %v", err)
	}
	if err := run(t.Context(), []string{"--database-url", "postgres://127.0.0.1:1/x"}); err == nil || !strings.Contains(err.Error(), "no signing key") {
		t.Fatalf("without a key: %v", err)
	}
}
