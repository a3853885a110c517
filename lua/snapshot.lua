-- snapshot: read every counter of an activity at one instant.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] staging
-- Returns {state, paused, total, count, claimed_count, claimed_amount, refunded,
-- settled_count, settled_amount, refund_settled, dead_count, remaining_count,
-- staged_count, close_reason, start_ms, end_ms, seeded_ms}; state is "" when the
-- activity is not in Redis.
local m = redis.call('HMGET', KEYS[1], 'state', 'paused', 'total', 'count',
  'claimed_count', 'claimed_amount', 'refunded', 'settled_count', 'settled_amount',
  'refund_settled', 'dead_count', 'close_reason', 'start_ms', 'end_ms', 'seeded_ms')
return {m[1] or '', m[2] or '0', m[3] or '0', m[4] or '0', m[5] or '0', m[6] or '0',
  m[7] or '0', m[8] or '0', m[9] or '0', m[10] or '0', m[11] or '0',
  tostring(redis.call('LLEN', KEYS[2])), tostring(redis.call('LLEN', KEYS[3])),
  m[12] or '', m[13] or '0', m[14] or '0', m[15] or '0'}
