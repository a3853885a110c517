// Package doclines reads the shell lines out of the project's Markdown documents
// (README.md and docs/*.md) and classifies each one by the rules in rules.go: a
// line runs against the test cluster, or it does not run here, with the reason.
// The real-node suite (test/e2e/node, TestDocsShellLines) runs the lines that run;
// this package's own test fails on any line that no rule classifies, so a new doc
// line cannot go unchecked by accident.
//
// A shell line is a command in a fenced code block tagged sh, bash, shell or
// console, or in an untagged block that no NotShell rule claims (a diagram, a
// config file, a transcript of output). In a block with `$ ` prompts only the
// prompted lines are commands and the rest is output; otherwise every line that is
// not blank and not a comment is one. A line ending in `\`, `|`, `&&` or `||`
// continues on the next, and the whole is one Line.
package doclines

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// Line is one shell command of a document.
type Line struct {
	// Doc is the document's path relative to the repository root, with slashes.
	Doc string
	// Num is the 1-based number of the command's first physical line in Doc.
	Num int
	// Text is the command as bash reads it: its physical lines, joined by newlines,
	// without a console prompt.
	Text string
	// Block is the first line of the fenced block the command is in, trimmed.
	Block string
}

// Flat is the command on one line, without its comments: continuations joined,
// runs of blanks made single spaces. Rules match against it.
func (l Line) Flat() string {
	var parts []string
	for _, phys := range strings.Split(l.Text, "\n") {
		phys = strings.TrimSuffix(strings.TrimRight(withoutComment(phys), " \t"), "\\")
		parts = append(parts, phys)
	}
	return strings.Join(strings.Fields(strings.Join(parts, " ")), " ")
}

// withoutComment cuts a physical shell line at its comment: a # that starts a word
// outside quotes.
func withoutComment(s string) string {
	var quote rune
	prev := ' '
	for i, r := range s {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			}
		case r == '\'' || r == '"':
			quote = r
		case r == '#' && (prev == ' ' || prev == '\t'):
			return s[:i]
		}
		prev = r
	}
	return s
}

func (l Line) String() string { return fmt.Sprintf("%s:%d: %s", l.Doc, l.Num, l.Flat()) }

// statusComment is a comment that states the HTTP status a line answers: "# 403: ...".
var statusComment = regexp.MustCompile(`^#\s*([1-5][0-9][0-9]):`)

// ExpectedStatus is the HTTP status the line's comment states ("# 201: created"), or
// "". Such a line must print that status last (curl -w ' %{http_code}'), which
// Script checks: the docs' word is tested, not only the command's exit.
func (l Line) ExpectedStatus() string {
	phys := strings.Split(l.Text, "\n")
	last := phys[len(phys)-1]
	comment := strings.TrimSpace(last[len(withoutComment(last)):])
	if m := statusComment.FindStringSubmatch(comment); m != nil {
		return m[1]
	}
	return ""
}

// Rule classifies the shell lines of a document that its pattern matches.
type Rule struct {
	// Doc is the document the rule is for ("" for every document).
	Doc string
	// Match is a regular expression that the line's Flat form must match.
	Match string
	// InBlock, when set, is a regular expression that the first line of the line's
	// block must match too: a rule for every line of one block.
	InBlock string
	// Run says that the line runs against the test cluster, in the document's order,
	// and must exit 0.
	Run bool
	// Reason says why a line that does not run cannot run here (required), or what
	// a line that runs needs from the lines before it (optional).
	Reason string
}

// NotShell claims an untagged fenced block that is not shell: its first line
// matches First.
type NotShell struct {
	Doc    string
	First  string
	Reason string
}

// Classified is a line with the rule that classified it.
type Classified struct {
	Line
	Rule *Rule
}

// Documents lists README.md and docs/*.md under root, relative to it, README first.
func Documents(root string) ([]string, error) {
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		return nil, fmt.Errorf("listing docs/*.md: %w", err)
	}
	out := []string{"README.md"}
	for _, d := range docs {
		rel, err := filepath.Rel(root, d)
		if err != nil {
			return nil, fmt.Errorf("relative path of %s: %w", d, err)
		}
		out = append(out, filepath.ToSlash(rel))
	}
	slices.Sort(out[1:])
	return out, nil
}

// shellTags are the info strings of blocks whose lines are shell.
var shellTags = map[string]bool{"sh": true, "bash": true, "shell": true, "console": true, "": true}

