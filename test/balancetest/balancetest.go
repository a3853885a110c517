// Package balancetest runs the reference balance system, cmd/balance, as a real
// process on a throwaway PostgreSQL cluster of its own (test/pgtest), for the demo and
// the suites on a real node, and reads its books back through its read API
// (docs/balance.md). Stop ends the process, stops the database and removes the
// cluster's directory: nothing is left behind.
package balancetest

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/test/pgtest"
	"redpacket.io/operator/test/proc"
)

// Options say how to run the balance system.
type Options struct {
	// Binary is the cmd/balance binary (bin/balance, or one Build made).
	Binary string
	// Host is the address it listens on, on a free port: 127.0.0.1, or the node's
	// address where pods must reach it.
	Host string
	// Dir holds its log and key files; it must exist.
	Dir string
	// SigningKeys are the HMAC keys it verifies v1 signatures with, as the operator's
	// keys Secret holds them (--signing-key-file).
	SigningKeys [][]byte
	// PublicKeys are the operator's Ed25519 public keys it verifies v1a signatures
	// with (--public-key-file).
	PublicKeys []ed25519.PublicKey
}

// System is cmd/balance running on its own PostgreSQL cluster.
type System struct {
	// URL is its base URL, "http://<host>:<port>".
	URL string
	// DB is its PostgreSQL cluster; DatabaseURL the database it books into.
	DB          *pgtest.Server
	DatabaseURL string
	// LogPath is the process's log (its standard output and error).
	LogPath string

	proc *proc.Proc
}

// WebhookURL is where the operator delivers: POST /v1/credits.
func (s *System) WebhookURL() string { return s.URL + "/v1/credits" }

// Build compiles cmd/balance from the module at root into out.
func Build(ctx context.Context, root, out string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "./cmd/balance")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building cmd/balance: %w: %s", err, strings.TrimSpace(string(b)))
	}
	return nil
}

// Start starts a PostgreSQL cluster, then cmd/balance on a free port of o.Host
// booking into a new database of it, and waits until its /healthz answers 200 (the
// schema is migrated by then). On error nothing it started is left running.
func Start(ctx context.Context, o Options) (*System, error) {
	if len(o.SigningKeys) == 0 && len(o.PublicKeys) == 0 {
		return nil, errors.New("the balance system needs a signing key or a public key")
	}
	args := []string{}
	if len(o.SigningKeys) > 0 {
		f := filepath.Join(o.Dir, "balance-signing-keys")
		if err := writeLines(f, o.SigningKeys); err != nil {
			return nil, err
		}
		args = append(args, "--signing-key-file", f)
	}
	if len(o.PublicKeys) > 0 {
		lines := make([][]byte, 0, len(o.PublicKeys))
		for _, k := range o.PublicKeys {
			lines = append(lines, []byte(webhooksig.FormatPublicKey(k)))
		}
		f := filepath.Join(o.Dir, "balance-public-keys")
		if err := writeLines(f, lines); err != nil {
			return nil, err
		}
		args = append(args, "--public-key-file", f)
	}

	db, err := pgtest.StartProcess()
	if err != nil {
		return nil, fmt.Errorf("starting PostgreSQL for the balance system: %w", err)
	}
	s := &System{DB: db, LogPath: filepath.Join(o.Dir, "balance.log")}
	if s.DatabaseURL, err = db.NewDatabase(ctx); err != nil {
		s.Stop()
		return nil, err
	}
	port, err := freePort(o.Host)
	if err != nil {
		s.Stop()
		return nil, err
	}
	listen := net.JoinHostPort(o.Host, strconv.Itoa(port))
	s.URL = "http://" + listen
	// The database URL goes in the environment, not in the arguments.
	s.proc, err = proc.Start("balance system", s.LogPath, []string{"DATABASE_URL=" + s.DatabaseURL},
		o.Binary, append([]string{"--listen", listen}, args...)...)
	if err != nil {
		s.Stop()
		return nil, err
	}
	if err := proc.WaitHTTP(ctx, s.proc, s.URL+"/healthz", time.Minute); err != nil {
		s.Stop()
		return nil, fmt.Errorf("the balance system: %w (log: %s)", err, proc.Tail(s.LogPath, 2000))
	}
	return s, nil
}

