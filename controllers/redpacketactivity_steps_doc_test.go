package controllers

import (
	"bufio"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// stepsHeading is the section of docs/architecture.md that lists the reconcile's steps.
const stepsHeading = "## The controller's reconcile: steps and one status write"

// stepLine is one item of a step list: "N. **<step name>**: <what it does>".
var stepLine = regexp.MustCompile(`^\d+\.\s+\*\*([^*]+)\*\*`)

// documentedSteps returns the bold step names of the first numbered list under the
// level-2 heading (a line equal to heading), in order, and whether the heading is there.
func documentedSteps(doc, heading string) ([]string, bool) {
	var names []string
	in, found := false, false
	sc := bufio.NewScanner(strings.NewReader(doc))
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "## ") || strings.HasPrefix(line, "# ") {
			if in {
				break
			}
			in = strings.TrimSpace(line) == heading
			found = found || in
			continue
		}
		if !in {
			continue
		}
		if m := stepLine.FindStringSubmatch(line); m != nil {
			names = append(names, strings.TrimSpace(m[1]))
		} else if len(names) > 0 && strings.TrimSpace(line) == "" {
			break // the list ended
		}
	}
	return names, found
}

// TestArchitectureDocListsTheSteps keeps the step list in docs/architecture.md equal
// to the steps the reconciler runs, in order.
func TestArchitectureDocListsTheSteps(t *testing.T) {
	raw, err := os.ReadFile("../docs/architecture.md")
	if err != nil {
		t.Fatal(err)
	}
	doc, found := documentedSteps(string(raw), stepsHeading)
	if !found {
		t.Fatalf("docs/architecture.md has no heading %q", stepsHeading)
	}
	var code []string
	for _, s := range (&RedPacketActivityReconciler{}).normalSteps(nil) {
		code = append(code, s.name)
	}
	if !slices.Equal(doc, code) {
		t.Errorf("docs/architecture.md lists the reconcile's steps as\n  %q\nbut normalSteps (controllers/redpacketactivity_phases.go) runs\n  %q",
			doc, code)
	}
}

func TestDocumentedStepsParser(t *testing.T) {
	doc := "# T\n\n## Other\n\n1. **no**: not this list\n\n" + stepsHeading + "\n\nIntro.\n\n" +
		"1. **redis connection**: resolve it\n2. **seed**: seed\n10. **counters**: write them\n\nAfter.\n\n3. **not a step**: later text\n\n## Next\n\n1. **no**: no\n"
	got, found := documentedSteps(doc, stepsHeading)
	want := []string{"redis connection", "seed", "counters"}
	if !found || !slices.Equal(got, want) {
		t.Fatalf("documentedSteps = %q, %v; want %q, true", got, found, want)
	}
}
