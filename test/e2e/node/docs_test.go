package node

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"redpacket.io/operator/test/doclines"
)

// TestDocsShellLines runs the shell lines of README.md and docs/*.md that the rules
// of test/doclines classify as runnable, on this suite's node, as a user would type
// them: each document's lines in order in one bash, from the repository root, with
// the node's KUBECONFIG and a PATH that starts with a kubectl-rpa built from this tree
// and bin/ (kubectl). The variables the docs use ($ENDPOINT, $TOKEN, $SENDER_TOKEN,
// ...) come from the docs' own lines (port-forwards, Secrets, the plugin). Every line
// must exit 0. A line no rule classifies fails the test before anything runs.
//
// The README's quick start creates the samples (config/samples and
// config/samples/signed) and their keys in the namespace default; the documents after
// it use them, and the test deletes them at the end.
func TestDocsShellLines(t *testing.T) {
	requireNode(t)
	classified, err := doclines.LoadClassified(env.root)
	if err != nil {
		t.Fatal(err)
	}
	var docs []string
	byDoc := map[string][]doclines.Line{}
	skipped := 0
	for _, c := range classified {
		if !c.Rule.Run {
			skipped++
			continue
		}
		if byDoc[c.Doc] == nil {
			docs = append(docs, c.Doc)
		}
		byDoc[c.Doc] = append(byDoc[c.Doc], c.Line)
	}
	t.Logf("%d shell lines: %d run here, %d do not (each with its reason in test/doclines/rules.go)",
		len(classified), len(classified)-skipped, skipped)

	pluginDir := buildPlugin(t)
	path := pluginDir + string(os.PathListSeparator) + env.node.BinDir + string(os.PathListSeparator) + os.Getenv("PATH")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := env.node.Kubectl(ctx, "", "delete", "--ignore-not-found", "--wait=false",
			"-f", filepath.Join(env.root, "config", "samples"), "-f", filepath.Join(env.root, "config", "samples", "signed"),
			"-f", filepath.Join(env.root, "config", "samples", "quotas")); err != nil {
			t.Logf("deleting the samples: %v", err)
		}
		if _, err := env.node.Kubectl(ctx, "", "delete", "--ignore-not-found", "secret", "grab-hmac"); err != nil {
			t.Logf("deleting the token key: %v", err)
		}
	})
	for _, doc := range docs {
		if !t.Run(doc, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, "bash", "-c", doclines.Script(byDoc[doc]))
			cmd.Dir = env.root
			cmd.Env = append(os.Environ(), "KUBECONFIG="+env.node.Kubeconfig, "PATH="+path)
			// The port-forwards a document sends to the background hold the output
			// open; they end with bash (its EXIT trap), and this bounds the wait.
			cmd.WaitDelay = 10 * time.Second
			var stdout, stderr strings.Builder
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			start := time.Now()
			err := cmd.Run()
			t.Logf("%d lines of %s in %s:\n%s", len(byDoc[doc]), doc, time.Since(start).Round(100*time.Millisecond), stdout.String())
			if err != nil {
				t.Fatalf("%s: %v\n%s", doc, err, stderr.String())
			}
			if s := stderr.String(); s != "" {
				t.Logf("stderr:\n%s", s)
			}
		}) {
			// The documents after this one use what it made.
			t.Fatalf("%s failed; the documents after it were not run", doc)
		}
	}
}