var fence = regexp.MustCompile("^(\\s*)(```+|~~~+)\\s*([^\\s`]*)")

// block is a fenced code block: its info string, and its lines with the fence's
// indentation removed, from line first (1-based) on.
type block struct {
	tag   string
	first int
	lines []string
}

// blocks returns the fenced code blocks of a Markdown text.
func blocks(text string) []block {
	var out []block
	var cur *block
	var marker, indent string
	for i, raw := range strings.Split(text, "\n") {
		if cur == nil {
			if m := fence.FindStringSubmatch(raw); m != nil {
				cur = &block{tag: strings.ToLower(m[3]), first: i + 2}
				indent, marker = m[1], m[2]
			}
			continue
		}
		trimmed := strings.TrimSpace(raw)
		if strings.HasPrefix(trimmed, marker[:1]) && strings.Trim(trimmed, marker[:1]) == "" && len(trimmed) >= len(marker) {
			out = append(out, *cur)
			cur = nil
			continue
		}
		cur.lines = append(cur.lines, strings.TrimPrefix(raw, indent))
	}
	return out
}

// continues says whether a physical shell line goes on on the next one.
func continues(s string) bool {
	s = strings.TrimRight(s, " \t")
	return strings.HasSuffix(s, "\\") || strings.HasSuffix(s, "|") || strings.HasSuffix(s, "&&")
}

// Extract returns the shell lines of one document's text, in order, leaving out the
// untagged blocks that a NotShell rule for doc claims.
func Extract(doc, text string, notShell []NotShell) ([]Line, error) {
	var out []Line
	for _, b := range blocks(text) {
		if !shellTags[b.tag] {
			continue
		}
		if b.tag == "" && claimed(doc, b, notShell) {
			continue
		}
		console := slices.ContainsFunc(b.lines, func(l string) bool {
			t := strings.TrimSpace(l)
			return t == "$" || strings.HasPrefix(t, "$ ")
		})
		for i := 0; i < len(b.lines); i++ {
			first := strings.TrimSpace(b.lines[i])
			if console {
				if !strings.HasPrefix(first, "$ ") {
					continue // output
				}
				first = strings.TrimSpace(strings.TrimPrefix(first, "$ "))
			}
			if first == "" || strings.HasPrefix(first, "#") {
				continue
			}
			start := i
			text := []string{first}
			for continues(b.lines[i]) {
				i++
				if i == len(b.lines) {
					return nil, fmt.Errorf("%s:%d: the command continues past the end of its block", doc, b.first+start)
				}
				text = append(text, b.lines[i])
			}
			out = append(out, Line{Doc: doc, Num: b.first + start, Text: strings.Join(text, "\n"), Block: b.firstLine()})
		}
	}
	return out, nil
}

// firstLine is the first line of a block that is not blank, trimmed.
func (b block) firstLine() string {
	for _, l := range b.lines {
		if t := strings.TrimSpace(l); t != "" {
			return t
		}
	}
	return ""
}

func claimed(doc string, b block, notShell []NotShell) bool {
	first := b.firstLine()
	for _, n := range notShell {
		if (n.Doc == "" || n.Doc == doc) && regexp.MustCompile(n.First).MatchString(first) {
			return true
		}
	}
	return false
}

// Load extracts the shell lines of every document under root.
func Load(root string, notShell []NotShell) ([]Line, error) {
	docs, err := Documents(root)
	if err != nil {
		return nil, err
	}
	var out []Line
	for _, d := range docs {
		raw, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(d)))
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", d, err)
		}
		lines, err := Extract(d, string(raw), notShell)
		if err != nil {
			return nil, err
		}
		out = append(out, lines...)
	}
	return out, nil
}

