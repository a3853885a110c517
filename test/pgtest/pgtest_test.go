package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// A row committed before a kill -9 of the whole server is there after a restart on
// the same data directory and port; the unix socket, the data and the log live in
// the cluster's own directory, which Remove deletes.
func TestKillAndRestartKeepCommittedRows(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	s := Start(t)
	dsn, err := s.NewDatabase(ctx)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	var fsync string
	if err := conn.QueryRow(ctx, "SHOW fsync").Scan(&fsync); err != nil || fsync != "on" {
		t.Fatalf("fsync = %q (%v), want on", fsync, err)
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE t (k int PRIMARY KEY); INSERT INTO t VALUES (1), (2)"); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close(ctx)

	port := s.Port
	if err := s.Kill(); err != nil {
		t.Fatal(err)
	}
	if _, err := pgx.Connect(ctx, dsn); err == nil {
		t.Fatal("a connection after the kill succeeded")
	}
	if err := s.Restart(); err != nil {
		t.Fatal(err)
	}
	if s.Port != port {
		t.Fatalf("restarted on port %d, want %d", s.Port, port)
	}
	conn, err = pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&n); err != nil || n != 2 {
		t.Fatalf("%d rows after the restart (%v), want 2", n, err)
	}

	dir := s.Dir
	s.Remove()
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("the cluster's directory %s is still there after Remove (%v)", dir, err)
	}
}

// recorder is a testing.TB that records how a test was ended.
type recorder struct {
	testing.TB
	fatal, skip string
}

func (r *recorder) Helper()                        {}
func (r *recorder) Fatalf(format string, a ...any) { r.fatal = fmt.Sprintf(format, a...) }
func (r *recorder) Skipf(format string, a ...any)  { r.skip = fmt.Sprintf(format, a...) }

// A missing PostgreSQL fails the test under CI=true and skips it elsewhere.
func TestMissingPostgresFailsUnderCI(t *testing.T) {
	err := errors.New("initdb not found")
	t.Setenv("CI", "true")
	r := &recorder{TB: t}
	missing(r, err)
	if r.fatal == "" || r.skip != "" {
		t.Fatalf("under CI=true: fatal %q, skip %q", r.fatal, r.skip)
	}
	t.Setenv("CI", "")
	r = &recorder{TB: t}
	missing(r, err)
	if r.fatal != "" || r.skip == "" {
		t.Fatalf("without CI: fatal %q, skip %q", r.fatal, r.skip)
	}
}
