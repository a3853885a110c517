-- dead_letter: park a stream entry that could not be delivered, once.
-- KEYS[1] meta, KEYS[2] stream, KEYS[3] dead-letter stream
-- ARGV[1] consumer group, ARGV[2] entry id, ARGV[3] last error,
-- ARGV[4..] the entry's field/value pairs
-- Returns 1 when this call parked the entry, 0 when it had been acknowledged before,
-- or when the activity was purged (its unsettled streams kept for retention): then
-- nothing is written, so no key of a deleted activity comes back without a TTL; the
-- entry stays in the retained stream.
-- Bounded work: at most 64 field/value pairs (ARGV[4..131]); a call with more is
-- refused before anything is written (the Go side keeps the first 64 by name).
if #ARGV > 131 then
  return redis.error_reply('ERR ' .. (#ARGV - 3) .. ' field values, at most 128')
end
if redis.call('HEXISTS', KEYS[1], 'state') == 0 then
  return 0
end
local n = redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
if n == 1 then
  redis.call('XADD', KEYS[3], '*', 'entry', ARGV[2], 'error', ARGV[3], unpack(ARGV, 4))
  redis.call('HINCRBY', KEYS[1], 'dead_count', 1)
end
return n
