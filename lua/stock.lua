-- stock: what one shard holds for the others, read at one instant.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] transfers (journal)
-- Returns {transfer_seq, unclaimed packets in the list, journal entries, state, epoch}.
-- transfer_seq moves with every transfer_out, transfer_in and transfer_done on the
-- shard, and with nothing else: a reader that sees the same sequence on every shard
-- before and after reading their stocks read them with no packet moving between
-- shards, while grabs could only have lowered them. With the epoch, the sequence is
-- also a transfer mark the reader has seen the shard reach (transfer_out.lua).
-- A fenced shard's state reads "fenced": it gives and takes nothing.
-- Bounded work: four O(1) reads; meta fields of more than 32 bytes (only the
-- tenant's own writes make one) are refused, not parsed. Nothing is written.
local m = redis.call('HMGET', KEYS[1], 'transfer_seq', 'state', 'epoch', 'fenced')
for i = 1, 4 do
  if m[i] and #m[i] > 32 then
    return redis.error_reply('ERR meta field of ' .. #m[i] .. ' bytes in ' .. KEYS[1] .. ', at most 32')
  end
end
local state = m[2] or ''
if m[2] and m[4] then
  state = 'fenced'
end
return {tonumber(m[1]) or 0, redis.call('LLEN', KEYS[2]), redis.call('HLEN', KEYS[3]), state, tonumber(m[3]) or 0}
