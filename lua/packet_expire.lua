-- packet_expire: expire a bounded batch of a budget shard's packets that are due.
-- KEYS[1] the shard's meta, KEYS[2] the shard's due index, KEYS[3] the shard's
-- settlement stream
-- ARGV[1] the most packets to expire, 1 to 500, ARGV[2] how long the tombstone of a
-- packet with nothing left is kept, in milliseconds (1 to 2^40)
-- Returns a flat list, two values per packet expired by this call: its id and the
-- money refunded ("0" when every share had been granted).
--
-- Due means an expiry (the due index's score, unix ms) at or before the Redis clock;
-- on a closed shard (budget_close) every packet in the index is due. For each one, in
-- one step: its remaining money moves from live to refunded, one refund entry goes
-- to the settlement stream (kind refund, packet "<id>/refund", user the sender,
-- amount, currency, at), the packet is marked expired (x, which packet_grab answers
-- expired from then on) and it leaves the due index. A packet with nothing left
-- writes no refund and its hash becomes a tombstone at once (packet_forget.lua says
-- what it keeps and why), kept ARGV[2]: no refund will settle to forget it, and its
-- id stays taken while the ledger remembers its grants' keys. A field the budget's
-- Redis user wrote longer than 1024 bytes is left out of the tombstone, not copied.
-- A second call finds it no longer due, so a refund is written
-- once: settlement delivers it with the Idempotency-Key "<budget uid>/<id>/refund".
--
-- Numbers: a remainder is at most 15 digits (packet_create.lua), so tonumber reads it
-- exactly; they are summed in Lua only up to 2^52 before the sum moves by HINCRBY, so
-- every sum is exact too.
--
-- A fenced shard (its meta holds "fenced", store.Budget.Fence: its Redis lost or
-- rolled back its data) expires nothing: a refund computed from data older than what
-- was acknowledged could pay a sender money its users were already paid.
--
-- Bounded work: at most 500 packets of the index, each a fixed handful of commands.
local limit = tonumber(ARGV[1])
if not limit or limit < 1 or limit > 500 or limit ~= math.floor(limit) then
  return redis.error_reply('ERR limit must be an integer from 1 to 500')
end
local keep = ARGV[2]
if not keep or #keep > 13 or not string.find(keep, '^[1-9]%d*$') or tonumber(keep) > 1099511627776 then
  return redis.error_reply('ERR tombstone lifetime must be 1 to 2^40 milliseconds')
end
local prefix = string.sub(KEYS[1], 1, -5)
if string.sub(KEYS[1], -4) ~= 'meta' or KEYS[2] ~= prefix .. 'due' or KEYS[3] ~= prefix .. 'stream' then
  return redis.error_reply('ERR keys are not one budget shard\'s meta, due index and stream')
end
local m = redis.call('HMGET', KEYS[1], 'state', 'currency', 'fenced')
if not m[1] or m[3] then
  return {}
end
local clock = redis.call('TIME')
local now = string.format('%d', tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000))
local upto = now
if m[1] == 'closed' then
  upto = '+inf'
end
local tombFields = {'fp', 'snd', 'tot', 'cnt', 'dst', 'ct', 'ex', 'g', 'r'}
-- tombstone replaces a packet's hash by its tombstone: the fields above, each kept
-- only when at most 1024 bytes, x and f (now).
local function tombstone(key)
  local tomb = {'x', '1', 'f', now}
  for _, name in ipairs(tombFields) do
    if redis.call('HSTRLEN', key, name) <= 1024 then
      local v = redis.call('HGET', key, name)
      if v then
        tomb[#tomb + 1] = name
        tomb[#tomb + 1] = v
      end
    end
  end
  redis.call('UNLINK', key)
  redis.call('HSET', key, unpack(tomb))
  redis.call('PEXPIRE', key, keep)
end
local out, done, moved = {}, {}, 0
-- The refunds move from live to refunded in sums of at most 2^52, each remainder
-- below 10^15, so the sum is exact as a Lua number and one HINCRBY pair moves many.
local function flush()
  if moved > 0 then
    local n = string.format('%d', moved)
    redis.call('HINCRBY', KEYS[1], 'live', '-' .. n)
    redis.call('HINCRBY', KEYS[1], 'refunded', n)
    moved = 0
  end
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', upto, 'LIMIT', 0, limit)) do
  local key = prefix .. 'p:' .. id
  local p = redis.call('HMGET', key, 'snd', 'r', 'x')
  if p[2] and not p[3] then
    local rem = p[2]
    if rem ~= '0' then
      redis.call('XADD', KEYS[3], '*', 'kind', 'refund', 'packet', id .. '/refund', 'user', p[1], 'amount', rem,
        'currency', m[2] or '', 'at', now)
      if moved > 4503599627370496 then -- 2^52
        flush()
      end
      moved = moved + tonumber(rem)
    end
    if rem == '0' then
      -- Nothing to refund, so nothing for settlement to forget later: the packet
      -- becomes its tombstone now (its grants are settled from their own entries).
      tombstone(key)
    else
      redis.call('HSET', key, 'x', '1')
    end
    out[#out + 1] = id
    out[#out + 1] = rem
  end
  done[#done + 1] = id
end
flush()
if #done > 0 then
  redis.call('ZREM', KEYS[2], unpack(done))
end
if #out > 0 then
  redis.call('HINCRBY', KEYS[1], 'expired', #out / 2)
end
return out
