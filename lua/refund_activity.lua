-- refund_activity: the one refund of an activity, written once on shard 0, the only
-- script that writes a refund.
-- KEYS[1] meta, KEYS[2] stream of shard 0
-- ARGV[1] refund amount (the activity's total minus every shard's claimed amount,
-- read after every shard closed), ARGV[2] reason
-- Returns the refund recorded: the first call's amount, whatever later calls pass.
-- Shards close without a refund of their own (close.lua), because the balance system
-- credits one refund per activity (Idempotency-Key "<uid>/refund"); a packet still
-- journalled between shards at close is neither claimed nor listed, so the refund
-- counts it. No refund entry is written for a refund of nothing.
local prev = redis.call('HGET', KEYS[1], 'activity_refund')
if prev then
  return tonumber(prev)
end
local m = redis.call('HMGET', KEYS[1], 'sponsor', 'currency')
-- "refunded" is the figure a refund entry is verified against (VerifyEntries).
redis.call('HSET', KEYS[1], 'activity_refund', ARGV[1], 'refunded', ARGV[1],
  'activity_close_reason', ARGV[2])
if tonumber(ARGV[1]) > 0 then
  local t = redis.call('TIME')
  redis.call('XADD', KEYS[2], '*', 'kind', 'refund', 'packet', 'refund', 'user', m[1] or '',
    'amount', ARGV[1], 'currency', m[2] or '',
    'at', string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
end
return tonumber(ARGV[1])
