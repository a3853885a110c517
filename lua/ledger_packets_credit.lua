-- ledger_packets_credit: decide, once and for good, whether settlement may credit each
-- of a batch of a RedPacketBudget's stream entries, and record the decision in the
-- operator's ledger of the budget: each packet's creation record is booked as the
-- packet's account, and each grant and refund is held to that account.
-- KEYS[1] the budget's ledger hash, rpl:{<uid>}:ledger; then one key per entry: the
-- ledger of the entry's packet, rpl:{<uid>}:p:<packetId> (operator-only keys: the
-- budget's Redis user may not touch them). All carry the hash tag {<uid>}.
-- ARGV[1] how long a packet's ledger is kept after its last write, in milliseconds;
-- then seven arguments per entry: kind (create|grant|refund), share (the 0-based
-- grab order, "refund", or "open" for a creation), user id (a creation's sender),
-- amount (a creation's total), the entry's time (unix ms: a grant's or refund's as
-- its body says, a creation's), the entry id's time (unix ms: when Redis appended it,
-- which no writer can set before an entry already in the stream), and for a
-- creation "<expires ms>:<shares>", the shares in grab order, each a 15-digit
-- zero-padded decimal (the caller decoded and summed them: they sum to the total),
-- "" otherwise.
--
-- The budget's ledger holds "total", the budget announced to the balance system (the
-- highest; see ledger_packets_total.lua); the sums credited: "credited" (grants and
-- refunds), "grants", "granted", "refunds", "refunded"; what the booked packets drew,
-- "drawn" in "packets"; and "accounts_since" (BudgetLedger.AccountsSince): from that
-- time on every packet's creation record is in its stream before its entries.
--
-- A packet's ledger holds its account, booked from its creation record:
-- "open" = "<total>:<created ms>:<expires ms>:<sender>" and "sh" its shares; "paid",
-- what was credited against it; and each credited share, and "refund", mapped to
-- "<amount>:<at ms>:<user>". A packet's entries follow its creation record in its
-- shard's stream (its grabs after its creation, its refund after its last grab), and
-- no writer can append an entry before one already there: the account decides them
-- in that order. The refund is held to what the credited grants left, so a refund
-- decided before a grant (a worker's crash reorders what its group hands out) still
-- never lets the packet pay out more than its total (over_packet).
--
-- Per entry, in order, one verdict:
--   "ok"        recorded now: deliver it (a creation: booked, nothing to deliver);
--   "again"     the same key was recorded before with the same body (a
--               redelivery, a replayed dead letter): deliver it, nothing changes;
--   "duplicate_packet:<user>"  the key was credited before to <user>, or with
--               another body; for a creation, another account under the same id;
--   "over_budget" the credits so far and this one (for a creation: the packets
--               booked so far and this one) would exceed the announced total;
--   "packet_unknown" a grant or refund written at or after accounts_since whose
--               packet has no account: no creation record was booked for it;
--   "packet_out_of_range" a grant of a share the account does not have;
--   "amount_mismatch" a grant of another amount than the account's share;
--   "claim_mismatch" a refund to another user than the packet's sender;
--   "over_packet" this credit and those already paid against the packet would
--               exceed its total.
-- Only "ok" writes, so a refused entry leaves the ledger as it was and the sums never
-- exceed the announced total, whatever order the entries come in. Without an
-- announced total nothing is decided: an error, and the worker tries again.
--
-- Bounded work: each entry is a handful of hash reads and writes; a share is read at
-- a fixed place of "sh" (no scan), and booking writes one string of 15 bytes a share
-- (at most 1000). The caller sends at most 16 entries a call (store.LedgerDecideStep).
local total = redis.call('HGET', KEYS[1], 'total')
if not total then
  return redis.error_reply('ERR the budget was not announced: no total in ' .. KEYS[1])
end
total = tonumber(total)
local retention = tonumber(ARGV[1])
if not retention or retention < 1 then
  return redis.error_reply('ERR retention ' .. tostring(ARGV[1]) .. ' is not a positive number of milliseconds')
end
if #ARGV - 1 ~= 7 * (#KEYS - 1) then
  return redis.error_reply('ERR ' .. (#KEYS - 1) .. ' packet keys for ' .. ((#ARGV - 1) / 7) .. ' entries')
end
local sums = redis.call('HMGET', KEYS[1], 'credited', 'drawn', 'accounts_since')
local credited, drawn = tonumber(sums[1] or '0'), tonumber(sums[2] or '0')
local accountsSince = tonumber(sums[3] or '')
local out = {}
for i = 2, #KEYS do
  local a = 2 + (i - 2) * 7
  local kind, share, user, amount = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  local at, appended, extra = ARGV[a + 4], tonumber(ARGV[a + 5]), ARGV[a + 6]
  local verdict
  if kind == 'create' then
    local exp, sh = string.match(extra, '^(%d+):(%d*)$')
    if not exp or #sh == 0 or #sh % 15 ~= 0 then
      return redis.error_reply('ERR creation record of entry ' .. (i - 1) .. ' has no expiry and shares')
    end
    local record = ARGV[a + 3] .. ':' .. at .. ':' .. exp .. ':' .. user
    local held = redis.call('HMGET', KEYS[i], 'open', 'sh')
    if held[1] then
      if held[1] == record and held[2] == sh then
        verdict = 'again'
      else
        verdict = 'duplicate_packet:' .. (string.match(held[1], '^%d+:%d+:%d+:(.*)$') or '')
      end
    elseif drawn + amount > total then
      verdict = 'over_budget'
    else
      drawn = drawn + amount
      redis.call('HSET', KEYS[i], 'open', record, 'sh', sh, 'paid', 0)
      redis.call('PEXPIRE', KEYS[i], retention)
      redis.call('HSET', KEYS[1], 'drawn', drawn)
      redis.call('HINCRBY', KEYS[1], 'packets', 1)
      verdict = 'ok'
    end
  else
    local record = ARGV[a + 3] .. ':' .. at .. ':' .. user
    local p = redis.call('HMGET', KEYS[i], share, 'open', 'paid')
    local held, acct, paid = p[1], p[2], tonumber(p[3] or '0')
    if held then
      if held == record then
        verdict = 'again'
      else
        local first = string.find(held, ':', 1, true) or 0
        verdict = 'duplicate_packet:' .. string.sub(held, (string.find(held, ':', first + 1, true) or first) + 1)
      end
    elseif acct then
      local tot, snd = string.match(acct, '^(%d+):%d+:%d+:(.*)$')
      tot = tonumber(tot)
      if kind == 'refund' then
        if user ~= snd then
          verdict = 'claim_mismatch'
        end
      else
        local sh = redis.call('HGET', KEYS[i], 'sh') or ''
        local n = tonumber(share)
        if not n or n >= #sh / 15 then
          verdict = 'packet_out_of_range'
        elseif tonumber(string.sub(sh, n * 15 + 1, n * 15 + 15)) ~= amount then
          verdict = 'amount_mismatch'
        end
      end
      if not verdict and paid + amount > tot then
        verdict = 'over_packet'
      end
    elseif accountsSince and appended >= accountsSince then
      verdict = 'packet_unknown'
    end
    if verdict then
      -- refused above
    elseif credited + amount > total then
      verdict = 'over_budget'
    else
      credited = credited + amount
      redis.call('HSET', KEYS[i], share, record)
      if acct then
        redis.call('HINCRBY', KEYS[i], 'paid', amount)
      end
      redis.call('PEXPIRE', KEYS[i], retention)
      redis.call('HSET', KEYS[1], 'credited', credited)
      if kind == 'refund' then
        redis.call('HINCRBY', KEYS[1], 'refunds', 1)
        redis.call('HINCRBY', KEYS[1], 'refunded', amount)
      else
        redis.call('HINCRBY', KEYS[1], 'grants', 1)
        redis.call('HINCRBY', KEYS[1], 'granted', amount)
      end
      verdict = 'ok'
    end
  end
  out[#out + 1] = verdict
end
return out
