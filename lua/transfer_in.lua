-- transfer_in: the second half of a move between shards, on the destination.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] applied transfers of the destination shard
-- ARGV[1] transfer id, ARGV[2] count, ARGV[3] amount
-- ARGV[4] the caller's transfer mark of this shard (the highest transfer_seq it has
--         seen it reach, 0 = none), ARGV[5] the epoch it was seen in (transfer_out.lua)
-- ARGV[6..] "<id>:<amount>"
-- Returns {result, transfer_seq, epoch}: result is applied (now or before: a
-- transfer is applied at most once, whoever retries it), or missing / fenced /
-- closed, when nothing was written; transfer_seq and epoch are the shard's after the
-- call. A closed destination takes nothing: its refund is fixed, and the activity's
-- refund counts every packet that is neither claimed nor in an open list. A
-- destination below the caller's mark came back from before a transfer it took
-- (its packets are then in no list, and what it applies is not what the caller saw):
-- it is fenced and takes nothing.
-- Bounded work: at most 1000 packets per call (transfer_out.lua journals no more),
-- each "<id>:<amount>" of at most 128 bytes (what a listed packet carries, with or
-- without its "@<n>:<amount>"), an id of at most 128 bytes and numbers of at most 20
-- digits; a call with anything else is refused before anything is read. Meta fields
-- longer than 32 bytes (only the tenant's own writes make one) refuse it before
-- anything is written.
if #ARGV - 5 > 1000 then
  return redis.error_reply('ERR transfer of ' .. (#ARGV - 5) .. ' packets, at most 1000')
end
if #ARGV < 5 or #ARGV[1] > 128 then
  return redis.error_reply('ERR transfer_in takes an id of at most 128 bytes, four numbers and the packets')
end
for i = 2, 5 do
  if #ARGV[i] > 20 or not string.find(ARGV[i], '^%d+$') then
    return redis.error_reply('ERR transfer_in argument ' .. i .. ' is not a number of at most 20 digits')
  end
end
for i = 6, #ARGV do
  local p = ARGV[i]
  if #p > 128 or not string.find(p, '^[^:@,|]+:%d+$') and not string.find(p, '^[^:@,|]+:%d+@%d+:%d+$') then
    return redis.error_reply('ERR packet ' .. (i - 5) .. ' of the transfer is not <id>:<amount> of at most 128 bytes')
  end
end
local m = redis.call('HMGET', KEYS[1], 'state', 'fenced', 'count', 'total', 'transfer_seq', 'epoch')
for i = 1, 6 do
  if m[i] and #m[i] > 32 then
    return redis.error_reply('ERR meta field of ' .. #m[i] .. ' bytes in ' .. KEYS[1] .. ', at most 32')
  end
end
local seq, epoch = m[5] or '0', m[6] or '0'
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
for i = 6, #ARGV do
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
return {'applied', string.format('%d', seq), epoch}
