package main

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"

	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/pkg/webhooksig"
	"redpacket.io/operator/test/balancetest"
	"redpacket.io/operator/test/pgtest"
)

// balanceSystem is the demo's balance system: cmd/balance (bin/balance) on a
// PostgreSQL cluster of its own, and the file holding the operator's Ed25519 private
// key for it, which goes into the operator's settlement keys Secret.
type balanceSystem struct {
	*balancetest.System
	// privateKeyFile holds the operator's key, "whsk_<base64>"; the balance system
	// holds only its public half.
	privateKeyFile string
	publicKey      string
}

// startBalanceSystem makes an Ed25519 key pair, starts PostgreSQL and bin/balance on
// a free port of host with the public key only, and prints where they run.
func startBalanceSystem(ctx context.Context, root, dir, host string) (*balanceSystem, error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("making the operator's Ed25519 key: %w", err)
	}
	keyFile := filepath.Join(dir, "operator.ed25519")
	if err := os.WriteFile(keyFile, []byte(webhooksig.FormatPrivateKey(priv)), 0o600); err != nil {
		return nil, fmt.Errorf("writing %s: %w", keyFile, err)
	}
	sys, err := balancetest.Start(ctx, balancetest.Options{Binary: filepath.Join(root, "bin", "balance"), Host: host, Dir: dir,
		PublicKeys: []ed25519.PublicKey{pub}})
	if err != nil {
		return nil, err
	}
	bs := &balanceSystem{System: sys, privateKeyFile: keyFile, publicKey: webhooksig.FormatPublicKey(pub)}
	fmt.Printf("    PostgreSQL %s on 127.0.0.1:%d, a throwaway cluster in %s\n", postgresVersion(ctx), sys.DB.Port, sys.DB.Dir)
	fmt.Printf("    bin/balance --listen %s --public-key-file %s, DATABASE_URL=%s; log %s\n",
		strings.TrimPrefix(sys.URL, "http://"), rel(root, filepath.Join(dir, "balance-public-keys")), sys.DatabaseURL, rel(root, sys.LogPath))
	fmt.Printf("    it holds only the operator's public key %s: it verifies v1a (Ed25519) signatures and can sign nothing\n", bs.publicKey)
	fmt.Printf("    webhook %s; the operator's private key, in %s, goes into its keys Secret\n", sys.WebhookURL(), rel(root, keyFile))
	return bs, nil
}

// settlementKeyName is the entry of the operator's settlement keys Secret that holds
// its Ed25519 key for the balance system: "<host>_<port>.ed25519".
func (bs *balanceSystem) settlementKeyName() string { return allowlistKey(bs.URL) + ".ed25519" }

// stop stops the balance system and its database, and says whether the cluster's
// directory is gone.
func (bs *balanceSystem) stop() {
	if err := bs.Stop(); err != nil {
		fmt.Printf("    the balance system: %v\n", err)
		return
	}
	fmt.Printf("    the balance system and its PostgreSQL stopped; %s removed\n", bs.DB.Dir)
}

// postgresVersion is the version the postgres binary the cluster runs reports
// ("postgres (PostgreSQL) 15.14 (Debian ...)"), such as "15.14", or "" when it cannot
// tell.
func postgresVersion(ctx context.Context) string {
	bin, err := pgtest.Bin()
	if err != nil {
		return ""
	}
	out, err := exec.CommandContext(ctx, filepath.Join(bin, "postgres"), "--version").Output()
	if err != nil {
		return ""
	}
	f := strings.Fields(string(out))
	if len(f) < 3 {
		return ""
	}
	return f[2]
}

// ensurePostgres makes sure PostgreSQL's server programs are installed: through
// hack/ensure-postgres.sh (the system's packages, as root), or with a clear message.
func ensurePostgres(ctx context.Context, root string) error {
	if _, err := pgtest.Bin(); err == nil {
		return nil
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("PostgreSQL is not installed; install it with: sudo apt-get install -y postgresql (or run hack/ensure-postgres.sh as root)")
	}
	step("installing PostgreSQL through the system's package manager")
	cmd := exec.CommandContext(ctx, filepath.Join(root, "hack", "ensure-postgres.sh"))
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("installing PostgreSQL: %w", err)
	}
	if _, err := pgtest.Bin(); err != nil {
		return fmt.Errorf("PostgreSQL is still missing after hack/ensure-postgres.sh: %w", err)
	}
	return nil
}

