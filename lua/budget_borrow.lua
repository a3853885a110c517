-- budget_borrow: the second step of a move between budget shards (budget_lend.lua):
-- the borrowing shard takes the money lent to it, once.
-- KEYS[1] the borrowing shard's meta
-- ARGV[1] the lending shard's index, ARGV[2] the move's sequence number on the
-- lender, ARGV[3] the amount
-- Returns {'borrowed'} when this call added the amount, {'again'} when this move was
-- applied before (a retry, or the recovery of a move that crashed after this step);
-- only 'borrowed' writes.
--
-- The shard keeps, per lender, the highest sequence number it applied (in:<lender>).
-- A lender has one move under way at a time and numbers them in order, so a sequence
-- number at or below it was applied: the amount moves from lent to borrowed once,
-- whoever finishes the move and however often. A closed shard takes the money too:
-- it is in transit and must land somewhere; expiry and deletion account for it.
--
-- Bounded work: the arguments are checked, and the field read is at most 20 bytes,
-- before the first write.
local from, seq, amount = ARGV[1], ARGV[2], ARGV[3]
if not amount or #from > 4 or not string.find(from, '^%d+$') or #seq > 18 or not string.find(seq, '^[1-9]%d*$') or
  #amount > 15 or not string.find(amount, '^[1-9]%d*$') then
  return redis.error_reply('ERR budget_borrow takes a shard index, a sequence number and a positive amount')
end
if string.sub(KEYS[1], -4) ~= 'meta' then
  return redis.error_reply('ERR key is not a budget shard\'s meta')
end
local field = 'in:' .. from
local applied = redis.call('HGET', KEYS[1], field)
if applied and #applied > 20 then
  return redis.error_reply('ERR meta field ' .. field .. ' of ' .. #applied .. ' bytes in ' .. KEYS[1])
end
if applied and tonumber(applied) >= tonumber(seq) then
  return {'again'}
end
redis.call('HINCRBY', KEYS[1], 'available', amount)
redis.call('HINCRBY', KEYS[1], 'borrowed', amount)
redis.call('HSET', KEYS[1], field, seq)
return {'borrowed'}
