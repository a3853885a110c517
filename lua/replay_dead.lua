-- replay_dead: move dead-lettered entries back into the settlement stream, oldest first.
-- KEYS[1] meta, KEYS[2] stream, KEYS[3] dead-letter stream
-- ARGV[1] how many entries to move at most (>= 1)
-- Each moved entry is appended to the stream as a new entry with its original fields
-- (kind, packet, user, amount, at; the dead letter's own "entry" and "error" fields
-- are dropped), deleted from the dead-letter stream, and dead_count goes down by one,
-- all in one step, so the consumer group delivers it again.
-- Returns the number of entries moved.
local entries = redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', ARGV[1])
for _, e in ipairs(entries) do
  local f = e[2]
  local out = {}
  for i = 1, #f, 2 do
    if f[i] ~= 'entry' and f[i] ~= 'error' then
      out[#out + 1] = f[i]
      out[#out + 1] = f[i + 1]
    end
  end
  if #out == 0 then
    -- A dead letter without payload still goes back, so it is not stuck here forever.
    out = {'entry', e[1]}
  end
  redis.call('XADD', KEYS[2], '*', unpack(out))
  redis.call('XDEL', KEYS[3], e[1])
end
if #entries > 0 then
  redis.call('HINCRBY', KEYS[1], 'dead_count', -#entries)
end
return #entries
