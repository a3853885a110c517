-- packet_grab: decide one user's grab of a runtime packet, once per user per packet.
-- KEYS[1] the shard's meta, KEYS[2] the packet's hash, KEYS[3] the shard's
-- settlement stream
-- ARGV[1] packet id, ARGV[2] user id; with the recipient's quota, when this shard is
-- the user's home shard or every shard is on one server (else the caller took it
-- first with packet_quota, which says how it counts, and passes none here), KEYS[4]
-- the day's hash of recipients of the home shard (qr:<yyyymmdd>), ARGV[3] shares per day, ARGV[4] when the day's hash
-- may go (unix ms). It is counted after every other check, so a repeat still
-- answers already_claimed, and {'quota_exceeded', 'sharesPerDay', limit} writes
-- nothing.
-- Returns a list: {'granted', share, amount}, {'already_claimed', claim} with the
-- user's claim as stored, "<share>:<amount>:<entryId>", or {outcome} for sold_out
-- (every share was granted), expired (its time is up by the Redis clock, or
-- packet_expire refunded it) and missing (no such packet: never created, or its hash
-- was forgotten after its refund settled), or {'fenced', reason} when the shard's
-- meta holds "fenced" (store.Budget.Fence: its Redis lost or rolled back its data),
-- before anything else is read, since what the shard holds is not what was
-- acknowledged; a fenced grab writes nothing.
--
-- A grant hands out the next share in order: share g (the packet's g field, the
-- count of grants so far) with the amount fixed at creation (s<g>), so a packet never
-- hands out more than its count and its shares sum to its total. In the same step the
-- amount moves from the packet's remaining money (r) and the shard's live money to
-- its claimed money, the user's claim u:<user> is recorded, and the grant goes to the
-- settlement stream in the activities' packed format,
-- grant = "<id>/<share>:<amount>:0:<currency>:<user>" (epoch 0; the user id last, as
-- it may hold ':'), whose entry id is the grant's time. The claim names that entry,
-- so settlement can tell the one entry this grant wrote from any copy.
--
-- Numbers: amounts travel as the decimal strings they were created as and move by
-- HINCRBY; the only numbers read are the count, the grants so far and the clock.
--
-- Bounded work: a user id of at most 1024 bytes and a packet id of at most 64 chars
-- of [A-Za-z0-9._-] (anything else is refused before a key is read); a grant is at
-- most ten commands. What it reads of the shard's keys (the budget's Redis user may
-- write them with anything) is checked before the first write, and the call refused
-- otherwise: a claim of at most 256 bytes, packet numbers of at most 20 digits, a
-- share of a positive amount of at most 15 digits and a currency of at most 32 bytes.
local id, user = ARGV[1], ARGV[2]
if not user or #user < 1 or #user > 1024 then
  return redis.error_reply('ERR user id must be 1 to 1024 bytes')
end
if #id > 64 or not string.find(id, '^[A-Za-z0-9][A-Za-z0-9%._%-]*$') then
  return redis.error_reply('ERR packet id must be 1 to 64 of [A-Za-z0-9._-], the first alphanumeric')
end
local prefix = string.sub(KEYS[1], 1, -5)
if string.sub(KEYS[1], -4) ~= 'meta' or KEYS[2] ~= prefix .. 'p:' .. id or KEYS[3] ~= prefix .. 'stream' then
  return redis.error_reply('ERR keys are not one budget shard\'s meta, packet ' .. id .. ' and stream')
end
-- The meta is read once, first: the fence and the currency of the grant.
local mf = redis.call('HMGET', KEYS[1], 'fenced', 'currency')
if mf[1] then
  return {'fenced', string.sub(mf[1], 1, 64)}
end

local prev = redis.call('HGET', KEYS[2], 'u:' .. user)
if prev and #prev > 256 then
  return redis.error_reply('ERR claim of ' .. #prev .. ' bytes in ' .. KEYS[2] .. ', at most 256')
end
if prev then
  return {'already_claimed', prev}
end
local p = redis.call('HMGET', KEYS[2], 'cnt', 'g', 'ex', 'x')
if not p[1] then
  return {'missing'}
end
for i = 1, 4 do
  if p[i] and #p[i] > 20 then
    return redis.error_reply('ERR packet field of ' .. #p[i] .. ' bytes in ' .. KEYS[2] .. ', at most 20')
  end
end
local g = tonumber(p[2])
if g >= tonumber(p[1]) then
  return {'sold_out'}
end
if p[4] then
  return {'expired'}
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
if now >= tonumber(p[3]) then
  return {'expired'}
end

local qv, qn
if KEYS[4] then
  local limit, expires = ARGV[3] or '', ARGV[4] or ''
  if #limit > 16 or not string.find(limit, '^%d+$') or #expires > 16 or not string.find(expires, '^%d+$')
      or not string.match(prefix, '^(rpb:{.*%.)%d+}:$') then
    return redis.error_reply('ERR the recipient quota takes a shard\'s qr:<yyyymmdd>, a limit and an expiry')
  end
  -- Any shard's of this budget: on one server the caller passes the user's home
  -- shard's even when it is not this one.
  local budget = string.match(prefix, '^(rpb:{.*%.)%d+}:$')
  local rest = string.sub(KEYS[4], 1, #budget) == budget and string.sub(KEYS[4], #budget + 1)
  if not rest or #rest > 24 or not string.find(rest, '^%d+}:qr:%d%d%d%d%d%d%d%d$') then
    return redis.error_reply('ERR the recipient quota takes a shard\'s qr:<yyyymmdd> of this budget')
  end
  qv = redis.call('HGET', KEYS[4], user)
  if qv and (#qv > 20 or not string.find(qv, '^%d+$')) then
    return redis.error_reply('ERR quota counter ' .. KEYS[4] .. ' is not what packet_quota writes')
  end
  qn = (tonumber(qv or '0')) + 1
  if tonumber(limit) > 0 and qn > tonumber(limit) then
    return {'quota_exceeded', 'sharesPerDay', limit}
  end
end

local share = string.format('%d', g)
local amount = redis.call('HGET', KEYS[2], 's' .. share)
local currency = mf[2] or ''
if not amount or #amount > 15 or not string.find(amount, '^[1-9]%d*$') or #currency > 32 then
  return redis.error_reply('ERR share ' .. share .. ' of ' .. KEYS[2] .. ' or the currency is not what packet_create wrote')
end
local entry = redis.call('XADD', KEYS[3], '*', 'grant', id .. '/' .. share .. ':' .. amount .. ':0:' .. currency .. ':' .. user)
redis.call('HSET', KEYS[2], 'g', g + 1, 'u:' .. user, share .. ':' .. amount .. ':' .. entry)
redis.call('HINCRBY', KEYS[2], 'r', '-' .. amount)
redis.call('HINCRBY', KEYS[1], 'live', '-' .. amount)
redis.call('HINCRBY', KEYS[1], 'claimed', amount)
redis.call('HINCRBY', KEYS[1], 'grabbed', 1)
if qn then
  redis.call('HSET', KEYS[4], user, string.format('%d', qn))
  if not qv then
    redis.call('PEXPIREAT', KEYS[4], ARGV[4])
  end
end
return {'granted', share, amount}
