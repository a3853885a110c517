package redistest

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"
)

// A server stopped or killed while a child it forked is writing (a BGSAVE slowed down
// key by key) takes the child with it: nothing writes into its directory afterwards,
// so the test's cleanup can remove it.
func TestStopAndKillEndForkedChildren(t *testing.T) {
	for name, end := range map[string]func(*Server) error{
		"Stop": func(s *Server) error { s.Stop(); return nil },
		"Kill": (*Server).Kill,
	} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dir := t.TempDir()
			s, err := StartProcess(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Stop()
			c := s.Client(t)
			for i := range 20 {
				if err := c.Set(ctx, "k"+strconv.Itoa(i), i, 0).Err(); err != nil {
					t.Fatal(err)
				}
			}
			// One second per key: the child writes for about 20 s unless it is killed.
			if err := c.ConfigSet(ctx, "rdb-key-save-delay", "1000000").Err(); err != nil {
				t.Fatal(err)
			}
			if err := c.BgSave(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			pid := s.cmd.Process.Pid
			var children []int
			for deadline := time.Now().Add(5 * time.Second); len(children) == 0; {
				if time.Now().After(deadline) {
					t.Fatal("BGSAVE forked no child")
				}
				children = childrenOf(pid)
				time.Sleep(10 * time.Millisecond)
			}

			if err := end(s); err != nil {
				t.Fatal(err)
			}
			for _, child := range children {
				if _, state, ok := procStat(child); ok && state != 'Z' && state != 'X' {
					t.Errorf("child %d of the ended server is still running (state %c)", child, state)
				}
			}
			if _, _, ok := procStat(pid); ok {
				t.Errorf("the server %d is still there", pid)
			}
			// The directory stays as the end left it: no temp file appears later.
			before, err := os.ReadDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond)
			after, err := os.ReadDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			if len(after) != len(before) {
				t.Errorf("%d entries in the server's directory after its end, then %d", len(before), len(after))
			}
		})
	}
}
