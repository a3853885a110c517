package node

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

// pluginVersion is the version stamped into the plugin this test builds.
const pluginVersion = "e2e-plugin"

// TestKubectlPlugin runs the kubectl-rpa plugin the way a user does: built from this
// tree, put on the PATH, and run by the real kubectl as `kubectl rpa`, with the
// node's kubeconfig. status shows the money table of a Ready activity; a token it
// mints is accepted by the grab pods; pause makes them answer paused and resume opens
// grabbing again; rain, through a port-forward to a grab pod via the API server,
// empties the activity with every check passing; settlement credits every grant,
// which status then shows; and replay-dead-letters reaches the dev Redis at the
// address given.
func TestKubectlPlugin(t *testing.T) {
	requireNode(t)
	const (
		name  = "plugin"
		total = int64(100000)
		count = int64(1000)
		users = 1500
	)
	pluginDir := buildPlugin(t)
	// rpa runs `kubectl rpa ARGS...`: the real kubectl finds the plugin on the PATH.
	rpa := func(args ...string) (string, error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, filepath.Join(env.node.BinDir, "kubectl"), append([]string{"rpa"}, args...)...)
		// REDIS_USERNAME and REDIS_PASSWORD: the operator's user, for replay-dead-letters
		// --redis-addr on the dev Redis, which refuses the default user.
		cmd.Env = append(os.Environ(), "KUBECONFIG="+env.node.Kubeconfig, "PATH="+pluginDir+string(os.PathListSeparator)+os.Getenv("PATH"),
			"REDIS_USERNAME="+env.redis.Options().Username, "REDIS_PASSWORD="+env.redis.Options().Password)
		var stdout, stderr strings.Builder
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		t.Logf("kubectl rpa %s\n%s", strings.Join(args, " "), stdout.String())
		if err != nil {
			return stdout.String(), fmt.Errorf("kubectl rpa %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
		}
		return stdout.String(), nil
	}
	mustRPA := func(args ...string) string {
		t.Helper()
		out, err := rpa(args...)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	line := func(out, first string) string {
		t.Helper()
		for _, l := range strings.Split(out, "\n") {
			if f := strings.Fields(l); len(f) > 0 && f[0] == first {
				return strings.Join(f, " ")
			}
		}
		t.Fatalf("no line starts with %q in\n%s", first, out)
		return ""
	}
	ns := namespace(t, "e2e-plugin")
	phase := func(want redpacketv1alpha1.Phase) {
		t.Helper()
		eventually(t, time.Minute, "phase "+string(want), func() error {
			if a := activity(t, ns, name); a.Status.Phase != want || a.Status.ObservedGeneration != a.Generation {
				return fmt.Errorf("phase %s, generation %d observed %d", a.Status.Phase, a.Generation, a.Status.ObservedGeneration)
			}
			return nil
		})
	}

	if out := mustRPA("version"); !strings.HasPrefix(out, "kubectl-rpa "+pluginVersion+" ") {
		t.Fatalf("kubectl rpa version printed %q", out)
	}

	kubectl(t, activityManifest(ns, name, total, count, 1), "apply", "-f", "-")
	kubectl(t, "", "-n", ns, "wait", "--for=condition=Ready", "rpa/"+name, "--timeout=180s")
	url := grabURL(t, ns, name)

	// status: the money table and the invariant of the fresh activity.
	out := mustRPA("status", name, "-n", ns)
	for first, want := range map[string]string{
		"Phase:":     "Phase: Active",
		"total":      "total 1000 100000 1000.00 CNY",
		"Invariant:": "Invariant: OK:",
		"Ready":      "Ready True",
	} {
		if got := line(out, first); !strings.HasPrefix(got, want) {
			t.Errorf("status: %q, want %q…", got, want)
		}
	}

	// token: the grab pods accept what the plugin mints from the activity's Secret.
	tok := strings.TrimSpace(mustRPA("token", name, "plugin-user-1", "-n", ns, "--ttl", "10m"))
	grab := func(user, token string) (int, string) {
		t.Helper()
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, url+"/v1/grab", strings.NewReader(`{"userId":"`+user+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, string(body)
	}
	if code, body := grab("plugin-user-1", tok); code != http.StatusOK || !strings.Contains(body, `"granted"`) {
		t.Fatalf("grab with the plugin's token: HTTP %d %s", code, body)
	}

	// pause and resume: the grab pods follow spec.paused.
	if out := mustRPA("pause", name, "-n", ns); out != "redpacketactivity.redpacket.io/"+name+" paused\n" {
		t.Errorf("pause printed %q", out)
	}
	phase(redpacketv1alpha1.PhasePaused)
	tok2 := strings.TrimSpace(mustRPA("token", name, "plugin-user-2", "-n", ns))
	eventually(t, 30*time.Second, "the grab pods to answer paused", func() error {
		if code, body := grab("plugin-user-2", tok2); code != http.StatusConflict || !strings.Contains(body, `"paused"`) {
			return fmt.Errorf("HTTP %d %s", code, body)
		}
		return nil
	})
	mustRPA("resume", name, "-n", ns)
	phase(redpacketv1alpha1.PhaseActive)
	eventually(t, 30*time.Second, "the grab pods to grant again", func() error {
		if code, body := grab("plugin-user-2", tok2); code != http.StatusOK {
			return fmt.Errorf("HTTP %d %s", code, body)
		}
		return nil
	})

	// rain: through a port-forward to a grab pod, more users than packets left.
	start := time.Now()
	out = mustRPA("rain", name, "-n", ns, "--users", fmt.Sprint(users), "--connections", "16")
	t.Logf("the rain took %s", time.Since(start).Round(100*time.Millisecond))
	if !strings.Contains(out, "through a port-forward to pod "+name+"-grab-") {
		t.Errorf("the rain did not go through a port-forward to a grab pod")
	}
	if got, want := line(out, "granted"), fmt.Sprintf("granted %d", count-2); got != want {
		t.Errorf("rain: %q, want %q", got, want)
	}
	if strings.Contains(out, "FAILED") || strings.Count(out, " OK ") < 5 {
		t.Errorf("rain checks:\n%s", out)
	}

	// Settlement credits every grant, and status shows it.
	eventually(t, 3*time.Minute, "the activity to be Exhausted and settled", func() error {
		st := activity(t, ns, name).Status
		if st.Phase != redpacketv1alpha1.PhaseExhausted || val(st.SettledCount) != count {
			return fmt.Errorf("phase %s settled %d", st.Phase, val(st.SettledCount))
		}
		return nil
	})
	out = mustRPA("status", name, "-n", ns)
	for first, want := range map[string]string{
		"Phase:":     "Phase: Exhausted",
		"claimed":    fmt.Sprintf("claimed %d %d", count, total),
		"remaining":  "remaining 0 0",
		"Invariant:": "Invariant: OK:",
		"packets":    fmt.Sprintf("packets %d %d 100%%", count, count),
		"amount":     fmt.Sprintf("amount %d %d 100%%", total, total),
	} {
		if got := line(out, first); !strings.HasPrefix(got, want) {
			t.Errorf("status after the rain: %q, want %q…", got, want)
		}
	}
	uid := string(activity(t, ns, name).UID)
	credited, _ := booked(t, uid)
	if int64(len(credited)) != count {
		t.Errorf("the balance system booked %d grants, want %d", len(credited), count)
	}

	// replay-dead-letters: the activity is on the operator's default Redis, which the
	// plugin reaches at the address given (the dev Redis's ClusterIP); nothing is parked.
	if _, err := rpa("replay-dead-letters", name, "-n", ns); err == nil || !strings.Contains(err.Error(), "--redis-addr") {
		t.Errorf("replay without a Redis address: %v; want an error naming --redis-addr", err)
	}
	if out := mustRPA("replay-dead-letters", name, "-n", ns, "--redis-addr", env.redis.Options().Addr); !strings.Contains(out, "moved 0 of 0 dead letters") {
		t.Errorf("replay printed %q", out)
	}

	kubectl(t, "", "-n", ns, "delete", "rpa", name, "--timeout=120s")
}