// statusFigures is what a resource's status says was settled to the balance
// system: the grants credited and their sum, the refunds and their sum.
type statusFigures struct {
	grants, grantSum, refunds, refundSum int64
}

// ledgerRow is one source of the ledger: its resource, its UID, and what its status
// says.
type ledgerRow struct {
	resource string // "rpa/quiz-night"
	uid      string
	status   statusFigures
}

// activityLedgerRow reads activity name (namespace default) and returns its row: its
// status's settled grants and refund (one refund when its refundedAmount is above 0).
func activityLedgerRow(ctx context.Context, c client.Client, name string) (ledgerRow, error) {
	var a redpacketv1alpha1.RedPacketActivity
	if err := c.Get(ctx, client.ObjectKey{Namespace: "default", Name: name}, &a); err != nil {
		return ledgerRow{}, fmt.Errorf("reading the activity: %w", err)
	}
	st := a.Status
	refundSum := max(0, val(st.RefundedAmount))
	refunds := int64(0)
	if refundSum > 0 {
		refunds = 1
	}
	return ledgerRow{resource: "rpa/" + name, uid: string(a.UID),
		status: statusFigures{grants: val(st.SettledCount), grantSum: val(st.SettledAmount), refunds: refunds, refundSum: refundSum}}, nil
}

// showLedger reads each row's source from the balance system (GET
// /v1/sources/{uid}), prints it beside its resource's status figures, and reports
// whether every one agrees to the unit.
func showLedger(ctx context.Context, bs *balanceSystem, rows []ledgerRow) (bool, error) {
	fmt.Printf("$ curl -s %s/v1/sources/<uid>   # for each resource's UID: its book in PostgreSQL\n", bs.URL)
	fmt.Printf("    %-20s %-9s %10s %7s %10s %8s %11s   %s\n", "RESOURCE", "KIND", "TOTAL", "GRANTS", "GRANT-SUM", "REFUNDS", "REFUND-SUM", "THE STATUS SAYS")
	agree := true
	for _, r := range rows {
		src, ok, err := bs.Source(ctx, r.uid)
		if err != nil {
			return false, err
		}
		got := statusFigures{grants: src.Grants.Count, grantSum: src.Grants.Sum, refunds: src.Refunds.Count, refundSum: src.Refunds.Sum}
		verdict := "the same to the unit"
		if !ok || got != r.status {
			verdict, agree = "DIFFERENT", false
		}
		fmt.Printf("    %-20s %-9s %10d %7d %10d %8d %11d   %d grants summing to %d, %d refunds summing to %d: %s\n",
			r.resource, src.Kind, src.Total, got.grants, got.grantSum, got.refunds, got.refundSum,
			r.status.grants, r.status.grantSum, r.status.refunds, r.status.refundSum, verdict)
		if !ok {
			fmt.Printf("    %s: the balance system has no source %s\n", r.resource, r.uid)
		}
	}
	return agree, nil
}

// usersCreditedTwice counts the users who were credited more than one grant of an
// activity, from its credits in the balance system.
func usersCreditedTwice(credits []balance.Credit) int64 {
	byUser := map[string]int{}
	for _, c := range credits {
		if c.Kind == "grant" {
			byUser[c.UserID]++
		}
	}
	var twice int64
	for _, n := range byUser {
		if n > 1 {
			twice++
		}
	}
	return twice
}

// formatCounts prints counts by code in a stable order, "none" when empty.
func formatCounts(counts map[string]int) string {
	if len(counts) == 0 {
		return "none"
	}
	codes := make([]string, 0, len(counts))
	for c := range counts {
		codes = append(codes, c)
	}
	sort.Strings(codes)
	parts := make([]string, 0, len(codes))
	for _, c := range codes {
		parts = append(parts, fmt.Sprintf("%d %s", counts[c], c))
	}
	return strings.Join(parts, ", ")
}
