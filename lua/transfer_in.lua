-- transfer_in: the second half of a move between shards, on the destination.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] applied transfers of the destination shard
-- ARGV[1] transfer id, ARGV[2] count, ARGV[3] amount, ARGV[4..] "<id>:<amount>"
-- Returns applied (now or before: a transfer is applied at most once, whoever
-- retries it), or missing / fenced / closed, when nothing was written. A closed
-- destination takes nothing: its refund is fixed, and the activity's refund counts
-- every packet that is neither claimed nor in an open list.
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return 'applied'
end
local m = redis.call('HMGET', KEYS[1], 'state', 'fenced')
if not m[1] then
  return 'missing'
end
if m[2] then
  return 'fenced'
end
if m[1] == 'closed' then
  return 'closed'
end
local batch = 1000
for i = 4, #ARGV, batch do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + batch - 1, #ARGV)))
end
redis.call('HINCRBY', KEYS[1], 'count', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'total', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'transfer_seq', 1)
redis.call('HSET', KEYS[3], ARGV[1], '1')
return 'applied'
