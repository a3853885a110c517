-- packet_create: create one runtime packet of a budget, drawing its money from the
-- budget shard it hashes to, in one atomic step.
-- KEYS[1] the shard's meta, KEYS[2] the packet's hash, KEYS[3] the shard's due index,
-- KEYS[4] the shard's settlement stream, and with the sender's quotas KEYS[5]
-- (below)
-- ARGV[1] packet id, ARGV[2] body fingerprint, ARGV[3] sender, ARGV[4] total,
-- ARGV[5] count, ARGV[6] distribution, ARGV[7] time to live in ms (0: the budget's
-- default), ARGV[8..7+count] the shares in grab order (lua/split's, computed by the
-- caller; they are checked here, not trusted)
-- Returns a list: {'created', createdMs, expiresMs}, {'existing'} (the same id with
-- the same fingerprint: the packet as it is), or one of {'conflict'} (the same id
-- with another body), {'closed'}, {'limit_exceeded', why}, {'invalid_request', why},
-- {'quota_exceeded', rule, limit}, {'budget_exhausted'}, {'fenced', reason}; every
-- answer but created writes nothing.
-- A shard that was never configured is an error.
--
-- The fence comes before everything: a shard whose meta holds "fenced" (the operator
-- wrote it when the budget's Redis lost its data or came back older than the marks
-- the budget's status recorded, store.Budget.Fence) answers {'fenced', reason} to
-- every creation, a retried one included, since what it holds is not what was
-- acknowledged.
--
-- Order of the other checks: the id first (an existing packet answers as it is, even once
-- the budget closed, so a retried creation is idempotent), then the closed flag, the
-- body, the limits written by budget_configure, and the money: available must cover
-- the total. Then the total moves from available to live, the packet hash is written
-- with its shares (s0..s<count-1>), the packet enters the due index, and its creation
-- record goes to the settlement stream:
--   create = "<id>:<total>:<expires ms>:<s0>,<s1>,...:<sender>" (the sender last, as it
--   may hold ':'), whose entry id is the creation's time.
-- Settlement books that record first, in the operator's ledger (a per-packet account:
-- ledger_packets_credit.lua), and every later grant and the refund of the packet are
-- held to it; nothing is delivered for it. At most 1000 shares of at most 15 digits,
-- so a record is at most about 17 KB; a 5-share packet's is under 100 bytes.
--
-- The packet hash: fp fingerprint, snd sender, tot total, cnt count, dst
-- distribution, ct created and ex expires (unix ms), g shares granted, r remaining
-- money, s<i> share i's amount; packet_grab adds u:<user> per grant, packet_expire
-- sets x when it expired the packet. The names are short so that a 5-share packet
-- stays a small listpack.
--
-- Numbers: every amount is a decimal string of at most 15 digits, below 2^53, so
-- tonumber reads it exactly; the shares are summed in a Lua number only while the
-- running sum stays at most the total. Money in meta moves by HINCRBY, which is exact
-- int64 arithmetic in Redis, and available is compared with the total as text.
--
-- Bounded work: whoever calls it (a tenant may FCALL it with anything), the id is at
-- most 64 chars of [A-Za-z0-9._-], the sender at most 1024 bytes, the fingerprint at
-- most 64, and the shares are read only once their count is known to be at most the
-- shard's max_count (itself at most 1000). What it reads of the shard's keys (the
-- budget's Redis user may write them with anything) is checked before the first
-- write: a fingerprint of more than 64 bytes or a meta field longer than the numbers
-- and lists budget_configure writes is an error, and nothing is written.
local id, fp, sender, total, count, dist, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
if not ttl then
  return redis.error_reply('ERR packet_create takes at least 7 arguments')
end
if #id > 64 or not string.find(id, '^[A-Za-z0-9][A-Za-z0-9%._%-]*$') then
  return redis.error_reply('ERR packet id must be 1 to 64 of [A-Za-z0-9._-], the first alphanumeric')
end
local prefix = string.sub(KEYS[1], 1, -5)
if string.sub(KEYS[1], -4) ~= 'meta' or KEYS[2] ~= prefix .. 'p:' .. id or KEYS[3] ~= prefix .. 'due'
    or KEYS[4] ~= prefix .. 'stream' then
  return redis.error_reply('ERR keys are not one budget shard\'s meta, packet ' .. id .. ', due index and stream')
end
if #fp < 1 or #fp > 64 then
  return redis.error_reply('ERR fingerprint must be 1 to 64 bytes')
end
-- The meta is read once, first: the fence, then what the checks below need.
local m = redis.call('HMGET', KEYS[1], 'state', 'available', 'max_total', 'max_count', 'min_share', 'dists',
  'default_ttl_ms', 'max_ttl_ms', 'fenced')
if m[9] then
  return {'fenced', string.sub(m[9], 1, 64)}
end

local known = redis.call('HGET', KEYS[2], 'fp')
if known and #known > 64 then
  return redis.error_reply('ERR fingerprint of ' .. #known .. ' bytes in ' .. KEYS[2] .. ', at most 64')
end
if known then
  if known == fp then
    return {'existing'}
  end
  return {'conflict'}
end

if not m[1] then
  return redis.error_reply('ERR budget shard ' .. KEYS[1] .. ' is not configured')
end
for i = 1, 8 do
  if m[i] and #m[i] > (i == 6 and 256 or 32) then
    return redis.error_reply('ERR meta field of ' .. #m[i] .. ' bytes in ' .. KEYS[1] .. ', longer than configured')
  end
end
if m[1] == 'closed' then
  return {'closed'}
end

local function amount(s)
  return #s <= 15 and string.find(s, '^[1-9]%d*$') ~= nil
end
if #sender < 1 or #sender > 1024 then
  return {'invalid_request', 'sender must be 1 to 1024 bytes'}
end
if not amount(total) then
  return {'invalid_request', 'total must be a positive integer of at most 15 digits'}
end
if #count > 4 or not string.find(count, '^[1-9]%d*$') then
  return {'invalid_request', 'count must be a positive integer'}
end
if #ttl > 15 or not string.find(ttl, '^%d+$') then
  return {'invalid_request', 'ttl must be a non-negative integer of milliseconds'}
end
local n, t = tonumber(count), tonumber(total)
if n > tonumber(m[4]) then
  return {'limit_exceeded', 'count ' .. count .. ' is above the budget\'s maximum of ' .. m[4]}
end
if t > tonumber(m[3]) then
  return {'limit_exceeded', 'total ' .. total .. ' is above the budget\'s maximum of ' .. m[3]}
end
if #dist > 32 or not string.find(m[6], ',' .. dist .. ',', 1, true) then
  return {'limit_exceeded', 'distribution is not one the budget allows'}
end
local ttlMs = tonumber(ttl)
if ttlMs == 0 then
  ttlMs = tonumber(m[7])
end
if ttlMs > tonumber(m[8]) then
  return {'limit_exceeded', 'ttl ' .. ttlMs .. ' ms is above the budget\'s maximum of ' .. m[8]}
end
-- With the sender's quotas, 5 arguments follow the shares (below).
local quota = KEYS[5] ~= nil
if #ARGV ~= 7 + n + (quota and 5 or 0) then
  return {'invalid_request', (#ARGV - 7) .. ' shares for a count of ' .. count}
end
local minShare, sum = tonumber(m[5]), 0
local shares = {}
local fields = {'fp', fp, 'snd', sender, 'tot', total, 'cnt', count, 'dst', dist, 'ct', 0, 'ex', 0, 'g', 0, 'r', total}
for i = 1, n do
  local a = ARGV[7 + i]
  if not amount(a) then
    return {'invalid_request', 'share ' .. (i - 1) .. ' is not a positive integer of at most 15 digits'}
  end
  local v = tonumber(a)
  if v < minShare then
    return {'limit_exceeded', 'share ' .. (i - 1) .. ' is below the minimum share of ' .. m[5]}
  end
  sum = sum + v
  if sum > t then
    return {'invalid_request', 'the shares sum to more than the total'}
  end
  fields[#fields + 1] = 's' .. (i - 1)
  fields[#fields + 1] = a
  shares[i] = a
end
if sum ~= t then
  return {'invalid_request', 'the shares sum to less than the total'}
end

-- The sender's quotas, when this shard is the sender's home shard or every shard is
-- on one server (else the caller took them first with packet_quota, which says how
-- they count, and passes none here): KEYS[5] the day's hash of the home shard
-- (qd:<yyyymmdd>); ARGV[8+count..12+count]
-- packets per minute, packets per day, money per day (0: no limit), when the day's
-- hash may go (unix ms), the unix minute. They are counted after every other check
-- but the money, and a refusal, {'quota_exceeded', rule, limit}, writes nothing.
local qv, qf
if quota then
  local q = {}
  for i = 1, 5 do
    local v = ARGV[7 + n + i]
    if #v > 16 or not string.find(v, '^%d+$') then
      return redis.error_reply('ERR quota argument ' .. i .. ' is not a non-negative integer of at most 16 digits')
    end
    q[i] = tonumber(v)
  end
  -- Any shard's of this budget (rpb:{<uid>.<j>}:qd:<yyyymmdd>): on one server the
  -- caller passes the sender's home shard's even when it is not this one.
  local budget = string.match(prefix, '^(rpb:{.*%.)%d+}:$')
  local rest = budget and #KEYS == 5 and string.sub(KEYS[5], 1, #budget) == budget and string.sub(KEYS[5], #budget + 1)
  if not rest or #rest > 24 or not string.find(rest, '^%d+}:qd:%d%d%d%d%d%d%d%d$') then
    return redis.error_reply('ERR the quota key is not a shard\'s qd:<yyyymmdd> of this budget')
  end
  qv = redis.call('HGET', KEYS[5], sender)
  local qn, qa, qc = 0, 0, 0
  if qv then
    local sn, sa, sm, sc
    if #qv <= 60 then
      sn, sa, sm, sc = string.match(qv, '^(%d+):(%d+):(%d+):(%d+)$')
    end
    if not sn then
      return redis.error_reply('ERR quota counter ' .. KEYS[5] .. ' is not what packet_quota writes')
    end
    qn, qa = tonumber(sn), tonumber(sa)
    if tonumber(sm) == q[5] then
      qc = tonumber(sc)
    end
  end
  if q[1] > 0 and qc + 1 > q[1] then
    return {'quota_exceeded', 'packetsPerMinute', ARGV[8 + n]}
  end
  if q[2] > 0 and qn + 1 > q[2] then
    return {'quota_exceeded', 'packetsPerDay', ARGV[9 + n]}
  end
  if q[3] > 0 and qa > q[3] - t then
    return {'quota_exceeded', 'amountPerDay', ARGV[10 + n]}
  end
  qf = {string.format('%d:%d:%d:%d', qn + 1, math.min(qa + t, 1e16), q[5], qc + 1), q[4]}
end

local avail = m[2] or '0'
if #avail < #total or (#avail == #total and avail < total) or string.byte(avail) == 45 then -- '-'
  return {'budget_exhausted'}
end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local created, expires = string.format('%d', now), string.format('%d', now + ttlMs)
fields[12], fields[14] = created, expires
redis.call('HINCRBY', KEYS[1], 'available', '-' .. total)
redis.call('HINCRBY', KEYS[1], 'live', total)
redis.call('HINCRBY', KEYS[1], 'created', 1)
redis.call('HSET', KEYS[2], unpack(fields))
if qf then
  redis.call('HSET', KEYS[5], sender, qf[1])
  if not qv then
    redis.call('PEXPIREAT', KEYS[5], qf[2])
  end
end
redis.call('ZADD', KEYS[3], expires, id)
redis.call('XADD', KEYS[4], '*', 'create', id .. ':' .. total .. ':' .. expires .. ':' .. table.concat(shares, ',') .. ':' .. sender)
return {'created', created, expires}
