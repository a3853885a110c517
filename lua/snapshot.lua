-- snapshot: read every counter of an activity at one instant.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] staging, KEYS[4] claims
-- Returns a flat list of field names and values: every field of the meta hash that
-- is set, then remaining_count (LLEN packets), staged_count (LLEN staging) and
-- claimed_count (HLEN claims: the claims hash holds one field per grant and nothing
-- else, so grab.lua keeps no counter of its own; a claimed_count field that an
-- earlier version kept in the meta hash is left out). The activity is not in Redis
-- when "state" is absent.
local meta = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #meta, 2 do
  if meta[i] ~= 'claimed_count' then
    out[#out + 1] = meta[i]
    out[#out + 1] = meta[i + 1]
  end
end
out[#out + 1] = 'remaining_count'
out[#out + 1] = tostring(redis.call('LLEN', KEYS[2]))
out[#out + 1] = 'staged_count'
out[#out + 1] = tostring(redis.call('LLEN', KEYS[3]))
out[#out + 1] = 'claimed_count'
out[#out + 1] = tostring(redis.call('HLEN', KEYS[4]))
return out
