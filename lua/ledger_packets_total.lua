-- ledger_packets_total: the budget total a RedPacketBudget announced to the balance
-- system, and the announcement under way.
-- KEYS[1] the budget's ledger hash, rpl:{<uid>}:ledger (operator-only)
-- ARGV[1] "get", "prepare" or "commit".
--   get                  returns {total, pending}: the announced total ("" when none)
--                        and the announcement under way, "<total>:<at ms>" ("" when none).
--   prepare <total> <at> when no announcement is under way and <total> exceeds the
--                        announced one, records "<total>:<at>" as under way; returns
--                        {total, pending} as get does. A pending announcement is kept
--                        until committed, so every resend has the same body.
--   commit <total>       the announcement of <total> was acknowledged: the announced
--                        total becomes the larger of it and the recorded one, and
--                        the pending announcement of <total> is cleared; returns
--                        {total, pending}.
-- The announced total only grows: the ledger never lets credits exceed it.
local op = ARGV[1]
if op == 'prepare' then
  local want = tonumber(ARGV[2])
  local have = tonumber(redis.call('HGET', KEYS[1], 'total') or '0')
  if want and want > have and redis.call('HEXISTS', KEYS[1], 'announcing') == 0 then
    redis.call('HSET', KEYS[1], 'announcing', ARGV[2] .. ':' .. ARGV[3])
  end
elseif op == 'commit' then
  local pending = redis.call('HGET', KEYS[1], 'announcing')
  if pending and string.match(pending, '^(%d+):') == ARGV[2] then
    local have = tonumber(redis.call('HGET', KEYS[1], 'total') or '0')
    if tonumber(ARGV[2]) > have then
      redis.call('HSET', KEYS[1], 'total', ARGV[2])
    end
    redis.call('HDEL', KEYS[1], 'announcing')
  end
elseif op ~= 'get' then
  return redis.error_reply('ERR unknown operation ' .. tostring(op))
end
return {redis.call('HGET', KEYS[1], 'total') or '', redis.call('HGET', KEYS[1], 'announcing') or ''}
