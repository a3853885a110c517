-- transfer_done: the source forgets a transfer the destination has applied.
-- KEYS[1] meta, KEYS[2] transfers (journal) of the source shard
-- ARGV[1] transfer id
-- ARGV[2] the caller's transfer mark of this shard (the highest transfer_seq it has
--         seen it reach, absent or 0 = none), ARGV[3] the epoch it was seen in
-- Returns {result, transfer_seq, epoch}: result is done when the entry was removed
-- now, gone when it was already gone, fenced when the shard is below the caller's
-- mark (transfer_out.lua) and was fenced now, or was fenced before; transfer_seq and
-- epoch are the shard's after the call. Call it only after transfer_in answered
-- applied: the destination's record of the id is what keeps a retried transfer_in
-- from applying the packets twice, and it is never removed while the activity lives.
-- A source below the mark lost the transfer_out this entry came from (its packets
-- may be listed here again while the destination holds them): it is fenced before it
-- can grant them.
-- Bounded work: an id of at most 128 bytes and numbers of at most 20 digits, and meta
-- fields of at most 32 bytes (only the tenant's own writes make longer ones), or the
-- call is refused before anything is written; then at most three commands.
if not ARGV[1] or #ARGV[1] > 128 or (ARGV[2] and #ARGV[2] > 20) or (ARGV[3] and #ARGV[3] > 20) then
  return redis.error_reply('ERR transfer_done takes an id of at most 128 bytes and numbers of at most 20 digits')
end
local m = redis.call('HMGET', KEYS[1], 'state', 'fenced', 'transfer_seq', 'epoch')
for i = 1, 4 do
  if m[i] and #m[i] > 32 then
    return redis.error_reply('ERR meta field of ' .. #m[i] .. ' bytes in ' .. KEYS[1] .. ', at most 32')
  end
end
local seq, epoch = m[3] or '0', m[4] or '0'
if m[1] and not m[2] and ARGV[2] and ARGV[2] ~= '0' then
  local seen, now = tonumber(ARGV[3]) or 0, tonumber(epoch)
  if seen > now or (seen == now and tonumber(seq) < tonumber(ARGV[2])) then
    redis.call('HSET', KEYS[1], 'fenced', 'rolled_back', 'gate', '-')
    m[2] = 'rolled_back'
  end
end
if redis.call('HDEL', KEYS[2], ARGV[1]) == 0 then
  if m[2] then
    return {'fenced', seq, epoch}
  end
  return {'gone', seq, epoch}
end
seq = redis.call('HINCRBY', KEYS[1], 'transfer_seq', 1)
if m[2] then
  return {'fenced', string.format('%d', seq), epoch}
end
return {'done', string.format('%d', seq), epoch}
