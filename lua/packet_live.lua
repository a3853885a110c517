-- packet_live: list a budget shard's live packets, soonest expiry first.
-- KEYS[1] the shard's meta, KEYS[2] the shard's due index
-- ARGV[1] the most packets to list, 1 to 100
-- Returns a flat list, ten values per packet: id, snd, tot, cnt, dst, ct, ex, g, r,
-- x (the packet hash's fields, see packet_create.lua; "" when absent).
--
-- Bounded work: at most 100 packets, one HMGET each. The packets' hashes share the
-- shard's hash tag, so they are on the slot of the declared keys.
local limit = tonumber(ARGV[1])
if not limit or limit < 1 or limit > 100 or limit ~= math.floor(limit) then
  return redis.error_reply('ERR limit must be an integer from 1 to 100')
end
local prefix = string.sub(KEYS[1], 1, -5)
if string.sub(KEYS[1], -4) ~= 'meta' or KEYS[2] ~= prefix .. 'due' then
  return redis.error_reply('ERR keys are not one budget shard\'s meta and due index')
end
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, limit - 1)) do
  local p = redis.call('HMGET', prefix .. 'p:' .. id, 'snd', 'tot', 'cnt', 'dst', 'ct', 'ex', 'g', 'r', 'x')
  out[#out + 1] = id
  for i = 1, 9 do
    out[#out + 1] = p[i] or ''
  end
end
return out
