package balance

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed migrations/*.sql
var migrations embed.FS

// migrationLock is the advisory lock key that serializes Migrate across processes
// (two replicas starting at once): "balance migrations" as an integer.
const migrationLock = 0x62616c616e6365

// Migrate brings the database's schema up to the migrations embedded in the binary
// and returns the names of those it applied (none when it was up to date). Each
// migration runs once, in name order, recorded in schema_migrations; all of it runs
// in one transaction under an advisory lock, so concurrent calls and a crash half-way
// leave either the old schema or the new one.
func Migrate(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	names, err := fs.Glob(migrations, "migrations/*.sql")
	if err != nil {
		return nil, fmt.Errorf("listing the migrations: %w", err)
	}
	slices.Sort(names)
	var applied []string
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", int64(migrationLock)); err != nil {
			return fmt.Errorf("locking the schema: %w", err)
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
			name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			return fmt.Errorf("creating schema_migrations: %w", err)
		}
		for _, name := range names {
			var done bool
			if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM schema_migrations WHERE name = $1)", name).Scan(&done); err != nil {
				return fmt.Errorf("reading schema_migrations: %w", err)
			}
			if done {
				continue
			}
			sql, err := migrations.ReadFile(name)
			if err != nil {
				return fmt.Errorf("reading %s: %w", name, err)
			}
			if _, err := tx.Exec(ctx, string(sql)); err != nil {
				return fmt.Errorf("applying %s: %w", name, err)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO schema_migrations (name) VALUES ($1)", name); err != nil {
				return fmt.Errorf("recording %s: %w", name, err)
			}
			applied = append(applied, name)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("migrating the balance database: %w", err)
	}
	return applied, nil
}
