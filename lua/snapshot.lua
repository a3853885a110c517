-- snapshot: read every counter of an activity at one instant.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] staging, KEYS[4] claims
-- Returns a flat list of field names and values: every field of the meta hash that
-- is set, then remaining_count (LLEN packets), staged_count (LLEN staging),
-- claimed_count (HLEN claims: the claims hash holds one field per grant and nothing
-- else) and claimed_amount. grab.lua keeps no counter of either: fields of those
-- names that the meta hash holds are left out, and claimed_amount is read as
-- claimedAmount says (see there). The activity is not in Redis when "state" is absent.
--
-- claimedAmount: the list holds the packets not yet claimed, in the order grab.lua
-- pops them, each "<packetId>:<amount>@<countBefore>:<amountBefore>" (see grab.lua),
-- so at every instant total = claimed + listed and the head's <amountBefore> is the
-- claimed amount. An empty list means all of the total was claimed (or, before the
-- commit, that nothing is there to count); a closed activity keeps the figure
-- close.lua recorded.
--
-- Bounded work: the meta hash is read whole, so a meta hash of more than 256 fields
-- or 64 KiB (an activity's has about 30 fields of short values; anything more was
-- written by someone else) is refused before it is read: its size is MEMORY USAGE's
-- exact sum over its at most 256 fields. The head of the list is read whole and
-- refused when it is not a listed packet of at most 256 bytes; the other reads are
-- O(1). Nothing is written.
local function claimedAmount(fields, head)
  if fields.state == 'closed' then
    return fields.claimed_amount or '0'
  end
  if not head then
    return fields.total or '0'
  end
  local at = string.find(head, '@', 1, true)
  return string.sub(head, string.find(head, ':', at + 1, true) + 1)
end

local metaLen = redis.call('HLEN', KEYS[1])
if metaLen > 256 then
  return redis.error_reply('ERR meta hash ' .. KEYS[1] .. ' holds ' .. metaLen .. ' fields, at most 256')
end
local metaBytes = redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', '0') or 0
if metaBytes > 65536 then
  return redis.error_reply('ERR meta hash ' .. KEYS[1] .. ' takes ' .. metaBytes .. ' bytes, at most 65536')
end
local meta = redis.call('HGETALL', KEYS[1])
local out, fields = {}, {}
for i = 1, #meta, 2 do
  local f = meta[i]
  fields[f] = meta[i + 1]
  if f ~= 'claimed_count' and f ~= 'claimed_amount' then
    out[#out + 1] = f
    out[#out + 1] = meta[i + 1]
  end
end
out[#out + 1] = 'remaining_count'
out[#out + 1] = tostring(redis.call('LLEN', KEYS[2]))
out[#out + 1] = 'staged_count'
out[#out + 1] = tostring(redis.call('LLEN', KEYS[3]))
out[#out + 1] = 'claimed_count'
out[#out + 1] = tostring(redis.call('HLEN', KEYS[4]))
out[#out + 1] = 'claimed_amount'
local head = redis.call('LINDEX', KEYS[2], 0)
if head and (#head > 256 or not string.find(head, '^[^@]+@%d+:%d+$')) then
  return redis.error_reply('ERR the head of ' .. KEYS[2] .. ' is not a listed packet (' .. #head .. ' bytes)')
end
out[#out + 1] = claimedAmount(fields, head)
return out