// Classify gives each line the first rule for its document that matches it, and
// returns the lines that no rule matches and the rules that match no line (stale).
func Classify(lines []Line, rules []Rule) (classified []Classified, unclassified []Line, stale []Rule, err error) {
	res := make([]*regexp.Regexp, len(rules))
	blockRes := make([]*regexp.Regexp, len(rules))
	for i, r := range rules {
		if res[i], err = regexp.Compile(r.Match); err != nil {
			return nil, nil, nil, fmt.Errorf("rule %q: %w", r.Match, err)
		}
		if blockRes[i], err = regexp.Compile(r.InBlock); err != nil {
			return nil, nil, nil, fmt.Errorf("rule %q: block %q: %w", r.Match, r.InBlock, err)
		}
		if !r.Run && r.Reason == "" {
			return nil, nil, nil, fmt.Errorf("rule %q does not run and gives no reason", r.Match)
		}
	}
	used := make([]bool, len(rules))
	for _, l := range lines {
		i := -1
		for j, r := range rules {
			if (r.Doc == "" || r.Doc == l.Doc) && res[j].MatchString(l.Flat()) && blockRes[j].MatchString(l.Block) {
				i = j
				break
			}
		}
		if i < 0 {
			unclassified = append(unclassified, l)
			continue
		}
		used[i] = true
		classified = append(classified, Classified{Line: l, Rule: &rules[i]})
	}
	for i, r := range rules {
		if !used[i] {
			stale = append(stale, r)
		}
	}
	return classified, unclassified, stale, nil
}

// LoadClassified loads the shell lines of every document under root and classifies
// them by NotShellBlocks and Rules. Its error names every line that no rule
// classifies and every rule that classifies nothing, with what to do.
func LoadClassified(root string) ([]Classified, error) {
	lines, err := Load(root, NotShellBlocks)
	if err != nil {
		return nil, err
	}
	classified, unclassified, stale, err := Classify(lines, Rules)
	if err != nil {
		return nil, err
	}
	var problems []string
	for _, l := range unclassified {
		problems = append(problems, fmt.Sprintf("%s\n\tno rule in test/doclines/rules.go classifies this line: add one (it runs on the test cluster, or why not)", l))
	}
	for _, r := range stale {
		problems = append(problems, fmt.Sprintf("the rule for %q (%s) in test/doclines/rules.go matches no line: remove it", r.Match, r.Doc))
	}
	if len(problems) > 0 {
		return classified, errors.New(strings.Join(problems, "\n"))
	}
	return classified, nil
}

// backgroundForward finds a port-forward sent to the background and its local port.
var backgroundForward = regexp.MustCompile(`\bport-forward\s+\S+\s+(\d+)(?::\d+)?\b.*&\s*$`)

// Script is the bash script that runs lines in order, in one shell, so that what a
// line sets (a variable, a function, a background port-forward) is there for the
// next. It stops at the first line that exits non-zero, printing "LINE exited N" on
// stderr, and exits 1. Each line is announced on stdout as "+ DOC:NUM". Pipelines
// fail when any command in them fails (pipefail). After a port-forward sent to the
// background it waits, up to 30 seconds, until the local port accepts connections,
// as a user would before the next command; background jobs are ended on exit.
func Script(lines []Line) string {
	var b strings.Builder
	b.WriteString(`set -o pipefail
trap 'kill $(jobs -p) 2>/dev/null' EXIT
wait_port() {
	for _ in $(seq 300); do
		if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
		sleep 0.1
	done
	return 1
}
`)
	for _, l := range lines {
		where := fmt.Sprintf("%s:%d", l.Doc, l.Num)
		if status := l.ExpectedStatus(); status != "" {
			// The command in $( ) on lines of its own, so that its comment ends at a
			// newline; its output is shown, and its last word must be the status.
			fmt.Fprintf(&b, "\necho '+ %s'\nout=$(\n%s\n)\n", where, l.Text)
			fmt.Fprintf(&b, "rc=$?; echo \"$out\"; if [ \"$rc\" -ne 0 ]; then echo '%s exited '\"$rc\" >&2; exit 1; fi\n", where)
			fmt.Fprintf(&b, "case \"$out\" in *' %s') ;; *) echo '%s: the docs say %s, the answer was '\"${out##* }\" >&2; exit 1;; esac\n",
				status, where, status)
			continue
		}
		fmt.Fprintf(&b, "\necho '+ %s'\n%s\n", where, l.Text)
		fmt.Fprintf(&b, "rc=$?; if [ \"$rc\" -ne 0 ]; then echo '%s exited '\"$rc\" >&2; exit 1; fi\n", where)
		if m := backgroundForward.FindStringSubmatch(l.Flat()); m != nil {
			fmt.Fprintf(&b, "wait_port %s || { echo '%s: nothing listens on port %s' >&2; exit 1; }\n", m[1], where, m[1])
		}
	}
	return b.String()
}
