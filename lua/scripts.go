package lua

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// Script is one embedded Lua program. Run sends EVALSHA and falls back to EVAL when
// the server's script cache does not hold it (after a restart, a failover or
// SCRIPT FLUSH). Because the fallback is decided per command, it also works on an
// auto-pipelining client, where many callers' commands share one pipeline.
type Script struct {
	name string
	src  string
	sha  string
	// function is the script's function in GrabLibrary, "" for a script that is
	// only ever run with EVALSHA (the operator's).
	function string
}

func newScript(name, src string) *Script {
	s := redis.NewScript(src)
	return &Script{name: name, src: src, sha: s.Hash()}
}

// Name is the script's file name without extension.
func (s *Script) Name() string { return s.name }

// SHA is the SHA1 digest Redis knows the script by.
func (s *Script) SHA() string { return s.sha }

// Source is the Lua text of the script.
func (s *Script) Source() string { return s.src }

// Function is the name of the script's function in GrabLibrary (run by Call), or ""
// when the script is not in the library.
func (s *Script) Function() string { return s.function }

// Call runs the script as its function in GrabLibrary (FCALL), routed by its first
// key. It never falls back to EVAL: a server that lacks the library answers "ERR
// Function not found" (IsFunctionMissing), and only the operator loads it. A script
// that is not in the library is refused without a command sent.
func (s *Script) Call(ctx context.Context, c redis.Cmdable, keys []string, args ...any) *redis.Cmd {
	if s.function == "" {
		cmd := redis.NewCmd(ctx)
		cmd.SetErr(fmt.Errorf("script %s is not a function of library %s", s.name, GrabLibrary.name))
		return cmd
	}
	return c.FCall(ctx, s.function, keys, args...)
}

// Run executes the script, with EVAL as the fallback on NOSCRIPT.
func (s *Script) Run(ctx context.Context, c redis.Scripter, keys []string, args ...any) *redis.Cmd {
	cmd := c.EvalSha(ctx, s.sha, keys, args...)
	if IsNoScript(cmd.Err()) {
		return c.Eval(ctx, s.src, keys, args...)
	}
	return cmd
}

// Load puts the script into the script cache of every master that may serve it.
func (s *Script) Load(ctx context.Context, c redis.UniversalClient) error {
	load := func(ctx context.Context, node *redis.Client) error {
		got, err := node.ScriptLoad(ctx, s.src).Result()
		if err != nil {
			return fmt.Errorf("loading script %s on %s: %w", s.name, node.Options().Addr, err)
		}
		if got != s.sha {
			return fmt.Errorf("loading script %s: server digest %s, want %s", s.name, got, s.sha)
		}
		return nil
	}
	if cc, ok := c.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, load)
	}
	if sc, ok := c.(*redis.Client); ok {
		return load(ctx, sc)
	}
	if err := c.ScriptLoad(ctx, s.src).Err(); err != nil {
		return fmt.Errorf("loading script %s: %w", s.name, err)
	}
	return nil
}

// IsNoScript reports whether err says the script cache lacks the script.
func IsNoScript(err error) bool {
	if err == nil {
		return false
	}
	var re redis.Error
	if errors.As(err, &re) {
		return strings.HasPrefix(re.Error(), "NOSCRIPT")
	}
	return strings.HasPrefix(err.Error(), "NOSCRIPT")
}

