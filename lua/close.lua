-- close: end grabbing on one shard for good and record what was claimed there.
-- KEYS[1] meta, KEYS[2] packets
-- ARGV[1] reason: "expired" (always closes) or "exhausted" (closes only when no
-- packet is left)
-- Returns {result, reason}; result is closed, open (not exhausted yet), missing, or
-- fenced (the activity is fenced after a rollback: its counters cannot be trusted to
-- compute a refund, so nothing is written). Closing twice returns the first close's
-- reason. No refund is written here: the activity's one refund, on shard 0, is
-- refund_activity.lua's, once every shard is closed (the claimed amounts are final
-- then), so a refund entry anywhere else is forged.
local m = redis.call('HMGET', KEYS[1], 'state', 'close_reason', 'total', 'fenced')
if not m[1] then
  return {'missing', ''}
end
if m[4] then
  return {'fenced', ''}
end
if m[1] == 'closed' then
  return {'closed', m[2]}
end
local left = redis.call('LLEN', KEYS[2])
if ARGV[1] == 'exhausted' and left > 0 then
  return {'open', ''}
end
-- The claimed amount is read as snapshot.lua reads it (the head's <amountBefore>, the
-- total when nothing is listed) and recorded, since the list it comes from goes now.
local claimed = m[3]
if left > 0 then
  local head = redis.call('LINDEX', KEYS[2], 0)
  local at = string.find(head, '@', 1, true)
  claimed = string.sub(head, string.find(head, ':', at + 1, true) + 1)
end
redis.call('UNLINK', KEYS[2])
-- The gate goes to "-": no grab takes the fast path of an open activity any more
-- (see grab.lua).
redis.call('HSET', KEYS[1], 'state', 'closed', 'close_reason', ARGV[1], 'gate', '-',
  'claimed_amount', claimed)
return {'closed', ARGV[1]}
