-- ensure_group: create a consumer group on a settlement stream.
-- KEYS[1] meta, KEYS[2] stream
-- ARGV[1] consumer group
-- ARGV[2] where it starts: absent or "", at the start of the stream (settlement reads
-- every entry ever written); "end", at the stream's end when the stream exists, so
-- that a budget's events webhook set on a budget that ran before is told what happens
-- from then on, not its history, and at the start of a new stream otherwise (the
-- first packet's entries are read)
-- ARGV[3] "live" when the caller knows the activity or budget is live (a budget's
-- reconcile, which creates its events groups before its shards are configured)
-- Returns "created", "exists", or "missing" when neither the activity (budget shard)
-- nor its stream is in Redis and the caller did not say "live": a worker that runs
-- late, after the keys were purged, does not bring the stream back as a key without a
-- TTL.
local start = '0'
if redis.call('EXISTS', KEYS[2]) == 1 then
  if ARGV[2] == 'end' then
    start = '$'
  end
elseif ARGV[3] ~= 'live' and redis.call('HEXISTS', KEYS[1], 'state') == 0 then
  return 'missing'
end
local r = redis.pcall('XGROUP', 'CREATE', KEYS[2], ARGV[1], start, 'MKSTREAM')
if type(r) == 'table' and r.err then
  if string.find(r.err, 'BUSYGROUP', 1, true) then
    return 'exists'
  end
  return redis.error_reply(r.err)
end
return 'created'
