package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"redpacket.io/operator/settlement/reconcilebench"
	"redpacket.io/operator/test/pgtest"
	"redpacket.io/operator/test/redistest"
)

// reconcileRun is (n): one reconciliation round of a budget whose ledger paid a
// million credits against the reference balance system's book on PostgreSQL, which
// differs in 10 keys (reconcilebench, as BenchmarkReconcileAMillionCredits runs it).
type reconcileRun struct {
	res reconcilebench.Result
}

// measureReconcile starts a PostgreSQL cluster and a redis-server of its own, runs
// reconcilebench with credits credits and removes both.
func measureReconcile(ctx context.Context, credits int) (reconcileRun, error) {
	fmt.Printf("(n) reconciliation: %d credits differing in %d keys ... ", credits, reconcilebench.Differences)
	pg, err := pgtest.StartProcess()
	if err != nil {
		return reconcileRun{}, fmt.Errorf("starting PostgreSQL (make postgres installs it): %w", err)
	}
	defer pg.Remove()
	dsn, err := pg.NewDatabase(ctx)
	if err != nil {
		return reconcileRun{}, err
	}
	dir, err := os.MkdirTemp("", "redpacket-reconcile-")
	if err != nil {
		return reconcileRun{}, err
	}
	defer os.RemoveAll(dir)
	srv, err := redistest.StartProcess(dir)
	if err != nil {
		return reconcileRun{}, fmt.Errorf("starting redis-server: %w", err)
	}
	defer srv.Stop()
	rdb := redis.NewClient(srv.Options())
	defer rdb.Close()
	res, err := reconcilebench.Measure(ctx, reconcilebench.Config{DSN: dsn, Redis: rdb, Credits: credits})
	if err != nil {
		return reconcileRun{}, fmt.Errorf("reconciliation: %w", err)
	}
	fmt.Printf("%s, peak heap %.1f MB\n", res.Round.Round(time.Millisecond), mb(res.PeakHeap))
	return reconcileRun{res: res}, nil
}

func mb(b uint64) float64 { return float64(b) / (1 << 20) }

func (r reconcileRun) summary() string {
	return fmt.Sprintf("(n) reconciliation of %d credits differing in %d keys: %.1f s, operator heap at most %.1f MB in use (%.0f MB allocated)\n",
		r.res.Credits, reconcilebench.Differences, r.res.Round.Seconds(), mb(r.res.PeakHeap), mb(r.res.Allocated))
}

// markdown is reconciliation's section of docs/benchmarks.md.
func (r reconcileRun) markdown() string {
	var out strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&out, format, args...) }
	p("## Reconciliation with the balance system\n\n")
	p("One round of `settlement.Reconciler` ([operations.md](operations.md#reconciliation)) for a budget whose\n")
	p("ledger paid %d credits (packets of 10 shares, in a redis-server of its own), against the reference\n", r.res.Credits)
	p("balance system's book on PostgreSQL (a cluster of its own, fsync on), which lost %d of them and holds %d\n",
		reconcilebench.Differences/2, reconcilebench.Differences/2)
	p("the operator never paid: the round pages through both sides, delivers the %d again and names the %d\n",
		reconcilebench.Differences/2, reconcilebench.Differences/2)
	p("(`settlement/reconcilebench`, which `BenchmarkReconcileAMillionCredits` runs too). The issue asks for the\n")
	p("time and the operator's memory of a source of %d credits differing in %d keys; it sets no bound.\n\n",
		reconcilebench.GoalCredits, reconcilebench.Differences)
	p("| figure | value |\n|---|---:|\n")
	p("| credits | %d |\n", r.res.Credits)
	p("| the round | **%.1f s** |\n", r.res.Round.Seconds())
	p("| operator heap in use, peak during the round (sampled every 10 ms) | **%.1f MB** |\n", mb(r.res.PeakHeap))
	p("| allocated during the round | %.0f MB |\n\n", mb(r.res.Allocated))
	return out.String()
}
