// Command kubectl-rpa is the kubectl plugin for red-packet activities: put it on the
// PATH and run `kubectl rpa status NAME`, `kubectl rpa pause NAME`,
// `kubectl rpa token NAME USER`, `kubectl rpa replay-dead-letters NAME` or
// `kubectl rpa rain NAME --users N`. The commands are in internal/rpactl;
// docs/kubectl-rpa.md describes them.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"redpacket.io/operator/internal/rpactl"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	cmd := rpactl.NewCommand(rpactl.Streams{In: os.Stdin, Out: os.Stdout, ErrOut: os.Stderr})
	err := cmd.ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
