-- grab: decide one claim atomically.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] claims, KEYS[4] stream
-- ARGV[1] user id
-- ARGV[2] watermark: the claimed_count this Redis has already been seen to reach
--         (0 = none), ARGV[3] the epoch that watermark was seen in (0 before any
--         accepted rollback)
-- Returns {outcome, packetId, amount[, claimedCount, epoch]}; outcome is one of granted,
-- already_claimed, sold_out, not_started, ended, paused, missing, fenced. A grant also
-- returns the claimed_count it raised and the epoch, the caller's next watermark. A
-- closed activity answers sold_out when every packet was claimed and ended when its
-- time ran out.
--
-- The fence: a Redis that comes back older than it was (a failover to a lagging
-- replica, an AOF everysec crash, a restored backup) holds a claimed_count below what
-- was already acknowledged, or an epoch below the one the caller knows. Granting from
-- it would hand out again packets that were granted. So a watermark above the count,
-- or an epoch above Redis's, fences the activity: the "fenced" field is written and
-- every later grab answers fenced, until an operator accepts the state as it is.
-- Every other read and check comes before the first write. Amounts travel as the
-- decimal strings they were seeded as, never through a Lua number.
local user = ARGV[1]

local prev = redis.call('HGET', KEYS[3], user)
if prev then
  -- "<packetId>:<amount>:<stream entry id>"
  local sep = string.find(prev, ':', 1, true)
  local sep2 = string.find(prev, ':', sep + 1, true)
  return {'already_claimed', string.sub(prev, 1, sep - 1), tonumber(string.sub(prev, sep + 1, sep2 - 1))}
end

local m = redis.call('HMGET', KEYS[1], 'state', 'paused', 'start_ms', 'end_ms', 'close_reason',
  'fenced', 'claimed_count', 'epoch', 'currency')
local state = m[1]
if not state then
  return {'missing', '', 0}
end
if m[6] then
  return {'fenced', '', 0}
end
local epoch = tonumber(m[8]) or 0
local seenEpoch = tonumber(ARGV[3]) or 0
if seenEpoch > epoch or (seenEpoch == epoch and (tonumber(m[7]) or 0) < (tonumber(ARGV[2]) or 0)) then
  redis.call('HSET', KEYS[1], 'fenced', 'rolled_back')
  return {'fenced', '', 0}
end
if state == 'closed' then
  if m[5] == 'exhausted' then
    return {'sold_out', '', 0}
  end
  return {'ended', '', 0}
end
if state ~= 'open' then
  return {'not_started', '', 0}
end
if m[2] == '1' then
  return {'paused', '', 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local startMs = tonumber(m[3]) or 0
local endMs = tonumber(m[4]) or 0
if now < startMs then
  return {'not_started', '', 0}
end
if endMs > 0 and now >= endMs then
  return {'ended', '', 0}
end

local packet = redis.call('LPOP', KEYS[2])
if not packet then
  return {'sold_out', '', 0}
end
local sep = string.find(packet, ':', 1, true)
local id = string.sub(packet, 1, sep - 1)
local amount = string.sub(packet, sep + 1)

-- The claim names its settlement entry, so settlement can tell the one entry this
-- grant wrote from any copy appended later.
local entry = redis.call('XADD', KEYS[4], '*', 'kind', 'grant', 'packet', id, 'user', user,
  'amount', amount, 'currency', m[9] or '', 'at', string.format('%d', now))
redis.call('HSET', KEYS[3], user, packet .. ':' .. entry)
local claimed = redis.call('HINCRBY', KEYS[1], 'claimed_count', 1)
redis.call('HINCRBY', KEYS[1], 'claimed_amount', amount)
return {'granted', id, tonumber(amount), claimed, epoch}
