-- ledger_packets_credit: decide, once and for good, whether settlement may credit each
-- of a batch of a RedPacketBudget's stream entries, and record the decision in the
-- operator's ledger of the budget.
-- KEYS[1] the budget's ledger hash, rpl:{<uid>}:ledger; then one key per entry: the
-- ledger of the entry's packet, rpl:{<uid>}:p:<packetId> (operator-only keys: the
-- budget's Redis user may not touch them). All carry the hash tag {<uid>}.
-- ARGV[1] how long a packet's ledger is kept after its last credit, in milliseconds;
-- then five arguments per entry: kind (grant|refund), share (the 0-based grab order,
-- or "refund"), user id, amount, and the entry's time (unix ms).
-- The budget's ledger holds "total", the budget announced to the balance system (the
-- highest; see ledger_packets_total.lua), and the sums credited: "credited" (grants
-- and refunds), "grants", "granted", "refunds", "refunded". A packet's ledger maps
-- each credited share, and "refund", to "<amount>:<user>".
-- Per entry, in order, one verdict:
--   "ok"        recorded now: deliver it;
--   "again"     the same key was recorded before with the same amount, time and
--               user (a redelivery, a replayed dead letter): deliver it, nothing
--               changes;
--   "duplicate_packet:<user>"  the key was credited before to <user>, or with
--               another amount or time (another body under the same key);
--   "over_budget" the credits so far and this one would exceed the announced total.
-- Only "ok" writes, so a refused entry leaves the ledger as it was and the sums never
-- exceed the announced total, whatever order the entries come in. Without an
-- announced total nothing is decided: an error, and the worker tries again.
local total = redis.call('HGET', KEYS[1], 'total')
if not total then
  return redis.error_reply('ERR the budget was not announced: no total in ' .. KEYS[1])
end
total = tonumber(total)
local retention = tonumber(ARGV[1])
if not retention or retention < 1 then
  return redis.error_reply('ERR retention ' .. tostring(ARGV[1]) .. ' is not a positive number of milliseconds')
end
if #ARGV - 1 ~= 5 * (#KEYS - 1) then
  return redis.error_reply('ERR ' .. (#KEYS - 1) .. ' packet keys for ' .. ((#ARGV - 1) / 5) .. ' entries')
end
local credited = tonumber(redis.call('HGET', KEYS[1], 'credited') or '0')
local out = {}
for i = 2, #KEYS do
  local a = 2 + (i - 2) * 5
  local kind, share, user, amount = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  local record = ARGV[a + 3] .. ':' .. ARGV[a + 4] .. ':' .. user
  local verdict
  local held = redis.call('HGET', KEYS[i], share)
  if held then
    if held == record then
      verdict = 'again'
    else
      local first = string.find(held, ':', 1, true) or 0
      verdict = 'duplicate_packet:' .. string.sub(held, (string.find(held, ':', first + 1, true) or first) + 1)
    end
  elseif credited + amount > total then
    verdict = 'over_budget'
  else
    credited = credited + amount
    redis.call('HSET', KEYS[i], share, record)
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
  out[#out + 1] = verdict
end
return out
