-- budget_configure: write a budget shard's limits and raise its allotment, creating
-- the shard on the first call.
-- KEYS[1] the shard's meta
-- ARGV[1] the allotment the caller read (its compare-and-set; "0" for a shard not
-- created yet), ARGV[2] the new allotment, ARGV[3] the raise (ARGV[2] - ARGV[1],
-- computed exactly by the caller), ARGV[4] currency, ARGV[5] max_total,
-- ARGV[6] max_count, ARGV[7] min_share, ARGV[8] the allowed distributions as
-- ",A,B,", ARGV[9] default_ttl_ms, ARGV[10] max_ttl_ms
-- Returns {'ok', allotment}, or, writing nothing, {'moved', allotment} when the
-- allotment is not the one the caller read (read again and retry), {'lowered',
-- allotment} when the new one is below it (an allotment is never lowered), or
-- {'currency', currency} when the shard holds money in another currency.
--
-- Conservation: a raise adds the same amount to allotted and available, so
-- allotted = available + live + claimed + refunded still holds. The first call
-- writes every counter (at zero, available at the allotment) and the state open; a
-- closed shard stays closed. Idempotent: the same arguments again change nothing.
local m = redis.call('HMGET', KEYS[1], 'allotted', 'currency', 'state')
local cur = m[1] or '0'
if cur ~= ARGV[1] then
  return {'moved', cur}
end
local new = ARGV[2]
if #new < #cur or (#new == #cur and new < cur) then
  return {'lowered', cur}
end
if m[2] and m[2] ~= ARGV[4] then
  return {'currency', m[2]}
end
if not m[3] then
  redis.call('HSET', KEYS[1], 'state', 'open', 'currency', ARGV[4], 'allotted', new, 'available', new,
    'live', 0, 'claimed', 0, 'refunded', 0, 'created', 0, 'expired', 0, 'grabbed', 0)
elseif new ~= cur then
  redis.call('HINCRBY', KEYS[1], 'available', ARGV[3])
  redis.call('HSET', KEYS[1], 'allotted', new)
end
redis.call('HSET', KEYS[1], 'max_total', ARGV[5], 'max_count', ARGV[6], 'min_share', ARGV[7], 'dists', ARGV[8],
  'default_ttl_ms', ARGV[9], 'max_ttl_ms', ARGV[10])
return {'ok', new}
