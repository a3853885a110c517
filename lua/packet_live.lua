-- packet_live: list a budget shard's live packets, soonest expiry first.
-- KEYS[1] the shard's meta, KEYS[2] the shard's due index
-- ARGV[1] the most packets to list, 1 to 100
-- Returns a flat list, ten values per packet: id, snd, tot, cnt, dst, ct, ex, g, r,
-- x (the packet hash's fields, see packet_create.lua; "" when absent).
--
-- Bounded work: at most 100 packets, nine HGETs each. The packets' hashes share the
-- shard's hash tag, so they are on the slot of the declared keys. The budget's Redis
-- user may write the due index and the hashes with anything, so values are read one
-- at a time and each checked before the next is read: the ids (ZRANGE i i) refused
-- beyond 64 bytes, and each of the nine fields (HGET) beyond 1024 bytes, so a call
-- reads at most one value bigger than packet_create writes. Nothing is written.
local limit = tonumber(ARGV[1])
if not limit or limit < 1 or limit > 100 or limit ~= math.floor(limit) then
  return redis.error_reply('ERR limit must be an integer from 1 to 100')
end
local prefix = string.sub(KEYS[1], 1, -5)
if string.sub(KEYS[1], -4) ~= 'meta' or KEYS[2] ~= prefix .. 'due' then
  return redis.error_reply('ERR keys are not one budget shard\'s meta and due index')
end
local names = {'snd', 'tot', 'cnt', 'dst', 'ct', 'ex', 'g', 'r', 'x'}
local out = {}
for i = 0, limit - 1 do
  local one = redis.call('ZRANGE', KEYS[2], i, i)
  local id = one[1]
  if not id then
    break
  end
  if #id > 64 then
    return redis.error_reply('ERR member ' .. i .. ' of ' .. KEYS[2] .. ' is not a packet id (' .. #id .. ' bytes)')
  end
  local key = prefix .. 'p:' .. id
  out[#out + 1] = id
  for _, f in ipairs(names) do
    local v = redis.call('HGET', key, f)
    if v and #v > 1024 then
      return redis.error_reply('ERR field ' .. f .. ' of ' .. key .. ' holds ' .. #v .. ' bytes, at most 1024')
    end
    out[#out + 1] = v or ''
  end
end
return out
