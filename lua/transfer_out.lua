-- transfer_out: the first half of moving packets from one shard of an activity to
-- another (shards live on different Redis masters, so no one script can do both).
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] transfers (journal) of the source shard
-- ARGV[1] transfer id, ARGV[2] destination shard index, ARGV[3] most packets to take
-- ARGV[4] the caller's transfer mark of this shard: the highest transfer_seq it has
--         seen the shard reach (absent or 0 = none), ARGV[5] the epoch it was seen in
-- Returns {result, journal entry, transfer_seq, epoch}; result is moved (the entry
-- was written now), pending (this id was journalled before: the same entry again),
-- empty (no packet to give), or missing / fenced / closed / ended, when the source
-- gives nothing. transfer_seq and epoch are the shard's after the call, the caller's
-- next mark.
--
-- The packets leave the list and enter the journal in one step, and the shard's
-- count and total drop by what left, so at every instant each packet is in exactly
-- one place: a list, a claim, or a journal entry that no destination has applied.
-- The journal entry "<dest>|<count>|<amount>|<id>:<amount>,..." stays until the
-- source hears that the destination applied it (transfer_done), so a crash between
-- the halves loses nothing: whoever finds the entry finishes the move.
--
-- The transfer mark: every transfer step raises the shard's transfer_seq, and only
-- they do, so a shard whose transfer_seq is below what a caller saw it reach came
-- back from before a transfer (a failover to a lagging replica, a restored backup)
-- and may list again packets that already left it. It is fenced here, as grab.lua
-- fences it, before it gives anything.
--
-- Bounded work: at most 1000 packets leave per call, whatever ARGV[3] asks (a refill
-- asks for at most store.DefaultTransferBatch), so one call is O(1000) and its
-- journal entry is one that transfer_in.lua takes whole. The arguments are checked
-- first (an id of at most 128 bytes, numbers of at most 20 digits), and everything
-- read is checked before the first write, the whole call refused otherwise (the
-- activity's user may write these keys with anything, docs/operations.md): meta
-- fields of at most 32 bytes, a journal entry of at most 64 KiB, and each packet to
-- leave, read one at a time from the tail (LINDEX) before
-- any leaves, a listed packet "<id>:<amount>@<n>:<amount>" of at most 128 bytes. So a
-- call reads at most one value longer than these, whole, once.
if not ARGV[3] or #ARGV[1] > 128 or #ARGV[2] > 20 or #ARGV[3] > 20 or (ARGV[4] and #ARGV[4] > 20) or
    (ARGV[5] and #ARGV[5] > 20) then
  return redis.error_reply('ERR transfer_out takes an id of at most 128 bytes and numbers of at most 20 digits')
end
local m = redis.call('HMGET', KEYS[1], 'state', 'fenced', 'end_ms', 'transfer_seq', 'epoch')
for i = 1, 5 do
  if m[i] and #m[i] > 32 then
    return redis.error_reply('ERR meta field of ' .. #m[i] .. ' bytes in ' .. KEYS[1] .. ', at most 32')
  end
end
local seq, epoch = m[4] or '0', m[5] or '0'
local prev = redis.call('HGET', KEYS[3], ARGV[1])
if prev and #prev > 65536 then
  return redis.error_reply('ERR journal entry of ' .. #prev .. ' bytes in ' .. KEYS[3] .. ', at most 65536')
end
if prev then
  return {'pending', prev, seq, epoch}
end
if not m[1] then
  return {'missing', '', seq, epoch}
end
if m[2] then
  return {'fenced', '', seq, epoch}
end
if ARGV[4] and ARGV[4] ~= '0' then
  local seen, now = tonumber(ARGV[5]) or 0, tonumber(epoch)
  if seen > now or (seen == now and tonumber(seq) < tonumber(ARGV[4])) then
    redis.call('HSET', KEYS[1], 'fenced', 'rolled_back', 'gate', '-')
    return {'fenced', '', seq, epoch}
  end
end
if m[1] == 'closed' then
  return {'closed', '', seq, epoch}
end
local endMs = tonumber(m[3]) or 0
if endMs > 0 then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) >= endMs then
    return {'ended', '', seq, epoch}
  end
end
-- The packets leave from the tail, the end grab.lua does not pop: the list stays
-- numbered from its head, so its head still says the claimed amount (snapshot.lua).
-- The journal carries them as "<id>:<amount>", without their place in this list.
local want = math.min(tonumber(ARGV[3]) or 0, 1000)
if want < 1 then
  return redis.error_reply('ERR transfer of ' .. tostring(ARGV[3]) .. ' packets, want 1 to 1000')
end
-- Every packet that is to leave is read and checked before any leaves.
local ok = 0
for i = 1, want do
  local p = redis.call('LINDEX', KEYS[2], -i)
  if not p then
    break
  end
  if #p > 128 or not string.find(p, '^[^:@,|]+:%d+@%d+:%d+$') then
    return redis.error_reply('ERR entry ' .. i .. ' from the tail of ' .. KEYS[2] .. ' is not a listed packet (' ..
      #p .. ' bytes)')
  end
  ok = i
end
if ok == 0 then
  return {'empty', '', seq, epoch}
end
local taken = redis.call('RPOP', KEYS[2], ok)
local amount = 0
for i = 1, #taken do
  local p = taken[i]
  p = string.sub(p, 1, string.find(p, '@', 1, true) - 1)
  taken[i] = p
  amount = amount + tonumber(string.sub(p, string.find(p, ':', 1, true) + 1))
end
local amountStr = string.format('%d', amount)
local entry = ARGV[2] .. '|' .. #taken .. '|' .. amountStr .. '|' .. table.concat(taken, ',')
redis.call('HSET', KEYS[3], ARGV[1], entry)
redis.call('HINCRBY', KEYS[1], 'count', -#taken)
redis.call('HINCRBY', KEYS[1], 'total', '-' .. amountStr)
seq = redis.call('HINCRBY', KEYS[1], 'transfer_seq', 1)
return {'moved', entry, string.format('%d', seq), epoch}
