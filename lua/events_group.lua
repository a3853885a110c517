-- events_group: create a budget shard's events consumer group on its settlement stream.
-- KEYS[1] the shard's meta, KEYS[2] its settlement stream
-- ARGV[1] the events consumer group, ARGV[2] "live" when the caller knows the budget
-- is live (its reconcile), "" otherwise
-- The group starts at the stream's end when the stream exists: a webhook set on a
-- budget that has run before is told what happens from then on, not its history.
-- With no stream yet it starts at the beginning of a new one (MKSTREAM), so that the
-- first packet's entries are read: the reconcile of a new budget creates it before
-- the shards are configured. Returns "created", "exists", or "missing" when neither
-- the budget shard nor its stream is in Redis and the caller did not say "live"
-- (purged): nothing is brought back as a key without a TTL.
local start = '$'
if redis.call('EXISTS', KEYS[2]) == 0 then
  if ARGV[2] ~= 'live' and redis.call('HEXISTS', KEYS[1], 'state') == 0 then
    return 'missing'
  end
  start = '0'
end
local r = redis.pcall('XGROUP', 'CREATE', KEYS[2], ARGV[1], start, 'MKSTREAM')
if type(r) == 'table' and r.err then
  if string.find(r.err, 'BUSYGROUP', 1, true) then
    return 'exists'
  end
  return redis.error_reply(r.err)
end
return 'created'
