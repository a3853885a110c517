-- transfer_in: the second half of a move between shards, on the destination.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] applied transfers of the destination shard
-- ARGV[1] transfer id, ARGV[2] count, ARGV[3] amount, ARGV[4..] "<id>:<amount>"
-- Returns applied (now or before: a transfer is applied at most once, whoever
-- retries it), or missing / fenced / closed, when nothing was written. A closed
-- destination takes nothing: its refund is fixed, and the activity's refund counts
-- every packet that is neither claimed nor in an open list.
-- Bounded work: at most 1000 packets per call (transfer_out.lua journals no more); a
-- call with more is refused before anything is written.
if #ARGV - 3 > 1000 then
  return redis.error_reply('ERR transfer of ' .. (#ARGV - 3) .. ' packets, at most 1000')
end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return 'applied'
end
local m = redis.call('HMGET', KEYS[1], 'state', 'fenced', 'count', 'total')
if not m[1] then
  return 'missing'
end
if m[2] then
  return 'fenced'
end
if m[1] == 'closed' then
  return 'closed'
end
-- Each packet is appended numbered on from the shard's count and total,
-- "<id>:<amount>@<countBefore>:<amountBefore>": the list ends where count and total
-- say (count = claimed + listed, and so the total), so its head still says what was
-- claimed (grab.lua, snapshot.lua).
local count, before = tonumber(m[3]) or 0, tonumber(m[4]) or 0
local batch, chunk = 1000, {}
for i = 4, #ARGV do
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
redis.call('HINCRBY', KEYS[1], 'transfer_seq', 1)
redis.call('HSET', KEYS[3], ARGV[1], '1')
return 'applied'
