package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
)

// eventsRun is what BenchmarkGrabsWithAStuckEventsReceiver (grabsvc) reported: grabs
// per second through HTTP of three budgets alike but for their events, in the same
// run: none, events workers against a receiver that never answers, and against one
// that answers at once.
type eventsRun struct {
	iterations           int
	off, stuck, healthy  float64
	load1Before, load1At string
}

// eventsIterations is -benchtime of the benchmark: each iteration grabs 5,000 shares
// of each budget.
const eventsIterations = 10

// measureEvents runs BenchmarkGrabsWithAStuckEventsReceiver in a child go test and
// reads its metrics.
func measureEvents(ctx context.Context, root string) (eventsRun, error) {
	r := eventsRun{iterations: eventsIterations, load1Before: load1()}
	fmt.Print("(l) grabs with a stuck events receiver: go test -bench BenchmarkGrabsWithAStuckEventsReceiver ./grabsvc ... ")
	// A line another goroutine prints while the benchmark runs can split its result
	// line; such a run is made once more.
	for attempt := 1; ; attempt++ {
		cmd := exec.CommandContext(ctx, "go", "test", "-run", "^$", "-bench", "^BenchmarkGrabsWithAStuckEventsReceiver$",
			"-benchtime", fmt.Sprintf("%dx", eventsIterations), "-count", "1", "./grabsvc")
		cmd.Dir = root
		cmd.Stderr = os.Stderr
		b, err := cmd.Output()
		if err != nil {
			return r, fmt.Errorf("BenchmarkGrabsWithAStuckEventsReceiver: %w\n%s", err, b)
		}
		r.load1At = load1()
		m := benchMetrics(b, "BenchmarkGrabsWithAStuckEventsReceiver")
		r.off, r.stuck, r.healthy = m["grabs/s-events-off"], m["grabs/s-events-stuck"], m["grabs/s-events-healthy"]
		if r.off != 0 && r.stuck != 0 && r.healthy != 0 {
			break
		}
		if attempt == 2 {
			return r, fmt.Errorf("BenchmarkGrabsWithAStuckEventsReceiver printed no figures:\n%s", b)
		}
		fmt.Printf("no figures in its output, once more:\n%s\n", b)
	}
	fmt.Printf("%.0f grabs/s without events, %.0f with a stuck receiver (%.3f), %.0f with a healthy one (%.3f)\n",
		r.off, r.stuck, ratio(r.stuck, r.off), r.healthy, ratio(r.healthy, r.off))
	return r, nil
}

// eventsMarkdown is the events' part of section (l).
func eventsMarkdown(r eventsRun) string {
	if r.off == 0 {
		return ""
	}
	var s strings.Builder
	s.WriteString("\n### Packet events\n\n")
	fmt.Fprintf(&s, "`BenchmarkGrabsWithAStuckEventsReceiver` (grabsvc): three budgets of 16 shards, each on a redis-server "+
		"of its own with its packet server over HTTP and its settlement workers crediting every grant to a balance "+
		"system that answers at once; one without `spec.events`, one whose events workers run from the start against "+
		"a receiver that holds every request and never answers, one whose receiver answers at once "+
		"([budgets.md](budgets.md#events)). Each of %d iterations creates 1,000 packets of 5 shares on each budget "+
		"in turn (not timed) and grabs their 5,000 shares from 64 keep-alive clients (timed).\n\n", r.iterations)
	s.WriteString("| events | grabs/s | ÷ without events (goal for a stuck receiver: within 5 %) | load average |\n")
	s.WriteString("|---|---:|---:|---:|\n")
	fmt.Fprintf(&s, "| none | %.0f | 1 | %s to %s |\n", r.off, r.load1Before, r.load1At)
	fmt.Fprintf(&s, "| receiver stuck | %.0f | **%.3f** | |\n", r.stuck, ratio(r.stuck, r.off))
	fmt.Fprintf(&s, "| receiver answering | %.0f | %.3f | |\n", r.healthy, ratio(r.healthy, r.off))
	return s.String()
}
