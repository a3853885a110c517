-- budget_snapshot: read a budget shard's money and counters at one instant.
-- KEYS[1] the shard's meta
-- Returns the values of state, allotted, available, live, claimed, refunded,
-- created, expired, grabbed, settled_count, settled_amount, refund_settled and
-- dead_count, in that order ("" for a field not set; state "" means the shard was
-- never configured).
local v = redis.call('HMGET', KEYS[1], 'state', 'allotted', 'available', 'live', 'claimed', 'refunded', 'created',
  'expired', 'grabbed', 'settled_count', 'settled_amount', 'refund_settled', 'dead_count')
for i = 1, 13 do
  v[i] = v[i] or ''
end
return v
