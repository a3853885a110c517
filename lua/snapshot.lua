-- snapshot: read every counter of an activity at one instant.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] staging
-- Returns a flat list of field names and values: every field of the meta hash that
-- is set, then remaining_count (LLEN packets) and staged_count (LLEN staging). The
-- activity is not in Redis when "state" is absent.
local out = redis.call('HGETALL', KEYS[1])
out[#out + 1] = 'remaining_count'
out[#out + 1] = tostring(redis.call('LLEN', KEYS[2]))
out[#out + 1] = 'staged_count'
out[#out + 1] = tostring(redis.call('LLEN', KEYS[3]))
return out
