-- budget_lend: a budget shard lends part of its available money to a sibling shard
-- that ran dry, as the first of the three steps of a move (budget_lend,
-- budget_borrow on the borrower, budget_lend_done back here).
-- KEYS[1] the lending shard's meta
-- ARGV[1] the borrowing shard's index, ARGV[2] the money the borrower needs (the
-- creation it could not pay)
-- Returns {'lent', seq, amount}, {'busy', record} (a move of this shard is still
-- under way, record "<seq>:<to>:<amount>": the caller completes it, then asks again),
-- {'dry', available} (nothing to lend) or {'closed'}; only 'lent' writes.
--
-- A lend moves min(available, max(need, floor(available / 2))) from available to
-- lent, takes the next sequence number (lend_seq) and records the move under way in
-- the field lend. A shard has at most one move under way, so the record is one field
-- and whoever finds it can finish it: budget_borrow applies a sequence number once,
-- and budget_lend_done clears the record. Half of what the lender holds, and at least
-- the need: one move usually pays for many creations of the borrower, and the lender
-- keeps half, so two dry shards do not take turns emptying each other.
--
-- Money: every shard keeps allotted + borrowed - lent = available + live + claimed +
-- refunded at every instant, each script changing one shard atomically; so the budget
-- keeps sum(allotted) = sum(available + live + claimed + refunded) + in transit,
-- in transit being sum(lent) - sum(borrowed) (store.Budget.Snapshot counts it as
-- available). Amounts are decimal strings of at most 18 digits moved by HINCRBY.
--
-- Bounded work: the arguments are checked, and each meta field read is at most 40
-- bytes, before the first write.
local to, need = ARGV[1], ARGV[2]
if not need or #to > 4 or not string.find(to, '^%d+$') or #need > 15 or not string.find(need, '^[1-9]%d*$') then
  return redis.error_reply('ERR budget_lend takes a shard index and a positive amount of at most 15 digits')
end
if string.sub(KEYS[1], -4) ~= 'meta' then
  return redis.error_reply('ERR key is not a budget shard\'s meta')
end
local m = redis.call('HMGET', KEYS[1], 'state', 'available', 'lend', 'lend_seq')
for i = 1, 4 do
  if m[i] and #m[i] > 40 then
    return redis.error_reply('ERR meta field of ' .. #m[i] .. ' bytes in ' .. KEYS[1])
  end
end
if m[1] ~= 'open' then
  return {'closed'}
end
if m[3] then
  return {'busy', m[3]}
end
local avail = tonumber(m[2] or '0') or 0
if avail < 1 then
  return {'dry', string.format('%d', avail)}
end
local amount = math.min(avail, math.max(tonumber(need), math.floor(avail / 2)))
local a = string.format('%d', amount)
local seq = redis.call('HINCRBY', KEYS[1], 'lend_seq', 1)
redis.call('HINCRBY', KEYS[1], 'available', '-' .. a)
redis.call('HINCRBY', KEYS[1], 'lent', a)
redis.call('HSET', KEYS[1], 'lend', seq .. ':' .. to .. ':' .. a)
return {'lent', tostring(seq), a}
