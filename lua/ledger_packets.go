package lua

import _ "embed"

var (
	//go:embed ledger_packets_credit.lua
	ledgerPacketsCreditSrc string
	//go:embed ledger_packets_total.lua
	ledgerPacketsTotalSrc string
)

// The operator's ledger scripts of a RedPacketBudget (runtime packets); they run from
// the script cache on the operator's Redis user only.
var (
	// LedgerPacketsCreditScript decides, once, whether settlement may credit a
	// budget's entry: each key once, never beyond the announced total.
	LedgerPacketsCreditScript = newScript("ledger_packets_credit", ledgerPacketsCreditSrc)
	// LedgerPacketsTotalScript records the budget total announced to the balance
	// system, and the announcement under way.
	LedgerPacketsTotalScript = newScript("ledger_packets_total", ledgerPacketsTotalSrc)
)
