// Package store is an activity's data in Redis: where its packets wait, who holds
// which, what settlement still owes, and the atomic Lua scripts (package lua) that
// are the only writers of all of it. Outside this package nothing issues a Redis
// command about an activity: everything goes through the activity's handle,
// NewActivity(client, uid, n), and its methods; Activity.Shard(i) hands out one
// shard for the calls that are that shard's own (its grabs, its claims). A shard's
// settlement stream, consumer group and dead letters are a Stream, which an
// activity's shards and a budget's hand out alike (Activity.Stream(i),
// Budget.Stream(i)): settlement works on a Stream whichever kind it credits.
// Clients are opened by package store/redisconn.
//
// Where things happen, one hop each:
//
//   - a grab is decided: Activity.Grab (grab.go) and grab.lua;
//   - an activity is seeded: Activity.Seed (seed.go, seed_direct.go), seed_stage.lua
//     and seed_commit.lua;
//   - a packet moves between shards: Activity.Transfer and Refill (transfer.go),
//     transfer_out.lua, transfer_in.lua and transfer_done.lua;
//   - money is refunded: Activity.Close (close.go), close.lua on every shard, then
//     refund_activity.lua once;
//   - the schedule, the fence and an accepted rollback: lifecycle.go;
//   - reading the counters: Shard snapshots (snapshot.go, snapshot.lua), summed
//     over shards into a View (view.go);
//   - settlement: the Stream handle (settlement_stream.go), the consumer group and
//     the checks of its entries (stream.go), the
//     acknowledgement and the dead letters (settle.go, replay.go), and the operator's
//     ledger of what was credited (ledger.go, ledger_credit.lua);
//   - deleting an activity: purge.go; its Redis user: acl.go; durability:
//     durability.go;
//   - how the scripts run: functions.go. The grab-side scripts (lua.GrabSideScripts)
//     are the functions of one library, lua.GrabLibrary, called with FCALL by every
//     caller; the operator's scripts (seed, configure, close, fence, accept, refund)
//     are cached scripts run with EVALSHA and an EVAL fallback. Only the operator
//     loads the library, through the store (LoadScripts, and the Library handle
//     the manager's function keeper and a budget's reconcile use: library.go); an
//     activity's own Redis user may FCALL it and run no other Lua (acl.go). A call
//     that finds the library missing fails with ErrFunctionMissing, except on a
//     handle of the operator's (RestoreFunctions), which loads it and retries once. Each grab-side script caps
//     the work one call can do, whatever its arguments.
//
// The invariants, which every script keeps in one atomic step:
//
//   - Money is integers, in minor units, and never rounded. At every instant each
//     packet is in exactly one place: a shard's packets list, a claim, or a transfer
//     journal entry not yet applied; once the activity is closed, what is in none of
//     them is in its one refund. So claimed + listed + in transfer + refunded =
//     total, in packets and in money (View.Conservation).
//   - One packet per user: a user's claim is decided by their home shard alone, whose
//     claims hash is the whole truth about them (Activity.Home).
//   - Nothing is paid twice: every grant writes one settlement entry in the step that
//     records its claim, and the claim names that entry, so a copy of an entry is
//     told apart (Shard.VerifyEntries); an entry is counted as settled only once
//     (settle_ack.lua), and the refund is written once (refund_activity.lua).
//   - Nothing beyond what was seeded is credited: the operator's ledger lets each
//     packet be credited to one user at most, and the grants plus the refund never
//     above the total (ledger_credit.lua), in one step with the decision.
//   - A Redis that comes back older than what was acknowledged is fenced, and grants
//     nothing until a person accepts its state (grab.lua, fence.lua, accept.lua): below
//     a caller's claimed count or, for a shard, below its transfer sequence (Watermark,
//     ShardMarks; the transfer scripts fence it too). A shard's transfer sequence is
//     kept by the destinations of the transfers out of it (transfer_in.lua) and read
//     from them before every grab and transfer there (Activity.RecordedMark), so every
//     caller fences it, not only the one that made the transfer.
//   - A sharded seed is all or nothing: shard 0's commit records the activity's count
//     and total in the same script, so a seed cut between any two calls is completed
//     by the next (seed_commit.lua).
//
// Every key of a shard carries one hash tag, {<uid>} for an activity of one shard and
// {<uid>.<i>} for shard i of more, so a shard lives on one Redis Cluster slot and
// every script can touch all of its keys:
//
//	rpa:{uid}:meta     hash: state, schedule, totals and every counter but the
//	                   claimed count, and the grab script's gate (grab.lua); on
//	                   shard 0 also the activity's count, total and refund; the
//	                   shard's transfer_seq, raised by every transfer step and by
//	                   nothing else (transfer_out.lua)
//	rpa:{uid}:staging  list: packets written in chunks before the commit
//	rpa:{uid}:packets  list: the unclaimed packets, "<packetId>:<amount>@<countBefore>:<amountBefore>",
//	                   what was claimed from the list before each (grab.lua)
//	rpa:{uid}:claims   hash: userId -> "<packetId>:<amount>:<stream entry id>", one
//	                   field per grant and nothing else: its length is the claimed count
//	rpa:{uid}:stream   stream: one entry per grant and per refund, for settlement
//	                   (a grant is one field, see stream.go)
//	rpa:{uid}:dead     stream: deliveries parked after too many failures
//	rpa:{uid}:xout     hash: transfers to another shard not yet known applied
//	rpa:{uid}:xin      hash: transfers from other shards applied here
//
// One key per activity (all its shards) is the operator's alone: its prefix is not
// the rpa: that the activity's ACL user is confined to, so the tenant who holds that
// user's password cannot touch it.
//
//	rpl:{uid}:ledger   hash: "p:<packetId>" -> the user it was credited to, the sums
//	                   credited and granted, the refund, the announced budget
//
// A RedPacketBudget's packets, created at runtime, live under the rpb: prefix, one hash
// tag per budget shard (budget.go, budget_admin.go, budget_packets.go and
// docs/budgets.md): a shard's meta, due index, stream and dead letters, and one hash
// per packet under the tag of the shard its id hashes to, so creating a packet draws
// its money and seeds it in one script.
package store
