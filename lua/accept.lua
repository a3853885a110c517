-- accept: take an activity's Redis state as it is, after a human reconciled the
-- balances of a rollback, and start a new epoch.
-- KEYS[1] meta
-- ARGV[1] the epoch the caller saw (the fenced state it decided on)
-- Returns the new epoch; -1 when the activity is not in Redis; -2 when Redis is not
-- at the epoch the caller saw (another accept, or another rollback, came between).
-- Watermarks of earlier epochs are ignored by the grab script from now on, and a
-- Redis restored to before this accept carries a lower epoch and is fenced again.
local m = redis.call('HMGET', KEYS[1], 'state', 'epoch')
if not m[1] then
  return -1
end
local epoch = tonumber(m[2]) or 0
if epoch ~= tonumber(ARGV[1]) then
  return -2
end
redis.call('HDEL', KEYS[1], 'fenced')
-- The gate carries the epoch: the next grab writes it again (see grab.lua).
redis.call('HSET', KEYS[1], 'gate', '-')
return redis.call('HINCRBY', KEYS[1], 'epoch', 1)
