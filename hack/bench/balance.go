package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"redpacket.io/operator/internal/balance/grantbench"
	"redpacket.io/operator/test/pgtest"
)

// balanceRun is (m): grants of one budget booked by the reference balance system
// (internal/balance) over HTTP into a PostgreSQL cluster of its own, fsync and
// synchronous_commit on, against plain inserts on the same server and pool in the
// same run (grantbench.Measure, as BenchmarkGrantsIntoPostgres runs it).
type balanceRun struct {
	res             grantbench.Result
	postgresVersion string
}

// measureBalance starts a throwaway PostgreSQL cluster (test/pgtest), measures
// grants grants against as many plain inserts on it, and removes the cluster.
func measureBalance(ctx context.Context, grants int) (balanceRun, error) {
	fmt.Printf("(m) the balance system: %d grants into PostgreSQL, and as many plain inserts ... ", grants)
	// PostgreSQL's own default cache (the test harness keeps 32MB): a balance
	// system's server is not sized like a test's.
	pg, err := pgtest.StartProcessWith("shared_buffers=128MB")
	if err != nil {
		return balanceRun{}, fmt.Errorf("starting PostgreSQL (make postgres installs it): %w", err)
	}
	defer pg.Remove()
	dsn, err := pg.NewDatabase(ctx)
	if err != nil {
		return balanceRun{}, err
	}
	var run balanceRun
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return balanceRun{}, fmt.Errorf("connecting to PostgreSQL: %w", err)
	}
	var version string
	err = conn.QueryRow(ctx, "SHOW server_version").Scan(&version)
	_ = conn.Close(ctx)
	if err != nil {
		return balanceRun{}, fmt.Errorf("reading PostgreSQL's version: %w", err)
	}
	// "15.20 (Debian 15.20-0+deb12u1)": the version is the first word.
	if f := strings.Fields(version); len(f) > 0 {
		run.postgresVersion = f[0]
	}
	if run.res, err = grantbench.Measure(ctx, grantbench.Config{DSN: dsn, Grants: grants}); err != nil {
		return balanceRun{}, fmt.Errorf("the balance system: %w", err)
	}
	fmt.Printf("%s (%.0f grants/s), plain inserts %.0f/s, ratio %.2f\n", run.res.Booked.Round(time.Millisecond),
		run.res.GrantsPerSecond(), run.res.PlainPerSecond(), run.res.Ratio())
	return run, nil
}

// goalGrantsWithin is how long grantbench.GoalGrants grants may take.
const goalGrantsWithin = grantbench.GoalSeconds * time.Second

// seconds100k is how long the goal's 100,000 grants take: measured when the run
// booked that many, projected from the rate otherwise.
func (b balanceRun) seconds100k() float64 { return b.res.SecondsFor(grantbench.GoalGrants) }

// measuredOrProjected says which seconds100k is.
func (b balanceRun) measuredOrProjected() string {
	if b.res.Grants == grantbench.GoalGrants {
		return "measured"
	}
	return fmt.Sprintf("projected from %d grants", b.res.Grants)
}

// meetsOrMisses is "meets" when ok, else "misses".
func meetsOrMisses(ok bool) string {
	if ok {
		return "meets"
	}
	return "misses"
}

func (b balanceRun) summary() string {
	s := b.seconds100k()
	return fmt.Sprintf("(m) balance system on PostgreSQL %s: %d grants booked in %s (%.0f grants/s); 100,000 grants in %.1f s (%s; %s the goal of ≤ %d s); "+
		"plain inserts %.0f/s; ratio %.2f (%s the goal of ≥ %.1f)\n",
		b.postgresVersion, b.res.Grants, b.res.Booked.Round(time.Millisecond), b.res.GrantsPerSecond(), s, b.measuredOrProjected(),
		meetsOrMisses(s <= goalGrantsWithin.Seconds()), grantbench.GoalSeconds,
		b.res.PlainPerSecond(), b.res.Ratio(), meetsOrMisses(b.res.Ratio() >= grantbench.GoalRatio), grantbench.GoalRatio)
}

// markdown is the balance system's section of docs/benchmarks.md.
func (b balanceRun) markdown() string {
	var out strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&out, format, args...) }
	r := b.res
	p("## The reference balance system\n\n")
	p("`internal/balance` booking %d grants of one budget, posted over loopback HTTP by %d clients and\n", r.Grants, r.Clients)
	p("signed as the operator signs them, into PostgreSQL %s (a cluster of its own from `test/pgtest`,\n", b.postgresVersion)
	p("fsync and synchronous_commit on), and in the same run on the same server and pool %d plain\n", r.Grants)
	p("`INSERT … ON CONFLICT DO NOTHING` of the same keys by %d clients, the reference\n", r.Clients)
	p("(`internal/balance/grantbench`, which `BenchmarkGrantsIntoPostgres` runs too). The grants of\n")
	p("the budget share transactions and commits (group commit: [balance.md](balance.md#throughput)).\n\n")
	p("| figure | value | goal |\n|---|---:|---:|\n")
	p("| grants booked | %d in %s, %.0f/s | |\n", r.Grants, r.Booked.Round(time.Millisecond), r.GrantsPerSecond())
	p("| plain inserts | %d in %s, %.0f/s | |\n", r.Grants, r.Plain.Round(time.Millisecond), r.PlainPerSecond())
	p("| seconds for 100,000 grants (%s) | **%.1f** | ≤ %d (%s) |\n", b.measuredOrProjected(), b.seconds100k(),
		grantbench.GoalSeconds, meetsOrMisses(b.seconds100k() <= goalGrantsWithin.Seconds()))
	p("| grants/s ÷ plain inserts/s | **%.2f** | ≥ %.1f (%s) |\n\n", r.Ratio(), grantbench.GoalRatio,
		meetsOrMisses(r.Ratio() >= grantbench.GoalRatio))
	return out.String()
}
