// Command balance is the reference balance system: it receives the operator's
// settlement webhook, books every credit once in PostgreSQL within the budget the
// operator announced, and serves a small read API (docs/balance.md). It applies its
// schema migrations, embedded in the binary, when it starts.
//
// Usage:
//
//	balance --database-url postgres://... --signing-key-file /keys/key [flags]
//	balance --database-url postgres://... --public-key-file /keys/operator.pub [flags]
//	balance --version
//
// It verifies the Standard Webhooks signatures of every delivery: v1 with the HMAC
// keys, v1a with the operator's Ed25519 public keys, and a webhook-timestamp within
// --tolerance (5 minutes) of its clock. The database URL may come from DATABASE_URL
// instead, the HMAC keys from BALANCE_SIGNING_KEYS and the public keys from
// BALANCE_PUBLIC_KEYS (one key per line), so that none shows in the process's
// arguments.
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/internal/version"
	"redpacket.io/operator/pkg/webhooksig"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "balance:", err)
		os.Exit(1)
	}
}

// fileList is a repeatable flag of file names.
type fileList []string

func (k *fileList) String() string     { return strings.Join(*k, ",") }
func (k *fileList) Set(v string) error { *k = append(*k, v); return nil }

// options are the command's flags, read.
type options struct {
	listen, dsn string
	// keys are the HMAC keys (v1, and X-Signature where accepted); publicKeys the
	// operator's Ed25519 public keys (v1a).
	keys       [][]byte
	publicKeys []ed25519.PublicKey
	tolerance  time.Duration
	// requireStandard refuses a request without the Standard Webhooks headers.
	requireStandard bool
	maxConns        int
	timeout         time.Duration
	version         bool
}

// parseOptions reads args, and the environment through getenv: DATABASE_URL,
// BALANCE_SIGNING_KEYS and BALANCE_PUBLIC_KEYS. It refuses to go on without a
// database, or without any key unless --insecure-skip-signature.
func parseOptions(args []string, getenv func(string) string) (options, error) {
	fs := flag.NewFlagSet("balance", flag.ContinueOnError)
	var o options
	fs.StringVar(&o.listen, "listen", ":8080", "address to serve the webhook and the read API on")
	fs.StringVar(&o.dsn, "database-url", "", "PostgreSQL connection string (default: $DATABASE_URL)")
	var keyFiles, publicKeyFiles fileList
	fs.Var(&keyFiles, "signing-key-file", "a file of HMAC keys, one per line, as the operator's keys Secret holds them: they verify v1 signatures (repeatable; also $BALANCE_SIGNING_KEYS, one per line); every key is accepted, for rotations")
	fs.Var(&publicKeyFiles, "public-key-file", "a file of the operator's Ed25519 public keys, \"whpk_<base64>\" one per line: they verify v1a signatures (repeatable; also $BALANCE_PUBLIC_KEYS, one per line); every key is accepted, for rotations")
	fs.DurationVar(&o.tolerance, "tolerance", webhooksig.DefaultTolerance, "refuse a request whose webhook-timestamp is further than this from this host's clock, either way (a captured request replayed later)")
	fs.BoolVar(&o.requireStandard, "require-standard-webhooks", true, "refuse a request without the Standard Webhooks headers; false also accepts X-Signature alone, as an operator of an earlier release sends it, which a captured request can be replayed with at any time")
	insecure := fs.Bool("insecure-skip-signature", false, "accept unsigned deliveries (tests and demos only)")
	fs.IntVar(&o.maxConns, "max-conns", 16, "most connections to PostgreSQL")
	fs.DurationVar(&o.timeout, "request-timeout", 10*time.Second, "bound on each request's work in the database")
	fs.BoolVar(&o.version, "version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return options{}, err
	}
	if o.version {
		return o, nil
	}
	if o.tolerance <= 0 {
		return options{}, fmt.Errorf("--tolerance %s: it must be above 0", o.tolerance)
	}
	if o.dsn == "" {
		o.dsn = getenv("DATABASE_URL")
	}
	if o.dsn == "" {
		return options{}, errors.New("no database: set --database-url or DATABASE_URL")
	}
	var err error
	if o.keys, err = loadKeys(keyFiles, getenv("BALANCE_SIGNING_KEYS")); err != nil {
		return options{}, err
	}
	if o.publicKeys, err = loadPublicKeys(publicKeyFiles, getenv("BALANCE_PUBLIC_KEYS")); err != nil {
		return options{}, err
	}
	if len(o.keys) == 0 && len(o.publicKeys) == 0 && !*insecure {
		return options{}, errors.New("no signing key: give --signing-key-file or BALANCE_SIGNING_KEYS, --public-key-file or BALANCE_PUBLIC_KEYS (or --insecure-skip-signature for a test)")
	}
	return o, nil
}

func run(ctx context.Context, args []string) error {
	o, err := parseOptions(args, os.Getenv)
	if err != nil {
		return err
	}
	if o.version {
		fmt.Println(version.String("balance"))
		return nil
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))

	pcfg, err := pgxpool.ParseConfig(o.dsn)
	if err != nil {
		return fmt.Errorf("parsing the database URL: %w", err)
	}
	pcfg.MaxConns = int32(o.maxConns)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("connecting to PostgreSQL: %w", err)
	}
	defer pool.Close()
	applied, err := migrateWithRetry(ctx, pool, log)
	if err != nil {
		return err
	}
	log.Info("schema up to date", "applied", applied)

	l, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", o.listen, err)
	}
	srv := &http.Server{
		Handler: balance.Handler(balance.Config{Book: balance.NewBook(pool), Keys: o.keys, PublicKeys: o.publicKeys,
			Tolerance: o.tolerance, AcceptXSignature: !o.requireStandard, Log: log, Timeout: o.timeout}),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
	}
	log.Info("serving", "addr", l.Addr().String(), "signingKeys", len(o.keys), "publicKeys", len(o.publicKeys),
		"tolerance", o.tolerance, "requireStandardWebhooks", o.requireStandard, "version", version.String("balance"))
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serving: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("shutting down: %w", err)
	}
	return nil
}

// migrateWithRetry applies the migrations, waiting up to a minute for a database
// that is still starting.
func migrateWithRetry(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) ([]string, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		applied, err := balance.Migrate(ctx, pool)
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return applied, err
		}
		log.Warn("migrating; retrying", "err", err)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// loadPublicKeys reads the operator's Ed25519 public keys: every non-empty line of
// every file, then of env, each "whpk_<base64>".
func loadPublicKeys(files []string, env string) ([]ed25519.PublicKey, error) {
	lines, err := loadKeys(files, env)
	if err != nil {
		return nil, err
	}
	keys := make([]ed25519.PublicKey, 0, len(lines))
	for i, l := range lines {
		k, err := webhooksig.ParsePublicKey(l)
		if err != nil {
			return nil, fmt.Errorf("public key %d: %w", i+1, err)
		}
		keys = append(keys, k)
	}
	return keys, nil
}

// loadKeys reads the signing keys: every non-empty line of every file, then of env.
// A line's bytes are the key, as the operator's Secret holds it (settlement.Sign).
func loadKeys(files []string, env string) ([][]byte, error) {
	var keys [][]byte
	add := func(text []byte) {
		sc := bufio.NewScanner(bytes.NewReader(text))
		for sc.Scan() {
			if line := strings.TrimRight(sc.Text(), "\r"); line != "" {
				keys = append(keys, []byte(line))
			}
		}
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("reading keys: %w", err)
		}
		add(b)
	}
	add([]byte(env))
	return keys, nil
}
