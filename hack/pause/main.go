// Command pause is the pod sandbox ("pause") process of the project's images: it holds
// a pod's namespaces open and does nothing else. As PID 1 of a pod with a shared
// process namespace it also reaps the zombies that are reparented to it. It runs
// until SIGTERM or SIGINT, then reaps what is left and exits 0.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 16)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	// Children that exited before the handler was in place sent their SIGCHLD already.
	reap()
	for sig := range sigs {
		reap()
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
	}
}

// reap waits for every child that has exited, without blocking. One SIGCHLD can stand
// for several children, so it loops until none is left.
func reap() {
	for {
		var status syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
	}
}
