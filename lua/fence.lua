-- fence: stop an activity whose Redis came back older than what was acknowledged.
-- KEYS[1] meta
-- ARGV[1] why (e.g. rolled_back)
-- Returns the fence's reason (the first one written wins), or "missing" when the
-- activity is not in Redis. A fenced activity grants nothing, is never reopened by
-- configure and is never closed or refunded from its counters, until accept lifts
-- the fence.
local m = redis.call('HMGET', KEYS[1], 'state', 'fenced')
if not m[1] then
  return 'missing'
end
if m[2] then
  return m[2]
end
-- A fenced activity is never plainly open: no grab takes the gate's fast path
-- (see grab.lua).
redis.call('HSET', KEYS[1], 'fenced', ARGV[1], 'gate', '-')
return ARGV[1]