var (
	//go:embed grab.lua
	grabSrc string
	//go:embed seed_stage.lua
	seedStageSrc string
	//go:embed seed_commit.lua
	seedCommitSrc string
	//go:embed configure.lua
	configureSrc string
	//go:embed close.lua
	closeSrc string
	//go:embed snapshot.lua
	snapshotSrc string
	//go:embed settle_ack.lua
	settleAckSrc string
	//go:embed dead_letter.lua
	deadLetterSrc string
	//go:embed fence.lua
	fenceSrc string
	//go:embed accept.lua
	acceptSrc string
	//go:embed ensure_group.lua
	ensureGroupSrc string
	//go:embed events_mark.lua
	eventsMarkSrc string
	//go:embed transfer_out.lua
	transferOutSrc string
	//go:embed transfer_in.lua
	transferInSrc string
	//go:embed transfer_done.lua
	transferDoneSrc string
	//go:embed stock.lua
	stockSrc string
	//go:embed refund_activity.lua
	refundActivitySrc string
	//go:embed replay_dead.lua
	replayDeadSrc string
	//go:embed ledger_credit.lua
	ledgerCreditSrc string
	//go:embed ledger_allowance.lua
	ledgerAllowanceSrc string
	//go:embed packet_create.lua
	packetCreateSrc string
	//go:embed packet_grab.lua
	packetGrabSrc string
	//go:embed packet_detail.lua
	packetDetailSrc string
	//go:embed packet_live.lua
	packetLiveSrc string
	//go:embed packet_expire.lua
	packetExpireSrc string
	//go:embed packet_forget.lua
	packetForgetSrc string
	//go:embed packet_quota.lua
	packetQuotaSrc string
	//go:embed budget_configure.lua
	budgetConfigureSrc string
	//go:embed budget_close.lua
	budgetCloseSrc string
	//go:embed budget_snapshot.lua
	budgetSnapshotSrc string
	//go:embed budget_lend.lua
	budgetLendSrc string
	//go:embed budget_borrow.lua
	budgetBorrowSrc string
	//go:embed budget_lend_done.lua
	budgetLendDoneSrc string
)

// The activity's scripts.
var (
	// GrabScript decides one claim: see grab.lua.
	GrabScript = newScript("grab", grabSrc)
	// SeedStageScript appends one chunk of packets to staging exactly once.
	SeedStageScript = newScript("seed_stage", seedStageSrc)
	// SeedCommitScript turns a complete staging list into the activity.
	SeedCommitScript = newScript("seed_commit", seedCommitSrc)
	// ConfigureScript sets the schedule and pause flag and opens the activity.
	ConfigureScript = newScript("configure", configureSrc)
	// CloseScript ends grabbing on one shard, writing no refund.
	CloseScript = newScript("close", closeSrc)
	// SnapshotScript reads every counter at one instant.
	SnapshotScript = newScript("snapshot", snapshotSrc)
	// SettleAckScript acknowledges a delivered entry and counts it, once.
	SettleAckScript = newScript("settle_ack", settleAckSrc)
	// DeadLetterScript parks an undeliverable entry, once.
	DeadLetterScript = newScript("dead_letter", deadLetterSrc)
	// FenceScript stops an activity whose Redis rolled back.
	FenceScript = newScript("fence", fenceSrc)
	// AcceptScript lifts a fence and starts a new epoch.
	AcceptScript = newScript("accept", acceptSrc)
	// EnsureGroupScript creates a consumer group on a settlement stream (settlement's
	// at its start, a budget's events group at its end), never the stream of a purged
	// activity or budget.
	EnsureGroupScript = newScript("ensure_group", ensureGroupSrc)
	// EventsMarkScript records which of a packet's events were delivered.
	EventsMarkScript = newScript("events_mark", eventsMarkSrc)
	// TransferOutScript moves packets from a shard's list into its journal.
	TransferOutScript = newScript("transfer_out", transferOutSrc)
	// TransferInScript applies a journalled transfer on its destination, once.
	TransferInScript = newScript("transfer_in", transferInSrc)
	// TransferDoneScript removes an applied transfer from its source's journal.
	TransferDoneScript = newScript("transfer_done", transferDoneSrc)
	// StockScript reads a shard's transfer sequence and stock at one instant.
	StockScript = newScript("stock", stockSrc)
	// RefundActivityScript writes an activity's one refund, once, after every shard
	// closed.
	RefundActivityScript = newScript("refund_activity", refundActivitySrc)
	// ReplayDeadScript moves dead-lettered entries back into the settlement stream.
	ReplayDeadScript = newScript("replay_dead", replayDeadSrc)
	// LedgerCreditScript decides, once, whether settlement may credit an entry, in
	// the operator's ledger (an operator-only key).
	LedgerCreditScript = newScript("ledger_credit", ledgerCreditSrc)
	// LedgerAllowanceScript records that the activity's allowance was announced.
	LedgerAllowanceScript = newScript("ledger_allowance", ledgerAllowanceSrc)
)

