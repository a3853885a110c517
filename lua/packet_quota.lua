-- packet_quota: take or give back one use of a sender's or a recipient's quotas on
-- their home budget shard, in one atomic step. It is the first half of a creation
-- or a grab whose packet lives on another shard (store.QuotaShardOf: with
-- spec.budgetShards > 1 a sender's packets land on every shard, so the counters
-- cannot live with each packet); when the packet's shard is the home shard,
-- packet_create and packet_grab count the same counters themselves, in the same
-- step as the creation or the grant.
-- KEYS[1] the home shard's meta, KEYS[2] the day's hash (rpb:T:qd:<yyyymmdd> for a
-- sender, rpb:T:qr:<yyyymmdd> for a recipient), KEYS[3] the minute's hash
-- (rpb:T:qm:<unix minute>, a sender's only, absent when there is no per-minute rate)
-- ARGV[1] take or give, ARGV[2] send or recv, ARGV[3] the sender or the recipient,
-- ARGV[4] the packet's total (send; 0 for recv), ARGV[5] packets per minute,
-- ARGV[6] packets (send) or shares (recv) per day, ARGV[7] money per day (send),
-- each 0 for no limit, ARGV[8] when the day's hash may go (unix ms: the end of the
-- day in the budget's time zone, plus an hour), ARGV[9] when the minute's may go.
-- Returns {'ok'}, {'quota_exceeded', rule, limit} (take: nothing written), or
-- {'fenced', reason} when the home shard is fenced (nothing written).
--
-- The counters: a field per sender in the day's hash, "<packets>:<money>", and in
-- the minute's hash, "<packets>"; a field per recipient in the day's hash of
-- recipients, "<shares>". A hash gets its expiry (PEXPIREAT) when a field is added
-- to it, so every quota key goes away on its own after its day or minute, and the
-- memory held is one field per active sender or recipient per day and per minute.
-- The day and the minute are the caller's (the grab service's clock, the day in the
-- budget's time zone), never Redis's: the key names carry them. The money counted
-- stops at 10^16, above any limit (at most 10^15), so the sum stays exact.
--
-- A take adds one (and the money) when every limit allows it, else refuses naming
-- the first rule it breaks, in the order packetsPerMinute, packetsPerDay,
-- amountPerDay (sharesPerDay for a recipient). A give takes one back, never below
-- zero, and deletes a field that reaches zero: the caller gives back what a take
-- counted when the creation or grant it was for did not happen.
--
-- Bounded work: at most six commands; a who of at most 1024 bytes; every number is
-- checked, and every counter read (the budget's Redis user may write them) must be
-- what this script writes, else the call is refused before anything is written.
local op, kind, who, amount = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if #ARGV ~= 9 or (op ~= 'take' and op ~= 'give') or (kind ~= 'send' and kind ~= 'recv') then
  return redis.error_reply('ERR packet_quota takes take|give, send|recv and 7 more arguments')
end
if #who < 1 or #who > 1024 then
  return redis.error_reply('ERR the sender or recipient must be 1 to 1024 bytes')
end
local q = {}
for i = 4, 9 do
  if #ARGV[i] > 16 or not string.find(ARGV[i], '^%d+$') then
    return redis.error_reply('ERR quota argument ' .. i .. ' is not a non-negative integer of at most 16 digits')
  end
  q[i] = tonumber(ARGV[i])
end
local prefix = string.sub(KEYS[1], 1, -5)
local dayKind = kind == 'send' and 'qd:' or 'qr:'
if string.sub(KEYS[1], -4) ~= 'meta' or string.sub(KEYS[2], 1, #prefix + 3) ~= prefix .. dayKind
    or not string.find(string.sub(KEYS[2], #prefix + 4), '^%d%d%d%d%d%d%d%d$')
    or (KEYS[3] and (kind ~= 'send' or string.sub(KEYS[3], 1, #prefix + 3) ~= prefix .. 'qm:'
      or not string.find(string.sub(KEYS[3], #prefix + 4), '^%d+$') or #KEYS[3] > #prefix + 15)) then
  return redis.error_reply('ERR keys are not one budget shard\'s meta, ' .. dayKind .. '<yyyymmdd> and qm:<minute>')
end
local fenced = redis.call('HGET', KEYS[1], 'fenced')
if fenced then
  return {'fenced', string.sub(fenced, 1, 64)}
end

-- What is counted so far.
local dv = redis.call('HGET', KEYS[2], who)
local mv = KEYS[3] and redis.call('HGET', KEYS[3], who) or nil
local dn, da, mn = 0, 0, 0
if dv then
  local n, a
  if #dv <= 40 and kind == 'send' then
    n, a = string.match(dv, '^(%d+):(%d+)$')
  elseif #dv <= 20 then
    n, a = string.match(dv, '^(%d+)$'), '0'
  end
  if not n then
    return redis.error_reply('ERR quota counter ' .. KEYS[2] .. ' is not what packet_quota writes')
  end
  dn, da = tonumber(n), tonumber(a)
end
if mv then
  if #mv > 20 or not string.find(mv, '^%d+$') then
    return redis.error_reply('ERR quota counter ' .. KEYS[3] .. ' is not what packet_quota writes')
  end
  mn = tonumber(mv)
end

local function put(key, value, was, expires)
  if value == nil then
    redis.call('HDEL', key, who)
    return
  end
  redis.call('HSET', key, who, value)
  if not was then
    redis.call('PEXPIREAT', key, expires)
  end
end
local function day(n, a)
  if n <= 0 then
    return nil
  end
  if kind == 'recv' then
    return string.format('%d', n)
  end
  return string.format('%d:%d', n, math.max(0, math.min(a, 1e16)))
end

if op == 'give' then
  if dv then
    put(KEYS[2], day(dn - 1, da - q[4]), dv, q[8])
  end
  if mv then
    put(KEYS[3], mn > 1 and string.format('%d', mn - 1) or nil, mv, q[9])
  end
  return {'ok'}
end

if KEYS[3] and q[5] > 0 and mn + 1 > q[5] then
  return {'quota_exceeded', 'packetsPerMinute', ARGV[5]}
end
if q[6] > 0 and dn + 1 > q[6] then
  return {'quota_exceeded', kind == 'send' and 'packetsPerDay' or 'sharesPerDay', ARGV[6]}
end
if kind == 'send' and q[7] > 0 and da > q[7] - q[4] then
  return {'quota_exceeded', 'amountPerDay', ARGV[7]}
end
if q[6] > 0 or q[7] > 0 then
  put(KEYS[2], day(dn + 1, da + q[4]), dv, q[8])
end
if KEYS[3] and q[5] > 0 then
  put(KEYS[3], string.format('%d', mn + 1), mv, q[9])
end
return {'ok'}
