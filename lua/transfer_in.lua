-- transfer_in: the second half of a move between shards, on the destination.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] applied transfers of the destination shard
-- ARGV[1] transfer id, ARGV[2] count, ARGV[3] amount
-- ARGV[4] the caller's transfer mark of this shard (the highest transfer_seq it has
--         seen it reach, 0 = none), ARGV[5] the epoch it was seen in (transfer_out.lua)
-- ARGV[6] the source shard's index, ARGV[7] the transfer_seq the source reached with
--         this transfer's transfer_out (or later), ARGV[8] its epoch
-- ARGV[9..] "<id>:<amount>"
-- Returns {result, transfer_seq, epoch}: result is applied (now or before: a
-- transfer is applied at most once, whoever retries it), or missing / fenced /
-- closed, when nothing was written; transfer_seq and epoch are the shard's after the
-- call. A closed destination takes nothing: its refund is fixed, and the activity's
-- refund counts every packet that is neither claimed nor in an open list. A
-- destination below the caller's mark came back from before a transfer it took
-- (its packets are then in no list, and what it applies is not what the caller saw):
-- it is fenced and takes nothing.
--
-- The source's mark, kept here: applying the packets also records, in the meta field
-- "mark.<source>" = "<epoch>:<transfer_seq>", the highest transfer mark of the source
-- that a transfer applied here carried (ARGV[6..8]; a lower one leaves it as it is).
-- The source that comes back from before its transfer_out lists again the packets
-- this shard now holds, and knows nothing of it; this record does, in the same step
-- that makes the packets grantable here, so it lasts as long as they do: whoever
-- grabs on the source or moves packets out of it reads the record of every sibling
-- first (store.Activity.RecordedMark) and sends the source the highest as its mark, and
-- a source below it is fenced before it grants (grab.lua) or gives (transfer_out.lua)
-- anything. Nothing but this script writes the field, and it only rises within an
-- epoch.
--
-- Bounded work: at most 1000 packets per call (transfer_out.lua journals no more),
-- each "<id>:<amount>" of at most 128 bytes (what a listed packet carries, with or
-- without its "@<n>:<amount>"), an id of at most 128 bytes and numbers of at most 20
-- digits; a call with anything else is refused before anything is read. Meta fields
-- longer than 32 bytes, or a source's record that is not "<epoch>:<transfer_seq>" of
-- at most 41 bytes (only the tenant's own writes make one), refuse it before anything
-- is written.
if #ARGV - 8 > 1000 then
  return redis.error_reply('ERR transfer of ' .. (#ARGV - 8) .. ' packets, at most 1000')
end
if #ARGV < 8 or #ARGV[1] > 128 then
  return redis.error_reply('ERR transfer_in takes an id of at most 128 bytes, seven numbers and the packets')
end
for i = 2, 8 do
  if #ARGV[i] > 20 or not string.find(ARGV[i], '^%d+$') then
    return redis.error_reply('ERR transfer_in argument ' .. i .. ' is not a number of at most 20 digits')
  end
end
for i = 9, #ARGV do
  local p = ARGV[i]
  if #p > 128 or not string.find(p, '^[^:@,|]+:%d+$') and not string.find(p, '^[^:@,|]+:%d+@%d+:%d+$') then
    return redis.error_reply('ERR packet ' .. (i - 8) .. ' of the transfer is not <id>:<amount> of at most 128 bytes')
  end
end
local m = redis.call('HMGET', KEYS[1], 'state', 'fenced', 'count', 'total', 'transfer_seq', 'epoch')
for i = 1, 6 do
  if m[i] and #m[i] > 32 then
    return redis.error_reply('ERR meta field of ' .. #m[i] .. ' bytes in ' .. KEYS[1] .. ', at most 32')
  end
end
local seq, epoch = m[5] or '0', m[6] or '0'
local markField = 'mark.' .. ARGV[6]
local kept = redis.call('HGET', KEYS[1], markField)
if kept and (#kept > 41 or not string.find(kept, '^%d+:%d+$')) then
  return redis.error_reply('ERR ' .. markField .. ' in ' .. KEYS[1] .. ' is not <epoch>:<transfer_seq> (' .. #kept ..
    ' bytes)')
end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return {'applied', seq, epoch}
end
if not m[1] then
  return {'missing', seq, epoch}
end
if m[2] then
  return {'fenced', seq, epoch}
end
if ARGV[4] ~= '0' then
  local seen, now = tonumber(ARGV[5]) or 0, tonumber(epoch)
  if seen > now or (seen == now and tonumber(seq) < tonumber(ARGV[4])) then
    redis.call('HSET', KEYS[1], 'fenced', 'rolled_back', 'gate', '-')
    return {'fenced', seq, epoch}
  end
end
if m[1] == 'closed' then
  return {'closed', seq, epoch}
end
-- Each packet is appended numbered on from the shard's count and total,
-- "<id>:<amount>@<countBefore>:<amountBefore>": the list ends where count and total
-- say (count = claimed + listed, and so the total), so its head still says what was
-- claimed (grab.lua, snapshot.lua).
local count, before = tonumber(m[3]) or 0, tonumber(m[4]) or 0
local batch, chunk = 1000, {}
for i = 9, #ARGV do
  local p = ARGV[i]
  local at = string.find(p, '@', 1, true)
  if at then
    p = string.sub(p, 1, at - 1)
  end
  chunk[#chunk + 1] = p .. string.format('@%d:%d', count, before)
  count = count + 1
  before = before + tonumber(string.sub(p, string.find(p, ':', 1, true) + 1))
  if #chunk == batch or i == #ARGV then
    redis.call('RPUSH', KEYS[2], unpack(chunk))
    chunk = {}
  end
end
redis.call('HINCRBY', KEYS[1], 'count', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'total', ARGV[3])
seq = redis.call('HINCRBY', KEYS[1], 'transfer_seq', 1)
redis.call('HSET', KEYS[3], ARGV[1], '1')
-- The source's mark, the higher of the two within an epoch, a later epoch's over an
-- earlier one's (store.Watermark.Raise).
local srcEpoch, srcSeq = tonumber(ARGV[8]), tonumber(ARGV[7])
local keptEpoch, keptSeq = -1, -1
if kept then
  local c = string.find(kept, ':', 1, true)
  keptEpoch, keptSeq = tonumber(string.sub(kept, 1, c - 1)), tonumber(string.sub(kept, c + 1))
end
if srcEpoch > keptEpoch or srcEpoch == keptEpoch and srcSeq > keptSeq then
  redis.call('HSET', KEYS[1], markField, ARGV[8] .. ':' .. ARGV[7])
end
return {'applied', string.format('%d', seq), epoch}
