-- budget_lend_done: the last step of a move between budget shards (budget_lend.lua):
-- once the borrower applied the move, the lender clears its record of it, and may
-- lend again.
-- KEYS[1] the lending shard's meta
-- ARGV[1] the move's sequence number
-- Returns 1 when this call cleared the record, 0 when it was not this move's (done
-- before, by another caller).
--
-- Bounded work: the argument is checked, and the record read is at most 40 bytes,
-- before the only write.
local seq = ARGV[1]
if not seq or #seq > 18 or not string.find(seq, '^[1-9]%d*$') then
  return redis.error_reply('ERR budget_lend_done takes a sequence number')
end
if string.sub(KEYS[1], -4) ~= 'meta' then
  return redis.error_reply('ERR key is not a budget shard\'s meta')
end
local rec = redis.call('HGET', KEYS[1], 'lend')
if not rec or #rec > 40 or string.sub(rec, 1, #seq + 1) ~= seq .. ':' then
  return 0
end
redis.call('HDEL', KEYS[1], 'lend')
return 1
