-- packet_quota: take or give back one use of a sender's or a recipient's quotas on
-- their home budget shard, in one atomic step. It is the first half of a creation
-- or a grab whose packet lives on another shard (store.QuotaShardOf: with
-- spec.budgetShards > 1 a sender's packets land on every shard, so the counters
-- cannot live with each packet); when the packet's shard is the home shard,
-- packet_create and packet_grab count the same counters themselves, in the same
-- step as the creation or the grant.
-- KEYS[1] the home shard's meta, KEYS[2] the day's hash (rpb:T:qd:<yyyymmdd> for a
-- sender, rpb:T:qr:<yyyymmdd> for a recipient)
-- ARGV[1] take or give, ARGV[2] send or recv, ARGV[3] the sender or the recipient,
-- ARGV[4] the packet's total (send; 0 for recv), ARGV[5] packets per minute,
-- ARGV[6] packets (send) or shares (recv) per day, ARGV[7] money per day (send),
-- each 0 for no limit, ARGV[8] when the day's hash may go (unix ms: the end of the
-- day in the budget's time zone, plus an hour), ARGV[9] the unix minute.
-- Returns {'ok', now} (take: the Redis clock in unix ms when it counted), {'ok'}
-- (give), {'quota_exceeded', rule, limit} (take: nothing written), or {'fenced',
-- reason} when the home shard is fenced (nothing written).
--
-- The counters: one field per sender in the day's hash,
-- "<packets>:<money>:<minute>:<packets in that minute>" (the minute's count starts
-- again when the minute changes), and one per recipient in the day's hash of
-- recipients, "<shares>". A hash gets its expiry (PEXPIREAT) when a field is added
-- to it, so every quota key goes away on its own after its day, and the memory held
-- is one field per sender or recipient active that day. The day and the minute are
-- the caller's (the grab service's clock, the day in the budget's time zone), never
-- Redis's: the key name and the arguments carry them. The money counted stops at
-- 10^16, above any limit (at most 10^15), so the sum stays exact.
--
-- A take adds one (and the money) when every limit allows it, else refuses naming
-- the first rule it breaks, in the order packetsPerMinute, packetsPerDay,
-- amountPerDay (sharesPerDay for a recipient). A give takes one back, never below
-- zero, and deletes a field that reaches zero: the caller gives back what a take
-- counted when the creation or grant it was for did not happen. The take's time
-- tells the caller whether an answer existing (already_claimed) is of a packet
-- (share) from before the take, or one this very call made in a first run whose
-- reply was lost, which stays counted.
--
-- Bounded work: at most five commands; a who of at most 1024 bytes; every number is
-- checked, and every counter read (the budget's Redis user may write them) must be
-- what this script writes, else the call is refused before anything is written.
local op, kind, who = ARGV[1], ARGV[2], ARGV[3]
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
if #KEYS ~= 2 or string.sub(KEYS[1], -4) ~= 'meta' or string.sub(KEYS[2], 1, #prefix + 3) ~= prefix .. dayKind
    or not string.find(string.sub(KEYS[2], #prefix + 4), '^%d%d%d%d%d%d%d%d$') then
  return redis.error_reply('ERR keys are not one budget shard\'s meta and ' .. dayKind .. '<yyyymmdd>')
end
local fenced = redis.call('HGET', KEYS[1], 'fenced')
if fenced then
  return {'fenced', string.sub(fenced, 1, 64)}
end

-- What is counted so far: the day's packets (or shares) and money, and the packets
-- of the minute the field names.
local v = redis.call('HGET', KEYS[2], who)
local n, a, m, c = 0, 0, q[9], 0
if v then
  local ok
  if kind == 'send' and #v <= 60 then
    local sn, sa, sm, sc = string.match(v, '^(%d+):(%d+):(%d+):(%d+)$')
    if sn then
      ok, n, a = true, tonumber(sn), tonumber(sa)
      if tonumber(sm) == q[9] then
        c = tonumber(sc)
      end
    end
  elseif kind == 'recv' and #v <= 20 and string.find(v, '^%d+$') then
    ok, n = true, tonumber(v)
  end
  if not ok then
    return redis.error_reply('ERR quota counter ' .. KEYS[2] .. ' is not what packet_quota writes')
  end
end

local function put(pn, pa, pc)
  if pn <= 0 then
    redis.call('HDEL', KEYS[2], who)
    return
  end
  if kind == 'recv' then
    redis.call('HSET', KEYS[2], who, string.format('%d', pn))
  else
    redis.call('HSET', KEYS[2], who, string.format('%d:%d:%d:%d', pn, math.max(0, math.min(pa, 1e16)), m, math.max(0, pc)))
  end
  if not v then
    redis.call('PEXPIREAT', KEYS[2], q[8])
  end
end

if op == 'give' then
  if v then
    put(n - 1, a - q[4], c - 1)
  end
  return {'ok'}
end
if kind == 'send' and q[5] > 0 and c + 1 > q[5] then
  return {'quota_exceeded', 'packetsPerMinute', ARGV[5]}
end
if q[6] > 0 and n + 1 > q[6] then
  return {'quota_exceeded', kind == 'send' and 'packetsPerDay' or 'sharesPerDay', ARGV[6]}
end
if kind == 'send' and q[7] > 0 and a > q[7] - q[4] then
  return {'quota_exceeded', 'amountPerDay', ARGV[7]}
end
put(n + 1, a + q[4], c + 1)
local clock = redis.call('TIME')
return {'ok', string.format('%d', tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000))}
