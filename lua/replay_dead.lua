-- replay_dead: move dead-lettered entries back into the settlement stream, oldest first.
-- KEYS[1] meta, KEYS[2] stream, KEYS[3] dead-letter stream, KEYS[4] claims
-- ARGV[1] how many entries to move at most (>= 1)
-- Each moved entry is appended to the stream as a new entry with its original fields
-- (a grant's packed "grant" field, or kind, packet, user, amount, currency, at; the
-- dead letter's own "entry" and "error" fields are dropped), deleted from the
-- dead-letter stream, and dead_count goes down by one, all in one step, so the
-- consumer group delivers it again. A packed grant takes its time from its entry id,
-- so the moved copy gets an "at" field with the original entry's time. A grant's
-- claim names the stream entry its grant wrote; when the claim names the
-- dead-lettered entry, it is moved to the new one, so settlement still finds the
-- grant genuine. A claim that names another entry is left alone: a forged entry
-- stays forged when replayed. Only a packed grant is a grant (see grab.lua); a refund
-- names no claim.
-- Returns the number of entries moved.
-- Only the operator replays (docs/operations.md, "Who can do what"): the dead-letter
-- stream is read-only to a tenant's Redis user (%R~ in its ACL rules), and Redis
-- refuses an FCALL that declares a key the caller may not write before the function
-- runs, so no entry a tenant wrote is ever replayed and a tenant cannot run this.
-- Bounded work: at most 500 entries move per call, whatever ARGV[1] asks (the Go
-- side loops); each entry costs its fields, at most 64 pairs for a dead letter that
-- dead_letter.lua parked, and only the operator's dead_letter.lua writes the stream.
-- The keys must be one shard's: <tag>:meta, <tag>:stream, <tag>:dead and
-- <tag>:claims (a budget shard's <tag>:noclaims), so that no other stream is taken
-- for the dead letters; anything else is refused before anything is read.
local prefix = string.sub(KEYS[1], 1, -5)
if string.sub(KEYS[1], -4) ~= 'meta' or KEYS[2] ~= prefix .. 'stream' or KEYS[3] ~= prefix .. 'dead' or
    (KEYS[4] ~= prefix .. 'claims' and KEYS[4] ~= prefix .. 'noclaims') then
  return redis.error_reply('ERR keys are not one shard\'s meta, stream, dead letters and claims')
end
local limit = math.min(tonumber(ARGV[1]) or 0, 500)
if limit < 1 then
  return redis.error_reply('ERR replay limit ' .. tostring(ARGV[1]) .. ', want 1 to 500')
end
local entries = redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', limit)
for _, e in ipairs(entries) do
  local f = e[2]
  local out = {}
  local original, kind, packet, user, amount, at, packed
  for i = 1, #f, 2 do
    local name, value = f[i], f[i + 1]
    if name == 'entry' then
      original = value
    elseif name ~= 'error' then
      out[#out + 1] = name
      out[#out + 1] = value
      if name == 'grant' then
        packed = true
        -- "<packetId>:<amount>:<epoch>:<currency>:<userId>"
        local a = string.find(value, ':', 1, true)
        local b = a and string.find(value, ':', a + 1, true)
        local c = b and string.find(value, ':', b + 1, true)
        local d = c and string.find(value, ':', c + 1, true)
        if d then
          kind = 'grant'
          packet = string.sub(value, 1, a - 1)
          amount = string.sub(value, a + 1, b - 1)
          user = string.sub(value, d + 1)
        end
      elseif name == 'at' then at = value
      end
    end
  end
  if #out == 0 then
    -- A dead letter without payload still goes back, so it is not stuck here forever.
    out = {'entry', e[1]}
  elseif packed and not at and original then
    local ms = string.match(original, '^(%d+)')
    if ms then
      out[#out + 1] = 'at'
      out[#out + 1] = ms
    end
  end
  local id = redis.call('XADD', KEYS[2], '*', unpack(out))
  if kind == 'grant' and original and packet and user and amount then
    local claim = packet .. ':' .. amount .. ':'
    if redis.call('HGET', KEYS[4], user) == claim .. original then
      redis.call('HSET', KEYS[4], user, claim .. id)
    end
  end
  redis.call('XDEL', KEYS[3], e[1])
end
if #entries > 0 then
  redis.call('HINCRBY', KEYS[1], 'dead_count', -#entries)
end
return #entries
