package main

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"redpacket.io/operator/internal/rain"
)

// The demo's group packets (seed 004): a RedPacketBudget like
// config/samples/redpacket_v1alpha1_redpacketbudget.yaml, sized for the demo, with its
// shared grab fleet of 2 pods and settlement to the demo's balance system.
const (
	demoBudget        = "group-packets"
	demoBudgetTotal   = int64(10_000_000)
	demoGroupPackets  = 500
	demoGroupTotal    = int64(1000)
	demoGroupShares   = 5
	demoGroupTTL      = 15 // seconds: the packets expire within the demo, refunds and all
	demoBudgetReplica = 2
)

func demoBudgetManifest(webhook string) string {
	return fmt.Sprintf(`apiVersion: redpacket.io/v1alpha1
kind: RedPacketBudget
metadata:
  name: %s
  namespace: default
spec:
  total: %d
  currency: CNY
  packets: {maxTotal: 20000, maxCount: 100, minShare: 1, distributions: [Random, Fixed], defaultTTL: 24h, maxTTL: 24h}
  budgetShards: 4
  grabService: {replicas: %d}
  settlement:
    webhook: {url: %s}
    maxAttempts: 10
`, demoBudget, demoBudgetTotal, demoBudgetReplica, webhook)
}

// groupPackets applies the demo budget, shows kubectl get rpb, fires a burst of group
// packets through its grab Service (each raced by its group: 8 members for the even
// packets, 3 for the odd ones, which leave two shares to refund), waits until every
// packet expired and every share and refund was booked in PostgreSQL, shows kubectl
// get rpb again and reports whether every check held, and the budget's row of the
// ledger: what its status says was settled.
func (nd *nodeDemo) groupPackets(ctx context.Context, bs *balanceSystem, took func(string, time.Duration)) (bool, ledgerRow, error) {
	step("group packets (seed 004): a RedPacketBudget, its shared grab fleet and packets created at runtime")
	manifestPath := filepath.Join(nd.dir, demoBudget+".yaml")
	if err := os.WriteFile(manifestPath, []byte(demoBudgetManifest(bs.WebhookURL())), 0o644); err != nil {
		return false, ledgerRow{}, fmt.Errorf("writing %s: %w", manifestPath, err)
	}
	fmt.Printf("    a demo-sized budget like config/samples/redpacket_v1alpha1_redpacketbudget.yaml: %d in %d budget shards, %d grab pods, settlement to the balance system\n",
		demoBudgetTotal, 4, demoBudgetReplica)
	applied := time.Now()
	if err := nd.kc.show(ctx, "apply", "-f", rel(nd.root, manifestPath)); err != nil {
		return false, ledgerRow{}, err
	}
	if err := nd.kc.show(ctx, "wait", "--for=condition=Ready", "rpb/"+demoBudget, "--timeout=180s"); err != nil {
		return false, ledgerRow{}, err
	}
	if err := nd.kc.show(ctx, "rollout", "status", "deployment/"+demoBudget+"-grab", "--timeout=120s"); err != nil {
		return false, ledgerRow{}, err
	}
	took("budget Ready", time.Since(applied))
	step("the budget before the burst")
	if err := nd.kc.show(ctx, "get", "rpb"); err != nil {
		return false, ledgerRow{}, err
	}
	enc, err := nd.kc.output(ctx, "get", "secret", demoBudget+"-sender", "-o", "jsonpath={.data.token}")
	if err != nil {
		return false, ledgerRow{}, err
	}
	token, err := base64.StdEncoding.DecodeString(strings.TrimSpace(enc))
	if err != nil {
		return false, ledgerRow{}, fmt.Errorf("the sender credential: %w", err)
	}
	uid, err := nd.kc.output(ctx, "get", "rpb", demoBudget, "-o", "jsonpath={.metadata.uid}")
	if err != nil {
		return false, ledgerRow{}, err
	}
	ip, err := nd.kc.output(ctx, "get", "service", demoBudget+"-grab", "-o", "jsonpath={.spec.clusterIP}")
	if err != nil {
		return false, ledgerRow{}, err
	}
	url := "http://" + strings.TrimSpace(ip) + ":8080"
	spec := rain.GroupSpec{URL: url, SenderToken: string(token), Packets: demoGroupPackets, IDPrefix: "order-",
		Total: demoGroupTotal, Shares: demoGroupShares, TTLSeconds: demoGroupTTL,
		Members: func(p int) int { return 8 - 5*(p%2) }}
	step("%d packets of %d in %d shares created through %s/v1/packets, each raced by its group", demoGroupPackets,
		demoGroupTotal, demoGroupShares, url)
	res := rain.RunGroups(ctx, spec)
	took("group packets", res.CreateElapsed+res.GrabElapsed)
	fmt.Printf("    created %d in %s (%.0f/s); %d grabs in %s, %d sold out; the packet page: %s/p/order-0\n",
		res.Created, res.CreateElapsed.Round(time.Millisecond), float64(res.Created)/res.CreateElapsed.Seconds(),
		res.Grabs, res.GrabElapsed.Round(time.Millisecond), res.SoldOut, url)
	ok := len(res.Errors) == 0 && res.Created == demoGroupPackets
	for _, e := range res.Errors {
		fmt.Printf("    unexpected answer: %s\n", e)
	}
	claimed, err := res.Check(spec)
	if err != nil {
		fmt.Printf("    %v\n", err)
		ok = false
	}
	refunded := demoGroupPackets*demoGroupTotal - claimed
	wantShares := int64(demoGroupPackets/2*demoGroupShares + demoGroupPackets/2*3)
	// The odd packets, raced by 3 members for 5 shares, each refund their 2 shares left.
	wantRefunds := int64(demoGroupPackets / 2)

	step("waiting for the packets to expire (%ds) and settlement to book every share and refund in PostgreSQL", demoGroupTTL)
	uid = strings.TrimSpace(uid)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		src, _, err := bs.Source(ctx, uid)
		if err != nil {
			return false, ledgerRow{}, err
		}
		live, _ := nd.kc.output(ctx, "get", "rpb", demoBudget, "-o", "jsonpath={.status.livePackets}")
		if src.Grants.Count == wantShares && src.Refunds.Count == wantRefunds && src.Refunds.Sum == refunded && strings.TrimSpace(live) == "0" {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			fmt.Printf("    after 2 minutes: %d shares and %d refunds summing to %d booked, want %d, %d and %d; %s live packets\n",
				src.Grants.Count, src.Refunds.Count, src.Refunds.Sum, wantShares, wantRefunds, refunded, live)
			ok = false
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	step("the budget after the burst")
	if err := nd.kc.show(ctx, "get", "rpb", "-o", "wide"); err != nil {
		return false, ledgerRow{}, err
	}
	figures, err := nd.kc.output(ctx, "get", "rpb", demoBudget, "-o",
		"jsonpath={.status.total} {.status.available} {.status.inPackets} {.status.claimed} {.status.refunded} {.status.grabbedShares}")
	if err != nil {
		return false, ledgerRow{}, err
	}
	var got []int64
	for _, f := range strings.Fields(figures) {
		n, _ := strconv.ParseInt(f, 10, 64)
		got = append(got, n)
	}
	want := []int64{demoBudgetTotal, demoBudgetTotal - demoGroupPackets*demoGroupTotal, 0, claimed, refunded, wantShares}
	exact := fmt.Sprint(got) == fmt.Sprint(want)
	fmt.Printf("    total %d = available %d + in packets %d + claimed %d + refunded %d, in %d shares: %s\n", want[0], want[1], want[2], want[3], want[4], want[5],
		map[bool]string{true: "the status says exactly that", false: "the status says " + figures}[exact])
	// The status has no count of refunds: one per packet that expired with shares left.
	row := ledgerRow{resource: "rpb/" + demoBudget, uid: uid}
	if len(got) == len(want) {
		row.status = statusFigures{grants: got[5], grantSum: got[3], refunds: wantRefunds, refundSum: got[4]}
	}
	return ok && exact, row, nil
}
