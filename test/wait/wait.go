// Package wait polls a condition in tests until it holds or a deadline passes, so
// tests wait for what they expect instead of sleeping for a fixed time.
package wait

import (
	"testing"
	"time"
)

// Interval is how often Until checks its condition.
const Interval = 20 * time.Millisecond

// Until checks cond every Interval until it returns true, and fails the test if it
// has not within the given time. cond's second result says what it saw, for the
// failure message.
func Until(tb testing.TB, within time.Duration, what string, cond func() (bool, string)) {
	tb.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, seen := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("%s did not happen within %s; last seen: %s", what, within, seen)
		}
		time.Sleep(Interval)
	}
}
