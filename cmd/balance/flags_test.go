package main

import (
	"crypto/ed25519"
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"redpacket.io/operator/pkg/webhooksig"
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
	t.Setenv("BALANCE_PUBLIC_KEYS", "")
	if err := run(t.Context(), nil); err == nil || !strings.Contains(err.Error(), "no database") {
		t.Fatalf("without a database: %v", err)
	}
	if err := run(t.Context(), []string{"--database-url", "postgres://127.0.0.1:1/x"}); err == nil || !strings.Contains(err.Error(), "no signing key") {
		t.Fatalf("without a key: %v", err)
	}
}

// The signature flags: by default a tolerance of 5 minutes and Standard Webhooks
// required (X-Signature alone refused); --tolerance and --require-standard-webhooks
// change them; public keys come from --public-key-file and BALANCE_PUBLIC_KEYS, each
// "whpk_<base64>", and are enough to start without an HMAC key; a line that is not
// one, or a tolerance not above 0, stops the start.
func TestParseOptions(t *testing.T) {
	env := func(vars map[string]string) func(string) string {
		return func(k string) string { return vars[k] }
	}
	base := map[string]string{"DATABASE_URL": "postgres://127.0.0.1:1/x", "BALANCE_SIGNING_KEYS": "k"}
	o, err := parseOptions(nil, env(base))
	if err != nil {
		t.Fatal(err)
	}
	if o.tolerance != 5*time.Minute || !o.requireStandard || len(o.keys) != 1 || len(o.publicKeys) != 0 {
		t.Fatalf("defaults %+v", o)
	}
	o, err = parseOptions([]string{"--tolerance", "30s", "--require-standard-webhooks=false"}, env(base))
	if err != nil || o.tolerance != 30*time.Second || o.requireStandard {
		t.Fatalf("flags: %+v, %v", o, err)
	}

	_, priv1, _ := ed25519.GenerateKey(rand.Reader)
	_, priv2, _ := ed25519.GenerateKey(rand.Reader)
	pub1, pub2 := priv1.Public().(ed25519.PublicKey), priv2.Public().(ed25519.PublicKey)
	f := filepath.Join(t.TempDir(), "operator.pub")
	if err := os.WriteFile(f, []byte(webhooksig.FormatPublicKey(pub1)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	o, err = parseOptions([]string{"--public-key-file", f}, env(map[string]string{"DATABASE_URL": "postgres://127.0.0.1:1/x",
		"BALANCE_PUBLIC_KEYS": webhooksig.FormatPublicKey(pub2) + "\n"}))
	if err != nil || len(o.keys) != 0 || len(o.publicKeys) != 2 || !o.publicKeys[0].Equal(pub1) || !o.publicKeys[1].Equal(pub2) {
		t.Fatalf("public keys alone: %+v, %v", o, err)
	}

	for name, c := range map[string]struct {
		args []string
		vars map[string]string
		want string
	}{
		"a tolerance of 0":   {[]string{"--tolerance", "0s"}, base, "tolerance"},
		"a private key":      {nil, map[string]string{"DATABASE_URL": "x", "BALANCE_PUBLIC_KEYS": webhooksig.FormatPrivateKey(priv1)}, "public key 1"},
		"no key of any kind": {nil, map[string]string{"DATABASE_URL": "x"}, "no signing key"},
	} {
		if _, err := parseOptions(c.args, env(c.vars)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error about %q", name, err, c.want)
		}
	}
}
