-- packet_forget: once an expired runtime packet's refund settled, shrink its hash to a
-- tombstone that keeps the packet's id taken for as long as the settlement ledger can
-- still be asked to credit one of its keys.
-- KEYS[1] the packet's hash
-- ARGV[1] how long the tombstone is kept, in milliseconds (1 to 2^40)
-- Returns 1 when this call made the tombstone, 0 when there is no such packet or it is
-- a tombstone already, and an error, changing nothing, for a packet that has not
-- expired: its money is still live, and its hash is what says so.
--
-- The tombstone keeps the fields that say which packet the id named and how it ended
-- (see packet_tombstone in packet_expire.lua, which writes the same one): fp, snd,
-- tot, cnt, dst, ct, ex, g, r, x, and f (the time it was made). It drops the shares
-- and the claims, most of a packet's memory. packet_create then answers a creation of
-- the same id existing (same fingerprint) or conflict, never created: a packet id
-- names one packet, whose Idempotency-Keys "<uid>/<id>/<share>" and "<uid>/<id>/refund"
-- the ledger remembers for its retention, so a second packet of that id would draw
-- money that settlement could never pay. packet_grab answers sold_out or expired.
--
-- Bounded work: each kept field is checked to be at most 1024 bytes (HSTRLEN) before
-- it is read; a longer one, which only the budget's Redis user can have written, is
-- left out of the tombstone, not copied, and the packet is forgotten all the same.
local keep = ARGV[1]
if not keep or #keep > 13 or not string.find(keep, '^[1-9]%d*$') or tonumber(keep) > 1099511627776 then
  return redis.error_reply('ERR tombstone lifetime must be 1 to 2^40 milliseconds')
end
local fields = {'fp', 'snd', 'tot', 'cnt', 'dst', 'ct', 'ex', 'g', 'r', 'x', 'f'}
local v = {}
for i, name in ipairs(fields) do
  if redis.call('HSTRLEN', KEYS[1], name) <= 1024 then
    v[i] = redis.call('HGET', KEYS[1], name)
  end
end
if v[11] then
  return 0
end
if not v[10] then
  if v[4] then
    return redis.error_reply('ERR packet ' .. KEYS[1] .. ' has not expired')
  end
  return 0
end
local clock = redis.call('TIME')
local tomb = {}
for i = 1, 10 do
  if v[i] then
    tomb[#tomb + 1] = fields[i]
    tomb[#tomb + 1] = v[i]
  end
end
tomb[#tomb + 1] = 'f'
tomb[#tomb + 1] = string.format('%d', tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000))
redis.call('UNLINK', KEYS[1])
redis.call('HSET', KEYS[1], unpack(tomb))
redis.call('PEXPIRE', KEYS[1], keep)
return 1
