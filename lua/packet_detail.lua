-- packet_detail: read one runtime packet as its group sees it.
-- KEYS[1] the shard's meta, KEYS[2] the packet's hash
-- ARGV[1] packet id
-- Returns {} when there is no such packet, otherwise {currency, field, value, ...}:
-- the budget's currency and every field of the packet hash (see packet_create.lua
-- and packet_grab.lua); the caller orders the claims u:<user> =
-- "<share>:<amount>:<entryId>" by share, which is the grab order.
--
-- Bounded work: a packet id of at most 64 chars of [A-Za-z0-9._-]; a hash of more
-- fields than a packet of 1000 shares holds, or of more than 4 MiB (MEMORY USAGE's
-- exact sum over those fields; a packet of 1000 shares of users of 1024 bytes takes
-- about 1.2 MiB), written by someone else, is refused before it is read. Nothing is
-- written.
local id = ARGV[1]
if not id or #id > 64 or not string.find(id, '^[A-Za-z0-9][A-Za-z0-9%._%-]*$') then
  return redis.error_reply('ERR packet id must be 1 to 64 of [A-Za-z0-9._-], the first alphanumeric')
end
local prefix = string.sub(KEYS[1], 1, -5)
if string.sub(KEYS[1], -4) ~= 'meta' or KEYS[2] ~= prefix .. 'p:' .. id then
  return redis.error_reply('ERR keys are not one budget shard\'s meta and packet ' .. id)
end
local n = redis.call('HLEN', KEYS[2])
if n == 0 then
  return {}
end
if n > 2016 then
  return redis.error_reply('ERR packet hash ' .. KEYS[2] .. ' holds ' .. n .. ' fields, at most 2016')
end
local bytes = redis.call('MEMORY', 'USAGE', KEYS[2], 'SAMPLES', '0') or 0
if bytes > 4194304 then
  return redis.error_reply('ERR packet hash ' .. KEYS[2] .. ' takes ' .. bytes .. ' bytes, at most 4194304')
end
local currency = redis.call('HGET', KEYS[1], 'currency') or ''
if #currency > 32 then
  return redis.error_reply('ERR currency of ' .. #currency .. ' bytes in ' .. KEYS[1] .. ', at most 32')
end
local out = redis.call('HGETALL', KEYS[2])
table.insert(out, 1, currency)
return out
