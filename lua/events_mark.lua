-- events_mark: record in a packet's ledger account that one of its events was
-- delivered to the budget's events webhook (or dead-lettered), so that it is never
-- sent again and none of its successors is sent before it.
-- KEYS[1] the packet's ledger account (rpl:{<uid>}:p:<packetId>)
-- ARGV[1] the letters to add to the account's "ev" field (each one event)
-- The account is never created here: one the ledger forgot stays forgotten, and the
-- field adds no key without a TTL. Returns the field as it is afterwards, or false
-- when there is no account.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
local ev = redis.call('HGET', KEYS[1], 'ev') or ''
if #ev > 16 then
  return redis.error_reply('ERR the events field of ' .. KEYS[1] .. ' is longer than any events worker writes')
end
for i = 1, #ARGV[1] do
  local c = string.sub(ARGV[1], i, i)
  if not string.find(ev, c, 1, true) then
    ev = ev .. c
  end
end
redis.call('HSET', KEYS[1], 'ev', ev)
return ev
