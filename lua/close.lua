-- close: end grabbing for good and refund the unclaimed remainder to the sponsor.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] stream
-- ARGV[1] reason: "expired" (always closes) or "exhausted" (closes only when no
-- packet is left); ARGV[2] "0" closes a shard of a sharded activity: no refund
-- entry, and "refunded" stays 0 (the shard refunds nothing itself; the activity's one
-- refund is written on shard 0 by refund_activity.lua, so a refund entry on any other
-- shard is forged); anything else or nothing refunds the remainder
-- Returns {result, reason, refunded}; result is closed, open (not exhausted yet),
-- missing, or fenced (the activity is fenced after a rollback: its counters cannot be
-- trusted to compute a refund, so nothing is written). Closing twice returns the
-- first close's figures. The refund goes to the sponsor the meta hash holds now
-- (configure keeps it current).
local m = redis.call('HMGET', KEYS[1], 'state', 'close_reason', 'refunded', 'total',
  'claimed_amount', 'sponsor', 'fenced', 'currency')
if not m[1] then
  return {'missing', '', 0}
end
if m[7] then
  return {'fenced', '', 0}
end
if m[1] == 'closed' then
  return {'closed', m[2], tonumber(m[3])}
end
local left = redis.call('LLEN', KEYS[2])
if ARGV[1] == 'exhausted' and left > 0 then
  return {'open', '', 0}
end
-- The claimed amount is read as snapshot.lua reads it (the head's <amountBefore>,
-- the total when nothing is listed, the claimed_amount field for a head seeded
-- without '@') and recorded, since the list it comes from goes now.
local claimed = m[5] or '0'
if left == 0 then
  claimed = m[4]
else
  local head = redis.call('LINDEX', KEYS[2], 0)
  local at = string.find(head, '@', 1, true)
  if at then
    claimed = string.sub(head, string.find(head, ':', at + 1, true) + 1)
  end
end
local refund = tonumber(m[4]) - tonumber(claimed)
local refundStr = string.format('%d', refund)
redis.call('UNLINK', KEYS[2])
-- The gate goes to "-": no grab takes the fast path of an open activity any more
-- (see grab.lua).
local recorded = refundStr
if ARGV[2] == '0' then
  recorded = '0'
end
redis.call('HSET', KEYS[1], 'state', 'closed', 'close_reason', ARGV[1], 'refunded', recorded, 'gate', '-',
  'claimed_amount', claimed)
if refund > 0 and ARGV[2] ~= '0' then
  local t = redis.call('TIME')
  redis.call('XADD', KEYS[3], '*', 'kind', 'refund', 'packet', 'refund', 'user', m[6],
    'amount', refundStr, 'currency', m[8] or '',
    'at', string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
end
return {'closed', ARGV[1], refund}
