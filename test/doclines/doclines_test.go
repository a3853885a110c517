package doclines

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/test/controlplane"
)

const fenceMark = "```"

func TestExtract(t *testing.T) {
	doc := strings.Join([]string{
		"# Title",
		"",
		fenceMark + "sh",
		"# a comment",
		"make demo   # a trailing comment",
		"kubectl create secret generic k \\",
		"  --from-literal=a=b --dry-run=client -o yaml |",
		"  kubectl apply -f -",
		"curl -s -d '{\"a\":\"#not a comment\"}' x",
		fenceMark,
		"",
		fenceMark,
		"$ kubectl rpa pause quiz-night",
		"redpacketactivity.redpacket.io/quiz-night paused",
		"$ # only a comment",
		"$ curl -s -X POST x \\",
		"    -d '{}'",
		"{\"outcome\":\"granted\"}",
		fenceMark,
		"",
		fenceMark + "yaml",
		"kind: Secret",
		fenceMark,
		"",
		"1. A list item:",
		"   " + fenceMark,
		"   kubectl get rpa",
		"   " + fenceMark,
		"",
		fenceMark,
		"┌─ a diagram",
		fenceMark,
	}, "\n")
	notShell := []NotShell{{Doc: "doc.md", First: `^┌─`, Reason: "a diagram"}}
	got, err := Extract("doc.md", doc, notShell)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		num        int
		flat, text string
	}{
		{5, "make demo", "make demo   # a trailing comment"},
		{6, "kubectl create secret generic k --from-literal=a=b --dry-run=client -o yaml | kubectl apply -f -",
			"kubectl create secret generic k \\\n  --from-literal=a=b --dry-run=client -o yaml |\n  kubectl apply -f -"},
		{9, `curl -s -d '{"a":"#not a comment"}' x`, `curl -s -d '{"a":"#not a comment"}' x`},
		{13, "kubectl rpa pause quiz-night", "kubectl rpa pause quiz-night"},
		{16, "curl -s -X POST x -d '{}'", "curl -s -X POST x \\\n    -d '{}'"},
		{27, "kubectl get rpa", "kubectl get rpa"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d lines, want %d: %q", len(got), len(want), got)
	}
	for i, w := range want {
		if got[i].Num != w.num || got[i].Flat() != w.flat || got[i].Text != w.text {
			t.Errorf("line %d: got %d %q %q, want %d %q %q", i, got[i].Num, got[i].Flat(), got[i].Text, w.num, w.flat, w.text)
		}
	}
	if got[4].Block != "$ kubectl rpa pause quiz-night" {
		t.Errorf("block of the console line: %q", got[4].Block)
	}

	// Without its NotShell rule the diagram is shell, and so a line to classify.
	all, err := Extract("doc.md", doc, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != len(want)+1 || all[len(all)-1].Flat() != "┌─ a diagram" {
		t.Errorf("without the NotShell rule: %q", all)
	}

	if _, err := Extract("doc.md", fenceMark+"sh\nkubectl get \\\n"+fenceMark+"\n", nil); err == nil {
		t.Error("a continuation past the end of its block was accepted")
	}
}

func TestClassify(t *testing.T) {
	lines := []Line{
		{Doc: "a.md", Num: 1, Text: "kubectl get rpa", Block: "kubectl get rpa"},
		{Doc: "b.md", Num: 1, Text: "kubectl get rpa", Block: "export X=1"},
		{Doc: "b.md", Num: 2, Text: "make image", Block: "export X=1"},
		{Doc: "c.md", Num: 1, Text: "helm install x", Block: "helm install x"},
	}
	rules := []Rule{
		{Doc: "b.md", InBlock: `^export X=`, Match: `.`, Reason: "the whole block"},
		{Match: `^kubectl get `, Run: true},
		{Match: `^make image$`, Reason: "builds images"},
		{Match: `^never`, Reason: "matches nothing"},
	}
	got, unclassified, stale, err := Classify(lines, rules)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || !got[0].Rule.Run || got[1].Rule.Reason != "the whole block" || got[2].Rule.Reason != "the whole block" {
		t.Errorf("classified: %+v", got)
	}
	if len(unclassified) != 1 || unclassified[0].Doc != "c.md" {
		t.Errorf("unclassified: %v", unclassified)
	}
	if len(stale) != 2 || stale[0].Match != `^make image$` || stale[1].Match != `^never` {
		t.Errorf("stale: %v", stale)
	}
	if _, _, _, err := Classify(lines, []Rule{{Match: `.`}}); err == nil {
		t.Error("a rule that neither runs nor says why was accepted")
	}
}

// TestScript runs the script of a few lines with the real bash.
func TestScript(t *testing.T) {
	run := func(lines ...string) (string, string, error) {
		t.Helper()
		var ls []Line
		for i, l := range lines {
			ls = append(ls, Line{Doc: "d.md", Num: i + 1, Text: l})
		}
		cmd := exec.Command("bash", "-c", Script(ls))
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		return stdout.String(), stderr.String(), err
	}
	out, _, err := run("x=1", "f() { echo \"f$1\"; }", "test \"$x\" = 1", "f 2")
	if err != nil || !strings.Contains(out, "+ d.md:4\nf2\n") {
		t.Errorf("a variable and a function a line sets are there for the next: %v %q", err, out)
	}
	out, errOut, err := run("true", "false", "echo never")
	if err == nil || strings.Contains(out, "never") || !strings.Contains(errOut, "d.md:2 exited 1") {
		t.Errorf("a failing line: %v, stdout %q, stderr %q", err, out, errOut)
	}
	if _, errOut, err := run("v=$(false | cat)"); err == nil || !strings.Contains(errOut, "d.md:1 exited 1") {
		t.Errorf("a failing command inside a pipeline: %v %q", err, errOut)
	}
}

func TestScriptWaitsForPortForward(t *testing.T) {
	s := Script([]Line{{Doc: "d.md", Num: 3, Text: "kubectl -n ns port-forward service/x-grab 8081:8080 >/dev/null &"}})
	if !strings.Contains(s, "wait_port 8081 ||") {
		t.Errorf("no wait for the forwarded port in\n%s", s)
	}
	s = Script([]Line{{Doc: "d.md", Num: 3, Text: "kubectl port-forward service/x-grab 8081:8080"}})
	if strings.Contains(s, "wait_port 8081") {
		t.Errorf("a wait for a port-forward in the foreground in\n%s", s)
	}
}

// docLines loads the repository's documents and classifies their lines.
func docLines(t *testing.T) (root string, classified []Classified) {
	t.Helper()
	root, err := controlplane.Root()
	if err != nil {
		t.Fatal(err)
	}
	classified, err = LoadClassified(root)
	if err != nil {
		t.Error(err)
	}
	return root, classified
}

// TestEveryDocLineClassified fails on a shell line of README.md or docs/*.md that no
// rule classifies, and on a rule that classifies nothing.
func TestEveryDocLineClassified(t *testing.T) {
	_, classified := docLines(t)
	runs := 0
	for _, c := range classified {
		if c.Rule.Run {
			runs++
		}
	}
	t.Logf("%d shell lines, %d of them run on the test cluster", len(classified), runs)
	if !slices.ContainsFunc(classified, func(c Classified) bool { return c.Doc == "README.md" && c.Rule.Run }) {
		t.Error("no line of the README runs")
	}
}

// TestDocTokensNameActivitiesWithAuth checks that every `kubectl rpa token NAME` line
// that runs names an activity of config/samples (or a directory under it) that has
// spec.grabService.auth: for any other the plugin refuses to mint and exits 1.
func TestDocTokensNameActivitiesWithAuth(t *testing.T) {
	root, classified := docLines(t)
	withAuth := map[string]bool{}
	err := filepath.WalkDir(filepath.Join(root, "config", "samples"), func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || filepath.Ext(path) != ".yaml" {
			return err
		}
		raw, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(raw), -1) {
			var a redpacketv1alpha1.RedPacketActivity
			if err := yaml.Unmarshal([]byte(doc), &a); err != nil {
				t.Errorf("%s: %v", path, err)
				continue
			}
			if a.Kind == "RedPacketActivity" {
				withAuth[a.Name] = a.Spec.GrabService.Auth != nil && a.Spec.GrabService.Auth.TokenSecretRef.Name != ""
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	token := regexp.MustCompile(`kubectl rpa token ([a-z0-9-]+)`)
	seen := 0
	for _, c := range classified {
		if !c.Rule.Run {
			continue
		}
		for _, m := range token.FindAllStringSubmatch(c.Flat(), -1) {
			seen++
			if auth, ok := withAuth[m[1]]; !ok {
				t.Errorf("%s\n\tmints a token for %s, which no sample in config/samples creates", c.Line, m[1])
			} else if !auth {
				t.Errorf("%s\n\tmints a token for %s, whose sample has no spec.grabService.auth: the plugin refuses", c.Line, m[1])
			}
		}
	}
	if seen == 0 {
		t.Error("no doc line that runs mints a token")
	}
}

// A line whose comment states an HTTP status passes only when it prints that status
// last; the others pass on exit 0 alone.
func TestScriptChecksTheStatusTheDocsState(t *testing.T) {
	for _, c := range []struct {
		text string
		ok   bool
	}{
		{`echo '{"outcome":"granted"} 200'   # 200: granted`, true},
		{`echo '{"error":"limit_exceeded"} 422'   # 201: created`, false},
		{`echo 'no status at all'   # 403: quota_exceeded`, false},
		{`echo '{"error":"x"} 500'   # a comment without a status`, true},
		{`false   # 200: but it exits 1`, false},
	} {
		l := Line{Doc: "docs/x.md", Num: 1, Text: c.text}
		err := exec.Command("bash", "-c", Script([]Line{l})).Run()
		if (err == nil) != c.ok {
			t.Errorf("%s: passed %v, want %v (status %q)", c.text, err == nil, c.ok, l.ExpectedStatus())
		}
	}
}
