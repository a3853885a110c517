-- seed_commit: turn a complete staging list into the activity, atomically and once.
-- KEYS[1] meta, KEYS[2] staging, KEYS[3] packets
-- ARGV[1] count, ARGV[2] total, ARGV[3] start ms, ARGV[4] end ms, ARGV[5] paused (0|1),
-- ARGV[6] sponsor, ARGV[7] currency (recorded in every settlement entry); on shard 0
-- only, ARGV[8] the activity's count, ARGV[9] its total and ARGV[10] its number of
-- shards, recorded with the shard's packets so that no committed activity lacks them
-- Returns 1 when this call committed, 0 when the activity was already committed.
-- The activity is left in state "ready": grabbing opens with the configure script.
-- The claimed count is the length of the claims hash and the claimed amount is read
-- from the head packet's numbering (snapshot.lua); claimed_amount starts at 0 for the
-- close to record over.
if redis.call('HEXISTS', KEYS[1], 'state') == 1 then
  return 0
end
local n = redis.call('LLEN', KEYS[2])
if n ~= tonumber(ARGV[1]) then
  return redis.error_reply('staging holds ' .. n .. ' packets, want ' .. ARGV[1])
end
local t = redis.call('TIME')
redis.call('RENAME', KEYS[2], KEYS[3])
-- The grab script's fields come first: a small hash is one list that HGET walks
-- from its start (see grab.lua, the gate).
redis.call('HSET', KEYS[1],
  'gate', '-', 'epoch', 0,
  'state', 'ready', 'claimed_amount', 0, 'count', ARGV[1], 'total', ARGV[2],
  'start_ms', ARGV[3], 'end_ms', ARGV[4], 'paused', ARGV[5], 'sponsor', ARGV[6], 'currency', ARGV[7] or '',
  'refunded', 0,
  'settled_count', 0, 'settled_amount', 0, 'refund_settled', 0, 'dead_count', 0,
  'seeded_ms', string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
if ARGV[8] then
  redis.call('HSET', KEYS[1], 'activity_count', ARGV[8], 'activity_total', ARGV[9], 'shards', ARGV[10])
end
return 1
