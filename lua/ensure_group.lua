-- ensure_group: create the settlement consumer group at the start of the stream.
-- KEYS[1] meta, KEYS[2] stream
-- ARGV[1] consumer group
-- Returns "created", "exists", or "missing" when neither the activity nor its stream
-- is in Redis: a worker that runs late, after the activity's keys were purged, does
-- not bring the stream back as a key without a TTL.
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('HEXISTS', KEYS[1], 'state') == 0 then
  return 'missing'
end
local r = redis.pcall('XGROUP', 'CREATE', KEYS[2], ARGV[1], '0', 'MKSTREAM')
if type(r) == 'table' and r.err then
  if string.find(r.err, 'BUSYGROUP', 1, true) then
    return 'exists'
  end
  return redis.error_reply(r.err)
end
return 'created'
