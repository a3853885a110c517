-- budget_snapshot: read a budget shard's money and counters at one instant.
-- KEYS[1] the shard's meta, KEYS[2] its due index
-- Returns the values of state, allotted, available, live, claimed, refunded,
-- created, expired, grabbed, settled_count, settled_amount, refund_settled,
-- dead_count, lent and borrowed (budget_lend.lua) and epoch (the operator's
-- reconcile epoch, store.Budget.AdvanceEpoch), in that order ("" for a field
-- not set; state "" means the shard was
-- never configured), then the number of live packets whose expiry has passed by the
-- Redis clock and are not expired yet (the expiry backlog: ZCOUNT, O(log N)).
local v = redis.call('HMGET', KEYS[1], 'state', 'allotted', 'available', 'live', 'claimed', 'refunded', 'created',
  'expired', 'grabbed', 'settled_count', 'settled_amount', 'refund_settled', 'dead_count', 'lent', 'borrowed', 'epoch')
for i = 1, 16 do
  v[i] = v[i] or ''
end
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
v[17] = tostring(redis.call('ZCOUNT', KEYS[2], '-inf', now))
return v