// Stop ends the balance system, then its PostgreSQL cluster, and removes the
// cluster's directory. It reports an error when the directory is still there.
func (s *System) Stop() error {
	s.proc.Stop(15 * time.Second)
	s.proc = nil
	if s.DB == nil {
		return nil
	}
	s.DB.Remove()
	if _, err := os.Stat(s.DB.Dir); !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("the PostgreSQL cluster's directory %s is still there (%v)", s.DB.Dir, err)
	}
	return nil
}

// Source reads a source's book (GET /v1/sources/{uid}); ok is false when no
// announcement made it (404).
func (s *System) Source(ctx context.Context, uid string) (src balance.Source, ok bool, err error) {
	status, err := s.getJSON(ctx, "/v1/sources/"+url.PathEscape(uid), &src)
	if err != nil {
		return balance.Source{}, false, err
	}
	switch status {
	case http.StatusOK:
		return src, true, nil
	case http.StatusNotFound:
		return balance.Source{}, false, nil
	}
	return balance.Source{}, false, fmt.Errorf("GET /v1/sources/%s: HTTP %d", uid, status)
}

// Credits reads every credit of a source, page after page of
// GET /v1/sources/{uid}/credits, in key order; none when no announcement made the
// source.
func (s *System) Credits(ctx context.Context, uid string) ([]balance.Credit, error) {
	var all []balance.Credit
	after := ""
	for {
		q := url.Values{"limit": {strconv.Itoa(balance.MaxPage)}}
		if after != "" {
			q.Set("after", after)
		}
		var page struct {
			Credits []balance.Credit `json:"credits"`
			Next    string           `json:"next"`
		}
		status, err := s.getJSON(ctx, "/v1/sources/"+url.PathEscape(uid)+"/credits?"+q.Encode(), &page)
		if err != nil {
			return nil, err
		}
		if status == http.StatusNotFound {
			return nil, nil
		}
		if status != http.StatusOK {
			return nil, fmt.Errorf("GET /v1/sources/%s/credits: HTTP %d", uid, status)
		}
		all = append(all, page.Credits...)
		if page.Next == "" {
			return all, nil
		}
		after = page.Next
	}
}

// getJSON GETs path and decodes a 200 answer into v; it returns the status.
func (s *System) getJSON(ctx context.Context, path string, v any) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+path, nil)
	if err != nil {
		return 0, fmt.Errorf("GET %s: %w", path, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, fmt.Errorf("GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, nil
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return 0, fmt.Errorf("GET %s: decoding the answer: %w", path, err)
	}
	return resp.StatusCode, nil
}

// Refusals counts the POSTs the balance system refused, by the answer's error code
// ("bad_signature", "over_budget", "in_flight", ...), from the line it logs for each;
// the read API's answers are not counted.
func (s *System) Refusals() (map[string]int, error) {
	f, err := os.Open(s.LogPath)
	if err != nil {
		return nil, fmt.Errorf("reading the balance system's log: %w", err)
	}
	defer f.Close()
	counts := map[string]int{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, " msg=refused method=POST ") {
			continue
		}
		code := "unknown"
		if _, rest, ok := strings.Cut(line, " error="); ok {
			code, _, _ = strings.Cut(rest, " ")
		}
		counts[code]++
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading the balance system's log: %w", err)
	}
	return counts, nil
}

// Alarms are the refusals that the operator never causes when it and the balance
// system agree: a signature, a body, a key reused with another body, a credit beyond
// the budget. The others (in_flight, unknown_source, internal) heal on a retry.
func Alarms(refusals map[string]int) map[string]int {
	alarms := map[string]int{}
	for code, n := range refusals {
		switch code {
		case balance.CodeInFlight, balance.CodeUnknownSource, balance.CodeInternal:
		default:
			alarms[code] = n
		}
	}
	return alarms
}

// writeLines writes one key a line, readable by this user only.
func writeLines(path string, lines [][]byte) error {
	var b []byte
	for _, l := range lines {
		b = append(append(b, l...), '\n')
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}

// freePort finds a free port on host.
func freePort(host string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, fmt.Errorf("finding a free port on %s: %w", host, err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