// The scripts of a RedPacketBudget's runtime packets (docs/budgets.md). The grab
// fleet's (create, grab, detail, live listing) are functions of GrabLibrary
// (PacketSideScripts); the operator's run with EVALSHA.
var (
	// PacketCreateScript draws a packet's money from its budget shard and seeds it,
	// in one step: see packet_create.lua.
	PacketCreateScript = newScript("packet_create", packetCreateSrc)
	// PacketGrabScript decides one user's grab of a runtime packet.
	PacketGrabScript = newScript("packet_grab", packetGrabSrc)
	// PacketDetailScript reads a runtime packet and its grabs.
	PacketDetailScript = newScript("packet_detail", packetDetailSrc)
	// PacketLiveScript lists a budget shard's live packets, soonest expiry first.
	PacketLiveScript = newScript("packet_live", packetLiveSrc)
	// PacketExpireScript expires a bounded batch of due packets, refunding each
	// remainder once.
	PacketExpireScript = newScript("packet_expire", packetExpireSrc)
	// PacketForgetScript deletes an expired packet's hash.
	PacketForgetScript = newScript("packet_forget", packetForgetSrc)
	// PacketQuotaScript takes or gives back one use of a sender's or recipient's
	// quotas on their home budget shard, when the packet lives on another.
	PacketQuotaScript = newScript("packet_quota", packetQuotaSrc)
	// BudgetConfigureScript writes a budget shard's limits and raises its allotment.
	BudgetConfigureScript = newScript("budget_configure", budgetConfigureSrc)
	// BudgetCloseScript stops creation on a budget shard.
	BudgetCloseScript = newScript("budget_close", budgetCloseSrc)
	// BudgetSnapshotScript reads a budget shard's money and counters at one instant.
	BudgetSnapshotScript = newScript("budget_snapshot", budgetSnapshotSrc)
	// BudgetLendScript lends part of a budget shard's available money to a dry
	// sibling: the first step of a move.
	BudgetLendScript = newScript("budget_lend", budgetLendSrc)
	// BudgetBorrowScript lands a move's money on the borrowing shard, once.
	BudgetBorrowScript = newScript("budget_borrow", budgetBorrowSrc)
	// BudgetLendDoneScript clears a finished move's record on the lender.
	BudgetLendDoneScript = newScript("budget_lend_done", budgetLendDoneSrc)
)

// PacketSideScripts are the scripts of runtime packets the grab fleet runs, as
// functions of GrabLibrary: the create, the grab, the detail and the live listing,
// the three steps of a move of money to a dry budget shard, and the quotas' take and
// give on a home shard.
func PacketSideScripts() []*Script {
	return []*Script{PacketCreateScript, PacketGrabScript, PacketDetailScript, PacketLiveScript,
		BudgetLendScript, BudgetBorrowScript, BudgetLendDoneScript, PacketQuotaScript}
}

// AllScripts lists every script, for loading them all at once.
func AllScripts() []*Script {
	return []*Script{GrabScript, SeedStageScript, SeedCommitScript, ConfigureScript,
		CloseScript, SnapshotScript, SettleAckScript, DeadLetterScript, ReplayDeadScript,
		FenceScript, AcceptScript, EnsureGroupScript, TransferOutScript, TransferInScript,
		TransferDoneScript, StockScript, RefundActivityScript, LedgerCreditScript, LedgerAllowanceScript,
		PacketCreateScript, PacketGrabScript, PacketDetailScript, PacketLiveScript, PacketExpireScript,
		PacketForgetScript, BudgetConfigureScript, BudgetCloseScript, BudgetSnapshotScript,
		LedgerPacketsCreditScript, LedgerPacketsTotalScript, BudgetLendScript, BudgetBorrowScript, BudgetLendDoneScript, PacketQuotaScript,
		EventsMarkScript}
}

// LoadAll loads the operator's scripts into the script cache and GrabLibrary as a
// function library, on every master.
func LoadAll(ctx context.Context, c redis.UniversalClient) error {
	for _, s := range AllScripts() {
		if s.function != "" {
			continue // run as a function, never from the script cache
		}
		if err := s.Load(ctx, c); err != nil {
			return err
		}
	}
	if _, err := GrabLibrary.Ensure(ctx, c); err != nil {
		return err
	}
	return nil
}
