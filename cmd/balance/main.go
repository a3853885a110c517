// Command balance is the reference balance system: it receives the operator's
// settlement webhook, books every credit once in PostgreSQL within the budget the
// operator announced, and serves a small read API (docs/balance.md). It applies its
// schema migrations, embedded in the binary, when it starts.
//
// Usage:
//
//	balance --database-url postgres://... --signing-key-file /keys/key [flags]
//	balance --version
//
// The database URL may come from DATABASE_URL instead, and the signing keys from
// BALANCE_SIGNING_KEYS (one key per line), so that neither shows in the process's
// arguments.
package main

import (
	"bufio"
	"bytes"
	"context"
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
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "balance:", err)
		os.Exit(1)
	}
}

// keyFiles is the repeatable --signing-key-file flag.
type keyFiles []string

func (k *keyFiles) String() string     { return strings.Join(*k, ",") }
func (k *keyFiles) Set(v string) error { *k = append(*k, v); return nil }

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("balance", flag.ContinueOnError)
	listen := fs.String("listen", ":8080", "address to serve the webhook and the read API on")
	dsn := fs.String("database-url", "", "PostgreSQL connection string (default: $DATABASE_URL)")
	var files keyFiles
	fs.Var(&files, "signing-key-file", "a file of X-Signature keys, one per line (repeatable; also $BALANCE_SIGNING_KEYS, one per line); every key is accepted, for rotations")
	insecure := fs.Bool("insecure-skip-signature", false, "accept unsigned deliveries (tests and demos only)")
	maxConns := fs.Int("max-conns", 16, "most connections to PostgreSQL")
	timeout := fs.Duration("request-timeout", 10*time.Second, "bound on each request's work in the database")
	showVersion := fs.Bool("version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *showVersion {
		fmt.Println(version.String("balance"))
		return nil
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))

	if *dsn == "" {
		*dsn = os.Getenv("DATABASE_URL")
	}
	if *dsn == "" {
		return errors.New("no database: set --database-url or DATABASE_URL")
	}
	keys, err := loadKeys(files, os.Getenv("BALANCE_SIGNING_KEYS"))
	if err != nil {
		return err
	}
	if len(keys) == 0 && !*insecure {
		return errors.New("no signing key: give --signing-key-file or BALANCE_SIGNING_KEYS (or --insecure-skip-signature for a test)")
	}

	pcfg, err := pgxpool.ParseConfig(*dsn)
	if err != nil {
		return fmt.Errorf("parsing the database URL: %w", err)
	}
	pcfg.MaxConns = int32(*maxConns)
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

	l, err := net.Listen("tcp", *listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", *listen, err)
	}
	srv := &http.Server{
		Handler:           balance.Handler(balance.Config{Book: balance.NewBook(pool), Keys: keys, Log: log, Timeout: *timeout}),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
	}
	log.Info("serving", "addr", l.Addr().String(), "signingKeys", len(keys), "version", version.String("balance"))
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
			return nil, fmt.Errorf("reading signing keys: %w", err)
		}
		add(b)
	}
	add([]byte(env))
	return keys, nil
}
