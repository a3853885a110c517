-- grab: decide one claim atomically.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] claims, KEYS[4] stream
-- ARGV[1] user id
-- ARGV[2] watermark: the claimed count this Redis has already been seen to reach
--         (0 = none), ARGV[3] the epoch that watermark was seen in (0 before any
--         accepted rollback); without ARGV[2] nothing is checked
-- ARGV[4] optional, with ARGV[2]: the transfer mark, the highest transfer_seq this
--         shard has been seen to reach in that epoch (see the fence, below)
-- Returns, for a grant, one string:
-- "<packetId>:<amount>@<countBefore>:<amountBefore>:<epoch>:<currency>", the packet as
-- it was listed (what was claimed from its list before it: the count this grant
-- raised is countBefore + 1, the caller's next watermark with the epoch) and the
-- currency. Any other outcome is a list: {'already_claimed',
-- '<packetId>:<amount>:<entryId>'} (the user's claim as stored) or {outcome} for
-- sold_out, not_started, ended, paused, missing and fenced. lua.GrabAbove splits the
-- strings: a grant costs the server no reply list, no number written as text and no
-- more string work than it must do. A closed activity answers sold_out when every
-- packet was claimed and ended when its time ran out.
--
-- A grant is five commands on the gate's path: HGET claims, HGET gate, LPOP, XADD,
-- HSET claims, and HGET transfer_seq when a transfer mark is sent (ARGV[4]). No
-- counter is read or raised: the popped packet carries the claimed count and amount
-- (see the packets, below).
--
-- The gate: the meta field "gate" says in one read what the grab of an open
-- activity needs: "<epoch>:<currency>" while the activity is plainly open (state
-- open, not paused, not fenced) without a window, "w<start_ms>:<end_ms>:<epoch>:<currency>"
-- with one, and "-" otherwise. Every script that changes the state, the pause flag,
-- the window, the fence, the epoch or the currency sets it to "-" in the same step
-- (configure, close, fence, accept, and this script when it fences), and this script
-- writes it from the full fields the first time it finds the activity plainly open
-- again. A gate that is "-" or absent (an activity written before the gate existed)
-- takes the slow path, which reads every field and answers as before. seed_commit
-- writes the gate and the epoch first, so the meta hash finds them without walking
-- its other fields. TIME is read only when there is a window.
--
-- The fence: a Redis that comes back older than it was (a failover to a lagging
-- replica, an AOF everysec crash, a restored backup) holds fewer claims than were
-- already acknowledged, or an epoch below the one the caller knows. Granting from it
-- would hand out again packets that were granted. So a watermark above the claimed
-- count, or an epoch above Redis's, fences the activity: the "fenced" field is
-- written and every later grab answers fenced, until an operator accepts the state
-- as it is. The claimed count is the length of the claims hash, which holds one
-- field per grant and nothing else; on the gate's path it is read from the popped
-- packet, which carries it in every state Redis can come back in (a restored Redis
-- is one consistent earlier moment: its claims and its list together), and a
-- packet popped from a Redis behind the watermark is pushed back before the fence is
-- written. A claims hash lost on its own, with the list kept, is no such moment:
-- lua.ShardsView.ClaimsLost (claimed + listed = count), read by the grab service's
-- reporter at every report and by the controller at every resync, fences it.
--
-- The claimed count does not see transfers between shards: a shard that comes back
-- from before a transfer_out holds every claim it held, and lists again the packets
-- that left it, which its sibling holds too. Every transfer step raises the shard's
-- transfer_seq (transfer_out.lua), so a caller that saw the shard reach a sequence
-- sends it as ARGV[4], and a shard below it is fenced before its next grant. The
-- sequence is read only when a mark is sent (a sharded activity after its first
-- transfer): one HGET, on no other grab.
--
-- Every other read and check comes before the first write, but for that push back
-- (the gate's rewrite only caches what the fields say). The settlement entry packs
-- the grant into one field, "grant" = "<packetId>:<amount>:<epoch>:<currency>:<userId>"
-- (the user id last, as it may hold ':'); its time is the entry id's, the Redis clock
-- in milliseconds. Amounts travel as the decimal strings they were seeded as, never
-- through a Lua number.
--
-- Bounded work: whoever calls it (an activity's own Redis user may FCALL it with any
-- arguments, and write its keys with anything), one call runs the fixed commands
-- above, on strings of at most 1024 bytes of user id and 20 of watermark (longer ones
-- are refused before anything is read). What it reads of the activity's keys is
-- checked before the first write, and refused whole when it is not what the
-- operator's scripts write: a claim or a gate of more than 256 bytes, meta fields
-- longer than the numbers and currency they hold, and a listed
-- packet that is not "<id>:<amount>@<n>:<amount>" of at most 256 bytes, which is
-- pushed back where it was. A value is read whole before it is checked, so one value
-- the tenant wrote costs about what its own HGET or LPOP of it costs
-- (docs/operations.md, "Who can do what").
local user, meta, claims = ARGV[1], KEYS[1], KEYS[3]
if #user > 1024 then
  return redis.error_reply('ERR user id of ' .. #user .. ' bytes, at most 1024')
end
for i = 2, 4 do
  if ARGV[i] and #ARGV[i] > 20 then
    return redis.error_reply('ERR watermark argument ' .. i .. ' of ' .. #ARGV[i] .. ' bytes, at most 20')
  end
end

local prev = redis.call('HGET', claims, user)
if prev then
  if #prev > 256 then
    return redis.error_reply('ERR claim of ' .. #prev .. ' bytes in ' .. claims .. ', at most 256')
  end
  return {'already_claimed', prev}
end

-- tail is "<epoch>:<currency>"; startMs is set when there is a window.
local gate = redis.call('HGET', meta, 'gate')
if gate and #gate > 256 then
  return redis.error_reply('ERR gate of ' .. #gate .. ' bytes in ' .. meta .. ', at most 256')
end
local tail, startMs, endMs, s
if gate and gate ~= '-' then
  if string.byte(gate) == 119 then -- 'w'
    local a = string.find(gate, ':', 2, true)
    local b = string.find(gate, ':', a + 1, true)
    startMs, endMs = tonumber(string.sub(gate, 2, a - 1)), tonumber(string.sub(gate, a + 1, b - 1))
    tail = string.sub(gate, b + 1)
  else
    tail = gate
  end
else
  s = redis.call('HMGET', meta, 'state', 'paused', 'start_ms', 'end_ms', 'close_reason', 'fenced',
    'epoch', 'currency')
  if not s[1] then
    return {'missing'}
  end
  if s[6] then
    return {'fenced'}
  end
  for i = 3, 8 do
    if s[i] and #s[i] > 32 then
      return redis.error_reply('ERR meta field of ' .. #s[i] .. ' bytes in ' .. meta .. ', at most 32')
    end
  end
  tail = (s[7] or '0') .. ':' .. (s[8] or '')
end

-- The watermark. A later epoch than Redis's fences now. Within the epoch, the claimed
-- count is compared with it: on the slow path (every answer but a grant of an open
-- activity is decided there) now, with HLEN; on the gate's path after the pop, with
-- the count the popped packet carries, which is the claims hash's length in any state
-- Redis can come back in (see below).
local mark, markN = ARGV[2], nil
if mark then
  -- The epochs are compared as text first (tail starts "<epoch>:"): no number is read
  -- unless they differ.
  local seen, behind = ARGV[3] or '0', false
  if string.find(tail, seen, 1, true) ~= 1 or string.byte(tail, #seen + 1) ~= 58 then -- ':'
    behind = (tonumber(seen) or 0) > tonumber(string.match(tail, '^%d+'))
  else
    if ARGV[4] then
      behind = (tonumber(redis.call('HGET', meta, 'transfer_seq')) or 0) < tonumber(ARGV[4])
    end
    if not behind and mark ~= '0' then
      markN = tonumber(mark) or 0
      if s then
        behind = redis.call('HLEN', claims) < markN
        markN = nil
      end
    end
  end
  if behind then
    redis.call('HSET', meta, 'fenced', 'rolled_back', 'gate', '-')
    return {'fenced'}
  end
end

if s then
  if s[1] == 'closed' then
    if s[5] == 'exhausted' then
      return {'sold_out'}
    end
    return {'ended'}
  end
  if s[1] ~= 'open' then
    return {'not_started'}
  end
  if s[2] == '1' then
    return {'paused'}
  end
  startMs, endMs = tonumber(s[3]) or 0, tonumber(s[4]) or 0
  if startMs == 0 and endMs == 0 then
    startMs = nil
    redis.call('HSET', meta, 'gate', tail)
  else
    redis.call('HSET', meta, 'gate', string.format('w%d:%d:', startMs, endMs) .. tail)
  end
end

if startMs then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if now < startMs then
    return {'not_started'}
  end
  if endMs > 0 and now >= endMs then
    return {'ended'}
  end
end

local listed = redis.call('LPOP', KEYS[2])
if not listed then
  return {'sold_out'}
end
-- A packet is listed as "<packetId>:<amount>@<countBefore>:<amountBefore>": what was
-- claimed from this list before it, in packets and in money. The seeder numbers the
-- list from 0, transfers take from its tail and append numbered on from the meta
-- count and total (transfer_out.lua, transfer_in.lua), and every pop from the head is
-- one claim, so the head's numbers are the claims hash's length and the claimed
-- amount: no counter is read or raised here (snapshot.lua).
if #listed > 256 or not string.find(listed, '^[^@]+@%d+:%d+$') then
  -- Not a packet the operator's scripts list: only the tenant's own writes make one.
  redis.call('LPUSH', KEYS[2], listed)
  return redis.error_reply('ERR the head of ' .. KEYS[2] .. ' is not a listed packet (' .. #listed .. ' bytes)')
end
local at = string.find(listed, '@', 1, true)
local packet, n = string.sub(listed, 1, at - 1), nil
if markN then
  n = tonumber(string.sub(listed, at + 1, string.find(listed, ':', at + 1, true) - 1))
end
if markN and n < markN then
  -- Rolled back: the packet goes back where it was, and nothing else was written.
  redis.call('LPUSH', KEYS[2], listed)
  redis.call('HSET', meta, 'fenced', 'rolled_back', 'gate', '-')
  return {'fenced'}
end
-- The claim names its settlement entry, so settlement can tell the one entry this
-- grant wrote from any copy appended later.
local entry = redis.call('XADD', KEYS[4], '*', 'grant', packet .. ':' .. tail .. ':' .. user)
redis.call('HSET', claims, user, packet .. ':' .. entry)
return listed .. ':' .. tail